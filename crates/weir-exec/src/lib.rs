//! The executor: claims work items, runs each item's wave through its flow's graph until
//! quiescence, and ends the item with one atomic commit of everything the wave did.
//!
//! Order and concurrency: items are claimed in journal order and started in that order per
//! flow, at most `concurrency` at a time: at once when the flow has a free place and nothing
//! waiting, otherwise by the flow's dispatcher, which takes them in turn. Waves that
//! may call a stateful node (delay, a function with state) queue for it in journal order and
//! hold it until their commit returns, so a node's memory sees its messages in order; the
//! version check in the commit catches conflicts with other engines, and the wave runs again.

mod flows;
mod wave;

pub(crate) use flows::Ended;
pub use flows::{FlowRt, Flows, NodeCounts};
pub use wave::{RunRecord, RUNS};

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use weir_core::{now_ms, Failpoints};
use weir_queue::{Claimed, Queue, QueueError, WorkItem};
use weir_triggers::{StartHere, StartedWave};

/// Executor settings.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// This engine's name as a consumer of the queue.
    pub consumer: String,
    /// Deliveries after which an item that never finishes is dead-lettered; also the number
    /// of tries of an unclassified node failure.
    pub max_deliveries: u32,
    /// Node calls one wave may make; past it the wave (a loop in the graph) is dead-lettered.
    pub step_bound: usize,
    pub node_timeout: Duration,
    pub wave_deadline: Duration,
    /// In-flight items idle this long are taken back (their engine died or stalled).
    pub reclaim_after: Duration,
    pub claim_batch: usize,
    /// Items claimed and not yet committed, across all flows. Each claim counts a delivery,
    /// so claiming far ahead of what can run would charge an engine that keeps crashing with
    /// deliveries of items that never started (and dead-letter them at the ceiling). The
    /// waves a webhook starts itself (`start_claimed`) are bounded apart, by as many again:
    /// the executor's claims wait in the backend holding their share of this bound, so the
    /// two cannot share it without those waves never finding a place.
    pub max_in_flight: usize,
    /// Of those, items claimed and not yet started (waiting for their flow's turn) at most.
    /// An item that waits in an engine longer than `reclaim_after` is taken back as stalled
    /// and delivered again, and the copies pile up behind the same slow flow: so the items
    /// an engine holds unstarted stay few, and the rest of `max_in_flight` is waves running
    /// or waiting for their commit.
    pub max_waiting: usize,
    /// Transient failures retry until the item is this old.
    pub max_age: Duration,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    /// How long shutdown waits for waves in flight.
    pub shutdown_grace: Duration,
    /// Outcomes, dead letters and run records older than this are pruned (with a count in
    /// the metrics and the log).
    pub retention: Duration,
    /// Items parked per paused flow at most; past it an item is dead-lettered with the
    /// reason instead of parked (a pause forgotten for days must not grow without end).
    pub max_parked: usize,
    /// How often to prune past the retention (the first time a minute after start at most).
    pub prune_every: Duration,
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            consumer: consumer_name(),
            max_deliveries: 5,
            step_bound: 1000,
            node_timeout: Duration::from_secs(30),
            wave_deadline: Duration::from_secs(60),
            reclaim_after: Duration::from_secs(120),
            claim_batch: 64,
            // A wave that ends in a side effect waits for its broker or server (an MQTT
            // PUBACK) and then its commit: 64 at once held MQTT in → function → out to a third
            // of what 256 do (benches/mqtt.rs); webhook loads are the same either way.
            max_in_flight: 256,
            // 256 waiting behind a rate-limited flow, with a 2 s reclaim delay, were taken
            // back again and again until dead-lettered (tests/chaos.rs on a loaded machine).
            max_waiting: 64,
            max_age: Duration::from_secs(24 * 3600),
            retry_base: Duration::from_secs(1),
            retry_cap: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
            prune_every: Duration::from_secs(600),
            max_parked: 100_000,
        }
    }
}

