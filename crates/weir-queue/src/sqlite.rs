//! The embedded default: one SQLite file, durable across kill -9 with no server at all.
//!
//! - **One writer.** A thread owns the writing connection. Every change (add, claim, commit,
//!   park…) is a job sent to it; it takes whatever jobs are waiting, runs them in one
//!   transaction, commits with one fsync (`synchronous=FULL`, WAL), and only then answers
//!   every member. A job checks before it writes, so one that fails has written nothing; one
//!   that fails halfway (an I/O error) rolls the whole batch back, every member told. It
//!   never waits on a timer to fill a batch: a lone job commits at once. A failed COMMIT
//!   answers every member with an error, and nothing of the batch is kept.
//! - **Claims wait in the writer.** A claim that finds nothing ready stays with the writer
//!   until its deadline; the next job that makes items ready claims them for it in the same
//!   transaction, so an event reaching an idle engine is journaled and handed out with one
//!   fsync. Delayed items are promoted by the writer itself when they fall due.
//! - **The writer keeps the items in flight** (which it alone puts in flight and takes out):
//!   the reclaim of a stalled claim and the count in `stats` read them there, so no index of
//!   them is written at every claim and commit.
//! - **Readers** (stats, listings, state reads, done markers) use their own connection: WAL
//!   lets them read the last commit while the writer works.
//! - **One engine per file.** `open` takes an exclusive lock on `PATH.lock`; a second engine
//!   on the same file refuses to start. Holding the lock also proves that items left in
//!   flight by an earlier process belong to nobody alive, so they are made ready at once,
//!   with their delivery counts (bumped durably at each claim) kept.
//! - **Schema version** in `PRAGMA user_version`, migrated forward at open; a file written by
//!   a newer weir is refused rather than misread.

use std::any::Any;
use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, Row};
use tokio::sync::oneshot;
use ulid::Ulid;

use crate::replies::Replies;
use crate::{
    now_ms, Claimed, Committed, DoneKey, End, Failpoints, ItemKind, ItemState, ItemView,
    ListFilter, Message, QueueError, Reply, StateError, StateKey, StateRead, Stats, Versioned,
    WaveEffects, WorkItem, WorkQueue, ITEM_VERSION,
};

/// A step of the schema: SQL, or Rust where SQL cannot do it.
enum Step {
    Sql(&'static str),
    Rust(fn(&Connection) -> Result<(), rusqlite::Error>),
}

impl Step {
    fn apply(&self, c: &Connection) -> Result<(), rusqlite::Error> {
        match self {
            Step::Sql(sql) => c.execute_batch(sql),
            Step::Rust(f) => f(c),
        }
    }
}

/// Each step brings the schema from version `i` to `i + 1`.
const MIGRATIONS: &[Step] = &[
    // 1: items, node state, pauses, done markers, idempotency keys.
    Step::Sql("CREATE TABLE items (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, -- never reused, even after deletes
        id TEXT NOT NULL UNIQUE,               -- the item's ULID
        flow TEXT NOT NULL,
        st TEXT NOT NULL,                      -- waiting|in_flight|delayed|parked|dead|finished
        ord INTEGER,                           -- place in the ready order
        due INTEGER,                           -- delayed: not before (ms)
        deliveries INTEGER NOT NULL DEFAULT 0,
        lease INTEGER NOT NULL DEFAULT 0,
        consumer TEXT,
        since INTEGER,
        stepped INTEGER NOT NULL DEFAULT 0,
        reason TEXT,                           -- dead: why; finished: the outcome
        at INTEGER,                            -- when it died or finished
        enqueued_at INTEGER NOT NULL,
        body TEXT NOT NULL                     -- the WorkItem as JSON
    );
    CREATE INDEX items_order ON items (st, ord);
    CREATE INDEX items_at ON items (st, at);
    CREATE INDEX items_flow ON items (flow, st, ord);
    CREATE INDEX items_due ON items (due) WHERE st = 'delayed';
    CREATE TABLE state (
        flow TEXT NOT NULL, node TEXT NOT NULL, key TEXT NOT NULL,
        value TEXT,                            -- JSON; NULL once deleted (the version stays)
        version INTEGER NOT NULL,
        PRIMARY KEY (flow, node, key)
    ) WITHOUT ROWID;
    CREATE TABLE paused (flow TEXT PRIMARY KEY) WITHOUT ROWID;
    CREATE TABLE done (
        item TEXT NOT NULL, node TEXT NOT NULL, position INTEGER NOT NULL,
        outputs TEXT NOT NULL,
        PRIMARY KEY (item, node, position)
    ) WITHOUT ROWID;
    CREATE TABLE idempotency (key TEXT PRIMARY KEY, id TEXT NOT NULL, at INTEGER NOT NULL) WITHOUT ROWID;"),
    // 2: partial indexes, one per state that is looked up, so a state change touches the
    // index of the state it leaves and of the one it enters, not three indexes over every
    // row (an item's add, claim and ack went from 15 index writes to 5).
    Step::Sql("DROP INDEX items_order;
    DROP INDEX items_at;
    DROP INDEX items_flow;
    CREATE INDEX items_ready ON items (ord) WHERE st = 'waiting';
    CREATE INDEX items_claimed ON items (since) WHERE st = 'in_flight';
    CREATE INDEX items_parked ON items (flow, ord) WHERE st = 'parked';
    CREATE INDEX items_dead ON items (at) WHERE st = 'dead';
    CREATE INDEX items_finished ON items (at) WHERE st = 'finished';"),
    // 3: a new item's body holds only what its columns do not (see `Stored`). Nothing to
    // change in the file: bodies written before still read. The version moves so that a
    // weir that knows schema 2 refuses the file instead of reading new bodies as poison.
    Step::Sql(""),
    // 4: `seq` without AUTOINCREMENT, which wrote the largest `seq` to `sqlite_sequence` at
    // every journaled item (about 3 % of the CPU an item in the pipelined queue bench). A
    // new row takes the one after the largest; a `seq` can come back only after the newest
    // row was deleted, and nothing outside a row's own life refers to it (claims carry their
    // lease too, and a row in flight is never deleted). SQLite cannot drop AUTOINCREMENT in
    // place: the table is made again, its rows copied with their `seq`.
    Step::Sql("CREATE TABLE items_4 (
        seq INTEGER PRIMARY KEY,               -- the row; a new one takes the next after the largest
        id TEXT NOT NULL UNIQUE,               -- the item's ULID
        flow TEXT NOT NULL,
        st TEXT NOT NULL,                      -- waiting|in_flight|delayed|parked|dead|finished
        ord INTEGER,                           -- place in the ready order
        due INTEGER,                           -- delayed: not before (ms)
        deliveries INTEGER NOT NULL DEFAULT 0,
        lease INTEGER NOT NULL DEFAULT 0,
        consumer TEXT,
        since INTEGER,
        stepped INTEGER NOT NULL DEFAULT 0,
        reason TEXT,                           -- dead: why; finished: the outcome
        at INTEGER,                            -- when it died or finished
        enqueued_at INTEGER NOT NULL,
        body TEXT NOT NULL                     -- the WorkItem (see `Stored`) as JSON
    );
    INSERT INTO items_4 (seq, id, flow, st, ord, due, deliveries, lease, consumer, since,
                         stepped, reason, at, enqueued_at, body)
        SELECT seq, id, flow, st, ord, due, deliveries, lease, consumer, since,
               stepped, reason, at, enqueued_at, body FROM items;
    DROP TABLE items;
    ALTER TABLE items_4 RENAME TO items;
    DELETE FROM sqlite_sequence WHERE name = 'items';
    CREATE INDEX items_due ON items (due) WHERE st = 'delayed';
    CREATE INDEX items_ready ON items (ord) WHERE st = 'waiting';
    CREATE INDEX items_claimed ON items (since) WHERE st = 'in_flight';
    CREATE INDEX items_parked ON items (flow, ord) WHERE st = 'parked';
    CREATE INDEX items_dead ON items (at) WHERE st = 'dead';
    CREATE INDEX items_finished ON items (at) WHERE st = 'finished';"),
    // 5: no index of the items in flight. The writer makes every change of state (one engine
    // a file), so it keeps them itself (`InFlight`); the index's newest page was written
    // again by nearly every transaction (a page of the 7 an echo's transaction wrote; without
    // it 1.03x the accepted events a second over fourteen pairs, and 2-3 us less of the
    // writer's CPU an event).
    Step::Sql("DROP INDEX items_claimed;"),
    // 6: no index of the finished items either. The writer keeps them in the order they
    // finished (`Finished`), for the trim past `FINISHED_KEPT` and the prune of old outcomes;
    // the index's newest page was written again by every transaction that finished an item
    // (1.2 of the 5.6 pages an echo's transaction wrote).
    Step::Sql("DROP INDEX items_finished;"),
    // 7: no index of ids: a row's `seq` is made from its id's time (`rows_of`), so an id is
    // found among the rows of its millisecond. In Rust: SQLite cannot read a ULID's time.
    Step::Rust(rows_by_id_time),
];

/// Bits of `seq` below an id's millisecond: rows within one millisecond, in the order
/// journaled (1,048,576 at most).
const ROW_BITS: u32 = 20;

/// The rows an item with an id of millisecond `ms` may take: `ms << ROW_BITS` and the
/// 2^20 after it. Ids are found there (a look-up reads the rows of one millisecond, about
/// as many as were journaled in it), and rows are in the order of their ids' times, which
/// is about the order journaled, so new rows go at the end of the table as before.
fn rows_at(ms: u64) -> (i64, i64) {
    // Up to the year 2248; a later time (only a made-up id) shares the last millisecond.
    let lo = (ms.min((1 << (63 - ROW_BITS)) - 1) as i64) << ROW_BITS;
    (lo, lo | ((1 << ROW_BITS) - 1))
}

/// The rows an item with id `id` may take.
fn rows_of(id: Ulid) -> (i64, i64) {
    rows_at(id.timestamp_ms())
}

/// Schema 7's step: the rows copied into a table without the id's `UNIQUE`, each given a
/// `seq` from its id's time, in the order of their ids.
fn rows_by_id_time(c: &Connection) -> Result<(), rusqlite::Error> {
    c.execute_batch(
        "CREATE TABLE items_7 (
            seq INTEGER PRIMARY KEY,               -- the id's time (ms) << 20, then the rows journaled in it
            id TEXT NOT NULL,                      -- the item's ULID (unique: see `new_row`)
            flow TEXT NOT NULL,
            st TEXT NOT NULL,                      -- waiting|in_flight|delayed|parked|dead|finished
            ord INTEGER,                           -- place in the ready order
            due INTEGER,                           -- delayed: not before (ms)
            deliveries INTEGER NOT NULL DEFAULT 0,
            lease INTEGER NOT NULL DEFAULT 0,
            consumer TEXT,
            since INTEGER,
            stepped INTEGER NOT NULL DEFAULT 0,
            reason TEXT,                           -- dead: why; finished: the outcome
            at INTEGER,                            -- when it died or finished
            enqueued_at INTEGER NOT NULL,
            body TEXT NOT NULL                     -- the WorkItem (see `Stored`) as JSON
        );",
    )?;
    {
        let mut rows = c.prepare("SELECT seq, id, enqueued_at FROM items ORDER BY id")?;
        let mut copy = c.prepare(
            "INSERT INTO items_7 (seq, id, flow, st, ord, due, deliveries, lease, consumer,
                                  since, stepped, reason, at, enqueued_at, body)
                SELECT ?2, id, flow, st, ord, due, deliveries, lease, consumer,
                       since, stepped, reason, at, enqueued_at, body FROM items WHERE seq = ?1",
        )?;
        let mut rows = rows.query([])?;
        // The largest row given in each millisecond so far: in id order they come one
        // millisecond after another, but for an id that is no ULID (none is written so),
        // kept at its journaling's time.
        let mut last: std::collections::HashMap<i64, i64> = std::collections::HashMap::new();
        while let Some(r) = rows.next()? {
            let (old, id, enqueued_at): (i64, String, i64) = (r.get(0)?, r.get(1)?, r.get(2)?);
            let (lo, hi) = match Ulid::from_string(&id) {
                Ok(u) => rows_of(u),
                Err(_) => rows_at(enqueued_at.max(0) as u64),
            };
            let seq = match last.get(&lo) {
                None => lo,
                Some(&l) if l < hi => l + 1,
                Some(_) => {
                    return Err(rusqlite::Error::ToSqlConversionFailure(
                        format!("more than 2^{ROW_BITS} items with ids of one millisecond").into(),
                    ))
                }
            };
            copy.execute([old, seq])?;
            last.insert(lo, seq);
        }
    }
    c.execute_batch(
        "DROP TABLE items;
        ALTER TABLE items_7 RENAME TO items;
        CREATE INDEX items_due ON items (due) WHERE st = 'delayed';
        CREATE INDEX items_ready ON items (ord) WHERE st = 'waiting';
        CREATE INDEX items_parked ON items (flow, ord) WHERE st = 'parked';
        CREATE INDEX items_dead ON items (at) WHERE st = 'dead';",
    )
}

/// The schema this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Finished items kept for `get` (the operator's "what became of my event").
const FINISHED_KEPT: i64 = 10_000;
/// Idempotency keys are remembered this long.
const IDEMPOTENCY_KEPT_MS: i64 = 24 * 3600 * 1000;
/// Jobs in one transaction at most: bounds the latency of the first member.
const MAX_BATCH: usize = 1024;
/// Batches between two prunes of old idempotency keys.
const PRUNE_EVERY: u64 = 512;
/// Finished items past `FINISHED_KEPT` are deleted in the transactions that finish more,
/// at most this many at a time (never one long delete that stalls every caller behind it).
/// Each trim rewrites the pages at the old end of the table and of its indexes, whatever
/// it deletes, so fewer, larger trims write less: at 256 (about 0.3 ms of SQL) an echo
/// transaction wrote 0.3-0.6 pages fewer than at 64, for 1.06x the requests a second in
/// seven alternating pairs, with the same p99; at 1,024 the p99 grew by a quarter.
const TRIM_CHUNK: i64 = 256;

const ITEM_COLS: &str =
    "body, deliveries, due, st, consumer, since, reason, at, id, flow, enqueued_at";

impl From<rusqlite::Error> for QueueError {
    fn from(e: rusqlite::Error) -> Self {
        QueueError::Unavailable(format!("sqlite: {e}"))
    }
}

fn json<T: serde::Serialize>(v: &T) -> Result<String, QueueError> {
    serde_json::to_string(v).map_err(|e| QueueError::Corrupt(e.to_string()))
}

fn unjson<T: serde::de::DeserializeOwned>(s: &str) -> Result<T, QueueError> {
    serde_json::from_str(s).map_err(|e| QueueError::Corrupt(e.to_string()))
}

/// An item as this journal keeps it in its row's `body`: only what the row's columns (`id`,
/// `flow`, `deliveries`, `enqueued_at`, `due`) do not already hold, under one-letter names,
/// with the usual values left out. A row is written up to four times (add, claim, commit,
/// delete) and every page it is on is written whole each time, so the row's size is paid
/// four times per item: the whole item as JSON was 230 bytes for a one-field message, this
/// is 50. Rows written before (the whole `WorkItem` as JSON, schema 2) read through the
/// aliases; their extra fields are what the columns hold. Written from a borrowed item (no
/// copy of its messages to encode it), read into owned values.
#[derive(serde::Serialize, serde::Deserialize)]
struct Stored<'a> {
    #[serde(rename = "n", alias = "node")]
    node: Cow<'a, str>,
    #[serde(rename = "o", alias = "outputs")]
    outputs: Cow<'a, [Vec<Message>]>,
    #[serde(rename = "c", alias = "cause")]
    cause: Cow<'a, str>,
    #[serde(
        rename = "k",
        alias = "kind",
        default = "cascade",
        skip_serializing_if = "is_cascade"
    )]
    kind: ItemKind,
    #[serde(
        rename = "a",
        alias = "attempt",
        default,
        skip_serializing_if = "is_zero"
    )]
    attempt: u32,
    /// Left out when it is the row's `enqueued_at` (an item that was not made again).
    #[serde(
        rename = "f",
        alias = "first_enqueued_at",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    first_enqueued_at: Option<i64>,
    #[serde(
        rename = "gk",
        alias = "guard_key",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    guard_key: Option<Cow<'a, str>>,
    #[serde(
        rename = "gv",
        alias = "guard_value",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    guard_value: Option<Cow<'a, serde_json::Value>>,
    #[serde(
        rename = "og",
        alias = "origin_id",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    origin_id: Option<Ulid>,
    #[serde(
        rename = "r",
        alias = "run_id",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    run_id: Option<Cow<'a, str>>,
    #[serde(
        rename = "w",
        alias = "awaited",
        default,
        skip_serializing_if = "std::ops::Not::not"
    )]
    awaited: bool,
}

fn cascade() -> ItemKind {
    ItemKind::Cascade
}

