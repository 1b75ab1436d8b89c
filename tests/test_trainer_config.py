"""The trainer's configuration (``trainer/config.py``): defaults and checks, without Ray."""

from __future__ import annotations

from tracestore.keys import validate_run
from tracestore.trainer.config import TrainConfig


def test_default_run_ids_are_unique_even_within_one_second() -> None:
    """They were `train-<unix second>`: two jobs started in the same second shared a run."""
    ids = [TrainConfig().run for _ in range(50)]  # made within a second or two: they collided
    assert len(set(ids)) == 50
    for run in ids:
        validate_run(run)
        assert run.startswith("train-")
