-- script: init_run
-- Create the run's meta hash on first connect; later connects leave it as is.
-- KEYS: 1
-- KEYS[1] = ts:{R}:meta   hash
-- ARGV[1] = schema version (int)
-- ARGV[2] = config (json, informational)
-- returns: {0, schema_version (int), created_ms (int), created (0|1)}
-- errors: INVALID_INPUT ("schema", message) when the run was created by another schema version
local meta = KEYS[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local created = 0
if redis.call('EXISTS', meta) == 0 then
  redis.call('HSET', meta, 'schema', ARGV[1], 'created_ms', now, 'config', ARGV[2])
  created = 1
end
local schema = redis.call('HGET', meta, 'schema')
if schema ~= ARGV[1] then
  return {1, 'INVALID_INPUT', 'schema', 'run was created with trace schema ' .. tostring(schema) ..
    ' by another tracestore version; this one writes schema ' .. ARGV[1] ..
    ': move it with `tracestore checkpoint save` of the version that wrote it and `tracestore checkpoint load` of this one' ..
    ' (docs/checkpoint.md), or remove it with `tracestore run delete <run> --force`'}
end
return {0, tonumber(schema), tonumber(redis.call('HGET', meta, 'created_ms')) or -1, created}
