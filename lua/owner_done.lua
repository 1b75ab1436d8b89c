-- script: owner_done
-- An owner tag is done (its process closes cleanly): drop its heartbeat, so
-- gc never declares it lost, unless it still owns sessions. An owner that
-- holds sessions keeps its heartbeat: if it does not come back, gc must still
-- release them (nothing leaks because a process ended). A lost owner stays
-- lost. Naturally idempotent: a retry finds the heartbeat gone already.
-- KEYS: 2
-- KEYS[1] = ts:{R}:owners        zset owner -> heartbeat deadline (ms, server clock)
-- KEYS[2] = ts:{R}:o:<owner>     set of sids owned by owner
-- ARGV[1] = owner tag
-- returns: {0, done (1: no heartbeat left | 0: kept, it owns sessions), sessions owned (int)}
-- errors: none
local owners, okey = KEYS[1], KEYS[2]
local held = redis.call('SCARD', okey)
if held > 0 then return {0, 0, held} end
redis.call('ZREM', owners, ARGV[1])
return {0, 1, 0}
