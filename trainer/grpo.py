"""GRPO-style objective: group-relative advantages and a clipped token-level loss.

A training sample is one exported trace (every turn of a session): its
``input_ids``, ``labels`` (-100 on prompt and tool tokens), the rollout
``logprobs`` (the old policy) and the routed experts to replay. The sample's
advantage (its reward relative to its group of samples of the same prompt)
weights every generated token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .policy import MoEPolicy, replay_logprobs

IGNORE = -100


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """``(r - mean) / (std + eps)`` within one group; all zeros when the rewards are equal."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    std = math.sqrt(var)
    if std < eps:
        return [0.0 for _ in rewards]
    return [(r - mean) / (std + eps) for r in rewards]


@dataclass(frozen=True)
class TrainSample:
    """One trace ready for the learner (arrays are 1-D over tokens, routing [T-1, L, k])."""

    input_ids: np.ndarray
    labels: np.ndarray
    logprobs: np.ndarray
    routing: np.ndarray | None
    advantage: float


@dataclass(frozen=True)
class Batch:
    """Padded tensors of a list of samples (shifted: position i predicts token i + 1)."""

    input_ids: Tensor  # [B, T] long
    mask: Tensor  # [B, T-1] float, 1 on generated tokens
    old_logprobs: Tensor  # [B, T-1]
    routing: Tensor | None  # [B, T-1, L, k] long
    advantages: Tensor  # [B]


def collate(samples: Sequence[TrainSample], pad_id: int) -> Batch:
    """Right-pad samples into a :class:`Batch` (routing replayed only if every sample has it)."""
    if not samples:
        raise ValueError("empty batch")
    t = max(len(s.input_ids) for s in samples)
    b = len(samples)
    ids = np.full((b, t), pad_id, dtype=np.int64)
    mask = np.zeros((b, t - 1), dtype=np.float32)
    old = np.zeros((b, t - 1), dtype=np.float32)
    have_routing = all(s.routing is not None for s in samples)
    routing = None
    if have_routing:
        first = samples[0].routing
        assert first is not None
        routing = np.zeros((b, t - 1, *first.shape[1:]), dtype=np.int64)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = s.input_ids
        mask[i, : n - 1] = (s.labels[1:] != IGNORE).astype(np.float32)
        old[i, : n - 1] = s.logprobs[1:]
        if routing is not None and s.routing is not None:
            if s.routing.shape[0] != n - 1:
                raise ValueError(
                    f"routing has {s.routing.shape[0]} rows for {n} tokens (want {n - 1})"
                )
            routing[i, : n - 1] = s.routing
    return Batch(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.from_numpy(old),
        None if routing is None else torch.from_numpy(routing),
        torch.tensor([s.advantage for s in samples], dtype=torch.float32),
    )


def grpo_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate ``-min(ratio * A, clip(ratio) * A)``, averaged over generated tokens.

    Returns the loss and stats: the clipped fraction, the mean ratio and the
    approximate KL ``mean(old - new)`` to the rollout policy.
    """
    ratio = torch.exp(new_logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    denom = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        clip_frac = ((clipped < unclipped - 1e-9).float() * mask).sum() / denom  # clip active
        kl = ((old_logprobs - new_logprobs) * mask).sum() / denom
        mean_ratio = (ratio * mask).sum() / denom
    return loss, {"clip_frac": float(clip_frac), "approx_kl": float(kl), "ratio": float(mean_ratio)}


def train_step(
    model: MoEPolicy,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    pad_id: int,
    *,
    replay_routing: bool = True,
    max_grad_norm: float = 1.0,
) -> dict[str, float]:
    """One optimiser step of the GRPO objective on ``samples`` (routing replayed when present)."""
    batch = collate(samples, pad_id)
    model.train()
    routing = batch.routing if replay_routing else None
    new_lp = replay_logprobs(model, batch.input_ids, routing)
    loss, stats = grpo_loss(new_lp, batch.old_logprobs, batch.advantages, batch.mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    stats.update(
        loss=float(loss.detach()), grad_norm=float(grad_norm), tokens=float(batch.mask.sum())
    )
    return stats
