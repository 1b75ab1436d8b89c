-- script: record_turn
-- Write one turn of a session atomically: the delta node (key = prompt, when
-- the turn added prompt tokens) and the response node (key = prompt +
-- response). Nothing is written when any check fails. A turn whose response
-- node is new is counted in the run's turn counter shard of this slot (a
-- replayed or duplicate turn writes nothing and is not counted).
-- Idempotent under retry by content (lua/_lib/nodes.lua); with a caller's op
-- id (KEYS[7]) the first reply is recorded too, so a call again returns it
-- (its fresh flags) even after the session's data was purged. With an answer
-- field (the gateway's retry digest) the turn's answer record is kept beside
-- it, in the same write (tracestore/traces/answers.py; a retry writes the
-- same value again).
-- KEYS: 6+
-- KEYS[1] = ts:{R/sid}:idx   hash node id -> "num.wid,parent_num,end,ntok,flags,version,expert_key";
--   '#e' epoch, '#v' "index version.chain" (lua/_lib/nodes.lua)
-- KEYS[2] = ts:{R/sid}:tok   hash node number -> packed payload (int32 ids, float32 logprobs[, int32 labels])
-- KEYS[3] = ts:{R/sid}:txt   hash node number -> node text (segment text)
-- KEYS[4] = ts:{R/sid}:dead  tombstone (string)
-- KEYS[5] = ts:{R|<tag>}:turns  the run's turn counter shard of this hash slot (string, int)
-- KEYS[6] = ts:{R/sid}:ans  hash retry digest -> kept answer (JSON), written when ARGV[5 + 5n] ~= ''
-- KEYS[7] = ts:{R/sid}:op:<op_id>  (optional) the recorded reply
-- ARGV[1] = session id (for error fields)
-- ARGV[2] = store text (1|0)
-- ARGV[3] = number of nodes n (1 or 2, parents first)
-- ARGV[4 + 5(i-1) .. 8 + 5(i-1)] = node i: id (hex), parent id ('' at the root; "id.wid":
--   must be stored with that write id, lua/_lib/nodes.lua), fields
--   "end,ntok,flags,version,expert_key", payload (bytes), text
-- ARGV[4 + 5n] = write id of this call (8 hex; the same on a retry)
-- ARGV[5 + 5n] = answer field ('' none), ARGV[6 + 5n] = ttl of KEYS[6] (ms), ARGV[7 + 5n] = answer (bytes)
-- ARGV[8 + 5n] = op record ttl (ms), when KEYS[7] is given
-- returns: {0, epoch, version_before, version_after, fresh_1, ..., fresh_n, num_1, ..., num_n,
--           index_wid_before, index_wid_after, wid_1, ..., wid_n}
--   (fresh: 1 = newly written; num: the node's number, its field in tok and txt; index_wid:
--   the index's chain before and after the call; wid_i: the write id node i is stored with)
-- errors: SESSION_RELEASED (sid, detail), INVALID_INPUT ('prefix', msg) when a parent is missing,
--         PREFIX_CHANGED (sid, parent id, stored wid, read wid, stored 1|0) when a parent given
--         as "id.wid" is stored with another write id or no longer stored (lua/_lib/nodes.lua),
--         NODE_CONFLICT (sid, id, detail) when a node exists with another payload,
--         CORRUPT (key, field, detail) when a stored record does not parse
-- include: op
-- include: nodes
local opkey = KEYS[7]
if opkey then
  local done = op_replay(opkey)
  if done then return done end
end
local nodes = {}
for i = 1, tonumber(ARGV[3]) do
  local b = 4 + 5 * (i - 1)
  nodes[i] = {ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4]}
end
local wid = ARGV[4 + 5 * #nodes]
local plan, err = nodes_check(KEYS[1], KEYS[2], KEYS[4], ARGV[1], nodes, wid)
if err then return err end
local epoch, before, after, wid_before, wid_after = nodes_write(
  KEYS[1], KEYS[2], KEYS[3], nodes, plan, ARGV[2] == '1')
if plan.fresh[#nodes] then redis.call('INCR', KEYS[5]) end
local a = 5 + 5 * #nodes
if ARGV[a] ~= '' then
  redis.call('HSET', KEYS[6], ARGV[a], ARGV[a + 2])
  redis.call('PEXPIRE', KEYS[6], tonumber(ARGV[a + 1]))
end
local out = {0, epoch, before, after}
for i = 1, #nodes do out[#out + 1] = plan.fresh[i] and 1 or 0 end
for i = 1, #nodes do out[#out + 1] = tonumber(plan.nums[i]) end
out[#out + 1] = wid_before
out[#out + 1] = wid_after
for i = 1, #nodes do out[#out + 1] = plan.wids[i] end
if opkey then return op_record(opkey, tonumber(ARGV[a + 3]), out) end
return out
