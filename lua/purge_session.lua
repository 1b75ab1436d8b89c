-- script: purge_session
-- Delete a session's data keys and leave the data tombstone (release phase 2).
-- Idempotent: purging twice leaves the same state. Later writes fail with
-- SESSION_RELEASED because record_turn/insert check the tombstone.
-- KEYS: 4
-- KEYS[1] = ts:{R/sid}:idx    hash
-- KEYS[2] = ts:{R/sid}:tok    hash
-- KEYS[3] = ts:{R/sid}:txt    hash
-- KEYS[4] = ts:{R/sid}:dead   string (tombstone)
-- ARGV[1] = tombstone TTL in ms (0 = keep forever)
-- returns: {0, deleted_keys (int)}
-- errors: none
-- include: op
local ttl = tonumber(ARGV[1])
local deleted = redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
if ttl and ttl > 0 then
  redis.call('SET', KEYS[4], now_ms(), 'PX', ttl)
else
  redis.call('SET', KEYS[4], now_ms())
end
return {0, deleted}
