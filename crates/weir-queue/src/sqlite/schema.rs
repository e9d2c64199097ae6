//! The file's schema: its versions, the steps between them, and the migration at open.

use rusqlite::Connection;
use ulid::Ulid;

use crate::QueueError;

/// A step of the schema: SQL, or Rust where SQL cannot do it.
pub(super) enum Step {
    Sql(&'static str),
    Rust(fn(&Connection) -> Result<(), rusqlite::Error>),
}

impl Step {
    pub(super) fn apply(&self, c: &Connection) -> Result<(), rusqlite::Error> {
        match self {
            Step::Sql(sql) => c.execute_batch(sql),
            Step::Rust(f) => f(c),
        }
    }
}

/// Each step brings the schema from version `i` to `i + 1`.
pub(super) const MIGRATIONS: &[Step] = &[
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
    // every journaled item. A
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
    // again by nearly every transaction.
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
pub(super) const ROW_BITS: u32 = 20;

/// The rows an item with an id of millisecond `ms` may take: `ms << ROW_BITS` and the
/// 2^20 after it. Ids are found there (a look-up reads the rows of one millisecond, about
/// as many as were journaled in it), and rows are in the order of their ids' times, which
/// is about the order journaled, so new rows go at the end of the table as before.
pub(super) fn rows_at(ms: u64) -> (i64, i64) {
    // Up to the year 2248; a later time (only a made-up id) shares the last millisecond.
    let lo = (ms.min((1 << (63 - ROW_BITS)) - 1) as i64) << ROW_BITS;
    (lo, lo | ((1 << ROW_BITS) - 1))
}

/// The rows an item with id `id` may take.
pub(super) fn rows_of(id: Ulid) -> (i64, i64) {
    rows_at(id.timestamp_ms())
}

/// Schema 7's step: the rows copied into a table without the id's `UNIQUE`, each given a
/// `seq` from its id's time, in the order of their ids.
pub(super) fn rows_by_id_time(c: &Connection) -> Result<(), rusqlite::Error> {
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

pub(super) fn migrate(conn: &mut Connection) -> Result<(), QueueError> {
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
