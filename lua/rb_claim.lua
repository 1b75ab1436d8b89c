-- script: rb_claim
-- Claim back up to n retryable groups of a task (status `aborted` or
-- `expired`) for a producer, oldest put first (by seq across both statuses):
-- their sessions move from the buffer to the producer's owner tag and the
-- groups leave the buffer, atomically. Keys protocol as in lua/_lib/rb.lua.
-- KEYS: 10+
-- KEYS[1] = ts:{R}:rb:q:<task>:aborted     zset gid -> seq
-- KEYS[2] = ts:{R}:rb:v:<task>:aborted     zset gid -> min_version + seq/2^32
-- KEYS[3] = ts:{R}:rb:q:<task>:expired     zset gid -> seq
-- KEYS[4] = ts:{R}:rb:v:<task>:expired     zset gid -> min_version + seq/2^32
-- KEYS[5] = ts:{R}:o:<replay>              set: sessions of the buffer
-- KEYS[6] = ts:{R}:o:<owner>               set: sessions of the producer
-- KEYS[7] = ts:{R}:rb:sids                 hash gid -> sids (json)
-- KEYS[8] = ts:{R}:rb:bytes                hash "<status> <task>" -> bytes
-- KEYS[9] = ts:{R}:op:<op_id>              cached reply (retry idempotency)
-- KEYS[10] = ts:{R}:owners:lost            zset owner -> lost ms
-- KEYS[11..10+g] = ts:{R}:rb:g:<gid>       group hashes of the gids in ARGV
-- KEYS[11+g..10+g+s] = ts:{R}:s:<sid>      session hashes of the sids in ARGV
-- ARGV[1] = task
-- ARGV[2] = n (int >= 1): most groups claimed
-- ARGV[3] = producer owner tag
-- ARGV[4] = buffer owner tag ("replay")
-- ARGV[5] = op reply TTL (ms)
-- ARGV[6] = window: groups to name in a NEED reply (>= n)
-- ARGV[7] = g, ARGV[8..7+g] = gids, ARGV[8+g] = s, ARGV[9+g..] = sids
-- returns: {0, 'NEED', g, gid..., sid...}   missing keys; nothing written
--          {0, 'OK', m, m x (gid, status, sids, min_version, seq, retryable, payload)}
-- errors: OWNER_LOST (owner, lost_ms), INVALID_INPUT (field, message)
-- include: op
-- include: sessions
-- include: rb
local qa, va, qe, ve = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local oreplay, oto, sidskey, bkey, opkey, lost = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local n, to, replay, window = tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[6])
local cached = op_replay(opkey)
if cached then return cached end
local lost_ms = redis.call('ZSCORE', lost, to)
if lost_ms then return {1, 'OWNER_LOST', to, tonumber(lost_ms)} end
local gmap, smap = rb_keymap(10, 7)
if not gmap then return {1, 'INVALID_INPUT', 'keys', 'KEYS tail does not match the ids in ARGV'} end

-- merge the two FIFO queues by seq: O(log n + window)
local a = redis.call('ZRANGE', qa, 0, window - 1, 'WITHSCORES')
local e = redis.call('ZRANGE', qe, 0, window - 1, 'WITHSCORES')
local cand, from = {}, {}
local i, j = 1, 1
while #cand < window and (i <= #a or j <= #e) do
  if j > #e or (i <= #a and tonumber(a[i + 1]) < tonumber(e[j + 1])) then
    cand[#cand + 1] = a[i]; from[a[i]] = 'a'; i = i + 2
  else
    cand[#cand + 1] = e[j]; from[e[j]] = 'e'; j = j + 2
  end
end
local picked = {}
for k = 1, math.min(n, #cand) do picked[k] = cand[k] end
local need_g, need_s = {}, {}
rb_missing(sidskey, picked, gmap, smap, need_g, need_s)
if #need_g > 0 or #need_s > 0 then
  local extra = {}
  for k = #picked + 1, #cand do extra[#extra + 1] = cand[k] end
  rb_missing(sidskey, extra, gmap, smap, need_g, need_s)
  return rb_need_reply(need_g, need_s)
end

local out = {0, 'OK', #picked}
for _, gid in ipairs(picked) do
  if from[gid] == 'a' then
    rb_hand_over(gid, gmap[gid], qa, va, oreplay, oto, sidskey, bkey, smap, replay, to, out)
  else
    rb_hand_over(gid, gmap[gid], qe, ve, oreplay, oto, sidskey, bkey, smap, replay, to, out)
  end
end
return op_record(opkey, tonumber(ARGV[5]), out)
