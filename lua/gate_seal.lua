-- script: gate_seal
-- Seal the gate (no new admission until reopen) or reopen it, and return
-- the status right after. Sealing a sealed gate keeps its first sealed_ms.
-- A sealer may name itself with a token (weight_update does): a reopen that
-- carries a token only reopens a seal held under that token. An anonymous
-- seal (an operator's) is never taken over: it turns a token seal anonymous,
-- so the weight update in progress leaves the gate sealed. A token seal takes
-- over another token's seal (that updater crashed, or runs concurrently, which
-- is unsupported), so a crashed updater's seal does not outlive the next
-- weight update. A weight update's seal names the version it will install:
-- when that version is not larger than the current one the seal is refused
-- (STALE_VERSION) and nothing is written, so an update that can never install
-- neither blocks admissions nor leaves a key behind; so is a seal of a gate
-- with poisoned (or overdue) leases (GATE_POISONED): the install would be
-- refused, so the seal would only refuse admissions for nothing.
-- A weight update's seal also records when its drain gives up (drain_by_ms,
-- from ARGV[8]) and its reopen how long the cycle held the seal (cycle_ms):
-- the retry hint of refused admissions is computed from them
-- (gate_retry_hint in lua/_lib/gate.lua).
-- Idempotent under client retry: the reply is recorded under the op key (a
-- retried reopen does not reopen a seal made since).
-- A seal that closes an open gate and a reopen that opens a sealed one each
-- append one entry to the gate's log (capped at ARGV[7] entries), which is
-- the history of weight-update cycles (docs/gate.md, The gate's log); a seal
-- of a sealed gate and a reopen of an open one change nothing and log nothing.
-- KEYS: 5
-- KEYS[1] = ts:{R}:gate            hash: state, version, sealed_ms, retry_ms, sealed_by, drained_ms, drain_by_ms, cycle_ms
-- KEYS[2] = ts:{R}:gate:leases     zset: lease id -> deadline ms (read)
-- KEYS[3] = ts:{R}:gate:poison     hash: lease id -> reason json (read)
-- KEYS[4] = ts:{R}:op:<op_id>      string: the recorded reply
-- KEYS[5] = ts:{R}:gate:log        stream: ev=seal (version, live, ms) | ev=reopen (version, sealed_ms, drained_ms, ms)
-- ARGV[1] = "seal" | "reopen"
-- ARGV[2] = retry hint given to refused admissions while sealed (ms)
-- ARGV[3] = max ids to return per list of the status
-- ARGV[4] = sealer token ("" for none: an unconditional reopen)
-- ARGV[5] = op record ttl (ms)
-- ARGV[6] = seal only: the version the sealer will install ("" for none); refused unless larger
-- ARGV[7] = most entries the gate's log keeps (XADD MAXLEN)
-- ARGV[8] = seal with a token only: the drain timeout (ms) of the weight update ('' for none)
-- returns: the reply of gate_status, then the token of the current seal ("" when open or anonymous)
-- errors: STALE_VERSION (current, requested), GATE_POISONED (lease ids, first 20): nothing written
-- include: clock
-- include: op
-- include: gate
local gate, opkey, log = KEYS[1], KEYS[4], KEYS[5]
local done = op_replay(opkey)
if done then return done end
local g = redis.call('HMGET', gate, 'state', 'sealed_by', 'version')
local state, by = g[1], g[2] or ''
local token = ARGV[4] or ''
if ARGV[1] == 'seal' and ARGV[6] ~= '' then
  local cur = tonumber(g[3] or '0')
  if tonumber(ARGV[6]) <= cur then return {1, 'STALE_VERSION', cur, tonumber(ARGV[6])} end
  -- a weight update cannot install over poison (nor over overdue leases, poison at the next sweep):
  -- refuse before sealing, so that no admission is refused and no request stopped for nothing
  local bad = redis.call('HKEYS', KEYS[3])
  local overdue = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now_ms(), 'LIMIT', 0, 20)
  for _, id in ipairs(overdue) do bad[#bad + 1] = id end
  if #bad > 0 then
    local out = {1, 'GATE_POISONED'}
    for i = 1, math.min(#bad, 20) do out[#out + 1] = bad[i] end
    return out
  end
end
if ARGV[1] == 'seal' then
  if state ~= 'sealed' then
    local now = now_ms()
    redis.call('HSET', gate, 'state', 'sealed', 'sealed_ms', now, 'retry_ms', ARGV[2], 'sealed_by', token)
    redis.call('HDEL', gate, 'drained_ms', 'drain_by_ms')
    if token ~= '' and (ARGV[8] or '') ~= '' then
      redis.call('HSET', gate, 'drain_by_ms', now + tonumber(ARGV[8]))
    end
    redis.call('XADD', log, 'MAXLEN', ARGV[7], '*', 'ev', 'seal', 'version', g[3] or '0',
      'live', redis.call('ZCOUNT', KEYS[2], now, '+inf'), 'ms', now)
  elseif by ~= '' and by ~= token then
    redis.call('HSET', gate, 'sealed_by', token)
    if token ~= '' and (ARGV[8] or '') ~= '' then
      redis.call('HSET', gate, 'drain_by_ms', now_ms() + tonumber(ARGV[8]))
    end
  end
elseif state ~= 'open' and (token == '' or token == by) then
  local c = redis.call('HMGET', gate, 'sealed_ms', 'drained_ms')
  redis.call('HSET', gate, 'state', 'open')
  if by ~= '' and c[1] then  -- a weight update's cycle: how long it held the seal (the next hint)
    redis.call('HSET', gate, 'cycle_ms', math.max(0, now_ms() - tonumber(c[1])))
  end
  redis.call('HDEL', gate, 'sealed_ms', 'sealed_by', 'drained_ms', 'drain_by_ms')
  if state == 'sealed' then  -- (absent = open: nothing reopened, nothing logged)
    redis.call('XADD', log, 'MAXLEN', ARGV[7], '*', 'ev', 'reopen', 'version', g[3] or '0',
      'sealed_ms', c[1] or '', 'drained_ms', c[2] or '', 'ms', now_ms())
  end
end
local out = gate_status_reply(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[3]))
out[#out + 1] = redis.call('HGET', gate, 'sealed_by') or ''
return op_record(opkey, tonumber(ARGV[5]), out)
