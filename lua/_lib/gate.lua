-- Request-gate primitives shared by the gate_*.lua scripts (DESIGN section 6).
-- Live leases are members of the zset ts:{R}:gate:leases scored by their
-- deadline (ms, server clock); poisoned leases are fields of the hash
-- ts:{R}:gate:poison (lease id -> reason json). Every key used here is passed
-- in by the caller (from KEYS). Include clock first: gate_status_reply reads now_ms.

-- Move every live lease whose deadline has passed into the poison hash
-- (invariant 2: past its deadline, the outcome of a request is not known).
-- Returns the ids of the leases moved. O(log n + k).
local function gate_sweep(leases_key, poison_key, now)
  local overdue = redis.call('ZRANGEBYSCORE', leases_key, '-inf', '(' .. now, 'WITHSCORES')
  local ids = {}
  for i = 1, #overdue, 2 do
    local id = overdue[i]
    redis.call('HSETNX', poison_key, id, cjson.encode({
      reason = 'expired', deadline_ms = tonumber(overdue[i + 1]), at_ms = now }))
    ids[#ids + 1] = id
  end
  if #ids > 0 then
    redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', '(' .. now)
  end
  return ids
end

-- Wake drainers blocked on the signal list when the live set is empty. At
-- most one token is kept (a woken drainer re-checks the state in a script and
-- passes the token on), and it expires so an unused token leaves no garbage.
local function gate_signal_if_empty(leases_key, signal_key)
  if redis.call('ZCARD', leases_key) == 0 and redis.call('LLEN', signal_key) == 0 then
    redis.call('RPUSH', signal_key, '1')
    redis.call('PEXPIRE', signal_key, 60000)
    return 1
  end
  return 0
end

-- The gate's status as a flat reply (see gate_status.lua for its layout);
-- read-only, shared by gate_status and gate_seal so both answer alike.
local function gate_status_reply(gate, leases, poison, cap)
  local now = now_ms()
  local g = redis.call('HMGET', gate, 'state', 'version', 'sealed_ms', 'installed_ms')
  local live = redis.call('ZCOUNT', leases, now, '+inf')
  local nextd = redis.call('ZRANGEBYSCORE', leases, now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local out = {0, g[1] or 'open', tonumber(g[2] or '0'), tonumber(g[3] or '-1'),
    tonumber(g[4] or '-1'), now, live, tonumber(nextd[2] or '-1')}
  out[#out + 1] = redis.call('HLEN', poison)
  local items = redis.call('HSCAN', poison, 0, 'COUNT', cap)[2]
  local n = math.min(#items / 2, cap)
  out[#out + 1] = n
  for i = 1, 2 * n do out[#out + 1] = items[i] end
  local overdue = redis.call('ZRANGEBYSCORE', leases, '-inf', '(' .. now, 'WITHSCORES', 'LIMIT', 0, cap)
  out[#out + 1] = redis.call('ZCOUNT', leases, '-inf', '(' .. now)
  out[#out + 1] = #overdue / 2
  for i = 1, #overdue do out[#out + 1] = overdue[i] end
  return out
end

-- The unsettled leases of `holder` in the held index ts:{R}:gate:held, whose
-- members are '<holder> <lease id>' (scores 0): a holder tag holds no
-- whitespace, so the lexicographic range ['<holder> ', '<holder>!') is
-- exactly its members. O(log n + k).
local function gate_held_of(held_key, holder)
  local members = redis.call('ZRANGEBYLEX', held_key, '[' .. holder .. ' ', '(' .. holder .. '!')
  local out, n = {}, #holder + 2
  for i = 1, #members do out[i] = string.sub(members[i], n) end
  return out
end

-- Holders of ts:{R}:gate:holders whose heartbeat deadline passed (server
-- clock): a flat list {holder, deadline, ...}, oldest deadline first, at most `cap`
-- holders (-1 for all). A holder that never heart-beat is not in the zset.
local function gate_dead_holders(holders_key, now, cap)
  if cap and cap >= 0 then
    return redis.call('ZRANGEBYSCORE', holders_key, '-inf', '(' .. now, 'WITHSCORES', 'LIMIT', 0, cap)
  end
  return redis.call('ZRANGEBYSCORE', holders_key, '-inf', '(' .. now, 'WITHSCORES')
end

-- The retry hint (ms) of an admission refused by a sealed gate, from the gate
-- hash: an operator's seal (sealed_by empty) gives its own hint (retry_ms). A
-- weight update's seal gives the wait it expects: the last weight-update
-- cycle's sealed time (cycle_ms) minus the time sealed so far; without one,
-- or once past it, as long again as it has been sealed; never past the drain
-- deadline (drain_by_ms, while not drained: the update fails and reopens
-- then). Bounded by retry_ms below and 60 s above (what SDKs honour).
local function gate_retry_hint(gate, now)
  local g = redis.call('HMGET', gate, 'retry_ms', 'sealed_ms', 'sealed_by', 'drain_by_ms', 'drained_ms', 'cycle_ms')
  local floor = tonumber(g[1] or '500')
  if (g[3] or '') == '' then return floor end
  local elapsed = math.max(0, now - tonumber(g[2] or now))
  local est = elapsed
  if g[6] and tonumber(g[6]) > elapsed then est = tonumber(g[6]) - elapsed end
  if g[4] and not g[5] then est = math.min(est, tonumber(g[4]) - now) end
  return math.max(floor, math.min(est, 60000))
end
