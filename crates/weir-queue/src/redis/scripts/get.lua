-- One item's record as field/value pairs, wherever its state keeps it (a finished one's
-- as `json` and its record, see `finished_record`); nothing when there is none.
local id = ARGV[3]
local st, at = locate(id)
if not st then return {} end
if st == 'finished' then return {'json', out_get(id)} end
if st ~= 'waiting' and st ~= 'in_flight' then return redis.call('HGETALL', ik(id)) end
local f = entry_fields(at.entry) or {}
local r = {'st', st, 'body', f.body or '', 'flow', f.flow or '', 'enq', f.enq or '0'}
local function put(k, v) r[#r + 1] = k; r[#r + 1] = v end
if st == 'waiting' then
  put('deliveries', f.d or '0')
else
  put('deliveries', at.d)
  put('lease', at.lease)
  -- Who holds it and since when: the group's pending entry (its idle time restarts only
  -- when the entry is claimed again, as a claim would), on the server's clock, which
  -- measured the idle time.
  local p = redis.pcall('XPENDING', STREAM, G, at.entry, at.entry, 1)
  if type(p) == 'table' and not p.err and p[1] then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    put('consumer', p[1][2])
    put('since', string.format('%.0f', now - p[1][3]))
  end
end
return r
