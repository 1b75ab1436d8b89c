-- script: run_unlock
-- Release the run's lock if the caller's token holds it (a trainer that ends).
-- A lock held by another token (it expired and was taken, or taken over) is
-- left alone. Naturally idempotent: a retry finds the lock released already.
-- KEYS: 1
-- KEYS[1] = ts:{R}:lock   hash (see run_lock)
-- ARGV[1] = holder token
-- returns: {0, released (1 | 0: not held by this token)}
-- errors: none
local lock = KEYS[1]
if redis.call('HGET', lock, 'holder') == ARGV[1] then
  redis.call('DEL', lock)
  return {0, 1}
end
return {0, 0}
