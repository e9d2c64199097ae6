--
local before = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local outcomes, dead = 0, 0
-- Finished records, oldest first.
for _ = 1, limit do
  local id = redis.call('LINDEX', P .. 'finished', 0)
  if not id then break end
  local rec = redis.call('HGET', OUT, id)
  if rec and tonumber(cjson.decode(string.match(rec, '^[^\n]*')).at or '0') >= before then
    break
  end
  redis.call('LPOP', P .. 'finished')
  if rec then
    redis.call('HDEL', OUT, id)
    redis.call('ZREM', P .. 'index', id)
    outcomes = outcomes + 1
  end
end
-- Dead letters whose stream entry is older than the cutoff.
for _, e in ipairs(redis.call('XRANGE', DEAD, '-', '(' .. before .. '-0', 'COUNT', limit)) do
  local id = e[2][2]
  redis.call('XDEL', DEAD, e[1])
  if redis.call('HGET', ik(id), 'st') == 'dead' then
    redis.call('DEL', ik(id))
    redis.call('ZREM', P .. 'index', id)
    dead = dead + 1
  end
end
return {outcomes, dead}
