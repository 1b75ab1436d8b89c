-- script: rb_expire
-- Expire up to `limit` stale groups of one task and status (completed or
-- aborted), oldest first (DESIGN section 7, invariant 3): a range query on
-- the version index, O(log n + k), never a scan of the buffer. A kept group
-- moves to `expired` with its sessions still owned by the buffer
-- (claim_retry hands it back to a producer); with per-member expiry (not for
-- agentic groups) only its stale members' sessions are released and listed
-- in its `reroll`. A released group's sessions are released (reason
-- 'expired', one event each) and the group is deleted.
-- Session keys: in-script or declared, as in lua/_lib/rb.lua.
-- KEYS: 15+
-- KEYS[1] = ts:{R}:o:<replay>              set: sessions of the buffer
-- KEYS[2] = ts:{R}:released                zset tombstones
-- KEYS[3] = ts:{R}:events                  stream of release events
-- KEYS[4] = ts:{R}:rb:groups               hash gid -> record (json)
-- KEYS[5] = ts:{R}:rb:sids                 hash gid -> sids (json)
-- KEYS[6] = ts:{R}:rb:payloads             hash gid -> payload (json)
-- KEYS[7] = ts:{R}:rb:bytes                hash "<status> <task>" -> bytes
-- KEYS[8] = ts:{R}:op:<op_id>              cached reply (retry idempotency)
-- KEYS[9] = ts:{R}:stats                   hash of the run's counters
-- CELLS: <status> expired
-- KEYS[10..15] = the cells of the task: the status expired from (ARGV[8]) and expired,
--     each the keys of its indexes (lua/_lib/rb.lua rb_cells; tracestore/replay/layout.py task_keys)
-- KEYS[16..] = declared session keys ts:{R}:s:<sid>, in the order of their sids in ARGV
-- ARGV[1] = task
-- ARGV[2] = cutoff: a group is stale when min_version < cutoff (int)
-- ARGV[3] = retryable: "" (each group's own flag), "1" (keep all), "0" (release all)
-- ARGV[4] = limit: most groups expired by this call (int >= 1)
-- ARGV[5] = buffer owner tag ("replay")
-- ARGV[6] = op reply TTL (ms)
-- ARGV[7] = per-member expiry (0|1)
-- ARGV[8] = status expired from: completed | aborted (the cell KEYS[10..12])
-- ARGV[9] = session key prefix "ts:{R}:s:" ("" = declared keys only)
-- ARGV[10] = s, then s sids (those of the declared session keys)
-- returns: {0, 'NEED', sid...}   declared session keys missing; nothing written
--          {0, 'OK', more (0|1), k, kept gid..., r, released gid..., s, released sid...}
-- errors: INVALID_INPUT (field, message), CORRUPT (key, gid, detail): nothing written
-- include: clock
-- include: op
-- include: stats
-- include: sessions
-- include: rb
local rb = {oreplay = KEYS[1], released = KEYS[2], events = KEYS[3], groups = KEYS[4],
  sidskey = KEYS[5], payloads = KEYS[6], bkey = KEYS[7], replay = ARGV[5], rel_s = {}, st = {}}
local opkey = KEYS[8]
local cutoff, limit = ARGV[2], tonumber(ARGV[4])
local cells, k = rb_cells(9, ARGV[1], {ARGV[8], 'expired'})
if not cells then return k end
local c = cells[ARGV[8]]
rb.ecell = cells.expired
local early = rb_open(rb, opkey, nil, k, 9)
if early then return early end

local stale = rb_stale(c.v, cutoff, limit)
-- nothing stale: nothing to write, not even the op record (a retry finds the same or acts now)
if #stale == 0 then return {0, 'OK', 0, 0, 0, 0} end
local need = rb_need(rb, stale, #stale)
if need then return need end
local groups, corrupt = rb_load_groups(rb, stale)
if corrupt then return corrupt end

rb.now = now_ms()
local opts = {keep = ARGV[3], per_member = ARGV[7], cutoff = tonumber(cutoff)}
local kept, rel_g = {}, {}
for _, g in ipairs(groups) do
  if rb_expire_group(rb, g, c, opts) then
    kept[#kept + 1] = g.gid
  else
    rel_g[#rel_g + 1] = g.gid
  end
end
sessions_release_flush(rb.rel)
stats_flush(KEYS[9], rb.st)
local more = 0
if #stale == limit and rb_count_stale(c.v, cutoff) > 0 then more = 1 end
local out = {0, 'OK', more, #kept}
for _, g in ipairs(kept) do out[#out + 1] = g end
out[#out + 1] = #rel_g
for _, g in ipairs(rel_g) do out[#out + 1] = g end
out[#out + 1] = #rb.rel_s
for _, s in ipairs(rb.rel_s) do out[#out + 1] = s end
return op_record(opkey, tonumber(ARGV[6]), out)
