-- script: response_keep
-- Keep the items of one Responses-API response (its new input and its output,
-- as canonical messages, and the id of the response it continued), so that a
-- later request naming it as previous_response_id resolves the conversation on
-- any gateway (docs/design.md section 17). One field per response in the
-- session's data slot; the hash goes with the session's other data keys when
-- the session is released. Idempotent: a retry writes the same value again.
-- KEYS: 2
-- KEYS[1] = ts:{R/sid}:resp  hash response id -> items (JSON, see tracestore/traces/responses.py)
-- KEYS[2] = ts:{R/sid}:dead  tombstone (string)
-- ARGV[1] = session id (for error fields)
-- ARGV[2] = field: the response id
-- ARGV[3] = the items (JSON bytes)
-- returns: {0}
-- errors: SESSION_RELEASED (sid, detail) when the session's data was purged
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1, 'SESSION_RELEASED', ARGV[1], 'its trace data was purged'}
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return {0}
