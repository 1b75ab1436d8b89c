"""Where a gateway's time goes: py-spy's raw (collapsed) stacks summed into the parts of a turn.

``py-spy record -f raw`` writes one line per distinct stack, ``frame;frame;...;frame COUNT``
(root first, each frame ``function (file:line)``, the file relative to its ``sys.path`` entry,
e.g. ``aiohttp/client.py``), idle samples left out. Each stack is given
to one part:

* the leaf-most frame of a *definite* part decides: ``parse`` (reading and decoding the
  request body, the wire parser: ``gateway/body.py`` and the ``parse``-side functions of the
  wire modules), ``canonicalise/hash`` (``tracestore/conversation.py``), ``render/tokenise``
  (the gateway's tokenizer, the builtin tokenizer, jinja2, ``tokenizers``, the answer
  parsers), ``store`` (tracestore's store code: ``io``, ``traces``, ``gate``, the script and
  reply codecs; redis-py, hiredis), ``engine I/O`` (``gateway/engines``, aiohttp's client);
* a stack with none is given to its leaf-most frame's *general* part: ``HTTP server``
  (aiohttp outside its client, multidict, yarl), ``gateway logic`` (the rest of
  ``tracestore/gateway``: the turn, admission, the answer's JSON), ``event loop`` (asyncio,
  uvloop), else ``other``.

So an aiohttp frame under an engine call is engine I/O, under a store call store, and on its
own (accepting, reading, writing the client's HTTP) the HTTP server. Stacks without a Python
frame and a thread pool's idle workers (waiting that py-spy counts as active) are left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PARTS = (
    "parse",
    "canonicalise/hash",
    "render/tokenise",
    "store",
    "engine I/O",
    "HTTP server",
    "gateway logic",
    "event loop",
    "other",
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::\d+)?\)$")
#: Waiting that py-spy does not see as idle: a thread pool's worker waiting for work.
_IDLE = re.compile(r"^_worker \(concurrent/futures/thread\.py:")
_WIRE = ("gateway/openai.py", "gateway/anthropic.py", "gateway/responses.py", "gateway/chat.py", "gateway/completions.py")
_PARSE_FUNCS = re.compile(r"^(parse|_message|_text|_tool_choice|_content|_blocks|as_|opt_|stop_strings|template_kwargs|tool_arguments|function_tool)")
_STORE_CORE = (
    "tracestore/io/",
    "tracestore/traces/",
    "tracestore/gate/",
    "tracestore/store.py",
    "tracestore/twin.py",
    "tracestore/scripts.py",
    "tracestore/replies.py",
    "tracestore/codec.py",
    "tracestore/keys.py",
    "tracestore/nodecache.py",
    "tracestore/connection.py",
    "tracestore/ownership.py",
    "tracestore/context.py",
    "tracestore/validate.py",
)


def _definite(func: str, file: str) -> str | None:
    f = "/" + file.replace("\\", "/")  # py-spy names files relative to their sys.path entry
    if f.endswith("gateway/body.py") or (f.endswith(_WIRE) and _PARSE_FUNCS.match(func)):
        return "parse"
    if f.endswith("tracestore/conversation.py"):
        return "canonicalise/hash"
    if (
        f.endswith(("gateway/tokenizer.py", "trainer/tokenizer.py", "trainer/tool_syntax.py"))
        or "/gateway/parsers/" in f
        or "/jinja2/" in f
        or "/tokenizers/" in f
        or "/transformers/" in f
    ):
        return "render/tokenise"
    if any(p in f for p in _STORE_CORE) or "/redis/" in f or "/hiredis/" in f:
        return "store"
    if "/gateway/engines/" in f or re.search(r"/aiohttp/(client|connector)", f):
        return "engine I/O"
    return None


def _general(file: str) -> str:
    f = "/" + file.replace("\\", "/")
    if "/aiohttp/" in f or "/multidict/" in f or "/yarl/" in f:
        return "HTTP server"
    if "tracestore/gateway/" in f:
        return "gateway logic"
    if "/asyncio/" in f or "/uvloop/" in f:
        return "event loop"
    return "other"


def classify(frames: list[str]) -> str:
    """The part of one stack (frames root first)."""
    general: str | None = None
    for frame in reversed(frames):
        m = _FRAME.match(frame.strip())
        func, file = (m["func"], m["file"]) if m else (frame, "")
        part = _definite(func, file)
        if part is not None:
            return part
        if general is None and _general(file) != "other":
            general = _general(file)
    return general or "other"


def aggregate(lines: Iterable[str]) -> dict[str, Any]:
    """Samples per part (and their share) of py-spy raw output lines."""
    counts = dict.fromkeys(PARTS, 0)
    total = idle = 0
    for line in lines:
        line = line.rstrip("\n")
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if f.strip()]
        if not frames or _IDLE.search(frames[-1]):
            idle += int(n)
            continue
        counts[classify(frames)] += int(n)
        total += int(n)
    return {
        "samples": total,
        "idle_samples_left_out": idle,
        "share_pct": {p: round(100 * c / total, 1) if total else 0.0 for p, c in counts.items()},
        "samples_by_part": counts,
    }


def aggregate_file(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return aggregate(f)
