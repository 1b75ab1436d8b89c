-- script: rb_take
-- Take n completed groups of a task, atomically and all-or-nothing (DESIGN
-- section 7, invariant 2): first expire the stale groups (min_version <
-- cutoff; retryable ones move to `expired` and keep their sessions, the others
-- are released, one event per session), then remove n groups in policy order
-- (fifo: by seq; staleness: oldest min_version first, then seq) and move their
-- sessions from the buffer to the taker. Fewer than n ready: nothing changes.
-- Keys protocol (lua/_lib/rb.lua): a call that lacks a group or session key
-- it needs returns NEED and writes nothing; the client calls again with them.
-- KEYS: 12+
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
-- KEYS[13..12+g] = ts:{R}:rb:g:<gid>       group hashes of the gids in ARGV
-- KEYS[13+g..12+g+s] = ts:{R}:s:<sid>      session hashes of the sids in ARGV
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
-- errors: OWNER_LOST (taker, lost_ms), INVALID_INPUT (field, message)
-- include: op
-- include: sessions
-- include: rb
local qc, vc, qe, ve = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local oreplay, otaker, released, events, sidskey, bkey = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local opkey, lost = KEYS[11], KEYS[12]
local n, cutoff, policy = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local taker, replay = ARGV[5], ARGV[6]
local window, max_stale = tonumber(ARGV[8]), tonumber(ARGV[9])
local cached = op_replay(opkey)
if cached then return cached end
local lost_ms = redis.call('ZSCORE', lost, taker)
if lost_ms then return {1, 'OWNER_LOST', taker, tonumber(lost_ms)} end
local gmap, smap = rb_keymap(12, 10)
if not gmap then return {1, 'INVALID_INPUT', 'keys', 'KEYS tail does not match the ids in ARGV'} end

-- plan (reads only)
local nstale = rb_count_stale(vc, cutoff)
if nstale > max_stale then return {0, 'EXPIRE_FIRST', nstale} end
local stale = rb_stale(vc, cutoff, 0)
local cand
if policy == 'staleness' then
  if cutoff == '' then
    cand = redis.call('ZRANGE', vc, 0, window - 1)
  else
    cand = redis.call('ZRANGEBYSCORE', vc, cutoff, '+inf', 'LIMIT', 0, window)
  end
else
  local is_stale = {}
  for _, g in ipairs(stale) do is_stale[g] = true end
  cand = {}
  for _, g in ipairs(redis.call('ZRANGE', qc, 0, window + #stale - 1)) do
    if not is_stale[g] then cand[#cand + 1] = g end
  end
end
if #cand < n then return {0, 'SHORT', #cand} end
local picked = {}
for i = 1, n do picked[i] = cand[i] end
local need_g, need_s = {}, {}
rb_missing(sidskey, stale, gmap, smap, need_g, need_s)
rb_missing(sidskey, picked, gmap, smap, need_g, need_s)
if #need_g > 0 or #need_s > 0 then
  -- name the whole window, so a retry survives other takers removing the head
  local extra = {}
  for i = n + 1, #cand do extra[#extra + 1] = cand[i] end
  rb_missing(sidskey, extra, gmap, smap, need_g, need_s)
  return rb_need_reply(need_g, need_s)
end

-- commit
local now = now_ms()
local kept, rel_s = {}, {}
for _, gid in ipairs(stale) do
  if rb_expire_group(gid, gmap[gid], '', qc, vc, qe, ve, oreplay, released, events, sidskey, bkey,
      smap, replay, now, rel_s) then
    kept[#kept + 1] = gid
  end
end
local out = {0, 'OK', #kept}
for _, g in ipairs(kept) do out[#out + 1] = g end
out[#out + 1] = #rel_s
for _, s in ipairs(rel_s) do out[#out + 1] = s end
out[#out + 1] = n
for _, gid in ipairs(picked) do
  rb_hand_over(gid, gmap[gid], qc, vc, oreplay, otaker, sidskey, bkey, smap, replay, taker, out)
end
return op_record(opkey, tonumber(ARGV[7]), out)
