//! Redis Streams: the backend for several engines sharing work.
//!
//! - Ready items are entries of a stream read through the consumer group `weir`; a claimed
//!   entry stays pending until its commit acknowledges and deletes it, and an engine that
//!   dies leaves its entries pending for `XAUTOCLAIM` to hand to the living. Nothing is ever
//!   trimmed: an entry is deleted when its item ends.
//! - A ready or in-flight item's record is its stream entry (id, the deliveries it had when
//!   the entry was made, body; the flow and when it was enqueued are read from the body off
//!   the hot path) and its line in one hash, `live`: `ENTRY` while it waits, `LEASE ENTRY
//!   BEFORE` once claimed, BEFORE being the deliveries before this one (who holds it, and
//!   since when, are the group's pending entry's). A claim writes the line in the same
//!   script that reads the entry, so the count is the item's own, exactly, and a commit from
//!   an engine whose lease is gone is refused: a plain acknowledgement (the item ends,
//!   nothing else is written) sends the line its claim wrote and the script compares it
//!   whole. A claim and an acknowledgement therefore touch no key of the item's own: every
//!   write they make is one command for the whole batch, as in the bare pipelined loop the
//!   benchmarks compare against. Delayed, parked and dead items have a hash each; a finished
//!   item leaves its record (outcome, when, body) in the hash `out`, the newest 10,000 per
//!   shard kept.
//! - Delayed items wait in a sorted set; promotion is one script (remove, append, mark), so
//!   a crash can neither lose nor duplicate one. Parked items are a list per flow, unparked
//!   by one script. Dead letters are a capped stream; an eviction is counted and recorded.
//!   Done markers are a hash per item with a TTL; node state is two hashes per node (values
//!   and versions).
//! - A wave's commit is one script that refuses when the lease moved, a state version moved,
//!   a guard no longer holds, or a park meets a flow that is no longer paused; it checks all
//!   of that before it writes anything, because Redis does not roll a script back.
//! - Keys are in shards by flow (see [`keys`]); the default is one shard.
//!
//! Durability is the server's: weir checks `appendonly`/`appendfsync` at start and warns when
//! an acknowledged write can be lost. With replication, a failover can lose acknowledged
//! writes unless the replica had them; weir does not use WAIT.

pub mod keys;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, Script};
use serde::Serialize;
use tokio::sync::oneshot;
use ulid::Ulid;

use crate::{
    now_ms, Claimed, Committed, DoneKey, End, Failpoints, ItemState, ItemView, ListFilter, Message,
    QueueError, Reply, StateError, StateKey, StateRead, Stats, Versioned, WaveEffects, WorkItem,
    WorkQueue,
};

const HELPERS: &str = include_str!("scripts.lua");
/// How the keys hold items (see scripts.lua). 1: a hash per item in every state; 2: a
/// waiting or in-flight item is its stream entry and a line of `live`, a finished one a
/// field of `out`; 3: as 2, with entries of three fields (the flow and when it was
/// enqueued read from the body) and `live` lines of `ENTRY` and `LEASE ENTRY BEFORE`.
const LAYOUT: u32 = 3;
/// Finished item records kept per shard for `get`.
const FINISHED_KEPT: usize = 10_000;
/// Dead letters kept per shard, by default, before the oldest is evicted (counted, recorded).
pub const DEAD_CAP: usize = 100_000;
/// Done markers outlive a crashed engine's redelivery by far, then expire.
const DONE_TTL_SECS: i64 = 7 * 24 * 3600;
const IDEMPOTENCY_TTL_SECS: i64 = 24 * 3600;
const REPLY_TTL_SECS: i64 = 120;
/// Delayed items promoted per script run (the rest in the next).
const PROMOTE_BATCH: usize = 1000;
/// Entries one reclaim call looks at per shard, and rounds of that per call.
const RECLAIM_BATCH: usize = 100;
const RECLAIM_ROUNDS: usize = 10;

/// ARGV[3] the bound on ready items, ARGV[4] how many of the items are ready now; then three
/// arguments for each of those (id, deliveries, body) and six for each of the rest (id,
/// flow, deliveries, enqueued at, due, body): flat, so the bodies travel as they are, not
/// escaped into JSON. No id is there twice (the caller keeps the first).
const ADD: &str = r#"
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
"#;

const ADD_IDEMPOTENT: &str = r#"
local first = redis.call('GET', ARGV[3])
if first then return {'old', first} end
local ready = ready_count()
if ready + 1 > tonumber(ARGV[5]) then return {'full', tostring(ready)} end
local it = cjson.decode(ARGV[6])
redis.call('SET', ARGV[3], it.id, 'EX', ARGV[4])
insert(it)
return {'new', it.id}
"#;

const ADD_TICK: &str = r#"
local last = redis.call('HGET', ARGV[3], ARGV[5])
if last and tonumber(last) >= tonumber(ARGV[6]) then return 0 end
redis.call('HSET', ARGV[3], ARGV[5], ARGV[6])
redis.call('HINCRBY', ARGV[4], ARGV[5], 1)
insert(cjson.decode(ARGV[7]))
return 1
"#;

/// ARGV[3] the consumer, ARGV[4] how many at most. Answers the call's lease, then three
/// values for each item claimed, flat: entry, the deliveries before this one (with an `s`
/// after it when a step made the item ready), body; nothing at all when nothing was read.
/// The item's id is the body's. Every item of one call has the same lease (new with each
/// call): with the item's own line, that names its claim, so it is answered once. No number
/// is made text per item (Lua's conversion costs more than the rest of an item's work
/// here), and nothing is answered that the client has already: each value is one more the
/// client parses and Lua converts.
const CLAIM: &str = r#"
local function read()
  return redis.pcall('XREADGROUP', 'GROUP', G, ARGV[3], 'COUNT', ARGV[4], 'STREAMS', STREAM, '>')
end
local r = read()
if type(r) == 'table' and r.err then
  if not string.find(r.err, 'NOGROUP') then return r end
  -- First claim, or the server lost the group: read the stream from its start.
  redis.call('XGROUP', 'CREATE', STREAM, G, '0', 'MKSTREAM')
  r = read()
  if type(r) == 'table' and r.err then return r end
end
local out = {}
if not r then return out end
local entries = r[1][2]
local n = #entries
if n == 0 then return out end
local ids = {}
for i = 1, n do ids[i] = entries[i][2][2] end
-- Each entry's item must be waiting on that very entry (it always is, unless the data
-- was changed behind weir's back): one read for the whole batch.
local cur = {}
for c = 1, n, 1000 do
  local got = redis.call('HMGET', LIVE, unpack(ids, c, math.min(c + 999, n)))
  for j = 1, #got do cur[c + j - 1] = got[j] end
