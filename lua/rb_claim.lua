-- script: rb_claim
-- Claim back up to n retryable groups of a task (status `aborted` or
-- `expired`) for a producer, oldest put first (by seq across both statuses):
-- their sessions move from the buffer to the producer's owner tag and the
-- groups leave the buffer, atomically. A group expired per member comes back
-- with its fresh members as sids and the released ones in its `reroll`.
-- Session keys: in-script or declared, as in lua/_lib/rb.lua.
-- KEYS: 15+
-- KEYS[1] = ts:{R}:o:<replay>              set: sessions of the buffer
-- KEYS[2] = ts:{R}:o:<owner>               set: sessions of the producer
-- KEYS[3] = ts:{R}:rb:groups               hash gid -> record (json)
-- KEYS[4] = ts:{R}:rb:sids                 hash gid -> sids (json)
-- KEYS[5] = ts:{R}:rb:payloads             hash gid -> payload (json)
-- KEYS[6] = ts:{R}:rb:bytes                hash "<status> <task>" -> bytes
-- KEYS[7] = ts:{R}:op:<op_id>              cached reply (retry idempotency)
-- KEYS[8] = ts:{R}:owners:lost             zset owner -> lost ms
-- KEYS[9] = ts:{R}:stats                   hash of the run's counters
-- CELLS: aborted expired
-- KEYS[10..15] = the cells aborted and expired of the task, each the keys of its indexes
--     (lua/_lib/rb.lua rb_cells; tracestore/replay/layout.py task_keys)
-- KEYS[16..] = declared session keys ts:{R}:s:<sid>, in the order of their sids in ARGV
-- ARGV[1] = task
-- ARGV[2] = n (int >= 1): most groups claimed
-- ARGV[3] = producer owner tag
-- ARGV[4] = buffer owner tag ("replay")
-- ARGV[5] = op reply TTL (ms)
-- ARGV[6] = session key prefix "ts:{R}:s:" ("" = declared keys only)
-- ARGV[7] = s, then s sids (those of the declared session keys)
-- returns: {0, 'NEED', sid...}   declared session keys missing; nothing written
--          {0, 'OK', m, m x (gid, record, sids, payload)}   aborted groups, then expired ones
-- errors: OWNER_LOST (owner, lost_ms), INVALID_INPUT (field, message),
--         CORRUPT (key, gid, detail): a group the client could not decode; nothing written
-- include: op
-- include: stats
-- include: sessions
-- include: rb
local rb = {oreplay = KEYS[1], oto = KEYS[2], groups = KEYS[3], sidskey = KEYS[4], payloads = KEYS[5],
  bkey = KEYS[6], to = ARGV[3], replay = ARGV[4]}
local opkey = KEYS[7]
local task, n = ARGV[1], tonumber(ARGV[2])
local cells, k = rb_cells(9, task, {'aborted', 'expired'})
if not cells then return k end
local ca, ce = cells.aborted, cells.expired
local early = rb_open(rb, opkey, KEYS[8], k, 6)
if early then return early end
local window = n
if rb.spre == '' then window = 2 * n + 8 end

-- merge the two FIFO queues by seq: O(log n + window)
local a = redis.call('ZRANGE', ca.q, 0, window - 1, 'WITHSCORES')
local e = redis.call('ZRANGE', ce.q, 0, window - 1, 'WITHSCORES')
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
local need = rb_need(rb, cand, npicked)
if need then return need end
local pa, pe = {}, {}
for k = 1, npicked do
  if from[cand[k]] == 'a' then pa[#pa + 1] = cand[k] else pe[#pe + 1] = cand[k] end
end
local la, le = rb_load(rb, pa), rb_load(rb, pe)
if la.corrupt then return la.corrupt end
if le.corrupt then return le.corrupt end

-- commit; the reply lists the aborted groups, then the expired ones (the client orders them by seq)
local out = {0, 'OK', npicked}
rb_hand_over(rb, la, ca, 'aborted', task, out)
rb_hand_over(rb, le, ce, 'expired', task, out)
if npicked > 0 then redis.call('HINCRBY', KEYS[9], 'groups_claimed', npicked) end
return op_record(opkey, tonumber(ARGV[5]), out)
