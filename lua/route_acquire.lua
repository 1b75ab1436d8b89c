-- script: route_acquire
-- Session affinity: the entrypoint that serves a session. Sticky: a routed
-- session keeps its entrypoint while that entrypoint is in the caller's list;
-- a new session (or one whose entrypoint left the list) goes to the
-- least-loaded entrypoint of the list (ties: list order). Atomic, so
-- concurrent acquires of one new session all get the same answer. The list
-- comes from the caller (ARGV), so routers with different lists share the
-- routes and the load counts but each only places sessions on its own list.
-- Idempotent under client retry: a call that placed or moved the session
-- records its reply under the op key, so a retry returns the same `how` and
-- `previous` (a sticky call writes nothing and stays sticky on retry).
-- KEYS: 4
-- KEYS[1] = ts:{R}:route           hash: sid -> entrypoint
-- KEYS[2] = ts:{R}:route:load      zset: entrypoint -> sessions routed to it
-- KEYS[3] = ts:{R}:route:retired   zset: sid -> tombstone expiry ms (server clock)
-- KEYS[4] = ts:{R}:op:<op_id>      cached reply of this call (retry idempotency)
-- ARGV[1] = session id
-- ARGV[2] = op reply TTL (ms)
-- ARGV[3..n+2] = entrypoints (n >= 1, distinct)
-- returns: {0, entrypoint, how ("sticky" | "new" | "moved"), previous entrypoint ("" unless moved)}
-- errors: SESSION_RETIRED (sid)
-- include: clock
-- include: op
local route, load, retired, opkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local sid = ARGV[1]
local cached = op_replay(opkey)
if cached then return cached end
local until_ms = redis.call('ZSCORE', retired, sid)
if until_ms then
  local now = now_ms()
  if tonumber(until_ms) > now then
    return {1, 'SESSION_RETIRED', sid}
  end
  redis.call('ZREM', retired, sid)
end
local cur = redis.call('HGET', route, sid)
local best, best_load = nil, nil
for i = 3, #ARGV do
  local ep = ARGV[i]
  if cur and ep == cur then
    return {0, cur, 'sticky', ''}
  end
  local l = tonumber(redis.call('ZSCORE', load, ep) or '0')
  if best_load == nil or l < best_load then
    best, best_load = ep, l
  end
end
local how, prev = 'new', ''
if cur then
  how, prev = 'moved', cur
  if tonumber(redis.call('ZINCRBY', load, -1, cur)) <= 0 then
    redis.call('ZREM', load, cur)
  end
end
redis.call('HSET', route, sid, best)
redis.call('ZINCRBY', load, 1, best)
return op_record(opkey, tonumber(ARGV[2]), {0, best, how, prev})
