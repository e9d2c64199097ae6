-- Shared by every weir script. ARGV[1] is the shard's key prefix `{NS:K}:`, ARGV[2] the
-- time (ms) as text. Key names mirror keys.rs.
--
-- Redis runs a script alone but does not roll one back when it fails halfway, so every
-- script checks everything first and writes after, with nothing left that can fail.
local P = ARGV[1]
local NOW = ARGV[2]
local NOWN = tonumber(NOW)
local G = 'weir'
local STREAM = P .. 'stream'
local DEAD = P .. 'dead'
local KEEP = __FINISHED_KEPT__
local DEADCAP = __DEAD_CAP__

local function ik(id) return P .. 'item:' .. id end

local function xadd(id)
  return redis.call('XADD', STREAM, '*', 'id', id)
end

-- Items claimed and not yet acknowledged (0 before the first claim made the group).
local function pending()
  local p = redis.pcall('XPENDING', STREAM, G)
  if type(p) == 'table' and p.err then return 0 end
  return p[1]
end

local function ready_count()
  return redis.call('XLEN', STREAM) - pending()
end

-- Ack and delete an item's entry in the ready stream: acknowledged entries are deleted,
-- never trimmed while unacknowledged.
local function unstream(k)
  local e = redis.call('HGET', k, 'entry')
  if e then
    redis.pcall('XACK', STREAM, G, e)
    redis.call('XDEL', STREAM, e)
    redis.call('HDEL', k, 'entry')
  end
end

-- A new item: ready now (an entry in the stream) or delayed (in the sorted set). An id
-- seen before is the same item added again (a retried add): the first is kept.
local function insert(it)
  local k = ik(it.id)
  if redis.call('EXISTS', k) == 1 then return 0 end
  redis.call('ZADD', P .. 'index', 0, it.id)
  redis.call('HSET', k, 'body', it.body, 'flow', it.flow, 'deliveries', it.deliveries,
    'lease', 0, 'enq', it.enq)
  if it.due ~= '' and tonumber(it.due) > NOWN then
    redis.call('HSET', k, 'st', 'delayed', 'due', it.due)
    redis.call('ZADD', P .. 'delayed', it.due, it.id)
  else
    redis.call('HSET', k, 'st', 'waiting', 'entry', xadd(it.id))
  end
  return 1
end

-- End an item for good, taking it out of whatever holds it. The newest KEEP finished
-- records stay for the operator; older ones go.
local function finish(id, outcome)
  local k = ik(id)
  local st, flow, dentry, e = unpack(redis.call('HMGET', k, 'st', 'flow', 'dentry', 'entry'))
  if st == 'delayed' then redis.call('ZREM', P .. 'delayed', id) end
  if st == 'parked' then redis.call('LREM', P .. 'parked:' .. flow, 0, id) end
  if st == 'dead' and dentry then redis.call('XDEL', DEAD, dentry) end
  if e then
    redis.pcall('XACK', STREAM, G, e)
    redis.call('XDEL', STREAM, e)
  end
  redis.call('HSET', k, 'st', 'finished', 'reason', outcome, 'at', NOW)
  redis.call('HDEL', k, 'due', 'consumer', 'since', 'stepped', 'dentry', 'entry')
  if redis.call('RPUSH', P .. 'finished', id) > KEEP then
    local old = redis.call('LPOP', P .. 'finished')
    if redis.call('HGET', ik(old), 'st') == 'finished' then
      redis.call('DEL', ik(old))
      redis.call('ZREM', P .. 'index', old)
    end
  end
end

-- Set an item aside with its reason. Past the cap the oldest dead letter is evicted: counted,
-- and its record says so; never silent.
local function bury(id, reason)
  local k = ik(id)
  unstream(k)
  local d = redis.call('XADD', DEAD, '*', 'id', id, 'reason', reason)
  redis.call('HSET', k, 'st', 'dead', 'reason', reason, 'at', NOW, 'dentry', d)
  redis.call('HDEL', k, 'consumer', 'since', 'stepped', 'due')
  if redis.call('XLEN', DEAD) > DEADCAP then
    local oldest = redis.call('XRANGE', DEAD, '-', '+', 'COUNT', 1)[1]
    local oid = oldest[2][2]
    redis.call('INCR', P .. 'dead_evicted')
    redis.log(redis.LOG_WARNING, 'weir: dead letter ' .. oid .. ' evicted past the cap of ' .. DEADCAP)
    finish(oid, 'evicted from the dead letters: more than ' .. DEADCAP .. ' were kept')
  end
end

local function insert_dead(it, reason)
  local k = ik(it.id)
  if redis.call('EXISTS', k) == 1 then return end
  redis.call('ZADD', P .. 'index', 0, it.id)
  redis.call('HSET', k, 'body', it.body, 'flow', it.flow, 'deliveries', it.deliveries,
    'lease', 0, 'enq', it.enq)
  bury(it.id, reason)
end

local function make_ready(id, stepped)
  local k = ik(id)
  redis.call('HSET', k, 'st', 'waiting', 'entry', xadd(id))
  redis.call('HDEL', k, 'due', 'consumer', 'since')
  if stepped then redis.call('HSET', k, 'stepped', '1') end
end

-- Make ready those of `ids` still in state `st`; returns how many.
local function ready_those(ids, st)
  local n = 0
  for _, id in ipairs(ids) do
    if redis.call('HGET', ik(id), 'st') == st then
      make_ready(id, false)
      n = n + 1
    end
  end
  return n
end
