-- script: rb_take
-- Take completed groups of one or more tasks for a learner, atomically
-- (DESIGN section 7, invariant 2): first expire each task's stale groups
-- (min_version < cutoff; retryable ones move to `expired` and keep their
-- sessions, or only their fresh members with per-member expiry; the others
-- are released, one event per session), then remove n_i groups of task i in
-- policy order (ARGV[2], a picker RB_PICK[policy] of lua/_lib/rb.lua: fifo,
-- staleness, priority; tracestore/replay/policies.py) and move their sessions
-- from the buffer to the taker. All or nothing across
-- the tasks: unless every task has its n_i ready groups no group is taken;
-- the expiry is not part of that: stale groups are expired whether or not the
-- take then finds enough (a stale group never stays counted as completed).
-- With at_most, each task gives up to n_i (never SHORT).
-- Session keys: in-script or declared (lua/_lib/rb.lua); with declared keys a
-- call that lacks a session key returns NEED and writes nothing.
-- KEYS: 11+
-- KEYS[1] = ts:{R}:o:<replay>              set: sessions of the buffer
-- KEYS[2] = ts:{R}:o:<taker>               set: sessions of the taker
-- KEYS[3] = ts:{R}:released                zset tombstones
-- KEYS[4] = ts:{R}:events                  stream of release events
-- KEYS[5] = ts:{R}:rb:groups               hash gid -> record (json)
-- KEYS[6] = ts:{R}:rb:sids                 hash gid -> sids (json)
-- KEYS[7] = ts:{R}:rb:payloads             hash gid -> payload (json)
-- KEYS[8] = ts:{R}:rb:bytes                hash "<status> <task>" -> bytes
-- KEYS[9] = ts:{R}:op:<op_id>              cached reply (retry idempotency)
-- KEYS[10] = ts:{R}:owners:lost            zset owner -> lost ms
-- KEYS[11] = ts:{R}:stats                  hash of the run's counters
-- CELLS: completed expired
-- KEYS[12..] = for each task i of T (ARGV order): its cells completed and expired, each the
--     keys of its indexes (lua/_lib/rb.lua rb_cells; tracestore/replay/layout.py task_keys)
-- KEYS[after the cells..] = declared session keys ts:{R}:s:<sid>, in the order of their sids in ARGV
-- ARGV[1] = cutoff: a group is stale when min_version < cutoff ("" = no bound)
-- ARGV[2] = policy: a name of RB_PICK (fifo | staleness | priority)
-- ARGV[3] = taker owner tag
-- ARGV[4] = buffer owner tag ("replay")
-- ARGV[5] = op reply TTL (ms)
-- ARGV[6] = max stale groups expired inside this call (more: EXPIRE_FIRST)
-- ARGV[7] = at_most (0|1)
-- ARGV[8] = per-member expiry (0|1)
-- ARGV[9] = T (tasks), ARGV[10..9+2T] = task_i, n_i (int >= 1)
-- ARGV[10+2T] = session key prefix "ts:{R}:s:" ("" = declared keys only)
-- ARGV[11+2T] = s, then s sids (those of the declared session keys)
-- returns: {0, 'NEED', sid...}                declared session keys missing; nothing written
--          {0, 'SHORT', k, kept gid..., r, released sid..., T, ready_1..ready_T}
--              a task has fewer than n_i ready (ready_i: how many task i has): nothing taken,
--              the stale groups expired (kept: moved to `expired`; released: their sessions)
--          {0, 'EXPIRE_FIRST', stale}          too many stale groups for one call; nothing written
--          {0, 'OK', k, kept gid..., r, released sid..., then per task: m, m x (gid, record,
--              sids, payload)}
-- errors: OWNER_LOST (taker, lost_ms), INVALID_INPUT (field, message),
--         CORRUPT (key, gid, detail): a group the client could not decode; nothing written
-- include: clock
-- include: op
-- include: stats
-- include: sessions
-- include: rb
local rb = {oreplay = KEYS[1], oto = KEYS[2], released = KEYS[3], events = KEYS[4],
  groups = KEYS[5], sidskey = KEYS[6], payloads = KEYS[7], bkey = KEYS[8],
  to = ARGV[3], replay = ARGV[4], rel_s = {}, st = {}}
local opkey = KEYS[9]
local cutoff, policy = ARGV[1], ARGV[2]
local max_stale, at_most = tonumber(ARGV[6]), ARGV[7] == '1'
local ntasks = tonumber(ARGV[9])
local pick = RB_PICK[policy]
if not pick then return {1, 'INVALID_INPUT', 'policy', 'no take policy ' .. policy .. ' in lua/_lib/rb.lua'} end
local tasks, k = {}, 11
for i = 1, ntasks do
  local name = ARGV[8 + 2 * i]
  local cells
  cells, k = rb_cells(k, name, {'completed', 'expired'})
  if not cells then return k end
  tasks[i] = {name = name, n = tonumber(ARGV[9 + 2 * i]), c = cells.completed, e = cells.expired}
