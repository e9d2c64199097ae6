--
local L = P .. 'parked:' .. ARGV[3]
for _ = 1, redis.call('LLEN', L) do
  local id = redis.call('LPOP', L)
  if redis.call('HGET', ik(id), 'st') == 'parked' then
    make_ready(id, true)
    return id
  end
end
return false
