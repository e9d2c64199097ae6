-- A removed flow's items that had not run (parked, delayed, waiting), set aside as dead
-- letters with the reason, a page at a time: at most ARGV[4] of each kind, the stream from
-- cursor ARGV[5] on ('' when done), the delayed set from rank ARGV[6] on (-1 when done).
-- Returns how many were set aside, the stream's next cursor, the delayed set's next rank
-- and how many parked items are left.
local flow = ARGV[3]
local count = tonumber(ARGV[4])
local why = 'flow `' .. flow .. '` was removed by a reload; replay once it is back'
local n = 0
local parked = P .. 'parked:' .. flow
for _, id in ipairs(redis.call('LRANGE', parked, 0, count - 1)) do
  redis.call('LREM', parked, 0, id)
  if redis.call('HGET', ik(id), 'st') == 'parked' then
    bury(id, why)
    n = n + 1
  end
end
local rank = tonumber(ARGV[6])
local next_rank = -1
if rank >= 0 then
  local ids = redis.call('ZRANGE', P .. 'delayed', rank, rank + count - 1)
  local kept = 0
  for _, id in ipairs(ids) do
    local st, f = unpack(redis.call('HMGET', ik(id), 'st', 'flow'))
    if st == 'delayed' and f == flow then
      redis.call('ZREM', P .. 'delayed', id)
      bury(id, why)
      n = n + 1
    else
      kept = kept + 1
    end
  end
  if #ids == count then next_rank = rank + kept end
end
local next_cursor = ''
if ARGV[5] ~= '' then
  -- Waiting items: their flow is in the body (read only here, off the hot path).
  local entries = redis.call('XRANGE', STREAM, ARGV[5], '+', 'COUNT', count)
  for _, e in ipairs(entries) do
    local id = e[2][2]
    if live_get(id) == e[1] then
      local ok, it = pcall(cjson.decode, e[2][6] or '')
      if ok and type(it) == 'table' and it.flow == flow then
        bury(id, why)
        n = n + 1
      end
    end
  end
  if #entries == count then next_cursor = '(' .. entries[#entries][1] end
end
return {n, next_cursor, next_rank, redis.call('LLEN', parked)}
