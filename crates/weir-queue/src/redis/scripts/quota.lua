-- GCRA over KEYS[1] (the theoretical arrival time in µs, by the server's clock, so that
-- engines' clocks need not agree): ARGV one pass every N µs, the burst, how many are wanted.
-- Answers {granted, µs until the next pass}. Standalone (not wrapped with the helpers).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local every = tonumber(ARGV[1])
local tau = every * (tonumber(ARGV[2]) - 1)
local want = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local granted = 0
if tat - tau <= now then
  granted = math.min(want, math.floor((now + tau - tat) / every) + 1)
end
if granted > 0 then
  tat = tat + granted * every
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
end
local next_in = 0
if granted < want then next_in = math.max(tat - tau - now, 0) end
return {granted, string.format('%.0f', next_in)}
