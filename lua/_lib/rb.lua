-- Replay-buffer helpers shared by lua/rb_*.lua (DESIGN section 7).
--
-- Keys protocol. The groups a take/expire/claim touches are chosen inside the
-- script, so the client cannot know their keys beforehand, and keys are never
-- built in Lua. The caller therefore passes a tail of KEYS (group hashes, then
-- session hashes) whose ids are listed in ARGV. The script plans with reads
-- only; if a key it needs is missing it returns {0, 'NEED', ...} naming the
-- ids (read from the fixed index ts:{R}:rb:sids) and writes nothing. The
-- client calls again with those keys; the second call commits atomically.
-- Every key a script touches is in KEYS; every KEYS entry is in slot {R}.
--
-- The helpers share one table `rb` that the calling script fills in once:
--   gmap, smap  gid -> group key, sid -> session key (rb_open)
--   sidskey     KEYS: ts:{R}:rb:sids        bkey     KEYS: ts:{R}:rb:bytes
--   oreplay     KEYS: ts:{R}:o:<replay>     replay   ARGV: the buffer's owner tag
--   to, oto     the taker's owner tag and its owner set (rb_hand_over)
--   qc, vc, qe, ve, released, events, now, rel_s   (rb_expire_group)
--   st          the script's counters (lua/_lib/stats.lua): the script flushes
--               them into ts:{R}:stats at its end (rb_expire_group counts
--               groups_expired and, through session_release, the releases)

local RB_TWO32 = 4294967296

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
-- reply, refuse a taker that gc declared lost (lost_key nil: no taker), parse
-- the keys tail into rb.gmap / rb.smap. Returns a reply to return at once, or nil.
local function rb_open(rb, opkey, lost_key, k0, a)
  local cached = op_replay(opkey)
  if cached then return cached end
  if lost_key then
    local lost_ms = redis.call('ZSCORE', lost_key, rb.to)
    if lost_ms then return {1, 'OWNER_LOST', rb.to, tonumber(lost_ms)} end
  end
  rb.gmap, rb.smap = rb_keymap(k0, a)
  if not rb.gmap then return {1, 'INVALID_INPUT', 'keys', 'KEYS tail does not match the ids in ARGV'} end
  return nil
end