/// A consumer name an operator can read and no other engine shares: host, process id and a
/// random suffix (`web-1-4242-7kq2m`), as `XINFO CONSUMERS` and `weir queue show` print it.
pub fn consumer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "weir".into());
    // The ULID's last characters are its random part.
    let id = ulid::Ulid::new().to_string().to_lowercase();
    format!("{host}-{}-{}", std::process::id(), &id[id.len() - 5..])
}

pub struct Executor {
    pub queue: Queue,
    pub flows: Arc<Flows>,
    pub cfg: ExecConfig,
    pub failpoints: Failpoints,
    /// Every wave this executor runs, the ones its callers start ([`Executor::start_claimed`])
    /// with those it claims: shutdown waits for all of them.
    waves: TaskTracker,
    /// The waves its callers start running now, at most `max_in_flight` (each flow's
    /// `concurrency` alone would let a thousand flows run sixteen thousand). A count, not a
    /// semaphore: nothing ever waits for it, and a semaphore's permit locks its list of
    /// waiters when it is given back.
    started_here: Arc<AtomicUsize>,
    /// `weir_bounds_hit_total{bound="webhook_waves"}`, made at its first use and kept: under
    /// a sustained load past the bound every request counts one.
    started_here_full: std::sync::OnceLock<metrics::Counter>,
}

/// A place for a wave its caller journals claimed and starts itself
/// ([`Executor::place_for`]): its share of the flow's concurrency, held until the wave runs.
pub struct Place {
    flow: Arc<FlowRt>,
    permit: OwnedSemaphorePermit,
    /// Its share of the engine's bound on such waves.
    engine: StartedHere,
}

/// One of the waves an engine's callers start, counted in `Executor::started_here` until
/// it is dropped (however its wave ends).
struct StartedHere(Arc<AtomicUsize>);

impl Drop for StartedHere {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The executor as triggers reach it ([`Executor::starter`]).
struct Starter(Arc<Executor>);

#[async_trait::async_trait]
impl StartHere for Starter {
    async fn journal_and_start(&self, item: WorkItem) -> Result<Option<StartedWave>, QueueError> {
        let ex = &self.0;
        let here = ex
            .queue
            .claim_on_add()
            .and_then(|adder| Some((adder, ex.place_for(&item.flow, &item.node)?)));
        let Some((adder, place)) = here else {
            ex.queue.add(vec![item]).await?;
            return Ok(None);
        };
        let claimed = adder.add_claimed(&ex.cfg.consumer, item).await?;
        Ok(claimed.map(|c| ex.start_claimed(place, c)))
    }
}

/// A claimed item on its way to its wave, with its share of the in-flight bound.
struct Job {
    claimed: Claimed,
    _permit: OwnedSemaphorePermit,
    /// Given back when the wave starts.
    waiting: OwnedSemaphorePermit,
}

type Permits = (OwnedSemaphorePermit, OwnedSemaphorePermit);

/// A claim waiting in the backend, with the permits (in flight, waiting) it asked for.
struct Claim {
    permits: Permits,
    claim: Pin<Box<dyn Future<Output = Result<Vec<Claimed>, QueueError>> + Send>>,
    answer: Option<Result<Vec<Claimed>, QueueError>>,
}

/// The claims waiting in the backend, in the order they were made. They are futures polled
/// here, not tasks: each is first polled (and so reaches the backend) in the order made, and
/// the answers are taken in that order, which is the order the backend answers them in
/// (journal order). As tasks, whichever a worker thread ran first reached SQLite's writer
/// first, and whichever finished first was taken first: the items of a later claim started
/// before an earlier one's, out of order within a flow
/// (`a_burst_over_two_flows_keeps_each_flows_journal_order`).
#[derive(Default)]
struct Claims(VecDeque<Claim>);

impl Claims {
    /// Poll every claim not yet answered, in order; ready when the first is answered.
    fn poll_first(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<(Permits, Result<Vec<Claimed>, QueueError>)> {
        for c in self.0.iter_mut().filter(|c| c.answer.is_none()) {
            if let Poll::Ready(a) = c.claim.as_mut().poll(cx) {
                c.answer = Some(a);
            }
        }
        // Not answered yet: the first claim was polled just above, so it wakes this task.
        let Some(answer) = self.0.front_mut().and_then(|c| c.answer.take()) else {
            return Poll::Pending;
        };
        let first = self
            .0
            .pop_front()
            .expect("the claim just answered is first");
        Poll::Ready((first.permits, answer))
    }
}

/// A flow's dispatcher, made the first time one of its items has to wait for a place: the
/// items it holds, in journal order, and how many it has not yet started.
struct Lane {
    tx: mpsc::UnboundedSender<Job>,
    behind: Arc<AtomicUsize>,
}

impl Executor {
    pub fn new(
        queue: Queue,
        flows: Arc<Flows>,
        cfg: ExecConfig,
        failpoints: Failpoints,
    ) -> Arc<Self> {
        Arc::new(Executor {
            queue,
            flows,
            cfg,
            failpoints,
            waves: TaskTracker::new(),
            started_here: Arc::new(AtomicUsize::new(0)),
            started_here_full: std::sync::OnceLock::new(),
        })
    }

