"""Trainer building blocks: tokenizer, chat template, task reward, MoE policy, GRPO.

Pure torch on CPU with fixed seeds; no server needed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tracestore.trainer.chat import render, render_after_response, strip_stop
from tracestore.trainer.grpo import (
    IGNORE,
    TrainSample,
    collate,
    group_advantages,
    grpo_loss,
    train_step,
)
from tracestore.trainer.policy import new_policy, replay_logprobs, set_determinism
from tracestore.trainer.task import Episode, Problem, make_problem, parse_action, score
from tracestore.trainer.tokenizer import CHARS, SPECIAL_TOKENS, TOKENIZER, WORDS, ToyTokenizer

tok = TOKENIZER


@pytest.fixture(scope="module")
def policy():  # type: ignore[no-untyped-def]
    set_determinism(0)
    return new_policy(tok.vocab_size, seed=0, max_len=256)


# -- tokenizer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "add 3",
        "reach 24 from 5",
        "<|im_start|>assistant\nmul 9<|im_end|>",
        "héllo ∑ 日本 🙂",
        "ADDRESS\t!",
    ],
)
def test_tokenizer_round_trip(text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_round_trip_random_text() -> None:
    rng = random.Random(7)
    alphabet = "add sub mul done 0123456789 <|im_end|> \n\t{}é∑🙂ABCxyz"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert tok.decode(tok.encode(text)) == text


def test_tokenizer_uses_words_and_specials_and_is_deterministic() -> None:
    ids = tok.encode("<|im_start|>user\nadd 7<|im_end|>")
    assert tok.pieces(ids) == ["<|im_start|>", "user", "\n", "add", " ", "7", "<|im_end|>"]
    assert ToyTokenizer().encode("sub 4 done") == tok.encode("sub 4 done")
    assert tok.stop_id == tok.token_id("<|im_end|>")
    assert all(0 <= i < tok.vocab_size for i in tok.encode("∑🙂"))


def _greedy(text: str) -> list[int]:
    """The tokenizer's rule, written plainly: at each position the longest vocabulary piece, else
    the character's UTF-8 bytes (byte ids follow the pieces)."""
    pieces = sorted((*SPECIAL_TOKENS, *WORDS, *CHARS), key=len, reverse=True)
    byte_base = len(SPECIAL_TOKENS) + len(WORDS) + len(CHARS)
    out, i = [], 0
    while i < len(text):
        p = next((p for p in pieces if text.startswith(p, i)), None)
        if p is None:
            out += [byte_base + b for b in text[i].encode("utf-8")]
            i += 1
        else:
            out.append(tok.token_id(p))
            i += len(p)
    return out


def test_tokenizer_is_greedy_longest_match_with_byte_fallback() -> None:
    rng = random.Random(11)
    # whole pieces, their prefixes and overlaps (use/user, <|im_end|> cut short), runs of
    # characters and characters outside the vocabulary
    alphabet = [*SPECIAL_TOKENS, *WORDS, *CHARS, "us", "<|im", "<|", "<pad", "syste", "e", "é", "🙂", "A", "\t", "12 34"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert tok.encode(text) == _greedy(text), text


def test_tokenizer_rejects_ids_outside_vocabulary() -> None:
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


# -- chat template -----------------------------------------------------------------


def test_render_after_response_extends_the_prompt_by_response_and_stop_word() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "reach 5 from 1"}]
    prompt = render(msgs, add_generation_prompt=True)
    after = render_after_response(msgs, {"role": "assistant", "content": "add 4"})
    assert prompt.endswith("<|im_start|>assistant\n")
    assert after == prompt + "add 4<|im_end|>"
    nxt = render(
        [*msgs, {"role": "assistant", "content": "add 4"}, {"role": "tool", "content": "= 5"}], True
    )
    assert nxt.startswith(after)
    assert strip_stop("add 4<|im_end|>") == ("add 4", True)
    assert strip_stop("add 4") == ("add 4", False)


# -- task --------------------------------------------------------------------------


