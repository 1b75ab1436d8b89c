-- script: open_sessions
-- Open many sessions owned by one owner, all or nothing per call (DESIGN section 5).
-- Every sid is checked before anything is written, so a conflict leaves no trace.
-- Idempotent under client retry: the reply is recorded under the op key.
-- KEYS: 5+
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:o:<owner>     set of sids owned by owner
-- KEYS[2] = ts:{R}:released      zset of released sids (tombstones)
-- KEYS[3] = ts:{R}:owners:lost   zset owner -> lost ms (a lost owner cannot open)
-- KEYS[4] = ts:{R}:op:<op_id>    cached reply of this call (one op id per chunk)
-- KEYS[5] = ts:{R}:stats         hash of the run's counters (sessions_opened)
-- KEYS[6..5+n] = ts:{R}:s:<sid_i> session hashes
-- ARGV[1] = owner tag
-- ARGV[2] = born: weight version at open (int)
-- ARGV[3] = group id ("" for none)
-- ARGV[4] = op reply TTL (ms)
-- ARGV[5..4+n] = sid_i (same order as the session keys; distinct)
-- returns: {0, opened_ms (int)}
-- errors: SESSION_EXISTS (sid, owner), SESSION_RELEASED (sid, detail), OWNER_LOST (owner, lost_ms)
-- include: clock
-- include: op
local okey, released, lost, opkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner = ARGV[1]
local cached = op_replay(opkey)
if cached then return cached end
local lost_ms = redis.call('ZSCORE', lost, owner)
if lost_ms then return {1, 'OWNER_LOST', owner, tonumber(lost_ms)} end
for i = 6, #KEYS do
  local sid = ARGV[i - 1]
  if redis.call('ZSCORE', released, sid) then
    return {1, 'SESSION_RELEASED', sid, 'released session ids cannot be reopened'}
  end
  local cur = redis.call('HMGET', KEYS[i], 'owner', 'state')
  if cur[2] == 'released' then
    return {1, 'SESSION_RELEASED', sid, 'released session ids cannot be reopened'}
  end
  if cur[2] then return {1, 'SESSION_EXISTS', sid, cur[1] or ''} end
end
local now = now_ms()
for i = 6, #KEYS do
  local sid = ARGV[i - 1]
  redis.call('HSET', KEYS[i], 'owner', owner, 'state', 'live', 'born', ARGV[2], 'opened_ms', now, 'group', ARGV[3])
  redis.call('SADD', okey, sid)
end
redis.call('HINCRBY', KEYS[5], 'sessions_opened', #KEYS - 5)
return op_record(opkey, tonumber(ARGV[4]), {0, now})
