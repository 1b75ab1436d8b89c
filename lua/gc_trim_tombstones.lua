-- script: gc_trim_tombstones
-- Forget released sessions whose tombstone is older than the retention: remove
-- them from the released zset and delete their (released) session hash. After
-- this their ids could be opened again, which is why gc keeps tombstones for a
-- long retention (default 7 days). A session that is not released, or was
-- released after the cutoff, is left untouched.
-- Idempotent under client retry: the reply is recorded under the op key.
-- KEYS: 2+
-- CHUNK: 4000
-- KEYS[1] = ts:{R}:released      zset sid -> released ms
-- KEYS[2] = ts:{R}:op:<op_id>    cached reply of this call
-- KEYS[3..2+n] = ts:{R}:s:<sid_i> session hashes
-- ARGV[1] = cutoff (ms, server clock): tombstones released at or before it go
-- ARGV[2] = op reply TTL (ms)
-- ARGV[3..2+n] = sid_i
-- returns: {0, sid, ...} the sids whose tombstone was trimmed
-- errors: none
-- include: op
local released, opkey = KEYS[1], KEYS[2]
local cutoff = tonumber(ARGV[1])
local cached = op_replay(opkey)
if cached then return cached end
local out = {0}
for i = 3, #KEYS do
  local sid = ARGV[i]
  local ms = redis.call('ZSCORE', released, sid)
  local state = redis.call('HGET', KEYS[i], 'state')
  if ms and tonumber(ms) <= cutoff and state ~= 'live' then
    redis.call('ZREM', released, sid)
    redis.call('DEL', KEYS[i])
    out[#out + 1] = sid
  end
end
return op_record(opkey, tonumber(ARGV[2]), out)
