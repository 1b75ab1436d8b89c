"""Demo section: the replay buffer across a weight update (puts, aborts, expiry, takes)."""

from __future__ import annotations

from ..replay import REPLAY_OWNER, Group
from ..store import TraceStore

TITLE = "Replay buffer: put, weight update aborts in-flight groups, expiry, take"

WORKER = "rollout:w0"


def _rollout(store: TraceStore, gid: str, version: int) -> tuple[str, ...]:
    """Open a group of two sessions and record one turn each, at ``version``."""
    sids = (f"{gid}.a", f"{gid}.b")
    store.open_sessions(list(sids), WORKER, version=version, group=gid)
    for sid in sids:
        prompt = f"<user>{gid}: what is 6*7?</user>"
        store.record_turn(
            sid, prompt, "<a>42</a>", prefix=store.lookup(sid, prompt),
            delta_token_ids=[5, 6, 7], response_token_ids=[42, 2], response_logprobs=[-0.1, -0.2],
            version=version,
        )
    return sids


def run(store: TraceStore) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    rb = store.replay
    v0 = store.gate.status().version
    for i in range(4):
        sids = _rollout(store, f"done{i}", v0)
        # min_version comes from the traces; not retryable: an expired group is released
        rb.put(Group(f"done{i}", "math", sids, retryable=False, payload={"rewards": [1.0, 0.0]}), WORKER)
    rows.append(("4 finished groups put (sessions move to 'replay')", f"{rb.count('math', 'completed')} stored"))

    # two rollouts are in flight when the trainer wants to push new weights
    leases = {}
    for i in range(2):
        gid = f"inflight{i}"
        leases[gid] = (store.gate.admit(f"{gid}.a", holder=WORKER, ttl_s=30), _rollout(store, gid, v0))
    store.gate.seal()  # the workers see the seal and abort their in-flight requests
    for gid, (lease, sids) in leases.items():
        store.gate.settle(lease, "aborted")
        rb.put(Group(gid, "math", sids, status="aborted"), WORKER)  # retryable by default
    with store.gate.weight_update(v0 + 4, drain_timeout_s=5) as res:
        rows.append(("weight update: in-flight groups aborted into the buffer", f"drained={res.drained}"))
    v1 = store.gate.status().version
    rows.append(("installed version", f"{v0} -> {v1} (4 versions per sync)"))

    claimed = rb.claim_retry("math", 8, "rollout:w1")
    rows.append(("producer claims the aborted groups, finishes and re-puts them", [g.gid for g in claimed]))
    for g in claimed:  # it finishes the rollouts (tokens of both versions) and puts them again
        rb.put(Group(g.gid, g.task, g.sids), "rollout:w1")
    for i in range(3):
        sids = _rollout(store, f"fresh{i}", v1)
        rb.put(Group(f"fresh{i}", "math", sids), WORKER)

    events = store.redis.xlen(store.keys.events)
    rep = rb.expire(v1, 2)  # staleness 4 > 2: every group of the old version
    rows.append(("expire staleness > 2: retryable groups kept as 'expired'", list(rep.kept)))
    rows.append(("  non-retryable groups released", list(rep.released_groups)))
    rows.append(("  release events (one per session)", store.redis.xlen(store.keys.events) - events))
    taken = rb.take("math", 2, owner="train:0", current_version=v1, max_staleness=2, policy="staleness")
    rows.append(("learner takes 2 (staleness order)", [g.gid for g in taken]))
    owners = sorted({store.owner_of(s) or "-" for g in taken for s in g.sids})
    rows.append(("  their sessions are now owned by", owners))
    short = rb.take("math", 5, owner="train:0", current_version=v1, max_staleness=2)
    rows.append(("take 5 with only 1 ready: all or nothing", f"took {len(short)}, ready={short.ready}"))
    retry = rb.claim_retry("math", 100, "rollout:w2")
    rows.append(("expired groups claimed for another try", [g.gid for g in retry]))
    left = f"{rb.count()} group(s); replay owns {len(store.sessions(REPLAY_OWNER))} sessions"
    rows.append(("left in the buffer", left))
    return rows
