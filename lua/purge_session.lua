-- script: purge_session
-- Delete a session's data keys and leave the data tombstone (release phase 2).
-- Idempotent: purging twice leaves the same state. Later writes fail with
-- SESSION_RELEASED because record_turn/insert check the tombstone. The data
-- keys come from tracestore/keys.py Keys.data_keys, so a data key added there
-- is purged without changing this script.
-- KEYS: 1+
-- KEYS[1] = ts:{R/sid}:dead   string (tombstone)
-- KEYS[2..1+n] = ts:{R/sid}:* data keys of the session (idx, tok, txt; same slot)
-- ARGV[1] = tombstone TTL in ms (0 = keep forever)
-- returns: {0, deleted_keys (int)}
-- errors: none
-- include: op
local ttl = tonumber(ARGV[1])
local deleted = 0
if #KEYS > 1 then deleted = redis.call('DEL', unpack(KEYS, 2)) end
if ttl and ttl > 0 then
  redis.call('SET', KEYS[1], now_ms(), 'PX', ttl)
else
  redis.call('SET', KEYS[1], now_ms())
end
return {0, deleted}
