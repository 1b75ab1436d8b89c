-- Exact per-run counters (DESIGN section 12) in the hash ts:{R}:stats:
-- sessions_opened, sessions_released, release_events, groups_put,
-- groups_taken, groups_expired. Each is changed in the same script as the
-- state it counts, so a counter and its state can never disagree; trimming
-- streams or tombstones never touches the hash. A script collects its
-- increments in a table `st` (stats_add) and writes them once, at its end,
-- after its last check (stats_flush: one HINCRBY per field it changed).
-- The turn counter lives on the data plane (lua/record_turn.lua).

local function stats_add(st, field, n)
  st[field] = (st[field] or 0) + n
end

local function stats_flush(key, st)
  for field, n in pairs(st) do
    if n ~= 0 then redis.call('HINCRBY', key, field, n) end
  end
end
