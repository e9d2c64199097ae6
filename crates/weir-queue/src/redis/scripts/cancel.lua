--
local st = locate(ARGV[3])
if not st then return 'missing' end
if st == 'waiting' or st == 'delayed' or st == 'parked' then
  finish(ARGV[3], 'cancelled by hand')
  return 'ok'
end
return st
