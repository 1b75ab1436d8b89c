"""Option types of the CLI that check a value the way the library would, before any I/O.

A value the library would refuse with InvalidInput (a negative duration, NaN)
is refused by click instead, as a usage error (exit 2) naming the option.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..errors import InvalidInput
from ..validate import duration_ms

if TYPE_CHECKING:  # generic in click's types since 8.2; a plain class at run time (click >= 8.1)
    _FloatType = click.ParamType[float]
else:
    _FloatType = click.ParamType


class Seconds(_FloatType):
    """A duration in seconds, as :func:`tracestore.validate.duration_ms` accepts it.

    Finite, at most 366 days, at least 1 ms (0 allowed with ``allow_zero``);
    converts to ``float``. Raises click's BadParameter (exit 2) otherwise.
    """

    name = "seconds"

    def __init__(self, *, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        """``value`` (text from the command line, or a number) as seconds; fails on a bad one."""
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        try:
            duration_ms("seconds", seconds, allow_zero=self.allow_zero)
        except InvalidInput as exc:
            self.fail(str(exc).split(": ", 1)[1], param, ctx)
        return seconds
