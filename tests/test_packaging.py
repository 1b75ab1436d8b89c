"""The built wheel carries the Lua scripts and the trainer (as ``tracestore.trainer``, no
top-level ``trainer`` module); the core imports without torch or Ray."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tracestore.scripts import registry

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_its_lua_scripts_and_the_trainer_as_tracestore_trainer(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=240,
    )
    (wheel,) = out.glob("tracestore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"tracestore/lua/{n}.lua" for n in registry()} <= set(names)
    assert "tracestore/lua/_lib/op.lua" in names
    assert "tracestore/py.typed" in names
    # the trainer ships inside the tracestore namespace: nothing else at the top level
    # (a top-level `trainer` would clash with RL codebases' own `trainer` modules)
    trainer_src = {f"tracestore/trainer/{p.name}" for p in (ROOT / "trainer").glob("*.py")}
    assert "tracestore/trainer/loop.py" in trainer_src and trainer_src <= set(names)
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"tracestore", wheel.name.split("-py3")[0] + ".dist-info"}, tops

    # A throwaway venv: the wheel installed by pip, dependencies borrowed from
    # this environment's site-packages as a plain path (so the editable
    # install's import hook of the source tree is NOT active there).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
        check=True, capture_output=True, timeout=240,
    )
    probe = (
        "import sys, tracestore, tracestore.scripts as s\n"
        "print(tracestore.__file__); print(s.lua_dir()); print(len(s.registry()))\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
    )
    res = subprocess.run([str(py), "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True)
    file, lua, count = res.stdout.split()
    assert file.startswith(site), file
    assert lua.startswith(site) and lua.endswith("tracestore/lua")
    assert int(count) == len(registry())

    # the trainer imports from the wheel under the one name the CLI, tests and benchmarks use
    probe = (
        "import importlib.util, tracestore.trainer.loop as loop, tracestore.cli.train as cli\n"
        "print(loop.__file__); print(importlib.util.find_spec('trainer'))\n"
    )
    res = subprocess.run([str(py), "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True)
    file, top = res.stdout.split()
    assert file.startswith(site) and file.endswith("tracestore/trainer/loop.py"), file
    assert top == "None"  # no top-level `trainer` installed
    res = subprocess.run(
        [str(py), "-m", "tracestore.trainer", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert res.returncode == 0 and "--mode" in res.stdout, res.stderr


def test_core_imports_without_torch_or_ray() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['ray'] = None; sys.modules['numpy'] = None\n"
        "import pkgutil, importlib, tracestore\n"
        "for m in pkgutil.walk_packages(tracestore.__path__, 'tracestore.'):\n"
        "    if m.name in ('tracestore.ray', 'tracestore.cli.__main__') or m.name.startswith('tracestore.trainer.'):\n"
        "        continue\n"
        "    importlib.import_module(m.name)\n"
        "assert 'tracestore.trainer' in sys.modules  # the trainer package itself imports light\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_core_and_cli_import_without_the_gateway_extras() -> None:
    code = (
        "import sys\n"
        "for m in ('aiohttp', 'prometheus_client', 'transformers', 'tokenizers', 'jinja2', 'openai', 'anthropic'):\n"
        "    sys.modules[m] = None\n"
        "import tracestore, tracestore.cli\n"
        "assert 'tracestore.gateway' not in sys.modules\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
