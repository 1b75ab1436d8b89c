-- script: gate_holder_done
-- Drop a holder's heartbeat entry (a holder that stops cleanly, or gc
-- forgetting holders long dead): refused while the holder has unsettled
-- leases in the held index (if its process does not come back, they must
-- stay resolvable), and, with a cutoff, while its deadline is at or after
-- the cutoff. Naturally idempotent (a retry removes nothing more).
-- KEYS: 2
-- KEYS[1] = ts:{R}:gate:holders    zset holder -> heartbeat deadline (ms, server clock)
-- KEYS[2] = ts:{R}:gate:held       zset (scores 0): '<holder> <lease id>' of every unsettled lease
-- ARGV[1] = holder tag
-- ARGV[2] = cutoff (ms, server clock; '' for none): only a deadline before it is dropped
-- returns: {0, gone (0|1: no entry left), removed (0|1: by this call), unsettled leases of the holder (int)}
-- errors: none
-- include: clock
-- include: gate
local holders, held, holder = KEYS[1], KEYS[2], ARGV[1]
local mine = #gate_held_of(held, holder)
if mine > 0 then return {0, 0, 0, mine} end
if ARGV[2] ~= '' then
  local d = redis.call('ZSCORE', holders, holder)
  if d and tonumber(d) >= tonumber(ARGV[2]) then return {0, 0, 0, 0} end
end
return {0, 1, redis.call('ZREM', holders, holder), 0}