fn is_cascade(k: &ItemKind) -> bool {
    *k == ItemKind::Cascade
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What a row holds of an item besides its `body`.
struct RowCols<'a> {
    id: &'a str,
    flow: String,
    deliveries: u32,
    enqueued_at: i64,
    due: Option<i64>,
}

/// The item a row holds. `Err` is a body (or an id) that cannot be read: a poison row.
fn decode(body: &str, cols: RowCols<'_>) -> Result<WorkItem, String> {
    let s: Stored = serde_json::from_str(body).map_err(|e| e.to_string())?;
    let id = Ulid::from_string(cols.id).map_err(|e| format!("the row's id: {e}"))?;
    Ok(WorkItem {
        version: ITEM_VERSION,
        id,
        kind: s.kind,
        flow: cols.flow,
        node: s.node.into_owned(),
        outputs: s.outputs.into_owned(),
        cause: s.cause.into_owned(),
        not_before: cols.due,
        guard_key: s.guard_key.map(Cow::into_owned),
        guard_value: s.guard_value.map(Cow::into_owned),
        deliveries: cols.deliveries,
        attempt: s.attempt,
        origin_id: s.origin_id,
        enqueued_at: cols.enqueued_at,
        first_enqueued_at: s.first_enqueued_at.unwrap_or(cols.enqueued_at),
        run_id: s.run_id.map(Cow::into_owned),
        awaited: s.awaited,
    })
}

/// An item encoded for the writer by its caller: the JSON is made on the caller's thread, so
/// the one writer thread (every durable write goes through it) only runs SQL.
struct Encoded {
    id: String,
    ulid: Ulid,
    flow: String,
    /// Not before this time; `None` = ready now.
    due: Option<i64>,
    deliveries: u32,
    enqueued_at: i64,
    body: String,
    /// The item itself, when its caller gave it up ([`Encoded::owning`]): handed to a
    /// claimer waiting in the same transaction (`insert_claimed`), it is not decoded again
    /// from `body` (about 5,000 instructions an accepted event). Taken at most once.
    item: std::cell::Cell<Option<WorkItem>>,
}

impl Encoded {
    fn new(item: &WorkItem, now: i64) -> Result<Encoded, QueueError> {
        let WorkItem {
            version: _,
            id,
            kind,
            flow,
            node,
            outputs,
            cause,
            not_before,
            guard_key,
            guard_value,
            deliveries,
            attempt,
            origin_id,
            enqueued_at,
            first_enqueued_at,
            run_id,
            awaited,
        } = item;
        let body = json(&Stored {
            node: Cow::Borrowed(node),
            outputs: Cow::Borrowed(outputs),
            cause: Cow::Borrowed(cause),
            kind: *kind,
            attempt: *attempt,
            first_enqueued_at: (first_enqueued_at != enqueued_at).then_some(*first_enqueued_at),
            guard_key: guard_key.as_deref().map(Cow::Borrowed),
            guard_value: guard_value.as_ref().map(Cow::Borrowed),
            origin_id: *origin_id,
            run_id: run_id.as_deref().map(Cow::Borrowed),
            awaited: *awaited,
        })?;
        Ok(Encoded {
            id: id.to_string(),
            ulid: *id,
            flow: flow.clone(),
            due: not_before.filter(|&t| t > now),
            deliveries: *deliveries,
            enqueued_at: *enqueued_at,
            body,
            item: Default::default(),
        })
    }

    /// `all`, keeping each item to hand on as it is.
    fn owning(items: Vec<WorkItem>) -> Result<Vec<Encoded>, QueueError> {
        let now = now_ms();
        items
            .into_iter()
            .map(|i| {
                let e = Encoded::new(&i, now)?;
                e.item.set(Some(i));
                Ok(e)
            })
            .collect()
    }

    fn all(items: &[WorkItem]) -> Result<Vec<Encoded>, QueueError> {
        let now = now_ms();
        items.iter().map(|i| Encoded::new(i, now)).collect()
    }
}

/// A claimed row as the writer hands it out: decoded into a [`Claimed`] by the claimer.
struct Taken {
    seq: i64,
    lease: u64,
    deliveries: u32,
    stepped: bool,
    body: String,
    id: String,
    flow: String,
    enqueued_at: i64,
    /// The item as its caller journaled it, when the writer had it (`body` is then empty).
    item: Option<WorkItem>,
}

/// What the writer keeps between jobs. Counters only move forward, so a rolled-back job
/// leaves at worst a gap.
struct Writer {
    /// The last place handed out in the ready order.
    ord: i64,
    /// The last lease handed out.
    lease: u64,
    /// Items ready now (kept here so `add` can check the bound without counting rows).
    ready: i64,
    /// A job made items ready: serve the waiting claimers in the same transaction.
    woke: bool,
    /// Claimers that found nothing ready, oldest first, each waiting until its deadline.
    waiters: Vec<Waiter>,
    /// Items (by `seq`) claimed for a claimer that had gone before the answer reached it:
    /// made ready again at the start of the next transaction.
    orphans: Vec<i64>,
    /// Items with done markers (so a commit deletes markers only where there are some).
    /// Never missing one: read from the file at open and again after a rollback.
    marked: std::collections::HashSet<Ulid>,
    /// The earliest `due` of a delayed item as far as the writer knows (never later than
    /// the true one): when it passes, the writer promotes what is due by itself.
    next_due: Option<i64>,
    /// The finished items in the file.
    finished: Finished,
    /// The items in flight.
    flying: InFlight,
    /// The rows of the millisecond last journaled into.
    recent: Recent,
    failpoints: Failpoints,
}

/// The items in flight, kept by the writer, which makes every change of state: no index
/// over the file (schema 5). Every write that puts a row in flight or takes it out says so
/// here; a rolled-back batch reads them from the file again. An item the writer lost track
/// of would only miss a reclaim until the next start (which makes every item in flight
/// ready), never be taken back wrongly: the reclaim's update checks the row's state too.
#[derive(Default)]
struct InFlight {
    /// By row: when it was claimed, and its `enqueued_at` (when it was journaled).
    rows: std::collections::HashMap<i64, (i64, i64), foldhash::fast::RandomState>,
    /// Taken out of flight by the batch under way: still shown until its commit.
    leaving: Vec<(i64, i64)>,
    /// What `stats` reads: an item shown in flight from before its batch's COMMIT to after
    /// the commit that ends its flight, so a reader that finds it no longer waiting (or not
    /// yet finished) finds it here.
    shown: Arc<Mutex<Flying>>,
    changed: bool,
}

/// After a rolled-back batch: what the writer keeps in memory of the file (the ready count,
/// the marked items, the items in flight and the finished ones) read from it again, since
/// the batch had moved it.
fn recount_after_rollback(conn: &Connection, w: &mut Writer) {
    if let Ok(n) = conn.query_row("SELECT count(*) FROM items WHERE st = 'waiting'", [], |r| {
        r.get(0)
    }) {
        w.ready = n;
    }
    if let Ok(m) = marked_items(conn) {
        w.marked = m;
    }
    match w.flying.reload(conn) {
        Ok(()) => w.flying.committed(),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the items in flight after a rollback; those missed come back at the next start")
        }
    }
    w.recent.forget();
    if let Err(e) = w.finished.reload(conn) {
        tracing::warn!(error = %e, "could not read the finished items after a rollback; those missed are kept until the next start");
    }
}

/// The items in flight as `stats` shows them: how many, and the earliest `enqueued_at`.
#[derive(Default, Clone, Copy)]
struct Flying {
    count: usize,
    oldest: Option<i64>,
}

impl InFlight {
    fn claimed(&mut self, seq: i64, since: i64, enqueued_at: i64) {
        self.rows.insert(seq, (since, enqueued_at));
        self.changed = true;
    }

    fn ended(&mut self, seq: i64) {
        if let Some(r) = self.rows.remove(&seq) {
            self.leaving.push(r);
            self.changed = true;
        }
    }

    /// Read them from the file (after a rolled-back batch: they are what it holds).
    fn reload(&mut self, c: &Connection) -> Result<(), rusqlite::Error> {
        self.rows = c
            .prepare("SELECT seq, since, enqueued_at FROM items WHERE st = 'in_flight'")?
            .query_map([], |r| {
                Ok((
                    r.get(0)?,
                    (r.get::<_, Option<i64>>(1)?.unwrap_or(0), r.get(2)?),
                ))
            })?
            .collect::<Result<_, _>>()?;
        self.leaving.clear();
        self.changed = true;
        Ok(())
    }

    /// Before a COMMIT: show the items the batch put in flight, and those it took out still.
    fn committing(&mut self) {
        if self.changed {
            let count = self.rows.len() + self.leaving.len();
            self.show(count, self.rows.values().chain(&self.leaving));
        }
    }

    /// After a COMMIT (or a reload): show what is in flight.
    fn committed(&mut self) {
        if std::mem::take(&mut self.changed) {
            self.leaving.clear();
            self.show(self.rows.len(), self.rows.values());
        }
    }

    fn show<'a>(&self, count: usize, rows: impl Iterator<Item = &'a (i64, i64)>) {
        let now = Flying {
            count,
            oldest: rows.map(|&(_, e)| e).min(),
        };
        *self.shown.lock().unwrap_or_else(|p| p.into_inner()) = now;
    }
}

/// The finished items in the file, kept by the writer in the order they finished (schema 6
/// has no index of them): the trim deletes the oldest past `FINISHED_KEPT`, and a prune
/// those finished before its time, each by row, with no scan of the file. Every write that
/// finishes a row or deletes one says so here; the file is read at open and after a
/// rolled-back batch. A row missed here would only be kept too long; a delete checks the
/// row's state, so one wrongly here deletes nothing.
#[derive(Default)]
struct Finished {
    /// `(at, seq)`: when each finished, and its row; oldest first.
    rows: std::collections::VecDeque<(i64, i64)>,
}

impl Finished {
    fn len(&self) -> i64 {
        self.rows.len() as i64
    }

    fn push(&mut self, at: i64, seq: i64) {
        self.rows.push_back((at, seq));
    }

    /// Read them from the file: at open, and after a rolled-back batch.
    fn reload(&mut self, c: &Connection) -> Result<(), rusqlite::Error> {
        self.rows = c
            .prepare(
                "SELECT coalesce(at, 0) AS t, seq FROM items WHERE st = 'finished' ORDER BY t, seq",
            )?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        Ok(())
    }
}

type ClaimAnswer = Result<Vec<Taken>, QueueError>;

/// A claim that found nothing ready and waits in the writer: the next job that makes items
/// ready claims them for it inside its own transaction, so an item added while an engine is
/// idle is journaled and handed out with one fsync, not two.
struct Waiter {
    consumer: String,
    max: usize,
    deadline: std::time::Instant,
    reply: oneshot::Sender<ClaimAnswer>,
    /// Items journaled in this transaction straight into its claim (`insert_all`): written
    /// once as in flight, where a claim afterwards would read each row back and rewrite it.
    /// Handed out by `serve_waiters` at the end of the same transaction.
    taken: Vec<Taken>,
}

impl Waiter {
    fn has_room(&self) -> bool {
        self.taken.len() < self.max && !self.reply.is_closed()
    }
}

