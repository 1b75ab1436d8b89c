-- script: route_retire
-- Retire sessions: drop their routes (and their entrypoints' load) and write
-- tombstones that make acquire raise SessionRetired (HTTP 410 Gone) until
-- they expire. Expired tombstones are trimmed on the way (range delete).
-- Retiring a retired session extends nothing and is not returned; a client
-- retry of the same call (same op id) returns the first reply.
-- KEYS: 4
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:route           hash: sid -> entrypoint
-- KEYS[2] = ts:{R}:route:load      zset: entrypoint -> sessions routed to it
-- KEYS[3] = ts:{R}:route:retired   zset: sid -> tombstone expiry ms (server clock)
-- KEYS[4] = ts:{R}:op:<op id>      the reply of this call, for retries
-- ARGV[1] = tombstone retention (ms, > 0)
-- ARGV[2] = op reply ttl (ms)
-- ARGV[3..n+2] = session ids
-- returns: {0, sids retired by this call...}
-- errors: none
-- include: clock
-- include: op
local route, load, retired = KEYS[1], KEYS[2], KEYS[3]
local cached = op_replay(KEYS[4])
if cached then return cached end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', retired, '-inf', now)
local expires = now + tonumber(ARGV[1])
local out = {0}
for i = 3, #ARGV do
  local sid = ARGV[i]
  if not redis.call('ZSCORE', retired, sid) then
    local ep = redis.call('HGET', route, sid)
    if ep then
      redis.call('HDEL', route, sid)
      if tonumber(redis.call('ZINCRBY', load, -1, ep)) <= 0 then
        redis.call('ZREM', load, ep)
      end
    end
    redis.call('ZADD', retired, expires, sid)
    out[#out + 1] = sid
  end
end
return op_record(KEYS[4], tonumber(ARGV[2]), out)
