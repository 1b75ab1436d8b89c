-- script: gate_seal
-- Seal the gate (no new admission until reopen) or reopen it, and return
-- the status right after. Sealing a sealed gate keeps its first sealed_ms;
-- both are naturally idempotent under client retry.
-- KEYS: 3
-- KEYS[1] = ts:{R}:gate            hash: state, version, sealed_ms, retry_ms
-- KEYS[2] = ts:{R}:gate:leases     zset: lease id -> deadline ms (read)
-- KEYS[3] = ts:{R}:gate:poison     hash: lease id -> reason json (read)
-- ARGV[1] = "seal" | "reopen"
-- ARGV[2] = retry hint given to refused admissions while sealed (ms)
-- ARGV[3] = max ids to return per list of the status
-- returns: the reply of gate_status
-- errors: none
-- include: gate
local gate = KEYS[1]
local state = redis.call('HGET', gate, 'state')
if ARGV[1] == 'seal' then
  if state ~= 'sealed' then
    redis.call('HSET', gate, 'state', 'sealed', 'sealed_ms', gate_now_ms(), 'retry_ms', ARGV[2])
  end
elseif state ~= 'open' then
  redis.call('HSET', gate, 'state', 'open')
  redis.call('HDEL', gate, 'sealed_ms')
end
return gate_status_reply(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[3]))
