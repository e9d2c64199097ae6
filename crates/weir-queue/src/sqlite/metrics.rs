//! The SQLite queue's metrics, recorded through handles made once per thread.

use std::time::Duration;

/// What waited for the writer's durable answer, as `weir_sqlite_wait_seconds` labels it.
#[derive(Clone, Copy)]
pub(super) enum Wait {
    /// An event journaled (what a webhook's answer waits for).
    Journal,
    /// A wave's commit.
    Commit,
    /// Anything else: the operator's changes, timers, markers.
    Other,
}

impl Wait {
    pub(super) fn record(self, waited: Duration) {
        let at = match self {
            Wait::Journal => 0,
            Wait::Commit => 1,
            Wait::Other => 2,
        };
        with_metrics(|m| m.waits[at].record(waited.as_secs_f64()));
    }
}

/// The SQLite queue's metrics, as handles. Looking a series up by its name and labels at
/// each use builds a key, hashes it and searches the recorder's registry, several times a
/// request; a handle records directly.
pub(super) struct Metrics {
    /// `weir_sqlite_wait_seconds`: journal, commit, other ([`Wait::record`]).
    pub(super) waits: [metrics::Histogram; 3],
    pub(super) transactions: metrics::Counter,
    pub(super) jobs: metrics::Counter,
    pub(super) commit: metrics::Histogram,
}

impl Metrics {
    pub(super) fn new() -> Self {
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
pub(super) fn with_metrics(f: impl FnOnce(&Metrics)) {
    let recorder =
        metrics::with_recorder(|r| (r as *const dyn metrics::Recorder).cast::<()>() as usize);
    METRICS.with_borrow_mut(|kept| match kept {
        Some((at, m)) if *at == recorder => f(m),
        _ => f(&kept.insert((recorder, Metrics::new())).1),
    });
}
