#!lua flags=no-writes
-- script: session_states
-- Read owner and state of many sessions at once (control plane, read-only).
-- KEYS: 0+
-- CHUNK: 4000
-- KEYS[1..n] = ts:{R}:s:<sid>   hash per session (all in the run's slot)
-- ARGV: none
-- returns: {0, owner_1, state_1, ..., owner_n, state_n}; "" for an unknown session
-- errors: none
local out = {0}
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 'owner', 'state')
  out[#out + 1] = v[1] or ''
  out[#out + 1] = v[2] or ''
end
return out
