-- Resume a flow in one step: no longer paused, and its parked items ready (in the order they
-- were parked), so that nothing arriving in between runs before them.
redis.call('SREM', P .. 'paused', ARGV[3])
local L = P .. 'parked:' .. ARGV[3]
local ids = redis.call('LRANGE', L, 0, -1)
redis.call('DEL', L)
return ready_those(ids, 'parked')
