--
local first = redis.call('GET', ARGV[3])
if first then return {'old', first} end
local ready = ready_count()
if ready + 1 > tonumber(ARGV[5]) then return {'full', tostring(ready)} end
local it = cjson.decode(ARGV[6])
redis.call('SET', ARGV[3], it.id, 'EX', ARGV[4])
insert(it)
return {'new', it.id}
