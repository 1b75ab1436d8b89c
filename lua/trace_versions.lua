#!lua flags=no-writes
-- script: trace_versions
-- The oldest weight version of a session's trained tokens (nodes whose labels
-- are not all -100: generated, or explicit labels), for the replay buffer's
-- put (DESIGN section 7: min_version comes from the traces). O(nodes of the
-- session), read only; a session with no such node answers -1.
-- Index records are "num.wid,parent_num,end,ntok,flags,version,expert_key" (lua/_lib/nodes.lua;
-- "num," without a write id in records written before write ids).
-- KEYS: 2
-- KEYS[1] = ts:{R/sid}:idx   hash node id -> record; '#e' epoch, '#v' "index version.chain"
-- KEYS[2] = ts:{R/sid}:dead  tombstone
-- returns: {0, dead (0|1), oldest version of a trained token (int, -1 = none), trained nodes (int)}
-- errors: none
local dead = redis.call('EXISTS', KEYS[2])
local oldest, nodes = -1, 0
local all = redis.call('HVALS', KEYS[1])
for _, rec in ipairs(all) do
  local ntok, flags, version = string.match(rec, '^%d+%.?[0-9a-f]*,%d*,%d+,(%d+),(%d+),(%d+),')
  if ntok and tonumber(ntok) > 0 and tonumber(flags) ~= 0 then
    local v = tonumber(version)
    nodes = nodes + 1
    if oldest < 0 or v < oldest then oldest = v end
  end
end
return {0, dead, oldest, nodes}
