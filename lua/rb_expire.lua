-- script: rb_expire
-- Expire up to `limit` stale completed groups of one task, oldest first
-- (DESIGN section 7, invariant 3): a range query on the version index,
-- O(log n + k), never a scan of the buffer. A kept group moves to `expired`
-- with its sessions still owned by the buffer (claim_retry hands it back to a
-- producer); a released group's sessions are released (reason 'expired', one
-- event each) and the group is deleted. Keys protocol as in lua/_lib/rb.lua.
-- KEYS: 11+
-- KEYS[1] = ts:{R}:rb:q:<task>:completed   zset gid -> seq
-- KEYS[2] = ts:{R}:rb:v:<task>:completed   zset gid -> min_version + seq/2^32
-- KEYS[3] = ts:{R}:rb:q:<task>:expired     zset gid -> seq
-- KEYS[4] = ts:{R}:rb:v:<task>:expired     zset gid -> min_version + seq/2^32
-- KEYS[5] = ts:{R}:o:<replay>              set: sessions of the buffer
-- KEYS[6] = ts:{R}:released                zset tombstones
-- KEYS[7] = ts:{R}:events                  stream of release events
-- KEYS[8] = ts:{R}:rb:sids                 hash gid -> sids (json)
-- KEYS[9] = ts:{R}:rb:bytes                hash "<status> <task>" -> bytes
-- KEYS[10] = ts:{R}:op:<op_id>             cached reply (retry idempotency)
-- KEYS[11] = ts:{R}:stats                 hash of the run's counters
-- KEYS[12..11+g] = ts:{R}:rb:g:<gid>       group hashes of the gids in ARGV
-- KEYS[12+g..11+g+s] = ts:{R}:s:<sid>      session hashes of the sids in ARGV
-- ARGV[1] = task
-- ARGV[2] = cutoff: a group is stale when min_version < cutoff (int)
-- ARGV[3] = retryable: "" (each group's own flag), "1" (keep all), "0" (release all)
-- ARGV[4] = limit: most groups expired by this call (int >= 1)
-- ARGV[5] = buffer owner tag ("replay")
-- ARGV[6] = op reply TTL (ms)
-- ARGV[7] = g, ARGV[8..7+g] = gids, ARGV[8+g] = s, ARGV[9+g..] = sids
-- returns: {0, 'NEED', g, gid..., sid...}   missing keys; nothing written
--          {0, 'OK', more (0|1), k, kept gid..., r, released gid..., s, released sid...}
-- errors: INVALID_INPUT (field, message), CORRUPT (key, field, detail): nothing written
-- include: clock
-- include: op
-- include: stats
-- include: sessions
-- include: rb
local rb = {qc = KEYS[1], vc = KEYS[2], qe = KEYS[3], ve = KEYS[4], oreplay = KEYS[5],
  released = KEYS[6], events = KEYS[7], sidskey = KEYS[8], bkey = KEYS[9],
  replay = ARGV[5], rel_s = {}, st = {}}
local opkey = KEYS[10]
local cutoff, keep_override, limit = ARGV[2], ARGV[3], tonumber(ARGV[4])
local early = rb_open(rb, opkey, nil, 11, 7)
if early then return early end

local stale = rb_stale(rb.vc, cutoff, limit)
local need = {g = {}, s = {}}
rb_missing(rb, stale, need)
if need.corrupt then return need.corrupt end
if #need.g > 0 or #need.s > 0 then return rb_need_reply(need) end
local corrupt = rb_check_groups(rb, stale, #stale)
if corrupt then return corrupt end

rb.now = now_ms()
local kept, rel_g = {}, {}
for _, gid in ipairs(stale) do
  if rb_expire_group(rb, gid, keep_override) then
    kept[#kept + 1] = gid
  else
    rel_g[#rel_g + 1] = gid
  end
end
sessions_release_flush(rb.rel)
stats_flush(KEYS[11], rb.st)
local more = 0
if #stale == limit and rb_count_stale(rb.vc, cutoff) > 0 then more = 1 end
local out = {0, 'OK', more, #kept}
for _, g in ipairs(kept) do out[#out + 1] = g end
out[#out + 1] = #rel_g
for _, g in ipairs(rel_g) do out[#out + 1] = g end
out[#out + 1] = #rb.rel_s
for _, s in ipairs(rb.rel_s) do out[#out + 1] = s end
return op_record(opkey, tonumber(ARGV[6]), out)
