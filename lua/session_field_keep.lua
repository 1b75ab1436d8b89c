-- script: session_field_keep
-- Keep one field of a session's data hash that lives a while after its last
-- write: the tokens a turn generated before a weight update stopped it
-- (ts:{R/sid}:part, field: the node id of the turn's prompt key; DESIGN
-- section 15, tracestore/traces/partial.py), or what a recorded turn answered,
-- for its retries (ts:{R/sid}:ans, field: the turn's retry digest;
-- docs/gateway.md, Retries, tracestore/traces/answers.py). The hash expires
-- when no field was written for ARGV[3] ms. Refused once the session's data
-- was purged, so a late write cannot outlive its session. Idempotent: a retry
-- writes the same value again.
-- KEYS: 2
-- KEYS[1] = ts:{R/sid}:part or ts:{R/sid}:ans   the hash
-- KEYS[2] = ts:{R/sid}:dead  tombstone (string)
-- ARGV[1] = session id (for error fields)
-- ARGV[2] = field
-- ARGV[3] = ttl of the hash (ms)
-- ARGV[4] = value (bytes)
-- returns: {0}
-- errors: SESSION_RELEASED (sid, detail) when the session's data was purged
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1, 'SESSION_RELEASED', ARGV[1], 'its trace data was purged'}
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return {0}
