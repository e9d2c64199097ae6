-- ARGV[3] the bound on ready items, ARGV[4] how many of the items are ready now; then three
-- arguments for each of those (id, deliveries, body) and six for each of the rest (id,
-- flow, deliveries, enqueued at, due, body): flat, so the bodies travel as they are, not
-- escaped into JSON. No id is there twice (the caller keeps the first).
local max = tonumber(ARGV[3])
local r = tonumber(ARGV[4])
if (#ARGV - 4 - 3 * r) % 6 ~= 0 then return redis.error_reply('weir add: three arguments a ready item, six a delayed one') end
local later = (#ARGV - 4 - 3 * r) / 6
local ready = ready_count()
if ready + r + later > max then return {'full', ready} end
-- Ready now (most are): straight into the stream, with no per-item table of the helpers',
-- as the bare loop would. Ids with a record already (a retried add) are kept once.
for c = 1, r, 1000 do
  local last = math.min(c + 999, r)
  local ids = {}
  for i = c, last do ids[i - c + 1] = ARGV[2 + 3 * i] end
  local seen = redis.call('ZMSCORE', P .. 'index', unpack(ids))
  local lines, scored, k = {}, {}, 0
  for i = c, last do
    if not seen[i - c + 1] then
      local a = 2 + 3 * i
      local id = ARGV[a]
      local eid = redis.call('XADD', STREAM, '*', 'id', id, 'd', ARGV[a + 1], 'body', ARGV[a + 2])
      lines[k + 1], lines[k + 2] = id, eid
      -- The score as text: a Lua number given to a command is made text there, per item.
      scored[k + 1], scored[k + 2] = '0', id
      k = k + 2
    end
  end
  if k > 0 then
    redis.call('HSETNX', LIVE, KEEPER_FIELD, keeper())
    redis.call('HSET', LIVE, unpack(lines))
    redis.call('ZADD', P .. 'index', unpack(scored))
  end
end
for i = 0, later - 1 do
  local a = 5 + 3 * r + 6 * i
  insert({id = ARGV[a], flow = ARGV[a + 1], deliveries = ARGV[a + 2], enq = ARGV[a + 3],
    due = ARGV[a + 4], body = ARGV[a + 5]})
end
return {'ok', 0}
