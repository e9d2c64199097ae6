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

#[async_trait::async_trait]
impl crate::Admin for MemoryQueue {
    async fn delayed_by_node(
        &self,
        flow: &str,
    ) -> Result<std::collections::BTreeMap<String, u64>, QueueError> {
        let g = self.lock();
        let mut held = std::collections::BTreeMap::new();
        for e in g.entries.values() {
            if matches!(e.st, St::Delayed)
                && e.item.flow == flow
                && e.item.kind != crate::ItemKind::Flush
            {
                *held.entry(e.item.node.clone()).or_default() += 1;
            }
        }
        Ok(held)
    }

    async fn dead_ids(
        &self,
        flow: Option<&str>,
        reason: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Ulid>, QueueError> {
        let g = self.lock();
        Ok(g.dead
            .iter()
            .rev()
            .filter_map(|(_, id)| g.entries.get(id))
            .filter(|e| flow.is_none_or(|f| f == e.item.flow))
            .filter(|e| match (&e.st, reason) {
                (_, None) => true,
                (St::Dead { reason, .. }, Some(want)) => reason.contains(want),
                _ => false,
            })
            .take(limit)
            .map(|e| e.item.id)
            .collect())
    }

    async fn prune(&self, before: i64) -> Result<crate::Pruned, QueueError> {
        let mut g = self.lock();
        let mut p = crate::Pruned::default();
        let old: Vec<(Ulid, bool)> = g
            .entries
            .iter()
            .filter_map(|(id, e)| match e.st {
                St::Finished { at, .. } if at < before => Some((*id, false)),
                St::Dead { at, .. } if at < before => Some((*id, true)),
                _ => None,
            })
            .collect();
        for (id, dead) in old {
            g.unindex(id);
            g.entries.remove(&id);
            if dead {
                p.dead += 1;
            } else {
                p.outcomes += 1;
            }
        }
        // Idempotency keys live a day, or the retention if shorter; an item's id says when
        // its key was set.
        let since = before.max(now_ms() - 24 * 3600 * 1000);
        g.idempotency
            .retain(|_, id| i64::try_from(id.timestamp_ms()).unwrap_or(i64::MAX) >= since);
        let Inner {
            finished, entries, ..
        } = &mut *g;
        finished.retain(|id| entries.contains_key(id));
        let runs: Vec<StateKey> = g
            .state
            .iter()
            .filter(|(k, v)| {
                k.node == crate::RUNS_NODE
                    && v.value
                        .as_ref()
                        .and_then(|r| r["updated_at"].as_i64())
                        .is_some_and(|t| t < before)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in runs {
            g.state.remove(&k);
            p.runs += 1;
        }
        Ok(p)
    }

    async fn clear_flow(&self, flow: &str) -> Result<usize, QueueError> {
        let mut g = self.lock();
        let ids: Vec<Ulid> = g
            .entries
            .values()
            .filter(|e| e.item.flow == flow && matches!(e.st, St::Ready | St::Delayed | St::Parked))
            .map(|e| e.item.id)
            .collect();
        let now = now_ms();
        let reason = crate::removed_flow_reason(flow);
        for id in &ids {
            g.unindex(*id);
            g.dead.insert((now, *id));
            if let Some(e) = g.entries.get_mut(id) {
                e.item.not_before = None;
                e.st = St::Dead {
                    reason: reason.clone(),
                    at: now,
                };
            }
        }
        Ok(ids.len())
    }

    async fn stats(&self) -> Result<Stats, QueueError> {
        let g = self.lock();
        let mut s = Stats {
            ready: g.ready.len(),
            delayed: g.delayed.len(),
            parked: g.parked.values().map(BTreeMap::len).sum(),
            dead: g.dead.len(),
            durable: false,
            ..Default::default()
        };
        let now = now_ms();
        for e in g.entries.values() {
            match e.st {
                St::InFlight { .. } => s.in_flight += 1,
                St::Ready => {}
                _ => continue,
            }
            let age = now - e.item.enqueued_at;
            s.oldest_pending_age_ms = Some(s.oldest_pending_age_ms.map_or(age, |a| a.max(age)));
        }
        Ok(s)
    }

    async fn dead_letters(&self, n: usize) -> Result<Vec<ItemView>, QueueError> {
        let g = self.lock();
        Ok(g.dead
            .iter()
            .rev()
            .take(n)
            .filter_map(|(_, id)| g.entries.get(id).map(|e| g.view(e)))
            .collect())
    }

    async fn get(&self, id: Ulid) -> Result<Option<ItemView>, QueueError> {
        let g = self.lock();
        Ok(g.entries.get(&id).map(|e| g.view(e)))
    }

    async fn list(&self, f: ListFilter) -> Result<Vec<ItemView>, QueueError> {
        let g = self.lock();
        let mut ids: Vec<&Ulid> = g.entries.keys().collect();
        ids.sort_unstable();
        let limit = if f.limit == 0 { 100 } else { f.limit };
        Ok(ids
            .into_iter()
            .filter(|id| f.after.is_none_or(|a| **id > a))
            .filter_map(|id| g.entries.get(id))
            .map(|e| g.view(e))
            .filter(|v| f.flow.as_ref().is_none_or(|fl| *fl == v.item.flow))
            .filter(|v| f.state.as_ref().is_none_or(|s| s == v.state.name()))
            .take(limit)
            .collect())
    }

    async fn cancel(&self, id: Ulid) -> Result<(), QueueError> {
        let mut g = self.lock();
        let Some(e) = g.entries.get(&id) else {
            return Err(QueueError::NotFound(id));
        };
        match e.st {
            St::Ready | St::Delayed | St::Parked => {
                g.finish(id, "cancelled by hand".into(), now_ms());
                Ok(())
            }
            St::InFlight { .. } => Err(QueueError::Conflict(format!(
                "item {id} is in flight; it ends with its wave"
            ))),
            St::Dead { .. } => Err(QueueError::Conflict(format!(
                "item {id} is a dead letter: discard or replay it"
            ))),
            St::Finished { .. } => Err(QueueError::Conflict(format!("item {id} has finished"))),
        }
    }

    async fn replay(&self, id: Ulid) -> Result<Ulid, QueueError> {
        let new_id = {
            let mut g = self.lock();
            let Some(e) = g.entries.get(&id) else {
                return Err(QueueError::NotFound(id));
            };
            if !matches!(e.st, St::Dead { .. }) {
                return Err(QueueError::Conflict(format!(
                    "item {id} is not a dead letter"
                )));
            }
            let item = e.item.replayed();
            let new_id = item.id;
            let now = now_ms();
            g.finish(id, format!("replayed as {new_id}"), now);
            g.insert(item, now);
            new_id
        };
        self.ready.notify_waiters();
        Ok(new_id)
    }

    async fn discard(&self, id: Ulid) -> Result<(), QueueError> {
        let mut g = self.lock();
        match g.entries.get(&id) {
            None => Err(QueueError::NotFound(id)),
            Some(e) if matches!(e.st, St::Dead { .. }) => {
                g.finish(id, "discarded by hand".into(), now_ms());
                Ok(())
            }
            Some(_) => Err(QueueError::Conflict(format!(
                "item {id} is not a dead letter"
            ))),
        }
    }
}

#[async_trait::async_trait]
impl crate::Pausing for MemoryQueue {
    async fn parked(&self, flow: &str) -> Result<usize, QueueError> {
        Ok(self.lock().parked.get(flow).map_or(0, BTreeMap::len))
    }

    async fn set_paused(&self, flow: &str, paused: bool) -> Result<(), QueueError> {
        let mut g = self.lock();
        if paused {
            g.paused.insert(flow.to_string());
        } else {
            g.paused.remove(flow);
        }
        Ok(())
    }

    async fn is_paused(&self, flow: &str) -> Result<bool, QueueError> {
        Ok(self.lock().paused.contains(flow))
    }

    async fn unpark(&self, flow: &str) -> Result<usize, QueueError> {
        let n = {
            let mut g = self.lock();
            let parked = g.parked.remove(flow).unwrap_or_default();
            let n = parked.len();
            for (seq, id) in parked {
                if let Some(e) = g.entries.get_mut(&id) {
                    e.st = St::Ready;
                    g.ready.insert(seq, id);
                }
            }
            n
        };
        self.ready.notify_waiters();
        Ok(n)
    }

    async fn resume(&self, flow: &str) -> Result<usize, QueueError> {
        let n = {
            let mut g = self.lock();
            g.paused.remove(flow);
            // Back at their places in the journal order.
            let parked = g.parked.remove(flow).unwrap_or_default();
            let n = parked.len();
            for (seq, id) in parked {
                if let Some(e) = g.entries.get_mut(&id) {
                    e.st = St::Ready;
                    g.ready.insert(seq, id);
                }
            }
            n
        };
        self.ready.notify_waiters();
        Ok(n)
    }

    async fn unpark_one(&self, flow: &str) -> Result<Option<Ulid>, QueueError> {
        let id = {
            let mut g = self.lock();
            let Some((seq, id)) = g.parked.get_mut(flow).and_then(|p| p.pop_first()) else {
                return Ok(None);
            };
            if let Some(e) = g.entries.get_mut(&id) {
                e.st = St::Ready;
            }
            g.ready.insert(seq, id);
            g.permits.insert(id);
            id
        };
        self.ready.notify_waiters();
        Ok(Some(id))
    }
}

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
