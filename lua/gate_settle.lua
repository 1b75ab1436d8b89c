-- script: gate_settle
-- Settle a lease with its outcome and return the settlement receipt. The
-- first settlement is final: settling again (a retry, or a second caller)
-- returns the first receipt unchanged. Outcome `unknown` poisons the lease;
-- a definite outcome resolves a poison entry left by an expired deadline
-- (a late settle). The settle that empties the live set signals drainers.
-- A definite settlement keeps only the receipt (sid, version, outcome,
-- settled_ms, late when 1) and expires after the retention; a poisoned lease
-- keeps its whole record, without expiry, until someone resolves it.
-- A lease id never admitted (an admit whose reply was lost and which never
-- ran, or a lease whose receipt expired) is fenced: its record becomes a
-- receipt with `fenced` 1 for the retention, and gate_admit_many refuses an
-- admit with that id (LEASE_FENCED), so the lost admit cannot arrive later
-- and leave a lease nobody serves. Nothing else changes: no poison, no signal.
-- KEYS: 4
-- KEYS[1] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[2] = ts:{R}:gate:poison     hash: lease id -> reason json
-- KEYS[3] = ts:{R}:gate:signal     list: drain wake-up token
-- KEYS[4] = ts:{R}:gate:l:<lease>  hash of the lease (replaced by its receipt)
-- ARGV[1] = lease id
-- ARGV[2] = outcome: completed | aborted | failed | unknown
-- ARGV[3] = retention of a settled, unpoisoned lease record and of a fence (ms)
-- returns: {0, lease id, outcome, version (int, -1 when fenced), settled_ms (int), late (0|1), poisoned (0|1), first (0|1), admitted (0|1)}
-- errors: none
-- include: clock
-- include: gate
local leases, poison, signal, lkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, outcome = ARGV[1], ARGV[2]
local l = redis.call('HMGET', lkey, 'version', 'deadline_ms', 'outcome', 'settled_ms', 'late', 'rpoisoned', 'sid', 'fenced')
if l[8] then
  return {0, id, l[3], -1, tonumber(l[4]), 0, 0, 0, 0}
end
if not l[1] then
  local at = now_ms()
  redis.call('HSET', lkey, 'outcome', outcome, 'settled_ms', at, 'fenced', 1)
  redis.call('PEXPIRE', lkey, tonumber(ARGV[3]))
  return {0, id, outcome, -1, at, 0, 0, 1, 0}
end
if l[3] then
  return {0, id, l[3], tonumber(l[1]), tonumber(l[4]), tonumber(l[5] or '0'), tonumber(l[6] or '0'), 0, 1}
end
local now = now_ms()
local late = 0
if now > tonumber(l[2]) then late = 1 end
local removed = redis.call('ZREM', leases, id)
local poisoned = 0
if outcome == 'unknown' then
  redis.call('HSET', poison, id, cjson.encode({ reason = 'unknown', at_ms = now }))
  poisoned = 1
else
  redis.call('HDEL', poison, id)
end
if poisoned == 1 then
  redis.call('HSET', lkey, 'outcome', outcome, 'settled_ms', now, 'late', late, 'rpoisoned', 1)
else
  -- the live fields (holder, admitted_ms, ttl_ms, deadline_ms) are not needed any more; the
  -- session id stays so that an operator can tell which session a settled lease served
  redis.call('DEL', lkey)
  redis.call('HSET', lkey, 'sid', l[7] or '', 'version', l[1], 'outcome', outcome, 'settled_ms', now)
  if late == 1 then redis.call('HSET', lkey, 'late', 1) end
  redis.call('PEXPIRE', lkey, tonumber(ARGV[3]))
end
removed = removed + #gate_sweep(leases, poison, now)
if removed > 0 then
  gate_signal_if_empty(leases, signal)
end
return {0, id, outcome, tonumber(l[1]), now, late, poisoned, 1, 1}
