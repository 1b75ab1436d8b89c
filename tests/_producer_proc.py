"""A producer in its own process (tests/test_ownership.py, disaggregated race).

``python tests/_producer_proc.py URL RUN PREFIX N`` opens sessions
``PREFIX-0 .. PREFIX-(N-1)`` as ``rollout:proc``, writes one turn into each
and moves every second one to ``replay``; it prints one JSON line per session
(``{"sid": ..., "owner": ...}``) as soon as it is done with it, and ``done``
at the end. It exits with status 0 only if every write succeeded.
"""

from __future__ import annotations

import sys

import orjson

from tracestore import TraceStore


def write_turn(store: TraceStore, sid: str) -> None:
    prompt = f"<user>question of {sid}</user>"
    m = store.lookup(sid, prompt)
    store.record_turn(
        sid,
        prompt,
        f"<assistant>answer of {sid}</assistant>",
        prefix=m,
        delta_token_ids=[1, 2, 3, 4],
        response_token_ids=[5, 6, 7],
        response_logprobs=[-0.5, -0.25, -0.125],
        version=1,
    )


def main() -> None:
    url, run, prefix, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with TraceStore.connect(url, run=run) as store:
        for i in range(n):
            sid = f"{prefix}-{i}"
            store.open_session(sid, "rollout:proc")
            write_turn(store, sid)
            owner = "rollout:proc"
            if i % 2 == 0:
                assert store.transfer([sid], "rollout:proc", "replay") == [sid]
                owner = "replay"
            sys.stdout.write(orjson.dumps({"sid": sid, "owner": owner}).decode() + "\n")
            sys.stdout.flush()
    sys.stdout.write("done\n")


if __name__ == "__main__":
    main()
