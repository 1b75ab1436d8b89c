-- script: release
-- Release each given session that `owner` owns (DESIGN section 5, invariants 1, 2, 6):
-- exactly one event, its hash goes, it leaves the owner index, gets its
-- tombstone and is counted, atomically (lua/_lib/sessions.lua: sessions_release).
-- Sessions owned by someone else, unknown or already released are left
-- untouched and not returned.
-- Idempotent under client retry: the reply is recorded under the op key.
-- KEYS: 5+
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:o:<owner>     set of sids owned by owner
-- KEYS[2] = ts:{R}:released      zset sid -> released ms (tombstones)
-- KEYS[3] = ts:{R}:events        stream of release events
-- KEYS[4] = ts:{R}:op:<op_id>    cached reply of this call (one op id per chunk)
-- KEYS[5] = ts:{R}:stats         hash of the run's counters
-- KEYS[6..5+n] = ts:{R}:s:<sid_i> session hashes
-- ARGV[1] = owner tag
-- ARGV[2] = reason (printable id, e.g. "consumed")
-- ARGV[3] = op reply TTL (ms)
-- ARGV[4] = length of the session keys' head "ts:{R}:s:" (sid_i is the rest of KEYS[5+i]:
--           the ids are not sent twice)
-- returns: {0, "sid\nsid..."} the released sids in input order, joined by newlines (never
--          part of an id; "" when none): one string to record, send and split, not a
--          list of thousands
-- errors: none
-- include: clock
-- include: op
-- include: stats
-- include: sessions
local okey, released, events, opkey, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, reason = ARGV[1], ARGV[2]
local cached = op_replay(opkey)
if cached then return cached end
local rel = {owner = owner, okey = okey, released = released, events = events, reason = reason,
  now = now_ms(), st = {}}
local skeys, sids = {}, {}
local from, sub = tonumber(ARGV[4]) + 1, string.sub
for i = 6, #KEYS do
  local key = KEYS[i]
  skeys[i - 5] = key
  sids[i - 5] = sub(key, from)
end
local out = {}
sessions_release(rel, skeys, sids, out)
sessions_release_flush(rel)
stats_flush(stats, rel.st)
return op_record(opkey, tonumber(ARGV[3]), {0, table.concat(out, '\n')})
