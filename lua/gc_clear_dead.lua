-- script: gc_clear_dead
-- Delete a session's data tombstone if it still holds the value gc read before
-- it trimmed the session's release tombstone (lua/gc_trim_tombstones.lua). Once
-- the release tombstone is gone the id may be reopened, released and purged
-- again; that new purge writes a new value, and its data tombstone must stay
-- (DESIGN section 5, invariant 3). Naturally idempotent (compare and delete).
-- KEYS: 1
-- KEYS[1] = ts:{R/sid}:dead   data tombstone (string: purge time, ms)
-- ARGV[1] = the value read before the trim
-- returns: {0, deleted (0|1)}
-- errors: none
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return {0, 1}
end
return {0, 0}
