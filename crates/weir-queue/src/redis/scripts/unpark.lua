--
local L = P .. 'parked:' .. ARGV[3]
local ids = redis.call('LRANGE', L, 0, -1)
redis.call('DEL', L)
return ready_those(ids, 'parked')
