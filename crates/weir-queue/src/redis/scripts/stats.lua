--
local pend = pending()
local parked = 0
for _, f in ipairs(redis.call('SMEMBERS', P .. 'parked_flows')) do
  local l = redis.call('LLEN', P .. 'parked:' .. f)
  if l == 0 then redis.call('SREM', P .. 'parked_flows', f) end
  parked = parked + l
end
local first = redis.call('XRANGE', STREAM, '-', '+', 'COUNT', 1)[1]
local enq = ''
if first then enq = entry_fields(first[1]).enq or '' end
return {redis.call('XLEN', STREAM) - pend, pend, redis.call('ZCARD', P .. 'delayed'), parked,
  redis.call('XLEN', DEAD), enq, tonumber(redis.call('GET', P .. 'dead_evicted') or '0')}
