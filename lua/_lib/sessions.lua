-- Session ownership primitives shared by the control-plane scripts.
-- A session hash ts:{R}:s:<sid> holds owner, state (live|released), born,
-- opened_ms, group. The owner set ts:{R}:o:<owner> lists live sids of owner.
-- Every key used here is passed in by the caller (from KEYS).

-- Move a live session from `from` to `to`; false unless `from` owns it.
local function session_move(skey, sid, from, to, okey_from, okey_to)
  local cur = redis.call('HMGET', skey, 'owner', 'state')
  if cur[2] ~= 'live' or cur[1] ~= from then return false end
  if from == to then return true end
  redis.call('HSET', skey, 'owner', to)
  redis.call('SREM', okey_from, sid)
  redis.call('SADD', okey_to, sid)
  return true
end

-- Release a live session owned by `rel.owner`: state, owner index, tombstone
-- and exactly one event, all in the calling script. False (and nothing
-- changed) unless that owner owns it and it is live. `rel` is the release
-- the caller makes, shared by its sessions: {owner, okey (the owner's set),
-- released (tombstones zset), events (stream), reason, now (ms)}.
local function session_release(skey, sid, rel)
  local cur = redis.call('HMGET', skey, 'owner', 'state')
  if cur[2] ~= 'live' or cur[1] ~= rel.owner then return false end
  redis.call('HSET', skey, 'state', 'released', 'released_ms', rel.now, 'reason', rel.reason)
  redis.call('SREM', rel.okey, sid)
  redis.call('ZADD', rel.released, rel.now, sid)
  redis.call('XADD', rel.events, '*', 'sid', sid, 'owner', rel.owner, 'reason', rel.reason, 'ms', rel.now)
  return true
end
