//! The in-process backend: for tests and throwaway runs. It keeps the whole contract —
//! dead letters stay listable, parked items keep their order, commits are all-or-nothing —
//! but nothing survives the process, and it says so (`durable: false`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use ulid::Ulid;

use crate::replies::Replies;
use crate::{
    now_ms, Claimed, Committed, DoneKey, End, Failpoints, ItemState, ItemView, ListFilter, Message,
    QueueError, Reply, StateError, StateKey, StateRead, Stats, Versioned, WaveEffects, WorkItem,
    WorkQueue,
};

/// How many finished items are kept for `get` (the operator's "what became of my event").
const FINISHED_KEPT: usize = 10_000;

#[derive(Debug)]
enum St {
    Ready,
    InFlight {
        consumer: String,
        since: i64,
        at: Instant,
    },
    Delayed,
    Parked,
    Dead {
        reason: String,
        at: i64,
    },
    Finished {
        outcome: String,
        at: i64,
    },
}

#[derive(Debug)]
struct Entry {
    item: WorkItem,
    seq: u64,
    lease: u64,
    st: St,
}

#[derive(Default)]
struct Inner {
    seq: u64,
    lease: u64,
    entries: HashMap<Ulid, Entry>,
    ready: BTreeMap<u64, Ulid>,
    delayed: BTreeSet<(i64, u64, Ulid)>,
    parked: HashMap<String, BTreeMap<u64, Ulid>>,
    dead: BTreeSet<(i64, Ulid)>,
    finished: VecDeque<Ulid>,
    state: HashMap<StateKey, Versioned>,
    paused: HashSet<String>,
    permits: HashSet<Ulid>,
    done: HashMap<DoneKey, Vec<Vec<Message>>>,
    idempotency: HashMap<String, Ulid>,
}

impl Inner {
    fn insert(&mut self, mut item: WorkItem, now: i64) {
        if self.entries.contains_key(&item.id) {
            // The same item added again (a retried add): the first is kept.
            return;
        }
        self.seq += 1;
        let seq = self.seq;
        let st = match item.not_before {
            Some(t) if t > now => {
                self.delayed.insert((t, seq, item.id));
                St::Delayed
            }
            _ => {
                item.not_before = None;
                self.ready.insert(seq, item.id);
                St::Ready
            }
        };
        self.entries.insert(
            item.id,
            Entry {
                item,
                seq,
                lease: 0,
                st,
            },
        );
    }

    /// Claim `id`, just taken out of the ready order, for `consumer`.
    fn take(&mut self, id: Ulid, consumer: &str, now: i64) -> Option<Claimed> {
        self.lease += 1;
        let lease = self.lease;
        let stepped = self.permits.contains(&id);
        let e = self.entries.get_mut(&id)?;
        e.item.deliveries += 1;
        e.lease = lease;
        e.st = St::InFlight {
            consumer: consumer.to_string(),
            since: now,
            at: Instant::now(),
        };
        Some(Claimed::new(e.item.clone(), lease, consumer, stepped))
    }

    fn insert_dead(&mut self, item: WorkItem, reason: String, at: i64) {
        self.seq += 1;
        self.dead.insert((at, item.id));
        self.entries.insert(
            item.id,
            Entry {
                item,
                seq: self.seq,
                lease: 0,
                st: St::Dead { reason, at },
            },
        );
    }

    /// Make `flow`'s parked items ready, back at their places in the journal order; how many.
    fn release_parked(&mut self, flow: &str) -> usize {
        let parked = self.parked.remove(flow).unwrap_or_default();
        let n = parked.len();
        for (seq, id) in parked {
            if let Some(e) = self.entries.get_mut(&id) {
                e.st = St::Ready;
                self.ready.insert(seq, id);
            }
        }
        n
    }

    /// Take an entry out of whatever index holds it.
    fn unindex(&mut self, id: Ulid) {
        let Some(e) = self.entries.get(&id) else {
            return;
        };
        match &e.st {
            St::Ready => {
                self.ready.remove(&e.seq);
            }
            St::Delayed => {
                self.delayed
                    .remove(&(e.item.not_before.unwrap_or(0), e.seq, id));
            }
            St::Parked => {
                if let Some(p) = self.parked.get_mut(&e.item.flow) {
                    p.remove(&e.seq);
                }
            }
            St::Dead { at, .. } => {
                self.dead.remove(&(*at, id));
            }
            St::InFlight { .. } | St::Finished { .. } => {}
        }
    }

