-- script: release
-- Release each given session that `owner` owns (DESIGN section 5, invariants 1, 2, 6):
-- state, owner index, tombstone and exactly one event per released session,
-- atomically (lua/_lib/sessions.lua: session_release). Sessions owned by someone
-- else, unknown or already released are left untouched and not returned.
-- Idempotent under client retry: the reply is recorded under the op key.
-- KEYS: 4+
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:o:<owner>     set of sids owned by owner
-- KEYS[2] = ts:{R}:released      zset sid -> released ms (tombstones)
-- KEYS[3] = ts:{R}:events        stream of release events
-- KEYS[4] = ts:{R}:op:<op_id>    cached reply of this call (one op id per chunk)
-- KEYS[5..4+n] = ts:{R}:s:<sid_i> session hashes
-- ARGV[1] = owner tag
-- ARGV[2] = reason (printable id, e.g. "consumed")
-- ARGV[3] = op reply TTL (ms)
-- ARGV[4..3+n] = sid_i (same order as the session keys)
-- returns: {0, sid, ...} the released sids, in input order
-- errors: none
-- include: clock
-- include: op
-- include: sessions
local okey, released, events, opkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, reason = ARGV[1], ARGV[2]
local cached = op_replay(opkey)
if cached then return cached end
local rel = {owner = owner, okey = okey, released = released, events = events, reason = reason,
  now = now_ms()}
local out = {0}
for i = 5, #KEYS do
  local sid = ARGV[i - 1]
  if session_release(KEYS[i], sid, rel) then
    out[#out + 1] = sid
  end
end
return op_record(opkey, tonumber(ARGV[3]), out)
