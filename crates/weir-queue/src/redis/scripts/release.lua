-- A clean shutdown: ARGV[3] the consumer, ARGV[4] how many entries to look at. Its pending
-- entries are made ready again (each a new entry; the old one acknowledged and deleted);
-- when it holds nothing more, the consumer is deleted. Answers {released, still pending}.
local p = redis.pcall('XPENDING', STREAM, G, '-', '+', ARGV[4], ARGV[3])
if type(p) == 'table' and p.err then return {0, 0} end
local n = 0
for _, e in ipairs(p) do
  local eid = e[1]
  ACKS[#ACKS + 1] = eid
  local f = entry_fields(eid)
  if f and f.id then n = n + requeue(f.id, eid, f) end
end
local left = 0
if #p < tonumber(ARGV[4]) then
  flush()
  redis.call('XGROUP', 'DELCONSUMER', STREAM, G, ARGV[3])
else
  left = #p
end
return {n, left}
