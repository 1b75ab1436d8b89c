-- script: gate_admit_many
-- Admit one request, or several at once (a server that takes a burst of
-- requests): all of them or, while the gate is sealed, none. Every lease gets the same
-- version and deadline. Idempotent under client retry: the lease ids are
-- generated once per call by the client, and a retry that finds the first
-- lease already recorded returns the recorded admission. A lease id that
-- gate_settle fenced (settled before it was admitted: the recovery of a lost
-- admit) refuses the whole call, nothing admitted. Each lease may name the
-- engine (base URL) and the engine request id serving it, so that the leases
-- of a holder whose heartbeat stopped can be resolved (abort at the engine,
-- then gate_settle in mode 'dead'): the lease of a holder that heart-beats
-- joins its holder's entries in the held index (and says so, `held` 1); the
-- leases of holders that never heart-beat are not indexed (left to their
-- deadlines, and nothing more to pay). A refusal while sealed carries the retry hint of
-- gate_retry_hint (the wait the seal is expected to last).
-- KEYS: 5+
-- CHUNK: 1000
-- KEYS[1] = ts:{R}:gate            hash: state, version, retry_ms, sealed_ms, sealed_by, drain_by_ms, drained_ms, cycle_ms
-- KEYS[2] = ts:{R}:gate:leases     zset: lease id -> deadline ms
-- KEYS[3] = ts:{R}:released        zset: released sids (a released session gets no more requests)
-- KEYS[4] = ts:{R}:gate:held       zset (scores 0): '<holder> <lease id>' of every unsettled lease of a heart-beating holder
-- KEYS[5] = ts:{R}:gate:holders    zset: holder -> heartbeat deadline ms (read: does the holder heart-beat?)
-- KEYS[6..n+5] = ts:{R}:gate:l:<lease>  hash of each lease: sid, holder, version, admitted_ms, ttl_ms, deadline_ms[, engine, request, held]
-- ARGV[1] = ttl (ms, > 0)
-- ARGV[2..5n+1] = lease id, session id, holder, engine ('' none), engine request id ('' none) of each lease, in the order of KEYS[6..]
-- returns: {0, version (int), deadline_ms (int), replayed (0|1)}
-- errors: GATE_SEALED (version, retry_after_ms), SESSION_RELEASED (sid, detail), LEASE_FENCED (lease id): nothing admitted
-- include: clock
-- include: gate
local gate, leases, released, held, holders = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ttl = tonumber(ARGV[1])
local FIRST, PER = 6, 5
if #KEYS >= FIRST then
  local prior = redis.call('HMGET', KEYS[FIRST], 'version', 'deadline_ms', 'fenced')
  if prior[3] then
    return {1, 'LEASE_FENCED', ARGV[2]}
  end
  if prior[1] then
    -- (a settled lease keeps only its receipt: no deadline any more)
    return {0, tonumber(prior[1]), tonumber(prior[2] or '0'), 1}
  end
end
local g = redis.call('HMGET', gate, 'state', 'version')
local version = tonumber(g[2] or '0')
if g[1] == 'sealed' then
  return {1, 'GATE_SEALED', version, gate_retry_hint(gate, now_ms())}
end
for i = FIRST, #KEYS do
  local a = 2 + PER * (i - FIRST)
  if redis.call('ZSCORE', released, ARGV[a + 1]) then
    return {1, 'SESSION_RELEASED', ARGV[a + 1], 'released; it is admitted no more requests'}
  end
  if i > FIRST and redis.call('HEXISTS', KEYS[i], 'fenced') == 1 then
    return {1, 'LEASE_FENCED', ARGV[a]}
  end
end
local now = now_ms()
local deadline = now + ttl
local beats = {}  -- holder -> heart-beats (one ZSCORE per holder of the call)
for i = FIRST, #KEYS do
  local a = 2 + PER * (i - FIRST)
  local id, holder = ARGV[a], ARGV[a + 2]
  redis.call('ZADD', leases, deadline, id)
  redis.call('HSET', KEYS[i], 'sid', ARGV[a + 1], 'holder', holder, 'version', version,
    'admitted_ms', now, 'ttl_ms', ttl, 'deadline_ms', deadline)
  if ARGV[a + 3] ~= '' then redis.call('HSET', KEYS[i], 'engine', ARGV[a + 3]) end
  if ARGV[a + 4] ~= '' then redis.call('HSET', KEYS[i], 'request', ARGV[a + 4]) end
  if beats[holder] == nil then beats[holder] = redis.call('ZSCORE', holders, holder) ~= false end
  if beats[holder] then
    redis.call('HSET', KEYS[i], 'held', 1)
    redis.call('ZADD', held, 0, holder .. ' ' .. id)
  end
end
return {0, version, deadline, 0}
