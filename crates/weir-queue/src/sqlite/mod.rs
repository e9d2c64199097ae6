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

mod kept;
mod metrics;
mod ops;
mod rows;
mod schema;
mod stmt;
#[cfg(test)]
mod tests;
mod tx;
mod writer;

use std::any::Any;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::replies::Replies;
use crate::{Failpoints, QueueError};
use kept::*;
use metrics::*;
use schema::*;
use stmt::*;
use writer::*;

pub use schema::SCHEMA_VERSION;

/// A read for the reading connection's thread.
type Read = Box<dyn FnOnce(&Db<'_>) + Send>;

/// Reads waiting for the reading connection at most; past it a caller waits for room.
const READS_WAITING: usize = 1024;

/// The SQLite queue. `SqliteQueue::open("weir-data/queue.db", Failpoints::new())`.
pub struct SqliteQueue {
    jobs: mpsc::Sender<Msg>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Transactions committed by the writer (each is one fsync), for benchmarks and tests.
    batches: Arc<std::sync::atomic::AtomicU64>,
    /// The reading connection's thread, which runs each read sent to it with the
    /// connection's statements kept ([`SqliteQueue::read_with`]).
    reader: tokio::sync::mpsc::Sender<Read>,
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
            if !dir.exists() {
                private_dir(dir).map_err(|e| {
                    QueueError::Open(format!("cannot create {}: {e}", dir.display()))
                })?;
            }
        }
        let lock_path = PathBuf::from(format!("{shown}.lock"));
        let lock = private_file(&lock_path)
            .map_err(|e| QueueError::Open(format!("cannot create {}: {e}", lock_path.display())))?;
        // The queue file holds every event's payload: readable by its owner alone. SQLite
        // gives its -wal and -shm files the database file's permissions.
        if !path.exists() {
            private_file(path)
                .map_err(|e| QueueError::Open(format!("cannot create {shown}: {e}")))?;
        }
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
        // Every statement is prepared once and kept (SQLite's parser is dear next to running
        // them), by each connection's `Db`: rusqlite's own cache is not used.
        conn.set_prepared_statement_cache_capacity(0);
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
        let (reads, mut to_read) = tokio::sync::mpsc::channel::<Read>(READS_WAITING);
        std::thread::Builder::new()
            .name("weir-sqlite-reader".into())
            .spawn(move || {
                let db = Db::new(&reader);
                // Ends when the queue is dropped, and with it the sender.
                while let Some(read) = to_read.blocking_recv() {
                    // A read that panics fails alone (its caller hears the reader failed);
                    // the next runs on.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(&db)));
                }
            })
            .map_err(|e| QueueError::Open(format!("cannot start the reader thread: {e}")))?;
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
            marked: marked_items(&Db::new(&conn)).map_err(open_err)?,
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
            reader: reads,
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

    /// Run `f` on the reading connection, on its own thread, off the async threads.
    async fn read_with<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Db<'_>) -> Result<R, QueueError> + Send + 'static,
    ) -> Result<R, QueueError> {
        let (tx, rx) = oneshot::channel();
        let read: Read = Box::new(move |db| {
            let _ = tx.send(f(db));
        });
        let stopped = |_| QueueError::Unavailable("the reader has stopped".into());
        match self.reader.try_send(read) {
            Ok(()) => {}
            // Past the bound a caller waits for room, counted: nothing is dropped.
            Err(tokio::sync::mpsc::error::TrySendError::Full(read)) => {
                ::metrics::counter!("weir_bounds_hit_total", "bound" => "sqlite_reads")
                    .increment(1);
                self.reader.send(read).await.map_err(|_| stopped(()))?;
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return Err(stopped(())),
        }
        rx.await
            .map_err(|_| QueueError::Unavailable("the reader failed".into()))?
    }
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

/// A folder only its owner may enter (0700), with its missing parents.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
}

/// Open (creating it if missing) a file only its owner may read and write (0600).
fn private_file(path: &Path) -> std::io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.create(true).truncate(false).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
}
