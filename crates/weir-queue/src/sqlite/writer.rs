//! The writer thread: it gathers jobs, runs them in one transaction, commits once, and only
//! then answers every member (group commit).

use std::sync::mpsc;
use std::time::Duration;

use rusqlite::Connection;
use ulid::Ulid;

use super::kept::*;
use super::metrics::*;
use super::stmt::*;
use super::tx::*;
use crate::{now_ms, QueueError};

/// After a rolled-back batch: what the writer keeps in memory of the file (the ready count,
/// the marked items, the items in flight and the finished ones) read from it again, since
/// the batch had moved it.
pub(super) fn recount_after_rollback(conn: &Db<'_>, w: &mut Writer) {
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

pub(super) fn write_loop(
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
                            claim_ready(&conn, &mut w, &x.consumer, x.max, x.skip.as_deref())
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
pub(super) fn gather(
    rx: &mpsc::Receiver<Msg>,
    first: Option<Msg>,
    batch: &mut Vec<Job>,
    room: usize,
) -> bool {
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
pub(super) fn guarded<R>(
    conn: &Db<'_>,
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
pub(super) fn marked_items(c: &Db<'_>) -> Result<std::collections::HashSet<Ulid>, rusqlite::Error> {
    let ids: Vec<String> = c
        .cached("SELECT DISTINCT item FROM done")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(ids
        .iter()
        .filter_map(|i| Ulid::from_string(i).ok())
        .collect())
}

/// Make the delayed items due now ready, and look up when the next one is due.
pub(super) fn promote_due(c: &Db<'_>, w: &mut Writer) -> Result<(), QueueError> {
    make_ready(
        c,
        w,
        "SELECT seq FROM items WHERE st = 'delayed' AND due <= ?1 ORDER BY due, seq",
        [now_ms()],
    )?;
    w.next_due = c
        .cached("SELECT min(due) FROM items WHERE st = 'delayed'")?
        .query_row([], |r| r.get(0))?;
    Ok(())
}

/// Answer the claimers whose wait is over (nothing came) or who have gone.
pub(super) fn expire_waiters(w: &mut Writer) {
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
pub(super) fn serve_waiters(
    conn: &Db<'_>,
    w: &mut Writer,
    held: &mut Vec<Held>,
    poison: &mut Option<String>,
) {
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
        let got = guarded(conn, poison, || {
            claim_ready(conn, w, &x.consumer, room, x.skip.as_deref())
        });
        // A claim that passes over some flows finding too little says nothing of the
        // claims after it.
        let all = x.skip.is_none();
        match got {
            Ok(items) if items.is_empty() && taken.is_empty() => {
                dry = all;
                rest.push(x);
            }
            Ok(items) => {
                dry = all && items.len() < room;
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
pub(super) fn ready_again(c: &Db<'_>, w: &mut Writer, seqs: &[i64]) -> Result<usize, QueueError> {
    let mut up = c.cached(
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
