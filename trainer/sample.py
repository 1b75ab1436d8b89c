"""A :class:`Sample`: one episode of a prompt in one session, as it crosses actors and the buffer.

The producer creates samples, a rollout worker continues them, the replay
buffer carries them in a group's payload (:meth:`Sample.to_json`) and the
learner reads their reward and the key of their trace. Samples are values:
continuing one returns a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, cast

from .api_messages import tito_key
from .chat import render
from .task import Episode, Problem

Message = dict[str, str]
#: ``new`` (not started), ``running``, then ``completed``, ``aborted`` (a weight update
#: interrupted it: it is continued later) or ``failed`` (a request failed).
SampleStatus = Literal["new", "running", "completed", "aborted", "failed"]
#: A replay group's status (:func:`group_status`).
GroupStatus = Literal["completed", "filtered", "aborted", "failed"]


@dataclass(frozen=True)
class Sample:
    """One rollout of ``problem`` in session ``sid``: the conversation so far and its outcome.

    ``value``/``calls``/``turns`` are the calculator's state; ``versions``
    the weight version of each recorded turn; ``reward`` and ``finish`` are
    meaningful once ``done``; ``worker`` is the rollout worker the router
    placed the session on (the learner borrows the session's routed experts
    from it).
    """

    sid: str
    problem: Problem
    messages: tuple[Message, ...]
    value: int
    calls: int = 0
    turns: int = 0
    done: bool = False
    status: SampleStatus = "new"
    versions: tuple[int, ...] = ()
    reward: float = 0.0
    finish: str = ""
    error: str | None = None
    worker: str | None = None
    #: How its session is keyed: ``text`` (the rendered conversation: local agents' turn
    #: recorder) or ``tito`` (the canonical messages: HTTP agents through the gateway).
    keying: Literal["text", "tito"] = "text"

    @classmethod
    def new(cls, sid: str, problem: Problem, max_calls: int) -> Sample:
        """A fresh episode of ``problem`` in session ``sid``, not started yet."""
        ep = Episode(problem, max_calls=max_calls)
        return cls(sid, problem, tuple(ep.messages), ep.value)

    def episode(self, max_calls: int) -> Episode:
        """The task's episode state to continue this sample from (messages copied)."""
        return Episode(
            self.problem,
            max_calls=max_calls,
            messages=[dict(m) for m in self.messages],
            value=self.value,
            calls=self.calls,
            turns=self.turns,
        )

    def final_key(self) -> str:
        """Key of the last response node: the conversation up to its last answer, rendered
        (``text``) or as canonical messages (``tito``, :func:`~.api_messages.tito_key`)."""
        if self.keying == "tito":
            return tito_key(self.messages)
        return render(self.messages, False).rstrip()

    def to_json(self) -> dict[str, Any]:
        """JSON form (replay group payloads); ``None`` fields are left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "problem":
                v = self.problem.to_json()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_json`. Raises KeyError/ValueError on a malformed record."""
        return cls(
            sid=str(d["sid"]),
            problem=Problem.from_json(d["problem"]),
            messages=tuple({str(k): str(v) for k, v in m.items()} for m in d["messages"]),
            value=int(d["value"]),
            calls=int(d.get("calls", 0)),
            turns=int(d.get("turns", 0)),
            done=bool(d.get("done", False)),
            status=_status(d.get("status", "new")),
            versions=tuple(int(v) for v in d.get("versions", ())),
            reward=float(d.get("reward", 0.0)),
            finish=str(d.get("finish", "")),
            error=d.get("error"),
            worker=d.get("worker"),
            keying="tito" if d.get("keying") == "tito" else "text",
        )


def _status(s: str) -> SampleStatus:
    if s not in ("new", "running", "completed", "aborted", "failed"):
        raise ValueError(f"unknown sample status {s!r}")
    return cast(SampleStatus, s)


def group_status(samples: Sequence[Sample]) -> GroupStatus:
    """XTuner's priority: failed > aborted > filtered (no reward spread) > completed."""
    st = [s.status for s in samples]
    if "failed" in st:
        return "failed"
    if any(x != "completed" for x in st):
        return "aborted"
    rewards = [s.reward for s in samples]
    if max(rewards) - min(rewards) < 1e-9:
        return "filtered"
    return "completed"


def to_payload(samples: Sequence[Sample]) -> dict[str, Any]:
    """A replay group's payload: its samples' JSON forms."""
    return {"samples": [s.to_json() for s in samples]}


def from_payload(payload: dict[str, Any]) -> list[Sample]:
    """Inverse of :func:`to_payload`."""
    return [Sample.from_json(d) for d in payload["samples"]]
