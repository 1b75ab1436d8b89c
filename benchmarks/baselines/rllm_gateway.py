"""Peer baseline: rLLM's model gateway (``rllm-model-gateway`` 0.1.0 from PyPI), run as it ships.

Nothing of it is copied here: the package is installed, unchanged, into a virtual environment of
its own (``~/.cache/tracestore-bench/rllm-venv``, or ``$TRACESTORE_BENCH_CACHE/rllm-venv``;
created on first use with ``pip install rllm-model-gateway==0.1.0 uvicorn[standard]``), so its
dependencies (FastAPI, Starlette, uvicorn, httpx, pydantic, aiosqlite) never meet tracestore's.
``uvicorn[standard]`` adds uvloop and httptools, which uvicorn then uses: the fastest way to run
it that its own CLI offers (``tracestore gateway`` runs on uvloop too). It is started as a
subprocess with its own CLI::

    python -m rllm_model_gateway --host 127.0.0.1 --port P --worker ENGINE/v1 \\
        --store memory|sqlite [--db-path FILE] --log-level warning

(``warning``: no access line per request; its default, ``info``, writes one.)

What it does per request, read from its code (0.1.0): the session is the path
(``/sessions/{sid}/v1/chat/completions``; implicitly created); an ASGI middleware parses the JSON
body, adds ``logprobs: true`` and ``return_token_ids: true`` (and ``extra_body``) and serialises it
again; the proxy parses it once more, forwards the chat request with httpx to the session's worker
(sticky, least-loaded for a new session; ``max_connections=500``), parses the reply, builds a
pydantic ``TraceRecord`` (the request's messages, ``prompt_token_ids`` from the reply's root,
``token_ids`` and ``logprobs.content`` of the first choice, the finish reason, the raw request and
raw reply), then answers the client with the vLLM fields and (not asked for) logprobs removed.
The trace is written **after** the answer, in a background task (``sync_traces`` is off by
default): to a dict (``memory``) or, ``sqlite``, one JSON row per call plus a junction row, one
transaction each (``journal_mode=DELETE``, ``synchronous=NORMAL``) on one aiosqlite connection.
No gate, no ownership, no token-exact prefix handling: the engine renders and tokenises the whole
conversation every turn, and the trace holds the whole prompt's ids every turn.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

VERSION = "0.1.0"
PACKAGES = (f"rllm-model-gateway=={VERSION}", "uvicorn[standard]")


def venv_dir() -> Path:
    root = os.environ.get("TRACESTORE_BENCH_CACHE") or os.path.expanduser("~/.cache/tracestore-bench")
    return Path(root) / "rllm-venv"


def ensure_venv() -> Path:
    """The venv's python, after creating the venv and installing the peer into it on first use."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    marker = venv / f".installed-{VERSION}"
    if marker.exists():
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    subprocess.run([str(python), "-c", "import rllm_model_gateway, uvicorn, uvloop, httptools"], check=True)
    marker.write_text(" ".join(PACKAGES) + "\n")
    return python


def versions() -> dict[str, str]:
    """The installed versions of the peer and the packages that carry its requests."""
    code = (
        "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
        "('rllm-model-gateway', 'fastapi', 'starlette', 'uvicorn', 'httpx', 'httpcore', 'anyio', 'pydantic', 'aiosqlite', 'uvloop', 'httptools')}))"
    )
    out = subprocess.run([str(ensure_venv()), "-c", code], check=True, capture_output=True, text=True).stdout
    return dict(orjson.loads(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RllmGateway:
    """One ``rllm-model-gateway`` process in front of ``engine`` (a base URL; it calls
    ``ENGINE/v1/chat/completions``), with its ``memory`` or ``sqlite`` trace store."""

    def __init__(self, engine: str, store: str) -> None:
        python = ensure_venv()
        self.store = store
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="rllm-gateway-")
        self.db_path = os.path.join(self.dir, "traces.db")
        cmd = [str(python), "-m", "rllm_model_gateway", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--worker", engine.rstrip("/") + "/v1", "--store", store, "--log-level", "warning"]
        if store == "sqlite":
            cmd += ["--db-path", self.db_path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.dir)
        self.pid = self.proc.pid
        self.lines: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rllm-model-gateway did not start: {''.join(self.lines)[-2000:]}") from None
                time.sleep(0.2)

    def session_url(self) -> str:
        """The base URL a session's client is given (``{sid}`` filled per session)."""
        return self.url + "/sessions/{sid}"

    def trace_counts(self, prefix: str) -> int:
        """Traces stored for the sessions whose id starts with ``prefix`` (``GET /sessions``)."""
        rows: list[dict[str, Any]] = orjson.loads(urllib.request.urlopen(self.url + "/sessions", timeout=600).read())
        return sum(int(r["trace_count"]) for r in rows if str(r["session_id"]).startswith(prefix))

    def session_traces(self, sid: str) -> list[dict[str, Any]]:
        """The traces of one session (``GET /sessions/{sid}/traces``)."""
        out: list[dict[str, Any]] = orjson.loads(urllib.request.urlopen(f"{self.url}/sessions/{sid}/traces", timeout=60).read())
        return out

    def db_bytes(self) -> int:
        """The SQLite file's size (0 for the memory store)."""
        return sum(os.path.getsize(os.path.join(self.dir, f)) for f in os.listdir(self.dir) if f.startswith("traces.db"))

    def stop(self) -> None:
        from benchmarks.bench_gateway import stop_process

        stop_process(self.proc)
        for f in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, f))
        os.rmdir(self.dir)
