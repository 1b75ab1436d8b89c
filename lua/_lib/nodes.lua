-- Check-then-write of immutable trace nodes (DESIGN section 4), shared by
-- record_turn and insert_node. A node is {digest, record, payload, text};
-- its parent digest is the first comma field of its record
-- ("parent,end,ntok,flags,version,expert_key"). All checks run before any
-- write, so a refused call leaves every key byte-identical.
-- Idempotent under client retry without an op key: nodes are content
-- addressed and immutable, so a replayed call finds equal nodes and writes
-- nothing (and does not bump the index version).

-- Returns fresh (table: true = new node, false = equal existing one), or nil
-- and an error reply.
local function nodes_check(idx, tok, dead, sid, nodes)
  if redis.call('EXISTS', dead) == 1 then
    return nil, {1, 'SESSION_RELEASED', sid, 'its trace data was purged; writes are refused'}
  end
  local fresh, here = {}, {}
  for i, n in ipairs(nodes) do
    local parent = string.match(n[2], '^([^,]*),')
    if parent == nil then
      return nil, {1, 'INVALID_INPUT', 'record', 'malformed node record ' .. n[2]}
    end
    if parent ~= '' and not here[parent] and redis.call('HEXISTS', idx, parent) == 0 then
      return nil, {1, 'INVALID_INPUT', 'prefix',
        'parent node ' .. parent .. ' of node ' .. n[1] .. ' is not stored in session ' .. sid}
    end
    local old = redis.call('HGET', idx, n[1])
    if old then
      if old ~= n[2] then
        return nil, {1, 'NODE_CONFLICT', sid, n[1], 'stored record ' .. old .. ', new ' .. n[2]}
      end
      if redis.call('HGET', tok, n[1]) ~= n[3] then
        return nil, {1, 'NODE_CONFLICT', sid, n[1], 'token payload differs'}
      end
      fresh[i] = false
    else
      fresh[i] = true
    end
    here[n[1]] = true
  end
  return fresh, nil
end

-- Writes the fresh nodes; returns epoch, index version before, after.
local function nodes_write(idx, tok, txt, nodes, fresh, store_text)
  local meta = redis.call('HMGET', idx, '#e', '#v')
  local epoch = meta[1]
  local before = tonumber(meta[2] or '0')
  local n_new = 0
  for i, n in ipairs(nodes) do
    if fresh[i] then
      redis.call('HSET', idx, n[1], n[2])
      redis.call('HSET', tok, n[1], n[3])
      if store_text and n[4] ~= '' then
        redis.call('HSET', txt, n[1], n[4])
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
