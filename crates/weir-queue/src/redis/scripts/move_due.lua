--
local ids = redis.call('ZRANGEBYSCORE', P .. 'delayed', '-inf', ARGV[3], 'LIMIT', 0, ARGV[4])
if #ids > 0 then redis.call('ZREM', P .. 'delayed', unpack(ids)) end
return ready_those(ids, 'delayed')
