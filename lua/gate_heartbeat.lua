-- script: gate_heartbeat
-- Record that lease holder `holder` (a gateway, a rollout worker) is alive
-- until now + ttl (server clock). Once a holder has heart-beat, its unsettled
-- leases can be resolved when a deadline passes without a new heartbeat
-- (gate_dead_leases lists them, gate_settle in mode 'dead' settles them); a
-- holder that comes back just heart-beats again (nothing is fenced: a lease
-- already resolved keeps its receipt, the others stay its own).
-- Naturally idempotent under client retry (a retry only moves the deadline to
-- now + ttl again), so it takes no op id.
-- KEYS: 1
-- KEYS[1] = ts:{R}:gate:holders    zset holder -> heartbeat deadline (ms, server clock)
-- ARGV[1] = holder tag
-- ARGV[2] = ttl (ms, > 0)
-- returns: {0, deadline_ms (int)}
-- errors: none
-- include: clock
local deadline = now_ms() + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], deadline, ARGV[1])
return {0, deadline}
