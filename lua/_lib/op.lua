-- Idempotent replies of mutating scripts (DESIGN section 5, invariant 6).
-- A mutating script receives the key ts:{R}:op:<op_id> in KEYS and a TTL in
-- ARGV. On entry it returns the reply recorded under that key, if any (the
-- client retried a call whose reply was lost); on exit it records its reply.
-- A replay rewrites the record's expiry (same deadline): a WAIT after this
-- call (durability levels) waits for this connection's last write, and a
-- replay on a new connection would otherwise have none, so WAIT would
-- confirm at once a first write its replicas may not have yet. pcall: a
-- primary refusing writes (min-replicas-to-write) still answers the replay.
local function op_replay(opkey)
  local v = redis.call('GET', opkey)
  if v then
    redis.pcall('PEXPIRE', opkey, math.max(1, redis.call('PTTL', opkey)))
    return cjson.decode(v)
  end
  return nil
end

local function op_record(opkey, ttl_ms, reply)
  redis.call('SET', opkey, cjson.encode(reply), 'PX', ttl_ms)
  return reply
end
