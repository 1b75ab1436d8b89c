-- script: gate_clear_poison
-- Resolve poisoned leases by hand (an operator or the trainer decided what
-- happened to those requests). Overdue live leases are first moved to the
-- poison set, so they can be cleared in the same call. Each cleared lease
-- record keeps the resolution and expires after the retention, and leaves
-- its holder's entries in the held index. Lease ids not in the poison set are
-- ignored. Idempotent under client retry (op id).
-- KEYS: 4+
-- CHUNK: 2000
-- KEYS[1] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[2] = ts:{R}:gate:poison     hash: lease id -> reason json
-- KEYS[3] = ts:{R}:op:<op_id>      string: the recorded reply
-- KEYS[4] = ts:{R}:gate:held       zset (scores 0): '<holder> <lease id>' of every unsettled lease
-- KEYS[5..n+4] = ts:{R}:gate:l:<lease>  hash of each lease
-- ARGV[1] = op record ttl (ms)
-- ARGV[2] = resolution (text)
-- ARGV[3] = retention of a resolved lease record (ms)
-- ARGV[4..n+3] = lease ids, in the order of KEYS[5..]
-- returns: {0, cleared lease ids...}
-- errors: none
-- include: clock
-- include: op
-- include: gate
local leases, poison, opkey, held = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local done = op_replay(opkey)
if done then return done end
local now = now_ms()
gate_sweep(leases, poison, now)
local out = {0}
for i = 5, #KEYS do
  local id = ARGV[i - 1]
  if redis.call('HDEL', poison, id) == 1 then
    out[#out + 1] = id
    if redis.call('EXISTS', KEYS[i]) == 1 then
      local h = redis.call('HMGET', KEYS[i], 'holder', 'held')
      if h[2] then redis.call('ZREM', held, h[1] .. ' ' .. id) end
      redis.call('HSET', KEYS[i], 'resolution', ARGV[2], 'resolved_ms', now)
      redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[3]))
    end
  end
end
return op_record(opkey, tonumber(ARGV[1]), out)
