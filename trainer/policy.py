"""A tiny mixture-of-experts causal language model with routing replay.

Each layer: pre-norm causal self-attention, then a top-k routed MoE feed-forward
block. ``generate`` samples a response with a KV cache and returns, with the
ids and their log-probabilities, the *routed experts* of every token it fed
through the model: an int32 array ``[prompt + output tokens, layers, top_k]``
whose row 0 is a dummy all-zero row and row ``i`` is the routing of the token
at position ``i - 1`` (the layout XTuner's inference engines return). The
training forward :func:`replay_logprobs` takes that routing (dummy row
dropped) and uses it instead of recomputing top-k ("rollout routing replay"):
the gates are still the current router's softmax at the replayed experts, so
the router keeps learning while the expert choice matches the rollout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

KVCache = list[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class PolicyConfig:
    """Model dimensions (defaults are tiny: fast on one CPU core)."""

    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    d_ff: int = 96
    max_len: int = 512

    def to_json(self) -> dict[str, int]:
        """JSON form (checkpoints)."""
        return asdict(self)


@dataclass(frozen=True)
class Generation:
    """Result of :meth:`MoEPolicy.generate` for one request."""

    output_ids: list[int]
    logprobs: list[float]
    routed_experts: np.ndarray  # int32 [len(prompt) + len(output), layers, top_k], row 0 dummy
    finish_reason: str  # "stop", "length" or "abort"


class Attention(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self,
        x: Tensor,
        cache: tuple[Tensor, Tensor] | None,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        past = k.shape[2] - t
        if key_mask is not None:  # one decode step of rows padded to one cache length
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        elif past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif t == 1:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d)), (k, v)


class MoE(nn.Module):
    """Top-k routed experts (dense compute, gathered: simplest exact form at this size)."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        scale = 1.0 / math.sqrt(cfg.d_model)
        self.w1 = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_model, cfg.d_ff) * scale)
        self.b1 = nn.Parameter(torch.zeros(cfg.n_experts, cfg.d_ff))
        self.w2 = nn.Parameter(
            torch.randn(cfg.n_experts, cfg.d_ff, cfg.d_model) / math.sqrt(cfg.d_ff)
        )

    def forward(self, x: Tensor, routing: Tensor | None) -> tuple[Tensor, Tensor]:
        """``x`` [N, d]; ``routing`` [N, k] expert ids to replay, or None to route."""
        logits = self.router(x)
        idx = logits.topk(self.top_k, dim=-1).indices if routing is None else routing
        gates = torch.softmax(logits.gather(-1, idx), dim=-1)
        hidden = F.gelu(torch.einsum("nd,edf->nef", x, self.w1) + self.b1)
        out = torch.einsum("nef,efd->ned", hidden, self.w2)
        chosen = out.gather(1, idx.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        return (chosen * gates.unsqueeze(-1)).sum(dim=1), idx


class Block(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoE(cfg)

    def forward(
        self,
        x: Tensor,
        routing: Tensor | None,
        cache: tuple[Tensor, Tensor] | None,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        a, new_cache = self.attn(self.ln1(x), cache, key_mask)
        x = x + a
        b, t, d = x.shape
        flat_routing = None if routing is None else routing.reshape(b * t, -1)
        m, idx = self.moe(self.ln2(x).reshape(b * t, d), flat_routing)
        return x + m.view(b, t, d), idx.view(b, t, -1), new_cache


class MoEPolicy(nn.Module):
    """The policy: token + position embeddings, MoE blocks, tied-free LM head."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        nn.init.normal_(self.tok.weight, std=0.05)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(
        self,
        ids: Tensor,
        routing: Tensor | None = None,
        cache: KVCache | None = None,
        *,
        positions: Tensor | None = None,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, KVCache]:
        """Logits ``[B, T, V]``, routing used ``[B, T, layers, k]`` and the new KV cache.

        ``routing`` (``[B, T, layers, k]`` long) replays expert choices; ``cache``
        continues a sequence (positions start after the cached length).

        A batch of sequences of different lengths (an engine's decode step,
        ``T == 1``) shares one cache padded to its longest row: ``positions``
        (``[B, T]`` long) gives each row's positions and ``key_mask``
        (``[B, past + T]`` bool) the cached keys each row attends to (False:
        padding). Raises ValueError past ``max_len``, or for a ``key_mask``
        with ``T != 1``.
        """
        b, t = ids.shape
        past = 0 if cache is None else cache[0][0].shape[2]
        if positions is None:
            if past + t > self.cfg.max_len:
                raise ValueError(f"sequence of {past + t} tokens exceeds max_len {self.cfg.max_len}")
            pos = torch.arange(past, past + t)
        else:
            if int(positions.max()) >= self.cfg.max_len:
                raise ValueError(f"position {int(positions.max())} is past max_len {self.cfg.max_len}")
            pos = positions
        if key_mask is not None and t != 1:
            raise ValueError("key_mask is for one decode step (T == 1)")
        x = self.tok(ids) + self.pos(pos)
        used: list[Tensor] = []
        new_cache: KVCache = []
        for i, block in enumerate(self.blocks):
            layer_routing = None if routing is None else routing[:, :, i, :]
            x, idx, kv = block(x, layer_routing, None if cache is None else cache[i], key_mask)
            used.append(idx)
            new_cache.append(kv)
        return self.head(self.ln_f(x)), torch.stack(used, dim=2), new_cache

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        stop_id: int | Collection[int],
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        should_abort: Callable[[], bool] | None = None,
        on_token: Callable[[int, float], bool | None] | None = None,
    ) -> Generation:
        """Sample up to ``max_new_tokens`` ids after ``prompt_ids`` (stops after a stop id).

        ``stop_id``: one id or several (empty: never stop early). Log-probabilities
        are those of the sampling distribution (softmax of logits / temperature);
        ``temperature == 0`` decodes greedily and reports the model's own
        log-probabilities. ``should_abort`` is checked before every token (an
        engine's abort request): when it returns True, generation stops with
        ``finish_reason == "abort"``. ``on_token(id, logprob)`` is called after
        each sampled token (an engine streams it); returning True ends the
        generation there with ``finish_reason == "stop"`` (a stop string
        matched). Raises ValueError when the prompt is empty, the temperature
        negative or the result would not fit ``max_len``.
        """
        if not prompt_ids:
            raise ValueError("empty prompt")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        stops = {stop_id} if isinstance(stop_id, int) else set(stop_id)
        budget = min(max_new_tokens, self.cfg.max_len - len(prompt_ids))
        if budget <= 0:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room (max_len {self.cfg.max_len})"
            )
        was_training = self.training
        self.eval()
        try:
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
            logits, used, cache = self(ids)
            rows = [torch.zeros_like(used[0, :1]), used[0]]
            out_ids: list[int] = []
            out_lp: list[float] = []
            finish = "length"
            for step in range(budget):
                if should_abort is not None and should_abort():
                    finish = "abort"
                    break
                if temperature == 0:
                    logp = torch.log_softmax(logits[0, -1], dim=-1)
                    tok = int(logp.argmax().item())
                else:
                    logp = torch.log_softmax(logits[0, -1] / temperature, dim=-1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=generator).item())
                lp = float(logp[tok].item())
                out_ids.append(tok)
                out_lp.append(lp)
                matched = on_token is not None and bool(on_token(tok, lp))
                if matched or tok in stops:
                    finish = "stop"
                    break
                if step == budget - 1:
                    break
                logits, used, cache = self(torch.tensor([[tok]], dtype=torch.long), cache=cache)
                rows.append(used[0])
            n_rows = len(prompt_ids) + len(out_ids)  # an abort may have fed one more token
            experts = torch.cat(rows, dim=0)[:n_rows].to(torch.int32).numpy()
        finally:
            self.train(was_training)
        return Generation(out_ids, out_lp, experts, finish)


def replay_logprobs(model: MoEPolicy, input_ids: Tensor, routing: Tensor | None) -> Tensor:
    """Log-probability of ``input_ids[:, 1:]`` given their prefixes, ``[B, T - 1]``.

    ``routing`` is ``[B, T - 1, layers, k]`` (the recorded routed experts with
    the dummy row dropped) and is replayed; None recomputes the routing.
    Right padding is harmless: attention is causal.
    """
    logits, _, _ = model(input_ids[:, :-1], routing)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def set_determinism(seed: int, threads: int = 1) -> None:
    """Seed torch and pin the thread count (CPU results then repeat exactly)."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)


def new_policy(vocab_size: int, seed: int, **dims: int) -> MoEPolicy:
    """A freshly initialised policy (same seed, same weights)."""
    torch.manual_seed(seed)
    return MoEPolicy(PolicyConfig(vocab_size=vocab_size, **dims))


def state_to_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """Weights as numpy arrays (cheap to send through Ray; no pickle of torch objects)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_numpy_state(model: nn.Module, state: dict[str, np.ndarray]) -> None:
    """Inverse of :func:`state_to_numpy`."""
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
