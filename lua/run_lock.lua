-- script: run_lock
-- Take, renew or take over the run's lock: one holder per run (one trainer).
-- The lock is free when its key is absent (never taken, released, or expired
-- ttl after its holder's last renewal). A free lock, or one held by the
-- caller's token, is (re)taken for ttl from now; one held by the token the
-- caller proved gone (ARGV[7]: its host and boot are the caller's and its pid
-- is dead, checked by the caller) is taken over; any other holder refuses
-- with its identity, so the caller can name it or prove it gone.
-- Naturally idempotent under client retry: the token names the caller, and a
-- retry of a call that took the lock finds it held by that token and renews it
-- (since_ms unchanged), so it takes no op id.
-- KEYS: 1
-- KEYS[1] = ts:{R}:lock   hash holder, host, boot, pid, what, since_ms, renewed_ms, ttl_ms (PEXPIRE ttl)
-- ARGV[1] = holder token (the caller's, unique per process and lock)
-- ARGV[2] = ttl (ms, > 0): the lock expires this long after the last renewal
-- ARGV[3] = host of the caller
-- ARGV[4] = boot id of the caller's machine ('' when unknown)
-- ARGV[5] = pid of the caller (int)
-- ARGV[6] = what holds it (text, e.g. 'tracestore train')
-- ARGV[7] = token of a holder the caller proved gone ('' for none): replaced only while it holds the lock
-- returns: {0, since_ms (int), deadline_ms (int), taken_over (1: ARGV[7]'s holder was replaced | 0)}
-- errors: RUN_LOCKED (holder, host, boot, pid, what, since_ms, renewed_ms, deadline_ms)
-- include: clock
local lock = KEYS[1]
local token, ttl, gone = ARGV[1], tonumber(ARGV[2]), ARGV[7]
local now = now_ms()
local cur = redis.call('HMGET', lock, 'holder', 'host', 'boot', 'pid', 'what', 'since_ms', 'renewed_ms')
local holder = cur[1]
local since = now
local taken_over = 0
if holder == token then
  since = tonumber(cur[6]) or now
elseif holder and not (gone ~= '' and holder == gone) then
  local left = redis.call('PTTL', lock)
  return {1, 'RUN_LOCKED', holder, cur[2] or '', cur[3] or '', cur[4] or '', cur[5] or '',
    tonumber(cur[6]) or -1, tonumber(cur[7]) or -1, left >= 0 and now + left or -1}
elseif holder then
  taken_over = 1
end
if holder ~= token then redis.call('DEL', lock) end
redis.call('HSET', lock, 'holder', token, 'host', ARGV[3], 'boot', ARGV[4], 'pid', ARGV[5],
  'what', ARGV[6], 'since_ms', since, 'renewed_ms', now, 'ttl_ms', ttl)
redis.call('PEXPIRE', lock, ttl)
return {0, since, now + ttl, taken_over}
