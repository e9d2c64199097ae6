--
local res = redis.pcall('XAUTOCLAIM', STREAM, G, ARGV[3], ARGV[4], ARGV[5], 'COUNT', ARGV[6])
if type(res) == 'table' and res.err then return {0, '0-0'} end
if ARGV[5] == '0-0' then
  -- Once a pass: forget consumers that hold nothing and have not read for as long as an
  -- item may idle (engines that died or stopped; a living one is made again by its next read).
  local cs = redis.pcall('XINFO', 'CONSUMERS', STREAM, G)
  if type(cs) == 'table' and not cs.err then
    for _, c in ipairs(cs) do
      local f = {}
      for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
      if f.pending == 0 and tonumber(f.idle) > tonumber(ARGV[4]) and f.name ~= ARGV[3] then
        redis.call('XGROUP', 'DELCONSUMER', STREAM, G, f.name)
      end
    end
  end
end
local n = 0
for _, e in ipairs(res[2]) do
  local eid, f = e[1], e[2]
  ACKS[#ACKS + 1] = eid
  -- An entry deleted meanwhile comes back without fields (Redis 6.2).
  if f then
    local t = {}
    for i = 1, #f, 2 do t[f[i]] = f[i + 1] end
    if t.id then n = n + requeue(t.id, eid, t) end
  end
end
return {n, res[1]}
