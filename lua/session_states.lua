#!lua flags=no-writes
-- script: session_states
-- Read owner and state of many sessions at once (control plane, read-only).
-- A live session has its hash; a released one has only its tombstone in the
-- released zset (its hash went with the release), so it reads as
-- ("", "released"); a hash left by an older release (state = released) reads
-- the same.
-- KEYS: 1+
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:released     zset sid -> released ms (tombstones)
-- KEYS[2..1+n] = ts:{R}:s:<sid>  hash per session (all in the run's slot)
-- ARGV[1..n] = sid of each session key, same order
-- returns: {0, owner_1, state_1, ..., owner_n, state_n}; "", "" for an unknown session
-- errors: none
local out = {0}
for i = 2, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 'owner', 'state')
  if v[2] == 'live' then
    out[#out + 1] = v[1] or ''
    out[#out + 1] = 'live'
  elseif v[2] == 'released' or redis.call('ZSCORE', KEYS[1], ARGV[i - 1]) then
    out[#out + 1] = ''
    out[#out + 1] = 'released'
  else
    out[#out + 1] = ''
    out[#out + 1] = ''
  end
end
return out