    /// A place to start a wave of `flow` from `node` right where its item is journaled, with
    /// no claim between (a `respond: wave` webhook, whose answer waits for the wave): when
    /// the queue can claim an item as it journals it, the flow runs waves side by side
    /// (`concurrency` over 1) and has a place free now, the engine runs fewer such waves than
    /// `max_in_flight`, and the wave can reach no stateful node (whose calls queue in
    /// journal order). `None` otherwise: journal the item as usual and the executor claims
    /// it. Order is kept: a flow's items waiting for a place
    /// hold the flow's semaphore's queue, so none is free while they wait, and the item is
    /// journaled claimed only when no other is ready.
    pub fn place_for(&self, flow: &str, node: &str) -> Option<Place> {
        if self.queue.claim_on_add().is_none() || self.waves.is_closed() {
            return None;
        }
        let f = self.flows.get(flow)?;
        let n = f.flow.node_index(node)?;
        if f.flow.concurrency <= 1 || !f.flow.stateful_from(n).is_empty() {
            return None;
        }
        let engine = StartedHere(self.started_here.clone());
        if engine.0.fetch_add(1, Ordering::AcqRel) >= self.cfg.max_in_flight.max(1) {
            // Not an error: the executor claims the item instead. Counted, as every bound is.
            self.started_here_full
                .get_or_init(
                    || metrics::counter!("weir_bounds_hit_total", "bound" => "webhook_waves"),
                )
                .increment(1);
            return None;
        }
        let permit = f.permits.clone().try_acquire_owned().ok()?;
        Some(Place {
            flow: f,
            permit,
            engine,
        })
    }

    /// The wave of `c`, journaled claimed by this engine (`ClaimOnAdd::add_claimed`) into
    /// `place`, for its caller to run as far as it needs (a webhook, until its reply); what
    /// is left goes on as a task of its own when the caller drops it.
    pub fn start_claimed(self: &Arc<Self>, place: Place, c: Claimed) -> StartedWave {
        let me = self.clone();
        let wave = async move {
            me.process(Some(place.flow), c, Some(place.permit)).await;
            drop(place.engine);
        };
        StartedWave::new(self.waves.track_future(wave))
    }

    /// The handle through which triggers journal an event and start its wave here
    /// ([`StartHere`]): the webhook fast path.
    pub fn starter(self: &Arc<Self>) -> Arc<dyn StartHere> {
        Arc::new(Starter(self.clone()))
    }