    fn finish(&mut self, id: Ulid, outcome: String, at: i64) {
        self.unindex(id);
        if let Some(e) = self.entries.get_mut(&id) {
            e.st = St::Finished { outcome, at };
            self.finished.push_back(id);
        }
        while self.finished.len() > FINISHED_KEPT {
            if let Some(old) = self.finished.pop_front() {
                if matches!(
                    self.entries.get(&old).map(|e| &e.st),
                    Some(St::Finished { .. })
                ) {
                    self.entries.remove(&old);
                }
            }
        }
    }

    fn view(&self, e: &Entry) -> ItemView {
        let state = match &e.st {
            St::Ready => ItemState::Waiting,
            St::InFlight {
                consumer, since, ..
            } => ItemState::InFlight {
                consumer: consumer.clone(),
                since: *since,
            },
            St::Delayed => ItemState::Delayed {
                due: e.item.not_before.unwrap_or(0),
            },
            St::Parked => ItemState::Parked,
            St::Dead { reason, at } => ItemState::Dead {
                reason: reason.clone(),
                at: *at,
            },
            St::Finished { outcome, at } => ItemState::Finished {
                outcome: outcome.clone(),
                at: *at,
            },
        };
        ItemView {
            item: e.item.clone(),
            state,
        }
    }

    fn write_state(&mut self, key: StateKey, value: Option<serde_json::Value>) {
        let v = self.state.entry(key).or_default();
        v.version += 1;
        v.value = value;
    }
}

/// The in-process queue. Cheap to make: `MemoryQueue::new()`.
///
/// ```
/// # tokio_test_shim::block_on(async {
/// use weir_queue::{MemoryQueue, WorkItem, WorkQueue, WaveEffects, End, Committed};
/// use std::time::Duration;
/// let q = MemoryQueue::new();
/// q.add(vec![WorkItem::cascade("demo", "in", "test", vec![serde_json::json!({"payload": 1})])]).await?;
/// let claimed = q.claim("me", 10, Duration::ZERO).await?;
/// assert_eq!(claimed[0].item.deliveries, 1);
/// assert_eq!(q.commit(&claimed[0], WaveEffects::ending(End::Ack)).await?, Committed::Done);
/// # Ok::<(), weir_queue::QueueError>(()) }).unwrap();
/// # mod tokio_test_shim { pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
/// #   tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f) } }
/// ```
pub struct MemoryQueue {
    inner: Mutex<Inner>,
    ready: Notify,
    replies: Replies,
    max_ready: usize,
    failpoints: Failpoints,
}

impl Default for MemoryQueue {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryQueue {
    pub fn new() -> Self {
        Self::with_limits(100_000, Failpoints::new())
    }