-- Add to need.g the gids of `gids` whose group key is missing and to need.s
-- the sids of those groups whose session key is missing.
local function rb_missing(rb, gids, need)
  if #gids == 0 then return end
  local js = redis.call('HMGET', rb.sidskey, unpack(gids))
  for i, gid in ipairs(gids) do
    if not rb.gmap[gid] then need.g[#need.g + 1] = gid end
    if js[i] then
      local ok, sids = pcall(cjson.decode, js[i])
      if not ok or type(sids) ~= 'table' or not string.find(js[i], '^%s*%[') then
        need.corrupt = {1, 'CORRUPT', rb.sidskey, gid, 'not a JSON list of session ids'}
        return
      end
      for _, sid in ipairs(sids) do
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
  if need.corrupt then return need.corrupt end
  local picked, extra = {}, {}
  for i = 1, #cand do
    if i <= npicked then picked[#picked + 1] = cand[i] else extra[#extra + 1] = cand[i] end
  end
  rb_missing(rb, picked, need)
  if need.corrupt then return need.corrupt end
  if #need.g == 0 and #need.s == 0 then return nil end
  rb_missing(rb, extra, need)
  return rb_need_reply(need)
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

-- nil when the stored group gid can be handed to a client that decodes it
-- (task, status, sids a JSON list of strings, numeric min_version and seq, a
-- JSON object payload, all valid UTF-8); else the CORRUPT error reply naming
-- its key and field. Called before any write: a take or expiry never commits
-- a group the client would fail to decode.
local function rb_check_group(rb, gid)
  local gk = rb.gmap[gid]
  local f = redis.call('HMGET', gk, 'task', 'status', 'sids', 'min_version', 'seq', 'retryable', 'payload')
  local function bad(field, what) return {1, 'CORRUPT', gk, field, what} end
  if not f[1] or not rb_utf8(f[1]) then return bad('task', 'missing or not UTF-8') end
  if f[2] ~= 'completed' and f[2] ~= 'aborted' and f[2] ~= 'expired' then
    return bad('status', 'not a stored status')
  end
  local ok, sids = pcall(cjson.decode, f[3] or '')
  if not ok or type(sids) ~= 'table' or not string.find(f[3], '^%s*%[') or not rb_utf8(f[3]) then
    return bad('sids', 'not a JSON list')
  end
  for _, sid in ipairs(sids) do
    if type(sid) ~= 'string' then return bad('sids', 'not a list of session ids') end
  end
  if not tonumber(f[4]) then return bad('min_version', 'not a number') end
  if not tonumber(f[5]) then return bad('seq', 'not a number') end
  if f[6] and f[6] ~= '0' and f[6] ~= '1' then return bad('retryable', 'not 0 or 1') end
  local payload = f[7] or '{}'
  local okp, body = pcall(cjson.decode, payload)
  if not okp or type(body) ~= 'table' or not string.find(payload, '^%s*{') or not rb_utf8(payload) then
    return bad('payload', 'not a JSON object')
  end
  return nil
end

-- The first CORRUPT reply of the groups gids[1..n], or nil.
local function rb_check_groups(rb, gids, n)
  for i = 1, math.min(n, #gids) do
    local bad = rb_check_group(rb, gids[i])
    if bad then return bad end
  end
  return nil
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

-- Expire one stored group (status completed, in rb.qc/rb.vc). keep: move it
-- to `expired` (rb.qe/rb.ve), sessions stay owned by the buffer; else release
-- each of its sessions (one event each, reason 'expired') and delete the
-- group. keep_override '' uses the group's own retryable flag. Appends the
-- released sids to rb.rel_s. Returns true if kept.
local function rb_expire_group(rb, gid, keep_override)
  local gk = rb.gmap[gid]
  stats_add(rb.st, 'groups_expired', 1)
  local f = redis.call('HMGET', gk, 'task', 'seq', 'retryable', 'bytes', 'sids')
  local task, seq, bytes = f[1], f[2], tonumber(f[4]) or 0
  local vs = redis.call('ZSCORE', rb.vc, gid)
  redis.call('ZREM', rb.qc, gid)
  redis.call('ZREM', rb.vc, gid)
  rb_bytes_add(rb.bkey, 'completed', task, -bytes)
  local keep
  if keep_override == '' then keep = (f[3] == '1') else keep = (keep_override == '1') end
  if keep then
    redis.call('HSET', gk, 'status', 'expired')
    redis.call('ZADD', rb.qe, seq, gid)
    redis.call('ZADD', rb.ve, vs, gid)
    rb_bytes_add(rb.bkey, 'expired', task, bytes)
    return true
  end
  rb.rel = rb.rel or {owner = rb.replay, okey = rb.oreplay, released = rb.released,
    events = rb.events, reason = 'expired', now = rb.now, st = rb.st}
  local sids = cjson.decode(f[5])
  local skeys = {}
  for i, sid in ipairs(sids) do skeys[i] = rb.smap[sid] end
  sessions_release(rb.rel, skeys, sids, rb.rel_s)
  redis.call('DEL', gk)
  redis.call('HDEL', rb.sidskey, gid)
  return false
end

-- Hand one stored group (in queue q, version index v) to rb.to: move its
-- sessions from the buffer, delete the group and its index entries; append
-- its 7 reply fields to `out`.
local function rb_hand_over(rb, gid, q, v, out)
  local gk = rb.gmap[gid]
  local f = redis.call('HMGET', gk, 'task', 'status', 'sids', 'min_version', 'seq', 'retryable',
    'payload', 'bytes')
  for _, sid in ipairs(cjson.decode(f[3])) do
    session_move(rb.smap[sid], sid, rb.replay, rb.to, rb.oreplay, rb.oto)
  end
  redis.call('ZREM', q, gid)
  redis.call('ZREM', v, gid)
  redis.call('DEL', gk)
  redis.call('HDEL', rb.sidskey, gid)
  rb_bytes_add(rb.bkey, f[2], f[1], -(tonumber(f[8]) or 0))
  out[#out + 1] = gid
  for i = 2, 7 do out[#out + 1] = f[i] end
end