end
-- This call's lease: new, never reused.
local lease = redis.call('INCR', P .. 'lease')
local ls = lease .. ' '
local lines, k, o = {}, 0, 1
out[1] = lease
for i = 1, n do
  local e = entries[i]
  local eid, f = e[1], e[2]
  -- Fields as written: id, d, body[, stepped].
  if f[1] ~= 'id' or f[3] ~= 'd' or f[5] ~= 'body' then
    -- An entry weir did not write (added to the stream by something else): taken out of
    -- the stream like a stale one, and answered as a row with no deliveries, its fields as
    -- text where the body goes, for the engine to report.
    ACKS[#ACKS + 1] = eid
    out[o + 1], out[o + 2], out[o + 3] = eid, '', string.sub(table.concat(f, ' '), 1, 200)
    o = o + 3
  elseif cur[i] ~= eid then
    -- Stale: its item is no longer waiting on this entry.
    ACKS[#ACKS + 1] = eid
  else
    lines[k + 1], lines[k + 2] = ids[i], ls .. eid .. ' ' .. f[4]
    k = k + 2
    local d = f[4]
    if f[8] == '1' then d = d .. 's' end
    out[o + 1], out[o + 2], out[o + 3] = eid, d, f[6]
    o = o + 3
  end
end
if k > 0 then
  redis.call('HSETNX', LIVE, KEEPER_FIELD, keeper())
  each_chunk(lines, function(...) redis.call('HSET', LIVE, ...) end)
end
return out
"#;

/// Several waves' commits in one call (group commit). ARGV[3] is how many are plain
/// acknowledgements (the item ends and nothing else is written: most waves), ARGV[4] how
/// many are not. Then four arguments for each plain one (id, the `live` line its claim
/// wrote, its entry, its finished record as `finished_record` in scripts.lua makes one) and
/// seven for each of the rest (id, lease, flow, how it ends, the reason, the rest of its
/// effects as JSON or nothing when it has none, and for an `ack` its finished record). Each
/// is checked and applied on its own, as if alone; the answer is one word per commit, the
/// plain ones first: done, conflict or failed (a failpoint).
const COMMIT: &str = r#"
local function commit(id, lease, flow, kind, reason, effects, rec)
  -- The item must still be in flight on this very claim: its `live` line starts with the
  -- lease (each claim's is new), then the entry.
  local v = live_get(id)
  local want = lease .. ' '
  if not v or string.sub(v, 1, #want) ~= want then return 'conflict' end
  local eid = string.match(v, '^%S+ (%S+)')
  local fx = nil
  if effects ~= '' then
    fx = cjson.decode(effects)
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
  GONE[#GONE + 1] = P .. 'done:' .. id
  if kind == 'ack' then
    ACKS[#ACKS + 1] = eid
    live_set(id, false)
    OUTS[id] = rec
    FINISHED[#FINISHED + 1] = id
  elseif kind == 'dead' then
    bury(id, reason)
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
local g0 = 5 + 4 * np
for i = 0, ng - 1 do ids[i + 1] = ARGV[g0 + 7 * i] end
live_read(ids)
for i = 0, ng - 1 do
  local a = g0 + 7 * i
  local id = ARGV[a]
  if seen[id] then
    out[np + i + 1] = 'conflict'
  else
    out[np + i + 1] = commit(id, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4],
      ARGV[a + 5], ARGV[a + 6])
  end
end
return out
"#;

const RECLAIM: &str = r#"
local res = redis.pcall('XAUTOCLAIM', STREAM, G, ARGV[3], ARGV[4], ARGV[5], 'COUNT', ARGV[6])
if type(res) == 'table' and res.err then return {0, '0-0'} end
if ARGV[5] == '0-0' then
  -- Once a pass: forget consumers that hold nothing and have not read for as long as an
  -- item may idle (engines that died or stopped; a living one is made again by its next read).
  local cs = redis.pcall('XINFO', 'CONSUMERS', STREAM, G)
  if type(cs) == 'table' and not cs.err then
    for _, c in ipairs(cs) do
      local f = {}
      for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
      if f.pending == 0 and tonumber(f.idle) > tonumber(ARGV[4]) and f.name ~= ARGV[3] then
        redis.call('XGROUP', 'DELCONSUMER', STREAM, G, f.name)
      end
    end
  end
end
local n = 0
for _, e in ipairs(res[2]) do
  local eid, f = e[1], e[2]
  ACKS[#ACKS + 1] = eid
  -- An entry deleted meanwhile comes back without fields (Redis 6.2).
  if f then
    local t = {}
    for i = 1, #f, 2 do t[f[i]] = f[i + 1] end
    if t.id then n = n + requeue(t.id, eid, t) end
  end
end
return {n, res[1]}
"#;

/// A clean shutdown: ARGV[3] the consumer, ARGV[4] how many entries to look at. Its pending
/// entries are made ready again (each a new entry; the old one acknowledged and deleted);
/// when it holds nothing more, the consumer is deleted. Answers {released, still pending}.
const RELEASE: &str = r#"
local p = redis.pcall('XPENDING', STREAM, G, '-', '+', ARGV[4], ARGV[3])
if type(p) == 'table' and p.err then return {0, 0} end
local n = 0
for _, e in ipairs(p) do
  local eid = e[1]
  ACKS[#ACKS + 1] = eid
  local f = entry_fields(eid)
  if f and f.id then n = n + requeue(f.id, eid, f) end
end
local left = 0
if #p < tonumber(ARGV[4]) then
  flush()
  redis.call('XGROUP', 'DELCONSUMER', STREAM, G, ARGV[3])
else
  left = #p
end
return {n, left}
"#;

/// GCRA over KEYS[1] (the theoretical arrival time in µs, by the server's clock, so that
/// engines' clocks need not agree): ARGV one pass every N µs, the burst, how many are wanted.
/// Answers {granted, µs until the next pass}. Standalone (not wrapped with the helpers).
const QUOTA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local every = tonumber(ARGV[1])
local tau = every * (tonumber(ARGV[2]) - 1)
local want = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local granted = 0
if tat - tau <= now then
  granted = math.min(want, math.floor((now + tau - tat) / every) + 1)
end
if granted > 0 then
  tat = tat + granted * every
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
end
local next_in = 0
if granted < want then next_in = math.max(tat - tau - now, 0) end
return {granted, string.format('%.0f', next_in)}
"#;

/// ARGV[3] the entry of an item claimed whose body cannot be decoded (so the claim's answer
/// does not give its id), ARGV[4] the reason: the item is dead-lettered. Answers its id, or
/// nothing when no item is in flight on that entry any more.
const BURY: &str = r#"
local f = entry_fields(ARGV[3])
if not f or not f.id then return '' end
local st, at = locate(f.id)
if st ~= 'in_flight' or at.entry ~= ARGV[3] then return '' end
bury(f.id, ARGV[4])
return f.id
"#;

const PRUNE: &str = r#"
local before = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local outcomes, dead = 0, 0
-- Finished records, oldest first.
for _ = 1, limit do
  local id = redis.call('LINDEX', P .. 'finished', 0)
  if not id then break end
  local rec = redis.call('HGET', OUT, id)
  if rec and tonumber(cjson.decode(string.match(rec, '^[^\n]*')).at or '0') >= before then
    break
  end
  redis.call('LPOP', P .. 'finished')
  if rec then
    redis.call('HDEL', OUT, id)
    redis.call('ZREM', P .. 'index', id)
    outcomes = outcomes + 1
  end
end
-- Dead letters whose stream entry is older than the cutoff.
for _, e in ipairs(redis.call('XRANGE', DEAD, '-', '(' .. before .. '-0', 'COUNT', limit)) do
  local id = e[2][2]
  redis.call('XDEL', DEAD, e[1])
  if redis.call('HGET', ik(id), 'st') == 'dead' then
    redis.call('DEL', ik(id))
    redis.call('ZREM', P .. 'index', id)
    dead = dead + 1
  end
end
return {outcomes, dead}
"#;

const RECOVER: &str = r#"
-- This consumer's own pending entries (an earlier run of it died holding them), oldest
-- first: claimed again here, in place, so they keep their turn ahead of newer entries.
-- Answers as a claim does (the lease, then three values an item, flat).
local p = redis.pcall('XPENDING', STREAM, G, '-', '+', ARGV[4], ARGV[3])
if type(p) == 'table' and p.err then return {} end
local out = {}
for _, e in ipairs(p) do
  local eid = e[1]
  local f = entry_fields(eid)
  local st, at
  if f and f.id then st, at = locate(f.id) end
  if st == 'in_flight' and at.entry == eid then
    -- Reset the entry's idle time, so no other engine's reclaim takes it meanwhile.
    redis.call('XCLAIM', STREAM, G, ARGV[3], 0, eid, 'JUSTID')
    if #out == 0 then out[1] = redis.call('INCR', P .. 'lease') end
    live_set(f.id, out[1] .. ' ' .. eid .. ' ' .. at.d)
    local d = at.d
    if f.stepped == '1' then d = d .. 's' end
    for _, v in ipairs({eid, d, f.body}) do out[#out + 1] = v end
  else
    ACKS[#ACKS + 1] = eid
  end
end
return out
"#;

const MOVE_DUE: &str = r#"
local ids = redis.call('ZRANGEBYSCORE', P .. 'delayed', '-inf', ARGV[3], 'LIMIT', 0, ARGV[4])
if #ids > 0 then redis.call('ZREM', P .. 'delayed', unpack(ids)) end
return ready_those(ids, 'delayed')
"#;

const UNPARK: &str = r#"
local L = P .. 'parked:' .. ARGV[3]
local ids = redis.call('LRANGE', L, 0, -1)
redis.call('DEL', L)
return ready_those(ids, 'parked')
"#;

const UNPARK_ONE: &str = r#"
local L = P .. 'parked:' .. ARGV[3]
for _ = 1, redis.call('LLEN', L) do
  local id = redis.call('LPOP', L)
  if redis.call('HGET', ik(id), 'st') == 'parked' then
    make_ready(id, true)
    return id
  end
end
return false
"#;

const CLEAR_FLOW: &str = r#"
local flow = ARGV[3]
local n = 0
local why = 'cleared with its flow'
for _, id in ipairs(redis.call('LRANGE', P .. 'parked:' .. flow, 0, -1)) do
  if redis.call('HGET', ik(id), 'st') == 'parked' then
    finish(id, why)
    n = n + 1
  end
end
for _, id in ipairs(redis.call('ZRANGE', P .. 'delayed', 0, -1)) do
  local st, f = unpack(redis.call('HMGET', ik(id), 'st', 'flow'))
  if st == 'delayed' and f == flow then
    finish(id, why)
    n = n + 1
  end
end
-- Waiting items: their flow is in the body (read only here, off the hot path).
for _, e in ipairs(redis.call('XRANGE', STREAM, '-', '+')) do
  local id = e[2][2]
  if live_get(id) == e[1] then
    local ok, it = pcall(cjson.decode, e[2][6] or '')
    if ok and type(it) == 'table' and it.flow == flow then
      finish(id, why)
      n = n + 1
    end
  end
end
return n
"#;

const CANCEL: &str = r#"
local st = locate(ARGV[3])
if not st then return 'missing' end
if st == 'waiting' or st == 'delayed' or st == 'parked' then
  finish(ARGV[3], 'cancelled by hand')
  return 'ok'
end
return st
"#;

const DISCARD: &str = r#"
local st = locate(ARGV[3])
if not st then return 'missing' end
if st ~= 'dead' then return st end
finish(ARGV[3], 'discarded by hand')
return 'ok'
"#;

const REPLAY: &str = r#"
local st = locate(ARGV[3])
if not st then return 'missing' end
if st ~= 'dead' then return st end
local it = cjson.decode(ARGV[4])
finish(ARGV[3], 'replayed as ' .. it.id)
insert(it)
return 'ok'
"#;

/// One item's record as field/value pairs, wherever its state keeps it (a finished one's
/// as `json` and its record, see `finished_record`); nothing when there is none.
const GET: &str = r#"
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
"#;

const STATS: &str = r#"
local pend = pending()
local parked = 0
for _, f in ipairs(redis.call('SMEMBERS', P .. 'parked_flows')) do
  local l = redis.call('LLEN', P .. 'parked:' .. f)
  if l == 0 then redis.call('SREM', P .. 'parked_flows', f) end
  parked = parked + l
end
local first = redis.call('XRANGE', STREAM, '-', '+', 'COUNT', 1)[1]
local enq = ''
if first then enq = entry_fields(first[1]).enq or '' end
return {redis.call('XLEN', STREAM) - pend, pend, redis.call('ZCARD', P .. 'delayed'), parked,
  redis.call('XLEN', DEAD), enq, tonumber(redis.call('GET', P .. 'dead_evicted') or '0')}
"#;

struct Scripts {
    add: Script,
    add_idempotent: Script,
    add_tick: Script,
    claim: Script,
    commit: Script,
    reclaim: Script,
    recover: Script,
    release: Script,
    quota: Script,
    bury: Script,
    prune: Script,
    move_due: Script,
    unpark: Script,
    unpark_one: Script,
    clear_flow: Script,
    cancel: Script,
    discard: Script,
    replay: Script,
    stats: Script,
    get: Script,
}

impl Scripts {
    fn new(dead_cap: usize) -> Self {
        let helpers = HELPERS
            .replace("__FINISHED_KEPT__", &FINISHED_KEPT.to_string())
            .replace("__DEAD_CAP__", &dead_cap.max(1).to_string());
        let s = |body: &str| {
            Script::new(&format!(
                "{helpers}\nlocal function main()\n{body}\nend\nlocal r = main()\nflush()\nreturn r"
            ))
        };
        Scripts {
            add: s(ADD),
            add_idempotent: s(ADD_IDEMPOTENT),
            add_tick: s(ADD_TICK),
            claim: s(CLAIM),
            commit: s(COMMIT),
            reclaim: s(RECLAIM),
            recover: s(RECOVER),
            release: s(RELEASE),
            quota: Script::new(QUOTA),
            bury: s(BURY),
            prune: s(PRUNE),
            move_due: s(MOVE_DUE),
            unpark: s(UNPARK),
            unpark_one: s(UNPARK_ONE),
            clear_flow: s(CLEAR_FLOW),
            cancel: s(CANCEL),
            discard: s(DISCARD),
            replay: s(REPLAY),
            stats: s(STATS),
            get: s(GET),
        }
    }
}

/// Settings beyond the server's address.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// The namespace in every key (`{NS:K}:…`), so several deployments can share a server.
    pub namespace: String,
    /// Shards by flow (one Redis Cluster slot each).
    pub shards: u32,
    /// Past this many ready items (per shard) `add` answers `Full`.
    pub max_ready: usize,
    /// Dead letters kept per shard (100,000, or the URL's `dead_cap=`); past it the oldest
    /// is evicted, counted in `Stats::dead_evicted`, and its record says so.
    pub dead_cap: usize,
    /// The longest pause between two polls of a waiting claim or `respond: wave` request
    /// (25 ms, or the URL's `poll=`; the first pauses are shorter, from 2 ms doubling). The
    /// channels of added items and posted replies wake them sooner, so a longer pause costs
    /// an idle engine's Redis less, at the price of that much latency while the channels are
    /// not heard.
    pub poll: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            namespace: "weir".into(),
            shards: 1,
            max_ready: 100_000,
            dead_cap: DEAD_CAP,
            poll: POLL,
        }
    }
}

/// The longest pause between two polls of a waiting claim or reply, by default.
const POLL: Duration = Duration::from_millis(25);

/// An item as the scripts take it.
#[derive(Serialize)]
struct Rec<'a> {
    id: String,
    flow: &'a str,
    body: String,
    due: String,
    enq: String,
    deliveries: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
}

fn rec<'a>(item: &'a WorkItem, reason: Option<&'a str>) -> Result<Rec<'a>, QueueError> {
    Ok(Rec {
        id: item.id.to_string(),
        flow: &item.flow,
        body: serde_json::to_string(item).map_err(|e| QueueError::Corrupt(e.to_string()))?,
        due: item.not_before.map(|t| t.to_string()).unwrap_or_default(),
        enq: item.enqueued_at.to_string(),
        deliveries: item.deliveries,
        reason,
    })
}

/// The first line of a finished record (see `finished_record` in scripts.lua): values as
/// text, as a hash would hold them.
#[derive(Serialize)]
struct FinishedFields<'a> {
    st: &'static str,
    reason: &'a str,
    at: AsText<i64>,
    flow: &'a str,
    deliveries: AsText<u32>,
    enq: AsText<i64>,
}

/// A number serialized as JSON text (`"12"`), with no string made for it.
struct AsText<T>(T);

impl<T: itoa::Integer + Copy> Serialize for AsText<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(itoa::Buffer::new().format(self.0))
    }
}

/// One row of what `CLAIM` and `RECOVER` answer.
enum Row {
    Item(ClaimedRow),
    /// An entry weir did not write, which the script has already taken out of the stream:
    /// its fields as text (cut to 200 bytes), to report.
    Foreign {
        entry: String,
        fields: String,
    },
}

/// An item claimed, as the scripts answer it.
struct ClaimedRow {
    entry: String,
    /// Counted with this delivery.
    deliveries: u32,
    stepped: bool,
    body: String,
}

impl ClaimedRow {
    /// The item claimed under `lease`, keeping its entry and its JSON as read; or its entry
    /// and why its body cannot be decoded (a poison entry, for the caller to set aside).
    fn decode(self, lease: u64, consumer: &str) -> Result<Claimed, (String, serde_json::Error)> {
        match Claimed::decode(&self.body, self.deliveries, lease, consumer, self.stepped) {
            Ok(c) => Ok(Claimed {
                entry: self.entry,
                journaled: self.body,
                ..c
            }),
            Err(e) => Err((self.entry, e)),
        }
    }
}

/// The lease and the rows of a claim's flat answer (the lease, then three values an item;
/// nothing at all when there was nothing to claim).
fn claimed_rows(flat: Vec<redis::Value>) -> Result<(u64, Vec<Row>), QueueError> {
    let bad = |why: String| corrupt(format!("a claim's answer: {why}"));
    let mut it = flat.into_iter();
    let Some(lease) = it.next() else {
        return Ok((0, Vec::new()));
    };
    let lease: u64 = redis::from_redis_value(lease).map_err(|e| bad(e.to_string()))?;
    if !it.len().is_multiple_of(3) {
        return Err(bad(format!(
            "{} values after the lease, not three an item",
            it.len()
        )));
    }
    let text = |v: redis::Value| match v {
        redis::Value::BulkString(b) => Ok(b),
        other => Err(bad(format!("{other:?} where text was expected"))),
    };
    let mut rows = Vec::with_capacity(it.len() / 3);
    while let (Some(entry), Some(d), Some(body)) = (it.next(), it.next(), it.next()) {
        let entry = String::from_utf8(text(entry)?).map_err(|e| bad(e.to_string()))?;
        let d = text(d)?;
        let body = text(body)?;
        if d.is_empty() {
            // Text to show, whatever bytes it holds.
            rows.push(Row::Foreign {
                entry,
                fields: String::from_utf8_lossy(&body).into_owned(),
            });
            continue;
        }
        let (d, stepped) = match d.strip_suffix(b"s") {
            Some(d) => (d, true),
            None => (&d[..], false),
        };
        let before: u32 = std::str::from_utf8(d)
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| bad(format!("deliveries {:?}", String::from_utf8_lossy(d))))?;
        rows.push(Row::Item(ClaimedRow {
            entry,
            deliveries: before.saturating_add(1),
            stepped,
            // weir's own bodies are UTF-8 JSON.
            body: String::from_utf8(body).map_err(|e| bad(e.to_string()))?,
        }));
    }
    Ok((lease, rows))
}

fn unavailable(e: redis::RedisError) -> QueueError {
    QueueError::Unavailable(format!("redis: {e}"))
}

fn corrupt(e: impl std::fmt::Display) -> QueueError {
    QueueError::Corrupt(e.to_string())
}

/// One commit's script arguments (see `COMMIT`) and who waits for its word.
type GroupedCommit = (CommitArgs, oneshot::Sender<Result<String, QueueError>>);

/// A commit as the group script takes it.
enum CommitArgs {
    /// The item ends and nothing else is written: id, the `live` line its claim wrote, its
    /// entry, its finished record.
    Plain([String; 4]),
    /// Anything else: id, lease, flow, end, reason, effects, finished record.
    Full([String; 7]),
}

impl CommitArgs {
    fn strings(&self) -> &[String] {
        match self {
            CommitArgs::Plain(a) => a,
            CommitArgs::Full(a) => a,
        }
    }
}

/// Commits waiting for their shard's next group call.
#[derive(Default)]
struct CommitGroup {
    waiting: Vec<GroupedCommit>,
    /// Tasks sending this shard's groups (at most `COMMIT_CALLS`); each stops when none is
    /// waiting.
    flushing: usize,
}

type CommitGroups = Arc<std::sync::Mutex<HashMap<String, CommitGroup>>>;

/// Commits in one script call at most (the call's arguments stay small).
const COMMIT_GROUP: usize = 128;
/// Group calls of one shard on their way at once.
const COMMIT_CALLS: usize = 2;

/// The `respond: wave` requests waiting at this engine, each woken by its own item's reply.
type ReplyWaiters = std::sync::Mutex<HashMap<Ulid, Arc<ReplyWake>>>;

/// What wakes one waiting request: its reply posted here, or heard on the channel of posted
/// replies (then `heard` says so, and the request counts itself woken by the channel if the
/// wake-up is what found its reply).
#[derive(Default)]
struct ReplyWake {
    notify: tokio::sync::Notify,
    heard: AtomicBool,
}

/// Listen on the namespace's channels of posted replies (`keys::replies_posted`) and of
/// added items (`keys::items_added`): wake the request of this engine that waits for each
/// reply, and this engine's waiting claims when another engine names an add. Connects again
/// after a pause whenever the connection ends. Only a hint: every waiter and claim polls all
/// the same, so while the channels are not heard what another engine posts or adds is found
/// by the poll, up to `poll` later (`RedisOptions::poll`). Ends when the queue is dropped.
async fn hear_other_engines(
    client: redis::Client,
    channels: [String; 2],
    waiters: Weak<ReplyWaiters>,
    heard: Weak<Heard>,
    wakes: Arc<ClaimWakes>,
    poll: Duration,
) {
    let [channel, added] = channels;
    let mut pause = Duration::from_millis(100);
    // The first failure is said at `warn` (pub/sub refused to this user stays so); the
    // retries that follow, at `debug`.
    let mut said = false;
    // Counted off however this task ends, an abort when the queue is dropped included.
    let mut gauge = ListeningGauge::new();
    loop {
        gauge.set(false);
        let subscribed = async {
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(&[&channel, &added]).await?;
            Ok::<_, redis::RedisError>(ps)
        };
        match tokio::time::timeout(Duration::from_secs(2), subscribed).await {
            Ok(Ok(mut ps)) => {
                pause = Duration::from_millis(100);
                match heard.upgrade() {
                    Some(h) => h.listening.store(true, Ordering::Release),
                    None => return,
                }
                gauge.set(true);
                let mut posted = ps.on_message();
                while let Some(m) = posted.next().await {
                    let Some(waiters) = waiters.upgrade() else {
                        return;
                    };
                    let Ok(id) = m.get_payload::<String>() else {
                        continue;
                    };
                    if m.get_channel_name() == added {
                        // Another engine's add (this one's own are told at once, not here).
                        if id != wakes.me && wakes.waiting.load(Ordering::Acquire) > 0 {
                            // Counted by each claim this wake-up lets take items.
                            wakes.heard.fetch_add(1, Ordering::AcqRel);
                            wakes.ready.notify_waiters();
                        }
                        continue;
                    }
                    let Ok(id) = id.parse::<Ulid>() else { continue };
                    let waiter = waiters
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&id)
                        .cloned();
                    if let Some(w) = waiter {
                        // Counted by the request, if this wake-up is what finds its reply.
                        w.heard.store(true, Ordering::Release);
                        w.notify.notify_one();
                    }
                }
                match heard.upgrade() {
                    Some(h) => h.listening.store(false, Ordering::Release),
                    None => return,
                }
                tracing::debug!(
                    "the channels of other engines' replies and adds were cut; listening again"
                );
            }
            Ok(Err(e)) if !said => {
                said = true;
                tracing::warn!(%channel, error = %e, poll = ?poll, "cannot listen for the replies other engines post and the items they add; until it can, they are found by polling, up to `poll` later");
            }
            Ok(Err(e)) => {
                tracing::debug!(%channel, error = %e, "cannot listen for other engines' replies and adds yet");
            }
            Err(_) => {
                tracing::debug!(%channel, "no answer within 2 s to listening for other engines' replies and adds; they are found by polling meanwhile");
            }
        }
        if waiters.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// This queue's part of `weir_redis_reply_channel_listening`, the reply channels the
/// process listens on (an engine's: 1, or 0 while it cannot): counted on while subscribed,
/// off when not, and off however the listener's task ends, an abort when the queue is
/// dropped included. Off goes through the handle that counted on, so a queue made before
/// the process had a recorder takes nothing off the others' count.
struct ListeningGauge(Option<metrics::Gauge>);

impl ListeningGauge {
    /// Off, and shown as 0 until this queue listens (a user without pub/sub rights sees
    /// it stay there).
    fn new() -> Self {
        metrics::gauge!("weir_redis_reply_channel_listening").increment(0.0);
        ListeningGauge(None)
    }

    fn set(&mut self, on: bool) {
        match (on, self.0.take()) {
            (true, None) => {
                let g = metrics::gauge!("weir_redis_reply_channel_listening");
                g.increment(1.0);
                self.0 = Some(g);
            }
            (false, Some(g)) => g.decrement(1.0),
            (_, kept) => self.0 = kept,
        }
    }
}

impl Drop for ListeningGauge {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// What the listener of other engines' replies and adds has heard.
#[derive(Default)]
struct Heard {
    /// Subscribed to the channels now.
    listening: AtomicBool,
    /// Requests of this engine that found their reply, posted by another engine, when the
    /// channel woke them (not at a poll).
    woke: AtomicU64,
    /// Claims of this engine that took items when an add another engine named woke them
    /// (not at a poll).
    adds_woke: AtomicU64,
}

/// What wakes this engine's waiting claims: the items it makes ready itself, at once; those
/// another engine makes ready, through the namespace's channel of added items, named there
/// only by an engine that has no claim of its own waiting to take them. A quiet engine takes
/// its own lone items without waking the others (who would all race for each); a busy one
/// lets an idle one start its items at once instead of at its next poll (up to
/// `RedisOptions::poll`, 25 ms, later).
struct ClaimWakes {
    /// Told when items are made ready here, or heard to be made ready by another engine.
    ready: tokio::sync::Notify,
    /// Adds of other engines heard so far (each one told through `ready`): a claim woken
    /// while it moved was woken by the channel.
    heard: AtomicU64,
    /// This engine's claims waiting for work now.
    waiting: AtomicUsize,
    /// This engine's name on the channel, so that it does not wake itself.
    me: String,
    /// When this engine last named an add on the channel (ms since the epoch): at most one
    /// a millisecond, so a busy engine's adds cost the server a few hundred publishes a
    /// second at most, however many it makes.
    named_at: AtomicI64,
}

/// One of this engine's claims waiting for work, counted in `ClaimWakes::waiting` until it
/// stops waiting, however it stops.
struct WaitingClaim<'a>(&'a AtomicUsize);

impl<'a> WaitingClaim<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::AcqRel);
        WaitingClaim(n)
    }
}

impl Drop for WaitingClaim<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The listener of other engines' replies and adds, stopped with the queue.
struct Listener(tokio::task::AbortHandle);

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A `respond: wave` request's place in `reply_waiters`, given up however its wait ends.
struct ReplyWaiter<'a> {
    map: &'a ReplyWaiters,
    id: Ulid,
}

