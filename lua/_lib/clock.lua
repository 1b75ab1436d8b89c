-- The server clock, the one time source of every script (deadlines, release
-- times, heartbeats): clients' clocks may disagree, the server's is shared.
-- Scripts calling TIME are non-deterministic; Redis 7 replicates their
-- effects, not the script, so replicas see the same times.
local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
