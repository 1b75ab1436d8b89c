#!lua flags=no-writes
-- script: route_status
-- Read the routing table: load per entrypoint, counts, and the routes of
-- the given sessions.
-- KEYS: 3
-- KEYS[1] = ts:{R}:route           hash: sid -> entrypoint
-- KEYS[2] = ts:{R}:route:load      zset: entrypoint -> sessions routed to it
-- KEYS[3] = ts:{R}:route:retired   zset: sid -> tombstone expiry ms (server clock)
-- ARGV[1..n] = session ids to look up (may be none)
-- returns: {0, routed (int), retired (int, unexpired tombstones), n_load, (entrypoint, load)...,
--           route of each ARGV sid ("" unrouted, "!retired" when tombstoned)...}
-- errors: none
-- include: clock
local route, load, retired = KEYS[1], KEYS[2], KEYS[3]
local now = now_ms()
local out = {0, redis.call('HLEN', route), redis.call('ZCOUNT', retired, '(' .. now, '+inf')}
local l = redis.call('ZRANGE', load, 0, -1, 'WITHSCORES')
out[#out + 1] = #l / 2
for i = 1, #l do out[#out + 1] = l[i] end
for i = 1, #ARGV do
  local u = redis.call('ZSCORE', retired, ARGV[i])
  if u and tonumber(u) > now then
    out[#out + 1] = '!retired'
  else
    out[#out + 1] = redis.call('HGET', route, ARGV[i]) or ''
  end
end
return out
