-- script: insert_node
-- Insert one node (XTuner-style insert) under the parent the client chose from
-- its copy of the index. The parent must be the longest stored key that
-- prefixes the new key, so the call is conditional on the index version the
-- client read: when another writer changed the index since, nothing is
-- written and the client re-reads and retries.
-- KEYS: 4
-- KEYS[1] = ts:{R/sid}:idx   hash (see record_turn)
-- KEYS[2] = ts:{R/sid}:tok   hash
-- KEYS[3] = ts:{R/sid}:txt   hash
-- KEYS[4] = ts:{R/sid}:dead  tombstone
-- ARGV[1] = session id (for error fields)
-- ARGV[2] = store text (1|0)
-- ARGV[3] = expected epoch ('' = no data yet)
-- ARGV[4] = expected index version (int)
-- ARGV[5..9] = id, parent id, fields, payload, text (as record_turn)
-- ARGV[10] = write id of this call (8 hex; the same on a retry)
-- ARGV[11] = expected index chain (after the version in '#v', lua/_lib/nodes.lua; '' = none yet)
-- returns: {0, stale (1: index changed, nothing written), epoch, version_before, version_after, fresh, num,
--           wid, index_wid_after} (num: the node's number, 0 when stale; wid: the write id it is
--           stored with; index_wid_after: the index's chain after the call)
-- errors: SESSION_RELEASED, INVALID_INPUT ('prefix', ...), PREFIX_CHANGED, NODE_CONFLICT, CORRUPT (as record_turn)
-- include: nodes
local epoch, version, iwid = idx_meta(KEYS[1])
if redis.call('EXISTS', KEYS[4]) == 0
    and (epoch ~= ARGV[3] or version ~= tonumber(ARGV[4]) or iwid ~= ARGV[11]) then
  return {0, 1, epoch, version, version, 0, 0, '', iwid}
end
local nodes = {{ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]}}
local plan, err = nodes_check(KEYS[1], KEYS[2], KEYS[4], ARGV[1], nodes, ARGV[10])
if err then return err end
local e, before, after, _, wid_after = nodes_write(KEYS[1], KEYS[2], KEYS[3], nodes, plan, ARGV[2] == '1')
return {0, 0, e, before, after, plan.fresh[1] and 1 or 0, tonumber(plan.nums[1]), plan.wids[1], wid_after}