type Answer = Result<Box<dyn Any + Send>, QueueError>;
type Run = Box<dyn FnOnce(&Db<'_>, &mut Writer) -> Answer + Send>;

enum Job {
    Run {
        run: Run,
        reply: oneshot::Sender<Answer>,
    },
    Claim(Waiter),
    /// Journal a row claimed at once for its caller (`add_claimed`).
    /// Boxed: the other jobs, sent many times more often, stay small.
    AddClaimed(Box<AddClaimed>),
}

/// An item to journal claimed for `consumer`, when nothing else is ready.
struct AddClaimed {
    row: Encoded,
    consumer: String,
    /// `add`'s bound on the items ready.
    max_ready: i64,
    reply: oneshot::Sender<AddClaimedAnswer>,
}

/// The item's row and lease when it was journaled claimed; `None` when it was journaled
/// ready instead (something else was ready before it, or it was there already).
type AddClaimedAnswer = Result<Option<(i64, u64)>, QueueError>;

/// What the writer is sent: a job for its next batch, or the order to close.
enum Msg {
    Job(Job),
    /// Stop after the jobs sent before this one: the connection is closed and the lock
    /// released when the writer's thread ends.
    Close,
}

/// An answer held until the transaction it belongs to is durable.
enum Held {
    Run(oneshot::Sender<Answer>, Answer),
    /// Items claimed for `Waiter` (or the error claiming them).
    Claim(Waiter, ClaimAnswer),
    AddClaimed(oneshot::Sender<AddClaimedAnswer>, AddClaimedAnswer),
}

/// The SQLite queue. `SqliteQueue::open("weir-data/queue.db", Failpoints::new())`.
pub struct SqliteQueue {
    jobs: mpsc::Sender<Msg>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Transactions committed by the writer (each is one fsync), for benchmarks and tests.
    batches: Arc<std::sync::atomic::AtomicU64>,
    reader: Arc<Mutex<Connection>>,
    /// The paused flows, as committed (only this engine's writer changes them), so the
    /// check before every wave reads no row.
    paused: std::sync::RwLock<std::collections::HashSet<String>>,
    /// Pause changes one at a time, so the set follows the order of their commits.
    pausing: tokio::sync::Mutex<()>,
    replies: Replies,
    /// The items in flight as of the writer's last commit (it keeps them: `InFlight`).
    in_flight: Arc<Mutex<Flying>>,
    max_ready: i64,
    path: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl SqliteQueue {
    /// Open (or create) the queue at `path`, taking its lock.
    pub fn open(path: impl AsRef<Path>, failpoints: Failpoints) -> Result<Self, QueueError> {
        Self::open_with(path.as_ref(), 100_000, failpoints, None)
    }

    /// A queue in a temporary directory that is removed with it (tests, benchmarks).
    pub fn temporary(failpoints: Failpoints) -> Result<Self, QueueError> {
        let dir = tempfile::tempdir().map_err(|e| QueueError::Open(e.to_string()))?;
        let path = dir.path().join("queue.db");
        Self::open_with(&path, 100_000, failpoints, Some(dir))
    }

    /// `max_ready`: past this many ready items `add` answers `Full`.
    pub fn open_with_limit(
        path: impl AsRef<Path>,
        max_ready: usize,
        failpoints: Failpoints,
    ) -> Result<Self, QueueError> {
        Self::open_with(path.as_ref(), max_ready, failpoints, None)
    }

    fn open_with(
        path: &Path,
        max_ready: usize,
        failpoints: Failpoints,
        tmp: Option<tempfile::TempDir>,
    ) -> Result<Self, QueueError> {
        let shown = path.display();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| QueueError::Open(format!("cannot create {}: {e}", dir.display())))?;
        }
        let lock_path = PathBuf::from(format!("{shown}.lock"));
        let lock = File::create(&lock_path)
            .map_err(|e| QueueError::Open(format!("cannot create {}: {e}", lock_path.display())))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(QueueError::Open(format!(
                    "{shown} is in use by another weir engine (it holds {}); \
                     one engine per queue file, or use the redis backend to share work",
                    lock_path.display()
                )))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(QueueError::Open(format!(
                    "cannot lock {}: {e}",
                    lock_path.display()
                )))
            }
        }
        let open_err = |e: rusqlite::Error| QueueError::Open(format!("{shown}: {e}"));
        let mut conn = Connection::open(path).map_err(open_err)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(open_err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(QueueError::Open(format!(
                "{shown}: the file system does not allow WAL mode (got `{mode}`)"
            )));
        }
        // A checkpoint every 1,000 pages (4 MiB of WAL), SQLite's default: each one a short
        // pause inside a commit. 4,000 was tried: longer pauses (echo p99 4.3-4.7 ms against
        // 3.4-4.2 ms) and, with a longer WAL to search, more CPU per item, not less.
        conn.execute_batch(
            "PRAGMA synchronous=FULL; PRAGMA busy_timeout=5000; PRAGMA wal_autocheckpoint=1000;",
        )
        .map_err(open_err)?;
        // The writer's statements are prepared once each and kept (SQLite's parser cost a
        // transaction's BEGIN and COMMIT about 3,400 instructions together): those of its hot
        // path by the writer itself (`Db`), the others in rusqlite's cache, with room for all
        // of them, so none is prepared again for want of a place.
        conn.set_prepared_statement_cache_capacity(64);
        migrate(&mut conn).map_err(|e| match e {
            QueueError::Unavailable(m) | QueueError::Corrupt(m) => {
                QueueError::Open(format!("{shown}: {m}"))
            }
            other => other,
        })?;
        // We hold the lock: whatever is in flight was left by a process that is gone.
        let orphans = conn
            .execute(
                "UPDATE items SET st = 'waiting', consumer = NULL WHERE st = 'in_flight'",
                [],
            )
            .map_err(open_err)?;
        if orphans > 0 {
            tracing::info!(
                count = orphans,
                "items left in flight by the previous run are ready again"
            );
        }
        let (ord, lease, ready): (i64, i64, i64) = conn
            .query_row(
                "SELECT coalesce(max(ord), 0), coalesce(max(lease), 0),
                        (SELECT count(*) FROM items WHERE st = 'waiting') FROM items",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .map_err(open_err)?;
        let next_due: Option<i64> = conn
            .query_row("SELECT min(due) FROM items WHERE st = 'delayed'", [], |r| {
                r.get(0)
            })
            .map_err(open_err)?;
        let mut finished = Finished::default();
        finished.reload(&conn).map_err(open_err)?;
        let paused: std::collections::HashSet<String> = conn
            .prepare("SELECT flow FROM paused")
            .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
            .map_err(open_err)?;
        let reader = Connection::open(path).map_err(open_err)?;
        reader
            .execute_batch("PRAGMA query_only=1; PRAGMA busy_timeout=5000;")
            .map_err(open_err)?;
        let (tx, rx) = mpsc::channel();
        // Nothing is in flight: the items left so were made ready above.
        let flying = InFlight::default();
        let in_flight = flying.shown.clone();
        let writer = Writer {
            ord,
            lease: lease as u64,
            ready,
            woke: false,
            waiters: Vec::new(),
            orphans: Vec::new(),
            marked: marked_items(&conn).map_err(open_err)?,
            next_due,
            finished,
            flying,
            recent: Recent::default(),
            failpoints,
        };
        let batches = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = batches.clone();
        let handle = std::thread::Builder::new()
            .name("weir-sqlite-writer".into())
            .spawn(move || {
                write_loop(conn, rx, writer, &counted);
                // The lock goes with the writer: released only once its connection is closed.
                drop(lock);
            })
            .map_err(|e| QueueError::Open(format!("cannot start the writer thread: {e}")))?;
        Ok(SqliteQueue {
            jobs: tx,
            writer: Mutex::new(Some(handle)),
            batches,
            reader: Arc::new(Mutex::new(reader)),
            paused: std::sync::RwLock::new(paused),
            pausing: tokio::sync::Mutex::new(()),
            replies: Replies::default(),
            in_flight,
            max_ready: max_ready as i64,
            path: path.to_path_buf(),
            _tmp: tmp,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many transactions the writer has committed so far (one fsync each).
    pub fn batches(&self) -> u64 {
        self.batches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Run `f` on the writer, in the next batch; the answer comes once that batch is durable.
    async fn write<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Db<'_>, &mut Writer) -> Result<R, QueueError> + Send + 'static,
    ) -> Result<R, QueueError> {
        self.write_as(Wait::Other, f).await
    }

    /// `write`, its wait counted as `what`'s.
    async fn write_as<R: Send + 'static>(
        &self,
        what: Wait,
        f: impl FnOnce(&Db<'_>, &mut Writer) -> Result<R, QueueError> + Send + 'static,
    ) -> Result<R, QueueError> {
        let (reply, rx) = oneshot::channel();
        let run: Run = Box::new(move |c, w| f(c, w).map(|r| Box::new(r) as Box<dyn Any + Send>));
        let sent = std::time::Instant::now();
        self.jobs
            .send(Msg::Job(Job::Run { run, reply }))
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        let answer = rx
            .await
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        // How long a journaling or a commit waits for its transaction to be durable: behind
        // the transaction under way, then its own (group commit's price, and a webhook's).
        what.record(sent.elapsed());
        let answer = answer?;
        answer
            .downcast::<R>()
            .map(|b| *b)
            .map_err(|_| QueueError::Corrupt("the writer answered with another type".into()))
    }

    /// Run `f` on the reading connection, off the async threads.
    async fn read_with<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R, QueueError> + Send + 'static,
    ) -> Result<R, QueueError> {
        let reader = self.reader.clone();
        tokio::task::spawn_blocking(move || {
            let c = reader.lock().unwrap_or_else(|p| p.into_inner());
            f(&c)
        })
        .await
        .map_err(|e| QueueError::Unavailable(format!("reader task failed: {e}")))?
    }
}

/// What waited for the writer's durable answer, as `weir_sqlite_wait_seconds` labels it.
#[derive(Clone, Copy)]
enum Wait {
    /// An event journaled (what a webhook's answer waits for).
    Journal,
    /// A wave's commit.
    Commit,
    /// Anything else: the operator's changes, timers, markers.
    Other,
}

impl Wait {
    fn record(self, waited: Duration) {
        let at = match self {
            Wait::Journal => 0,
            Wait::Commit => 1,
            Wait::Other => 2,
        };
        with_metrics(|m| m.waits[at].record(waited.as_secs_f64()));
    }
}

/// The SQLite queue's metrics, as handles. Looking a series up by its name and labels at
/// each use cost about 1,000 instructions (a key built, hashed and searched for in the
/// recorder's registry), twice a request and three times a transaction; a handle records
/// in a few dozen.
struct Metrics {
    /// `weir_sqlite_wait_seconds`: journal, commit, other ([`Wait::record`]).
    waits: [metrics::Histogram; 3],
    transactions: metrics::Counter,
    jobs: metrics::Counter,
    commit: metrics::Histogram,
}

impl Metrics {
    fn new() -> Self {
        let wait =
            |write: &'static str| metrics::histogram!("weir_sqlite_wait_seconds", "write" => write);
        Metrics {
            waits: [wait("journal"), wait("commit"), wait("other")],
            transactions: metrics::counter!("weir_sqlite_transactions_total"),
            jobs: metrics::counter!("weir_sqlite_jobs_total"),
            commit: metrics::histogram!("weir_sqlite_commit_seconds"),
        }
    }
}

thread_local! {
    /// This thread's handles, with the address of the recorder they were made for.
    static METRICS: std::cell::RefCell<Option<(usize, Metrics)>> = const { std::cell::RefCell::new(None) };
}

/// Record through this thread's handles, made again whenever the recorder in force is not
/// the one they were made for: a queue may be opened before its process installs a
/// recorder (handles made then would be the no-op ones for good), and a test may record
/// into a local recorder of its own.
fn with_metrics(f: impl FnOnce(&Metrics)) {
    let recorder =
        metrics::with_recorder(|r| (r as *const dyn metrics::Recorder).cast::<()>() as usize);
    METRICS.with_borrow_mut(|kept| match kept {
        Some((at, m)) if *at == recorder => f(m),
        _ => f(&kept.insert((recorder, Metrics::new())).1),
    });
}

/// Copy the queue at `from` to a new file `to`, consistently, while an engine may be running
/// on it (the copy is one read transaction; the engine's lock is not needed to read).
pub fn backup(from: &Path, to: &Path) -> Result<(), QueueError> {
    if to.exists() {
        return Err(QueueError::Open(format!(
            "{} exists already; a backup does not overwrite",
            to.display()
        )));
    }
    if !from.exists() {
        return Err(QueueError::Open(format!("no queue at {}", from.display())));
    }
    let c = Connection::open_with_flags(
        from,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| QueueError::Open(format!("{}: {e}", from.display())))?;
    c.busy_timeout(Duration::from_secs(5))?;
    c.execute("VACUUM INTO ?1", [to.display().to_string()])
        .map_err(|e| QueueError::Open(format!("backup to {}: {e}", to.display())))?;
    Ok(())
}

impl Drop for SqliteQueue {
    /// Close the writer and wait for it, so the file and its lock are free on return (a
    /// reopen right after, as a restart does, finds them free).
    fn drop(&mut self) {
        let (closed, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.jobs, closed));
        let writer = self.writer.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = writer.take() {
            let _ = h.join();
        }
    }
}

fn migrate(conn: &mut Connection) -> Result<(), QueueError> {
    let have: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if have > SCHEMA_VERSION {
        return Err(QueueError::Open(format!(
            "the queue was written by a newer weir (schema {have}; this build knows up to \
             {SCHEMA_VERSION}); upgrade weir or restore a backup"
        )));
    }
    let started = std::time::Instant::now();
    for (i, step) in MIGRATIONS.iter().enumerate().skip(have as usize) {
        let tx = conn.transaction()?;
        step.apply(&tx)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tx.commit()?;
        tracing::debug!(version = i + 1, "queue schema migrated");
    }
    // A new file is not news; a file an earlier weir wrote is (a step may copy its items).
    if have > 0 && have < SCHEMA_VERSION {
        tracing::info!(
            from = have,
            to = SCHEMA_VERSION,
            took_ms = started.elapsed().as_millis() as u64,
            "queue file upgraded to this weir's schema; an earlier weir can no longer open it"
        );
    }
    Ok(())
}

/// The writer's connection, with the statements of its hot path kept prepared by the
/// address of their text ([`Db::cached`]). rusqlite's own statement cache, which the
/// other statements use, finds one by hashing its whole text, copies the text into a new
/// key at each use, and moves the statement out of its LRU list and back: about 750
/// instructions a use, 4 to 8 uses a request, on the thread every durable write waits for.
struct Db<'c> {
    conn: &'c Connection,
    kept: std::cell::RefCell<Vec<(&'static str, Option<rusqlite::Statement<'c>>)>>,
}

impl<'c> Db<'c> {
    fn new(conn: &'c Connection) -> Self {
        Db {
            conn,
            kept: Default::default(),
        }
    }

    /// The statement for `sql`, prepared at its first use and kept while the writer runs.
    /// `sql` is a constant: it is known by its address. A statement in use already (one
    /// call inside another) is prepared again for the inner call; of the two, the first
    /// given back is kept and the other finalized.
    fn cached(&self, sql: &'static str) -> rusqlite::Result<Kept<'_, 'c>> {
        let stmt = {
            let mut kept = self.kept.borrow_mut();
            match kept.iter_mut().find(|(k, _)| std::ptr::eq(*k, sql)) {
                Some((_, s)) => s.take(),
                None => {
                    kept.push((sql, None));
                    None
                }
            }
        };
        let stmt = match stmt {
            Some(s) => s,
            None => self
                .conn
                .prepare_with_flags(sql, rusqlite::PrepFlags::SQLITE_PREPARE_PERSISTENT)?,
        };
        Ok(Kept {
            db: self,
            sql,
            stmt: Some(stmt),
        })
    }

    /// Run one of the writer's statements that return no rows (BEGIN, COMMIT, ROLLBACK).
    fn run(&self, sql: &'static str) -> rusqlite::Result<()> {
        self.cached(sql)?.execute([]).map(drop)
    }
}

impl std::ops::Deref for Db<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// A statement of [`Db::cached`], given back to it when dropped. rusqlite resets a
/// statement after each `execute` and when the rows of a query are dropped, and every use
/// binds all its parameters: nothing of one use is left for the next.
struct Kept<'d, 'c> {
    db: &'d Db<'c>,
    sql: &'static str,
    stmt: Option<rusqlite::Statement<'c>>,
}

impl<'c> std::ops::Deref for Kept<'_, 'c> {
    type Target = rusqlite::Statement<'c>;

    fn deref(&self) -> &Self::Target {
        self.stmt.as_ref().expect("a kept statement until dropped")
    }
}

impl std::ops::DerefMut for Kept<'_, '_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.stmt.as_mut().expect("a kept statement until dropped")
    }
}

impl Drop for Kept<'_, '_> {
    fn drop(&mut self) {
        let mut kept = self.db.kept.borrow_mut();
        if let Some((_, slot @ None)) = kept.iter_mut().find(|(k, _)| std::ptr::eq(*k, self.sql)) {
            *slot = self.stmt.take();
        }
    }
}

fn write_loop(
    owned: Connection,
    rx: mpsc::Receiver<Msg>,
    mut w: Writer,
    counter: &std::sync::atomic::AtomicU64,
) {
    // Dropped before the connection it borrows, its statements with it.
    let conn = Db::new(&owned);
    let mut batches: u64 = 0;
    let mut closing = false;
    while !closing {
        expire_waiters(&mut w);
        // Wake for the first job, a waiting claim's deadline, or a delayed item falling due.
        let due_in = w
            .next_due
            .map(|d| Duration::from_millis((d - now_ms()).max(0) as u64));
        let now = std::time::Instant::now();
        let wake = w
            .waiters
            .iter()
            .map(|x| x.deadline.saturating_duration_since(now))
            .chain(due_in)
            .min();
        let first = match wake {
            None => match rx.recv() {
                Ok(j) => Some(j),
                Err(_) => break,
            },
            Some(d) => match rx.recv_timeout(d) {
                Ok(j) => Some(j),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            },
        };
        let due = w.next_due.is_some_and(|d| d <= now_ms());
        let mut batch: Vec<Job> = Vec::new();
        closing = gather(&rx, first, &mut batch, MAX_BATCH);
        let mut taken = batch.len();
        if batch.is_empty() && !due {
            continue;
        }
        if let Err(e) = conn.run("BEGIN IMMEDIATE") {
            let e = QueueError::from(e).to_string();
            for j in batch {
                match j {
                    Job::Run { reply, .. } => {
                        let _ = reply.send(Err(QueueError::Unavailable(e.clone())));
                    }
                    Job::Claim(x) => {
                        let _ = x.reply.send(Err(QueueError::Unavailable(e.clone())));
                    }
                    Job::AddClaimed(x) => {
                        let _ = x.reply.send(Err(QueueError::Unavailable(e.clone())));
                    }
                }
            }
            continue;
        }
        let mut held = Vec::with_capacity(batch.len());
        // A job that fails after writing poisons the batch: all of it is rolled back.
        let mut poison: Option<String> = None;
        if !w.orphans.is_empty() {
            let orphans = std::mem::take(&mut w.orphans);
            if let Err(e) = guarded(&conn, &mut poison, || ready_again(&conn, &mut w, &orphans)) {
                tracing::warn!(error = %e, "could not make ready again the items of a claimer that had gone; they come back at the next start");
            }
        }
        if due {
            if let Err(e) = guarded(&conn, &mut poison, || promote_due(&conn, &mut w)) {
                tracing::warn!(error = %e, "could not make due items ready; trying again");
            }
        }
        // Jobs sent while the batch's SQL runs join it, before its COMMIT: otherwise each would
        // wait for this whole transaction and then for its own.
        while !batch.is_empty() {
            for j in batch.drain(..) {
                match j {
                    Job::Run { run, reply } => {
                        let a = guarded(&conn, &mut poison, || run(&conn, &mut w));
                        held.push(Held::Run(reply, a));
                    }
                    Job::AddClaimed(x) => {
                        let a = guarded(&conn, &mut poison, || add_claimed(&conn, &mut w, &x));
                        held.push(Held::AddClaimed(x.reply, a));
                    }
                    // Older claims are waiting: this one waits behind them. What this batch made
                    // ready goes to the oldest first (`serve_waiters` below), so a claim made
                    // later never takes an item ahead of one made earlier, and the executor,
                    // which starts each claim's items in the order it made the claims, starts
                    // them in journal order. (Items ready with claims waiting, after a batch
                    // was rolled back: served now as well.)
                    Job::Claim(x) if !w.waiters.is_empty() => {
                        w.woke |= w.ready > 0;
                        w.waiters.push(x);
                    }
                    Job::Claim(x) => {
                        let got = guarded(&conn, &mut poison, || {
                            claim_ready(&conn, &mut w, &x.consumer, x.max)
                        });
                        match got {
                            Ok(items)
                                if items.is_empty() && x.deadline > std::time::Instant::now() =>
                            {
                                w.waiters.push(x)
                            }
                            got => held.push(Held::Claim(x, got)),
                        }
                    }
                }
            }
            if !closing && taken < MAX_BATCH {
                closing = gather(&rx, None, &mut batch, MAX_BATCH - taken);
                taken += batch.len();
            }
        }
        // Items became ready in this transaction: hand them to the claimers waiting for
        // work, oldest first, in the same transaction.
        if w.woke {
            serve_waiters(&conn, &mut w, &mut held, &mut poison);
        }
        if w.finished.len() > FINISHED_KEPT {
            if let Err(e) = guarded(&conn, &mut poison, || trim_finished(&conn, &mut w)) {
                tracing::warn!(error = %e, "could not delete the oldest finished items");
            }
        }
        let members = held.len();
        w.flying.committing();
        let commit_started = std::time::Instant::now();
        let committed = if let Some(e) = poison {
            Err(QueueError::Unavailable(format!(
                "the batch was rolled back: one of its members failed halfway ({e})"
            )))
        } else if w.failpoints.hit("sqlite-batch") {
            Err(QueueError::Unavailable(
                "failpoint `sqlite-batch` fired".into(),
            ))
        } else {
            conn.run("COMMIT").map_err(QueueError::from)
        };
        let fsynced = commit_started.elapsed();
        match committed {
            Ok(()) => {
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                w.flying.committed();
                for h in held {
                    match h {
                        Held::Run(reply, a) => {
                            let _ = reply.send(a);
                        }
                        Held::Claim(x, got) => {
                            if let Err(Ok(items)) = x.reply.send(got) {
                                w.orphans.extend(items.iter().map(|t| t.seq));
                            }
                        }
                        // The caller gave up waiting (a webhook's client went away): nobody
                        // will run the item, so it is made ready again for the executor.
                        Held::AddClaimed(reply, got) => {
                            if let Err(Ok(Some((seq, _)))) = reply.send(got) {
                                w.orphans.push(seq);
                            }
                        }
                    }
                }
            }
            Err(e) => {
                let _ = conn.run("ROLLBACK");
                // Counted again before anyone is told, so no caller who heard of the failure
                // reads counts (in flight, ready) that the rolled-back batch had moved.
                recount_after_rollback(&conn, &mut w);
                tracing::error!(error = %e, members = held.len(), "queue commit failed; every member of the batch is told");
                for h in held {
                    match h {
                        Held::Run(reply, _) => {
                            let _ = reply.send(Err(QueueError::Unavailable(e.to_string())));
                        }
                        // Nothing was claimed after all: the claimer goes on waiting.
                        Held::Claim(x, _) => w.waiters.push(x),
                        Held::AddClaimed(reply, _) => {
                            let _ = reply.send(Err(QueueError::Unavailable(e.to_string())));
                        }
                    }
                }
            }
        }
        // What group commit achieves, for the operator and the benchmarks.
        with_metrics(|m| {
            m.transactions.increment(1);
            m.jobs.increment(members as u64);
            m.commit.record(fsynced.as_secs_f64());
        });
        w.woke = false;
        batches += 1;
        if batches.is_multiple_of(PRUNE_EVERY) {
            if let Err(e) = prune(&conn) {
                tracing::warn!(error = %e, "could not prune old idempotency keys");
            }
        }
    }
    // The queue is closing: the claimers still waiting hear so from their dropped answers,
    // and so do the jobs sent after the close (dropped with `rx`).
}

