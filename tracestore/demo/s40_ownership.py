"""Demo section: producer, learner and evaluator share one run; each frees exactly what it owns."""

from __future__ import annotations

import threading
import time
from collections import Counter

from ..replies import text
from ..store import TraceStore

TITLE = "Ownership: producer, learner and evaluator over one run"

STEPS = 6
PER_STEP = 8


def _turn(store: TraceStore, sid: str) -> None:
    prompt = f"<user>task {sid}</user>"
    m = store.lookup(sid, prompt)
    store.record_turn(
        sid, prompt, "<assistant>42</assistant>", prefix=m, delta_token_ids=[1, 2, 3],
        response_token_ids=[4, 5], response_logprobs=[-0.1, -0.2], version=0,
    )


def run(store: TraceStore) -> list[tuple[str, object]]:
    opened: Counter[str] = Counter()
    stop = threading.Event()
    errors: list[BaseException] = []

    def producer() -> None:
        # Rollouts: open as the worker, write a turn, hand finished ones to replay;
        # every fourth stays with the worker (still generating) when the run ends.
        n = 0
        try:
            while not stop.is_set():
                sid, owner = f"prod-{n}", "rollout:0"
                store.open_session(sid, owner)
                _turn(store, sid)
                opened["producer"] += 1
                if n % 4 != 3:
                    store.transfer([sid], owner, "replay")
                n += 1
        except BaseException as exc:
            errors.append(exc)

    def evaluator() -> None:
        # Evaluation opens its own sessions and always releases eval:<step>,
        # here also after a failure midway (step 1).
        try:
            for step in range(3):
                owner = f"eval:{step}"
                try:
                    for i in range(5):
                        store.open_session(f"eval-{step}-{i}", owner)
                        opened["evaluator"] += 1
                        _turn(store, f"eval-{step}-{i}")
                        if step == 1 and i == 2:
                            raise RuntimeError("evaluation failed midway")
                except RuntimeError:
                    pass
                finally:
                    store.release_owner(owner, "eval-done")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=producer), threading.Thread(target=evaluator)]
    for t in threads:
        t.start()
    consumed = 0
    t0 = time.perf_counter()
    try:
        for step in range(STEPS):  # the learner
            owner = f"train:{step}"
            batch: list[str] = []
            deadline = time.monotonic() + 10
            while len(batch) < PER_STEP and time.monotonic() < deadline and not errors:
                batch += store.transfer(store.sessions("replay")[: PER_STEP - len(batch)], "replay", owner)
            consumed += len(store.release_owner(owner, "consumed"))
    finally:
        stop.set()
        for t in threads:
            t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]

    events = [
        {text(a): text(b) for a, b in fields.items()}
        for _id, fields in store.redis.xrange(store.keys.events, "-", "+")
    ]
    reasons = Counter(e["reason"] for e in events)
    duplicates = sum(c - 1 for c in Counter(e["sid"] for e in events).values())
    leaked_owners = [s for o in ("train", "eval") for step in range(STEPS) for s in store.sessions(f"{o}:{step}")]
    report = store.gc()
    total_opened = sum(opened.values())
    live = len(store.sessions())
    return [
        ("sessions opened (producer + evaluator)", f"{opened['producer']} + {opened['evaluator']} in {elapsed:.2f} s"),
        ("released by the learner (train:<step>)", consumed),
        ("released by the evaluator (eval:<step>)", reasons["eval-done"]),
        ("live: replay + rollout workers", f"{len(store.sessions('replay'))} + {len(store.sessions('rollout:0'))}"),
        ("opened = released + live", f"{total_opened} = {len(events)} + {live}"),
        ("events appended / duplicate events", f"{len(events)} / {duplicates}"),
        ("leaked (train/eval sessions still live)", len(leaked_owners)),
        ("leaked (released data gc had to purge)", len(report.sessions_purged)),
    ]
