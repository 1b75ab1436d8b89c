"""Supervised warm start on the task's format (the "SFT model" RL starts from).

A randomly initialised policy never emits a well-formed tool call, so RL
would see only zero rewards. A few hundred steps of next-token training on
demonstrations with mostly random calls teach the protocol, not the
solution: the reward then has room to improve under RL.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .chat import render, render_after_response
from .grpo import IGNORE
from .policy import MoEPolicy
from .task import Episode, demonstration, make_problem
from .tokenizer import ToyTokenizer


def demo_example(tok: ToyTokenizer, rng: random.Random, pid: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one demonstration, labels only on assistant tokens."""
    ep = Episode(make_problem(rng, pid))
    ids: list[int] = []
    labels: list[int] = []
    text_done = ""
    for content in demonstration(ep.problem, rng):
        prompt = render(ep.messages, add_generation_prompt=True)
        delta = tok.encode(prompt[len(text_done) :])
        ids += delta
        labels += [IGNORE] * len(delta)
        after = render_after_response(ep.messages, {"role": "assistant", "content": content})
        out = tok.encode(after[len(prompt) :])
        ids += out
        labels += out
        text_done = after
        obs = ep.step(content, stopped=True)
        ep.messages.append({"role": "assistant", "content": content})
        if obs is None:
            break
        ep.messages.append(obs)
    return ids, labels


def warm_start(
    model: MoEPolicy,
    tok: ToyTokenizer,
    *,
    steps: int,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
) -> float:
    """Train ``model`` in place on demonstrations; returns the final loss."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        exs = [demo_example(tok, rng, f"w{step}-{i}") for i in range(batch)]
        t = max(len(x[0]) for x in exs)
        ids = np.full((batch, t), tok.pad_id, dtype=np.int64)
        lab = np.full((batch, t), IGNORE, dtype=np.int64)
        for i, (x, y) in enumerate(exs):
            ids[i, : len(x)] = x
            lab[i, : len(y)] = y
        ids_t = torch.from_numpy(ids)
        logits, _, _ = model(ids_t[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            torch.from_numpy(lab[:, 1:]).reshape(-1),
            ignore_index=IGNORE,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value
