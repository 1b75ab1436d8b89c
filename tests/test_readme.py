"""The README's usage example runs as written, against every backend."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    return str(blocks[0])


def test_readme_usage_example_runs(url: str, run_id: str) -> None:
    code = _example()
    assert 'tracestore.connect("redis://127.0.0.1:6379", run="exp-42")' in code
    code = code.replace('"redis://127.0.0.1:6379", run="exp-42"', f"{url!r}, run={run_id!r}")
    pushed: list[bool] = []
    env: dict[str, Any] = {
        "prompt_text": "<user>what is 2+3?</user><assistant>",
        "response_text": "5</assistant>",
        "delta_ids": [11, 12, 13, 14],
        "out_ids": [7, 8],
        "out_logprobs": [-0.25, -0.5],
        "push_weights": lambda: pushed.append(True),
    }
    exec(compile(code, "README.md", "exec"), env)  # noqa: S102 - our own README
    store = env["store"]
    try:
        traces = env["traces"]
        assert len(traces) == 2
        assert traces[0].input_ids == [11, 12, 13, 14, 7, 8]
        assert traces[0].labels == [-100] * 4 + [7, 8]
        assert pushed == [True] and store.gate.status().version == 1
        assert store.sessions() == []
        assert store.session_states(["s-1", "s-2"]) == {
            "s-1": ("", "released"),
            "s-2": ("", "released"),
        }
    finally:
        store.close()
