-- Replay-buffer helpers shared by lua/rb_*.lua (DESIGN section 7).
--
-- Which keys a take, claim or expire touches is decided inside the script
-- (the head of a queue, the stale range of a version index): the group hashes
-- ts:{R}:rb:g:<gid> and the session hashes ts:{R}:s:<sid> of the groups it
-- picks. Two ways to reach them, chosen by the caller:
--
-- * in-script keys (the default, one round trip): ARGV carries the two key
--   prefixes "ts:{R}:rb:g:" and "ts:{R}:s:" (built by tracestore/keys.py) and
--   the script appends the id. Every such key has the hash tag {R} of the
--   declared keys (checked in rb_open), so it lives in the one slot the script
--   runs on: Redis 7 and Valkey 8 allow a script to access an undeclared key
--   of its own slot on a cluster (scriptVerifyClusterState only refuses a key
--   of another slot, or of a slot the node does not serve). The EVAL docs
--   still ask scripts to declare every key, so this is permitted, not
--   promised; see docs/replay.md.
-- * declared keys (StoreConfig.replay_declared_keys, two round trips): the
--   caller passes a tail of KEYS (group hashes, then session hashes) whose
--   ids are listed in ARGV. The script plans with reads only; if a key it
--   needs is missing it returns {0, 'NEED', ...} naming the ids (read from the
--   fixed index ts:{R}:rb:sids) and writes nothing; the client calls again
--   with those keys and the second call commits atomically.
--
-- Either way a script reads every group and session key it will write before
-- its first write (rb_load), so a key it cannot access (a slot migrating under
-- it) fails the call with nothing written.
--
-- The helpers share one table `rb` that the calling script fills in once:
--   gmap, smap  gid -> group key, sid -> session key (declared tail; rb_open)
--   gpre, spre  key prefixes of groups and sessions ('' = declared keys only)
--   sidskey     KEYS: ts:{R}:rb:sids        bkey     KEYS: ts:{R}:rb:bytes
--   oreplay     KEYS: ts:{R}:o:<replay>     replay   ARGV: the buffer's owner tag
--   to, oto     the taker's owner tag and its owner set (rb_hand_over)
--   qe, ve, released, events, now, rel_s   (rb_expire_group)
--
-- A loaded group (rb_load) is a table: gid, key, task, status, sids (list),
-- sids_json, min_version (number), seq, retryable, payload, bytes, agentic,
-- mv (member versions, list), reroll_json, owned (list of bools: session i
-- is live and owned by the buffer).

