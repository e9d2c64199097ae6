--
local flow = ARGV[3]
local n = 0
local why = 'cleared with its flow'
for _, id in ipairs(redis.call('LRANGE', P .. 'parked:' .. flow, 0, -1)) do
  if redis.call('HGET', ik(id), 'st') == 'parked' then
    finish(id, why)
    n = n + 1
  end
end
for _, id in ipairs(redis.call('ZRANGE', P .. 'delayed', 0, -1)) do
  local st, f = unpack(redis.call('HMGET', ik(id), 'st', 'flow'))
  if st == 'delayed' and f == flow then
    finish(id, why)
    n = n + 1
  end
end
-- Waiting items: their flow is in the body (read only here, off the hot path).
for _, e in ipairs(redis.call('XRANGE', STREAM, '-', '+')) do
  local id = e[2][2]
  if live_get(id) == e[1] then
    local ok, it = pcall(cjson.decode, e[2][6] or '')
    if ok and type(it) == 'table' and it.flow == flow then
      finish(id, why)
      n = n + 1
    end
  end
end
return n
