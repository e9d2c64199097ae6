-- ARGV[3] the entry of an item claimed whose body cannot be decoded (so the claim's answer
-- does not give its id), ARGV[4] the reason: the item is dead-lettered. Answers its id, or
-- nothing when no item is in flight on that entry any more.
local f = entry_fields(ARGV[3])
if not f or not f.id then return '' end
local st, at = locate(f.id)
if st ~= 'in_flight' or at.entry ~= ARGV[3] then return '' end
bury(f.id, ARGV[4])
return f.id
