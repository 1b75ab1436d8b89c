-- Session ownership primitives shared by the control-plane scripts.
-- A live session is a hash ts:{R}:s:<sid> (owner, state = live, born,
-- opened_ms, group) and a member of its owner's set ts:{R}:o:<owner>: a sid
-- is in o:<owner> exactly when its hash says owner = <owner>, state = live
-- (every script changes both together). A released session keeps no hash:
-- its tombstone (ts:{R}:released, sid -> released ms) alone says "released,
-- once, ever". Every key used here is passed in by the caller (from KEYS).
-- Include stats first (sessions_release counts what it releases).

-- Sessions released by this script call (their hashes go at the flush).
local sessions_gone = {}

-- Move a live session from `from` to `to`; false unless `from` owns it.
local function session_move(skey, sid, from, to, okey_from, okey_to)
  if sessions_gone[sid] then return false end
  local cur = redis.call('HMGET', skey, 'owner', 'state')
  if cur[2] ~= 'live' or cur[1] ~= from then return false end
  if from == to then return true end
  redis.call('HSET', skey, 'owner', to)
  redis.call('SREM', okey_from, sid)
  redis.call('SADD', okey_to, sid)
  return true
end

-- Release those of `sids` (session keys `skeys`, same order) that `rel.owner`
-- owns: each gets exactly one event, its hash goes, it leaves the owner
-- index, gets its tombstone and is counted, all in the calling script. The
-- others (owned by someone else, unknown, already released) are left
-- untouched. Appends the released sids to `out`, in input order.
-- `rel` is the release the caller makes: {owner, okey (the owner's set),
-- released (tombstones zset), events (stream), reason, now (ms), st (the
-- script's stats table)}. Ownership is read from the owner set (one
-- SMISMEMBER per 1,000 sessions); the hash deletions, owner-set removals and
-- tombstones are queued in `rel` and written by sessions_release_flush, which
-- the caller runs once before it returns. Per released session the script
-- then makes one call of its own, its XADD.
local function sessions_release(rel, skeys, sids, out)
  local q = rel.queued
  if not q then
    q = {keys = {}, sids = {}}
    rel.queued = q
  end
  -- Hot loop (10k sessions in a release): locals, not table fields; the time
  -- as a string once (a number argument is formatted again by every call).
  -- (redis.call is spelt out: tests/test_security.py lists the commands.)
  local gone, qkeys, qsids = sessions_gone, q.keys, q.sids
  local okey, events, owner, reason, ms = rel.okey, rel.events, rel.owner, rel.reason, tostring(rel.now)
  local nq, no = #qsids, #out
  local n = #sids
  for b = 1, n, 1000 do
    local e = math.min(b + 999, n)
    local owned = redis.call('SMISMEMBER', okey, unpack(sids, b, e))
    for i = b, e do
      local sid = sids[i]
      if owned[i - b + 1] == 1 and not gone[sid] then
        gone[sid] = true
        redis.call('XADD', events, '*', 'sid', sid, 'owner', owner, 'reason', reason, 'ms', ms)
        nq = nq + 1
        qkeys[nq] = skeys[i]
        qsids[nq] = sid
        no = no + 1
        out[no] = sid
      end
    end
  end
end

-- Write what sessions_release queued in `rel` (nil: nothing released): the
-- hashes go, the owner-set members go, the tombstones are added, the
-- releases are counted (into rel.st; the caller flushes its stats).
local function sessions_release_flush(rel)
  local q = rel and rel.queued
  if not q then return end
  local n = #q.sids
  for i = 1, n, 1000 do
    local j = math.min(i + 999, n)
    redis.call('DEL', unpack(q.keys, i, j))
    redis.call('SREM', rel.okey, unpack(q.sids, i, j))
    local z = {}
    for m = i, j do
      z[#z + 1] = rel.now
      z[#z + 1] = q.sids[m]
    end
    redis.call('ZADD', rel.released, unpack(z))
  end
  stats_add(rel.st, 'sessions_released', n)
  stats_add(rel.st, 'release_events', n)
  rel.queued = nil
end
