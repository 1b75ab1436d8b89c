-- script: rb_claim
-- Claim back up to n retryable groups of a task (status `aborted` or
-- `expired`) for a producer, oldest put first (by seq across both statuses):
-- their sessions move from the buffer to the producer's owner tag and the
-- groups leave the buffer, atomically. Keys protocol as in lua/_lib/rb.lua.
-- KEYS: 11+
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
-- KEYS[11] = ts:{R}:stats                 hash of the run's counters
-- KEYS[12..11+g] = ts:{R}:rb:g:<gid>       group hashes of the gids in ARGV
-- KEYS[12+g..11+g+s] = ts:{R}:s:<sid>      session hashes of the sids in ARGV
-- ARGV[1] = task
-- ARGV[2] = n (int >= 1): most groups claimed
-- ARGV[3] = producer owner tag
-- ARGV[4] = buffer owner tag ("replay")
-- ARGV[5] = op reply TTL (ms)
-- ARGV[6] = window: groups to name in a NEED reply (>= n)
-- ARGV[7] = g, ARGV[8..7+g] = gids, ARGV[8+g] = s, ARGV[9+g..] = sids
-- returns: {0, 'NEED', g, gid..., sid...}   missing keys; nothing written
--          {0, 'OK', m, m x (gid, status, sids, min_version, seq, retryable, payload)}
-- errors: OWNER_LOST (owner, lost_ms), INVALID_INPUT (field, message),
--         CORRUPT (key, field, detail): a group the client could not decode; nothing written
-- include: op
-- include: stats
-- include: sessions
-- include: rb
local qa, va, qe, ve = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local rb = {oreplay = KEYS[5], oto = KEYS[6], sidskey = KEYS[7], bkey = KEYS[8],
  to = ARGV[3], replay = ARGV[4]}
local opkey = KEYS[9]
local n, window = tonumber(ARGV[2]), tonumber(ARGV[6])
local early = rb_open(rb, opkey, KEYS[10], 11, 7)
if early then return early end

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
local npicked = math.min(n, #cand)
local need_reply = rb_need_window(rb, cand, npicked, {g = {}, s = {}})
if need_reply then return need_reply end
local corrupt = rb_check_groups(rb, cand, npicked)
if corrupt then return corrupt end

local out = {0, 'OK', npicked}
for k = 1, npicked do
  local gid = cand[k]
  if from[gid] == 'a' then
    rb_hand_over(rb, gid, qa, va, out)
  else
    rb_hand_over(rb, gid, qe, ve, out)
  end
end
if npicked > 0 then redis.call('HINCRBY', KEYS[11], 'groups_claimed', npicked) end
return op_record(opkey, tonumber(ARGV[5]), out)
