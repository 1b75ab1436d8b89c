"""A tiny deterministic tokenizer: special tokens, a few words, characters, byte fallback.

Encoding is greedy longest match over the special tokens and words, then one
token per known character, then UTF-8 byte tokens for anything else, so
``decode(encode(text)) == text`` for every string. Ids are stable (the
vocabulary is a constant), so every actor of a run agrees without sharing files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

PAD = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, IM_START, IM_END)

WORDS: tuple[str, ...] = (
    "system",
    "user",
    "assistant",
    "tool",
    "add",
    "sub",
    "mul",
    "done",
    "reach",
    "from",
    "with",
    "then",
    "error",
    "use",
)

CHARS: str = "0123456789 \n=+-*/():,.abcdefghijklmnopqrstuvwxyz"

_BYTE_BASE = len(SPECIAL_TOKENS) + len(WORDS) + len(CHARS)


class ToyTokenizer:
    """The vocabulary: special tokens, words, characters, then 256 byte tokens."""

    def __init__(self) -> None:
        pieces = [*SPECIAL_TOKENS, *WORDS, *CHARS]
        if len(set(pieces)) != len(pieces):  # pragma: no cover - constant tables
            raise ValueError("duplicate vocabulary entries")
        self._pieces: list[str] = pieces
        self._ids: dict[str, int] = {p: i for i, p in enumerate(pieces)}
        # Greedy longest match in one regex: per first character, the rests of its multi-character
        # pieces longest first (alternatives are tried in order); else a run of characters that
        # start no longer piece (translated to their ids at once); else one character.
        multi: dict[str, list[str]] = {}
        for p in sorted((p for p in pieces if len(p) > 1), key=len, reverse=True):
            multi.setdefault(p[0], []).append(p)
        groups = [re.escape(ch) + "(?:" + "|".join(re.escape(p[1:]) for p in ps) + ")" for ch, ps in multi.items()]
        plain = [c for c in CHARS if c not in multi]
        self._split = re.compile("|".join(groups) + f"|[{''.join(map(re.escape, plain))}]+|.", re.DOTALL).findall
        self._plain = {ord(c): chr(self._ids[c]) for c in plain}

    @property
    def vocab_size(self) -> int:
        """Number of ids (pieces plus the 256 byte tokens)."""
        return _BYTE_BASE + 256

    @property
    def pad_id(self) -> int:
        """Id of the padding token."""
        return self._ids[PAD]

    @property
    def stop_id(self) -> int:
        """Id of the stop word ``<|im_end|>`` that ends an assistant turn."""
        return self._ids[IM_END]

    def token_id(self, piece: str) -> int:
        """Id of a vocabulary piece (KeyError if it is not one)."""
        return self._ids[piece]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (greedy longest match, byte fallback)."""
        out: list[int] = []
        get, plain = self._ids.get, self._plain
        for p in self._split(text):
            tid = get(p)
            if tid is not None:
                out.append(tid)
            elif len(p) > 1:  # a run of plain characters
                out += map(ord, p.translate(plain))
            else:  # a character outside the vocabulary: its UTF-8 bytes
                out.extend(_BYTE_BASE + b for b in p.encode("utf-8"))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; byte tokens are joined and decoded as UTF-8 (invalid -> U+FFFD)."""
        parts: list[str] = []
        pending = bytearray()
        for tid in ids:
            t = int(tid)
            if t >= _BYTE_BASE:
                if t >= _BYTE_BASE + 256:
                    raise ValueError(f"token id {t} is outside the vocabulary ({self.vocab_size})")
                pending.append(t - _BYTE_BASE)
                continue
            if pending:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if t < 0:
                raise ValueError(f"negative token id {t}")
            parts.append(self._pieces[t])
        if pending:
            parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The piece of each id (byte tokens shown as ``<0xNN>``), for debugging."""
        return [
            self._pieces[t] if t < _BYTE_BASE else f"<0x{t - _BYTE_BASE:02X}>"
            for t in map(int, ids)
        ]


TOKENIZER = ToyTokenizer()
