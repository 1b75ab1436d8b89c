-- script: rb_put
-- Store a replay group and move its sessions from the putter to the buffer in
-- one atomic step (DESIGN section 7, invariant 1). A `failed` or `filtered`
-- group is never stored: its sessions are released at once (reason = status,
-- one event each). Nothing is written unless every session is live and owned
-- by the putter and the group id is not stored yet. Idempotent under retry.
-- KEYS: 13+
-- KEYS[1] = ts:{R}:rb:g:<gid>            hash: the group
-- KEYS[2] = ts:{R}:rb:q:<task>:<status>  zset gid -> seq (FIFO)
-- KEYS[3] = ts:{R}:rb:v:<task>:<status>  zset gid -> min_version + seq/2^32
-- KEYS[4] = ts:{R}:rb:seq                counter of put groups
-- KEYS[5] = ts:{R}:rb:tasks              set of task names
-- KEYS[6] = ts:{R}:rb:sids               hash gid -> sids (json)
-- KEYS[7] = ts:{R}:rb:bytes              hash "<status> <task>" -> bytes
-- KEYS[8] = ts:{R}:o:<owner>             set: sessions of the putter
-- KEYS[9] = ts:{R}:o:<replay>            set: sessions of the buffer
-- KEYS[10] = ts:{R}:released             zset tombstones
-- KEYS[11] = ts:{R}:events               stream of release events
-- KEYS[12] = ts:{R}:op:<op_id>           cached reply (retry idempotency)
-- KEYS[13] = ts:{R}:stats               hash of the run's counters (groups_put, releases)
-- KEYS[14..13+n] = ts:{R}:s:<sid_i>      session hashes, same order as the sids
-- ARGV[1] = gid
-- ARGV[2] = task
-- ARGV[3] = status: completed | aborted | expired | failed | filtered
-- ARGV[4] = sids (json array, same order as the session keys)
-- ARGV[5] = min_version (int, < 2^21)
-- ARGV[6] = retryable (0|1)
-- ARGV[7] = payload (json object)
-- ARGV[8] = owner tag of the putter
-- ARGV[9] = owner tag of the buffer ("replay")
-- ARGV[10] = op reply TTL (ms)
-- ARGV[11..10+n] = sid_i
-- returns: {0, 1, seq}               stored
--          {0, 0, 0, sid...}         failed/filtered: not stored, these sessions released
-- errors: GROUP_EXISTS (gid, status), NOT_OWNER (sid, owner, actual), SESSION_RELEASED (sid, detail),
--         INVALID_INPUT (field, message)
-- include: clock
-- include: op
-- include: stats
-- include: sessions
local gk, q, v, seqkey, tasks, sidskey, bkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local oown, oreplay, released, events, opkey = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local gid, task, status, sids_json = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local owner, replay = ARGV[8], ARGV[9]
local cached = op_replay(opkey)
if cached then return cached end

local existing = redis.call('HGET', gk, 'status')
if existing then return {1, 'GROUP_EXISTS', gid, existing} end
local n = #KEYS - 13
for i = 1, n do
  local sid = ARGV[10 + i]
  local cur = redis.call('HMGET', KEYS[13 + i], 'owner', 'state')
  if cur[2] == 'released' or redis.call('ZSCORE', released, sid) then
    return {1, 'SESSION_RELEASED', sid, 'a released session cannot join a replay group'}
  end
  if cur[2] ~= 'live' or cur[1] ~= owner then
    return {1, 'NOT_OWNER', sid, owner, cur[1] or ''}
  end
end

if status == 'failed' or status == 'filtered' then
  local rel = {owner = owner, okey = oown, released = released, events = events, reason = status,
    now = now_ms(), st = {}}
  local out = {0, 0, 0}
  local skeys, sids = {}, {}
  for i = 1, n do
    skeys[i] = KEYS[13 + i]
    sids[i] = ARGV[10 + i]
  end
  sessions_release(rel, skeys, sids, out)
  sessions_release_flush(rel)
  stats_flush(KEYS[13], rel.st)
  return op_record(opkey, tonumber(ARGV[10]), out)
end

local seq = tonumber(redis.call('GET', seqkey) or '0') + 1
if seq >= 4294967296 then
  return {1, 'INVALID_INPUT', 'seq', 'the replay buffer of this run has used all 2^32 sequence numbers'}
end
redis.call('SET', seqkey, seq)
local minv = tonumber(ARGV[5])
local bytes = #ARGV[7] + #sids_json
redis.call('HSET', gk, 'task', task, 'status', status, 'sids', sids_json, 'min_version', minv,
  'seq', seq, 'retryable', ARGV[6], 'payload', ARGV[7], 'bytes', bytes, 'put_ms', now_ms(),
  'producer', owner)
redis.call('ZADD', q, seq, gid)
redis.call('ZADD', v, minv + seq / 4294967296, gid)
redis.call('SADD', tasks, task)
redis.call('HSET', sidskey, gid, sids_json)
redis.call('HINCRBY', bkey, status .. ' ' .. task, bytes)
for i = 1, n do
  local sid = ARGV[10 + i]
  session_move(KEYS[13 + i], sid, owner, replay, oown, oreplay)
  redis.call('HSET', KEYS[13 + i], 'group', gid)
end
redis.call('HINCRBY', KEYS[13], 'groups_put', 1)
return op_record(opkey, tonumber(ARGV[10]), {0, 1, seq})
