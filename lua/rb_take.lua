-- script: rb_take
-- Take n completed groups of a task, atomically and all-or-nothing (DESIGN
-- section 7, invariant 2): first expire the stale groups (min_version <
-- cutoff; retryable ones move to `expired` and keep their sessions, the others
-- are released, one event per session), then remove n groups in policy order
-- (fifo: by seq; staleness: oldest min_version first, then seq) and move their
-- sessions from the buffer to the taker. Fewer than n ready: nothing changes.
-- Keys protocol (lua/_lib/rb.lua): a call that lacks a group or session key
-- it needs returns NEED and writes nothing; the client calls again with them.
-- KEYS: 13+
-- KEYS[1] = ts:{R}:rb:q:<task>:completed   zset gid -> seq
-- KEYS[2] = ts:{R}:rb:v:<task>:completed   zset gid -> min_version + seq/2^32
-- KEYS[3] = ts:{R}:rb:q:<task>:expired     zset gid -> seq
-- KEYS[4] = ts:{R}:rb:v:<task>:expired     zset gid -> min_version + seq/2^32
-- KEYS[5] = ts:{R}:o:<replay>              set: sessions of the buffer
-- KEYS[6] = ts:{R}:o:<taker>               set: sessions of the taker
-- KEYS[7] = ts:{R}:released                zset tombstones
-- KEYS[8] = ts:{R}:events                  stream of release events
-- KEYS[9] = ts:{R}:rb:sids                 hash gid -> sids (json)
-- KEYS[10] = ts:{R}:rb:bytes               hash "<status> <task>" -> bytes
-- KEYS[11] = ts:{R}:op:<op_id>             cached reply (retry idempotency)
-- KEYS[12] = ts:{R}:owners:lost            zset owner -> lost ms
-- KEYS[13] = ts:{R}:stats                 hash of the run's counters
-- KEYS[14..13+g] = ts:{R}:rb:g:<gid>       group hashes of the gids in ARGV
-- KEYS[14+g..13+g+s] = ts:{R}:s:<sid>      session hashes of the sids in ARGV
-- ARGV[1] = task
-- ARGV[2] = n (int >= 1)
-- ARGV[3] = cutoff: a group is stale when min_version < cutoff ("" = no bound)
-- ARGV[4] = policy: fifo | staleness
-- ARGV[5] = taker owner tag
-- ARGV[6] = buffer owner tag ("replay")
-- ARGV[7] = op reply TTL (ms)
-- ARGV[8] = window: groups to name in a NEED reply (>= n; more absorbs concurrent takers)
-- ARGV[9] = max stale groups expired inside this call (more: EXPIRE_FIRST)
-- ARGV[10] = g, ARGV[11..10+g] = gids, ARGV[11+g] = s, ARGV[12+g..] = sids
-- returns: {0, 'NEED', g, gid..., sid...}   missing keys; nothing written
--          {0, 'SHORT', ready}              fewer than n ready; nothing written
--          {0, 'EXPIRE_FIRST', stale}       too many stale groups for one call; nothing written
--          {0, 'OK', k, kept gid..., r, released sid..., m, m x (gid, status, sids, min_version,
--              seq, retryable, payload)}
-- errors: OWNER_LOST (taker, lost_ms), INVALID_INPUT (field, message),
--         CORRUPT (key, field, detail): a group the client could not decode; nothing written
-- include: clock
-- include: op
-- include: stats
-- include: sessions
-- include: rb
local rb = {qc = KEYS[1], vc = KEYS[2], qe = KEYS[3], ve = KEYS[4], oreplay = KEYS[5], oto = KEYS[6],
  released = KEYS[7], events = KEYS[8], sidskey = KEYS[9], bkey = KEYS[10],
  to = ARGV[5], replay = ARGV[6], rel_s = {}, st = {}}
local opkey = KEYS[11]
local n, cutoff, policy = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local window, max_stale = tonumber(ARGV[8]), tonumber(ARGV[9])
local early = rb_open(rb, opkey, KEYS[12], 13, 10)
if early then return early end

-- plan (reads only)
local nstale = rb_count_stale(rb.vc, cutoff)
if nstale > max_stale then return {0, 'EXPIRE_FIRST', nstale} end
local stale = rb_stale(rb.vc, cutoff, 0)
local cand
if policy == 'staleness' then
  if cutoff == '' then
    cand = redis.call('ZRANGE', rb.vc, 0, window - 1)
  else
    cand = redis.call('ZRANGEBYSCORE', rb.vc, cutoff, '+inf', 'LIMIT', 0, window)
  end
else
  local is_stale = {}
  for _, g in ipairs(stale) do is_stale[g] = true end
  cand = {}
  for _, g in ipairs(redis.call('ZRANGE', rb.qc, 0, window + #stale - 1)) do
    if not is_stale[g] then cand[#cand + 1] = g end
  end
end
if #cand < n then return {0, 'SHORT', #cand} end
local need = {g = {}, s = {}}
rb_missing(rb, stale, need)
local need_reply = rb_need_window(rb, cand, n, need)
if need_reply then return need_reply end
local corrupt = rb_check_groups(rb, stale, #stale) or rb_check_groups(rb, cand, n)
if corrupt then return corrupt end

-- commit
rb.now = now_ms()
local kept = {}
for _, gid in ipairs(stale) do
  if rb_expire_group(rb, gid, '') then kept[#kept + 1] = gid end
end
local out = {0, 'OK', #kept}
for _, g in ipairs(kept) do out[#out + 1] = g end
out[#out + 1] = #rb.rel_s
for _, s in ipairs(rb.rel_s) do out[#out + 1] = s end
out[#out + 1] = n
for i = 1, n do rb_hand_over(rb, cand[i], rb.qc, rb.vc, out) end
stats_add(rb.st, 'groups_taken', n)
sessions_release_flush(rb.rel)
stats_flush(KEYS[13], rb.st)
return op_record(opkey, tonumber(ARGV[7]), out)
