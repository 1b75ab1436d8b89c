-- script: heartbeat
-- Record that `owner` is alive until now + ttl (server clock). gc releases the
-- sessions of an owner whose deadline passed and records it as lost; a lost
-- owner's heartbeat is refused, so its released sessions stay released and no
-- new session can be opened under its tag.
-- Naturally idempotent under client retry (a retry only moves the deadline to
-- now + ttl again), so it takes no op id.
-- KEYS: 2
-- KEYS[1] = ts:{R}:owners        zset owner -> heartbeat deadline (ms, server clock)
-- KEYS[2] = ts:{R}:owners:lost   zset owner -> lost ms
-- ARGV[1] = owner tag
-- ARGV[2] = ttl (ms, > 0)
-- returns: {0, deadline_ms (int)}
-- errors: OWNER_LOST (owner, lost_ms)
-- include: clock
local owners, lost = KEYS[1], KEYS[2]
local owner = ARGV[1]
local lost_ms = redis.call('ZSCORE', lost, owner)
if lost_ms then return {1, 'OWNER_LOST', owner, tonumber(lost_ms)} end
local deadline = now_ms() + tonumber(ARGV[2])
redis.call('ZADD', owners, deadline, owner)
return {0, deadline}