    /// Run until `shutdown` fires: stop claiming, finish the waves in flight (up to the
    /// grace period), return. What is left is redelivered on the next start.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let tracker = self.waves.clone();
        let in_flight = Arc::new(Semaphore::new(self.cfg.max_in_flight));
        let waiting = Arc::new(Semaphore::new(self.cfg.max_waiting.max(1)));
        let mut lanes: HashMap<String, Lane, foldhash::fast::RandomState> = HashMap::default();
        let mut failures: u32 = 0;
        let mut last_reclaim = tokio::time::Instant::now();
        // The first prune comes a minute after start (sooner if pruning is more frequent).
        let every = self.cfg.prune_every;
        let mut last_prune =
            tokio::time::Instant::now() - every + every.min(Duration::from_secs(60));
        // Items a previous run under this consumer name left in flight are taken back at
        // once; any other engine's only after `reclaim_after`.
        let recovered = match self.queue.consumers() {
            Some(c) => c.recover(&self.cfg.consumer).await,
            None => Ok(0),
        };
        match recovered {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(count = n, consumer = %self.cfg.consumer, "took back the items an earlier run of this engine left in flight")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not look for items an earlier run left in flight; they come back after the reclaim delay")
            }
        }
        // `claims_ahead` claims wait in the backend at once, each holding the in-flight
        // permits it asked for (see [`Claims`]).
        let mut claims = Claims::default();
        let ahead = self
            .queue
            .claims_wait()
            .map_or(1, |c| c.claims_ahead().max(1));
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let housekeeping = async {
                let promotes = self.queue.claims_wait().is_some();
                if !promotes {
                    self.queue.move_due(now_ms()).await?;
                }
                if last_reclaim.elapsed()
                    >= self
                        .cfg
                        .reclaim_after
                        .min(Duration::from_secs(10))
                        .max(Duration::from_millis(200))
                {
                    last_reclaim = tokio::time::Instant::now();
                    let n = self.queue.reclaim_stale(self.cfg.reclaim_after).await?;
                    if n > 0 {
                        tracing::warn!(
                            count = n,
                            "took back items idle in flight (a stalled or dead engine)"
                        );
                    }
                }
                if last_prune.elapsed() >= every {
                    last_prune = tokio::time::Instant::now();
                    self.prune().await;
                }
                let wait = match promotes {
                    true => Duration::from_millis(100),
                    false => match self.queue.next_due().await? {
                        Some(t) => Duration::from_millis((t - now_ms()).clamp(1, 100) as u64),
                        None => Duration::from_millis(100),
                    },
                };
                Ok::<_, weir_queue::QueueError>(wait)
            };
            let ready = tokio::select! {
                _ = shutdown.cancelled() => break,
                r = housekeeping => r,
            };
            let claimed = match ready {
                Ok(wait) => {
                    // Flows whose waves are all taken and as many more wait their turn: the
                    // claims pass over their ready items, so that another flow's next item
                    // is not held up behind their backlog (where the backend can). With one
                    // flow there is nothing to pass over to, and a claim that passes over
                    // items still reads them.
                    let skip: Option<Arc<[String]>> = match self.queue.skips_flows() {
                        Some(_) if self.flows.count() > 1 => {
                            let full: Vec<String> = lanes
                                .iter()
                                .filter(|(flow, l)| {
                                    let behind = l.behind.load(Ordering::Acquire);
                                    behind > 0
                                        && self
                                            .flows
                                            .get(flow)
                                            .is_none_or(|f| behind >= f.flow.concurrency.max(1))
                                })
                                .map(|(flow, _)| flow.clone())
                                .collect();
                            (!full.is_empty()).then(|| full.into())
                        }
                        _ => None,
                    };
                    while claims.0.len() < ahead {
                        // The free permits shared among the claims still to be made.
                        let free = in_flight
                            .available_permits()
                            .min(waiting.available_permits())
                            .div_ceil(ahead - claims.0.len())
                            .min(self.cfg.claim_batch);
                        let Some(permits) = (free > 0)
                            .then(|| {
                                let p = in_flight.clone().try_acquire_many_owned(free as u32);
                                let w = waiting.clone().try_acquire_many_owned(free as u32);
                                p.ok().zip(w.ok())
                            })
                            .flatten()
                        else {
                            break;
                        };
                        let (queue, consumer) = (self.queue.clone(), self.cfg.consumer.clone());
                        let skip = skip.clone();
                        claims.0.push_back(Claim {
                            permits,
                            answer: None,
                            claim: Box::pin(async move {
                                match (queue.skips_flows(), skip) {
                                    // Not long: what it passes over is being worked on, and
                                    // once that flow has room again it is claimed from too.
                                    (Some(s), Some(skip)) => {
                                        let wait = wait.min(SKIPPING_WAIT);
                                        s.claim_skipping(&consumer, free, wait, skip).await
                                    }
                                    _ => queue.claim(&consumer, free, wait).await,
                                }
                            }),
                        });
                    }
                    if claims.0.is_empty() {
                        // Every permit is with a wave: wait for one to end.
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                        }
                        continue;
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        (permits, answer) = std::future::poll_fn(|cx| claims.poll_first(cx)) => {
                            answer.map(|items| (permits, items))
                        }
                    }
                }
                Err(e) => Err(e),
            };
            match claimed {
                Ok(((mut permits, mut waits), items)) => {
                    if failures > 0 {
                        tracing::info!(failures, "queue backend is back");
                        failures = 0;
                    }
                    for c in items {
                        // One of the permits the claim asked for goes with each item; what
                        // is left over goes back when `permits` is dropped.
                        let (Some(permit), Some(waiting)) = (permits.split(1), waits.split(1))
                        else {
                            tracing::error!("in-flight bound exceeded; item left for redelivery");
                            continue;
                        };
                        let job = Job {
                            claimed: c,
                            _permit: permit,
                            waiting,
                        };
                        // With nothing of its flow waiting before it and a place free, the
                        // wave starts here: one task, not a hand-off to the flow's dispatcher
                        // and a wake of it for every item (with many flows, most items are
                        // the only one of their flow in a claim).
                        let lane = lanes.get(&job.claimed.item.flow);
                        let job = if lane.is_none_or(|l| l.behind.load(Ordering::Acquire) == 0) {
                            match self.try_start(job, &tracker) {
                                None => continue,
                                Some(job) => job,
                            }
                        } else {
                            job
                        };
                        let lane =
                            lanes
                                .entry(job.claimed.item.flow.clone())
                                .or_insert_with(|| {
                                    let (tx, rx) = mpsc::unbounded_channel();
                                    let behind = Arc::new(AtomicUsize::new(0));
                                    let (me, tr, b) =
                                        (self.clone(), tracker.clone(), behind.clone());
                                    tracker.spawn(async move { me.dispatch(rx, b, tr).await });
                                    Lane { tx, behind }
                                });
                        lane.behind.fetch_add(1, Ordering::AcqRel);
                        let _ = lane.tx.send(job);
                    }
                }
                Err(e) => {
                    failures += 1;
                    // Log the first failure of a run and then every 50th, not every try.
                    if failures == 1 || failures.is_multiple_of(50) {
                        tracing::error!(error = %e, failures, "queue backend failing; backing off");
                    }
                    let backoff = Duration::from_millis(50u64.saturating_mul(1 << failures.min(7)))
                        .min(Duration::from_secs(5));
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
        // Claims still waiting are dropped: what the backend hands them after this goes
        // back to it (SQLite makes an unreceived answer ready again; `release` below).
        drop(claims);
        drop(lanes);
        tracker.close();
        if tokio::time::timeout(self.cfg.shutdown_grace, tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("waves still running at the end of the shutdown grace period; they will be redelivered");
        }
        // What this engine still holds goes back to the queue now, not after the reclaim
        // delay; a wave still running past the grace period has its commit refused.
        let released = match self.queue.consumers() {
            Some(c) => c.release(&self.cfg.consumer).await,
            None => Ok(0),
        };
        match released {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                count = n,
                "handed back the items this engine held but did not finish"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not hand back the items this engine holds; other engines take them after the reclaim delay")
            }
        }
    }

