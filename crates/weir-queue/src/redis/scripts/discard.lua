--
local st = locate(ARGV[3])
if not st then return 'missing' end
if st ~= 'dead' then return st end
finish(ARGV[3], 'discarded by hand')
return 'ok'
