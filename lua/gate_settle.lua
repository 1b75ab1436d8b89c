-- script: gate_settle
-- Settle a lease with its outcome and return the settlement receipt. The
-- first settlement is final: settling again (a retry, or a second caller)
-- returns the first receipt unchanged. Outcome `unknown` poisons the lease;
-- a definite outcome resolves a poison entry left by an expired deadline
-- (a late settle). The settle that empties the live set signals drainers.
-- A definite settlement keeps only the receipt (sid, version, outcome,
-- settled_ms, late when 1, resolution and resolved_ms when given) and expires
-- after the retention; a poisoned lease keeps its whole record, without
-- expiry, until someone resolves it. Every first settlement of a lease in the
-- held index (`held` 1) removes it from its holder's entries there.
-- A lease id never admitted (an admit whose reply was lost and which never
-- ran, or a lease whose receipt expired) is fenced: its record becomes a
-- receipt with `fenced` 1 for the retention, and gate_admit_many refuses an
-- admit with that id (LEASE_FENCED), so the lost admit cannot arrive later
-- and leave a lease nobody serves. Nothing else changes: no poison, no signal.
-- Mode 'dead' (resolving the leases of a holder that stopped heart-beating)
-- settles an unsettled lease only when its holder's heartbeat deadline has
-- passed on the server clock: a holder that heart-beat since the caller
-- looked (it came back), or that never heart-beat, keeps its lease
-- (HOLDER_NOT_DEAD, nothing written).
-- A replayed receipt rewrites one of its fields to its own value: a write,
-- so that a durability wait after a retry on a new connection covers the
-- first settlement instead of confirming at once (pcall: a primary refusing
-- writes still answers the replay).
-- KEYS: 6
-- KEYS[1] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[2] = ts:{R}:gate:poison     hash: lease id -> reason json
-- KEYS[3] = ts:{R}:gate:signal     list: drain wake-up token
-- KEYS[4] = ts:{R}:gate:l:<lease>  hash of the lease (replaced by its receipt)
-- KEYS[5] = ts:{R}:gate:holders    zset: holder -> heartbeat deadline ms (read, mode 'dead')
-- KEYS[6] = ts:{R}:gate:held       zset (scores 0): '<holder> <lease id>' of every unsettled lease
-- ARGV[1] = lease id
-- ARGV[2] = outcome: completed | aborted | failed | unknown
-- ARGV[3] = retention of a settled, unpoisoned lease record and of a fence (ms)
-- ARGV[4] = mode: '' (settle) | 'dead' (only if the lease's holder stopped heart-beating)
-- ARGV[5] = resolution ('' none): kept on the receipt
-- returns: {0, lease id, outcome, version (int, -1 when fenced), settled_ms (int), late (0|1), poisoned (0|1), first (0|1), admitted (0|1), resolution ('' none)}
-- errors: HOLDER_NOT_DEAD (lease id, holder, heartbeat deadline ms or -1 when it never heart-beat): nothing written
-- include: clock
-- include: gate
local leases, poison, signal, lkey, holders, held = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, outcome, mode, resolution = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
local l = redis.call('HMGET', lkey, 'version', 'deadline_ms', 'outcome', 'settled_ms', 'late', 'rpoisoned', 'sid',
  'fenced', 'holder', 'resolution', 'held')
if l[8] then
  redis.pcall('HSET', lkey, 'fenced', l[8])
  return {0, id, l[3], -1, tonumber(l[4]), 0, 0, 0, 0, l[10] or ''}
end
if not l[1] then
  local at = now_ms()
  redis.call('HSET', lkey, 'outcome', outcome, 'settled_ms', at, 'fenced', 1)
  if resolution ~= '' then redis.call('HSET', lkey, 'resolution', resolution, 'resolved_ms', at) end
  redis.call('PEXPIRE', lkey, tonumber(ARGV[3]))
  return {0, id, outcome, -1, at, 0, 0, 1, 0, resolution}
end
if l[3] then
  redis.pcall('HSET', lkey, 'outcome', l[3])
  return {0, id, l[3], tonumber(l[1]), tonumber(l[4]), tonumber(l[5] or '0'), tonumber(l[6] or '0'), 0, 1,
    l[10] or ''}
end
local now = now_ms()
local holder = l[9] or ''
if mode == 'dead' then
  local hb = redis.call('ZSCORE', holders, holder)
  if not hb or tonumber(hb) >= now then
    return {1, 'HOLDER_NOT_DEAD', id, holder, tonumber(hb or '-1')}
  end
end
local late = 0
if now > tonumber(l[2]) then late = 1 end
local removed = redis.call('ZREM', leases, id)
if l[11] then redis.call('ZREM', held, holder .. ' ' .. id) end
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
  -- the live fields (holder, admitted_ms, ttl_ms, deadline_ms, engine, request) are not needed any
  -- more; the session id stays so that an operator can tell which session a settled lease served
  redis.call('DEL', lkey)
  redis.call('HSET', lkey, 'sid', l[7] or '', 'version', l[1], 'outcome', outcome, 'settled_ms', now)
  if late == 1 then redis.call('HSET', lkey, 'late', 1) end
  redis.call('PEXPIRE', lkey, tonumber(ARGV[3]))
end
if resolution ~= '' then redis.call('HSET', lkey, 'resolution', resolution, 'resolved_ms', now) end
removed = removed + #gate_sweep(leases, poison, now)
if removed > 0 then
  gate_signal_if_empty(leases, signal)
end
return {0, id, outcome, tonumber(l[1]), now, late, poisoned, 1, 1, resolution}
