-- Check-then-write of immutable trace nodes (DESIGN section 4), shared by
-- record_turn and insert_node. A node is {id, parent id, fields, payload,
-- text}: "fields" is "end,ntok,flags,version,expert_key". The script gives
-- each new node the next node number of the session (1, 2, ...: HLEN idx
-- minus the two '#' fields, plus one) and stores the index record
-- "num,parent_num,end,ntok,flags,version,expert_key" under the node id in
-- idx, and the payload (and text) under the node number in tok (and txt).
-- All checks run before any write, so a refused call leaves every key
-- byte-identical.
-- Idempotent under client retry without an op key: nodes are content
-- addressed and immutable, so a replayed call finds equal nodes and writes
-- nothing (and does not bump the index version).

-- Returns the plan {fresh = {true: new node, false: equal existing one},
-- nums = node numbers (strings), recs = records to store}, or nil and an
-- error reply.
local function nodes_check(idx, tok, dead, sid, nodes)
  if redis.call('EXISTS', dead) == 1 then
    return nil, {1, 'SESSION_RELEASED', sid, 'its trace data was purged; writes are refused'}
  end
  local count = redis.call('HLEN', idx)
  if count > 0 then count = count - 2 end  -- '#e' and '#v' are written with the first node
  local fresh, nums, recs, here = {}, {}, {}, {}
  for i, n in ipairs(nodes) do
    local pnum = ''
    if n[2] ~= '' then
      pnum = here[n[2]]
      if not pnum then
        local prec = redis.call('HGET', idx, n[2])
        if not prec then
          return nil, {1, 'INVALID_INPUT', 'prefix',
            'parent node ' .. n[2] .. ' of node ' .. n[1] .. ' is not stored in session ' .. sid}
        end
        pnum = string.match(prec, '^(%d+),')
        if not pnum then
          return nil, {1, 'CORRUPT', idx, n[2], 'malformed index record ' .. prec}
        end
      end
    end
    local mine = pnum .. ',' .. n[3]
    local old = redis.call('HGET', idx, n[1])
    if old then
      local num, rest = string.match(old, '^(%d+),(.*)$')
      if rest ~= mine then
        return nil, {1, 'NODE_CONFLICT', sid, n[1], 'stored record ' .. old .. ', new ?,' .. mine}
      end
      if redis.call('HGET', tok, num) ~= n[4] then
        return nil, {1, 'NODE_CONFLICT', sid, n[1], 'token payload differs'}
      end
      fresh[i], nums[i] = false, num
    else
      count = count + 1
      local num = tostring(count)
      -- numbers are never reused; a taken one means the index was edited by hand
      if redis.call('HEXISTS', tok, num) == 1 then
        return nil, {1, 'CORRUPT', tok, num,
          'node number ' .. num .. ' is taken but the index counts ' .. (count - 1) .. ' nodes'}
      end
      fresh[i], nums[i], recs[i] = true, num, num .. ',' .. mine
    end
    here[n[1]] = nums[i]
  end
  return {fresh = fresh, nums = nums, recs = recs}, nil
end

-- Writes the fresh nodes; returns epoch, index version before, after.
local function nodes_write(idx, tok, txt, nodes, plan, store_text)
  local fresh, nums, recs = plan.fresh, plan.nums, plan.recs
  local meta = redis.call('HMGET', idx, '#e', '#v')
  local epoch = meta[1]
  local before = tonumber(meta[2] or '0')
  local n_new = 0
  for i, n in ipairs(nodes) do
    if fresh[i] then
      redis.call('HSET', idx, n[1], recs[i])
      redis.call('HSET', tok, nums[i], n[4])
      if store_text and n[5] ~= '' then
        redis.call('HSET', txt, nums[i], n[5])
      end
      n_new = n_new + 1
    end
  end
  local after = before
  if n_new > 0 then
    if not epoch then
      -- The incarnation of this session's data: a client's cached index and
      -- nodes are valid only for the epoch they were read under.
      local t = redis.call('TIME')
      epoch = t[1] .. '.' .. t[2]
      redis.call('HSET', idx, '#e', epoch)
    end
    after = redis.call('HINCRBY', idx, '#v', 1)
  end
  return epoch or '', before, after
end
