-- Replay-buffer helpers shared by lua/rb_*.lua (DESIGN section 7).
--
-- A stored group is three fields under its gid, one in each of three hashes
-- of the run's control plane (so a script reads or deletes many groups in one
-- command, and every group key is a declared key):
--   ts:{R}:rb:groups    gid -> rec: a JSON object (rb_rec): task, status,
--                       min_version, seq, retryable, agentic, mv (each
--                       member's oldest token version), reroll (members
--                       released by per-member expiry), put_ms, producer
--   ts:{R}:rb:sids      gid -> the members' session ids (JSON array)
--   ts:{R}:rb:payloads  gid -> the payload (JSON, verbatim as put)
-- A take hands the three strings out undecoded (Lua pays for every value it
-- creates; it decodes only the sids, to move their sessions).
--
-- Every stored group is also a member of the indexes of its *cell* (its task
-- and status), one zset each (RB_INDEXES, the order KEYS carries them, as
-- INDEXES in tracestore/replay/layout.py):
--   q  ts:{R}:rb:q:<task>:<status>  gid -> seq (put order)
--   v  ts:{R}:rb:v:<task>:<status>  gid -> min_version + seq/2^32 (staleness order, expiry range)
--   p  ts:{R}:rb:p:<task>:<status>  '<seq, 10 digits>:<gid>' -> -priority, for the groups
--      whose payload has a priority (ascending: highest first, then put order)
-- A script reads the cells of a task with rb_cells (after its fixed keys,
-- before the declared session keys; its header lists them on a '-- CELLS:'
-- line) and keeps every index of a cell with rb_index_put, rb_index_move and
-- rb_index_drop, so that no script knows an index by position. The take
-- policies are the pickers RB_PICK[name] below (tracestore/replay/policies.py).
--
-- The session hashes ts:{R}:s:<sid> of the groups a take, claim or expire
-- picks are chosen inside the script. Two ways to reach them, chosen by the
-- caller:
--
-- * in-script keys (the default, one round trip): ARGV carries the prefix
--   "ts:{R}:s:" (built by tracestore/keys.py) and the script appends the sid.
--   Every such key has the hash tag {R} of the declared keys (checked in
--   rb_open), so it lives in the one slot the script runs on: Redis 7 and
--   Valkey 8 let a script access an undeclared key of its own slot on a
--   cluster (scriptVerifyClusterState refuses only a key of another slot, or
--   of a slot the node does not serve). The EVAL docs still ask scripts to
--   declare every key, so this is permitted, not promised; see docs/replay.md.
-- * declared keys (StoreConfig.replay_declared_keys, two round trips): the
--   caller passes the session keys as a tail of KEYS with their sids in ARGV.
--   The script plans with reads only; when a session key it needs is missing
--   it returns {0, 'NEED', sid...} and writes nothing; the client calls again
--   with those keys and the second call commits atomically.
--
-- Either way a script touches every session key it will write before its
-- first write (rb_load: one EXISTS), so a key it cannot access (a slot
-- migrating under it) fails the call with nothing written.
--
-- The helpers share one table `rb` that the calling script fills in once:
--   groups, sidskey, payloads   KEYS: the three group hashes above
--   bkey        KEYS: ts:{R}:rb:bytes (bytes of records per "<status> <task>")
--   smap, spre  sid -> declared session key (rb_open); the key prefix ('' = declared only)
--   oreplay     KEYS: ts:{R}:o:<replay>     replay   ARGV: the buffer's owner tag
--   to, oto     the taker's owner tag and its owner set (rb_hand_over)
--   ecell, released, events, now, rel_s   (rb_expire_group: ecell = the task's expired cell)
--   st          the script's counters (lua/_lib/stats.lua): the script flushes
--               them into ts:{R}:stats at its end, after sessions_release_flush
--               (rb_expire_group counts groups_expired and, through
--               sessions_release, the releases)
--
-- A group the client could not decode (a record that is not the JSON object
-- rb_rec writes, sids that are not a JSON list of strings, a payload that is
-- not a JSON object, text that is not UTF-8) is never handed out: rb_load
-- checks every group it loads, before the script's first write, and the
-- script answers CORRUPT naming the hash and the gid, with nothing written.
--
local RB_TWO32 = 4294967296
-- Values per redis.call of a variadic command (Lua's unpack limit is ~8000).
local RB_CHUNK = 4000
-- Reply fields per group of a take or claim: gid, rec, sids, payload.
local RB_FIELDS = 4

-- The indexes of a cell, in KEYS order (tracestore/replay/layout.py INDEXES).
local RB_INDEXES = {'q', 'v', 'p'}

-- A Lua list as a JSON array (cjson encodes an empty table as an object).
local function rb_json_list(t)
  if #t == 0 then return '[]' end
  return cjson.encode(t)
end

local function rb_tag(key)
  return string.match(key, '{(.-)}')
end

-- The record of a group (ts:{R}:rb:groups), a JSON object; mv and reroll are
-- JSON arrays already encoded.
local function rb_rec(g)
  return '{"task":' .. cjson.encode(g.task) .. ',"status":' .. cjson.encode(g.status) ..
    ',"min_version":' .. string.format('%d', g.min_version) .. ',"seq":' .. string.format('%d', g.seq) ..
    ',"retryable":' .. g.retryable .. ',"agentic":' .. g.agentic .. ',"mv":' .. g.mv_json ..
    ',"reroll":' .. g.reroll_json .. ',"put_ms":' .. string.format('%d', g.put_ms) ..
    ',"producer":' .. cjson.encode(g.producer) .. '}'
end

-- The start every take, claim and expire shares: replay a retried call's
-- reply, refuse a taker that gc declared lost (lost_key nil: no taker), read
-- the session key prefix ARGV[a] and the declared session keys: ARGV[a+1] =
-- s, then s sids, matching KEYS[k0+1..k0+s]. Returns a reply to return at
-- once, or nil.
local function rb_open(rb, opkey, lost_key, k0, a)
  local cached = op_replay(opkey)
  if cached then return cached end
  if lost_key then
    local lost_ms = redis.call('ZSCORE', lost_key, rb.to)
    if lost_ms then return {1, 'OWNER_LOST', rb.to, tonumber(lost_ms)} end
  end
  rb.spre = ARGV[a]
  if rb.spre ~= '' and rb_tag(rb.spre) ~= rb_tag(opkey) then
    return {1, 'INVALID_INPUT', 'keys', 'the session key prefix is not in the slot of the declared keys'}
  end
  local ns = tonumber(ARGV[a + 1])
  if #KEYS ~= k0 + ns then
    return {1, 'INVALID_INPUT', 'keys', 'KEYS tail does not match the session ids in ARGV'}
  end
  rb.smap = {}
  for i = 1, ns do rb.smap[ARGV[a + 1 + i]] = KEYS[k0 + i] end
  return nil
end

-- The cells of task `task` in KEYS[k0+1..]: for each status of `statuses`,
-- one key per index of RB_INDEXES (tracestore/replay/layout.py task_keys).
-- Returns the cells by status (cell.q, cell.v, cell.p) and the position of
-- the last key read; or nil and an INVALID_INPUT reply when a key is not the
-- index of that task and status its position says (the client's layout and
-- the script's disagree: nothing is written).
local function rb_cells(k0, task, statuses)
  local cells, k = {}, k0
  for _, status in ipairs(statuses) do
    local cell, want = {}, ':' .. task .. ':' .. status
    for _, index in ipairs(RB_INDEXES) do
      k = k + 1
      local key = KEYS[k] or ''
      local tag_end = string.find(key, '}', 1, true) or 0
      local mark = ':rb:' .. index .. want
      if string.sub(key, tag_end + 1, tag_end + #mark) ~= mark or tag_end + #mark ~= #key then
        return nil, {1, 'INVALID_INPUT', 'keys', 'KEYS[' .. k .. '] is not the ' .. index ..
          ' index of cell ' .. task .. ' ' .. status .. ': the replay KEYS layout of the client and the script disagree'}
      end
      cell[index] = key
    end
    cells[status] = cell
  end
  return cells, k
end

-- The member of group gid (put sequence number seq) in a priority index.
local function rb_pmember(seq, gid)
  return string.format('%010d', seq) .. ':' .. gid
end

local function rb_pgid(member)
  return string.sub(member, 12)
end

-- Add group gid to the indexes of cell c: seq, min_version minv, priority
-- score pscore ('' when its payload has no priority).
local function rb_index_put(c, gid, seq, minv, pscore)
  redis.call('ZADD', c.q, seq, gid)
  redis.call('ZADD', c.v, minv + seq / RB_TWO32, gid)
  if pscore ~= '' then redis.call('ZADD', c.p, pscore, rb_pmember(seq, gid)) end
end

-- Move group gid (put sequence number seq) from cell a to cell b, keeping its scores.
local function rb_index_move(a, b, gid, seq)
  local vs = redis.call('ZSCORE', a.v, gid)
  local pm = rb_pmember(seq, gid)
  local ps = redis.call('ZSCORE', a.p, pm)
  redis.call('ZREM', a.q, gid)
  redis.call('ZREM', a.v, gid)
  redis.call('ZADD', b.q, seq, gid)
  redis.call('ZADD', b.v, vs, gid)
  if ps then
    redis.call('ZREM', a.p, pm)
    redis.call('ZADD', b.p, ps, pm)
  end
end

local function rb_skey(rb, sid)
  local k = rb.smap[sid]
  if k == nil and rb.spre ~= '' then k = rb.spre .. sid end
  return k
end

-- redis.call(cmd, key, items...) in chunks below Lua's unpack limit; the
-- replies of the chunks concatenated (for HMGET, SMISMEMBER).
local function rb_call_chunked(cmd, key, items)
  if #items <= RB_CHUNK then
    if #items == 0 then return {} end
    return redis.call(cmd, key, unpack(items))
  end
  local out = {}
  for i = 1, #items, RB_CHUNK do
    local part = redis.call(cmd, key, unpack(items, i, math.min(i + RB_CHUNK - 1, #items)))
    if type(part) == 'table' then
      for _, x in ipairs(part) do out[#out + 1] = x end
    end
  end
  return out
end

-- Remove groups `gids` from the indexes of cell c (a cell without prioritised
-- groups costs one EXISTS more than q and v; else their seqs come from q).
local function rb_index_drop(c, gids)
  if #gids == 0 then return end
  if redis.call('EXISTS', c.p) == 1 then
    local members = {}
    for b = 1, #gids, RB_CHUNK do
      local e = math.min(b + RB_CHUNK - 1, #gids)
      local seqs = redis.call('ZMSCORE', c.q, unpack(gids, b, e))
      for i = b, e do
        local seq = seqs[i - b + 1]
        if seq then members[#members + 1] = rb_pmember(tonumber(seq), gids[i]) end
      end
    end
    rb_call_chunked('ZREM', c.p, members)
  end
  rb_call_chunked('ZREM', c.q, gids)
  rb_call_chunked('ZREM', c.v, gids)
end

-- Take policies (tracestore/replay/policies.py POLICIES): RB_PICK[name](c,
-- want, cutoff, skip) returns up to `want` gids of cell c (a task's completed
-- cell), best first, none stale (min_version < cutoff; cutoff '' = no bound)
-- and none in skip (skip.set: gid -> true, skip.n: how many; the stale
-- groups, which the take expires first; a picker may add to it). Reads only.
local RB_PICK = {}

-- The first `want` members of zset `key` whose gid (conv(member), or the
-- member) is not in skip, in order: at most want + skip.n read. Also returns
-- whether that read the zset to its end, and the members read.
local function rb_head(key, want, skip, conv)
  local got, out = redis.call('ZRANGE', key, 0, want + skip.n - 1), {}
  for _, m in ipairs(got) do
    local gid = m
    if conv then gid = conv(m) end
    if #out < want and not skip.set[gid] then out[#out + 1] = gid end
  end
  return out, #got < want + skip.n, got
end

-- fifo: put order.
function RB_PICK.fifo(c, want, _cutoff, skip)
  return (rb_head(c.q, want, skip))
end

-- staleness: oldest min_version first, then put order (the version index from the cutoff on).
function RB_PICK.staleness(c, want, cutoff, _skip)
  if cutoff == '' then return redis.call('ZRANGE', c.v, 0, want - 1) end
  return redis.call('ZRANGEBYSCORE', c.v, cutoff, '+inf', 'LIMIT', 0, want)
end

-- priority: payload.priority highest first, then put order; the groups without a
-- priority follow every group with one, in put order.
function RB_PICK.priority(c, want, _cutoff, skip)
  local out, all, read = rb_head(c.p, want, skip, rb_pgid)
  if #out == want or not all then return out end
  for _, m in ipairs(read) do  -- every prioritised group was read: skip them in the queue
    local gid = rb_pgid(m)
    if not skip.set[gid] then
      skip.set[gid] = true
      skip.n = skip.n + 1
    end
  end
  for _, gid in ipairs((rb_head(c.q, want - #out, skip))) do out[#out + 1] = gid end
  return out
end

-- Declared keys only: nil when every session of the groups `gids` (in this
-- order, the first `npicked` picked, the rest spare candidates) has its key
-- in the KEYS tail; else a NEED reply naming the missing sessions of every
-- candidate, so that a retry survives other takers removing the head.
local function rb_need(rb, gids, npicked)
  if rb.spre ~= '' or #gids == 0 then return nil end
  local js = rb_call_chunked('HMGET', rb.sidskey, gids)
  local need, missing = {}, false
  for i = 1, #gids do
    local ok, members = pcall(cjson.decode, js[i] or '')
    if ok and type(members) == 'table' then  -- else rb_load reports the group CORRUPT
      for _, sid in ipairs(members) do
        if not rb.smap[sid] then
          need[#need + 1] = sid
          if i <= npicked then missing = true end
        end
      end
    end
  end
  if not missing then return nil end
  local out = {0, 'NEED'}
  for _, s in ipairs(need) do out[#out + 1] = s end
  return out
end

-- Stale gids of a version index (min_version < cutoff), oldest first:
-- ZRANGEBYSCORE, O(log n + k). cutoff '' means no staleness bound.
local function rb_stale(vkey, cutoff, limit)
  if cutoff == '' then return {} end
  if limit > 0 then
    return redis.call('ZRANGEBYSCORE', vkey, '-inf', '(' .. cutoff, 'LIMIT', 0, limit)
  end
  return redis.call('ZRANGEBYSCORE', vkey, '-inf', '(' .. cutoff)
end

local function rb_count_stale(vkey, cutoff)
  if cutoff == '' then return 0 end
  return redis.call('ZCOUNT', vkey, '-inf', '(' .. cutoff)
end

local function rb_bytes_add(bkey, status, task, delta)
  if delta ~= 0 then redis.call('HINCRBY', bkey, status .. ' ' .. task, delta) end
end

-- True when s is valid UTF-8 without surrogates or overlong forms (what the
-- client's JSON decoder accepts); ASCII is checked with one pattern search.
local function rb_utf8(s)
  if not string.find(s, '[\128-\255]') then return true end
  local i, n = 1, #s
  while i <= n do
    local c = string.byte(s, i)
    local len, lo, hi = 1, 0x80, 0xBF
    if c < 0x80 then len = 1
    elseif c >= 0xC2 and c <= 0xDF then len = 2
    elseif c >= 0xE0 and c <= 0xEF then
      len = 3
      if c == 0xE0 then lo = 0xA0 elseif c == 0xED then hi = 0x9F end
    elseif c >= 0xF0 and c <= 0xF4 then
      len = 4
      if c == 0xF0 then lo = 0x90 elseif c == 0xF4 then hi = 0x8F end
    else return false end
    for j = i + 1, i + len - 1 do
      local cc = string.byte(s, j)
      if not cc or cc < lo or cc > hi then return false end
      lo, hi = 0x80, 0xBF
    end
    i = i + len
  end
  return true
end

local RB_STATUSES = {completed = true, aborted = true, expired = true}

-- nil when group gid's record (rec), sids JSON (js) and payload (p) are what
-- the client decodes; else the CORRUPT reply naming the hash and the gid.
-- The record is decoded (it is small); the payload, handed out verbatim, is
-- checked for the shape put stores (a JSON object, valid UTF-8).
local function rb_check(rb, gid, rec, js, p)
  local function bad(key, what) return {1, 'CORRUPT', key, gid, what} end
  if type(rec) ~= 'string' then return bad(rb.groups, 'the group has no record') end
  local ok, r = pcall(cjson.decode, rec)
  if not ok or type(r) ~= 'table' or string.sub(rec, 1, 1) ~= '{' or not rb_utf8(rec) then
    return bad(rb.groups, 'the record is not a JSON object')
  end
  if type(r.task) ~= 'string' or not RB_STATUSES[r.status] or type(r.min_version) ~= 'number'
      or type(r.seq) ~= 'number' or type(r.mv) ~= 'table' or type(r.reroll) ~= 'table' then
    return bad(rb.groups, 'the record lacks task, a stored status, min_version, seq, mv or reroll')
  end
  if type(js) ~= 'string' then return bad(rb.sidskey, 'the group has no session list') end
  local oks, sids = pcall(cjson.decode, js)
  if not oks or type(sids) ~= 'table' or string.sub(js, 1, 1) ~= '[' or not rb_utf8(js) then
    return bad(rb.sidskey, 'not a JSON list of session ids')
  end
  for _, sid in ipairs(sids) do
    if type(sid) ~= 'string' then return bad(rb.sidskey, 'not a list of session ids') end
  end
  if type(p) ~= 'string' or not string.find(p, '^%s*{') or not string.find(p, '}%s*$') or not rb_utf8(p) then
    return bad(rb.payloads, 'the payload is not a JSON object')
  end
  return nil, sids
end

-- Read stored groups `gids` for a hand-over, as flat arrays (every value Lua
-- creates costs; a take of 512 groups must create few): gids, recs, js
-- (sids JSON), ps (payloads): one HMGET each; sids and skeys: every session
-- of the groups, in order; owned[i]: session i is live and owned by the
-- buffer (a member of its owner set: one SMISMEMBER); bytes: of the records.
-- One EXISTS touches every session key, so that a key the script cannot
-- access fails the call before its first write. Reads only.
local function rb_load(rb, gids)
  local L = {gids = gids, recs = rb_call_chunked('HMGET', rb.groups, gids),
    js = rb_call_chunked('HMGET', rb.sidskey, gids), ps = rb_call_chunked('HMGET', rb.payloads, gids),
    sids = {}, skeys = {}, bytes = 0}
  local sids, skeys, js = L.sids, L.skeys, L.js
  for i = 1, #gids do
    local bad, members = rb_check(rb, gids[i], L.recs[i], js[i], L.ps[i])
    if bad then
      L.corrupt = bad
      return L
    end
    for _, sid in ipairs(members) do
      sids[#sids + 1] = sid
      skeys[#skeys + 1] = rb_skey(rb, sid)
    end
    L.bytes = L.bytes + #L.recs[i] + #js[i] + #L.ps[i]
  end
  L.owned = rb_call_chunked('SMISMEMBER', rb.oreplay, sids)
  for i = 1, #skeys, RB_CHUNK do
    redis.call('EXISTS', unpack(skeys, i, math.min(i + RB_CHUNK - 1, #skeys)))
  end
  return L
end

-- Read stored groups for expiry: a table per group (gid, the fields of its
-- record: task, status, min_version, seq, retryable and agentic as '0'/'1',
-- mv, reroll, put_ms, producer; sids, skey[j], payload, bytes), the session
-- keys touched first as in rb_load; and the CORRUPT reply of the first group
-- that fails rb_check (then no table). Reads only.
local function rb_load_groups(rb, gids)
  local out = {}
  if #gids == 0 then return out end
  local L = rb_load(rb, gids)
  if L.corrupt then return out, L.corrupt end
  local at = 0
  for i, gid in ipairs(gids) do
    local r = cjson.decode(L.recs[i])
    local g = {gid = gid, task = r.task, status = r.status, min_version = r.min_version, seq = r.seq,
      retryable = tostring(r.retryable), agentic = tostring(r.agentic), mv = r.mv, reroll = r.reroll,
      put_ms = r.put_ms, producer = r.producer, payload = L.ps[i], sids = cjson.decode(L.js[i]),
      skey = {}, bytes = #L.recs[i] + #L.js[i] + #L.ps[i]}
    for j = 1, #g.sids do
      g.skey[j] = L.skeys[at + j]
      if g.mv[j] == nil then g.mv[j] = g.min_version end
    end
    at = at + #g.sids
    out[i] = g
  end
  return out
end

-- The members of a group to re-roll at `cutoff` (per-member expiry): those
-- whose oldest token version is below it; every member when none is (the
-- group's min_version was declared older than any of its traces shows).
-- Returns a list of booleans (true = stale).
local function rb_stale_members(mv, cutoff)
  local stale, any = {}, false
  for i, v in ipairs(mv) do
    stale[i] = v < cutoff
    any = any or stale[i]
  end
  if not any then
    for i = 1, #mv do stale[i] = true end
  end
  return stale
end

-- Expire one group loaded by rb_load_groups out of cell c (status completed or aborted).
--   opts.keep: '' = the group's retryable flag, '1' keep, '0' release
--   opts.per_member: '1' = re-roll only stale members (skipped for agentic groups)
--   opts.cutoff: the staleness cutoff (number)
-- Kept: the group moves to `expired` (cell rb.ecell) with its order, its
-- sessions stay with the buffer; with per-member expiry its stale members'
-- sessions are released (one event each, reason 'expired'), the fresh ones
-- keep their order, and the group lists the released sids in `reroll`.
-- Released: every session released (one event each), the group deleted.
-- Appends the released sids to rb.rel_s; counts groups_expired in rb.st. The
-- releases are queued in rb.rel: the script runs sessions_release_flush(rb.rel)
-- and stats_flush once, before it returns. Returns true if kept.
local function rb_expire_group(rb, g, c, opts)
  rb_bytes_add(rb.bkey, g.status, g.task, -g.bytes)
  local keep
  if opts.keep == '' then keep = (g.retryable == '1') else keep = (opts.keep == '1') end
  rb.rel = rb.rel or {owner = rb.replay, okey = rb.oreplay, released = rb.released,
    events = rb.events, reason = 'expired', now = rb.now, st = rb.st}
  stats_add(rb.st, 'groups_expired', 1)
  if not keep then
    rb_index_drop(c, {g.gid})
    sessions_release(rb.rel, g.skey, g.sids, rb.rel_s)
    redis.call('HDEL', rb.groups, g.gid)
    redis.call('HDEL', rb.sidskey, g.gid)
    redis.call('HDEL', rb.payloads, g.gid)
    return false
  end
  local sids, mv = g.sids, g.mv
  if opts.per_member == '1' and g.agentic ~= '1' then
    local stale = rb_stale_members(g.mv, opts.cutoff)
    local rkeys, rsids = {}, {}
    sids, mv = {}, {}
    for j, sid in ipairs(g.sids) do
      if stale[j] then
        rkeys[#rkeys + 1] = g.skey[j]
        rsids[#rsids + 1] = sid
        g.reroll[#g.reroll + 1] = sid
      else
        sids[#sids + 1] = sid
        mv[#mv + 1] = g.mv[j]
      end
    end
    sessions_release(rb.rel, rkeys, rsids, rb.rel_s)
  end
  g.status, g.mv_json, g.reroll_json = 'expired', rb_json_list(mv), rb_json_list(g.reroll)
  local rec, sids_json = rb_rec(g), rb_json_list(sids)
  redis.call('HSET', rb.groups, g.gid, rec)
  redis.call('HSET', rb.sidskey, g.gid, sids_json)
  rb_index_move(c, rb.ecell, g.gid, g.seq)
  rb_bytes_add(rb.bkey, 'expired', g.task, #rec + #sids_json + #g.payload)
  return true
end

-- Hand groups loaded by rb_load to rb.to: their sessions move from the buffer
-- to the taker, the groups leave the indexes of their cell c (status
-- `status` of task `task`) and the three hashes; appends RB_FIELDS reply
-- fields per group (gid, rec, sids, payload) to `out`, in the order loaded.
-- One command per key (and chunk), plus one HSET per session.
local function rb_hand_over(rb, L, c, status, task, out)
  if #L.gids == 0 then return end
  local moved = {}
  for i, skey in ipairs(L.skeys) do
    if L.owned[i] == 1 then
      redis.call('HSET', skey, 'owner', rb.to)
      moved[#moved + 1] = L.sids[i]
    end
  end
  if rb.to ~= rb.replay and #moved > 0 then
    rb_call_chunked('SREM', rb.oreplay, moved)
    rb_call_chunked('SADD', rb.oto, moved)
  end
  rb_index_drop(c, L.gids)
  rb_call_chunked('HDEL', rb.groups, L.gids)
  rb_call_chunked('HDEL', rb.sidskey, L.gids)
  rb_call_chunked('HDEL', rb.payloads, L.gids)
  rb_bytes_add(rb.bkey, status, task, -L.bytes)
  local recs, js, ps = L.recs, L.js, L.ps
  for i, gid in ipairs(L.gids) do
    out[#out + 1] = gid
    out[#out + 1] = recs[i]
    out[#out + 1] = js[i]
    out[#out + 1] = ps[i]
  end
end