    /// Retention: drop what ended longer ago than `retention`, and say how much.
    pub async fn prune(&self) {
        let before = now_ms() - self.cfg.retention.as_millis() as i64;
        match self.queue.admin().prune(before).await {
            Ok(p) => {
                for (what, n) in [
                    ("outcomes", p.outcomes),
                    ("dead_letters", p.dead),
                    ("runs", p.runs),
                ] {
                    if n > 0 {
                        metrics::counter!("weir_pruned_total", "what" => what).increment(n as u64);
                    }
                }
                if p != Default::default() {
                    tracing::info!(outcomes = p.outcomes, dead_letters = p.dead, runs = p.runs, retention = ?self.cfg.retention, "pruned past the retention");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not prune past the retention; trying again later")
            }
        }
    }

    /// Start `job`'s wave now if its flow has a place free; give the job back if not.
    fn try_start(self: &Arc<Self>, job: Job, tracker: &TaskTracker) -> Option<Job> {
        let flow = self.flows.get(&job.claimed.item.flow);
        let permit = match &flow {
            Some(f) => match f.permits.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => return Some(job),
            },
            None => None,
        };
        self.start(flow, permit, job, tracker);
        None
    }

    /// Take `job`'s places in line at the stateful nodes its wave may call (journal order:
    /// the caller starts a flow's items in that order) and run the wave as a task.
    fn start(
        self: &Arc<Self>,
        flow: Option<Arc<FlowRt>>,
        permit: Option<OwnedSemaphorePermit>,
        job: Job,
        tracker: &TaskTracker,
    ) {
        let (wait, hold) = match &flow {
            Some(f) => {
                let serial = f
                    .flow
                    .node_index(&job.claimed.item.node)
                    .map(|n| f.flow.stateful_from(n))
                    .unwrap_or_default();
                f.queue_for(serial)
            }
            None => (Vec::new(), Vec::new()),
        };
        let me = self.clone();
        tracker.spawn(async move {
            for w in wait {
                let _ = w.await;
            }
            drop(job.waiting);
            // Boxed: a wave's future is large, and a task's future is moved whole on its
            // way into the runtime, several times (its stage rewritten whole again at the
            // end). A box moves as a pointer.
            Box::pin(me.process(flow, job.claimed, permit)).await;
            drop(hold);
            drop(job._permit);
        });
    }

