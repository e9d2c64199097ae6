-- ARGV[3] the consumer, ARGV[4] how many at most. Answers the call's lease, then three
-- values for each item claimed, flat: entry, the deliveries before this one (with an `s`
-- after it when a step made the item ready), body; nothing at all when nothing was read.
-- The item's id is the body's. Every item of one call has the same lease (new with each
-- call): with the item's own line, that names its claim, so it is answered once. No number
-- is made text per item (Lua's conversion costs more than the rest of an item's work
-- here), and nothing is answered that the client has already: each value is one more the
-- client parses and Lua converts.
local function read()
  return redis.pcall('XREADGROUP', 'GROUP', G, ARGV[3], 'COUNT', ARGV[4], 'STREAMS', STREAM, '>')
end
local r = read()
if type(r) == 'table' and r.err then
  if not string.find(r.err, 'NOGROUP') then return r end
  -- First claim, or the server lost the group: read the stream from its start.
  redis.call('XGROUP', 'CREATE', STREAM, G, '0', 'MKSTREAM')
  r = read()
  if type(r) == 'table' and r.err then return r end
end
local out = {}
if not r then return out end
local entries = r[1][2]
local n = #entries
if n == 0 then return out end
local ids = {}
for i = 1, n do ids[i] = entries[i][2][2] end
-- Each entry's item must be waiting on that very entry (it always is, unless the data
-- was changed behind weir's back): one read for the whole batch.
local cur = {}
for c = 1, n, 1000 do
  local got = redis.call('HMGET', LIVE, unpack(ids, c, math.min(c + 999, n)))
  for j = 1, #got do cur[c + j - 1] = got[j] end
end
-- This call's lease: new, never reused.
local lease = redis.call('INCR', P .. 'lease')
local ls = lease .. ' '
local lines, k, o = {}, 0, 1
out[1] = lease
for i = 1, n do
  local e = entries[i]
  local eid, f = e[1], e[2]
  -- Fields as written: id, d, body[, stepped].
  if f[1] ~= 'id' or f[3] ~= 'd' or f[5] ~= 'body' then
    -- An entry weir did not write (added to the stream by something else): taken out of
    -- the stream like a stale one, and answered as a row with no deliveries, its fields as
    -- text where the body goes, for the engine to report.
    ACKS[#ACKS + 1] = eid
    out[o + 1], out[o + 2], out[o + 3] = eid, '', string.sub(table.concat(f, ' '), 1, 200)
    o = o + 3
  elseif cur[i] ~= eid then
    -- Stale: its item is no longer waiting on this entry.
    ACKS[#ACKS + 1] = eid
  else
    lines[k + 1], lines[k + 2] = ids[i], ls .. eid .. ' ' .. f[4]
    k = k + 2
    local d = f[4]
    if f[8] == '1' then d = d .. 's' end
    out[o + 1], out[o + 2], out[o + 3] = eid, d, f[6]
    o = o + 3
  end
end
if k > 0 then
  redis.call('HSETNX', LIVE, KEEPER_FIELD, keeper())
  each_chunk(lines, function(...) redis.call('HSET', LIVE, ...) end)
end
return out