local RB_TWO32 = 4294967296
-- Values per redis.call of a variadic command (Lua's unpack limit is ~8000).
local RB_CHUNK = 4000
-- Reply fields per group: gid, status, sids, min_version, seq, retryable,
-- payload, agentic, member versions, reroll.
local RB_FIELDS = 10

-- A Lua list as a JSON array (cjson encodes an empty table as an object).
local function rb_json_list(t)
  if #t == 0 then return '[]' end
  return cjson.encode(t)
end

local function rb_tag(key)
  return string.match(key, '{(.-)}')
end

-- Parse the tail: ARGV[a] = g, ARGV[a+1..a+g] = gids, ARGV[a+g+1] = s, then s
-- sids; KEYS[k0+1..k0+g] are the group keys, KEYS[k0+g+1..k0+g+s] the session
-- keys, in the same order. Returns gid->key and sid->key maps (nil on a
-- malformed call).
local function rb_keymap(k0, a)
  local gmap, smap = {}, {}
  local ng = tonumber(ARGV[a])
  local ns = tonumber(ARGV[a + ng + 1])
  if #KEYS ~= k0 + ng + ns then return nil, nil end
  for i = 1, ng do gmap[ARGV[a + i]] = KEYS[k0 + i] end
  for i = 1, ns do smap[ARGV[a + ng + 1 + i]] = KEYS[k0 + ng + i] end
  return gmap, smap
end

-- The start every take, claim and expire shares: replay a retried call's
-- reply, refuse a taker that gc declared lost (lost_key nil: no taker), read
-- the key prefixes ARGV[a], ARGV[a+1] and parse the keys tail from ARGV[a+2]
-- into rb.gmap / rb.smap. Returns a reply to return at once, or nil.
local function rb_open(rb, opkey, lost_key, k0, a)
  local cached = op_replay(opkey)
  if cached then return cached end
  if lost_key then
    local lost_ms = redis.call('ZSCORE', lost_key, rb.to)
    if lost_ms then return {1, 'OWNER_LOST', rb.to, tonumber(lost_ms)} end
  end
  rb.gpre, rb.spre = ARGV[a], ARGV[a + 1]
  if rb.gpre ~= '' then
    local tag = rb_tag(opkey)
    if rb_tag(rb.gpre) ~= tag or rb_tag(rb.spre) ~= tag then
      return {1, 'INVALID_INPUT', 'keys', 'key prefixes are not in the slot of the declared keys'}
    end
  end
  rb.gmap, rb.smap = rb_keymap(k0, a + 2)
  if not rb.gmap then return {1, 'INVALID_INPUT', 'keys', 'KEYS tail does not match the ids in ARGV'} end
  return nil
end

local function rb_gkey(rb, gid)
  local k = rb.gmap[gid]
  if k == nil and rb.gpre ~= '' then k = rb.gpre .. gid end
  return k
end

local function rb_skey(rb, sid)
  local k = rb.smap[sid]
  if k == nil and rb.spre ~= '' then k = rb.spre .. sid end
  return k
end

-- Declared keys only: add to need.g the gids of `gids` whose group key is
-- missing and to need.s the sids of those groups whose session key is
-- missing. (With in-script keys nothing is ever missing.)
local function rb_missing(rb, gids, need)
  if #gids == 0 or rb.gpre ~= '' then return end
  local js = redis.call('HMGET', rb.sidskey, unpack(gids))
  for i, gid in ipairs(gids) do
    if not rb.gmap[gid] then need.g[#need.g + 1] = gid end
    if js[i] then
      for _, sid in ipairs(cjson.decode(js[i])) do
        if not rb.smap[sid] then need.s[#need.s + 1] = sid end
      end
    end
  end
end

local function rb_need_reply(need)
  local out = {0, 'NEED', #need.g}
  for _, g in ipairs(need.g) do out[#out + 1] = g end
  for _, s in ipairs(need.s) do out[#out + 1] = s end
  return out
end

-- The NEED reply of a take or claim that picked cand[1..npicked] (plus what
-- `need` holds already), or nil when every key is at hand. A NEED names the
-- whole window cand[1..#cand], so a retry survives other takers removing the head.
local function rb_need_window(rb, cand, npicked, need)
  local picked, extra = {}, {}
  for i = 1, #cand do
    if i <= npicked then picked[#picked + 1] = cand[i] else extra[#extra + 1] = cand[i] end
  end
  rb_missing(rb, picked, need)
  if #need.g == 0 and #need.s == 0 then return nil end
  rb_missing(rb, extra, need)
  return rb_need_reply(need)
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

-- redis.call(cmd, key, items...) in chunks below Lua's unpack limit.
local function rb_call_chunked(cmd, key, items)
  for i = 1, #items, RB_CHUNK do
    redis.call(cmd, key, unpack(items, i, math.min(i + RB_CHUNK - 1, #items)))
  end
end

-- Read a stored group and the ownership of its sessions (reads only).
local function rb_load(rb, gid)
  local key = rb_gkey(rb, gid)
  local f = redis.call('HMGET', key, 'task', 'status', 'sids', 'min_version', 'seq', 'retryable',
    'payload', 'bytes', 'agentic', 'mv', 'reroll')
  local g = {gid = gid, key = key, task = f[1], status = f[2], sids_json = f[3],
    min_version = tonumber(f[4]), seq = f[5], retryable = f[6], payload = f[7],
    bytes = tonumber(f[8]) or 0, agentic = f[9] or '0', reroll_json = f[11] or '[]', owned = {}}
  g.sids = cjson.decode(f[3])
  if f[10] then g.mv = cjson.decode(f[10]) else g.mv = {} end
  for i, sid in ipairs(g.sids) do
    local cur = redis.call('HMGET', rb_skey(rb, sid), 'owner', 'state')
    g.owned[i] = (cur[2] == 'live' and cur[1] == rb.replay)
    if g.mv[i] == nil then g.mv[i] = g.min_version end
  end
  return g
end

local function rb_load_all(rb, gids)
  local out = {}
  for i, gid in ipairs(gids) do out[i] = rb_load(rb, gid) end
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

-- Expire one loaded group out of its queue q / version index v (status
-- completed or aborted).
--   opts.keep: '' = the group's retryable flag, '1' keep, '0' release
--   opts.per_member: '1' = re-roll only stale members (skipped for agentic groups)
--   opts.cutoff: the staleness cutoff (number)
-- Kept: the group moves to `expired` (rb.qe / rb.ve) with its order, its
-- sessions stay with the buffer; with per-member expiry its stale members'
-- sessions are released (one event each, reason 'expired'), the fresh ones
-- keep their order, and the group lists the released sids in `reroll`.
-- Released: every session released (one event each), the group deleted.
-- Appends the released sids to rb.rel_s. Returns true if kept.
local function rb_expire_group(rb, g, q, v, opts)
  local vs = redis.call('ZSCORE', v, g.gid)
  redis.call('ZREM', q, g.gid)
  redis.call('ZREM', v, g.gid)
  rb_bytes_add(rb.bkey, g.status, g.task, -g.bytes)
  local keep
  if opts.keep == '' then keep = (g.retryable == '1') else keep = (opts.keep == '1') end
  rb.rel = rb.rel or {owner = rb.replay, okey = rb.oreplay, released = rb.released,
    events = rb.events, reason = 'expired', now = rb.now}
  if not keep then
    for _, sid in ipairs(g.sids) do
      if session_release(rb_skey(rb, sid), sid, rb.rel) then rb.rel_s[#rb.rel_s + 1] = sid end
    end
    redis.call('DEL', g.key)
    redis.call('HDEL', rb.sidskey, g.gid)
    return false
  end
  local fields = {'status', 'expired'}
  local bytes = g.bytes
  if opts.per_member == '1' and g.agentic ~= '1' then
    local stale = rb_stale_members(g.mv, opts.cutoff)
    local fresh, fresh_mv, reroll = {}, {}, cjson.decode(g.reroll_json)
    for i, sid in ipairs(g.sids) do
      if stale[i] then
        if session_release(rb_skey(rb, sid), sid, rb.rel) then rb.rel_s[#rb.rel_s + 1] = sid end
        reroll[#reroll + 1] = sid
      else
        fresh[#fresh + 1] = sid
        fresh_mv[#fresh_mv + 1] = g.mv[i]
      end
    end
    local sids_json = rb_json_list(fresh)
    bytes = bytes + #sids_json - #g.sids_json
    fields = {'status', 'expired', 'sids', sids_json, 'mv', rb_json_list(fresh_mv),
      'reroll', rb_json_list(reroll), 'bytes', bytes}
    redis.call('HSET', rb.sidskey, g.gid, sids_json)
  end
  redis.call('HSET', g.key, unpack(fields))
  redis.call('ZADD', rb.qe, g.seq, g.gid)
  redis.call('ZADD', rb.ve, vs, g.gid)
  rb_bytes_add(rb.bkey, 'expired', g.task, bytes)
  return true
end

-- Hand loaded groups to rb.to: their sessions move from the buffer to the
-- taker, the groups and their index entries (g.q, g.v: the group's queue and
-- version index) are deleted; appends RB_FIELDS reply fields per group to
-- `out`, in the order of `groups`. Batched: one ZREM/HDEL/DEL/SREM/SADD per
-- key and chunk, one HSET per session.
local function rb_hand_over(rb, groups, out)
  if #groups == 0 then return end
  local gids, gkeys, moved, bytes, zrem = {}, {}, {}, {}, {}
  for _, g in ipairs(groups) do
    for i, sid in ipairs(g.sids) do
      if g.owned[i] then
        redis.call('HSET', rb_skey(rb, sid), 'owner', rb.to)
        moved[#moved + 1] = sid
      end
    end
    gids[#gids + 1] = g.gid
    gkeys[#gkeys + 1] = g.key
    for _, z in ipairs({g.q, g.v}) do
      zrem[z] = zrem[z] or {}
      zrem[z][#zrem[z] + 1] = g.gid
    end
    local cell = g.status .. ' ' .. g.task
    bytes[cell] = (bytes[cell] or 0) + g.bytes
    out[#out + 1] = g.gid
    out[#out + 1] = g.status
    out[#out + 1] = g.sids_json
    out[#out + 1] = g.min_version
    out[#out + 1] = g.seq
    out[#out + 1] = g.retryable
    out[#out + 1] = g.payload
    out[#out + 1] = g.agentic
    out[#out + 1] = rb_json_list(g.mv)
    out[#out + 1] = g.reroll_json
  end
  if rb.to ~= rb.replay and #moved > 0 then
    rb_call_chunked('SREM', rb.oreplay, moved)
    rb_call_chunked('SADD', rb.oto, moved)
  end
  for z, members in pairs(zrem) do rb_call_chunked('ZREM', z, members) end
  rb_call_chunked('HDEL', rb.sidskey, gids)
  for i = 1, #gkeys, RB_CHUNK do
    redis.call('DEL', unpack(gkeys, i, math.min(i + RB_CHUNK - 1, #gkeys)))
  end
  for cell, n in pairs(bytes) do
    if n ~= 0 then redis.call('HINCRBY', rb.bkey, cell, -n) end
  end
end