def test_task_reward_is_verifiable() -> None:
    p = Problem("p", start=2, target=9)
    ep = Episode(p)
    assert ep.step("add 3", True) == {"role": "tool", "content": "= 5"}
    assert ep.step("add 4", True) == {"role": "tool", "content": "= 9"}
    assert ep.step("done", True) is None
    assert ep.done and ep.finish == "done" and ep.reward == 1.0

    near = Episode(p)
    near.step("mul 4", True)  # 8: distance 1
    near.step("done", True)
    assert near.reward == pytest.approx(0.45)

    bad = Episode(p)
    assert bad.step("add 12", True) is None  # two-digit operand: malformed
    assert bad.finish == "malformed" and bad.reward == 0.0

    cut = Episode(p)
    assert cut.step("add 7", False) is None  # no stop word: truncated
    assert cut.finish == "length" and cut.reward == 0.0

    greedy = Episode(p, max_calls=1)
    greedy.step("add 7", True)
    assert greedy.step("add 1", True) is None and greedy.finish == "too-many-calls"
    assert greedy.reward == 0.0


def test_task_parse_and_score_edges() -> None:
    assert parse_action(" sub 0 ") == ("sub", 0)
    assert parse_action("div 3") is None
    assert parse_action("done") == ("done", 0)
    assert score(Problem("p", 0, 20), 35, True) == 0.0
    rng = random.Random(3)
    for i in range(200):
        prob = make_problem(rng, str(i))
        assert prob.start != prob.target and 0 <= prob.target <= 99


# -- policy: routing replay ----------------------------------------------------------


def _rollout_turn(model, prompt_ids, seed):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return model.generate(prompt_ids, max_new_tokens=16, stop_id=tok.stop_id, generator=g)


def test_generate_returns_routed_experts_in_engine_layout(policy) -> None:  # type: ignore[no-untyped-def]
    prompt = tok.encode(render([{"role": "user", "content": "reach 7 from 3"}], True))
    gen = _rollout_turn(policy, prompt, 1)
    n = len(prompt) + len(gen.output_ids)
    cfg = policy.cfg
    assert gen.routed_experts.shape == (n, cfg.n_layers, cfg.top_k)
    assert gen.routed_experts.dtype == np.int32
    assert not gen.routed_experts[0].any()  # dummy row
    assert len(gen.logprobs) == len(gen.output_ids) and all(lp <= 0 for lp in gen.logprobs)
    assert (gen.routed_experts >= 0).all() and (gen.routed_experts < cfg.n_experts).all()


def test_routing_replay_reproduces_rollout_logprobs(policy) -> None:  # type: ignore[no-untyped-def]
    """Multi-turn: the experts split per node and concatenated give the training forward's routing."""
    msgs = [{"role": "system", "content": "use add"}, {"role": "user", "content": "reach 7 from 3"}]
    ids: list[int] = []
    labels: list[int] = []
    logprobs: list[float] = []
    expert_parts: list[np.ndarray] = []
    for turn in range(3):
        prompt_text = render(msgs, True)
        delta = tok.encode(prompt_text[len(tok.decode(ids)) :]) if ids else tok.encode(prompt_text)
        gen = _rollout_turn(policy, ids + delta, 10 + turn)
        start = len(ids)
        # the recorder's split: rows of the delta, then of the response
        expert_parts.append(gen.routed_experts[start : start + len(delta)])
        expert_parts.append(gen.routed_experts[start + len(delta) :])
        ids += delta + gen.output_ids
        labels += [IGNORE] * len(delta) + gen.output_ids
        logprobs += [0.0] * len(delta) + gen.logprobs
        content, _ = strip_stop(tok.decode(gen.output_ids))
        msgs += [{"role": "assistant", "content": content}, {"role": "tool", "content": "= 1"}]
    routing = np.concatenate(expert_parts)[1:]  # drop the dummy row
    assert routing.shape[0] == len(ids) - 1
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        replayed = replay_logprobs(
            policy, input_ids, torch.from_numpy(routing.astype(np.int64))[None]
        )
        _, recomputed_routing, _ = policy(input_ids[:, :-1])
    mask = np.array(labels[1:]) != IGNORE
    got = replayed[0].numpy()[mask]
    want = np.array(logprobs[1:])[mask]
    assert mask.sum() > 10
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    # with unchanged weights the recorded routing is what a full forward computes
    assert (recomputed_routing[0].numpy() == routing).all()

    # the check can fail: replaying other experts changes the log-probabilities
    other = (routing + 1) % policy.cfg.n_experts
    with torch.no_grad():
        wrong = replay_logprobs(policy, input_ids, torch.from_numpy(other.astype(np.int64))[None])
    assert np.abs(wrong[0].numpy()[mask] - want).max() > 1e-3


