-- Shared by every weir script. ARGV[1] is the shard's key prefix `{NS:K}:`, ARGV[2] the
-- time (ms) as text. Key names mirror keys.rs.
--
-- Redis runs a script alone but does not roll one back when it fails halfway, so every
-- script checks everything first and writes after, with nothing left that can fail.
--
-- Each script's body runs as `main()`, then `flush()`: work that many items of one call
-- share (acknowledging and deleting stream entries, indexing new ids, recording finished
-- ones) is gathered while the body runs and done in one command each at the end, as the
-- bare pipelined loop the benchmarks compare against does. Nothing between the two reads
-- what `flush` writes.
local P = ARGV[1]
local NOW = ARGV[2]
local NOWN = tonumber(NOW)
local G = 'weir'
local STREAM = P .. 'stream'
local DEAD = P .. 'dead'
local KEEP = __FINISHED_KEPT__
local DEADCAP = __DEAD_CAP__
-- Finished records past KEEP are dropped this many at a time, not one per finish.
local TRIM = 256

-- Gathered for flush(): stream entries to acknowledge and delete, ids new to the index,
-- ids that finished, keys to delete (done markers of ended items).
local ACKS, INDEXED, FINISHED, GONE = {}, {}, {}, {}

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

-- `cmd key ...list` in chunks of at most 1000 arguments (unpack's limits).
local function each_chunk(list, f)
  for i = 1, #list, 1000 do
    f(unpack(list, i, math.min(i + 999, #list)))
  end
end

local function flush()
  -- Acknowledged entries are deleted, never trimmed while unacknowledged. XACK fails before
  -- the first claim made the group; the entries are deleted all the same.
  each_chunk(ACKS, function(...)
    redis.pcall('XACK', STREAM, G, ...)
    redis.call('XDEL', STREAM, ...)
  end)
  local scored = {}
  for _, id in ipairs(INDEXED) do
    scored[#scored + 1] = 0
    scored[#scored + 1] = id
  end
  each_chunk(scored, function(...) redis.call('ZADD', P .. 'index', ...) end)
  each_chunk(GONE, function(...) redis.call('DEL', ...) end)
  -- The newest KEEP finished records stay for the operator; older ones go. Finished is
  -- the one state no script leaves, and an id is listed once, when it finishes: every id
  -- taken off the list is a finished record (or one an operator's prune deleted already),
  -- so the records go in one DEL, unread.
  local n = 0
  each_chunk(FINISHED, function(...) n = redis.call('RPUSH', P .. 'finished', ...) end)
  if n > KEEP + TRIM then
    local old = redis.call('LPOP', P .. 'finished', math.min(n - KEEP, 4 * TRIM))
    local keys = {}
    for i, id in ipairs(old) do keys[i] = ik(id) end
    each_chunk(keys, function(...) redis.call('DEL', ...) end)
    each_chunk(old, function(...) redis.call('ZREM', P .. 'index', ...) end)
  end
  ACKS, INDEXED, FINISHED, GONE = {}, {}, {}, {}
end

-- Take an item's entry out of the ready stream (acknowledged and deleted at flush).
local function unstream(k)
  local e = redis.call('HGET', k, 'entry')
  if e then
    ACKS[#ACKS + 1] = e
    redis.call('HDEL', k, 'entry')
  end
end

-- A new item: ready now (an entry in the stream) or delayed (in the sorted set). An id
-- seen before is the same item added again (a retried add): the first is kept.
local function insert(it)
  local k = ik(it.id)
  if redis.call('HSETNX', k, 'body', it.body) == 0 then return 0 end
  INDEXED[#INDEXED + 1] = it.id
  if it.due ~= '' and tonumber(it.due) > NOWN then
    redis.call('HSET', k, 'flow', it.flow, 'deliveries', it.deliveries, 'lease', 0,
      'enq', it.enq, 'st', 'delayed', 'due', it.due)
    redis.call('ZADD', P .. 'delayed', it.due, it.id)
  else
    redis.call('HSET', k, 'flow', it.flow, 'deliveries', it.deliveries, 'lease', 0,
      'enq', it.enq, 'st', 'waiting', 'entry', xadd(it.id))
  end
  return 1
end

-- End an item for good, taking it out of whatever holds it. `known` is the record's
-- {st, flow, dentry, entry} when the caller has just read them.
local function finish(id, outcome, known)
  local k = ik(id)
  local st, flow, dentry, e
  if known then
    st, flow, dentry, e = known[1], known[2], known[3], known[4]
  else
    st, flow, dentry, e = unpack(redis.call('HMGET', k, 'st', 'flow', 'dentry', 'entry'))
  end
  if st == 'delayed' then
    redis.call('ZREM', P .. 'delayed', id)
    redis.call('HDEL', k, 'due')
  end
  if st == 'parked' then redis.call('LREM', P .. 'parked:' .. flow, 0, id) end
  if st == 'dead' and dentry then redis.call('XDEL', DEAD, dentry) end
  if e then ACKS[#ACKS + 1] = e end
  -- What the record held for its last state (consumer, since, entry…) stays: nothing reads
  -- it once the state is finished, and a call per item fewer is what the commit costs.
  redis.call('HSET', k, 'st', 'finished', 'reason', outcome, 'at', NOW)
  FINISHED[#FINISHED + 1] = id
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
  if redis.call('HSETNX', k, 'body', it.body) == 0 then return end
  INDEXED[#INDEXED + 1] = it.id
  redis.call('HSET', k, 'flow', it.flow, 'deliveries', it.deliveries, 'lease', 0, 'enq', it.enq)
  bury(it.id, reason)
end

local function make_ready(id, stepped)
  local k = ik(id)
  if stepped then
    redis.call('HSET', k, 'st', 'waiting', 'entry', xadd(id), 'stepped', '1')
  else
    redis.call('HSET', k, 'st', 'waiting', 'entry', xadd(id))
  end
  redis.call('HDEL', k, 'due', 'consumer', 'since')
end

-- An in-flight item whose pending entry `eid` is being taken from its consumer: ready
-- again (a new entry) if that entry is still its own; returns 1 if so, else 0.
local function requeue(id, eid)
  local st, entry = unpack(redis.call('HMGET', ik(id), 'st', 'entry'))
  if st == 'in_flight' and entry == eid then
    make_ready(id, false)
    return 1
  end
  return 0
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
