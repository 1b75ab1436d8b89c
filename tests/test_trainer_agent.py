"""The calculator agent apart from the model, and the Sample that crosses actors (no Ray, no server).

``play`` is driven here by a scripted model (a list of replies): the episode
logic (tool calls, conversation, reward, statuses, continuing an aborted
sample) is the agent's alone, whatever carries a turn to the model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator

import pytest

from tracestore import TraceStore
from tracestore.trainer.agent import NoReply, Outcome, Reply, TurnRequest, drive, drive_many, play
from tracestore.trainer.chat import render
from tracestore.trainer.sample import Sample, from_payload, group_status, to_payload
from tracestore.trainer.task import Problem


def _model(outcomes: list[Outcome], seen: list[TurnRequest]) -> Callable[[TurnRequest], Outcome]:
    it: Iterator[Outcome] = iter(outcomes)

    def turn(req: TurnRequest) -> Outcome:
        seen.append(TurnRequest(req.sid, [dict(m) for m in req.messages]))
        return next(it)

    return turn


def _sample() -> Sample:
    return Sample.new("s-1", Problem("p1", start=4, target=7), max_calls=3)


def test_an_episode_calls_the_tool_then_ends_with_the_reward() -> None:
    seen: list[TurnRequest] = []
    model = _model([Reply("add 3", True, 5), Reply("done", True, 6)], seen)
    out = drive(play(_sample(), max_calls=3), model)
    assert out.status == "completed" and out.done and out.finish == "done"
    assert out.reward == 1.0 and out.value == 7 and out.calls == 1 and out.turns == 2
    assert out.versions == (5, 6)
    assert [m["role"] for m in out.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert out.messages[3] == {"role": "tool", "content": "= 7"}
    # the model saw the conversation up to the turn it answers, in the session of the sample
    assert [len(r.messages) for r in seen] == [2, 4] and {r.sid for r in seen} == {"s-1"}
    # the trace key is the conversation up to the last answer
    assert out.final_key() == render(out.messages, False).rstrip()
    assert out.final_key().endswith("done<|im_end|>")


def test_an_aborted_turn_is_continued_later_from_where_it_stopped() -> None:
    seen: list[TurnRequest] = []
    first = drive(play(_sample(), 3), _model([Reply("add 3", True, 1), NoReply("aborted")], seen))
    assert first.status == "aborted" and not first.done and first.reward == 0.0
    assert first.turns == 1 and first.versions == (1,) and len(first.messages) == 4
    # through the buffer's JSON and back, then continued after the weight update
    again = Sample.from_json(json.loads(json.dumps(first.to_json())))
    assert again == first
    done = drive(play(again, 3), _model([Reply("done", True, 2)], seen))
    assert done.status == "completed" and done.reward == 1.0 and done.versions == (1, 2)
    assert done.turns == 2 and done.error is None


def test_a_failed_turn_fails_the_sample_and_a_finished_one_is_left_alone() -> None:
    failed = drive(play(_sample(), 3), _model([NoReply("failed", "OSError: gone")], []))
    assert failed.status == "failed" and failed.error == "OSError: gone" and failed.turns == 0
    truncated = drive(play(_sample(), 3), _model([Reply("add", False, 0)], []))
    assert truncated.status == "completed" and truncated.finish == "length"
    assert truncated.reward == 0.0  # an invalid episode scores 0
    seen: list[TurnRequest] = []
    assert drive(play(truncated, 3), _model([], seen)) == truncated
    assert seen == []


def test_group_status_priority_and_payload_round_trip() -> None:
    s = _sample()
    ok = [
        Sample.from_json({**s.to_json(), "status": "completed", "reward": r, "versions": [v]})
        for r, v in ((1.0, 3), (0.2, 2))
    ]
    assert group_status(ok) == "completed"
    same = [ok[0], ok[0]]
    assert group_status(same) == "filtered"  # no reward spread: nothing to learn
    aborted = [ok[0], Sample.from_json({**s.to_json(), "status": "aborted"})]
    assert group_status(aborted) == "aborted"
    failed = [*aborted, Sample.from_json({**s.to_json(), "status": "failed"})]
    assert group_status(failed) == "failed"
    payload = json.loads(json.dumps(to_payload(ok)))
    assert from_payload(payload) == ok
    with pytest.raises(ValueError, match="unknown sample status"):
        Sample.from_json({**s.to_json(), "status": "lost"})


def test_drive_many_serves_turns_in_rounds_with_the_same_episodes() -> None:
    """Each round asks the model once, for the next turn of every agent still running;
    each episode is the one drive() plays with the same replies."""
    script: dict[str, list[Outcome]] = {
        "a": [Reply("add 3", True, 1), Reply("done", True, 1)],
        "b": [Reply("done", True, 1)],
        "c": [Reply("add 1", True, 1), NoReply("aborted")],
        "d": [Reply("add 1", True, 1), Reply("add 1", True, 2), Reply("add 1", True, 2), Reply("done", True, 3)],
    }
    samples = [Sample.new(f"s-{k}", Problem("p1", start=4, target=7), max_calls=3) for k in script]
    rounds: list[list[str]] = []
    pos = dict.fromkeys(script, 0)

    def model(reqs: list[TurnRequest]) -> list[Outcome]:
        rounds.append([r.sid for r in reqs])
        out = []
        for r in reqs:
            k = r.sid[-1]
            out.append(script[k][pos[k]])
            pos[k] += 1
        return out

    many = drive_many([play(s, 3) for s in samples], model)
    assert rounds == [["s-a", "s-b", "s-c", "s-d"], ["s-a", "s-c", "s-d"], ["s-d"], ["s-d"]]
    one = [drive(play(s, 3), _model(list(script[s.sid[-1]]), [])) for s in samples]
    assert many == one
    assert [s.status for s in many] == ["completed", "completed", "aborted", "completed"]
    assert drive_many([], model) == [] and drive_many([play(many[0], 3)], model) == [many[0]]


def test_export_of_an_unrecorded_conversation_fails_and_logs_both_texts(
    store: TraceStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A sample whose conversation is no stored key fails the step (no other path is trained in
    its place); the learner's log has the sample's key and the session's stored keys."""
    import random

    from tests.test_ownership import prompt_of, response_of, write_turn
    from tracestore import PromptMismatch
    from tracestore.trainer.batch import BatchBuilder
    from tracestore.trainer.clock import Stopwatch
    from tracestore.trainer.task import make_problem

    write_turn(store, "s")
    builder = BatchBuilder(store, None, Stopwatch())  # type: ignore[arg-type]  # _export uses no pool
    bad = Sample.new("s", make_problem(random.Random(0), "p0"), 4)
    assert not bad.final_key().startswith(prompt_of("s"))  # its messages were never recorded
    fresh = Sample.new("t", make_problem(random.Random(0), "p0"), 4)
    ok = dataclasses.replace(fresh, messages=(*fresh.messages, {"role": "assistant", "content": "done"}))
    prompt = render(fresh.messages, True)
    m = store.lookup("t", prompt)
    store.record_turn("t", prompt, "done<|im_end|>", prefix=m, delta_token_ids=[1, 2], response_token_ids=[3, 4],
                      response_logprobs=[-0.5, -0.5], version=1)
    (tr,) = builder._export([ok])  # a recorded conversation exports
    assert list(tr.input_ids) == [1, 2, 3, 4]
    with caplog.at_level("ERROR", logger="tracestore.trainer.batch"), pytest.raises(PromptMismatch, match="'s'"):
        builder._export([ok, bad])
    (rec,) = caplog.records  # only the unrecorded one is reported, with both texts
    assert repr(bad.final_key()) in rec.getMessage()
    assert repr([prompt_of("s"), prompt_of("s") + response_of("s")]) in rec.getMessage()
    assert "'t'" not in rec.getMessage()
