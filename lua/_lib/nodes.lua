-- Check-then-write of immutable trace nodes (DESIGN section 4), shared by
-- record_turn and insert_node. A node is {id, parent id, fields, payload,
-- text}: "fields" is "end,ntok,flags,version,expert_key". The script gives
-- each new node the next node number of the session (1, 2, ...: HLEN idx
-- minus the '#' fields, plus one) and stores the index record
-- "num.wid,parent_num,end,ntok,flags,version,expert_key" under the node id in
-- idx, and the payload (and text) under the node number in tok (and txt).
-- All checks run before any write, so a refused call leaves every key
-- byte-identical.
-- Idempotent under client retry without an op key: nodes are content
-- addressed and immutable, so a replayed call finds equal nodes and writes
-- nothing (and does not bump the index version).
--
-- Write ids. Every call that writes carries a random write id (wid, 8
-- lowercase hex characters, the same on a retry); each node it creates
-- records it after its number. The index keeps, after its version in '#v'
-- ("version.chain"), the chain of the calls that wrote it: sha1(previous
-- chain .. ':' .. wid), 16 hex characters ('' before the first write; a '#v'
-- written before write ids is the version alone).
-- A store that rolls back (a failover to a lagging replica, a restored
-- checkpoint) hands out the same index versions and node numbers again, for
-- other nodes; the chain tells the two histories apart, even when a call
-- whose reply was lost is sent again after the rollback (same wid, other
-- writes before it): a client's cached index is current only when epoch,
-- version and chain all match, a cached payload only for the wid of its node
-- (one call's nodes have the same content whenever it runs). Records written
-- before write ids ("num,...") have wid ''.
-- A parent given as "id.wid" ("id." for a parent read without a write id)
-- must be stored with that wid: the caller read the prefix's tokens under
-- it (PREFIX_CHANGED when it is stored with another one, or no longer
-- stored). A bare "id" (a parent written by the same call) is not checked.

-- The index's epoch ('' before the first write), version (-1 when '#v' does
-- not parse) and chain, from HMGET idx '#e' '#v'.
local function idx_meta(idx)
  local meta = redis.call('HMGET', idx, '#e', '#v')
  local v, w = string.match(meta[2] or '0', '^(%d+)%.?([0-9a-f]*)$')
  return meta[1] or '', tonumber(v) or -1, w or ''
end

-- The number and wid of a record "num[.wid],...": (num, wid) or nil.
local function rec_num(rec)
  local num, wid = string.match(rec, '^(%d+)%.?([0-9a-f]*),')
  return num, wid
end

-- Returns the plan {fresh = {true: new node, false: equal existing one},
-- nums = node numbers (strings), wids = the nodes' write ids (this call's for
-- a new node, the stored one's for an existing one), recs = records to store,
-- wid = this call's write id}, or nil and an error reply. wid: this call's write id.
local function nodes_check(idx, tok, dead, sid, nodes, wid)
  if not string.match(wid or '', '^[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]$') then
    return nil, {1, 'INVALID_INPUT', 'wid', 'a write id is 8 lowercase hex characters'}
  end
  if redis.call('EXISTS', dead) == 1 then
    return nil, {1, 'SESSION_RELEASED', sid, 'its trace data was purged; writes are refused'}
  end
  local epoch, version, chain = idx_meta(idx)
  if version < 0 then
    return nil, {1, 'CORRUPT', idx, '#v', 'the index version is not "version[.chain]"'}
  end
  local count = redis.call('HLEN', idx)
  if count > 0 then count = count - 2 end  -- '#e' and '#v' are written with the first node
  local fresh, nums, wids, recs, here = {}, {}, {}, {}, {}
  for i, n in ipairs(nodes) do
    local pnum = ''
    if n[2] ~= '' then
      local pid, dot, pwid = string.match(n[2], '^([^.]+)(%.?)([0-9a-f]*)$')
      if not pid then
        return nil, {1, 'INVALID_INPUT', 'prefix',
          'parent ' .. n[2] .. ' of node ' .. n[1] .. ' is not "id" or "id.wid" (8 lowercase hex)'}
      end
      pnum = here[pid]
      if not pnum then
        local prec = redis.call('HGET', idx, pid)
        if not prec and dot == '.' then  -- read by the caller, gone since: as stored again
          return nil, {1, 'PREFIX_CHANGED', sid, pid, '', pwid, 0}
        end
        if not prec then
          return nil, {1, 'INVALID_INPUT', 'prefix',
            'parent node ' .. pid .. ' of node ' .. n[1] .. ' is not stored in session ' .. sid}
        end
        local swid
        pnum, swid = rec_num(prec)
        if not pnum then
          return nil, {1, 'CORRUPT', idx, pid, 'malformed index record ' .. prec}
        end
        if dot == '.' and swid ~= pwid then
          return nil, {1, 'PREFIX_CHANGED', sid, pid, swid, pwid, 1}
        end
      end
    end
    local mine = pnum .. ',' .. n[3]
    local old = redis.call('HGET', idx, n[1])
    if old then
      local num, owid, rest = string.match(old, '^(%d+)%.?([0-9a-f]*),(.*)$')
      if rest ~= mine then
        return nil, {1, 'NODE_CONFLICT', sid, n[1], 'stored record ' .. old .. ', new ?,' .. mine}
      end
      if redis.call('HGET', tok, num) ~= n[4] then
        return nil, {1, 'NODE_CONFLICT', sid, n[1], 'token payload differs'}
      end
      fresh[i], nums[i], wids[i] = false, num, owid
    else
      count = count + 1
      local num = tostring(count)
      -- numbers are never reused; a taken one means the index was edited by hand
      if redis.call('HEXISTS', tok, num) == 1 then
        return nil, {1, 'CORRUPT', tok, num,
          'node number ' .. num .. ' is taken but the index counts ' .. (count - 1) .. ' nodes'}
      end
      fresh[i], nums[i], wids[i], recs[i] = true, num, wid, num .. '.' .. wid .. ',' .. mine
    end
    here[n[1]] = nums[i]
  end
  return {fresh = fresh, nums = nums, wids = wids, recs = recs, wid = wid,
          epoch = epoch, version = version, chain = chain}, nil
end

-- Writes the fresh nodes; returns epoch, index version before, after, and the
-- index's chain before and after (read by nodes_check, in the same script).
local function nodes_write(idx, tok, txt, nodes, plan, store_text)
  local fresh, nums, recs = plan.fresh, plan.nums, plan.recs
  local epoch, before, wid_before = plan.epoch, plan.version, plan.chain
  local wid_after = wid_before
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
    if epoch == '' then
      -- The incarnation of this session's data: a client's cached index and
      -- nodes are valid only for the epoch they were read under.
      local t = redis.call('TIME')
      epoch = t[1] .. '.' .. t[2]
      redis.call('HSET', idx, '#e', epoch)
    end
    after = before + 1
    wid_after = string.sub(redis.sha1hex(wid_before .. ':' .. plan.wid), 1, 16)
    redis.call('HSET', idx, '#v', after .. '.' .. wid_after)
  end
  return epoch, before, after, wid_before, wid_after
end
