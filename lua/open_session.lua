-- script: open_session
-- Open a session owned by ARGV[2] (DESIGN section 5). Idempotent under retry.
-- KEYS: 6
-- KEYS[1] = ts:{R}:s:<sid>       hash: owner, state, born, opened_ms, group
-- KEYS[2] = ts:{R}:o:<owner>     set of sids owned by owner
-- KEYS[3] = ts:{R}:released      zset of released sids (tombstones)
-- KEYS[4] = ts:{R}:op:<op_id>    cached reply of this call (retry idempotency)
-- KEYS[5] = ts:{R}:owners:lost   zset owner -> lost ms (a lost owner cannot open)
-- KEYS[6] = ts:{R}:stats         hash of the run's counters (sessions_opened)
-- ARGV[1] = sid
-- ARGV[2] = owner tag
-- ARGV[3] = born: weight version at open (int)
-- ARGV[4] = group id ("" for none)
-- ARGV[5] = op reply TTL (ms)
-- returns: {0, opened_ms (int)}
-- errors: SESSION_EXISTS (sid, owner), SESSION_RELEASED (sid, detail), OWNER_LOST (owner, lost_ms)
-- include: clock
-- include: op
local skey, okey, released, opkey, lost = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local sid, owner = ARGV[1], ARGV[2]
local cached = op_replay(opkey)
if cached then return cached end
if redis.call('ZSCORE', released, sid) then
  return {1, 'SESSION_RELEASED', sid, 'released session ids cannot be reopened'}
end
local cur = redis.call('HMGET', skey, 'owner', 'state')
if cur[2] == 'released' then
  return {1, 'SESSION_RELEASED', sid, 'released session ids cannot be reopened'}
end
if cur[2] then
  return {1, 'SESSION_EXISTS', sid, cur[1] or ''}
end
local lost_ms = redis.call('ZSCORE', lost, owner)
if lost_ms then return {1, 'OWNER_LOST', owner, tonumber(lost_ms)} end
local now = now_ms()
redis.call('HSET', skey, 'owner', owner, 'state', 'live', 'born', ARGV[3], 'opened_ms', now, 'group', ARGV[4])
redis.call('SADD', okey, sid)
redis.call('HINCRBY', KEYS[6], 'sessions_opened', 1)
return op_record(opkey, tonumber(ARGV[5]), {0, now})