impl<'a> ReplyWaiter<'a> {
    fn new(map: &'a ReplyWaiters, id: Ulid, woken: Arc<ReplyWake>) -> Self {
        map.lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, woken);
        ReplyWaiter { map, id }
    }
}

impl Drop for ReplyWaiter<'_> {
    fn drop(&mut self) {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

/// Send shard `p`'s waiting commits, a group per call, until none is waiting.
async fn flush_commits(mut conn: Conn, script: Script, groups: CommitGroups, p: String) {
    loop {
        let batch: Vec<_> = {
            let mut g = groups.lock().unwrap_or_else(|e| e.into_inner());
            let Some(group) = g.get_mut(&p) else { return };
            if group.waiting.is_empty() {
                group.flushing -= 1;
                return;
            }
            let n = group.waiting.len().min(COMMIT_GROUP);
            group.waiting.drain(..n).collect()
        };
        // The plain ones first, as the script answers them.
        let (mut batch, full): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .partition(|(a, _)| matches!(a, CommitArgs::Plain(_)));
        let plain = batch.len();
        batch.extend(full);
        let mut inv = script.prepare_invoke();
        inv.key(keys::stream(&p))
            .arg(&p)
            .arg(now_ms().to_string())
            .arg(plain)
            .arg(batch.len() - plain);
        for (args, _) in &batch {
            for a in args.strings() {
                inv.arg(a);
            }
        }
        let answer: Result<Vec<String>, QueueError> =
            inv.invoke_async(&mut conn).await.map_err(unavailable);
        match answer {
            Ok(words) if words.len() == batch.len() => {
                for ((_, tx), w) in batch.into_iter().zip(words) {
                    let _ = tx.send(Ok(w));
                }
            }
            Ok(words) => {
                let e = format!(
                    "a group commit of {} answered {} words",
                    batch.len(),
                    words.len()
                );
                for (_, tx) in batch {
                    let _ = tx.send(Err(QueueError::Corrupt(e.clone())));
                }
            }
            Err(e) => {
                let e = e.to_string();
                for (_, tx) in batch {
                    let _ = tx.send(Err(QueueError::Unavailable(e.clone())));
                }
            }
        }
    }
}

/// A connection to one server (reconnecting by itself), or to a Redis Cluster (each command
/// routed to the node that serves its key; a script by its one declared key, the shard's
/// stream, whose hash tag every other key of the shard shares).
#[derive(Clone)]
enum Conn {
    One(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::One(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::One(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::One(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The seed nodes of `redis-cluster://HOST:PORT[,HOST:PORT…][/]` (or `rediss-cluster://`
/// for TLS), as URLs the cluster client takes; `None` for any other URL.
fn cluster_seeds(url: &str) -> Option<Vec<String>> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = scheme.strip_suffix("-cluster")?;
    let rest = rest.trim_end_matches('/');
    Some(
        rest.split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("{scheme}://{h}"))
            .collect(),
    )
}

/// The Redis Streams queue.
pub struct RedisQueue {
    conn: Conn,
    opts: RedisOptions,
    /// Each shard's key prefix, made once (an add and a commit name theirs for every item).
    shard_prefixes: Vec<String>,
    scripts: Scripts,
    failpoints: Failpoints,
    /// Items `recover` claimed again, handed out by the next claims first.
    recovered: std::sync::Mutex<std::collections::VecDeque<Claimed>>,
    commits: CommitGroups,
    /// The shard the next claim starts with (turning, so that none waits on another).
    next_shard: std::sync::atomic::AtomicUsize,
    /// Wakes this engine's claims polling for work: at once for items it made ready (an
    /// add, a commit that may carry follow-ups), through the channel of added items for
    /// those another engine made ready while it had no claim waiting.
    wakes: Arc<ClaimWakes>,
    /// `respond: wave` requests waiting at this engine, by item: a reply this engine posts
    /// wakes its waiter at once; one another engine posts wakes it through the namespace's
    /// channel of posted replies (or, while that is not heard, the waiter's poll finds it).
    reply_waiters: Arc<ReplyWaiters>,
    heard: Arc<Heard>,
    _listener: Listener,
    /// Something that must live as long as the queue (a test's own redis-server).
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl RedisQueue {
    /// Connect to `url` (`redis://HOST:PORT[/DB]`), check the server's persistence and warn
    /// when acknowledged writes can be lost.
    pub async fn connect(
        url: &str,
        opts: RedisOptions,
        failpoints: Failpoints,
    ) -> Result<Self, QueueError> {
        // No call waits on the server (claims poll), so a short response timeout only ever
        // cuts a dead connection. Reconnects are quick and few: while the server is down a
        // caller should hear so at once (a webhook answers 503), and the executor's loop does
        // the backing off.
        // In errors: the URL with its password hidden.
        let shown = crate::shown::url(url);
        let conn = match cluster_seeds(url) {
            Some(seeds) => {
                if seeds.is_empty() {
                    return Err(QueueError::Open(format!(
                        "`{shown}` names no node: write redis-cluster://HOST:PORT[,HOST:PORT…]"
                    )));
                }
                let client = redis::cluster::ClusterClientBuilder::new(seeds)
                    .connection_timeout(Duration::from_secs(2))
                    .response_timeout(Duration::from_secs(5))
                    .retries(2)
                    .build()
                    .map_err(|e| QueueError::Open(format!("`{shown}`: {e}")))?;
                Conn::Cluster(client.get_async_connection().await.map_err(|e| {
                    QueueError::Open(format!("cannot reach the Redis Cluster at {shown}: {e}"))
                })?)
            }
            None => {
                let client = redis::Client::open(url)
                    .map_err(|e| QueueError::Open(format!("`{shown}` is not a Redis URL: {e}")))?;
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(5)))
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(10))
                    .set_max_delay(Duration::from_millis(50));
                Conn::One(
                    client
                        .get_connection_manager_with_config(cfg)
                        .await
                        .map_err(|e| {
                            QueueError::Open(format!("cannot reach Redis at {shown}: {e}"))
                        })?,
                )
            }
        };
        let scripts = Scripts::new(opts.dead_cap);
        // Published replies reach every node of a cluster, so one node is enough to listen on.
        let listen_on = cluster_seeds(url)
            .and_then(|seeds| seeds.into_iter().next())
            .unwrap_or_else(|| url.to_string());
        let listen_on = redis::Client::open(listen_on.as_str())
            .map_err(|e| QueueError::Open(format!("`{shown}` is not a Redis URL: {e}")))?;
        let reply_waiters: Arc<ReplyWaiters> = Default::default();
        let heard: Arc<Heard> = Default::default();
        let wakes = Arc::new(ClaimWakes {
            ready: tokio::sync::Notify::new(),
            waiting: AtomicUsize::new(0),
            me: Ulid::new().to_string(),
            named_at: AtomicI64::new(0),
            heard: AtomicU64::new(0),
        });
        let listener = tokio::spawn(hear_other_engines(
            listen_on,
            [
                keys::replies_posted(&opts.namespace),
                keys::items_added(&opts.namespace),
            ],
            Arc::downgrade(&reply_waiters),
            Arc::downgrade(&heard),
            wakes.clone(),
            opts.poll,
        ));
        let q = RedisQueue {
            conn,
            shard_prefixes: (0..opts.shards.max(1))
                .map(|k| keys::prefix(&opts.namespace, k))
                .collect(),
            opts,
            scripts,
            failpoints,
            recovered: Default::default(),
            wakes,
            reply_waiters,
            heard,
            _listener: Listener(listener.abort_handle()),
            commits: Default::default(),
            next_shard: Default::default(),
            _keep: None,
        };
        q.check_layout().await?;
        q.check_shards().await?;
        q.check_persistence(url).await;
        Ok(q)
    }

    /// The first engine on a namespace records the layout of its keys; a namespace that an
    /// engine of another layout wrote (an earlier weir) is refused, since this one would
    /// not find its items.
    async fn check_layout(&self) -> Result<(), QueueError> {
        let ns = &self.opts.namespace;
        let k = keys::meta(ns, "layout");
        let mut c = self.conn.clone();
        let io = |e: redis::RedisError| QueueError::Open(format!("cannot use Redis ({k}): {e}"));
        let have: Option<u32> = c.get(&k).await.map_err(io)?;
        let have = match have {
            Some(v) => v,
            // No layout recorded, but shards are: written before layouts were recorded.
            None if c.exists(keys::meta(ns, "shards")).await.map_err(io)? => 1,
            None => {
                let _: bool = c.set_nx(&k, LAYOUT).await.map_err(io)?;
                c.get(&k).await.map_err(io)?
            }
        };
        if have != LAYOUT {
            return Err(QueueError::Open(format!(
                "the queue in namespace `{ns}` was written by a weir that keeps its items \
                 another way (layout {have}; this one uses layout {LAYOUT}): drain it with \
                 that weir (nothing waiting, in flight, delayed, parked or dead), or start \
                 this one with another namespace (ns=…)"
            )));
        }
        Ok(())
    }

    /// The first engine on a namespace records its number of shards; an engine configured
    /// with another number is refused, since it would look for items where they are not.
    async fn check_shards(&self) -> Result<(), QueueError> {
        let k = keys::meta(&self.opts.namespace, "shards");
        let mut c = self.conn.clone();
        let want = self.opts.shards.max(1);
        let _: bool = c
            .set_nx(&k, want)
            .await
            .map_err(|e| QueueError::Open(format!("cannot write to Redis ({k}): {e}")))?;
        let have: u32 = c
            .get(&k)
            .await
            .map_err(|e| QueueError::Open(format!("cannot read {k}: {e}")))?;
        if have != want {
            return Err(QueueError::Open(format!(
                "the queue in namespace `{ns}` has {have} shards and this engine was started \
                 with shards={want}: every engine on a namespace must use the same number. To \
                 change it, drain the queue (nothing waiting, in flight, delayed, parked or \
                 dead), delete the key {k}, and start with the new number; or use another \
                 namespace (ns=…)",
                ns = self.opts.namespace
            )));
        }
        Ok(())
    }

    /// A poll's first pause and its longest (`RedisOptions::poll`, at least 1 ms so that a
    /// waiter never spins).
    fn poll_pauses(&self) -> (Duration, Duration) {
        let most = self.opts.poll.max(Duration::from_millis(1));
        (Duration::from_millis(2).min(most), most)
    }

    /// Whether this engine hears, at this moment, the replies other engines post for its
    /// waiting `respond: wave` requests and the adds they name (through the namespace's
    /// channels of posted replies and added items). While it does not (Redis unreachable,
    /// or pub/sub refused to this user), those replies and items are found by polling, up to
    /// `RedisOptions::poll` (25 ms) later; nothing is lost either way.
    pub fn hears_other_engines(&self) -> bool {
        self.heard.listening.load(Ordering::Acquire)
    }

    /// How many `respond: wave` requests waiting at this engine were woken by a reply that
    /// another engine posted (heard on the channel, not found by a poll).
    pub fn replies_heard(&self) -> u64 {
        self.heard.woke.load(Ordering::Relaxed)
    }

    /// How many of this engine's waiting claims took items when an add another engine named
    /// on the channel of added items woke them (not found by a poll).
    pub fn adds_heard(&self) -> u64 {
        self.heard.adds_woke.load(Ordering::Relaxed)
    }

    /// Items were made ready here: wake this engine's waiting claims, and when none waits,
    /// name the add on the channel of added items (at most once a millisecond), so that
    /// another engine's waiting claims take them at once. Sent on its own, without holding
    /// up the add: only a hint is at stake, and the other engines' polls find the items if
    /// it is lost (or refused: a Redis user without pub/sub rights).
    fn made_ready(&self) {
        self.wakes.ready.notify_waiters();
        if self.wakes.waiting.load(Ordering::Acquire) > 0 {
            return;
        }
        let now = now_ms();
        let last = self.wakes.named_at.load(Ordering::Relaxed);
        if now <= last
            || self
                .wakes
                .named_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let mut c = self.conn.clone();
        let channel = keys::items_added(&self.opts.namespace);
        let me = self.wakes.me.clone();
        tokio::spawn(async move {
            if let Err(e) = c.publish::<_, _, i64>(channel, me).await {
                tracing::debug!(error = %e, "an add was not named on the channel of added items");
            }
        });
    }

    /// Keep `x` alive as long as the queue (a test's server, say).
    pub fn keeping(mut self, x: impl std::any::Any + Send + Sync) -> Self {
        self._keep = Some(Box::new(x));
        self
    }

    /// Warn when the server can lose a write it acknowledged; returns the warnings.
    pub async fn check_persistence(&self, url: &str) -> Vec<String> {
        let mut c = self.conn.clone();
        let get = |name: &'static str| {
            let mut c = c.clone();
            async move {
                let v: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(name)
                    .query_async(&mut c)
                    .await;
                v.ok().and_then(|v| v.get(1).cloned())
            }
        };
        let aof = get("appendonly").await;
        let fsync = get("appendfsync").await;
        let _ = &mut c;
        let mut warnings = Vec::new();
        match (aof.as_deref(), fsync.as_deref()) {
            (None, _) => warnings.push(format!(
                "cannot read the persistence settings of {url} (CONFIG GET refused); \
                 make sure it runs with appendonly yes and appendfsync always"
            )),
            (Some("yes"), Some("always")) => {}
            (Some("yes"), f) => warnings.push(format!(
                "{url} runs with appendfsync {}: a crash of the server can lose up to a second \
                 of events weir already acknowledged; set appendfsync always",
                f.unwrap_or("?")
            )),
            (Some(_), _) => warnings.push(format!(
                "{url} runs without the append-only file: a restart of the server loses events \
                 weir already acknowledged; set appendonly yes and appendfsync always"
            )),
        }
        for w in &warnings {
            tracing::warn!("{w}");
        }
        warnings
    }

    fn prefix_of(&self, flow: &str) -> &str {
        match self.shard_prefixes.as_slice() {
            [one] => one,
            all => &all[keys::shard_of(flow, self.opts.shards) as usize],
        }
    }

    fn prefixes(&self) -> &[String] {
        &self.shard_prefixes
    }

    /// Run a script in shard `p` (its stream key routes it to the right node of a cluster).
    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        p: &str,
        args: &[&dyn RedisArg],
    ) -> Result<T, QueueError> {
        let mut inv = script.prepare_invoke();
        inv.key(keys::stream(p)).arg(p).arg(now_ms().to_string());
        for a in args {
            a.push(&mut inv);
        }
        let mut c = self.conn.clone();
        inv.invoke_async(&mut c).await.map_err(unavailable)
    }

    /// Commit through shard `p`'s group: commits that arrive while the shard's calls are on
    /// their way (at most `COMMIT_CALLS`) go together in the next (one script, one fsync on
    /// the server), with no timer.
    async fn commit_grouped(&self, p: &str, args: CommitArgs) -> Result<String, QueueError> {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut groups = self.commits.lock().unwrap_or_else(|e| e.into_inner());
            // The shard's group is there after its first commit: no key made for each.
            let g = match groups.get_mut(p) {
                Some(g) => g,
                None => groups.entry(p.to_string()).or_default(),
            };
            g.waiting.push((args, tx));
            let lead = g.flushing < COMMIT_CALLS;
            if lead {
                g.flushing += 1;
            }
            lead
        };
        if lead {
            let (conn, script, groups, p) = (
                self.conn.clone(),
                self.scripts.commit.clone(),
                self.commits.clone(),
                p.to_string(),
            );
            tokio::spawn(flush_commits(conn, script, groups, p));
        }
        rx.await
            .map_err(|_| QueueError::Unavailable("the commit was dropped".into()))?
    }

    async fn record(&self, p: &str, id: &str) -> Result<Option<ItemView>, QueueError> {
        let pairs: Vec<String> = self.run(&self.scripts.get, p, &[&id]).await?;
        if pairs.is_empty() {
            return Ok(None);
        }
        let mut h: HashMap<String, String> = HashMap::with_capacity(pairs.len() / 2);
        let mut it = pairs.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            h.insert(k, v);
        }
        if let Some(rec) = h.remove("json") {
            // A finished record: a line of JSON whose values are text (as a hash's would
            // be), a newline, the body.
            let (line, body) = rec.split_once('\n').unwrap_or((&rec, ""));
            let fields: HashMap<String, serde_json::Value> =
                serde_json::from_str(line).map_err(corrupt)?;
            h = fields
                .into_iter()
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => (k, s),
                    other => (k, other.to_string()),
                })
                .collect();
            h.insert("body".into(), body.to_string());
        }
        view(id, &h).map(Some)
    }

    /// Up to `n` ready items of shard `p`, claimed and decoded (an undecodable one is
    /// dead-lettered with the reason, and the rest go on).
    async fn claim_shard(
        &self,
        p: &str,
        consumer: &str,
        n: usize,
    ) -> Result<Vec<Claimed>, QueueError> {
        let flat: Vec<redis::Value> = self.run(&self.scripts.claim, p, &[&consumer, &n]).await?;
        let (lease, rows) = claimed_rows(flat)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let row = match row {
                Row::Item(row) => row,
                Row::Foreign { entry, fields } => {
                    // Not weir's: the script has already taken it out of the stream.
                    metrics::counter!("weir_redis_foreign_entries_total").increment(1);
                    tracing::warn!(
                        %entry,
                        // Debug: quoted and escaped, so its text cannot pass for lines of the log.
                        fields = ?fields,
                        "a stream entry weir did not write was found in the queue's stream and removed; \
                         whatever wrote it should use a webhook or MQTT instead"
                    );
                    continue;
                }
            };
            match row.decode(lease, consumer) {
                Ok(c) => out.push(c),
                // A poison entry: set it aside with the reason, go on with the rest.
                Err((entry, e)) => {
                    if let Err(err) = self.bury_undecodable(p, &entry, &e).await {
                        tracing::warn!(%entry, error = %err, "cannot set the undecodable item aside yet; it comes back after the reclaim delay");
                    }
                }
            }
        }
        Ok(out)
    }

    /// Dead-letter a claimed item of shard `p` whose body cannot be decoded, found by its
    /// entry (a claim's answer carries no id), and say so in the log.
    async fn bury_undecodable(
        &self,
        p: &str,
        entry: &str,
        e: &serde_json::Error,
    ) -> Result<(), QueueError> {
        let reason = format!("undecodable item: {e}");
        let id: String = self.run(&self.scripts.bury, p, &[&entry, &reason]).await?;
        if id.is_empty() {
            tracing::warn!(%entry, error = %e, "an item that cannot be decoded was no longer in flight on this claim; left where it is");
        } else {
            tracing::error!(%id, %entry, error = %e, "an item that cannot be decoded is dead-lettered");
        }
        Ok(())
    }

    /// One claim over every shard, at most `max` items. With several shards, each is asked
    /// for a fair share at once (one round trip's latency, not one per shard), starting from
    /// a shard that turns with every round so that no shard's flows wait on another's; the
    /// rest of `max` then comes from the shards that had more. Items already claimed are
    /// handed out even when another shard fails (claimed and dropped, they would wait out
    /// the reclaim delay).
    async fn claim_round(&self, consumer: &str, max: usize) -> Result<Vec<Claimed>, QueueError> {
        let shards = self.prefixes();
        if shards.len() == 1 {
            return self.claim_shard(&shards[0], consumer, max).await;
        }
        let k = shards.len();
        let first = self
            .next_shard
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % k;
        let order: Vec<&String> = (0..k).map(|i| &shards[(first + i) % k]).collect();
        let mut out = Vec::new();
        let mut more = Vec::new();
        let mut failed = None;
        // Shards in groups of at most what is still wanted (one each at least), until the
        // claim is full or every shard was asked.
        let mut i = 0;
        while i < k && out.len() < max && failed.is_none() {
            let want = max - out.len();
            let group = &order[i..i + (k - i).min(want)];
            let share = (want / group.len()).max(1);
            let answers = futures::future::join_all(
                group.iter().map(|p| self.claim_shard(p, consumer, share)),
            )
            .await;
            for (p, a) in group.iter().zip(answers) {
                match a {
                    Ok(got) => {
                        if got.len() == share {
                            more.push(*p);
                        }
                        out.extend(got);
                    }
                    Err(e) => failed = Some(e),
                }
            }
            i += group.len();
        }
        for p in more {
            if out.len() >= max || failed.is_some() {
                break;
            }
            match self.claim_shard(p, consumer, max - out.len()).await {
                Ok(got) => out.extend(got),
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) if out.is_empty() => Err(e),
            Some(e) => {
                tracing::warn!(error = %e, claimed = out.len(), "a shard could not be claimed from; handing out what the others gave");
                Ok(out)
            }
            None => Ok(out),
        }
    }

    /// Find an item's record in whichever shard holds it.
    async fn find(&self, id: Ulid) -> Result<Option<(String, ItemView)>, QueueError> {
        let id = id.to_string();
        for p in self.prefixes() {
            if let Some(v) = self.record(p, &id).await? {
                return Ok(Some((p.clone(), v)));
            }
        }
        Ok(None)
    }

    /// An operator's script on one item, answering `ok` or the state that refused it.
    async fn on_item(
        &self,
        script: &Script,
        id: Ulid,
        extra: Option<String>,
        refuse: impl Fn(&str) -> QueueError,
    ) -> Result<(), QueueError> {
        let Some((p, _)) = self.find(id).await? else {
            return Err(QueueError::NotFound(id));
        };
        let ids = id.to_string();
        let r: String = match &extra {
            Some(x) => self.run(script, &p, &[&ids, x]).await?,
            None => self.run(script, &p, &[&ids]).await?,
        };
        match r.as_str() {
            "ok" => Ok(()),
            "missing" => Err(QueueError::NotFound(id)),
            st => Err(refuse(st)),
        }
    }
}

