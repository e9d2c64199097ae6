//! What the writer keeps in memory between jobs: counters, items in flight, finished
//! items, waiting claims, and the jobs it is sent.

use std::any::Any;
use std::sync::{Arc, Mutex};

use rusqlite::Connection;
use tokio::sync::oneshot;
use ulid::Ulid;

use super::rows::*;
use super::schema::*;
use super::stmt::*;
use crate::{Failpoints, QueueError};

/// What the writer keeps between jobs. Counters only move forward, so a rolled-back job
/// leaves at worst a gap.
pub(super) struct Writer {
    /// The last place handed out in the ready order.
    pub(super) ord: i64,
    /// The last lease handed out.
    pub(super) lease: u64,
    /// Items ready now (kept here so `add` can check the bound without counting rows).
    pub(super) ready: i64,
    /// A job made items ready: serve the waiting claimers in the same transaction.
    pub(super) woke: bool,
    /// Claimers that found nothing ready, oldest first, each waiting until its deadline.
    pub(super) waiters: Vec<Waiter>,
    /// Items (by `seq`) claimed for a claimer that had gone before the answer reached it:
    /// made ready again at the start of the next transaction.
    pub(super) orphans: Vec<i64>,
    /// Items with done markers (so a commit deletes markers only where there are some).
    /// Never missing one: read from the file at open and again after a rollback.
    pub(super) marked: std::collections::HashSet<Ulid>,
    /// The earliest `due` of a delayed item as far as the writer knows (never later than
    /// the true one): when it passes, the writer promotes what is due by itself.
    pub(super) next_due: Option<i64>,
    /// The finished items in the file.
    pub(super) finished: Finished,
    /// The items in flight.
    pub(super) flying: InFlight,
    /// The rows of the millisecond last journaled into.
    pub(super) recent: Recent,
    pub(super) failpoints: Failpoints,
}

/// The items in flight, kept by the writer, which makes every change of state: no index
/// over the file (schema 5). Every write that puts a row in flight or takes it out says so
/// here; a rolled-back batch reads them from the file again. An item the writer lost track
/// of would only miss a reclaim until the next start (which makes every item in flight
/// ready), never be taken back wrongly: the reclaim's update checks the row's state too.
#[derive(Default)]
pub(super) struct InFlight {
    /// By row: when it was claimed, and its `enqueued_at` (when it was journaled).
    pub(super) rows: std::collections::HashMap<i64, (i64, i64), foldhash::fast::RandomState>,
    /// Taken out of flight by the batch under way: still shown until its commit.
    pub(super) leaving: Vec<(i64, i64)>,
    /// What `stats` reads: an item shown in flight from before its batch's COMMIT to after
    /// the commit that ends its flight, so a reader that finds it no longer waiting (or not
    /// yet finished) finds it here.
    pub(super) shown: Arc<Mutex<Flying>>,
    pub(super) changed: bool,
}

/// The items in flight as `stats` shows them: how many, and the earliest `enqueued_at`.
#[derive(Default, Clone, Copy)]
pub(super) struct Flying {
    pub(super) count: usize,
    pub(super) oldest: Option<i64>,
}

impl InFlight {
    pub(super) fn claimed(&mut self, seq: i64, since: i64, enqueued_at: i64) {
        self.rows.insert(seq, (since, enqueued_at));
        self.changed = true;
    }

    pub(super) fn ended(&mut self, seq: i64) {
        if let Some(r) = self.rows.remove(&seq) {
            self.leaving.push(r);
            self.changed = true;
        }
    }

