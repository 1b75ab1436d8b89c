-- script: gate_renew
-- Extend a live lease's deadline to now + ttl (server clock). A lease already
-- past its deadline is not revived: it is moved to the poison set and the
-- call fails, because its request may have been presumed lost meanwhile.
-- Idempotent under client retry: the reply is recorded under the op key.
-- KEYS: 4
-- KEYS[1] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[2] = ts:{R}:gate:poison     hash: lease id -> reason json
-- KEYS[3] = ts:{R}:gate:l:<lease>  hash of the lease
-- KEYS[4] = ts:{R}:op:<op_id>      string: the recorded reply
-- ARGV[1] = lease id
-- ARGV[2] = ttl (ms, > 0), or 0 for the ttl the lease was admitted with
-- ARGV[3] = op record ttl (ms)
-- returns: {0, lease id, version (int), deadline_ms (int)}
-- errors: UNKNOWN_LEASE (lease id), INVALID_INPUT ("lease", already settled), GATE_POISONED (lease id)
-- include: clock
-- include: op
-- include: gate
local leases, poison, lkey, opkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local done = op_replay(opkey)
if done then return done end
local id = ARGV[1]
local l = redis.call('HMGET', lkey, 'version', 'ttl_ms', 'outcome')
if not l[1] then
  return {1, 'UNKNOWN_LEASE', id}
end
if l[3] then
  return {1, 'INVALID_INPUT', 'lease', 'lease ' .. id .. ' was already settled (' .. l[3] .. '); admit a new lease'}
end
local now = now_ms()
gate_sweep(leases, poison, now)
if not redis.call('ZSCORE', leases, id) then
  return {1, 'GATE_POISONED', id}
end
local ttl = tonumber(ARGV[2])
if ttl <= 0 then ttl = tonumber(l[2]) end
local deadline = now + ttl
redis.call('ZADD', leases, 'XX', deadline, id)
redis.call('HSET', lkey, 'deadline_ms', deadline)
return op_record(opkey, tonumber(ARGV[3]), {0, id, tonumber(l[1]), deadline})
