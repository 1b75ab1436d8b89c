-- script: transfer
-- Move each given session from `from` to `to` if `from` owns it and it is live
-- (lua/_lib/sessions.lua: session_move). Others are untouched and not returned.
-- Refused when `to` was declared lost by gc (its sessions would leak).
-- Idempotent under client retry: the reply is recorded under the op key.
-- KEYS: 4+
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:o:<from>      set of sids owned by from
-- KEYS[2] = ts:{R}:o:<to>        set of sids owned by to
-- KEYS[3] = ts:{R}:owners:lost   zset owner -> lost ms
-- KEYS[4] = ts:{R}:op:<op_id>    cached reply of this call (one op id per chunk)
-- KEYS[5..4+n] = ts:{R}:s:<sid_i> session hashes
-- ARGV[1] = from owner tag
-- ARGV[2] = to owner tag
-- ARGV[3] = op reply TTL (ms)
-- ARGV[4..3+n] = sid_i (same order as the session keys)
-- returns: {0, sid, ...} the moved sids, in input order
-- errors: OWNER_LOST (to, lost_ms)
-- include: op
-- include: stats
-- include: sessions
local ofrom, oto, lost, opkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local from, to = ARGV[1], ARGV[2]
local cached = op_replay(opkey)
if cached then return cached end
local lost_ms = redis.call('ZSCORE', lost, to)
if lost_ms then return {1, 'OWNER_LOST', to, tonumber(lost_ms)} end
local out = {0}
for i = 5, #KEYS do
  local sid = ARGV[i - 1]
  if session_move(KEYS[i], sid, from, to, ofrom, oto) then
    out[#out + 1] = sid
  end
end
return op_record(opkey, tonumber(ARGV[3]), out)