    /// Read them from the file (after a rolled-back batch: they are what it holds).
    pub(super) fn reload(&mut self, c: &Connection) -> Result<(), rusqlite::Error> {
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
    pub(super) fn committing(&mut self) {
        if self.changed {
            let count = self.rows.len() + self.leaving.len();
            self.show(count, self.rows.values().chain(&self.leaving));
        }
    }

    /// After a COMMIT (or a reload): show what is in flight.
    pub(super) fn committed(&mut self) {
        if std::mem::take(&mut self.changed) {
            self.leaving.clear();
            self.show(self.rows.len(), self.rows.values());
        }
    }

    pub(super) fn show<'a>(&self, count: usize, rows: impl Iterator<Item = &'a (i64, i64)>) {
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
pub(super) struct Finished {
    /// `(at, seq)`: when each finished, and its row; oldest first.
    pub(super) rows: std::collections::VecDeque<(i64, i64)>,
}

impl Finished {
    pub(super) fn len(&self) -> i64 {
        self.rows.len() as i64
    }

    pub(super) fn push(&mut self, at: i64, seq: i64) {
        self.rows.push_back((at, seq));
    }

    /// Read them from the file: at open, and after a rolled-back batch.
    pub(super) fn reload(&mut self, c: &Connection) -> Result<(), rusqlite::Error> {
        self.rows = c
            .prepare(
                "SELECT coalesce(at, 0) AS t, seq FROM items WHERE st = 'finished' ORDER BY t, seq",
            )?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        Ok(())
    }
}

pub(super) type ClaimAnswer = Result<Vec<Taken>, QueueError>;

/// A claim that found nothing ready and waits in the writer: the next job that makes items
/// ready claims them for it inside its own transaction, so an item added while an engine is
/// idle is journaled and handed out with one fsync, not two.
pub(super) struct Waiter {
    pub(super) consumer: String,
    pub(super) max: usize,
    pub(super) deadline: std::time::Instant,
    pub(super) reply: oneshot::Sender<ClaimAnswer>,
    /// Items journaled in this transaction straight into its claim (`insert_all`): written
    /// once as in flight, where a claim afterwards would read each row back and rewrite it.
    /// Handed out by `serve_waiters` at the end of the same transaction.
    pub(super) taken: Vec<Taken>,
    /// Flows whose ready items this claim passes over (their waves are all taken).
    pub(super) skip: Option<std::sync::Arc<[String]>>,
}

impl Waiter {
    pub(super) fn has_room(&self) -> bool {
        self.taken.len() < self.max && !self.reply.is_closed()
    }

    /// Whether this claim takes an item of `flow`.
    pub(super) fn takes(&self, flow: &str) -> bool {
        self.skip
            .as_ref()
            .is_none_or(|s| !s.iter().any(|f| f == flow))
    }
}

pub(super) type Answer = Result<Box<dyn Any + Send>, QueueError>;
pub(super) type Run = Box<dyn FnOnce(&Db<'_>, &mut Writer) -> Answer + Send>;

pub(super) enum Job {
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
pub(super) struct AddClaimed {
    pub(super) row: Encoded,
    pub(super) consumer: String,
    /// `add`'s bound on the items ready.
    pub(super) max_ready: i64,
    pub(super) reply: oneshot::Sender<AddClaimedAnswer>,
}

/// The item's row and lease when it was journaled claimed; `None` when it was journaled
/// ready instead (something else was ready before it, or it was there already).
pub(super) type AddClaimedAnswer = Result<Option<(i64, u64)>, QueueError>;

/// What the writer is sent: a job for its next batch, or the order to close.
pub(super) enum Msg {
    Job(Job),
    /// Stop after the jobs sent before this one: the connection is closed and the lock
    /// released when the writer's thread ends.
    Close,
}

/// An answer held until the transaction it belongs to is durable.
pub(super) enum Held {
    Run(oneshot::Sender<Answer>, Answer),
    /// Items claimed for `Waiter` (or the error claiming them).
    Claim(Waiter, ClaimAnswer),
    AddClaimed(oneshot::Sender<AddClaimedAnswer>, AddClaimedAnswer),
}

/// The rows of the millisecond the writer last journaled into, as the file holds them
/// (schema 7): a new item of that millisecond, the common case since items are journaled as
/// they are made, takes its row and is checked against the ids there without reading them
/// again (a batch of hundreds made in one millisecond would read the ones before it each
/// time). Read from the file when another millisecond comes; told of each row written only
/// once its insert succeeded; forgotten after a rolled-back batch and after any delete.
#[derive(Default)]
pub(super) struct Recent {
    /// The millisecond's first row.
    pub(super) lo: Option<i64>,
    /// Its largest row.
    pub(super) last: Option<i64>,
    pub(super) ids: std::collections::HashSet<Ulid>,
}

impl Recent {
    pub(super) fn read(&mut self, c: &Db<'_>, lo: i64, hi: i64) -> Result<(), rusqlite::Error> {
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
    pub(super) fn wrote(&mut self, seq: i64, id: Ulid) {
        if self.lo == Some(seq & !((1 << ROW_BITS) - 1)) {
            self.last = Some(self.last.map_or(seq, |l| l.max(seq)));
            self.ids.insert(id);
        }
    }

    pub(super) fn forget(&mut self) {
        self.lo = None;
    }
}
