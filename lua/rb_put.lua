-- script: rb_put
-- Store a replay group and move its sessions from the putter to the buffer in
-- one atomic step (DESIGN section 7, invariant 1). Never stored, its sessions
-- released at once (one event each): a `failed` or `filtered` group (reason =
-- status), a non-retryable `expired` group and a non-retryable group already
-- stale at put (reason 'expired'). A retryable group stale at put is stored as
-- `expired`; with per-member expiry (not for agentic groups) only its stale
-- members are released and listed in `reroll`. Nothing is written unless
-- every session is live and owned by the putter and the group id is not
-- stored yet. Idempotent under retry. Group layout: lua/_lib/rb.lua.
-- Counted in ts:{R}:stats: groups_put for a stored group (and groups_expired
-- when it is stored as `expired` at put), the released sessions.
-- KEYS: 18+
-- KEYS[1] = ts:{R}:rb:groups             hash gid -> record (json)
-- KEYS[2] = ts:{R}:rb:sids               hash gid -> sids (json)
-- KEYS[3] = ts:{R}:rb:payloads           hash gid -> payload (json)
-- KEYS[4] = ts:{R}:rb:seq                counter of put groups
-- KEYS[5] = ts:{R}:rb:tasks              set of task names
-- KEYS[6] = ts:{R}:rb:bytes              hash "<status> <task>" -> bytes
-- KEYS[7] = ts:{R}:o:<owner>             set: sessions of the putter
-- KEYS[8] = ts:{R}:o:<replay>            set: sessions of the buffer
-- KEYS[9] = ts:{R}:released              zset tombstones
-- KEYS[10] = ts:{R}:events               stream of release events
-- KEYS[11] = ts:{R}:op:<op_id>           cached reply (retry idempotency)
-- KEYS[12] = ts:{R}:stats                hash of the run's counters
-- CELLS: <status> expired
-- KEYS[13..18] = the group's cells: its status (ARGV[3]) and expired (a group expired at put),
--     each the keys of its indexes (lua/_lib/rb.lua rb_cells; tracestore/replay/layout.py task_keys)
-- KEYS[19..18+n] = ts:{R}:s:<sid_i>      session hashes, same order as the sids
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
-- ARGV[11] = agentic (0|1)
-- ARGV[12] = member versions (json array of ints, one per sid: oldest token version of each)
-- ARGV[13] = cutoff: the group is stale when min_version < cutoff ("" = no expiry at put)
-- ARGV[14] = per-member expiry (0|1)
-- ARGV[15] = priority index score: -payload.priority ("" = the payload has no priority)
-- ARGV[16..15+n] = sid_i
-- returns: {0, stored (0|1), seq (0 when not stored), status stored ("" when not), released sid...}
-- errors: GROUP_EXISTS (gid, status), NOT_OWNER (sid, owner, actual), SESSION_RELEASED (sid, detail),
--         INVALID_INPUT (field, message)
-- include: clock
-- include: op
-- include: stats
-- include: sessions
-- include: rb
local groups, sidskey, payloads = KEYS[1], KEYS[2], KEYS[3]
local seqkey, tasks, bkey = KEYS[4], KEYS[5], KEYS[6]
local oown, oreplay, released, events, opkey = KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local statskey = KEYS[12]
local A0 = 15
local gid, task, status = ARGV[1], ARGV[2], ARGV[3]
local cells, K0 = rb_cells(12, task, {status, 'expired'})
if not cells then return K0 end
local cell = cells[status]
local minv, retryable = tonumber(ARGV[5]), ARGV[6]
local owner, replay, ttl = ARGV[8], ARGV[9], tonumber(ARGV[10])
local agentic, cutoff, per_member = ARGV[11], ARGV[13], ARGV[14]
local cached = op_replay(opkey)
if cached then return cached end

local existing = redis.call('HGET', groups, gid)
if existing then return {1, 'GROUP_EXISTS', gid, cjson.decode(existing).status} end
local n = #KEYS - K0
for i = 1, n do
  local sid = ARGV[A0 + i]
  local cur = redis.call('HMGET', KEYS[K0 + i], 'owner', 'state')
  if cur[2] == 'released' or redis.call('ZSCORE', released, sid) then
    return {1, 'SESSION_RELEASED', sid, 'a released session cannot join a replay group'}
  end
  if cur[2] ~= 'live' or cur[1] ~= owner then
    return {1, 'NOT_OWNER', sid, owner, cur[1] or ''}
  end
end

local stale = cutoff ~= '' and (status == 'completed' or status == 'aborted') and minv < tonumber(cutoff)
local reason = nil
if status == 'failed' or status == 'filtered' then
  reason = status
elseif (status == 'expired' or stale) and retryable ~= '1' then
  reason = 'expired'
end
local st = {}
local rel = {owner = owner, okey = oown, released = released, events = events, now = now_ms(), st = st}
if reason then
  rel.reason = reason
  local out = {0, 0, 0, ''}
  local skeys, sids = {}, {}
  for i = 1, n do
    skeys[i] = KEYS[K0 + i]
    sids[i] = ARGV[A0 + i]
  end
  sessions_release(rel, skeys, sids, out)
  sessions_release_flush(rel)
  stats_flush(statskey, st)
  return op_record(opkey, ttl, out)
end

local seq = tonumber(redis.call('GET', seqkey) or '0') + 1
if seq >= RB_TWO32 then
  return {1, 'INVALID_INPUT', 'seq', 'the replay buffer of this run has used all 2^32 sequence numbers'}
end
redis.call('SET', seqkey, seq)
if stale then
  status, cell = 'expired', cells.expired
end
-- members kept (moved to the buffer) and released (per-member expiry at put)
local mv = cjson.decode(ARGV[12])
local drop = {}
if stale and per_member == '1' and agentic ~= '1' then
  drop = rb_stale_members(mv, tonumber(cutoff))
end
rel.reason = 'expired'
local keep, keep_mv, reroll, out_rel = {}, {}, {}, {}
local rkeys = {}
for i = 1, n do
  local sid = ARGV[A0 + i]
  if drop[i] then
    reroll[#reroll + 1] = sid
    rkeys[#rkeys + 1] = KEYS[K0 + i]
  else
    keep[#keep + 1] = sid
    keep_mv[#keep_mv + 1] = mv[i]
    session_move(KEYS[K0 + i], sid, owner, replay, oown, oreplay)
    redis.call('HSET', KEYS[K0 + i], 'group', gid)
  end
end
sessions_release(rel, rkeys, reroll, out_rel)
sessions_release_flush(rel)
local sids_json, mv_json = ARGV[4], ARGV[12]
if #reroll > 0 then sids_json, mv_json = rb_json_list(keep), rb_json_list(keep_mv) end
local rec = rb_rec({task = task, status = status, min_version = minv, seq = seq, retryable = retryable,
  agentic = agentic, mv_json = mv_json, reroll_json = rb_json_list(reroll), put_ms = rel.now,
  producer = owner})
redis.call('HSET', groups, gid, rec)
redis.call('HSET', sidskey, gid, sids_json)
redis.call('HSET', payloads, gid, ARGV[7])
rb_index_put(cell, gid, seq, minv, ARGV[15])
redis.call('SADD', tasks, task)
redis.call('HINCRBY', bkey, status .. ' ' .. task, #rec + #sids_json + #ARGV[7])
stats_add(st, 'groups_put', 1)
if stale then stats_add(st, 'groups_expired', 1) end
stats_flush(statskey, st)
local out = {0, 1, seq, status}
for _, sid in ipairs(out_rel) do out[#out + 1] = sid end
return op_record(opkey, ttl, out)