    /// `max_ready`: past this many ready items `add` answers `Full`. `failpoints`: `commit`
    /// makes the next commit fail before anything is applied.
    pub fn with_limits(max_ready: usize, failpoints: Failpoints) -> Self {
        MemoryQueue {
            inner: Mutex::new(Inner::default()),
            ready: Notify::new(),
            replies: Replies::default(),
            max_ready,
            failpoints,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that
        // matters more than stopping the engine would, so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait::async_trait]
impl StateRead for MemoryQueue {
    async fn read(&self, key: &StateKey) -> Result<Versioned, StateError> {
        Ok(self.lock().state.get(key).cloned().unwrap_or_default())
    }

    async fn read_node(
        &self,
        flow: &str,
        node: &str,
    ) -> Result<Vec<(String, Versioned)>, StateError> {
        Ok(self
            .lock()
            .state
            .iter()
            .filter(|(k, v)| k.flow == flow && k.node == node && v.value.is_some())
            .map(|(k, v)| (k.key.clone(), v.clone()))
            .collect())
    }
}

#[async_trait::async_trait]
impl WorkQueue for MemoryQueue {
    async fn add(&self, items: Vec<WorkItem>) -> Result<(), QueueError> {
        let now = now_ms();
        {
            let mut g = self.lock();
            if g.ready.len() + items.len() > self.max_ready {
                return Err(QueueError::Full(g.ready.len()));
            }
            for item in items {
                g.insert(item, now);
            }
        }
        self.ready.notify_waiters();
        Ok(())
    }

    async fn add_idempotent(&self, key: &str, item: WorkItem) -> Result<(Ulid, bool), QueueError> {
        let id = item.id;
        {
            let mut g = self.lock();
            if let Some(first) = g.idempotency.get(key) {
                return Ok((*first, false));
            }
            if g.ready.len() >= self.max_ready {
                return Err(QueueError::Full(g.ready.len()));
            }
            g.idempotency.insert(key.to_string(), id);
            g.insert(item, now_ms());
        }
        self.ready.notify_waiters();
        Ok((id, true))
    }

    async fn add_tick(
        &self,
        key: &StateKey,
        tick: i64,
        item: WorkItem,
    ) -> Result<bool, QueueError> {
        {
            let mut g = self.lock();
            let last = g
                .state
                .get(key)
                .and_then(|v| v.value.as_ref())
                .and_then(|v| v.as_i64());
            if last.is_some_and(|l| l >= tick) {
                return Ok(false);
            }
            g.write_state(key.clone(), Some(tick.into()));
            g.insert(item, now_ms());
        }
        self.ready.notify_waiters();
        Ok(true)
    }

    async fn claim(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Claimed>, QueueError> {
        self.claim_passing(consumer, max, wait, &[]).await
    }

    async fn commit(&self, c: &Claimed, fx: WaveEffects) -> Result<Committed, QueueError> {
        let now = now_ms();
        {
            let mut g = self.lock();
            let id = c.item.id;
            match g.entries.get(&id) {
                Some(e) if e.lease == c.lease && matches!(e.st, St::InFlight { .. }) => {}
                _ => return Ok(Committed::Conflict),
            }
            for w in &fx.state {
                if g.state.get(&w.key).map(|v| v.version).unwrap_or(0) != w.read_version {
                    return Ok(Committed::Conflict);
                }
            }
            for (k, want) in &fx.guards {
                if g.state.get(k).and_then(|v| v.value.as_ref()) != Some(want) {
                    return Ok(Committed::Conflict);
                }
            }
            if fx.end == Some(End::Park) && !g.paused.contains(&c.item.flow) {
                return Ok(Committed::Conflict);
            }
            if self.failpoints.hit("commit") {
                return Err(QueueError::Unavailable("failpoint `commit` fired".into()));
            }
            // Checked: from here on nothing can fail, so the commit is all-or-nothing.
            for w in fx.state {
                g.write_state(w.key, w.value);
            }
            for item in fx.follow_ups.into_iter().chain(fx.delayed) {
                g.insert(item, now);
            }
            for (item, reason) in fx.dead {
                g.insert_dead(item, reason, now);
            }
            // Done markers live until the item ends; one delivered again keeps them.
            if !matches!(fx.end, Some(End::Later(_))) {
                g.done.retain(|k, _| k.item != id);
            }
            g.permits.remove(&id);
            match fx.end.unwrap_or(End::Ack) {
                End::Ack => g.finish(id, fx.outcome.unwrap_or_else(|| "done".into()), now),
                End::Superseded => g.finish(id, "superseded by a newer timer".into(), now),
                End::DeadLetter(reason) => {
                    g.dead.insert((now, id));
                    if let Some(e) = g.entries.get_mut(&id) {
                        e.st = St::Dead { reason, at: now };
                    }
                }
                End::Park => {
                    let flow = c.item.flow.clone();
                    if let Some(e) = g.entries.get_mut(&id) {
                        e.st = St::Parked;
                        let seq = e.seq;
                        g.parked.entry(flow).or_default().insert(seq, id);
                    }
                }
                End::Later(due) => {
                    if let Some(e) = g.entries.get_mut(&id) {
                        e.st = St::Delayed;
                        e.item.not_before = Some(due);
                        let seq = e.seq;
                        g.delayed.insert((due, seq, id));
                    }
                }
            }
        }
        self.ready.notify_waiters();
        Ok(Committed::Done)
    }

    async fn reclaim_stale(&self, min_idle: Duration) -> Result<usize, QueueError> {
        let mut n = 0;
        {
            let mut g = self.lock();
            let stale: Vec<(Ulid, u64)> = g
                .entries
                .iter()
                .filter(
                    |(_, e)| matches!(&e.st, St::InFlight { at, .. } if at.elapsed() >= min_idle),
                )
                .map(|(id, e)| (*id, e.seq))
                .collect();
            for (id, seq) in stale {
                if let Some(e) = g.entries.get_mut(&id) {
                    e.st = St::Ready;
                    g.ready.insert(seq, id);
                    n += 1;
                }
            }
        }
        if n > 0 {
            self.ready.notify_waiters();
        }
        Ok(n)
    }

    async fn move_due(&self, now: i64) -> Result<usize, QueueError> {
        let mut n = 0;
        {
            let mut g = self.lock();
            while let Some(&(t, seq, id)) = g.delayed.first() {
                if t > now {
                    break;
                }
                g.delayed.remove(&(t, seq, id));
                g.seq += 1;
                let new_seq = g.seq;
                if let Some(e) = g.entries.get_mut(&id) {
                    e.seq = new_seq;
                    e.item.not_before = None;
                    e.st = St::Ready;
                    g.ready.insert(new_seq, id);
                    n += 1;
                }
            }
        }
        if n > 0 {
            self.ready.notify_waiters();
        }
        Ok(n)
    }

    async fn next_due(&self) -> Result<Option<i64>, QueueError> {
        Ok(self.lock().delayed.first().map(|(t, _, _)| *t))
    }

    async fn mark_done(&self, key: DoneKey, outputs: Vec<Vec<Message>>) -> Result<(), QueueError> {
        self.lock().done.insert(key, outputs);
        Ok(())
    }

    async fn was_done(&self, key: &DoneKey) -> Result<Option<Vec<Vec<Message>>>, QueueError> {
        Ok(self.lock().done.get(key).cloned())
    }

    async fn post_reply(&self, id: Ulid, reply: Reply) -> Result<(), QueueError> {
        self.replies.post(id, reply);
        Ok(())
    }

    async fn wait_reply(&self, id: Ulid, wait: Duration) -> Result<Option<Reply>, QueueError> {
        Ok(self.replies.wait(id, wait).await)
    }
}

#[async_trait::async_trait]
impl crate::ClaimOnAdd for MemoryQueue {
    async fn add_claimed(
        &self,
        consumer: &str,
        item: WorkItem,
    ) -> Result<Option<Claimed>, QueueError> {
        let now = now_ms();
        let id = item.id;
        let claimed = {
            let mut g = self.lock();
            if g.ready.len() >= self.max_ready {
                return Err(QueueError::Full(g.ready.len()));
            }
            // Only when nothing else is ready: it passes nothing in the ready order.
            let first = g.ready.is_empty() && !g.entries.contains_key(&id);
            g.insert(item, now);
            match first {
                true => match g.entries.get(&id).map(|e| (e.seq, &e.st)) {
                    Some((seq, St::Ready)) => {
                        g.ready.remove(&seq);
                        g.take(id, consumer, now)
                    }
                    _ => None,
                },
                false => None,
            }
        };
        if claimed.is_none() {
            self.ready.notify_waiters();
        }
        Ok(claimed)
    }
}

mod admin;

impl From<MemoryQueue> for crate::Queue {
    fn from(q: MemoryQueue) -> Self {
        let q = std::sync::Arc::new(q);
        crate::Queue::new(q.clone(), false)
            .with_claim_on_add(q.clone())
            .with_skips_flows(q)
    }
}

#[async_trait::async_trait]
impl crate::SkipsFlows for MemoryQueue {
    async fn claim_skipping(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
        skip: std::sync::Arc<[String]>,
    ) -> Result<Vec<Claimed>, QueueError> {
        self.claim_passing(consumer, max, wait, &skip).await
    }
}

impl MemoryQueue {
    /// Claim up to `max` ready items in journal order, passing over those of the flows in
    /// `skip`, waiting up to `wait` for one.
    async fn claim_passing(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
        skip: &[String],
    ) -> Result<Vec<Claimed>, QueueError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut g = self.lock();
                let mut out = Vec::new();
                let now = now_ms();
                if skip.is_empty() {
                    while out.len() < max {
                        let Some((_, id)) = g.ready.pop_first() else {
                            break;
                        };
                        out.extend(g.take(id, consumer, now));
                    }
                } else {
                    let chosen: Vec<(u64, Ulid)> = g
                        .ready
                        .iter()
                        .filter(|(_, id)| {
                            g.entries
                                .get(id)
                                .is_none_or(|e| !skip.contains(&e.item.flow))
                        })
                        .take(max)
                        .map(|(s, id)| (*s, *id))
                        .collect();
                    for (seq, id) in chosen {
                        g.ready.remove(&seq);
                        out.extend(g.take(id, consumer, now));
                    }
                }
                if !out.is_empty() {
                    return Ok(out);
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Ok(Vec::new());
            }
        }
    }
}