/// Take `first` and whatever else has been sent into `batch`, until it holds `room` jobs;
/// `true` when the writer was told to close (nothing sent after that is taken).
fn gather(rx: &mpsc::Receiver<Msg>, first: Option<Msg>, batch: &mut Vec<Job>, room: usize) -> bool {
    let mut next = first;
    loop {
        match next {
            Some(Msg::Close) => return true,
            Some(Msg::Job(j)) => batch.push(j),
            None => {}
        }
        if batch.len() >= room {
            return false;
        }
        match rx.try_recv() {
            Ok(m) => next = Some(m),
            Err(_) => return false,
        }
    }
}

/// Run one job of the batch. A job that fails must have written nothing (every job checks
/// before it writes); one that fails after writing (an I/O error halfway) poisons the batch,
/// and the whole transaction is rolled back with every member told. No savepoint per job:
/// they cost a copy of every page a job touches, and a failure halfway is rare.
fn guarded<R>(
    conn: &Connection,
    poison: &mut Option<String>,
    f: impl FnOnce() -> Result<R, QueueError>,
) -> Result<R, QueueError> {
    if let Some(e) = poison {
        return Err(QueueError::Unavailable(format!(
            "not run: the batch is being rolled back ({e})"
        )));
    }
    let before = conn.total_changes();
    let a = f();
    if let Err(e) = &a {
        if conn.total_changes() != before {
            *poison = Some(e.to_string());
        }
    }
    a
}

/// The items that have done markers.
fn marked_items(c: &Connection) -> Result<std::collections::HashSet<Ulid>, rusqlite::Error> {
    let ids: Vec<String> = c
        .prepare_cached("SELECT DISTINCT item FROM done")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(ids
        .iter()
        .filter_map(|i| Ulid::from_string(i).ok())
        .collect())
}

/// Make the delayed items due now ready, and look up when the next one is due.
fn promote_due(c: &Connection, w: &mut Writer) -> Result<(), QueueError> {
    make_ready(
        c,
        w,
        "SELECT seq FROM items WHERE st = 'delayed' AND due <= ?1 ORDER BY due, seq",
        [now_ms()],
    )?;
    w.next_due = c
        .prepare_cached("SELECT min(due) FROM items WHERE st = 'delayed'")?
        .query_row([], |r| r.get(0))?;
    Ok(())
}

/// Answer the claimers whose wait is over (nothing came) or who have gone.
fn expire_waiters(w: &mut Writer) {
    let now = std::time::Instant::now();
    let mut i = 0;
    while i < w.waiters.len() {
        if w.waiters[i].reply.is_closed() {
            w.waiters.remove(i);
        } else if w.waiters[i].deadline <= now {
            let x = w.waiters.remove(i);
            let _ = x.reply.send(Ok(Vec::new()));
        } else {
            i += 1;
        }
    }
}

/// Answer the waiting claimers that were given items in this transaction (`insert_all`),
/// and claim what is ready for them, oldest claimer first, until nothing is left.
fn serve_waiters(conn: &Db<'_>, w: &mut Writer, held: &mut Vec<Held>, poison: &mut Option<String>) {
    let waiting = std::mem::take(&mut w.waiters);
    let mut rest = Vec::new();
    let mut dry = false;
    for mut x in waiting {
        let mut taken = std::mem::take(&mut x.taken);
        // Answered even when the claimer has gone: its items become orphans, ready again.
        if !taken.is_empty() && (taken.len() >= x.max || x.reply.is_closed() || dry) {
            held.push(Held::Claim(x, Ok(taken)));
            continue;
        }
        if dry || x.reply.is_closed() {
            if !x.reply.is_closed() {
                rest.push(x);
            }
            continue;
        }
        let room = x.max - taken.len();
        let got = guarded(conn, poison, || claim_ready(conn, w, &x.consumer, room));
        match got {
            Ok(items) if items.is_empty() && taken.is_empty() => {
                dry = true;
                rest.push(x);
            }
            Ok(items) => {
                dry = items.len() < room;
                taken.extend(items);
                held.push(Held::Claim(x, Ok(taken)));
            }
            Err(e) if taken.is_empty() => held.push(Held::Claim(x, Err(e))),
            // It could not be given more: it is answered with what it was given, which
            // would otherwise stay in flight. (If the batch is rolled back, the claimer
            // waits on: nothing was claimed.)
            Err(_) => held.push(Held::Claim(x, Ok(taken))),
        }
    }
    w.waiters = rest;
}

/// Make ready again the items in flight at `seqs` (claimed for a claimer that was gone, or
/// taken back from a stalled one; their deliveries stay counted); how many there were.
fn ready_again(c: &Connection, w: &mut Writer, seqs: &[i64]) -> Result<usize, QueueError> {
    let mut up = c.prepare_cached(
        "UPDATE items SET st = 'waiting', consumer = NULL WHERE seq = ?1 AND st = 'in_flight'",
    )?;
    let mut n = 0;
    for seq in seqs {
        // Out of flight either way: a row that was not in flight was not the writer's to count.
        w.flying.ended(*seq);
        if up.execute([seq])? > 0 {
            w.ready += 1;
            w.woke = true;
            n += 1;
        }
    }
    Ok(n)
}

/// Delete the finished row `seq` (one the writer keeps in `Finished`).
const DELETE_FINISHED_SQL: &str = "DELETE FROM items WHERE seq = ?1 AND st = 'finished'";

/// Delete the oldest finished items past the newest `FINISHED_KEPT`, inside the writer's
/// transaction: the items a batch finishes are matched by about as many deletes in the same
/// batch, in chunks, so the cost is spread evenly instead of one long delete now and then.
fn trim_finished(c: &Db<'_>, w: &mut Writer) -> Result<(), QueueError> {
    let mut del = c.cached(DELETE_FINISHED_SQL)?;
    // At most two chunks a batch: a backlog (a file opened with many more) goes down
    // over the next batches.
    for _ in 0..2 {
        if w.finished.len() <= FINISHED_KEPT {
            break;
        }
        w.recent.forget();
        for _ in 0..TRIM_CHUNK {
            let Some((_, seq)) = w.finished.rows.pop_front() else {
                break;
            };
            del.execute([seq])?;
        }
    }
    Ok(())
}

/// Drop idempotency keys past their day.
fn prune(conn: &Connection) -> Result<(), rusqlite::Error> {
    conn.execute(
        "DELETE FROM idempotency WHERE at < ?1",
        [now_ms() - IDEMPOTENCY_KEPT_MS],
    )?;
    Ok(())
}

// ---- the writer's operations: plain functions over a connection inside a transaction ----

fn insert(c: &Db<'_>, w: &mut Writer, row: &Encoded) -> Result<(), QueueError> {
    insert_all(c, w, std::slice::from_ref(row))
}

