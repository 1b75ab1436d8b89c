-- Idempotent replies of mutating scripts (DESIGN section 5, invariant 6).
-- A mutating script receives the key ts:{R}:op:<op_id> in KEYS and a TTL in
-- ARGV. On entry it returns the reply recorded under that key, if any (the
-- client retried a call whose reply was lost); on exit it records its reply.
local function op_replay(opkey)
  local v = redis.call('GET', opkey)
  if v then return cjson.decode(v) end
  return nil
end

local function op_record(opkey, ttl_ms, reply)
  redis.call('SET', opkey, cjson.encode(reply), 'PX', ttl_ms)
  return reply
end
