-- script: gate_admit
-- Admit one request under the gate: a lease with a deadline (server clock).
-- Idempotent under client retry: the lease id is generated once per call by
-- the client and doubles as the operation id, and the lease hash is the
-- record of the call (a retry finds it and returns the same lease).
-- KEYS: 4
-- KEYS[1] = ts:{R}:gate            hash: state, version, sealed_ms, retry_ms
-- KEYS[2] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[3] = ts:{R}:gate:l:<lease>  hash: sid, holder, version, admitted_ms, ttl_ms, deadline_ms
-- KEYS[4] = ts:{R}:released        zset: released sids (a released session gets no more requests)
-- ARGV[1] = lease id (the call's operation id)
-- ARGV[2] = session id
-- ARGV[3] = holder (who serves the request)
-- ARGV[4] = ttl (ms, > 0)
-- returns: {0, lease id, version (int), deadline_ms (int), replayed (0|1)}
-- errors: GATE_SEALED (version, retry_after_ms), SESSION_RELEASED (sid, detail)
-- include: op
-- include: gate
local gate, leases, lkey = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
local prior = redis.call('HMGET', lkey, 'version', 'deadline_ms')
if prior[1] then
  return {0, id, tonumber(prior[1]), tonumber(prior[2]), 1}
end
local g = redis.call('HMGET', gate, 'state', 'version', 'retry_ms')
local version = tonumber(g[2] or '0')
if g[1] == 'sealed' then
  return {1, 'GATE_SEALED', version, tonumber(g[3] or '500')}
end
if redis.call('ZSCORE', KEYS[4], ARGV[2]) then
  return {1, 'SESSION_RELEASED', ARGV[2], 'released; it is admitted no more requests'}
end
local now = now_ms()
local deadline = now + tonumber(ARGV[4])
redis.call('ZADD', leases, deadline, id)
redis.call('HSET', lkey, 'sid', ARGV[2], 'holder', ARGV[3], 'version', version,
  'admitted_ms', now, 'ttl_ms', ARGV[4], 'deadline_ms', deadline)
return {0, id, version, deadline, 0}