    /// One flow's dispatcher: starts the waves that found no free place, in journal order,
    /// as places free up; `behind` counts those not yet started.
    async fn dispatch(
        self: Arc<Self>,
        mut rx: mpsc::UnboundedReceiver<Job>,
        behind: Arc<AtomicUsize>,
        tracker: TaskTracker,
    ) {
        while let Some(job) = rx.recv().await {
            let flow = self.flows.get(&job.claimed.item.flow);
            let permit = match &flow {
                Some(f) => f.permits.clone().acquire_owned().await.ok(),
                None => None,
            };
            self.start(flow, permit, job, &tracker);
            // Counted down only once the wave has its places in line, so that the run loop
            // starts nothing of this flow ahead of it.
            behind.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The longest a claim that passes over some flows waits for work: the flows it passes over
/// have room again as soon as their waves move on.
const SKIPPING_WAIT: Duration = Duration::from_millis(5);

/// Backoff for try `attempt` (1-based): base·2^(attempt-1), capped, with ±20% jitter (so
/// items that failed together do not all come back together), never past the cap.
pub fn backoff(base: Duration, cap: Duration, attempt: u32) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
    let jitter: f64 = rand::random_range(0.8..1.2);
    exp.min(cap).mul_f64(jitter).min(cap)
}

#[cfg(test)]
mod tests;
