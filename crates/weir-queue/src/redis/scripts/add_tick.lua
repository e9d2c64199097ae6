--
-- Decoded before anything is written: Redis keeps what a script wrote before it failed, and
-- a tick recorded without its item would be a tick lost.
local it = cjson.decode(ARGV[7])
local last = redis.call('HGET', ARGV[3], ARGV[5])
if last and tonumber(last) >= tonumber(ARGV[6]) then return 0 end
redis.call('HSET', ARGV[3], ARGV[5], ARGV[6])
redis.call('HINCRBY', ARGV[4], ARGV[5], 1)
insert(it)
return 1
