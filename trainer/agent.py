"""The calculator agent: its conversation, tool calls and reward, apart from how a turn reaches the model.

An episode is written once, as a generator (:func:`play`): each time it needs
the next assistant turn it yields a :class:`TurnRequest` (the session and the
conversation so far) and receives what became of that turn: a :class:`Reply`
(the answer's text, whether the stop word ended it, the weight version that
wrote it) or a :class:`NoReply` (a weight update aborted the turn, or the
request failed). The tool calls, the conversation and the reward stay here.

A driver decides how a turn reaches the model. :func:`drive` calls a plain
function per turn; :func:`drive_many` runs many agents in rounds and asks for
the turns of a round at once: the rollout worker's in-process policy behind
gate leases and a ``TurnRecorder`` (:class:`~tracestore.trainer.rollout.LocalModel`),
which batches the round's store calls. An asyncio
driver can send the same requests to a session gateway over HTTP with the
``openai`` SDK, one task per sample, without touching the episode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Literal

from .sample import Message, Sample


@dataclass(frozen=True)
class TurnRequest:
    """The agent needs the assistant's next turn of ``messages`` in session ``sid``."""

    sid: str
    messages: Sequence[Message]


@dataclass(frozen=True)
class Reply:
    """An assistant turn: ``content`` without the stop word; ``stopped``: the stop word ended it."""

    content: str
    stopped: bool
    version: int


@dataclass(frozen=True)
class NoReply:
    """The turn did not happen: ``aborted`` (redo it after the weight update) or ``failed``."""

    status: Literal["aborted", "failed"]
    error: str | None = None


Outcome = Reply | NoReply
#: An episode in progress: yields turn requests, receives outcomes, returns the sample.
Agent = Generator[TurnRequest, Outcome, Sample]


def play(sample: Sample, max_calls: int) -> Agent:
    """Continue ``sample`` until its episode ends, a turn is aborted or a turn fails.

    A finished sample is returned unchanged. The returned sample carries the
    conversation (with every completed turn), the calculator's state, the
    version of each turn, the reward (0 unless done) and the status.
    """
    if sample.done:
        return sample
    ep = sample.episode(max_calls)
    versions = list(sample.versions)
    stop: NoReply | None = None
    while not ep.done:
        got = yield TurnRequest(sample.sid, ep.messages)
        if isinstance(got, NoReply):
            stop = got
            break
        versions.append(got.version)
        obs = ep.step(got.content, got.stopped)
        ep.messages.append({"role": "assistant", "content": got.content})
        if obs is not None:
            ep.messages.append(obs)
    return dataclasses.replace(
        sample,
        messages=tuple(ep.messages),
        value=ep.value,
        calls=ep.calls,
        turns=ep.turns,
        done=ep.done,
        versions=tuple(versions),
        reward=ep.reward if ep.done else 0.0,
        finish=ep.finish,
        status=stop.status if stop else ("completed" if ep.done else "running"),
        error=stop.error if stop else None,
    )


def drive(agent: Agent, model: Callable[[TurnRequest], Outcome]) -> Sample:
    """Run ``agent`` to its end, asking ``model`` for every turn (the synchronous driver)."""
    try:
        request = next(agent)
        while True:
            request = agent.send(model(request))
    except StopIteration as end:
        sample: Sample = end.value
        return sample


def drive_many(
    agents: Sequence[Agent], model: Callable[[list[TurnRequest]], list[Outcome]]
) -> list[Sample]:
    """Run ``agents`` together, turn by turn; their samples, in order.

    Each round asks ``model`` once for the next turn of every agent still
    running (one request per agent, so per session), so that the model can
    batch what it does per request (the rollout worker's store calls). An
    agent's episode is the same as under :func:`drive`; only the order in
    which the agents' turns are served changes.
    """
    done: dict[int, Sample] = {}
    waiting: dict[int, TurnRequest] = {}
    for i, agent in enumerate(agents):
        try:
            waiting[i] = next(agent)
        except StopIteration as end:
            done[i] = end.value
    while waiting:
        order = list(waiting)
        outcomes = model([waiting[i] for i in order])
        for i, outcome in zip(order, outcomes, strict=True):
            try:
                waiting[i] = agents[i].send(outcome)
            except StopIteration as end:
                done[i] = end.value
                del waiting[i]
    return [done[i] for i in range(len(agents))]
