-- Several waves' commits in one call (group commit). ARGV[3] is how many are plain
-- acknowledgements (the item ends and nothing else is written: most waves), ARGV[4] how
-- many are not. Then four arguments for each plain one (id, the `live` line its claim
-- wrote, its entry, its finished record as `finished_record` in helpers.lua makes one) and
-- seven for each of the rest (id, lease, flow, how it ends, the reason, the rest of its
-- effects as JSON or nothing when it has none, and for an `ack` its finished record). Each
-- is checked and applied on its own, as if alone; the answer is one word per commit, the
-- plain ones first: done, conflict or failed (a failpoint).
local function commit(id, lease, flow, kind, reason, fx, rec)
  -- The item must still be in flight on this very claim: its `live` line starts with the
  -- lease (each claim's is new), then the entry.
  local v = live_get(id)
  local want = lease .. ' '
  if not v or string.sub(v, 1, #want) ~= want then return 'conflict' end
  local eid = string.match(v, '^%S+ (%S+)')
  if fx then
    for _, s in ipairs(fx.state) do
      if tonumber(redis.call('HGET', s.vk, s.key) or '0') ~= s.read then return 'conflict' end
    end
    for _, g in ipairs(fx.guards) do
      if redis.call('HGET', g.hk, g.key) ~= g.want then return 'conflict' end
    end
  end
  if kind == 'park' and redis.call('SISMEMBER', P .. 'paused', flow) == 0 then
    return 'conflict'
  end
  if fx and fx.fail then return 'failed' end
  -- Everything is checked; nothing below can fail.
  if fx then
    for _, it in ipairs(fx.items) do insert(it) end
    for _, s in ipairs(fx.state) do
      if s.del then redis.call('HDEL', s.hk, s.key) else redis.call('HSET', s.hk, s.key, s.value) end
      redis.call('HINCRBY', s.vk, s.key, 1)
    end
    for _, d in ipairs(fx.dead) do insert_dead(d, d.reason) end
  end
  -- Done markers live until the item ends; one delivered again keeps them.
  if kind ~= 'later' then GONE[#GONE + 1] = P .. 'done:' .. id end
  if kind == 'ack' then
    ACKS[#ACKS + 1] = eid
    live_set(id, false)
    OUTS[id] = rec
    FINISHED[#FINISHED + 1] = id
  elseif kind == 'dead' then
    bury(id, reason)
  elseif kind == 'later' then
    -- The same item, delayed: `reason` is when it is due.
    local k = unstream(id)
    redis.call('HSET', k, 'st', 'delayed', 'due', reason)
    redis.call('ZADD', P .. 'delayed', reason, id)
  else
    local k = unstream(id)
    redis.call('HSET', k, 'st', 'parked')
    redis.call('RPUSH', P .. 'parked:' .. flow, id)
    redis.call('SADD', P .. 'parked_flows', flow)
  end
  return 'done'
end
local out = {}
local np, ng = tonumber(ARGV[3]), tonumber(ARGV[4])
local g0 = 5 + 4 * np
-- Every wave's effects are decoded before anything is written: Redis keeps what a script
-- wrote before it failed, so nothing may fail after the first write.
local effects = {}
for i = 0, ng - 1 do
  local e = ARGV[g0 + 7 * i + 5]
  if e ~= '' then effects[i] = cjson.decode(e) end
end
-- Plain acknowledgements: the item's line must be exactly the one its claim wrote (the
-- lease is new with each claim), and then every write is one command for them all.
local seen = {}
for c = 0, np - 1, 1000 do
  local last = math.min(c + 999, np - 1)
  local ids = {}
  for i = c, last do ids[i - c + 1] = ARGV[5 + 4 * i] end
  local cur = redis.call('HMGET', LIVE, unpack(ids))
  local acks, ended, gone, outs, k = {}, {}, {}, {}, 0
  for i = c, last do
    local a = 5 + 4 * i
    local id = ARGV[a]
    if cur[i - c + 1] == ARGV[a + 1] and not seen[id] then
      seen[id] = true
      k = k + 1
      acks[k], ended[k], gone[k] = ARGV[a + 2], id, P .. 'done:' .. id
      outs[2 * k - 1], outs[2 * k] = id, ARGV[a + 3]
      out[i + 1] = 'done'
    else
      out[i + 1] = 'conflict'
    end
  end
  if k > 0 then
    redis.pcall('XACK', STREAM, G, unpack(acks))
    redis.call('XDEL', STREAM, unpack(acks))
    redis.call('HDEL', LIVE, unpack(ended))
    redis.call('HSET', OUT, unpack(outs))
    redis.call('DEL', unpack(gone))
    for j = 1, k do FINISHED[#FINISHED + 1] = ended[j] end
  end
end
-- The rest, each in full (after the plain ones, whose writes their reads then see).
local ids = {}
for i = 0, ng - 1 do ids[i + 1] = ARGV[g0 + 7 * i] end
live_read(ids)
for i = 0, ng - 1 do
  local a = g0 + 7 * i
  local id = ARGV[a]
  if seen[id] then
    out[np + i + 1] = 'conflict'
  else
    out[np + i + 1] = commit(id, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4],
      effects[i], ARGV[a + 6])
  end
end
return out