/// Journal `rows` with prepared statements taken from the writer's kept ones once per batch,
/// not per row.
///
/// A row ready now, with nothing else ready and a claimer waiting with room, is journaled
/// already claimed for it: one write of the row, not an insert, then a read and a rewrite
/// of the whole row by `claim_ready`. It is what that claim would have taken, in the same
/// order: nothing else was ready, the oldest claimer with room gets it, and once one row
/// has gone to the ready order the rest follow it there.
fn insert_all(c: &Db<'_>, w: &mut Writer, rows: &[Encoded]) -> Result<(), QueueError> {
    let mut ins = c.cached(
        "INSERT INTO items (seq, id, flow, st, ord, due, deliveries, enqueued_at, body)
         VALUES (?9, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    let mut ins_claimed = None;
    for row in rows {
        // An id seen before is the same item added again (a retried add): keep the first.
        let Some(seq) = new_row(c, &mut w.recent, row)? else {
            continue;
        };
        let (st, ord) = match row.due {
            Some(t) => {
                w.next_due = Some(w.next_due.map_or(t, |d| d.min(t)));
                ("delayed", None)
            }
            None => {
                w.ord += 1;
                if w.ready == 0 {
                    if let Some(x) = w.waiters.iter().position(Waiter::has_room) {
                        let ins = match &mut ins_claimed {
                            Some(s) => s,
                            None => ins_claimed.insert(c.cached(INSERT_CLAIMED_SQL)?),
                        };
                        insert_claimed(ins, seq, w, x, row)?;
                        continue;
                    }
                }
                ("waiting", Some(w.ord))
            }
        };
        ins.execute(params![
            row.id,
            row.flow,
            st,
            ord,
            row.due,
            row.deliveries,
            row.enqueued_at,
            row.body,
            seq
        ])?;
        w.recent.wrote(seq, row.ulid);
        if st == "waiting" {
            w.ready += 1;
            w.woke = true;
        }
    }
    Ok(())
}

/// The row a new item takes (`rows_of` its id): the one after the largest of its id's
/// millisecond. `None` when the id was journaled before (an add retried after its answer
/// was lost): the first is kept.
fn new_row(c: &Db<'_>, recent: &mut Recent, row: &Encoded) -> Result<Option<i64>, QueueError> {
    let (lo, hi) = rows_of(row.ulid);
    if recent.lo != Some(lo) {
        recent.read(c, lo, hi)?;
    }
    if recent.ids.contains(&row.ulid) {
        return Ok(None);
    }
    match recent.last {
        None => Ok(Some(lo)),
        Some(l) if l < hi => Ok(Some(l + 1)),
        _ => Err(QueueError::Unavailable(format!(
            "more than 2^{ROW_BITS} items with ids of one millisecond"
        ))),
    }
}

/// The rows of the millisecond the writer last journaled into, as the file holds them
/// (schema 7): a new item of that millisecond, the common case since items are journaled as
/// they are made, takes its row and is checked against the ids there without reading them
/// again (a batch of hundreds made in one millisecond would read the ones before it each
/// time). Read from the file when another millisecond comes; told of each row written only
/// once its insert succeeded; forgotten after a rolled-back batch and after any delete.
#[derive(Default)]
struct Recent {
    /// The millisecond's first row.
    lo: Option<i64>,
    /// Its largest row.
    last: Option<i64>,
    ids: std::collections::HashSet<Ulid>,
}

impl Recent {
    fn read(&mut self, c: &Db<'_>, lo: i64, hi: i64) -> Result<(), rusqlite::Error> {
        self.lo = None;
        self.last = None;
        self.ids.clear();
        let mut q = c.cached("SELECT seq, id FROM items WHERE seq BETWEEN ?1 AND ?2")?;
        let mut rows = q.query([lo, hi])?;
        while let Some(r) = rows.next()? {
            let seq: i64 = r.get(0)?;
            self.last = Some(self.last.map_or(seq, |l| l.max(seq)));
            // An id that is no ULID (none is written so) cannot be added again either.
            if let Ok(id) = Ulid::from_string(r.get_ref(1)?.as_str().unwrap_or_default()) {
                self.ids.insert(id);
            }
        }
        self.lo = Some(lo);
        Ok(())
    }

    /// The row `seq` was written for `id`.
    fn wrote(&mut self, seq: i64, id: Ulid) {
        if self.lo == Some(seq & !((1 << ROW_BITS) - 1)) {
            self.last = Some(self.last.map_or(seq, |l| l.max(seq)));
            self.ids.insert(id);
        }
    }

    fn forget(&mut self) {
        self.lo = None;
    }
}

/// The condition that finds the item with an id among its millisecond's rows, with
/// `by_id`'s parameters.
const BY_ID: &str = "seq BETWEEN ?1 AND ?2 AND id = ?3";

/// The parameters of `BY_ID` for `id`.
fn by_id(id: Ulid) -> (i64, i64, String) {
    let (lo, hi) = rows_of(id);
    (lo, hi, id.to_string())
}

/// The row of the item `id`, if it is journaled.
fn row_of(c: &Connection, id: Ulid) -> Result<Option<i64>, rusqlite::Error> {
    c.prepare_cached(&format!("SELECT seq FROM items WHERE {BY_ID}"))?
        .query_row(by_id(id), |r| r.get(0))
        .optional()
}

/// A new row already in flight (`insert_claimed`).
const INSERT_CLAIMED_SQL: &str = "INSERT INTO items
        (seq, id, flow, st, ord, deliveries, enqueued_at, body, lease, consumer, since)
    VALUES (?10, ?1, ?2, 'in_flight', ?3, ?4, ?5, ?6, ?7, ?8, ?9)";

/// Journal `row` in flight at `seq` (with `ins`, `INSERT_CLAIMED_SQL`), claimed for the
/// waiting claimer `w.waiters[x]`.
fn insert_claimed(
    ins: &mut rusqlite::Statement<'_>,
    seq: i64,
    w: &mut Writer,
    x: usize,
    row: &Encoded,
) -> Result<(), QueueError> {
    let lease = w.lease + 1;
    let deliveries = row.deliveries + 1;
    write_in_flight(
        ins,
        seq,
        (&mut w.flying, &mut w.recent),
        row,
        w.ord,
        lease,
        &w.waiters[x].consumer,
    )?;
    w.lease = lease;
    w.woke = true;
    let item = row.item.take();
    w.waiters[x].taken.push(Taken {
        seq,
        lease,
        deliveries,
        stepped: false,
        body: match item {
            Some(_) => String::new(),
            None => row.body.clone(),
        },
        id: row.id.clone(),
        flow: row.flow.clone(),
        enqueued_at: row.enqueued_at,
        item,
    });
    Ok(())
}

/// The answer to an `add_claimed` on its way. Dropped before it is received (the caller's
/// future dropped: a webhook's client went away), an item it claimed is made ready again,
/// as the writer does when the answer cannot be sent at all: nobody else would run it
/// before the reclaim delay.
struct Unreceived {
    rx: Option<oneshot::Receiver<AddClaimedAnswer>>,
    jobs: mpsc::Sender<Msg>,
}

impl Unreceived {
    async fn receive(&mut self) -> Result<AddClaimedAnswer, oneshot::error::RecvError> {
        let rx = self.rx.as_mut().expect("received once");
        let got = rx.await;
        self.rx = None;
        got
    }
}

impl Drop for Unreceived {
    fn drop(&mut self) {
        let Some(Ok(Ok(Some((seq, _))))) = self.rx.take().map(|mut rx| rx.try_recv()) else {
            return;
        };
        let (reply, _) = oneshot::channel();
        let run: Run = Box::new(move |c, w| {
            ready_again(c, w, &[seq])?;
            Ok(Box::new(()) as Box<dyn Any + Send>)
        });
        // A writer that has stopped leaves it in flight: the next start takes it back.
        let _ = self.jobs.send(Msg::Job(Job::Run { run, reply }));
    }
}

/// Journal `x.row` in flight for `x.consumer` when nothing else is ready, so it passes
/// nothing in the ready order; otherwise journal it ready, as `add` does.
fn add_claimed(c: &Db<'_>, w: &mut Writer, x: &AddClaimed) -> AddClaimedAnswer {
    if w.ready >= x.max_ready {
        return Err(QueueError::Full(w.ready.max(0) as usize));
    }
    let row = &x.row;
    if w.ready != 0 || row.due.is_some() {
        insert_all(c, w, std::slice::from_ref(row))?;
        return Ok(None);
    }
    let Some(seq) = new_row(c, &mut w.recent, row)? else {
        // The same id journaled before (a retried add): that copy goes its own way.
        return Ok(None);
    };
    w.ord += 1;
    let lease = w.lease + 1;
    let mut ins = c.cached(INSERT_CLAIMED_SQL)?;
    let to = (&mut w.flying, &mut w.recent);
    write_in_flight(&mut ins, seq, to, row, w.ord, lease, &x.consumer)?;
    w.lease = lease;
    Ok(Some((seq, lease)))
}

/// Write `row` in flight at `seq` for `consumer` under `lease`, its delivery counted, with
/// `ins` (`INSERT_CLAIMED_SQL`), and count it in `flying` and `recent`.
fn write_in_flight(
    ins: &mut rusqlite::Statement<'_>,
    seq: i64,
    (flying, recent): (&mut InFlight, &mut Recent),
    row: &Encoded,
    ord: i64,
    lease: u64,
    consumer: &str,
) -> Result<(), QueueError> {
    let since = now_ms();
    ins.execute(params![
        row.id,
        row.flow,
        ord,
        row.deliveries + 1,
        row.enqueued_at,
        row.body,
        lease as i64,
        consumer,
        since,
        seq
    ])?;
    recent.wrote(seq, row.ulid);
    flying.claimed(seq, since, row.enqueued_at);
    Ok(())
}

fn insert_dead(
    c: &Db<'_>,
    w: &mut Writer,
    row: &Encoded,
    reason: &str,
    now: i64,
) -> Result<(), QueueError> {
    let Some(seq) = new_row(c, &mut w.recent, row)? else {
        return Ok(());
    };
    c.prepare_cached(
        "INSERT INTO items (seq, id, flow, st, deliveries, reason, at, enqueued_at, body)
         VALUES (?8, ?1, ?2, 'dead', ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        row.id,
        row.flow,
        row.deliveries,
        reason,
        now,
        row.enqueued_at,
        row.body,
        seq
    ])?;
    w.recent.wrote(seq, row.ulid);
    Ok(())
}

/// An item row (selected with `ITEM_COLS`) as the operator sees it.
fn view(r: &Row<'_>) -> rusqlite::Result<Result<ItemView, QueueError>> {
    let body: String = r.get(0)?;
    let deliveries: u32 = r.get(1)?;
    let due: Option<i64> = r.get(2)?;
    let st: String = r.get(3)?;
    let consumer: Option<String> = r.get(4)?;
    let since: Option<i64> = r.get(5)?;
    let reason: Option<String> = r.get(6)?;
    let at: Option<i64> = r.get(7)?;
    let id: String = r.get(8)?;
    let flow: String = r.get(9)?;
    let enqueued_at: i64 = r.get(10)?;
    let cols = RowCols {
        id: &id,
        flow: flow.clone(),
        deliveries,
        enqueued_at,
        due,
    };
    // A body that cannot be decoded is still shown (it is a dead letter by now).
    let decoded = decode(&body, cols).or_else(|_| {
        Ulid::from_string(&id)
            .map(|id| WorkItem::undecodable(id, &flow, &body))
            .map_err(|e| QueueError::Corrupt(e.to_string()))
    });
    Ok(decoded.and_then(|item| {
        let state = match st.as_str() {
            "waiting" => ItemState::Waiting,
            "in_flight" => ItemState::InFlight {
                consumer: consumer.unwrap_or_default(),
                since: since.unwrap_or(0),
            },
            "delayed" => ItemState::Delayed {
                due: due.unwrap_or(0),
            },
            "parked" => ItemState::Parked,
            "dead" => ItemState::Dead {
                reason: reason.unwrap_or_default(),
                at: at.unwrap_or(0),
            },
            "finished" => ItemState::Finished {
                outcome: reason.unwrap_or_default(),
                at: at.unwrap_or(0),
            },
            other => return Err(QueueError::Corrupt(format!("unknown item state `{other}`"))),
        };
        Ok(ItemView { item, state })
    }))
}

fn get_view(c: &Connection, id: Ulid) -> Result<Option<ItemView>, QueueError> {
    c.prepare_cached(&format!("SELECT {ITEM_COLS} FROM items WHERE {BY_ID}"))?
        .query_row(by_id(id), view)
        .optional()?
        .transpose()
}

fn read_state(c: &Connection, key: &StateKey) -> Result<Versioned, QueueError> {
    let row: Option<(Option<String>, i64)> = c
        .prepare_cached(
            "SELECT value, version FROM state WHERE flow = ?1 AND node = ?2 AND key = ?3",
        )?
        .query_row(params![key.flow, key.node, key.key], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    Ok(match row {
        None => Versioned::default(),
        Some((value, version)) => Versioned {
            value: value.as_deref().map(unjson).transpose()?,
            version: version as u64,
        },
    })
}

fn write_state(
    c: &Connection,
    key: &StateKey,
    value: Option<&serde_json::Value>,
) -> Result<(), QueueError> {
    let value = value.map(json).transpose()?;
    c.prepare_cached(
        "INSERT INTO state (flow, node, key, value, version) VALUES (?1, ?2, ?3, ?4, 1)
         ON CONFLICT (flow, node, key) DO UPDATE SET value = excluded.value, version = version + 1",
    )?
    .execute(params![key.flow, key.node, key.key, value])?;
    Ok(())
}

fn item_state(c: &Connection, id: Ulid) -> Result<Option<String>, QueueError> {
    Ok(
        c.prepare_cached(&format!("SELECT st FROM items WHERE {BY_ID}"))?
            .query_row(by_id(id), |r| r.get(0))
            .optional()?,
    )
}

/// End `id` as finished with `outcome`, and count it among the finished items kept.
fn finish(
    c: &Connection,
    w: &mut Writer,
    id: Ulid,
    outcome: &str,
    now: i64,
) -> Result<(), QueueError> {
    match row_of(c, id)? {
        Some(seq) => finish_row(c, w, seq, outcome, now),
        None => Ok(()),
    }
}

/// End the row `seq` as finished with `outcome`, and count it among the finished items kept.
fn finish_row(
    c: &Connection,
    w: &mut Writer,
    seq: i64,
    outcome: &str,
    now: i64,
) -> Result<(), QueueError> {
    c.prepare_cached(
        "UPDATE items SET st = 'finished', reason = ?2, at = ?3, due = NULL, consumer = NULL,
                          stepped = 0
         WHERE seq = ?1",
    )?
    .execute(params![seq, outcome, now])?;
    w.finished.push(now, seq);
    Ok(())
}

/// A wave's new items, encoded by the committer: its follow-ups and delayed items, and its
/// dead children with their reasons.
struct NewRows {
    items: Vec<Encoded>,
    dead: Vec<(Encoded, String)>,
}

impl NewRows {
    /// Takes the wave's items out of `fx`.
    fn take(fx: &mut WaveEffects) -> Result<NewRows, QueueError> {
        let mut items = Encoded::owning(std::mem::take(&mut fx.follow_ups))?;
        items.extend(Encoded::all(&std::mem::take(&mut fx.delayed))?);
        let now = now_ms();
        let dead = std::mem::take(&mut fx.dead)
            .into_iter()
            .map(|(item, why)| Ok((Encoded::new(&item, now)?, why)))
            .collect::<Result<_, QueueError>>()?;
        Ok(NewRows { items, dead })
    }
}

/// The commit of a wave that writes nothing but its end: ?1 the row, ?2 the lease, ?3 the
/// outcome, ?4 now.
const COMMIT_PLAIN_SQL: &str = "UPDATE items SET st = 'finished', reason = ?3, at = ?4,
        due = NULL, consumer = NULL, stepped = 0
    WHERE seq = ?1 AND st = 'in_flight' AND lease = ?2";

/// `at` is the item's id and, when the claim gave it, its row.
fn commit_wave(
    c: &Db<'_>,
    w: &mut Writer,
    at: (Ulid, Option<i64>),
    lease: u64,
    flow: &str,
    fx: WaveEffects,
    new: NewRows,
) -> Result<Committed, QueueError> {
    let (id, seq) = at;
    let plain = new.items.is_empty()
        && new.dead.is_empty()
        && fx.state.is_empty()
        && fx.guards.is_empty()
        && !w.marked.contains(&id);
    if plain {
        // The common wave (nothing written but its end): the ownership check is the
        // update's own condition, one statement.
        let outcome = match &fx.end {
            None | Some(End::Ack) => Some(fx.outcome.as_deref().unwrap_or("done")),
            Some(End::Superseded) => Some("superseded by a newer timer"),
            _ => None,
        };
        if let Some(outcome) = outcome {
            if w.failpoints.hit("commit") {
                return Err(QueueError::Unavailable("failpoint `commit` fired".into()));
            }
            // By row when the claim gave it: a look-up among its millisecond's rows fewer
            // (the row of an id never changes while it is in flight).
            let seq = match seq {
                Some(s) => s,
                None => match row_of(c, id)? {
                    Some(s) => s,
                    None => return Ok(Committed::Conflict),
                },
            };
            let now = now_ms();
            let n =
                c.cached(COMMIT_PLAIN_SQL)?
                    .execute(params![seq, lease as i64, outcome, now])?;
            if n != 1 {
                return Ok(Committed::Conflict);
            }
            w.flying.ended(seq);
            w.finished.push(now, seq);
            return Ok(Committed::Done);
        }
    }
    let owner: Option<(String, i64, i64)> = c
        .prepare_cached(&format!("SELECT st, lease, seq FROM items WHERE {BY_ID}"))?
        .query_row(by_id(id), |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()?;
    let row = match owner {
        Some((st, l, row)) if st == "in_flight" && l == lease as i64 => row,
        _ => return Ok(Committed::Conflict),
    };
    for s in &fx.state {
        if read_state(c, &s.key)?.version != s.read_version {
            return Ok(Committed::Conflict);
        }
    }
    for (key, want) in &fx.guards {
        if read_state(c, key)?.value.as_ref() != Some(want) {
            return Ok(Committed::Conflict);
        }
    }
    if fx.end == Some(End::Park) && !is_paused(c, flow)? {
        return Ok(Committed::Conflict);
    }
    let now = now_ms();
    insert_all(c, w, &new.items)?;
    for s in &fx.state {
        write_state(c, &s.key, s.value.as_ref())?;
    }
    if w.failpoints.hit("commit") {
        // Halfway: follow-ups and state are written; the batch is rolled back.
        return Err(QueueError::Unavailable("failpoint `commit` fired".into()));
    }
    for (row, reason) in &new.dead {
        insert_dead(c, w, row, reason, now)?;
    }
    if w.marked.remove(&id) {
        c.prepare_cached("DELETE FROM done WHERE item = ?1")?
            .execute([id.to_string()])?;
    }
    match fx.end.unwrap_or(End::Ack) {
        End::Ack => finish_row(c, w, row, fx.outcome.as_deref().unwrap_or("done"), now)?,
        End::Superseded => finish_row(c, w, row, "superseded by a newer timer", now)?,
        End::DeadLetter(reason) => {
            c.prepare_cached(
                "UPDATE items SET st = 'dead', reason = ?2, at = ?3, consumer = NULL, stepped = 0
                 WHERE seq = ?1",
            )?
            .execute(params![row, reason, now])?;
        }
        End::Park => {
            c.prepare_cached(
                "UPDATE items SET st = 'parked', consumer = NULL, stepped = 0 WHERE seq = ?1",
            )?
            .execute([row])?;
        }
    }
    w.flying.ended(row);
    Ok(Committed::Done)
}

fn is_paused(c: &Connection, flow: &str) -> Result<bool, QueueError> {
    Ok(c.prepare_cached("SELECT 1 FROM paused WHERE flow = ?1")?
        .query_row([flow], |_| Ok(()))
        .optional()?
        .is_some())
}

/// The ready items, oldest first. No `LIMIT ?`: the bundled SQLite is built with STAT4, so
/// it reads a bound LIMIT while planning, and every claim asking for a different number made
/// it prepare the statement again (8% of the writer's time under a webhook load). The rows
/// come in index order and the caller stops stepping at its `max`.
const CLAIM_SQL: &str = "SELECT seq, body, deliveries, stepped, id, flow, enqueued_at
    FROM items WHERE st = 'waiting' ORDER BY ord";

fn claim_ready(
    c: &Db<'_>,
    w: &mut Writer,
    consumer: &str,
    max: usize,
) -> Result<Vec<Taken>, QueueError> {
    let mut q = c.cached(CLAIM_SQL)?;
    let mut rows: Vec<Taken> = q
        .query_map([], |r| {
            Ok(Taken {
                seq: r.get(0)?,
                lease: 0,
                body: r.get(1)?,
                deliveries: r.get::<_, u32>(2)? + 1,
                stepped: r.get(3)?,
                id: r.get(4)?,
                flow: r.get(5)?,
                enqueued_at: r.get(6)?,
                item: None,
            })
        })?
        .take(max)
        .collect::<Result<_, _>>()?;
    drop(q);
    let now = now_ms();
    let mut take = c.cached(
        "UPDATE items SET st = 'in_flight', deliveries = ?2, lease = ?3, consumer = ?4, since = ?5
         WHERE seq = ?1",
    )?;
    for t in &mut rows {
        w.lease += 1;
        t.lease = w.lease;
        take.execute(params![t.seq, t.deliveries, w.lease as i64, consumer, now])?;
        w.ready -= 1;
        w.flying.claimed(t.seq, now, t.enqueued_at);
    }
    Ok(rows)
}

/// Make the items matched by `sql` (which selects `seq`, in the order wanted) ready, each
/// at the back of the ready order.
fn make_ready(
    c: &Connection,
    w: &mut Writer,
    sql: &str,
    args: impl rusqlite::Params,
) -> Result<usize, QueueError> {
    let seqs: Vec<i64> = c
        .prepare_cached(sql)?
        .query_map(args, |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let mut up = c.prepare_cached(
        "UPDATE items SET st = 'waiting', due = NULL, consumer = NULL, ord = ?2 WHERE seq = ?1",
    )?;
    for seq in &seqs {
        w.ord += 1;
        up.execute(params![seq, w.ord])?;
    }
    if !seqs.is_empty() {
        w.ready += seqs.len() as i64;
        w.woke = true;
    }
    Ok(seqs.len())
}

#[async_trait::async_trait]
impl StateRead for SqliteQueue {
    async fn read(&self, key: &StateKey) -> Result<Versioned, StateError> {
        let key = key.clone();
        self.read_with(move |c| read_state(c, &key))
            .await
            .map_err(|e| StateError(e.to_string()))
    }

    async fn read_node(
        &self,
        flow: &str,
        node: &str,
    ) -> Result<Vec<(String, Versioned)>, StateError> {
        let (flow, node) = (flow.to_string(), node.to_string());
        self.read_with(move |c| {
            let rows: Vec<(String, Option<String>, i64)> = c
                .prepare_cached(
                    "SELECT key, value, version FROM state
                     WHERE flow = ?1 AND node = ?2 AND value IS NOT NULL",
                )?
                .query_map(params![flow, node], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })?
                .collect::<Result<_, _>>()?;
            rows.into_iter()
                .map(|(k, v, version)| {
                    Ok((
                        k,
                        Versioned {
                            value: v.as_deref().map(unjson).transpose()?,
                            version: version as u64,
                        },
                    ))
                })
                .collect()
        })
        .await
        .map_err(|e| StateError(e.to_string()))
    }
}

#[async_trait::async_trait]
impl WorkQueue for SqliteQueue {
    fn durable(&self) -> bool {
        true
    }

    fn promotes_due_items(&self) -> bool {
        true
    }

    /// Four: with two, the claim loop's turn (hand out one answer, send the next claim)
    /// sometimes outlasted a transaction, and under the echo load 19 % of the items were
    /// claimed a transaction after the one that journaled them (one more fsync each); with
    /// four, 1 % (docs/performance-log.md, "A write waits two transactions").
    fn claims_ahead(&self) -> usize {
        4
    }

    async fn close(&self) {
        let _ = self.jobs.send(Msg::Close);
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = writer {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
    }

    async fn add(&self, items: Vec<WorkItem>) -> Result<(), QueueError> {
        let max = self.max_ready;
        let rows = Encoded::owning(items)?;
        self.write_as(Wait::Journal, move |c, w| {
            if w.ready + rows.len() as i64 > max {
                return Err(QueueError::Full(w.ready.max(0) as usize));
            }
            insert_all(c, w, &rows)?;
            // Handed back to be freed here: freed on the writer's thread, memory allocated
            // on another one costs the writer the lock of that thread's allocator arena.
            Ok((rows, w.failpoints.hit("add-reply-lost")))
        })
        .await
        .and_then(|(_, lost)| match lost {
            false => Ok(()),
            true => Err(QueueError::Unavailable(
                "failpoint `add-reply-lost` fired (the add went through)".into(),
            )),
        })
    }

    fn claims_on_add(&self) -> bool {
        true
    }

    async fn add_claimed(
        &self,
        consumer: &str,
        item: WorkItem,
    ) -> Result<Option<Claimed>, QueueError> {
        let row = Encoded::new(&item, now_ms())?;
        let (reply, rx) = oneshot::channel();
        let sent = std::time::Instant::now();
        self.jobs
            .send(Msg::Job(Job::AddClaimed(Box::new(AddClaimed {
                row,
                consumer: consumer.to_string(),
                max_ready: self.max_ready,
                reply,
            }))))
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        let mut answer = Unreceived {
            rx: Some(rx),
            jobs: self.jobs.clone(),
        };
        let got = answer
            .receive()
            .await
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        Wait::Journal.record(sent.elapsed());
        Ok(got?.map(|(seq, lease)| {
            let mut item = item;
            item.deliveries += 1;
            // A claimed item is due now.
            item.not_before = None;
            Claimed::new(item, lease, consumer, false, seq as u64)
        }))
    }

    async fn add_idempotent(&self, key: &str, item: WorkItem) -> Result<(Ulid, bool), QueueError> {
        let key = key.to_string();
        let max = self.max_ready;
        let id = item.id;
        let row = Encoded::new(&item, now_ms())?;
        self.write_as(Wait::Journal, move |c, w| {
            let first: Option<String> = c
                .prepare_cached("SELECT id FROM idempotency WHERE key = ?1")?
                .query_row([&key], |r| r.get(0))
                .optional()?;
            if let Some(first) = first {
                let id =
                    Ulid::from_string(&first).map_err(|e| QueueError::Corrupt(e.to_string()))?;
                return Ok((id, false));
            }
            if w.ready >= max {
                return Err(QueueError::Full(w.ready.max(0) as usize));
            }
            c.prepare_cached("INSERT INTO idempotency (key, id, at) VALUES (?1, ?2, ?3)")?
                .execute(params![key, row.id, now_ms()])?;
            insert(c, w, &row)?;
            Ok((id, true))
        })
        .await
    }

    async fn add_tick(
        &self,
        key: &StateKey,
        tick: i64,
        item: WorkItem,
    ) -> Result<bool, QueueError> {
        let key = key.clone();
        let row = Encoded::new(&item, now_ms())?;
        self.write_as(Wait::Journal, move |c, w| {
            let last = read_state(c, &key)?.value.and_then(|v| v.as_i64());
            if last.is_some_and(|l| l >= tick) {
                return Ok(false);
            }
            write_state(c, &key, Some(&tick.into()))?;
            insert(c, w, &row)?;
            Ok(true)
        })
        .await
    }

    async fn claim(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Claimed>, QueueError> {
        // Always looks (an indexed LIMIT query): the ready count only bounds `add`, it never
        // decides whether an item can be claimed. Finding nothing, the claim waits in the
        // writer, which answers it by `wait` at the latest.
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Msg::Job(Job::Claim(Waiter {
                consumer: consumer.to_string(),
                max,
                deadline: std::time::Instant::now() + wait,
                reply,
                taken: Vec::new(),
            })))
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        let taken = rx
            .await
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))??;
        // Decoded here, off the writer's thread.
        let mut out = Vec::with_capacity(taken.len());
        for mut t in taken {
            let cols = RowCols {
                id: &t.id,
                flow: std::mem::take(&mut t.flow),
                deliveries: t.deliveries,
                enqueued_at: t.enqueued_at,
                // A claimed item is due now, whenever it was due.
                due: None,
            };
            let item = match t.item.take() {
                // As decoding its row would give it: counted delivered, due now.
                Some(mut item) => {
                    item.deliveries = t.deliveries;
                    item.not_before = None;
                    Ok(item)
                }
                None => decode(&t.body, cols),
            };
            match item {
                Ok(item) => out.push(Claimed::new(
                    item,
                    t.lease,
                    consumer,
                    t.stepped,
                    t.seq as u64,
                )),
                Err(e) => {
                    // A poison row: set aside with the reason; the ones around it go on.
                    // If setting it aside fails, the items claimed with it are still handed
                    // out (dropping them would strand them in flight); the poison row stays
                    // in flight until a reclaim pass or the next start brings it back.
                    tracing::error!(seq = t.seq, error = %e, "an item that cannot be decoded is dead-lettered");
                    let reason = format!("undecodable item: {e}");
                    let buried = self
                        .write(move |c, w| {
                            let n = c.prepare_cached(
                            "UPDATE items SET st = 'dead', reason = ?3, at = ?4, consumer = NULL
                             WHERE seq = ?1 AND st = 'in_flight' AND lease = ?2",
                        )?
                        .execute(params![
                            t.seq,
                            t.lease as i64,
                            reason,
                            now_ms()
                        ])?;
                            if n > 0 {
                                w.flying.ended(t.seq);
                            }
                            Ok(())
                        })
                        .await;
                    if let Err(e) = buried {
                        tracing::warn!(seq = t.seq, error = %e, "could not dead-letter an undecodable item; it comes back after a reclaim pass or a restart");
                    }
                }
            }
        }
        Ok(out)
    }

    async fn commit(&self, claimed: &Claimed, fx: WaveEffects) -> Result<Committed, QueueError> {
        let (id, lease, flow) = (claimed.item.id, claimed.lease, claimed.item.flow.clone());
        let seq = (claimed.slot > 0).then_some(claimed.slot as i64);
        let mut fx = fx;
        let new = NewRows::take(&mut fx)?;
        self.write_as(Wait::Commit, move |c, w| {
            commit_wave(c, w, (id, seq), lease, &flow, fx, new)
        })
        .await
    }

    async fn reclaim_stale(&self, min_idle: Duration) -> Result<usize, QueueError> {
        let before = now_ms() - min_idle.as_millis() as i64;
        self.write(move |c, w| {
            // The items in flight are the writer's to know (no index over the file).
            let stale: Vec<i64> = w
                .flying
                .rows
                .iter()
                .filter(|(_, &(since, _))| since <= before)
                .map(|(&seq, _)| seq)
                .collect();
            ready_again(c, w, &stale)
        })
        .await
    }

    async fn prune(&self, before: i64) -> Result<crate::Pruned, QueueError> {
        self.write(move |c, w| {
            // The finished items are the writer's to know (no index over the file).
            w.recent.forget();
            let mut del = c.prepare_cached(DELETE_FINISHED_SQL)?;
            let mut outcomes = 0;
            let mut kept = std::collections::VecDeque::with_capacity(w.finished.rows.len());
            for (at, seq) in std::mem::take(&mut w.finished.rows) {
                if at < before {
                    outcomes += del.execute([seq])?;
                } else {
                    kept.push_back((at, seq));
                }
            }
            w.finished.rows = kept;
            let dead = c.execute("DELETE FROM items WHERE st = 'dead' AND at < ?1", [before])?;
            let runs = c.execute(
                "DELETE FROM state WHERE node = ?1
                   AND json_extract(value, '$.updated_at') < ?2",
                params![crate::RUNS_NODE, before],
            )?;
            Ok(crate::Pruned {
                outcomes,
                dead,
                runs,
            })
        })
        .await
    }

    async fn move_due(&self, now: i64) -> Result<usize, QueueError> {
        self.write(move |c, w| {
            make_ready(
                c,
                w,
                "SELECT seq FROM items WHERE st = 'delayed' AND due <= ?1 ORDER BY due, seq",
                [now],
            )
        })
        .await
    }

    async fn next_due(&self) -> Result<Option<i64>, QueueError> {
        self.read_with(|c| {
            Ok(
                c.prepare_cached("SELECT min(due) FROM items WHERE st = 'delayed'")?
                    .query_row([], |r| r.get(0))?,
            )
        })
        .await
    }

    async fn set_paused(&self, flow: &str, paused: bool) -> Result<(), QueueError> {
        let name = flow.to_string();
        let _one_at_a_time = self.pausing.lock().await;
        self.write(move |c, _| {
            if paused {
                c.execute("INSERT OR IGNORE INTO paused (flow) VALUES (?1)", [&name])?;
            } else {
                c.execute("DELETE FROM paused WHERE flow = ?1", [&name])?;
            }
            Ok(())
        })
        .await?;
        let mut set = self.paused.write().unwrap_or_else(|p| p.into_inner());
        if paused {
            set.insert(flow.to_string());
        } else {
            set.remove(flow);
        }
        Ok(())
    }

    async fn is_paused(&self, flow: &str) -> Result<bool, QueueError> {
        Ok(self
            .paused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(flow))
    }

    async fn parked_count(&self, flow: &str) -> Result<usize, QueueError> {
        let flow = flow.to_string();
        self.read_with(move |c| {
            let n: i64 = c
                .prepare_cached("SELECT count(*) FROM items WHERE flow = ?1 AND st = 'parked'")?
                .query_row([&flow], |r| r.get(0))?;
            Ok(n as usize)
        })
        .await
    }

    async fn unpark(&self, flow: &str) -> Result<usize, QueueError> {
        let flow = flow.to_string();
        self.write(move |c, w| {
            make_ready(
                c,
                w,
                "SELECT seq FROM items WHERE flow = ?1 AND st = 'parked' ORDER BY ord",
                [&flow],
            )
        })
        .await
    }

    async fn unpark_one(&self, flow: &str) -> Result<Option<Ulid>, QueueError> {
        let flow = flow.to_string();
        self.write(move |c, w| {
            let oldest: Option<(i64, String)> = c
                .prepare_cached(
                    "SELECT seq, id FROM items WHERE flow = ?1 AND st = 'parked'
                     ORDER BY ord LIMIT 1",
                )?
                .query_row([&flow], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?;
            let Some((seq, id)) = oldest else {
                return Ok(None);
            };
            // It keeps its place in the ready order, and runs although the flow is paused.
            c.execute(
                "UPDATE items SET st = 'waiting', stepped = 1 WHERE seq = ?1",
                [seq],
            )?;
            w.ready += 1;
            w.woke = true;
            Ulid::from_string(&id)
                .map(Some)
                .map_err(|e| QueueError::Corrupt(e.to_string()))
        })
        .await
    }

    async fn clear_flow(&self, flow: &str) -> Result<usize, QueueError> {
        let flow = flow.to_string();
        self.write(move |c, w| {
            let ready: i64 = c.query_row(
                "SELECT count(*) FROM items WHERE flow = ?1 AND st = 'waiting'",
                [&flow],
                |r| r.get(0),
            )?;
            let now = now_ms();
            let cleared: Vec<i64> = c
                .prepare(
                    "UPDATE items SET st = 'finished', reason = 'cleared with its flow', at = ?2,
                                      due = NULL, stepped = 0
                     WHERE flow = ?1 AND st IN ('waiting', 'delayed', 'parked') RETURNING seq",
                )?
                .query_map(params![flow, now], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            w.ready -= ready;
            for &seq in &cleared {
                w.finished.push(now, seq);
            }
            Ok(cleared.len())
        })
        .await
    }

    async fn mark_done(&self, key: DoneKey, outputs: Vec<Vec<Message>>) -> Result<(), QueueError> {
        self.write(move |c, w| {
            w.marked.insert(key.item);
            c.prepare_cached(
                "INSERT OR REPLACE INTO done (item, node, position, outputs) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![
                key.item.to_string(),
                key.node,
                key.position,
                json(&outputs)?
            ])?;
            Ok(())
        })
        .await
    }

    async fn was_done(&self, key: &DoneKey) -> Result<Option<Vec<Vec<Message>>>, QueueError> {
        let key = key.clone();
        self.read_with(move |c| {
            let row: Option<String> = c
                .prepare_cached(
                    "SELECT outputs FROM done WHERE item = ?1 AND node = ?2 AND position = ?3",
                )?
                .query_row(params![key.item.to_string(), key.node, key.position], |r| {
                    r.get(0)
                })
                .optional()?;
            row.as_deref().map(unjson).transpose()
        })
        .await
    }

    async fn post_reply(&self, id: Ulid, reply: Reply) -> Result<(), QueueError> {
        self.replies.post(id, reply);
        Ok(())
    }

    async fn wait_reply(&self, id: Ulid, wait: Duration) -> Result<Option<Reply>, QueueError> {
        Ok(self.replies.wait(id, wait).await)
    }

    async fn stats(&self) -> Result<Stats, QueueError> {
        let in_flight = self.in_flight.clone();
        self.read_with(move |c| {
            let mut s = Stats {
                durable: true,
                ..Default::default()
            };
            let now = now_ms();
            // One query per state, each on that state's own index.
            for st in ["waiting", "delayed", "parked", "dead"] {
                let (n, oldest): (i64, Option<i64>) = c
                    .prepare_cached(&format!(
                        "SELECT count(*), min(enqueued_at) FROM items WHERE st = '{st}'"
                    ))?
                    .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                let n = n as usize;
                match st {
                    "waiting" => s.ready = n,
                    "delayed" => s.delayed = n,
                    "parked" => s.parked = n,
                    _ => s.dead = n,
                }
                if st == "waiting" {
                    if let Some(t) = oldest {
                        let age = now - t;
                        s.oldest_pending_age_ms =
                            Some(s.oldest_pending_age_ms.map_or(age, |a| a.max(age)));
                    }
                }
            }
            // The items in flight, which the writer counts, after those waiting: an item
            // claimed in between is counted once or twice, never missed.
            let flying = *in_flight.lock().unwrap_or_else(|p| p.into_inner());
            s.in_flight = flying.count;
            if let Some(t) = flying.oldest {
                let age = now - t;
                s.oldest_pending_age_ms = Some(s.oldest_pending_age_ms.map_or(age, |a| a.max(age)));
            }
            Ok(s)
        })
        .await
    }

    async fn dead_letters(&self, n: usize) -> Result<Vec<ItemView>, QueueError> {
        self.read_with(move |c| {
            c.prepare_cached(&format!(
                "SELECT {ITEM_COLS} FROM items WHERE st = 'dead' ORDER BY at DESC, seq DESC LIMIT ?1"
            ))?
            .query_map([n as i64], view)?
            .map(|r| r?)
            .collect()
        })
        .await
    }

    async fn get(&self, id: Ulid) -> Result<Option<ItemView>, QueueError> {
        self.read_with(move |c| get_view(c, id)).await
    }

    async fn list(&self, f: ListFilter) -> Result<Vec<ItemView>, QueueError> {
        let limit = if f.limit == 0 { 100 } else { f.limit };
        self.read_with(move |c| {
            // In the order of the rows, which is that of their ids' milliseconds (`rows_of`;
            // there is no index of ids): each millisecond's rows are read whole, and sorted
            // by id, until `limit` are found.
            let after = f.after.map(|a| a.to_string());
            let from = f.after.map_or(0, |a| rows_of(a).0);
            let mut q = c.prepare_cached(&format!(
                "SELECT {ITEM_COLS}, seq FROM items
                 WHERE seq >= ?1 AND (?2 IS NULL OR flow = ?2) AND (?3 IS NULL OR st = ?3)
                 ORDER BY seq"
            ))?;
            let mut rows = q.query(params![from, f.flow, f.state])?;
            let mut found: Vec<ItemView> = Vec::new();
            let mut ms = None;
            while let Some(r) = rows.next()? {
                let at = r.get::<_, i64>(11)? >> ROW_BITS;
                if found.len() >= limit && ms != Some(at) {
                    break;
                }
                ms = Some(at);
                if let Some(a) = &after {
                    if r.get::<_, String>(8)?.as_str() <= a.as_str() {
                        continue;
                    }
                }
                found.push(view(r)??);
            }
            found.sort_by_key(|v| v.item.id);
            found.truncate(limit);
            Ok(found)
        })
        .await
    }

    async fn cancel(&self, id: Ulid) -> Result<(), QueueError> {
        self.write(move |c, w| match item_state(c, id)?.as_deref() {
            None => Err(QueueError::NotFound(id)),
            Some(st @ ("waiting" | "delayed" | "parked")) => {
                if st == "waiting" {
                    w.ready -= 1;
                }
                finish(c, w, id, "cancelled by hand", now_ms())
            }
            Some("in_flight") => Err(QueueError::Conflict(format!(
                "item {id} is in flight; it ends with its wave"
            ))),
            Some("dead") => Err(QueueError::Conflict(format!(
                "item {id} is a dead letter: discard or replay it"
            ))),
            Some(_) => Err(QueueError::Conflict(format!("item {id} has finished"))),
        })
        .await
    }

    async fn replay(&self, id: Ulid) -> Result<Ulid, QueueError> {
        self.write(move |c, w| {
            let Some(v) = get_view(c, id)? else {
                return Err(QueueError::NotFound(id));
            };
            if !matches!(v.state, ItemState::Dead { .. }) {
                return Err(QueueError::Conflict(format!(
                    "item {id} is not a dead letter"
                )));
            }
            let item = v.item.replayed();
            let new_id = item.id;
            let now = now_ms();
            finish(c, w, id, &format!("replayed as {new_id}"), now)?;
            insert(c, w, &Encoded::new(&item, now)?)?;
            Ok(new_id)
        })
        .await
    }

    async fn discard(&self, id: Ulid) -> Result<(), QueueError> {
        self.write(move |c, w| match item_state(c, id)?.as_deref() {
            None => Err(QueueError::NotFound(id)),
            Some("dead") => finish(c, w, id, "discarded by hand", now_ms()),
            Some(_) => Err(QueueError::Conflict(format!(
                "item {id} is not a dead letter"
            ))),
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(n: i64) -> WorkItem {
        WorkItem::cascade("f", "in", "t", vec![serde_json::json!({ "payload": n })])
    }

    /// The row's body is the file's format: the same bytes whoever writes it, and every
    /// field an item can carry reads back as it was.
    #[test]
    fn a_body_is_written_in_the_journal_format_and_reads_back_whole() {
        let plain = item(1);
        let e = Encoded::new(&plain, plain.enqueued_at).unwrap();
        assert_eq!(e.body, r#"{"n":"in","o":[[{"payload":1}]],"c":"t"}"#);
        assert_eq!((e.flow.as_str(), e.due), ("f", None));
        let mut full = item(2);
        full.kind = ItemKind::Flush;
        full.attempt = 3;
        full.first_enqueued_at = full.enqueued_at - 5;
        full.guard_key = Some("g".into());
        full.guard_value = Some(serde_json::json!({ "v": 1 }));
        full.origin_id = Some(Ulid::new());
        full.run_id = Some("run-1".into());
        full.not_before = Some(full.enqueued_at + 60_000);
        full.deliveries = 2;
        let e = Encoded::new(&full, full.enqueued_at).unwrap();
        let cols = RowCols {
            id: &e.id,
            flow: e.flow.clone(),
            deliveries: e.deliveries,
            enqueued_at: e.enqueued_at,
            due: e.due,
        };
        assert_eq!(decode(&e.body, cols).unwrap(), full);
    }

    /// An `add_claimed` whose caller goes away (a webhook's client hung up) leaves no item
    /// stranded in flight until the reclaim delay: whether its answer was never sent (the
    /// caller gone before the commit) or sent and never read (gone after it), the item is
    /// made ready again and the executor's claim gets it, its first delivery counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_item_added_claimed_for_a_caller_gone_is_ready_again() {
        let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
        // Gone before the answer: the writer is busy with another job while the caller
        // gives up, so the answer finds nobody.
        let busy = tokio::spawn({
            let q = q.clone();
            async move {
                q.write(|_, _| {
                    std::thread::sleep(Duration::from_millis(200));
                    Ok(())
                })
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let early = item(1);
        let gone = tokio::time::timeout(
            Duration::from_millis(20),
            q.add_claimed("web", early.clone()),
        )
        .await;
        assert!(
            gone.is_err(),
            "answered while the writer was busy: {gone:?}"
        );
        busy.await.unwrap().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let again = claim_until(&q, deadline).await;
        assert_eq!((again.item.id, again.item.deliveries), (early.id, 2));
        // Gone after it: the answer waits unread in its channel when the caller drops it.
        let late = item(2);
        let before = q.batches();
        let mut call = Box::pin(q.add_claimed("web", late.clone()));
        assert!(poll_once(&mut call).await.is_none());
        while q.batches() == before {
            assert!(
                std::time::Instant::now() < deadline,
                "the writer never committed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The count moves just before the answers go out: give them a moment, so that it
        // is the unread answer, not an unsendable one, that this half drops.
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(call);
        let again = claim_until(&q, deadline).await;
        assert_eq!((again.item.id, again.item.deliveries), (late.id, 2));
    }

    /// The next item the executor's claim gets, waiting for it until `deadline`.
    async fn claim_until(q: &SqliteQueue, deadline: std::time::Instant) -> Claimed {
        loop {
            assert!(
                std::time::Instant::now() < deadline,
                "nothing came back to claim"
            );
            if let Some(c) = q
                .claim("exec", 1, Duration::from_millis(200))
                .await
                .unwrap()
                .pop()
            {
                return c;
            }
        }
    }

    /// Poll `f` once: its answer if it had one.
    async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        let polled =
            std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx)));
        match polled.await {
            std::task::Poll::Ready(out) => Some(out),
            std::task::Poll::Pending => None,
        }
    }

    /// Claims asking for different numbers of items reuse one prepared statement.
    #[tokio::test]
    async fn claims_of_any_size_do_not_prepare_the_claim_again() {
        let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
        q.add((0..20).map(item).collect()).await.unwrap();
        let mut got = 0;
        for max in [1, 2, 3, 5, 7, 2] {
            got += q.claim("a", max, Duration::ZERO).await.unwrap().len();
        }
        assert_eq!(got, 20, "1 + 2 + 3 + 5 + 7 + the last 2");
        let reprepared = q
            .write(|c, _| {
                Ok(c.prepare_cached(CLAIM_SQL)?
                    .get_status(rusqlite::StatementStatus::RePrepare))
            })
            .await
            .unwrap();
        assert_eq!(reprepared, 0);
    }

    /// A job sent while the writer runs a batch's SQL joins that batch, so it waits for one
    /// COMMIT, not for that one and then its own.
    #[tokio::test]
    async fn a_job_sent_while_a_batch_runs_joins_it() {
        let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
        let (started, running) = oneshot::channel();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let before = q.batches();
        let mut slow = std::pin::pin!(q.write(move |_, _| {
            let _ = started.send(());
            let _ = wait.recv_timeout(Duration::from_secs(10));
            Ok(())
        }));
        // Polled once: sent, and now the writer runs it.
        tokio::select! { biased; _ = &mut slow => panic!("answered before it ran"), _ = async {} => {} }
        running.await.unwrap();
        let one = item(1);
        let id = one.id;
        let mut add = std::pin::pin!(q.add(vec![one]));
        tokio::select! { biased; _ = &mut add => panic!("answered while the batch runs"), _ = async {} => {} }
        go.send(()).unwrap();
        slow.await.unwrap();
        add.await.unwrap();
        assert!(q.get(id).await.unwrap().is_some());
        assert_eq!(q.batches() - before, 1, "one transaction for both");
    }

    /// A claim gives each item its row, and the commit finds the item by it; a claim without
    /// one (slot 0) is still committed, by id; and the row does not stand in for the lease:
    /// a row whose lease has moved on refuses the commit.
    #[tokio::test]
    async fn commits_find_the_item_by_the_row_its_claim_gave() {
        let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
        q.add((0..3).map(item).collect()).await.unwrap();
        let c = q.claim("a", 3, Duration::ZERO).await.unwrap();
        assert!(c.iter().all(|c| c.slot > 0), "each claim gives the row");
        // The commit's update goes straight to the row, never a scan.
        let plan = q
            .write(|c, _| {
                let mut p = c.prepare(&format!("EXPLAIN QUERY PLAN {COMMIT_PLAIN_SQL}"))?;
                let args = params![1, 1, "done", 0];
                let rows = p.query_map(args, |r| r.get::<_, String>(3))?;
                Ok(rows.collect::<Result<Vec<_>, _>>()?.join("; "))
            })
            .await
            .unwrap();
        assert!(!plan.contains("SCAN"), "{plan}");
        assert!(plan.contains("INTEGER PRIMARY KEY"), "{plan}");
        let mut by_id = c[1].clone();
        by_id.slot = 0;
        for (claimed, how) in [(&c[0], "by row"), (&by_id, "by id")] {
            let r = q
                .commit(claimed, WaveEffects::ending(End::Ack))
                .await
                .unwrap();
            assert_eq!(r, Committed::Done, "{how}");
            let v = q.get(claimed.item.id).await.unwrap().unwrap();
            assert!(
                matches!(v.state, ItemState::Finished { .. }),
                "{how}: {:?}",
                v.state
            );
        }
        // The third item is reclaimed and claimed again: the old claim's row is right, its
        // lease is not.
        assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 1);
        let again = q.claim("b", 1, Duration::ZERO).await.unwrap();
        assert_eq!(again[0].slot, c[2].slot);
        let stale = q
            .commit(&c[2], WaveEffects::ending(End::Ack))
            .await
            .unwrap();
        assert_eq!(stale, Committed::Conflict);
        let r = q
            .commit(&again[0], WaveEffects::ending(End::Ack))
            .await
            .unwrap();
        assert_eq!(r, Committed::Done);
    }

    /// Past `FINISHED_KEPT`, the oldest finished items go, a few in each batch that finishes
    /// more; the newest stay for `get`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn finished_items_past_the_bound_are_deleted_oldest_first() {
        let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
        let total = FINISHED_KEPT + 300;
        let mut first = None;
        let mut last = None;
        let mut done = 0;
        while done < total {
            let batch: Vec<WorkItem> = (0..500.min(total - done)).map(item).collect();
            first.get_or_insert(batch[0].id);
            last = Some(batch[batch.len() - 1].id);
            q.add(batch).await.unwrap();
            let claimed = q.claim("a", 500, Duration::ZERO).await.unwrap();
            let commits = claimed
                .iter()
                .map(|c| q.commit(c, WaveEffects::ending(End::Ack)));
            for r in futures::future::join_all(commits).await {
                assert_eq!(r.unwrap(), Committed::Done);
            }
            done += claimed.len() as i64;
        }
        // One more batch lets the last trim run.
        q.add(vec![item(0)]).await.unwrap();
        let kept: i64 = q
            .read_with(|c| {
                Ok(c.query_row(
                    "SELECT count(*) FROM items WHERE st = 'finished'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .await
            .unwrap();
        let held = q.write(|_, w| Ok(w.finished.len())).await.unwrap();
        assert_eq!(held, kept, "the writer holds what the file does");
        assert!(
            (FINISHED_KEPT - TRIM_CHUNK..=FINISHED_KEPT).contains(&kept),
            "{kept} finished items kept"
        );
        assert!(
            q.get(first.unwrap()).await.unwrap().is_none(),
            "the oldest went"
        );
        let newest = q
            .get(last.unwrap())
            .await
            .unwrap()
            .expect("the newest stays");
        assert!(matches!(newest.state, ItemState::Finished { .. }));
    }

    /// Until `probe` holds, for 10 s at most.
    async fn until<F: std::future::Future<Output = bool>>(what: &str, probe: impl Fn() -> F) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !probe().await {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A claim by `consumer` for at most `max` items, once it waits in the writer.
    async fn waiting_claim(
        q: &Arc<SqliteQueue>,
        consumer: &'static str,
        max: usize,
    ) -> tokio::task::JoinHandle<Result<Vec<Claimed>, QueueError>> {
        let before = q.write(|_, w| Ok(w.waiters.len())).await.unwrap();
        let claim = {
            let q = q.clone();
            tokio::spawn(async move { q.claim(consumer, max, Duration::from_secs(5)).await })
        };
        until("the claim waits in the writer", || async {
            q.write(|_, w| Ok(w.waiters.len())).await.unwrap() > before
        })
        .await;
        claim
    }

    /// The items in flight are the writer's to count (schema 5 has no index of them): every
    /// way into flight and out of it moves what `stats` shows, and it is what the file
    /// holds, after a rolled-back batch too; a reclaim finds every one.
    #[tokio::test]
    async fn the_items_in_flight_are_counted_as_the_file_holds_them() {
        let fp = Failpoints::new();
        let q = Arc::new(SqliteQueue::temporary(fp.clone()).unwrap());
        let counted = |q: Arc<SqliteQueue>| async move {
            let shown = q.stats().await.unwrap().in_flight;
            let held: i64 = q
                .read_with(|c| {
                    Ok(c.query_row(
                        "SELECT count(*) FROM items WHERE st = 'in_flight'",
                        [],
                        |r| r.get(0),
                    )?)
                })
                .await
                .unwrap();
            assert_eq!(shown as i64, held, "shown against the file");
            shown
        };
        // Into flight: by a claim, journaled claimed, handed to a claim waiting.
        q.add((0..4).map(item).collect()).await.unwrap();
        let c = q.claim("a", 4, Duration::ZERO).await.unwrap();
        assert_eq!(counted(q.clone()).await, 4);
        let direct = q.add_claimed("a", item(10)).await.unwrap().unwrap();
        assert_eq!(counted(q.clone()).await, 5);
        let waiting = waiting_claim(&q, "a", 1).await;
        q.add(vec![item(11)]).await.unwrap();
        let handed = waiting.await.unwrap().unwrap();
        assert_eq!(handed.len(), 1);
        assert_eq!(counted(q.clone()).await, 6);
        assert!(q.stats().await.unwrap().oldest_pending_age_ms.is_some());
        // Out of flight: finished by row and by id, dead-lettered, parked.
        let ack = |c: &Claimed| {
            let (q, c) = (q.clone(), c.clone());
            async move { q.commit(&c, WaveEffects::ending(End::Ack)).await.unwrap() }
        };
        assert_eq!(ack(&c[0]).await, Committed::Done);
        let mut by_id = c[1].clone();
        by_id.slot = 0;
        assert_eq!(ack(&by_id).await, Committed::Done);
        assert_eq!(counted(q.clone()).await, 4);
        let dead = WaveEffects::ending(End::DeadLetter("no".into()));
        assert_eq!(q.commit(&c[2], dead).await.unwrap(), Committed::Done);
        q.set_paused("f", true).await.unwrap();
        let park = WaveEffects::ending(End::Park);
        assert_eq!(q.commit(&direct, park).await.unwrap(), Committed::Done);
        assert_eq!(counted(q.clone()).await, 2);
        // A commit in a batch rolled back ended nothing.
        fp.arm("sqlite-batch", 1);
        assert!(q
            .commit(&c[3], WaveEffects::ending(End::Ack))
            .await
            .is_err());
        assert_eq!(counted(q.clone()).await, 2);
        // A claim taken back by a reclaim, and the rest by the reclaim of all.
        assert_eq!(q.reclaim_stale(Duration::from_secs(3600)).await.unwrap(), 0);
        assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 2);
        assert_eq!(counted(q.clone()).await, 0);
        assert_eq!(q.stats().await.unwrap().ready, 2);
    }

    /// An id is journaled once (schema 7 has no index of ids: the writer keeps the ids of
    /// the millisecond it last wrote into): an add retried after its batch was rolled back is
    /// journaled, one retried after it was journaled is not, whether the first is in the
    /// same batch, the millisecond last written or an earlier one.
    #[tokio::test]
    async fn an_id_is_journaled_once_whatever_the_writer_remembers() {
        let fp = Failpoints::new();
        let q = SqliteQueue::temporary(fp.clone()).unwrap();
        async fn rows(q: &SqliteQueue) -> Result<i64, QueueError> {
            q.read_with(|c| Ok(c.query_row("SELECT count(*) FROM items", [], |r| r.get(0))?))
                .await
        }
        let (a, b) = (item(1), item(2));
        fp.arm("sqlite-batch", 1);
        assert!(q.add(vec![a.clone()]).await.is_err());
        assert_eq!(rows(&q).await.unwrap(), 0, "rolled back");
        q.add(vec![a.clone(), b.clone(), a.clone()]).await.unwrap();
        assert_eq!(rows(&q).await.unwrap(), 2, "the retry journaled, once");
        q.add(vec![b.clone()]).await.unwrap();
        // Another millisecond written in between: the first is read from the file again.
        tokio::time::sleep(Duration::from_millis(2)).await;
        q.add(vec![item(3)]).await.unwrap();
        q.add(vec![a.clone(), b.clone()]).await.unwrap();
        assert_eq!(rows(&q).await.unwrap(), 3);
        let x = q.add_claimed("c", a.clone()).await.unwrap();
        assert!(x.is_none(), "journaled before: that copy goes its own way");
        assert_eq!(rows(&q).await.unwrap(), 3);
    }

    /// The finished items are the writer's to keep (schema 6 has no index of them): every
    /// way an item finishes, and every way a finished one is deleted, moves what the writer
    /// holds, and it is what the file holds, oldest first, after a rolled-back batch too.
    #[tokio::test]
    async fn the_finished_items_are_kept_as_the_file_holds_them() {
        let fp = Failpoints::new();
        let q = Arc::new(SqliteQueue::temporary(fp.clone()).unwrap());
        let kept = |q: Arc<SqliteQueue>| async move {
            let held: Vec<(i64, i64)> = q
                .write(|_, w| Ok(w.finished.rows.iter().copied().collect()))
                .await
                .unwrap();
            let mut file: Vec<i64> = q
                .read_with(|c| {
                    let mut s = c.prepare("SELECT seq FROM items WHERE st = 'finished'")?;
                    let seqs = s.query_map([], |r| r.get(0))?;
                    Ok(seqs.collect::<Result<_, _>>()?)
                })
                .await
                .unwrap();
            assert!(
                held.windows(2).all(|p| p[0].0 <= p[1].0),
                "oldest first: {held:?}"
            );
            let mut seqs: Vec<i64> = held.iter().map(|&(_, s)| s).collect();
            seqs.sort_unstable();
            file.sort_unstable();
            assert_eq!(seqs, file, "held against the file");
            seqs.len()
        };
        q.add((0..6).map(item).collect()).await.unwrap();
        let c = q.claim("a", 6, Duration::ZERO).await.unwrap();
        let ack = |c: &Claimed| {
            let (q, c) = (q.clone(), c.clone());
            async move { q.commit(&c, WaveEffects::ending(End::Ack)).await.unwrap() }
        };
        // Finished by a plain commit, by row and by id.
        assert_eq!(ack(&c[0]).await, Committed::Done);
        let mut by_id = c[1].clone();
        by_id.slot = 0;
        assert_eq!(ack(&by_id).await, Committed::Done);
        assert_eq!(kept(q.clone()).await, 2);
        // By a commit that writes more than its end.
        let mut more = WaveEffects::ending(End::Ack);
        more.follow_ups.push(item(20));
        assert_eq!(q.commit(&c[2], more).await.unwrap(), Committed::Done);
        assert_eq!(kept(q.clone()).await, 3);
        // A dead letter discarded, another replayed.
        for x in &c[3..5] {
            let dead = WaveEffects::ending(End::DeadLetter("no".into()));
            assert_eq!(q.commit(x, dead).await.unwrap(), Committed::Done);
        }
        assert_eq!(kept(q.clone()).await, 3);
        q.discard(c[3].item.id).await.unwrap();
        q.replay(c[4].item.id).await.unwrap();
        assert_eq!(kept(q.clone()).await, 5);
        // A commit in a batch rolled back finished nothing.
        fp.arm("sqlite-batch", 1);
        assert!(q
            .commit(&c[5], WaveEffects::ending(End::Ack))
            .await
            .is_err());
        assert_eq!(kept(q.clone()).await, 5);
        // Cancelled by hand, and cleared with the flow (the follow-up, the replayed item).
        let waiting = item(30);
        q.add(vec![waiting.clone()]).await.unwrap();
        q.cancel(waiting.id).await.unwrap();
        assert_eq!(kept(q.clone()).await, 6);
        assert_eq!(q.clear_flow("f").await.unwrap(), 2);
        assert_eq!(kept(q.clone()).await, 8);
        // Pruned: those finished before the time go, the rest stay.
        let p = q.prune(now_ms() - 60_000).await.unwrap();
        assert_eq!((p.outcomes, kept(q.clone()).await), (0, 8));
        let p = q.prune(now_ms() + 1).await.unwrap();
        assert_eq!((p.outcomes, kept(q.clone()).await), (8, 0));
        assert_eq!(ack(&c[5]).await, Committed::Done);
        assert_eq!(kept(q.clone()).await, 1);
    }

    /// An item journaled claimed for a claim that was waiting in the writer (the row written
    /// in flight as it is inserted) is where a stalled engine's items are taken back from.
    #[tokio::test]
    async fn an_item_handed_to_a_waiting_claim_is_taken_back_from_a_stalled_engine() {
        let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
        let claim = waiting_claim(&q, "stalled", 1).await;
        let it = item(1);
        let id = it.id;
        q.add(vec![it]).await.unwrap();
        let got = claim.await.unwrap().unwrap();
        assert_eq!(ids(&got), vec![id]);
        assert_eq!(q.reclaim_stale(Duration::from_secs(3600)).await.unwrap(), 0);
        assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 1);
        let again = q.claim("other", 10, Duration::ZERO).await.unwrap();
        assert_eq!(ids(&again), vec![id]);
        assert_eq!(again[0].item.deliveries, 2);
        assert_eq!(
            q.commit(&got[0], WaveEffects::ending(End::Ack))
                .await
                .unwrap(),
            Committed::Conflict,
            "the stalled engine's late commit is refused"
        );
    }

    /// An item handed to a waiting claim as it was added (not decoded from its row) is the
    /// item its row holds, as a claim after a restart would decode it: counted delivered
    /// once, due now, with its messages, cause and retry history whole.
    #[tokio::test]
    async fn an_item_handed_on_as_added_is_the_item_its_row_holds() {
        let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
        let claim = waiting_claim(&q, "a", 1).await;
        let mut it = item(7);
        it.outputs = vec![vec![
            serde_json::json!({"payload": {"x": 1.5, "s": "é", "l": [1, null, true]}}),
        ]];
        it.attempt = 2;
        it.origin_id = Some(Ulid::new());
        it.first_enqueued_at = it.enqueued_at - 5_000;
        it.not_before = Some(now_ms() - 10);
        q.add(vec![it.clone()]).await.unwrap();
        let got = claim.await.unwrap().unwrap();
        let handed = got[0].item.clone();
        let seq = got[0].slot as i64;
        let decoded = q
            .write(move |c, _| {
                let (body, id, flow, enqueued_at): (String, String, String, i64) = c.query_row(
                    "SELECT body, id, flow, enqueued_at FROM items WHERE seq = ?1",
                    [seq],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
                )?;
                let cols = RowCols {
                    id: &id,
                    flow,
                    deliveries: 1,
                    enqueued_at,
                    due: None,
                };
                decode(&body, cols).map_err(QueueError::Unavailable)
            })
            .await
            .unwrap();
        assert_eq!(handed, decoded);
        assert_eq!((handed.deliveries, handed.not_before), (1, None));
        assert_eq!(handed.outputs, it.outputs);
    }

    fn ids(got: &[Claimed]) -> Vec<Ulid> {
        got.iter().map(|c| c.item.id).collect()
    }

    /// Items added while claimers wait are journaled already claimed (one write of each
    /// row): each goes to the oldest claimer with room, in the order added, counted as
    /// delivered once, held by its claimer in the file, and committed like any claimed item.
    #[tokio::test]
    async fn items_added_while_claims_wait_are_journaled_claimed_in_order() {
        let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
        let a = waiting_claim(&q, "a", 2).await;
        let b = waiting_claim(&q, "b", 2).await;
        let items: Vec<WorkItem> = (0..3).map(item).collect();
        let want: Vec<Ulid> = items.iter().map(|i| i.id).collect();
        let changes = || q.write(|c, _| Ok(c.total_changes()));
        let before = changes().await.unwrap();
        q.add(items).await.unwrap();
        let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
        assert_eq!(
            changes().await.unwrap() - before,
            3,
            "one row written per item, not an insert and then a claim's update"
        );
        assert_eq!(ids(&a), want[..2], "the older claimer gets the first two");
        assert_eq!(ids(&b), want[2..], "the next one gets the third");
        for (c, who) in a.iter().map(|c| (c, "a")).chain(b.iter().map(|c| (c, "b"))) {
            assert_eq!(c.item.deliveries, 1);
            assert_eq!(c.consumer, who);
            let v = q.get(c.item.id).await.unwrap().expect("journaled");
            assert!(
                matches!(&v.state, ItemState::InFlight { consumer, .. } if consumer == who),
                "in flight for {who} in the file: {:?}",
                v.state
            );
            assert_eq!(v.item.deliveries, 1);
        }
        assert_eq!(q.write(|_, w| Ok(w.ready)).await.unwrap(), 0);
        for c in a.iter().chain(&b) {
            let r = q.commit(c, WaveEffects::ending(End::Ack)).await.unwrap();
            assert_eq!(r, Committed::Done);
        }
        let st = q.stats().await.unwrap();
        assert_eq!((st.ready, st.in_flight), (0, 0));
    }

    /// An item made ready in a transaction keeps its place ahead of items added after it in
    /// the same transaction: those are not handed to a waiting claimer directly, past it.
    #[tokio::test]
    async fn an_item_added_does_not_pass_one_made_ready_before_it() {
        let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
        let mut later = item(0);
        later.not_before = Some(now_ms() + 3_600_000);
        let (first, second) = (later.id, item(1));
        let second_id = second.id;
        q.add(vec![later]).await.unwrap();
        let claim = waiting_claim(&q, "a", 5).await;
        // One transaction: the delayed item made ready, then a new item added.
        let rows = Encoded::all(&[second]).unwrap();
        q.write(move |c, w| {
            make_ready(c, w, "SELECT seq FROM items WHERE st = 'delayed'", [])?;
            insert_all(c, w, &rows)
        })
        .await
        .unwrap();
        let got = claim.await.unwrap().unwrap();
        assert_eq!(ids(&got), vec![first, second_id], "in the order made ready");
    }

    /// A transaction that gave a waiting claimer items and was then rolled back gave it
    /// nothing: the add is told it failed, no row is left in flight, and the claimer goes
    /// on waiting and gets the next item.
    #[tokio::test]
    async fn items_given_to_a_claim_in_a_rolled_back_batch_were_never_journaled() {
        let fp = Failpoints::new();
        let q = Arc::new(SqliteQueue::temporary(fp.clone()).unwrap());
        let claim = waiting_claim(&q, "a", 5).await;
        let lost = item(0);
        let lost_id = lost.id;
        fp.arm("sqlite-batch", 1);
        assert!(q.add(vec![lost]).await.is_err(), "the add is told");
        assert!(q.get(lost_id).await.unwrap().is_none(), "nothing journaled");
        assert_eq!(q.stats().await.unwrap().in_flight, 0);
        let next = item(1);
        let next_id = next.id;
        q.add(vec![next]).await.unwrap();
        let got = claim.await.unwrap().unwrap();
        assert_eq!(
            ids(&got),
            vec![next_id],
            "the claimer waited on and got the next"
        );
    }

    /// A claim made while older ones wait does not take, in the batch that journals it, an
    /// item ahead of them: the oldest claim gets it. (The executor starts each claim's items
    /// in the order it made its claims; a newer claim served first started a later item's
    /// wave ahead of an earlier one's, out of journal order at a stateful node.)
    #[tokio::test]
    async fn a_new_claim_does_not_take_an_item_ahead_of_older_waiting_ones() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
        let older = waiting_claim(&q, "older", 1).await;
        // The writer is held busy while an add and then a new claim are sent, so that both
        // come in its next batch, in that order.
        let started = Arc::new(AtomicBool::new(false));
        let busy = {
            let (q, started) = (q.clone(), started.clone());
            tokio::spawn(async move {
                q.write(move |_, _| {
                    started.store(true, Ordering::Release);
                    std::thread::sleep(Duration::from_millis(300));
                    Ok(())
                })
                .await
            })
        };
        until("the writer is busy", || async {
            started.load(Ordering::Acquire)
        })
        .await;
        let it = item(1);
        let id = it.id;
        let mut add = Box::pin(q.add(vec![it]));
        assert!(futures::poll!(&mut add).is_pending(), "the add is sent");
        let mut newer = Box::pin(q.claim("newer", 1, Duration::from_millis(300)));
        assert!(futures::poll!(&mut newer).is_pending(), "the claim is sent");
        busy.await.unwrap().unwrap();
        add.await.unwrap();
        let got = older.await.unwrap().unwrap();
        assert_eq!(
            got.iter().map(|c| c.item.id).collect::<Vec<_>>(),
            vec![id],
            "the older claim gets the item"
        );
        assert!(
            newer.await.unwrap().is_empty(),
            "the newer one waited behind it and got none"
        );
    }

    /// Schema 7's step gives a row whose id is no ULID (none is written so; a file edited by
    /// hand) a row at its journaling's time, whatever the rows around it in id order, and the
    /// file opens with every item.
    #[tokio::test]
    async fn a_row_whose_id_is_no_ulid_does_not_stop_the_migration() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("queue.db");
        let (a, b) = (item(1), item(2));
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch("PRAGMA journal_mode=WAL").unwrap();
            for step in &MIGRATIONS[..6] {
                step.apply(&c).unwrap();
            }
            c.pragma_update(None, "user_version", 6).unwrap();
            let w = |id: &str, enqueued_at: i64, body: &str| {
                c.execute(
                    "INSERT INTO items (id, flow, st, ord, enqueued_at, body)
                     VALUES (?1, 'f', 'waiting', 1, ?2, ?3)",
                    params![id, enqueued_at, body],
                )
                .unwrap();
            };
            for it in [&a, &b] {
                let e = Encoded::new(it, now_ms()).unwrap();
                w(&e.id, e.enqueued_at, &e.body);
            }
            // After both in id order, at a millisecond long before theirs.
            w("zz-not-a-ulid", 1_000, "{}");
        }
        let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
        assert!(q.get(a.id).await.unwrap().is_some());
        assert!(q.get(b.id).await.unwrap().is_some());
        let odd: i64 = q
            .read_with(|c| {
                Ok(c.query_row(
                    "SELECT seq FROM items WHERE id = 'zz-not-a-ulid'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .await
            .unwrap();
        assert_eq!(odd, 1_000 << ROW_BITS);
    }

    /// A file of schema 3 (`seq` AUTOINCREMENT) opens with every item where it was, in its
    /// state, with its row; new items take rows after the largest; journaling no longer
    /// writes `sqlite_sequence`; (schemas 5 and 6) the indexes of the items in flight and of
    /// those finished are gone, the writer keeping them instead; and (schema 7) the index of
    /// ids is gone, each row's `seq` made from its id's time.
    #[tokio::test]
    async fn a_schema_3_file_keeps_its_items_and_drops_autoincrement() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("queue.db");
        let (waiting, finished, in_flight) = (item(1), item(2), item(3));
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch("PRAGMA journal_mode=WAL").unwrap();
            for step in &MIGRATIONS[..3] {
                step.apply(&c).unwrap();
            }
            c.pragma_update(None, "user_version", 3).unwrap();
            let w = |it: &WorkItem, seq: i64, st: &str| {
                let e = Encoded::new(it, now_ms()).unwrap();
                c.execute(
                    "INSERT INTO items (seq, id, flow, st, ord, deliveries, enqueued_at, body, reason)
                     VALUES (?1, ?2, ?3, ?4, ?1, 1, ?5, ?6, ?7)",
                    params![seq, e.id, e.flow, st, e.enqueued_at, e.body,
                            (st == "finished").then_some("done")],
                )
                .unwrap();
            };
            w(&waiting, 7, "waiting");
            w(&finished, 40, "finished");
            w(&in_flight, 41, "in_flight");
            // The largest row was deleted once: AUTOINCREMENT remembers it.
            c.execute(
                "UPDATE sqlite_sequence SET seq = 90 WHERE name = 'items'",
                [],
            )
            .unwrap();
        }
        let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
        let (version, table): (i64, String) = q
            .read_with(|c| {
                Ok((
                    c.query_row("PRAGMA user_version", [], |r| r.get(0))?,
                    c.query_row(
                        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'items'",
                        [],
                        |r| r.get(0),
                    )?,
                ))
            })
            .await
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        assert!(!table.contains("AUTOINCREMENT"), "{table}");
        let indexes: Vec<String> = q
            .read_with(|c| {
                let mut s = c.prepare(
                    "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'items'
                     ORDER BY name",
                )?;
                let names = s.query_map([], |r| r.get(0))?;
                Ok(names.collect::<Result<_, _>>()?)
            })
            .await
            .unwrap();
        assert_eq!(
            indexes,
            ["items_dead", "items_due", "items_parked", "items_ready"]
        );
        // Schema 7: every row's `seq` is its id's time, then its place among the ids of
        // that millisecond.
        let rows: Vec<(i64, String)> = q
            .read_with(|c| {
                let mut s = c.prepare("SELECT seq, id FROM items ORDER BY seq")?;
                let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
            .unwrap();
        let mut by_id = rows.clone();
        by_id.sort_by(|a, b| a.1.cmp(&b.1));
        assert_eq!(rows, by_id, "rows in the order of their ids");
        for (seq, id) in &rows {
            let id = Ulid::from_string(id).unwrap();
            assert_eq!(*seq >> ROW_BITS, id.timestamp_ms() as i64, "{id}");
        }
        let row = |id: Ulid| rows.iter().find(|r| r.1 == id.to_string()).unwrap().0;
        let state = |id| {
            let q = &q;
            async move { q.get(id).await.unwrap().unwrap().state.name() }
        };
        assert_eq!(state(waiting.id).await, "waiting");
        assert_eq!(state(finished.id).await, "finished");
        let held = q
            .write(|_, w| Ok(w.finished.rows.iter().copied().collect::<Vec<_>>()))
            .await
            .unwrap();
        assert_eq!(
            held,
            [(0, row(finished.id))],
            "the finished item, kept by the writer"
        );
        assert_eq!(
            state(in_flight.id).await,
            "waiting",
            "left in flight: ready again"
        );
        let got = q.claim("a", 10, Duration::ZERO).await.unwrap();
        assert_eq!(q.stats().await.unwrap().in_flight, 2);
        assert_eq!(
            got.iter().map(|c| (c.item.id, c.slot)).collect::<Vec<_>>(),
            vec![
                (waiting.id, row(waiting.id) as u64),
                (in_flight.id, row(in_flight.id) as u64)
            ],
            "their rows, in the ready order"
        );
        assert_eq!(
            got[1].item.deliveries, 2,
            "its delivery counted before stays"
        );
        let new = item(4);
        q.add(vec![new.clone()]).await.unwrap();
        let (seq, sequence): (i64, i64) = q
            .read_with(move |c| {
                Ok((
                    c.query_row(
                        "SELECT seq FROM items WHERE id = ?1",
                        [new.id.to_string()],
                        |r| r.get(0),
                    )?,
                    c.query_row(
                        "SELECT count(*) FROM sqlite_sequence WHERE name = 'items'",
                        [],
                        |r| r.get(0),
                    )?,
                ))
            })
            .await
            .unwrap();
        assert_eq!(
            seq >> ROW_BITS,
            new.id.timestamp_ms() as i64,
            "a new row at its id's time"
        );
        assert_eq!(sequence, 0, "nothing kept in sqlite_sequence");
        for c in &got {
            let r = q.commit(c, WaveEffects::ending(End::Ack)).await.unwrap();
            assert_eq!(r, Committed::Done, "a claim of a migrated row commits");
        }
        let next = q.claim("a", 10, Duration::ZERO).await.unwrap();
        assert_eq!(next.len(), 1);
    }
}
