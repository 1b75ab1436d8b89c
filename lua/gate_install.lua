-- script: gate_install
-- Install a new weight version (the fencing token new leases carry).
-- Refused unless the gate is sealed, no lease is live (overdue ones are
-- first moved to the poison set), the poison set is empty and the version
-- is larger than the current one (invariant 1). A refusal changes nothing
-- but the move of overdue leases. Idempotent under client retry (op id): a
-- retried successful install returns its first reply, not StaleVersion.
-- An install appends one entry to the gate's log (capped at ARGV[3]
-- entries): the versions, when the gate was sealed and when it drained (the
-- first drain check that found no live lease, else this install).
-- KEYS: 5
-- KEYS[1] = ts:{R}:gate            hash: state, version, installed_ms, sealed_ms, drained_ms
-- KEYS[2] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[3] = ts:{R}:gate:poison     hash: lease id -> reason json
-- KEYS[4] = ts:{R}:op:<op_id>      string: the recorded reply
-- KEYS[5] = ts:{R}:gate:log        stream: ev=install (version, previous, sealed_ms, drained_ms, ms)
-- ARGV[1] = version (int >= 0)
-- ARGV[2] = op record ttl (ms)
-- ARGV[3] = most entries the gate's log keeps (XADD MAXLEN)
-- returns: {0, version (int), previous version (int)}
-- errors: STALE_VERSION (current, requested), NOT_DRAINED (state, live), GATE_POISONED (lease ids...)
-- include: clock
-- include: op
-- include: gate
local gate, leases, poison, opkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local done = op_replay(opkey)
if done then return done end
local want = tonumber(ARGV[1])
local g = redis.call('HMGET', gate, 'state', 'version')
local cur = tonumber(g[2] or '0')
if want <= cur then
  return {1, 'STALE_VERSION', cur, want}
end
if g[1] ~= 'sealed' then
  return {1, 'NOT_DRAINED', g[1] or 'open', redis.call('ZCARD', leases)}
end
local now = now_ms()
gate_sweep(leases, poison, now)
local live = redis.call('ZCARD', leases)
if live > 0 then
  return {1, 'NOT_DRAINED', 'sealed', live}
end
if redis.call('HLEN', poison) > 0 then
  local ids = redis.call('HKEYS', poison)
  local out = {1, 'GATE_POISONED'}
  for i = 1, math.min(#ids, 20) do out[#out + 1] = ids[i] end
  return out
end
redis.call('HSET', gate, 'version', want, 'installed_ms', now)
redis.call('HSETNX', gate, 'drained_ms', now)
local c = redis.call('HMGET', gate, 'sealed_ms', 'drained_ms')
redis.call('XADD', KEYS[5], 'MAXLEN', ARGV[3], '*', 'ev', 'install', 'version', want, 'previous', cur,
  'sealed_ms', c[1] or '', 'drained_ms', c[2], 'ms', now)
return op_record(opkey, tonumber(ARGV[2]), {0, want, cur})
