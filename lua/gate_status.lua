#!lua flags=no-writes
-- script: gate_status
-- Read the gate: state, version, live and overdue leases, poison set.
-- Overdue leases (past their deadline, not yet moved) count as poisoned.
-- KEYS: 3
-- KEYS[1] = ts:{R}:gate            hash: state, version, sealed_ms, installed_ms
-- KEYS[2] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[3] = ts:{R}:gate:poison     hash: lease id -> reason json
-- ARGV[1] = max ids to return per list
-- returns: {0, state, version, sealed_ms (-1 open), installed_ms (-1 never), now_ms,
--           live, next_deadline_ms (-1 none), n_poison, (id, reason json)..., n_overdue, (id, deadline)...}
-- errors: none
-- include: clock
-- include: gate
return gate_status_reply(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]))
