-- script: run_unlock
-- Release the run's lock if the caller's token holds it (a trainer that ends).
-- A lock held by another token (it expired and was taken, or taken over) is
-- left alone. Naturally idempotent, with the same reply: a retry of a release
-- whose reply was lost finds the lock free and answers 1 again.
-- KEYS: 1
-- KEYS[1] = ts:{R}:lock   hash (see run_lock)
-- ARGV[1] = holder token
-- returns: {0, released (1: this token does not hold the lock and no other does, by this call or before | 0: another token holds it)}
-- errors: none
local lock = KEYS[1]
local holder = redis.call('HGET', lock, 'holder')
if holder == ARGV[1] then
  redis.call('DEL', lock)
  return {0, 1}
end
if holder then return {0, 0} end
return {0, 1}
