#!lua flags=no-writes
-- script: gate_dead_leases
-- The unsettled leases of holders whose heartbeat deadline passed (server
-- clock): the leases a resolver aborts at their engines, then settles with
-- gate_settle in mode 'dead' (which checks the holder again). Each lease's
-- state: 'live' (within its deadline), 'overdue' (past it, not yet swept),
-- 'poisoned' (swept into the poison set: its outcome is unknown, a definite
-- settle resolves it) or 'gone' (neither: not listed by a later script call).
-- Dead holders without a lease are listed too (with 0), for gc to forget.
-- Holders that never heart-beat are not listed: their leases are left to
-- their deadlines. Reads only.
-- KEYS: 4
-- KEYS[1] = ts:{R}:gate:holders    zset holder -> heartbeat deadline (ms)
-- KEYS[2] = ts:{R}:gate:held       zset (scores 0): '<holder> <lease id>' of every unsettled lease
-- KEYS[3] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[4] = ts:{R}:gate:poison     hash: lease id -> reason json
-- ARGV[1] = most leases to list (the holders after the one that reaches it are left out)
-- returns: {0, now_ms, n (dead holders listed), then per holder: holder, deadline_ms (int), k, (lease id, state) x k}
-- errors: none
-- include: clock
-- include: gate
local holders, held, leases, poison = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local cap = tonumber(ARGV[1])
local now = now_ms()
local dead = gate_dead_holders(holders, now)
local out = {0, now, 0}
local listed = 0
for i = 1, #dead, 2 do
  if listed >= cap then break end
  local ids = gate_held_of(held, dead[i])
  out[3] = out[3] + 1
  out[#out + 1] = dead[i]
  out[#out + 1] = tonumber(dead[i + 1])
  out[#out + 1] = #ids
  for _, id in ipairs(ids) do
    local d = redis.call('ZSCORE', leases, id)
    local state = 'gone'
    if d then
      if tonumber(d) >= now then state = 'live' else state = 'overdue' end
    elseif redis.call('HEXISTS', poison, id) == 1 then
      state = 'poisoned'
    end
    out[#out + 1] = id
    out[#out + 1] = state
  end
  listed = listed + #ids
end
return out
