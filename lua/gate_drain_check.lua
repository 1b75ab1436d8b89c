-- script: gate_drain_check
-- One step of drain: move overdue leases to the poison set, then report the
-- live count. When leases are live it deletes the wake-up token in the same
-- atomic step (so the token a drainer then blocks on can only come from a
-- later settle: no stale wake-up, no lost one) and says how long the caller
-- may block before the earliest deadline needs expiring. When none is live
-- it leaves a token for any other drainer blocked on the list. The first
-- check that finds a sealed gate with no live lease records when it drained
-- (drained_ms, kept until the gate reopens; the gate's log reports it).
-- It also names the live leases held by holders whose heartbeat stopped:
-- nobody will settle them but a resolver (weight_update gives up on a drain
-- that only waits for those, instead of holding the seal for its timeout).
-- KEYS: 6
-- KEYS[1] = ts:{R}:gate            hash: state, version, drained_ms (set once per seal)
-- KEYS[2] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[3] = ts:{R}:gate:poison     hash: lease id -> reason json
-- KEYS[4] = ts:{R}:gate:signal     list: drain wake-up token
-- KEYS[5] = ts:{R}:gate:holders    zset: holder -> heartbeat deadline ms (read)
-- KEYS[6] = ts:{R}:gate:held       zset (scores 0): '<holder> <lease id>' of every unsettled lease (read)
-- ARGV[1] = max ids to return per list
-- returns: {0, state, version (int), live (int), wait_ms (int, -1 when live = 0),
--           n_new, new poisoned ids..., n_dead (live leases of dead holders), k, their ids (first ARGV[1])...,
--           n_poisoned (total), poisoned ids (first ARGV[1])...}
-- errors: none
-- include: clock
-- include: gate
local gate, leases, poison, signal, holders, held = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local cap = tonumber(ARGV[1])
local now = now_ms()
local swept = gate_sweep(leases, poison, now)
local live = redis.call('ZCARD', leases)
local wait = -1
local dead_ids = {}
if live > 0 then
  redis.call('DEL', signal)
  local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
  wait = math.max(1, tonumber(first[2]) - now + 1)
  local dead = gate_dead_holders(holders, now)
  for i = 1, #dead, 2 do
    for _, id in ipairs(gate_held_of(held, dead[i])) do
      if redis.call('ZSCORE', leases, id) then dead_ids[#dead_ids + 1] = id end
    end
  end
else
  gate_signal_if_empty(leases, signal)
end
local g = redis.call('HMGET', gate, 'state', 'version')
if live == 0 and g[1] == 'sealed' then redis.call('HSETNX', gate, 'drained_ms', now) end
local out = {0, g[1] or 'open', tonumber(g[2] or '0'), live, wait, #swept}
for i = 1, #swept do out[#out + 1] = swept[i] end
out[#out + 1] = #dead_ids
out[#out + 1] = math.min(#dead_ids, cap)
for i = 1, math.min(#dead_ids, cap) do out[#out + 1] = dead_ids[i] end
out[#out + 1] = redis.call('HLEN', poison)
local ids = redis.call('HKEYS', poison)
for i = 1, math.min(#ids, cap) do out[#out + 1] = ids[i] end
return out
