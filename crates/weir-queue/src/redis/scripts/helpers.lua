-- Shared by every weir script. ARGV[1] is the shard's key prefix `{NS:K}:`, ARGV[2] the
-- time (ms) as text. Key names mirror keys.rs.
--
-- Redis runs a script alone but does not roll one back when it fails halfway, so every
-- script checks everything first and writes after, with nothing left that can fail.
--
-- Where an item's record is, by state:
-- - waiting or in flight: its stream entry (fields id, d, body, and stepped when a step
--   made it ready; `d` is the deliveries it had when the entry was made; the flow and when
--   it was enqueued are read from the body where they are needed, which is off the hot
--   path), and its line in the `live` hash: `ENTRY` while it waits, `LEASE ENTRY BEFORE`
--   once claimed, BEFORE being the deliveries before this one (who holds it and since when
--   are the group's pending entry's).
--   A claim and an acknowledgement touch no key of the item's own.
-- - delayed, parked or dead: a hash `item:ID` (body, flow, deliveries, enq, st, …).
-- - finished: one field of the `out` hash (see `finished_record`), the newest FINISHED_KEPT
--   of them.
--
-- Each script's body runs as `main()`, then `flush()`: work that many items of one call
-- share (acknowledging and deleting stream entries, writing `live` and `out`, indexing new
-- ids, recording finished ones) is gathered while the body runs and done in one command
-- each at the end, as the bare pipelined loop the benchmarks compare against does. What the
-- body reads of `live` and `out` goes through the gathered writes first (`live_get`,
-- `out_get`), so it sees its own.
local P = ARGV[1]
local NOW = ARGV[2]
local NOWN = tonumber(NOW)
local G = 'weir'
local STREAM = P .. 'ready'
local DEAD = P .. 'dead'
local LIVE = P .. 'live'
local OUT = P .. 'out'
local KEEP = __FINISHED_KEPT__
local DEADCAP = __DEAD_CAP__
-- Finished records past KEEP are dropped this many at a time, not one per finish.
local TRIM = 256
-- A field of `live` that no item id can be (ids are ULIDs), whose value is longer than any
-- `hash-max-listpack-value` a server is likely to set, so that Redis keeps `live` a hash
-- table: a small hash is a listpack otherwise (up to `hash-max-listpack-entries` fields:
-- 128 by default, 512 in Debian's redis.conf), which every HMGET, HSET and HDEL scans from
-- its start, and `live` is small whenever the queue is nearly empty. With it `live` is
-- never empty either, so Redis does not delete it and start it over as a listpack.
local KEEPER_FIELD = '~hashtable'
local function keeper()
  return 'weir keeps this field so that Redis keeps this hash a hash table (see scripts.lua)'
    .. string.rep('.', 940)
end

-- Gathered for flush(): stream entries to acknowledge and delete, ids new to the index,
-- ids that finished, keys to delete (done markers of ended items), `live` lines to write
-- (false: to delete) and `out` records to write.
local ACKS, INDEXED, FINISHED, GONE, LIVES, OUTS = {}, {}, {}, {}, {}, {}
-- Ids this call indexed (for `known`, before the index has them).
local NEW = {}

local function ik(id) return P .. 'item:' .. id end

-- `cmd key ...list` in chunks of at most 1000 arguments (unpack's limits).
local function each_chunk(list, f)
  for i = 1, #list, 1000 do
    f(unpack(list, i, math.min(i + 999, #list)))
  end
end

-- `cmd key ...ids` in chunks of at most 1000 ids, calling `f(id, answer)` for each id with
-- its element of the answer (a read of many fields or members at once).
local function each_answer(cmd, key, ids, f)
  for i = 1, #ids, 1000 do
    local last = math.min(i + 999, #ids)
    local got = redis.call(cmd, key, unpack(ids, i, last))
    for j = i, last do f(ids[j], got[j - i + 1]) end
  end
end

-- `live` lines read ahead for a batch (`live_read`); the writes gathered in LIVES come first.
local READ = {}

local function live_get(id)
  local v = LIVES[id]
  if v ~= nil then return v end
  v = READ[id]
  if v ~= nil then return v end
  return redis.call('HGET', LIVE, id)
end

-- Read the `live` lines of `ids` ahead, in one command per thousand.
local function live_read(ids)
  each_answer('HMGET', LIVE, ids, function(id, v) READ[id] = v end)
end

local function live_set(id, v) LIVES[id] = v end

local function out_get(id)
  local v = OUTS[id]
  if v == nil then return redis.call('HGET', OUT, id) end
  return v
end

-- A `live` line as its parts: the lease ('-' while waiting), the entry, and once claimed
-- the deliveries counted (this one included).
local function parse_live(v)
  local lease, entry, before = string.match(v, '^(%S+) (%S+) (%S+)$')
  if not lease then return '-', v end
  return lease, entry, tostring(tonumber(before) + 1)
end

-- A stream entry's fields as a table, with its item's flow and when it was enqueued read
-- from the body (nil when the entry is gone).
local function entry_fields(eid)
  local r = redis.call('XRANGE', STREAM, eid, eid)[1]
  if not r then return nil end
  local f = {}
  for i = 1, #r[2], 2 do f[r[2][i]] = r[2][i + 1] end
  local ok, it = pcall(cjson.decode, f.body or '')
  if ok and type(it) == 'table' then
    if type(it.flow) == 'string' then f.flow = it.flow end
    if type(it.enqueued_at) == 'number' then f.enq = string.format('%.0f', it.enqueued_at) end
  end
  return f
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

-- The ids of `ids` that have a record, as a set. Every record's id is in the index (added
-- in the script that writes the record, taken out with it), so one read answers for a batch.
local function known(ids)
  local out = {}
  each_answer('ZMSCORE', P .. 'index', ids, function(id, score)
    if score or NEW[id] then out[id] = true end
  end)
  return out
end

local function flush()
  -- Acknowledged entries are deleted, never trimmed while unacknowledged. XACK fails before
  -- the first claim made the group; the entries are deleted all the same.
  each_chunk(ACKS, function(...)
    redis.pcall('XACK', STREAM, G, ...)
    redis.call('XDEL', STREAM, ...)
  end)
  local set, del = {}, {}
  for id, v in pairs(LIVES) do
    if v then
      set[#set + 1] = id
      set[#set + 1] = v
    else
      del[#del + 1] = id
    end
  end
  if #set > 0 then redis.call('HSETNX', LIVE, KEEPER_FIELD, keeper()) end
  each_chunk(set, function(...) redis.call('HSET', LIVE, ...) end)
  each_chunk(del, function(...) redis.call('HDEL', LIVE, ...) end)
  local outs = {}
  for id, v in pairs(OUTS) do
    outs[#outs + 1] = id
    outs[#outs + 1] = v
  end
  each_chunk(outs, function(...) redis.call('HSET', OUT, ...) end)
  local scored = {}
  for _, id in ipairs(INDEXED) do
    scored[#scored + 1] = '0'
    scored[#scored + 1] = id
  end
  each_chunk(scored, function(...) redis.call('ZADD', P .. 'index', ...) end)
  each_chunk(GONE, function(...) redis.call('DEL', ...) end)
  -- The newest KEEP finished records stay for the operator; older ones go. Finished is
  -- the one state no script leaves, and an id is listed once, when it finishes.
  local n = 0
  each_chunk(FINISHED, function(...) n = redis.call('RPUSH', P .. 'finished', ...) end)
  if n > KEEP + TRIM then
    local old = redis.call('LPOP', P .. 'finished', math.min(n - KEEP, 4 * TRIM))
    each_chunk(old, function(...)
      redis.call('HDEL', OUT, ...)
      redis.call('ZREM', P .. 'index', ...)
    end)
  end
  ACKS, INDEXED, FINISHED, GONE, LIVES, OUTS, NEW, READ = {}, {}, {}, {}, {}, {}, {}, {}
end

-- Make an item ready: a new stream entry holding its record, and its `live` line. (The
-- flow and when it was enqueued are in the body.)
local function enstream(id, d, body, stepped)
  local eid
  if stepped then
    eid = redis.call('XADD', STREAM, '*', 'id', id, 'd', d, 'body', body, 'stepped', '1')
  else
    eid = redis.call('XADD', STREAM, '*', 'id', id, 'd', d, 'body', body)
  end
  live_set(id, eid)
end

-- Where an item is: its state and, for one in the stream, its `live` line's parts.
local function locate(id)
  local v = live_get(id)
  if v then
    local lease, entry, d = parse_live(v)
    local st = 'in_flight'
    if lease == '-' then st = 'waiting' end
    return st, {lease = lease, entry = entry, d = d}
  end
  local st = redis.call('HGET', ik(id), 'st')
  if st then return st end
  if out_get(id) then return 'finished' end
  return nil
end

-- Take an item out of the stream (waiting or in flight) into a hash of its own, for a
-- state kept there; returns the hash's key, or nil if the item is not in the stream.
local function unstream(id)
  local st, at = locate(id)
  if st ~= 'waiting' and st ~= 'in_flight' then return nil end
  local f = entry_fields(at.entry) or {}
  local d = f.d or '0'
  if st == 'in_flight' then d = at.d end
  local k = ik(id)
  redis.call('HSET', k, 'body', f.body or '', 'flow', f.flow or '', 'deliveries', d,
    'lease', 0, 'enq', f.enq or '0')
  ACKS[#ACKS + 1] = at.entry
  live_set(id, false)
  return k
end

-- A new item: ready now (an entry in the stream) or delayed (in the sorted set). An id
-- seen before is the same item added again (a retried add): the first is kept.
local function insert(it)
  if known({it.id})[it.id] then return 0 end
  INDEXED[#INDEXED + 1] = it.id
  NEW[it.id] = true
  if it.due ~= '' and tonumber(it.due) > NOWN then
    redis.call('HSET', ik(it.id), 'body', it.body, 'flow', it.flow, 'deliveries',
      it.deliveries, 'lease', 0, 'enq', it.enq, 'st', 'delayed', 'due', it.due)
    redis.call('ZADD', P .. 'delayed', it.due, it.id)
  else
    enstream(it.id, it.deliveries, it.body, false)
  end
  return 1
end

-- The finished record: its fields as one line of JSON (values as text, as a hash would
-- hold them), a newline, then the body as it is.
local function finished_record(reason, flow, d, enq, body)
  return cjson.encode({st = 'finished', reason = reason, at = NOW, flow = flow,
    deliveries = tostring(d), enq = tostring(enq)}) .. '\n' .. body
end

-- End an item for good, taking it out of whatever holds it.
local function finish(id, outcome)
  local st, at = locate(id)
  if not st or st == 'finished' then return end
  local rec
  if st == 'waiting' or st == 'in_flight' then
    local f = entry_fields(at.entry) or {}
    local d = f.d or '0'
    if st == 'in_flight' then d = at.d end
    rec = finished_record(outcome, f.flow or '', d, f.enq or '0', f.body or '')
    ACKS[#ACKS + 1] = at.entry
    live_set(id, false)
  else
    local k = ik(id)
    local flow, dentry, d, enq, body =
      unpack(redis.call('HMGET', k, 'flow', 'dentry', 'deliveries', 'enq', 'body'))
    if st == 'delayed' then redis.call('ZREM', P .. 'delayed', id) end
    if st == 'parked' then redis.call('LREM', P .. 'parked:' .. flow, 0, id) end
    if st == 'dead' and dentry then redis.call('XDEL', DEAD, dentry) end
    rec = finished_record(outcome, flow or '', d or '0', enq or '0', body or '')
    redis.call('DEL', k)
  end
  OUTS[id] = rec
  FINISHED[#FINISHED + 1] = id
end

-- Set an item aside with its reason (its record is a hash by now, or the item is in the
-- stream). Past the cap the oldest dead letter is evicted: counted, and its record says
-- so; never silent.
local function bury(id, reason)
  local k = unstream(id) or ik(id)
  local d = redis.call('XADD', DEAD, '*', 'id', id, 'reason', reason)
  redis.call('HSET', k, 'st', 'dead', 'reason', reason, 'at', NOW, 'dentry', d)
  redis.call('HDEL', k, 'due')
  if redis.call('XLEN', DEAD) > DEADCAP then
    local oldest = redis.call('XRANGE', DEAD, '-', '+', 'COUNT', 1)[1]
    local oid = oldest[2][2]
    redis.call('INCR', P .. 'dead_evicted')
    redis.log(redis.LOG_WARNING, 'weir: dead letter ' .. oid .. ' evicted past the cap of ' .. DEADCAP)
    finish(oid, 'evicted from the dead letters: more than ' .. DEADCAP .. ' were kept')
  end
end

local function insert_dead(it, reason)
  if known({it.id})[it.id] then return end
  INDEXED[#INDEXED + 1] = it.id
  NEW[it.id] = true
  redis.call('HSET', ik(it.id), 'body', it.body, 'flow', it.flow, 'deliveries', it.deliveries,
    'lease', 0, 'enq', it.enq)
  bury(it.id, reason)
end

-- A delayed or parked item (a hash) made ready: its record moves into a stream entry.
local function make_ready(id, stepped)
  local k = ik(id)
  local body, d = unpack(redis.call('HMGET', k, 'body', 'deliveries'))
  enstream(id, d or '0', body or '', stepped)
  redis.call('DEL', k)
end

-- An in-flight item whose pending entry `eid` is being taken from its consumer: ready
-- again (a new entry, the deliveries so far carried) if that entry is still its own;
-- returns 1 if so, else 0. `f` is the entry's fields when the caller has them.
local function requeue(id, eid, f)
  local st, at = locate(id)
  if st ~= 'in_flight' or at.entry ~= eid then return 0 end
  f = f or entry_fields(eid) or {}
  enstream(id, at.d, f.body or '', false)
  return 1
end

-- Make ready those of `ids` still in state `st` (a hash's); returns how many.
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
