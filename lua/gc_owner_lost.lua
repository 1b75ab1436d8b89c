-- script: gc_owner_lost
-- Release sessions of an owner whose heartbeat deadline passed (DESIGN section 5,
-- invariant 5). Checks the deadline itself, on the server clock, so an owner
-- that heart-beat after gc looked is left alone. On the first call it records
-- the owner in the lost zset and drops its heartbeat: from then on the owner
-- cannot heartbeat, open or receive sessions (no resurrection), and later
-- calls release whatever is still in its set. Releases go through
-- sessions_release (one event each, reason ARGV[2]).
-- Idempotent under client retry: the reply is recorded under the op key.
-- KEYS: 7+
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:owners        zset owner -> heartbeat deadline (ms)
-- KEYS[2] = ts:{R}:owners:lost   zset owner -> lost ms
-- KEYS[3] = ts:{R}:o:<owner>     set of sids owned by owner
-- KEYS[4] = ts:{R}:released      zset sid -> released ms
-- KEYS[5] = ts:{R}:events        stream of release events
-- KEYS[6] = ts:{R}:op:<op_id>    cached reply of this call (one op id per chunk)
-- KEYS[7] = ts:{R}:stats         hash of the run's counters
-- KEYS[8..7+n] = ts:{R}:s:<sid_i> session hashes (a snapshot of the owner set)
-- ARGV[1] = owner tag
-- ARGV[2] = reason ("owner-lost")
-- ARGV[3] = op reply TTL (ms)
-- ARGV[4..3+n] = sid_i
-- returns: {0, lost (0: owner alive, nothing done | 1), sid, ...} the released sids
-- errors: none
-- include: clock
-- include: op
-- include: stats
-- include: sessions
local owners, lost, okey, released, events, opkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local owner, reason = ARGV[1], ARGV[2]
local cached = op_replay(opkey)
if cached then return cached end
local now = now_ms()
if not redis.call('ZSCORE', lost, owner) then
  local deadline = redis.call('ZSCORE', owners, owner)
  if not deadline or tonumber(deadline) > now then
    return op_record(opkey, tonumber(ARGV[3]), {0, 0})
  end
  redis.call('ZADD', lost, now, owner)
  redis.call('ZREM', owners, owner)
end
local out = {0, 1}
local rel = {owner = owner, okey = okey, released = released, events = events, reason = reason, now = now,
  st = {}}
local skeys, sids = {}, {}
for i = 8, #KEYS do
  skeys[#skeys + 1] = KEYS[i]
  sids[#sids + 1] = ARGV[i - 4]
end
sessions_release(rel, skeys, sids, out)
sessions_release_flush(rel)
stats_flush(KEYS[7], rel.st)
return op_record(opkey, tonumber(ARGV[3]), out)
