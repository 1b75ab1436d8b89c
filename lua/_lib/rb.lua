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

-- Add to need_g/need_s the gids of `gids` whose group key is missing and the
-- sids of those groups whose session key is missing.
local function rb_missing(sidskey, gids, gmap, smap, need_g, need_s)
  if #gids == 0 then return end
  local js = redis.call('HMGET', sidskey, unpack(gids))
  for i, gid in ipairs(gids) do
    if not gmap[gid] then need_g[#need_g + 1] = gid end
    if js[i] then
      for _, sid in ipairs(cjson.decode(js[i])) do
        if not smap[sid] then need_s[#need_s + 1] = sid end
      end
    end
  end
end

local function rb_need_reply(need_g, need_s)
  local out = {0, 'NEED', #need_g}
  for _, g in ipairs(need_g) do out[#out + 1] = g end
  for _, s in ipairs(need_s) do out[#out + 1] = s end
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

-- Expire one stored group (status completed, keys in qc/vc). keep: move it to
-- `expired` (qe/ve), sessions stay owned by the buffer; else release each of
-- its sessions (one event each, reason 'expired') and delete the group.
-- Appends to rel_s the released sids. Returns true if kept.
local function rb_expire_group(gid, gk, keep_override, qc, vc, qe, ve, oreplay, released, events,
                               sidskey, bkey, smap, replay, now, rel_s)
  local f = redis.call('HMGET', gk, 'task', 'seq', 'retryable', 'bytes', 'sids')
  local task, seq, bytes = f[1], f[2], tonumber(f[4]) or 0
  local vs = redis.call('ZSCORE', vc, gid)
  redis.call('ZREM', qc, gid)
  redis.call('ZREM', vc, gid)
  rb_bytes_add(bkey, 'completed', task, -bytes)
  local keep
  if keep_override == '' then keep = (f[3] == '1') else keep = (keep_override == '1') end
  if keep then
    redis.call('HSET', gk, 'status', 'expired')
    redis.call('ZADD', qe, seq, gid)
    redis.call('ZADD', ve, vs, gid)
    rb_bytes_add(bkey, 'expired', task, bytes)
    return true
  end
  for _, sid in ipairs(cjson.decode(f[5])) do
    if session_release(smap[sid], sid, replay, oreplay, released, events, 'expired', now) then
      rel_s[#rel_s + 1] = sid
    end
  end
  redis.call('DEL', gk)
  redis.call('HDEL', sidskey, gid)
  return false
end

-- Hand one stored group to `to`: move its sessions from the buffer, delete
-- the group and its index entries; append its 7 reply fields to `out`.
local function rb_hand_over(gid, gk, q, v, oreplay, oto, sidskey, bkey, smap, replay, to, out)
  local f = redis.call('HMGET', gk, 'task', 'status', 'sids', 'min_version', 'seq', 'retryable',
    'payload', 'bytes')
  for _, sid in ipairs(cjson.decode(f[3])) do
    session_move(smap[sid], sid, replay, to, oreplay, oto)
  end
  redis.call('ZREM', q, gid)
  redis.call('ZREM', v, gid)
  redis.call('DEL', gk)
  redis.call('HDEL', sidskey, gid)
  rb_bytes_add(bkey, f[2], f[1], -(tonumber(f[8]) or 0))
  out[#out + 1] = gid
  out[#out + 1] = f[2]
  out[#out + 1] = f[3]
  out[#out + 1] = f[4]
  out[#out + 1] = f[5]
  out[#out + 1] = f[6]
  out[#out + 1] = f[7]
end
