"""``tracestore demo``: a short scripted scenario that shows what the store does.

Each section is a module ``tracestore/demo/sNN_<topic>.py`` exposing
``TITLE: str`` and ``run(store: TraceStore) -> list[tuple[str, object]]``
(rows of "what happened", "result"). Sections run in file-name order, each
on its own run id, and print one table each, so a feature adds its part of
the demo by adding a module. Each section's run is deleted once its table
is printed (or it failed), unless ``keep``: a demo leaves nothing on the
server, in particular no session of an owner tag that never heart-beats.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
import uuid
from collections.abc import Callable
from types import ModuleType

from ..errors import InvalidInput
from ..formatting import format_table
from ..store import TraceStore


def sections() -> list[ModuleType]:
    """The demo section modules, in order."""
    mods = [m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("s")]
    return [importlib.import_module(f"{__name__}.{name}") for name in sorted(mods)]


def section_name(mod: ModuleType) -> str:
    """A section's short name (``s30_gate`` -> ``gate``), what ``--only`` matches."""
    return mod.__name__.rsplit(".", 1)[1].split("_", 1)[-1]


def run_demo(
    url: str | None,
    *,
    only: str | None = None,
    echo: Callable[[str], None] = print,
    run_prefix: str = "demo",
    keep: bool = False,
) -> dict[str, list[tuple[str, object]]]:
    """Run every section (or those whose name contains ``only``); return their rows.

    Each section runs on a new run ``<run_prefix>-<section>-<6 hex>``, which
    is deleted after it (``delete_run(force=True)``: its sessions, traces and
    counters), also when the section fails, unless ``keep``; the last line
    says which. Raises InvalidInput, before anything runs, when ``only``
    matches no section.
    """
    results: dict[str, list[tuple[str, object]]] = {}
    stamp = uuid.uuid4().hex[:6]
    chosen = [m for m in sections() if not only or only in m.__name__.rsplit(".", 1)[1]]
    if not chosen:
        names = ", ".join(section_name(m) for m in sections())
        raise InvalidInput("only", f"no section matches {only!r}; sections: {names}")
    runs: list[str] = []
    for mod in chosen:
        name = mod.__name__.rsplit(".", 1)[1]
        run = f"{run_prefix}-{section_name(mod)}-{stamp}"
        runs.append(run)
        start = time.perf_counter()
        with TraceStore.connect(url, run=run) as store:
            try:
                rows = mod.run(store)
            finally:
                if not keep:
                    store.delete_run(force=True)
        took = time.perf_counter() - start
        echo(f"\n== {mod.TITLE}  (run {run}, {took:.2f}s)")
        echo(format_table(["what happened", "result"], rows))
        results[name] = rows
    if keep:
        echo(f"\nkept the demo's runs: {', '.join(runs)} (`tracestore run delete RUN --force` removes one)")
    else:
        echo(f"\nremoved the demo's {len(runs)} run{'s' if len(runs) != 1 else ''} (--keep keeps them)")
    return results
