#!lua flags=no-writes
-- script: read_index
-- Validate a client's cached copy of a session index and fetch node payloads,
-- in one round trip. The whole index (tens of bytes per node) is returned
-- only when it changed since the version the client holds. With a fourth key,
-- one field of that hash of the session's slot comes back in the same reply
-- (the tokens kept of the turn being looked up: tracestore/traces/partial.py).
-- KEYS: 3+
-- KEYS[1] = ts:{R/sid}:idx   hash node id -> record; '#e' epoch, '#v' "version.chain"
-- KEYS[2] = ts:{R/sid}:tok   hash node number -> packed payload
-- KEYS[3] = ts:{R/sid}:dead  tombstone
-- KEYS[4] = (optional) ts:{R/sid}:part  hash whose field ARGV[4] is returned last
-- ARGV[1] = epoch the client holds ('' = none)
-- ARGV[2] = index version the client holds (int; -1 = none, always returns the index)
-- ARGV[3] = index chain the client holds (after the version in '#v', lua/_lib/nodes.lua: the chain
--   of the writes' ids;
--   after a rollback the same version names another index, never with the same chain)
-- ARGV[4] = (with KEYS[4] only) the field of KEYS[4] to return
-- ARGV[4..] (ARGV[5..] with KEYS[4]) = node numbers whose payloads to return (numbers of the index the client holds:
--   a client keeps a payload only when the index it gets back gives its node the same number
--   and write id)
-- returns: {0, dead (0|1), epoch, version, chain, changed (0|1), n, field_1, value_1, ...,
--           (n items), payload_1, ..., payload_m[, field value]} ('' for a missing payload or field)
-- errors: none
local dead = redis.call('EXISTS', KEYS[3])
local meta = redis.call('HMGET', KEYS[1], '#e', '#v')
local v, wid = string.match(meta[2] or '0', '^(%d+)%.?([0-9a-f]*)$')  -- '#v' = "version[.chain]"
local epoch, version = meta[1] or '', tonumber(v) or -1  -- -1: not a number (corrupt)
wid = wid or ''
local out = {0, dead, epoch, version, wid, 0, 0}
if epoch ~= ARGV[1] or version ~= tonumber(ARGV[2]) or wid ~= ARGV[3] then
  local all = redis.call('HGETALL', KEYS[1])
  out[6] = 1
  out[7] = #all
  for i = 1, #all do out[#out + 1] = all[i] end
end
local first = #KEYS > 3 and 5 or 4
if #ARGV >= first then
  local p = redis.call('HMGET', KEYS[2], unpack(ARGV, first))
  for i = 1, #ARGV - first + 1 do out[#out + 1] = p[i] or '' end
end
if #KEYS > 3 then out[#out + 1] = redis.call('HGET', KEYS[4], ARGV[4]) or '' end
return out
