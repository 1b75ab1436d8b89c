"""Demo section: a multi-turn session with a retried turn that branches, then its exports."""

from __future__ import annotations

from ..errors import NodeConflict, PromptMismatch
from ..store import TraceStore

TITLE = "Prefix traces: four turns, a retried turn that branches, training exports"


def _render(messages: list[tuple[str, str]], *, generation_prompt: bool) -> str:
    """A toy chat template (what the session server renders before each request)."""
    text = "".join(f"<|{role}|>{content}<|end|>" for role, content in messages)
    return text + ("<|assistant|>" if generation_prompt else "")


def _tokenize(text: str) -> list[int]:
    """A toy tokenizer: one token per character (the engine's ids in real use)."""
    return [ord(c) for c in text]


def run(store: TraceStore) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    sid = "chat-1"
    messages: list[tuple[str, str]] = [("system", "You are a calculator.")]
    version = 7

    def turn(user: str, answer: str, *, retry: bool = False) -> str:
        """One request as a session server makes it: lookup, send, record."""
        if not retry:
            messages.append(("user", user))
        prompt = _render(messages, generation_prompt=True)
        match = store.lookup(sid, prompt)  # before the request: reuse the stored prefix
        delta = _tokenize(prompt[match.text_len :])
        response = answer + "<|end|>"
        out_ids = _tokenize(response)
        t = store.record_turn(  # after it: delta + response nodes, one atomic script
            sid,
            prompt,
            response,
            prefix=match,
            delta_token_ids=delta,
            response_token_ids=out_ids,
            response_logprobs=[-0.25] * len(out_ids),
            version=version,
        )
        rows.append(
            (
                f"turn: {user or '(retry)'} -> {answer}",
                f"prompt {len(prompt)} chars, {match.text_len} reused; "
                f"sent {len(delta)} delta + {len(out_ids)} response tokens; "
                f"{t.written} new node(s)",
            )
        )
        return prompt + response

    turn("What is 2+2?", "4")
    messages.append(("assistant", "4"))
    turn("And 3*3?", "9")
    messages.append(("assistant", "9"))
    first = turn("Now 12/4?", "4")  # a wrong answer the rollout resamples
    version += 1  # the weights changed before the retry
    retried = turn("", "3", retry=True)  # same prompt: empty delta, a sibling response node
    messages.append(("assistant", "3"))
    final = turn("Thanks!", "You're welcome.")

    for name, key in (("first attempt", first), ("retried branch", final)):
        tr = store.export_training_trace(sid, key)
        generated = sum(1 for x in tr.labels if x != -100)
        rows.append(
            (
                f"export {name}",
                f"{len(tr.input_ids)} tokens ({generated} trained), {len(tr.nodes)} nodes, "
                f"versions {tr.min_version}..{max(tr.versions)}",
            )
        )
    shared = store.export_training_trace(sid, retried)
    rows.append(
        ("branches share their prefix", f"{len(shared.nodes) - 1} common nodes stored once")
    )

    try:
        store.export_training_trace(sid, final.replace("Thanks!", "Thanks?"))
    except PromptMismatch as exc:
        rows.append(("export of a prompt never stored", f"PromptMismatch: {exc.window}"))
    try:
        store.record_turn(
            sid,
            first[: -len("4<|end|>")],
            "4<|end|>",
            prefix=store.lookup(sid, first[: -len("4<|end|>")]),
            delta_token_ids=[],
            response_token_ids=_tokenize("4<|end|>"),
            response_logprobs=[-9.0] * len("4<|end|>"),
            version=version,
        )
    except NodeConflict as exc:
        rows.append(
            (
                "rewrite a node with other logprobs",
                f"NodeConflict, nothing written ({exc.digest[:8]}...)",
            )
        )

    r = store.redis
    k = store.keys
    nodes = r.hlen(k.idx(sid)) - 2  # minus the epoch and version fields
    mem = sum(int(r.memory_usage(key) or 0) for key in k.data_keys(sid))
    rows.append(("session keys", f"{k.idx(sid)} ({nodes} nodes), :tok, :txt; {mem} bytes in Redis"))
    return rows