end
local early = rb_open(rb, opkey, KEYS[10], k, 10 + 2 * ntasks)
if early then return early end
-- with declared keys a NEED names a window of spare candidates beyond n, so
-- a retry survives other takers removing the head; in-script keys need none
local spare = rb.spre == ''

-- Expire every task's loaded stale groups (t.stale_groups); append k, kept gid..., r,
-- released sid... to out. The caller flushes the releases and the counters.
local function expire_stale(out)
  rb.now = now_ms()
  local kept = {}
  local opts = {keep = '', per_member = ARGV[8], cutoff = tonumber(cutoff)}
  for _, t in ipairs(tasks) do
    rb.ecell = t.e
    for _, g in ipairs(t.stale_groups) do
      if rb_expire_group(rb, g, t.c, opts) then kept[#kept + 1] = g.gid end
    end
  end
  out[#out + 1] = #kept
  for _, g in ipairs(kept) do out[#out + 1] = g end
  out[#out + 1] = #rb.rel_s
  for _, s in ipairs(rb.rel_s) do out[#out + 1] = s end
end

-- plan (reads only)
local nstale = 0
for _, t in ipairs(tasks) do nstale = nstale + rb_count_stale(t.c.v, cutoff) end
if nstale > max_stale then return {0, 'EXPIRE_FIRST', nstale} end
local short = false
for _, t in ipairs(tasks) do
  local window = t.n
  if spare then window = 2 * t.n + 8 end
  t.stale = rb_stale(t.c.v, cutoff, 0)
  local skip = {set = {}, n = #t.stale}
  for _, g in ipairs(t.stale) do skip.set[g] = true end
  t.cand = pick(t.c, window, cutoff, skip)
  t.pick = t.n
  if #t.cand < t.n then
    if at_most then t.pick = #t.cand else short = true end
  end
end
if short then
  -- take nothing, but expire what is stale all the same
  local out, nstale = {0, 'SHORT'}, 0
  for _, t in ipairs(tasks) do
    nstale = nstale + #t.stale
    t.cand = {}
  end
  if nstale > 0 then
    if spare then
      local picked = {}
      for _, t in ipairs(tasks) do
        for _, g in ipairs(t.stale) do picked[#picked + 1] = g end
      end
      local need = rb_need(rb, picked, #picked)
      if need then return need end
    end
    for _, t in ipairs(tasks) do
      local corrupt
      t.stale_groups, corrupt = rb_load_groups(rb, t.stale)
      if corrupt then return corrupt end
    end
    expire_stale(out)
  else
    out[3], out[4] = 0, 0  -- nothing expired: nothing written, no op record
  end
  out[#out + 1] = ntasks
  for _, t in ipairs(tasks) do
    if cutoff == '' then
      out[#out + 1] = redis.call('ZCARD', t.c.v)
    else
      out[#out + 1] = redis.call('ZCOUNT', t.c.v, cutoff, '+inf')
    end
  end
  if nstale == 0 then return out end
  sessions_release_flush(rb.rel)
  stats_flush(KEYS[11], rb.st)
  return op_record(opkey, tonumber(ARGV[5]), out)
end
if spare then
  local picked, extra = {}, {}
  for _, t in ipairs(tasks) do
    for _, g in ipairs(t.stale) do picked[#picked + 1] = g end
    for i = 1, #t.cand do
      if i <= t.pick then picked[#picked + 1] = t.cand[i] else extra[#extra + 1] = t.cand[i] end
    end
  end
  local npicked = #picked
  for _, g in ipairs(extra) do picked[#picked + 1] = g end
  local need = rb_need(rb, picked, npicked)
  if need then return need end
end
for _, t in ipairs(tasks) do
  local corrupt
  t.stale_groups, corrupt = rb_load_groups(rb, t.stale)
  if corrupt then return corrupt end
  if t.pick < #t.cand then
    local picked = {}
    for i = 1, t.pick do picked[i] = t.cand[i] end
    t.cand = picked
  end
  t.loaded = rb_load(rb, t.cand)
  if t.loaded.corrupt then return t.loaded.corrupt end
end

-- commit
local out = {0, 'OK'}
expire_stale(out)
for _, t in ipairs(tasks) do
  out[#out + 1] = #t.loaded.gids
  rb_hand_over(rb, t.loaded, t.c, 'completed', t.name, out)
  stats_add(rb.st, 'groups_taken', #t.loaded.gids)
end
sessions_release_flush(rb.rel)
stats_flush(KEYS[11], rb.st)
return op_record(opkey, tonumber(ARGV[5]), out)
