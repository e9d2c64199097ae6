--
-- This consumer's own pending entries (an earlier run of it died holding them), oldest
-- first: claimed again here, in place, so they keep their turn ahead of newer entries.
-- Answers as a claim does (the lease, then three values an item, flat).
local p = redis.pcall('XPENDING', STREAM, G, '-', '+', ARGV[4], ARGV[3])
if type(p) == 'table' and p.err then return {} end
local out = {}
for _, e in ipairs(p) do
  local eid = e[1]
  local f = entry_fields(eid)
  local st, at
  if f and f.id then st, at = locate(f.id) end
  if st == 'in_flight' and at.entry == eid then
    -- Reset the entry's idle time, so no other engine's reclaim takes it meanwhile.
    redis.call('XCLAIM', STREAM, G, ARGV[3], 0, eid, 'JUSTID')
    if #out == 0 then out[1] = redis.call('INCR', P .. 'lease') end
    live_set(f.id, out[1] .. ' ' .. eid .. ' ' .. at.d)
    local d = at.d
    if f.stepped == '1' then d = d .. 's' end
    for _, v in ipairs({eid, d, f.body}) do out[#out + 1] = v end
  else
    ACKS[#ACKS + 1] = eid
  end
end
return out
