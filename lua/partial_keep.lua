-- script: partial_keep
-- Keep the tokens a turn generated before a weight update stopped it, so that
-- the turn can be continued later, by this gateway or another (DESIGN section
-- 15). One field per turn, named by the node id of the turn's prompt key; the
-- hash expires when no turn was kept for ARGV[3] ms. Idempotent: a retry
-- writes the same value again.
-- KEYS: 2
-- KEYS[1] = ts:{R/sid}:part  hash prompt node id -> kept tokens (see tracestore/traces/partial.py)
-- KEYS[2] = ts:{R/sid}:dead  tombstone (string)
-- ARGV[1] = session id (for error fields)
-- ARGV[2] = field: the prompt key's node id (16 hex)
-- ARGV[3] = ttl of the hash (ms)
-- ARGV[4] = the kept tokens (bytes)
-- returns: {0}
-- errors: SESSION_RELEASED (sid, detail) when the session's data was purged
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1, 'SESSION_RELEASED', ARGV[1], 'its trace data was purged'}
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return {0}
