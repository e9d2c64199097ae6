-- Every script but quota.lua is its body wrapped so: the shared helpers first, the body as
-- `main`, then `flush()`, which writes what the helpers gathered, before the answer.
__HELPERS__
local function main()
__BODY__
end
local r = main()
flush()
return r
