"""A run's checkpoint directory (``<out>/ckpt``): the model, the store, and ``state.json`` last.

``model.pt`` holds the model and optimizer state (``torch.save`` of tensors
only), ``store.ckpt`` the store (``store.checkpoint``), ``state.json`` the
loop's state (:class:`CheckpointState`). ``state.json`` is written last and
atomically, so a present ``state.json`` means a complete checkpoint.
``finished.json`` says that the run ended (its report written) at a step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tracestore import TraceStore

from .config import TrainConfig
from .steps import StepRecord

MODEL = "model.pt"
STORE = "store.ckpt"
STATE = "state.json"
#: Written once a run has ended and written its report: ``{"run": ..., "step": ...}``.
FINISHED = "finished.json"


def ckpt_dir(cfg: TrainConfig) -> str:
    """The run's checkpoint directory."""
    return os.path.join(cfg.out, "ckpt")


def store_path(cfg: TrainConfig) -> str:
    """The store's checkpoint file (``store.checkpoint`` / ``store.restore``)."""
    return os.path.join(ckpt_dir(cfg), STORE)


@dataclass(frozen=True)
class CheckpointState:
    """The loop's state at the checkpoint of ``step`` (the weights' ``version``, the config)."""

    step: int
    version: int
    history: list[StepRecord]
    gate_cycles: int
    baseline_eval: float | None
    cfg: TrainConfig

    def to_json(self) -> dict[str, Any]:
        """JSON form (``state.json``)."""
        return {
            "step": self.step,
            "version": self.version,
            "history": [h.to_json() for h in self.history],
            "gate_cycles": self.gate_cycles,
            "baseline_eval": self.baseline_eval,
            "cfg": self.cfg.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CheckpointState:
        """Inverse of :meth:`to_json`."""
        return cls(
            step=int(d["step"]),
            version=int(d["version"]),
            history=[StepRecord.from_json(h) for h in d["history"]],
            gate_cycles=int(d.get("gate_cycles", 0)),
            baseline_eval=d.get("baseline_eval"),
            cfg=TrainConfig.from_json(d["cfg"]),
        )


def load_state(cfg: TrainConfig) -> CheckpointState | None:
    """The state of the checkpoint in ``cfg.out`` (None when there is none)."""
    path = os.path.join(ckpt_dir(cfg), STATE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return CheckpointState.from_json(json.load(f))


def mark_finished(cfg: TrainConfig, step: int) -> None:
    """Record that ``cfg.run`` ended at ``step`` and wrote its report (``finished.json``).

    A ``--resume`` of the checkpoint of that step then has nothing to do
    (:func:`finished_at`); a run killed after its last checkpoint but before
    its end has no such record, and its resume finishes it.
    """
    directory = ckpt_dir(cfg)
    os.makedirs(directory, exist_ok=True)
    _replace(os.path.join(directory, FINISHED), lambda p: _dump_json(p, {"run": cfg.run, "step": step}))


def finished_at(cfg: TrainConfig, run: str) -> int | None:
    """The step at which ``run`` ended, per ``finished.json`` in ``cfg.out`` (None: it did not)."""
    path = os.path.join(ckpt_dir(cfg), FINISHED)
    try:
        with open(path) as f:
            done = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict) or done.get("run") != run or not isinstance(done.get("step"), int):
        return None
    return int(done["step"])


def write_checkpoint(
    state: CheckpointState, model: torch.nn.Module, opt: torch.optim.Optimizer, store: TraceStore
) -> None:
    """Write the checkpoint of ``state.cfg``'s run: ``model.pt``, ``store.ckpt``, then ``state.json``."""
    directory = ckpt_dir(state.cfg)
    os.makedirs(directory, exist_ok=True)
    weights = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    _replace(os.path.join(directory, MODEL), lambda p: torch.save(weights, p))
    store.checkpoint(store_path(state.cfg))
    _replace(os.path.join(directory, STATE), lambda p: _dump_json(p, state.to_json()))


def load_model(cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load ``model.pt`` into ``model`` and ``opt`` (``weights_only``: no arbitrary unpickling)."""
    ck = torch.load(os.path.join(ckpt_dir(cfg), MODEL), weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])


def _dump_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _replace(path: str, write: Callable[[str], None]) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)