def test_routing_replay_keeps_expert_choice_after_weights_change() -> None:
    set_determinism(1)
    model = new_policy(tok.vocab_size, seed=1, max_len=128)
    ids = tok.encode(render([{"role": "user", "content": "reach 9 from 2"}], True))
    gen = _rollout_turn(model, ids, 3)
    full = torch.tensor([ids + gen.output_ids])
    routing = torch.from_numpy(gen.routed_experts[1:].astype(np.int64))[None]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        _, used, _ = model(full[:, :-1], routing)
        _, fresh, _ = model(full[:, :-1])
    assert torch.equal(used, routing)
    assert not torch.equal(fresh, routing)  # without replay the routing drifts


def test_generation_is_deterministic_for_a_seed(policy) -> None:  # type: ignore[no-untyped-def]
    prompt = tok.encode(render([{"role": "user", "content": "reach 4 from 8"}], True))
    a = _rollout_turn(policy, prompt, 5)
    b = _rollout_turn(policy, prompt, 5)
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    assert (a.routed_experts == b.routed_experts).all()


# -- GRPO ----------------------------------------------------------------------------


def test_group_advantages() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([0.5, 0.5]) == [0.0, 0.0]
    assert sum(group_advantages([0.1, 0.9, 0.4])) == pytest.approx(0.0, abs=1e-9)


def test_grpo_loss_clips_and_masks() -> None:
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.5, -0.5, 9.0]])  # ratios e^.5 (clipped high), e^-.5, masked
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), mask)
    want = -(min(np.exp(0.5), 1.28) + np.exp(-0.5)) / 2
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_train_step_raises_likelihood_of_positive_advantage_samples() -> None:
    set_determinism(2)
    model = new_policy(tok.vocab_size, seed=2, max_len=128)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    prompt = tok.encode(render([{"role": "user", "content": "reach 9 from 2"}], True))
    samples = []
    for seed, adv in ((1, 1.0), (2, -1.0)):
        gen = _rollout_turn(model, prompt, seed)
        ids = np.array(prompt + gen.output_ids)
        labels = np.array([IGNORE] * len(prompt) + gen.output_ids)
        lps = np.array([0.0] * len(prompt) + gen.logprobs, dtype=np.float32)
        samples.append(TrainSample(ids, labels, lps, gen.routed_experts[1:], adv))
    batch = collate(samples, tok.pad_id)

    def seq_logp() -> np.ndarray:
        with torch.no_grad():
            lp = replay_logprobs(model, batch.input_ids, batch.routing)
        return (lp * batch.mask).sum(-1).numpy()

    before = seq_logp()
    for _ in range(3):
        train_step(model, opt, samples, tok.pad_id)
    after = seq_logp()
    assert after[0] > before[0] and after[1] < before[1]


def test_generate_stops_when_aborted(policy) -> None:  # type: ignore[no-untyped-def]
    prompt = tok.encode(render([{"role": "user", "content": "reach 4 from 8"}], True))
    calls = []

    def abort_after_two() -> bool:
        calls.append(1)
        return len(calls) > 2

    g = torch.Generator().manual_seed(5)
    # no token is the stop id here: only the abort can end the request before 16 tokens
    gen = policy.generate(
        prompt, max_new_tokens=16, stop_id=-1, generator=g, should_abort=abort_after_two
    )
    assert gen.finish_reason == "abort"
    assert len(gen.output_ids) == 2 and len(gen.logprobs) == 2
    assert gen.routed_experts.shape[0] == len(prompt) + 2
    never = policy.generate(
        prompt, max_new_tokens=16, stop_id=tok.stop_id, should_abort=lambda: True
    )
    assert never.finish_reason == "abort" and never.output_ids == []
