--
local st = locate(ARGV[3])
if not st then return 'missing' end
if st ~= 'dead' then return st end
local it = cjson.decode(ARGV[4])
finish(ARGV[3], 'replayed as ' .. it.id)
insert(it)
return 'ok'
