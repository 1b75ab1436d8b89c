-- script: answer_keep
-- Keep what a recorded turn answered, so that a retry of the same turn (same
-- session, same prompt, same sampling options) is answered from it instead of
-- generating again (docs/gateway.md, Retries). One field per turn, named by
-- the turn's retry digest; the hash expires when no answer was kept for
-- ARGV[3] ms. Idempotent: a retry writes the same value again.
-- KEYS: 2
-- KEYS[1] = ts:{R/sid}:ans   hash retry digest -> the answer record (JSON, tracestore/traces/answers.py)
-- KEYS[2] = ts:{R/sid}:dead  tombstone (string)
-- ARGV[1] = session id (for error fields)
-- ARGV[2] = field: the turn's retry digest (32 hex)
-- ARGV[3] = ttl of the hash (ms)
-- ARGV[4] = the answer record (bytes)
-- returns: {0}
-- errors: SESSION_RELEASED (sid, detail) when the session's data was purged
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1, 'SESSION_RELEASED', ARGV[1], 'its trace data was purged'}
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return {0}
