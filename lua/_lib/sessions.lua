-- Session ownership primitives shared by the control-plane scripts.
-- A live session is a hash ts:{R}:s:<sid> (owner, state = live, born,
-- opened_ms, group) and a member of its owner's set ts:{R}:o:<owner>. A
-- released session keeps no hash: its tombstone (ts:{R}:released, sid ->
-- released ms) alone says "released, once, ever" and its fields travel in
-- its release event. Every key used here is passed in by the caller (from
-- KEYS). Include stats first (session_release counts what it releases).

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

-- Release a live session owned by `rel.owner`: its hash goes, it leaves the
-- owner index, gets its tombstone and exactly one event (carrying the hash's
-- fields), and is counted, all in the calling script. False (and nothing
-- changed) unless that owner owns it and it is live. `rel` is the release
-- the caller makes, shared by its sessions: {owner, okey (the owner's set),
-- released (tombstones zset), events (stream), reason, now (ms), st (the
-- script's stats table)}; the caller flushes rel.st with stats_flush.
local function session_release(skey, sid, rel)
  local cur = redis.call('HMGET', skey, 'owner', 'state', 'born', 'opened_ms', 'group')
  if cur[2] ~= 'live' or cur[1] ~= rel.owner then return false end
  redis.call('DEL', skey)
  redis.call('SREM', rel.okey, sid)
  redis.call('ZADD', rel.released, rel.now, sid)
  redis.call('XADD', rel.events, '*', 'sid', sid, 'owner', rel.owner, 'reason', rel.reason,
    'ms', rel.now, 'born', cur[3] or '', 'opened_ms', cur[4] or '', 'group', cur[5] or '')
  stats_add(rel.st, 'sessions_released', 1)
  stats_add(rel.st, 'release_events', 1)
  return true
end