/// Something a script takes as an argument.
trait RedisArg: Sync {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>);
}

impl RedisArg for String {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(self.as_str());
    }
}

impl RedisArg for &str {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(*self);
    }
}

impl RedisArg for usize {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(*self);
    }
}

fn field<'a>(h: &'a HashMap<String, String>, k: &str) -> Option<&'a str> {
    h.get(k).map(String::as_str)
}

fn num(h: &HashMap<String, String>, k: &str) -> i64 {
    field(h, k).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// An item record as the operator sees it.
fn view(id: &str, h: &HashMap<String, String>) -> Result<ItemView, QueueError> {
    let body = field(h, "body").unwrap_or_default();
    // A body that cannot be decoded is still shown (it is a dead letter by now).
    let mut item: WorkItem = match serde_json::from_str(body) {
        Ok(item) => item,
        Err(_) => WorkItem::undecodable(
            Ulid::from_string(id).map_err(corrupt)?,
            field(h, "flow").unwrap_or_default(),
            body,
        ),
    };
    item.deliveries = num(h, "deliveries") as u32;
    item.not_before = field(h, "due").and_then(|d| d.parse().ok());
    let text = |k| field(h, k).unwrap_or_default().to_string();
    let state = match field(h, "st").unwrap_or_default() {
        "waiting" => ItemState::Waiting,
        "in_flight" => ItemState::InFlight {
            consumer: text("consumer"),
            since: num(h, "since"),
        },
        "delayed" => ItemState::Delayed { due: num(h, "due") },
        "parked" => ItemState::Parked,
        "dead" => ItemState::Dead {
            reason: text("reason"),
            at: num(h, "at"),
        },
        "finished" => ItemState::Finished {
            outcome: text("reason"),
            at: num(h, "at"),
        },
        other => return Err(corrupt(format!("unknown item state `{other}`"))),
    };
    Ok(ItemView { item, state })
}

fn done_field(key: &DoneKey) -> String {
    format!("{}/{}", key.node, key.position)
}

#[async_trait::async_trait]
impl StateRead for RedisQueue {
    async fn read(&self, key: &StateKey) -> Result<Versioned, StateError> {
        let p = self.prefix_of(&key.flow);
        let mut c = self.conn.clone();
        let (value, version): (Option<String>, Option<u64>) = redis::pipe()
            .hget(keys::state(p, &key.flow, &key.node), &key.key)
            .hget(keys::versions(p, &key.flow, &key.node), &key.key)
            .query_async(&mut c)
            .await
            .map_err(|e| StateError(e.to_string()))?;
        Ok(Versioned {
            value: value
                .map(|v| serde_json::from_str(&v))
                .transpose()
                .map_err(|e| StateError(e.to_string()))?,
            version: version.unwrap_or(0),
        })
    }

    fn shares_quotas(&self) -> bool {
        true
    }

    async fn take_quota(
        &self,
        key: &StateKey,
        every: Duration,
        burst: u32,
        want: u32,
    ) -> Result<weir_state::Quota, StateError> {
        let p = self.prefix_of(&key.flow);
        let k = keys::quota(p, &key.flow, &key.node, &key.key);
        let mut c = self.conn.clone();
        let (granted, next_us): (u32, u64) = self
            .scripts
            .quota
            .key(k)
            .arg(every.as_micros().max(1) as u64)
            .arg(burst.max(1))
            .arg(want)
            .invoke_async(&mut c)
            .await
            .map_err(|e| StateError(e.to_string()))?;
        Ok(weir_state::Quota {
            granted,
            next_in: Duration::from_micros(next_us),
        })
    }

    async fn read_node(
        &self,
        flow: &str,
        node: &str,
    ) -> Result<Vec<(String, Versioned)>, StateError> {
        let p = self.prefix_of(flow);
        let mut c = self.conn.clone();
        let (values, versions): (HashMap<String, String>, HashMap<String, u64>) = redis::pipe()
            .hgetall(keys::state(p, flow, node))
            .hgetall(keys::versions(p, flow, node))
            .query_async(&mut c)
            .await
            .map_err(|e| StateError(e.to_string()))?;
        values
            .into_iter()
            .map(|(k, v)| {
                let version = versions.get(&k).copied().unwrap_or(0);
                let value = serde_json::from_str(&v).map_err(|e| StateError(e.to_string()))?;
                Ok((
                    k,
                    Versioned {
                        value: Some(value),
                        version,
                    },
                ))
            })
            .collect()
    }
}

fn full(n: i64) -> QueueError {
    QueueError::Full(n.max(0) as usize)
}

#[async_trait::async_trait]
impl WorkQueue for RedisQueue {
    fn durable(&self) -> bool {
        true
    }

    async fn add(&self, items: Vec<WorkItem>) -> Result<(), QueueError> {
        // One script per shard: a batch is all-or-nothing within a shard (one shard by
        // default; a trigger's batch is one flow's, so one shard).
        let mut by_shard: Vec<(&str, Vec<&WorkItem>)> = Vec::new();
        for it in &items {
            let p = self.prefix_of(&it.flow);
            match by_shard.iter_mut().find(|(q, _)| *q == p) {
                Some((_, its)) => its.push(it),
                None => by_shard.push((p, vec![it])),
            }
        }
        let now = now_ms();
        for (p, its) in by_shard {
            // An id twice in one batch is journaled once, as the first.
            let mut ids = std::collections::HashSet::with_capacity(its.len());
            let its: Vec<&WorkItem> = its.into_iter().filter(|it| ids.insert(it.id)).collect();
            let (ready, later): (Vec<&WorkItem>, Vec<&WorkItem>) = its
                .into_iter()
                .partition(|it| it.not_before.is_none_or(|t| t <= now));
            let mut args: Vec<String> = Vec::with_capacity(2 + 3 * ready.len() + 6 * later.len());
            args.push(self.opts.max_ready.to_string());
            args.push(ready.len().to_string());
            for it in ready {
                args.extend([
                    it.id.to_string(),
                    it.deliveries.to_string(),
                    serde_json::to_string(it).map_err(corrupt)?,
                ]);
            }
            for it in later {
                let r = rec(it, None)?;
                args.extend([
                    r.id,
                    it.flow.clone(),
                    r.deliveries.to_string(),
                    r.enq,
                    r.due,
                    r.body,
                ]);
            }
            let args: Vec<&dyn RedisArg> = args.iter().map(|a| a as &dyn RedisArg).collect();
            let (r, n): (String, i64) = self.run(&self.scripts.add, p, &args).await?;
            if r == "full" {
                return Err(full(n));
            }
            self.made_ready();
        }
        Ok(())
    }

    async fn add_idempotent(&self, key: &str, item: WorkItem) -> Result<(Ulid, bool), QueueError> {
        let p = self.prefix_of(&item.flow);
        let payload = serde_json::to_string(&rec(&item, None)?).map_err(corrupt)?;
        let (r, v): (String, String) = self
            .run(
                &self.scripts.add_idempotent,
                p,
                &[
                    &keys::idempotency(p, key),
                    &IDEMPOTENCY_TTL_SECS.to_string(),
                    &self.opts.max_ready,
                    &payload,
                ],
            )
            .await?;
        match r.as_str() {
            "full" => Err(full(v.parse().unwrap_or(0))),
            "old" => Ok((Ulid::from_string(&v).map_err(corrupt)?, false)),
            _ => {
                self.made_ready();
                Ok((item.id, true))
            }
        }
    }

    async fn add_tick(
        &self,
        key: &StateKey,
        tick: i64,
        item: WorkItem,
    ) -> Result<bool, QueueError> {
        let p = self.prefix_of(&key.flow);
        let payload = serde_json::to_string(&rec(&item, None)?).map_err(corrupt)?;
        let r: i64 = self
            .run(
                &self.scripts.add_tick,
                p,
                &[
                    &keys::state(p, &key.flow, &key.node),
                    &keys::versions(p, &key.flow, &key.node),
                    &key.key.as_str(),
                    &tick.to_string(),
                    &payload,
                ],
            )
            .await?;
        if r == 1 {
            self.made_ready();
        }
        Ok(r == 1)
    }

    async fn claim(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Claimed>, QueueError> {
        {
            let mut back = self.recovered.lock().unwrap_or_else(|e| e.into_inner());
            if !back.is_empty() {
                let n = max.min(back.len());
                return Ok(back.drain(..n).collect());
            }
        }
        // Claims poll (a script cannot block): quickly at first, then less often, and at
        // once when this engine makes items ready. The wake-up is armed before each round, so
        // an add that lands while the round runs is not missed.
        let deadline = tokio::time::Instant::now() + wait;
        let (first, most) = self.poll_pauses();
        let mut pause = first;
        // Whether this round follows a wake-up by another engine's add, heard on the channel.
        let mut heard = false;
        loop {
            let woken = self.wakes.ready.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let adds_heard = self.wakes.heard.load(Ordering::Acquire);
            let out = self.claim_round(consumer, max).await?;
            if !out.is_empty() && heard {
                self.heard.adds_woke.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("weir_redis_adds_heard_total").increment(1);
            }
            if !out.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(out);
            }
            let left = deadline - tokio::time::Instant::now();
            let _waiting = WaitingClaim::new(&self.wakes.waiting);
            tokio::select! {
                _ = tokio::time::sleep(pause.min(left)) => {
                    pause = pause.saturating_mul(2).min(most);
                    heard = false;
                }
                _ = woken => {
                    pause = first;
                    heard = self.wakes.heard.load(Ordering::Acquire) != adds_heard;
                }
            }
        }
    }

    async fn commit(&self, claimed: &Claimed, fx: WaveEffects) -> Result<Committed, QueueError> {
        let item = &claimed.item;
        let p = self.prefix_of(&item.flow);
        let (kind, reason): (_, std::borrow::Cow<str>) = match &fx.end {
            None | Some(End::Ack) => ("ack", fx.outcome.as_deref().unwrap_or("done").into()),
            Some(End::Superseded) => ("ack", "superseded by a newer timer".into()),
            Some(End::DeadLetter(r)) => ("dead", r.as_str().into()),
            Some(End::Park) => ("park", "".into()),
        };
        let mut items = Vec::new();
        for it in fx.follow_ups.iter().chain(&fx.delayed) {
            items.push(rec(it, None)?);
        }
        let mut dead = Vec::new();
        for (it, why) in &fx.dead {
            dead.push(rec(it, Some(why))?);
        }
        let state = fx
            .state
            .iter()
            .map(|w| {
                let p = self.prefix_of(&w.key.flow);
                Ok(serde_json::json!({
                    "hk": keys::state(p, &w.key.flow, &w.key.node),
                    "vk": keys::versions(p, &w.key.flow, &w.key.node),
                    "key": w.key.key,
                    "read": w.read_version,
                    "del": w.value.is_none(),
                    "value": w.value.as_ref().map(serde_json::to_string).transpose().map_err(corrupt)?.unwrap_or_default(),
                }))
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        let guards = fx
            .guards
            .iter()
            .map(|(k, want)| {
                let p = self.prefix_of(&k.flow);
                Ok(serde_json::json!({
                    "hk": keys::state(p, &k.flow, &k.node),
                    "key": k.key,
                    "want": serde_json::to_string(want).map_err(corrupt)?,
                }))
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        let fail = self.failpoints.hit("commit");
        let reply_lost = self.failpoints.hit("commit-reply-lost");
        // The common wave ends its item and writes nothing else: no JSON to decode.
        let effects = if items.is_empty()
            && dead.is_empty()
            && state.is_empty()
            && guards.is_empty()
            && !fail
        {
            String::new()
        } else {
            let fx = serde_json::json!({
                "items": items, "dead": dead, "state": state, "guards": guards, "fail": fail,
            });
            serde_json::to_string(&fx).map_err(corrupt)?
        };
        // An acknowledged item's finished record is written as the client made it (its
        // fields as one line of JSON, a newline, the body): the script only checks the
        // claim, with no per-item work of its own.
        let record = if kind == "ack" {
            let fields = FinishedFields {
                st: "finished",
                reason: &reason,
                at: AsText(now_ms()),
                flow: &item.flow,
                deliveries: AsText(item.deliveries),
                enq: AsText(item.enqueued_at),
            };
            let mut rec = serde_json::to_string(&fields).map_err(corrupt)?;
            // Called so: `rec.push` would find `RedisArg::push` first.
            String::push(&mut rec, '\n');
            // The body as journaled (its deliveries and due time are the record's own
            // fields, which a view reads instead).
            if claimed.journaled.is_empty() {
                rec.push_str(&serde_json::to_string(item).map_err(corrupt)?);
            } else {
                rec.push_str(&claimed.journaled);
            }
            rec
        } else {
            String::new()
        };
        let args = if kind == "ack" && effects.is_empty() && !claimed.entry.is_empty() {
            // The line its claim wrote in `live` (see `CLAIM`): lease, entry, the
            // deliveries before this one.
            let mut n = itoa::Buffer::new();
            let mut line = String::with_capacity(48);
            line.push_str(n.format(claimed.lease));
            String::push(&mut line, ' ');
            line.push_str(&claimed.entry);
            String::push(&mut line, ' ');
            line.push_str(n.format(item.deliveries.saturating_sub(1)));
            CommitArgs::Plain([item.id.to_string(), line, claimed.entry.clone(), record])
        } else {
            CommitArgs::Full([
                item.id.to_string(),
                claimed.lease.to_string(),
                item.flow.clone(),
                kind.to_string(),
                reason.into_owned(),
                effects,
                record,
            ])
        };
        let r = self.commit_grouped(p, args).await?;
        if r == "failed" {
            return Err(QueueError::Unavailable("failpoint `commit` fired".into()));
        }
        if reply_lost {
            return Err(QueueError::Unavailable(
                "failpoint `commit-reply-lost` fired (the commit went through)".into(),
            ));
        }
        if r == "done" && !fx.follow_ups.is_empty() {
            self.made_ready();
        }
        Ok(if r == "done" {
            Committed::Done
        } else {
            Committed::Conflict
        })
    }

    async fn reclaim_stale(&self, min_idle: Duration) -> Result<usize, QueueError> {
        let mut n = 0;
        let idle = (min_idle.as_millis() as u64).to_string();
        for p in self.prefixes() {
            let mut cursor = "0-0".to_string();
            for round in 0..RECLAIM_ROUNDS {
                if round + 1 == RECLAIM_ROUNDS {
                    tracing::warn!(
                        looked_at = RECLAIM_ROUNDS * RECLAIM_BATCH,
                        "reclaim pass stopped at its bound; the rest of the pending entries wait for the next pass"
                    );
                }
                let (got, next): (usize, String) = self
                    .run(
                        &self.scripts.reclaim,
                        p,
                        &[&"weir-reclaimer", &idle, &cursor, &RECLAIM_BATCH],
                    )
                    .await?;
                n += got;
                if next == "0-0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(n)
    }

    async fn recover(&self, consumer: &str) -> Result<usize, QueueError> {
        // Everything pending for this consumer is taken in one pass (bounded per shard):
        // claimed again in place, and handed out by the next claims before anything newer.
        let mut back = Vec::new();
        for p in self.prefixes() {
            let flat: Vec<redis::Value> = self
                .run(
                    &self.scripts.recover,
                    p,
                    &[&consumer, &(RECLAIM_BATCH * RECLAIM_ROUNDS)],
                )
                .await?;
            let (lease, rows) = claimed_rows(flat)?;
            for row in rows {
                // `RECOVER` answers only items in flight on their entries, never a foreign one.
                let Row::Item(row) = row else { continue };
                match row.decode(lease, consumer) {
                    Ok(c) => back.push(c),
                    Err((entry, e)) => self.bury_undecodable(p, &entry, &e).await?,
                }
            }
        }
        let n = back.len();
        self.recovered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(back);
        Ok(n)
    }

    async fn release(&self, consumer: &str) -> Result<usize, QueueError> {
        let mut n = 0;
        for p in self.prefixes() {
            for _ in 0..RECLAIM_ROUNDS {
                let (got, left): (usize, usize) = self
                    .run(&self.scripts.release, p, &[&consumer, &RECLAIM_BATCH])
                    .await?;
                n += got;
                if left == 0 {
                    break;
                }
            }
        }
        Ok(n)
    }

    /// Finished items and dead letters; run records (hashes per flow) are left to the
    /// server's memory policy for now.
    async fn prune(&self, before: i64) -> Result<crate::Pruned, QueueError> {
        let mut p = crate::Pruned::default();
        let before = before.to_string();
        for shard in self.prefixes() {
            let (o, d): (usize, usize) = self
                .run(&self.scripts.prune, shard, &[&before, &10_000usize])
                .await?;
            p.outcomes += o;
            p.dead += d;
        }
        Ok(p)
    }

    async fn move_due(&self, now: i64) -> Result<usize, QueueError> {
        let mut n = 0;
        let now = now.to_string();
        for p in self.prefixes() {
            let got: usize = self
                .run(&self.scripts.move_due, p, &[&now, &PROMOTE_BATCH])
                .await?;
            n += got;
        }
        Ok(n)
    }

    async fn next_due(&self) -> Result<Option<i64>, QueueError> {
        let mut best: Option<i64> = None;
        let mut c = self.conn.clone();
        for p in self.prefixes() {
            let first: Vec<(String, f64)> = c
                .zrange_withscores(keys::delayed(p), 0, 0)
                .await
                .map_err(unavailable)?;
            if let Some((_, t)) = first.first() {
                let t = *t as i64;
                best = Some(best.map_or(t, |b| b.min(t)));
            }
        }
        Ok(best)
    }

    async fn set_paused(&self, flow: &str, paused: bool) -> Result<(), QueueError> {
        let key = keys::paused(self.prefix_of(flow));
        let mut c = self.conn.clone();
        if paused {
            c.sadd::<_, _, ()>(key, flow).await.map_err(unavailable)
        } else {
            c.srem::<_, _, ()>(key, flow).await.map_err(unavailable)
        }
    }

    async fn is_paused(&self, flow: &str) -> Result<bool, QueueError> {
        let mut c = self.conn.clone();
        c.sismember(keys::paused(self.prefix_of(flow)), flow)
            .await
            .map_err(unavailable)
    }

    async fn parked_count(&self, flow: &str) -> Result<usize, QueueError> {
        let mut c = self.conn.clone();
        c.llen(keys::parked(self.prefix_of(flow), flow))
            .await
            .map_err(unavailable)
    }

    async fn unpark(&self, flow: &str) -> Result<usize, QueueError> {
        self.run(&self.scripts.unpark, self.prefix_of(flow), &[&flow])
            .await
    }

    async fn unpark_one(&self, flow: &str) -> Result<Option<Ulid>, QueueError> {
        let r: Option<String> = self
            .run(&self.scripts.unpark_one, self.prefix_of(flow), &[&flow])
            .await?;
        r.map(|id| Ulid::from_string(&id).map_err(corrupt))
            .transpose()
    }

    async fn clear_flow(&self, flow: &str) -> Result<usize, QueueError> {
        self.run(&self.scripts.clear_flow, self.prefix_of(flow), &[&flow])
            .await
    }

    async fn mark_done(&self, key: DoneKey, outputs: Vec<Vec<Message>>) -> Result<(), QueueError> {
        let p = self.prefix_of(&key.flow);
        let k = keys::done(p, &key.item.to_string());
        let v = serde_json::to_string(&outputs).map_err(corrupt)?;
        let mut c = self.conn.clone();
        redis::pipe()
            .hset(&k, done_field(&key), v)
            .ignore()
            .expire(&k, DONE_TTL_SECS)
            .ignore()
            .query_async::<()>(&mut c)
            .await
            .map_err(unavailable)
    }

    async fn was_done(&self, key: &DoneKey) -> Result<Option<Vec<Vec<Message>>>, QueueError> {
        let p = self.prefix_of(&key.flow);
        let mut c = self.conn.clone();
        let v: Option<String> = c
            .hget(keys::done(p, &key.item.to_string()), done_field(key))
            .await
            .map_err(unavailable)?;
        v.map(|v| serde_json::from_str(&v).map_err(corrupt))
            .transpose()
    }

    async fn post_reply(&self, id: Ulid, reply: Reply) -> Result<(), QueueError> {
        let k = keys::reply(&self.opts.namespace, &id.to_string());
        let v = serde_json::to_string(&reply).map_err(corrupt)?;
        let waiter = self
            .reply_waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned();
        let mut c = self.conn.clone();
        redis::pipe()
            .rpush(&k, v)
            .ignore()
            .expire(&k, REPLY_TTL_SECS)
            .ignore()
            .query_async::<()>(&mut c)
            .await
            .map_err(unavailable)?;
        if waiter.is_none() {
            // No request waits here; it may wait at another engine. Name the reply on the
            // channel, now that the reply is kept (a waiter that hears it finds it), without
            // holding up the wave: only a hint is at stake, and the waiter's poll finds the
            // reply if the publish is lost. Not in the pipeline above: a refused publish (a
            // Redis user without pub/sub rights) would fail the whole post, and a cluster's
            // pipeline stays within one slot, which a channel has none of.
            let channel = keys::replies_posted(&self.opts.namespace);
            tokio::spawn(async move {
                if let Err(e) = c.publish::<_, _, i64>(channel, id.to_string()).await {
                    tracing::debug!(%id, error = %e, "a posted reply was not named on the channel");
                }
            });
        }
        if let Some(w) = waiter {
            // Kept as a permit if the waiter is between two polls.
            w.notify.notify_one();
        }
        Ok(())
    }

    async fn wait_reply(&self, id: Ulid, wait: Duration) -> Result<Option<Reply>, QueueError> {
        // Polled rather than BLPOP: a blocking read would hold a connection per waiter. A
        // reply posted by this engine (the usual case: the engine that journaled the event
        // claims it) wakes the poll at once; one posted by another engine, through the
        // channel of posted replies.
        let k = keys::reply(&self.opts.namespace, &id.to_string());
        let deadline = tokio::time::Instant::now() + wait;
        let (first, most) = self.poll_pauses();
        let mut pause = first;
        let mut c = self.conn.clone();
        let woken = Arc::new(ReplyWake::default());
        let _registered = ReplyWaiter::new(&self.reply_waiters, id, woken.clone());
        // Whether the look below follows a wake-up by the channel of posted replies.
        let mut heard = false;
        loop {
            let v: Option<String> = c.lpop(&k, None).await.map_err(unavailable)?;
            if let Some(v) = v {
                if heard {
                    self.heard.woke.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("weir_redis_replies_heard_total").increment(1);
                }
                return serde_json::from_str(&v).map(Some).map_err(corrupt);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            tokio::select! {
                _ = tokio::time::sleep(pause.min(deadline - now)) => {
                    pause = pause.saturating_mul(2).min(most);
                    heard = false;
                }
                _ = woken.notify.notified() => heard = woken.heard.swap(false, Ordering::AcqRel),
            }
        }
    }

    async fn stats(&self) -> Result<Stats, QueueError> {
        let mut s = Stats {
            durable: true,
            ..Default::default()
        };
        let now = now_ms();
        for p in self.prefixes() {
            let (ready, in_flight, delayed, parked, dead, enq, evicted): (
                i64,
                i64,
                i64,
                i64,
                i64,
                String,
                u64,
            ) = self.run(&self.scripts.stats, p, &[]).await?;
            s.ready += ready.max(0) as usize;
            s.in_flight += in_flight.max(0) as usize;
            s.delayed += delayed.max(0) as usize;
            s.parked += parked.max(0) as usize;
            s.dead += dead.max(0) as usize;
            s.dead_evicted += evicted;
            if let Ok(t) = enq.parse::<i64>() {
                let age = now - t;
                s.oldest_pending_age_ms = Some(s.oldest_pending_age_ms.map_or(age, |a| a.max(age)));
            }
        }
        Ok(s)
    }

    async fn dead_letters(&self, n: usize) -> Result<Vec<ItemView>, QueueError> {
        let mut out = Vec::new();
        let mut c = self.conn.clone();
        for p in self.prefixes() {
            let newest: redis::streams::StreamRangeReply = c
                .xrevrange_count(keys::dead(p), "+", "-", n)
                .await
                .map_err(unavailable)?;
            for e in newest.ids {
                let Some(id) = e.get::<String>("id") else {
                    continue;
                };
                if let Some(v) = self.record(p, &id).await? {
                    out.push(v);
                }
            }
        }
        let at = |v: &ItemView| match v.state {
            ItemState::Dead { at, .. } => at,
            _ => 0,
        };
        // Stable: within a shard the stream's own order (newest first) breaks ties.
        out.sort_by_key(|v| std::cmp::Reverse(at(v)));
        out.truncate(n);
        Ok(out)
    }

    async fn get(&self, id: Ulid) -> Result<Option<ItemView>, QueueError> {
        Ok(self.find(id).await?.map(|(_, v)| v))
    }

    async fn list(&self, f: ListFilter) -> Result<Vec<ItemView>, QueueError> {
        let limit = if f.limit == 0 { 100 } else { f.limit };
        let mut out = Vec::new();
        let mut c = self.conn.clone();
        let shards = match &f.flow {
            Some(flow) => vec![self.prefix_of(flow)],
            None => self.prefixes().iter().map(String::as_str).collect(),
        };
        for p in shards {
            let mut from = f
                .after
                .map(|a| format!("({a}"))
                .unwrap_or_else(|| "-".into());
            let mut taken = 0;
            // Pages of ids in ULID order, filtered, until enough match (bounded).
            for _ in 0..1000 {
                let ids: Vec<String> = c
                    .zrangebylex_limit(keys::index(p), &from, "+", 0, 200)
                    .await
                    .map_err(unavailable)?;
                let Some(last) = ids.last().cloned() else {
                    break;
                };
                for id in &ids {
                    if let Some(v) = self.record(p, id).await? {
                        let flow_ok = f.flow.as_ref().is_none_or(|fl| *fl == v.item.flow);
                        let state_ok = f.state.as_ref().is_none_or(|s| s == v.state.name());
                        if flow_ok && state_ok {
                            out.push(v);
                            taken += 1;
                        }
                    } else {
                        // The record was pruned; drop its id from the index too.
                        let _: () = c.zrem(keys::index(p), id).await.map_err(unavailable)?;
                    }
                    if taken >= limit {
                        break;
                    }
                }
                if taken >= limit {
                    break;
                }
                from = format!("({last}");
            }
        }
        out.sort_by_key(|v| v.item.id);
        out.truncate(limit);
        Ok(out)
    }

    async fn cancel(&self, id: Ulid) -> Result<(), QueueError> {
        self.on_item(&self.scripts.cancel, id, None, |st| match st {
            "in_flight" => {
                QueueError::Conflict(format!("item {id} is in flight; it ends with its wave"))
            }
            "dead" => {
                QueueError::Conflict(format!("item {id} is a dead letter: discard or replay it"))
            }
            _ => QueueError::Conflict(format!("item {id} has finished")),
        })
        .await
    }

    async fn replay(&self, id: Ulid) -> Result<Ulid, QueueError> {
        let Some((_, v)) = self.find(id).await? else {
            return Err(QueueError::NotFound(id));
        };
        let item = v.item.replayed();
        let new_id = item.id;
        let payload = serde_json::to_string(&rec(&item, None)?).map_err(corrupt)?;
        self.on_item(&self.scripts.replay, id, Some(payload), |_| {
            QueueError::Conflict(format!("item {id} is not a dead letter"))
        })
        .await?;
        Ok(new_id)
    }

    async fn discard(&self, id: Ulid) -> Result<(), QueueError> {
        self.on_item(&self.scripts.discard, id, None, |_| {
            QueueError::Conflict(format!("item {id} is not a dead letter"))
        })
        .await
    }
}
