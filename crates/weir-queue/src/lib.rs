//! The work-queue contract of weir and its backends.
//!
//! Every external event becomes a [`WorkItem`] journaled through [`WorkQueue::add`] before
//! anything runs; the executor claims items, runs their waves, and ends each item with exactly
//! one [`WorkQueue::commit`] that carries all of the wave's effects. The [`memory`] backend is
//! for tests and throwaway runs (`durable: false`); durable backends plug in behind the same
//! trait and run the same [`conformance`] suite.

pub mod duration;
pub mod failpoint;
mod item;
pub mod memory;
pub mod redis;
mod replies;
pub mod shown;
pub mod sqlite;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod testing;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use ulid::Ulid;

pub use failpoint::Failpoints;
pub use item::{now_ms, ItemKind, Message, WorkItem, ITEM_VERSION};
pub use memory::MemoryQueue;
pub use redis::{RedisOptions, RedisQueue};
pub use sqlite::SqliteQueue;
pub use weir_state::{StateError, StateKey, StateRead, StateWrite, Versioned};

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The backend cannot be reached or cannot write (Redis down, disk full). Transient:
    /// callers back off and try again; webhooks answer 503.
    #[error("queue backend unavailable: {0}")]
    Unavailable(String),
    /// The ready queue is at its bound: webhooks answer 429, MQTT acks are withheld.
    #[error("queue is full ({0} items ready)")]
    Full(usize),
    #[error("no item {0}")]
    NotFound(Ulid),
    /// The operation does not apply to the item in its current state.
    #[error("{0}")]
    Conflict(String),
    /// The backend cannot be opened as configured (a locked or newer file, a bad URL).
    #[error("cannot open the queue: {0}")]
    Open(String),
    /// Something stored cannot be decoded.
    #[error("corrupt record: {0}")]
    Corrupt(String),
}

impl From<StateError> for QueueError {
    fn from(e: StateError) -> Self {
        QueueError::Unavailable(e.0)
    }
}

/// A claimed item: the item as journaled (with `deliveries` already bumped) and the lease that
/// proves this engine still owns it when it commits.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub item: WorkItem,
    pub lease: u64,
    pub consumer: String,
    /// The item was handed out by a step of its paused flow: it runs instead of parking again.
    pub stepped: bool,
    /// Where the backend keeps the item, when it has such a handle (SQLite: its row), so the
    /// commit finds it without looking its id up; 0 when it has none.
    pub slot: u64,
    /// The backend's name for this claim's copy of the item, when it has one (Redis: the
    /// stream entry read), so the commit can check and acknowledge it as is; empty otherwise.
    pub entry: String,
    /// The item's JSON as the backend journaled it, when the claim read it as text (Redis),
    /// so that a commit can record the finished item without encoding it again; empty
    /// otherwise.
    pub journaled: String,
}

impl Claimed {
    /// An item a backend just claimed, decoded from the JSON it journaled, with the delivery
    /// count the claim bumped. `Err` is a poison body, for the backend to set aside.
    pub fn decode(
        body: &str,
        deliveries: u32,
        lease: u64,
        consumer: &str,
        stepped: bool,
    ) -> Result<Claimed, serde_json::Error> {
        let mut item: WorkItem = serde_json::from_str(body)?;
        item.deliveries = deliveries;
        item.not_before = None;
        Ok(Claimed::new(item, lease, consumer, stepped, 0))
    }

    /// `item` claimed for `consumer` under `lease`, at `slot` (0: none), with no copy of
    /// its journaled entry kept.
    pub fn new(item: WorkItem, lease: u64, consumer: &str, stepped: bool, slot: u64) -> Self {
        Claimed {
            item,
            lease,
            consumer: consumer.to_string(),
            stepped,
            slot,
            entry: String::new(),
            journaled: String::new(),
        }
    }
}

/// How a claimed item ends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum End {
    /// The wave quiesced: the item is done.
    Ack,
    /// Its flow is paused: keep it, in order, until resume or step. Refused if the flow is no
    /// longer paused when the commit runs.
    Park,
    /// Set aside with a reason, visible and replayable.
    DeadLetter(String),
    /// A guard no longer held: a newer timer replaced this one.
    Superseded,
}

/// A side effect already performed for (item, node, position in the wave's walk).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DoneKey {
    /// The item's flow: a backend that shards by flow keeps the marker beside the item.
    pub flow: String,
    pub item: Ulid,
    pub node: String,
    pub position: u32,
}

/// Everything one wave leaves behind, committed together or not at all.
#[derive(Debug, Clone, Default)]
pub struct WaveEffects {
    pub end: Option<End>,
    /// Items ready now.
    pub follow_ups: Vec<WorkItem>,
    /// Items with `not_before` (and perhaps a guard).
    pub delayed: Vec<WorkItem>,
    /// New items that go straight to the dead letters, each with its reason (a node that
    /// failed permanently inside a wave that otherwise went on).
    pub dead: Vec<(WorkItem, String)>,
    pub state: Vec<StateWrite>,
    /// (key, value) pairs that must still hold at commit time.
    pub guards: Vec<(StateKey, serde_json::Value)>,
    /// What to record as the item's outcome, for the operator (`weir queue show`).
    pub outcome: Option<String>,
}

impl WaveEffects {
    pub fn ending(end: End) -> Self {
        WaveEffects {
            end: Some(end),
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    Done,
    /// Nothing was written: this engine no longer owns the item, a state version moved, a
    /// guard no longer holds, or (for Park) the flow is no longer paused.
    Conflict,
}

/// The answer to a `respond: wave` webhook, travelling through the backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: ReplyBody,
}

/// A reply's body as JSON text, written once where the reply is made: straight from the
/// message the answering node borrows (no copy of the payload), then sent as it is, to the
/// client and through a backend (as the JSON value it is, so a reply's stored form is the
/// same as when the body was a value).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReplyBody(Box<serde_json::value::RawValue>);

impl ReplyBody {
    pub fn of(v: &serde_json::Value) -> ReplyBody {
        // A `Value` always serializes (its keys are strings); `null` is only a fallback.
        ReplyBody(
            serde_json::value::to_raw_value(v)
                .unwrap_or_else(|_| serde_json::value::RawValue::NULL.to_owned()),
        )
    }

    /// The JSON text.
    pub fn json(&self) -> &str {
        self.0.get()
    }

    /// The string the body is, when it is a JSON string (a webhook answers it as text).
    pub fn text(&self) -> Option<String> {
        let j = self.json();
        j.starts_with('"')
            .then(|| serde_json::from_str(j).ok())
            .flatten()
    }

    /// The JSON text, owned.
    pub fn into_json(self) -> String {
        String::from(Box::<str>::from(self.0))
    }
}

impl From<serde_json::Value> for ReplyBody {
    fn from(v: serde_json::Value) -> ReplyBody {
        ReplyBody::of(&v)
    }
}

/// The same JSON text (a body read back from a backend is the text that was written).
impl PartialEq for ReplyBody {
    fn eq(&self, other: &ReplyBody) -> bool {
        self.json() == other.json()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub ready: usize,
    pub in_flight: usize,
    pub delayed: usize,
    pub parked: usize,
    pub dead: usize,
    /// Age of the oldest item that is ready or in flight, in milliseconds.
    pub oldest_pending_age_ms: Option<i64>,
    /// Dead letters evicted past the backend's cap (each recorded on its item).
    #[serde(default)]
    pub dead_evicted: u64,
    pub durable: bool,
}

impl WorkItem {
    /// What an operator sees of a stored item whose body cannot be decoded: its id and flow,
    /// and the raw text as its only output.
    pub fn undecodable(id: Ulid, flow: &str, raw: &str) -> WorkItem {
        WorkItem {
            id,
            cause: "undecodable".into(),
            ..WorkItem::cascade(
                flow,
                "?",
                "undecodable",
                vec![serde_json::Value::String(raw.into())],
            )
        }
    }
}

/// What a prune removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pruned {
    /// Finished items (their outcomes).
    pub outcomes: usize,
    pub dead: usize,
    /// Run records (node state of the `$runs` pseudo-node).
    pub runs: usize,
}

/// The pseudo-node whose memory holds a flow's run records (`updated_at` in each).
pub const RUNS_NODE: &str = "$runs";

/// Where an item stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ItemState {
    Waiting,
    InFlight { consumer: String, since: i64 },
    Delayed { due: i64 },
    Parked,
    Dead { reason: String, at: i64 },
    Finished { outcome: String, at: i64 },
}

impl ItemState {
    pub fn name(&self) -> &'static str {
        match self {
            ItemState::Waiting => "waiting",
            ItemState::InFlight { .. } => "in_flight",
            ItemState::Delayed { .. } => "delayed",
            ItemState::Parked => "parked",
            ItemState::Dead { .. } => "dead",
            ItemState::Finished { .. } => "finished",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemView {
    pub item: WorkItem,
    #[serde(flatten)]
    pub state: ItemState,
}

/// Which items to list.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub flow: Option<String>,
    /// One of the names of [`ItemState::name`].
    pub state: Option<String>,
    /// Items after this id (paging).
    pub after: Option<Ulid>,
    pub limit: usize,
}

/// The queue contract. Every backend MUST behave as described here; the conformance suite
/// checks each sentence it can.
///
/// - **Journaling.** When `add` returns `Ok`, its items are durable (for a durable backend)
///   and will be delivered at least once. A batch is all-or-nothing. An id journaled before
///   (an add retried after its answer was lost) is journaled once: the first is kept.
/// - **Order.** Ready items of one flow are claimed in journal order (the order they were
///   added, or became ready), and one claim never hands them out of that order. Across
///   flows, a backend that shards by flow takes from every shard in turn, so that a busy
///   flow does not hold up the others; a backend with one journal keeps journal order
///   across flows too.
/// - **Delivery.** `claim` hands an item to one consumer and bumps `deliveries` durably before
///   returning it, so an item that crashes the engine still reaches the delivery ceiling.
///   A claimed item stays in flight until its commit; `reclaim_stale` makes items idle longer
///   than `min_idle` claimable again, and their next claim carries the new delivery count.
/// - **Commit.** `commit` is the one way an item ends. It applies all of the wave's effects
///   (end, follow-up, delayed and dead items, state writes) atomically, or none of them; it
///   MUST answer `Conflict` and write nothing when the lease is no longer the item's current
///   one, when a state version differs from the one read, when a guard does not hold, or when
///   ending with `Park` and the flow is not paused.
/// - **Delayed items** become ready when `move_due` runs at or after their `not_before`;
///   promotion neither loses nor duplicates an item.
/// - **Park.** Parked items are kept per flow in journal order; `unpark` makes all of them
///   ready, oldest first; `unpark_one` makes exactly the oldest ready and hands it out with
///   `stepped = true`, so it runs although the flow is paused.
/// - **Done markers** survive until the commit that ends their item, which deletes them.
/// - **Dead letters** stay listable with their reason until replayed or discarded by hand,
///   or pruned past the retention (`prune`).
/// - **Idempotency.** `add_idempotent` with a key seen before adds nothing and returns the
///   first item's id.
#[async_trait::async_trait]
pub trait WorkQueue: StateRead + Send + Sync {
    /// `false` for the memory backend: a crash loses everything.
    fn durable(&self) -> bool;

    /// Whether the backend makes delayed items ready by itself as they fall due (a claim
    /// waiting for work is answered when one does), so the executor need not call
    /// `move_due` and `next_due` before each claim.
    fn promotes_due_items(&self) -> bool {
        false
    }

    /// How many claims the executor keeps waiting at once. A claim that waits in the backend
    /// is answered in the very transaction that journals an item, but only if it is there
    /// then: with one claim, an item journaled while the previous answer is being handed
    /// out waits for a later transaction, one more fsync of latency. A second claim waiting
    /// meanwhile takes it at once; the SQLite backend keeps four. Backends whose claims
    /// poll keep one.
    fn claims_ahead(&self) -> usize {
        1
    }

    /// Journal items (ready now, or delayed when `not_before` is in the future).
    async fn add(&self, items: Vec<WorkItem>) -> Result<(), QueueError>;

    /// Whether [`WorkQueue::add_claimed`] can hand an item back claimed (otherwise it only
    /// journals it, as `add` does).
    fn claims_on_add(&self) -> bool {
        false
    }

    /// Journal `item` and, when nothing else is ready (so it passes nothing in journal
    /// order), claim it for `consumer` in the same write: its caller starts its wave at
    /// once, with no claim between. `None` when it was journaled ready instead, for the
    /// executor to claim. A caller gone before the answer leaves nothing stranded: the item
    /// is made ready again, its delivery counted.
    async fn add_claimed(
        &self,
        consumer: &str,
        item: WorkItem,
    ) -> Result<Option<Claimed>, QueueError> {
        let _ = consumer;
        self.add(vec![item]).await.map(|_| None)
    }

    /// Journal `item` unless `key` was used before; returns the id journaled under `key` and
    /// whether it is new.
    async fn add_idempotent(&self, key: &str, item: WorkItem) -> Result<(Ulid, bool), QueueError>;

    /// Claim a cron tick and journal its item in one step: only if `tick` (ms) is later than the
    /// tick stored under `key`. Several engines firing the same tick journal it once.
    async fn add_tick(&self, key: &StateKey, tick: i64, item: WorkItem)
        -> Result<bool, QueueError>;

    /// Up to `max` ready items, waiting up to `wait` for the first.
    async fn claim(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Claimed>, QueueError>;

    /// End a claimed item with its wave's effects, atomically.
    async fn commit(
        &self,
        claimed: &Claimed,
        effects: WaveEffects,
    ) -> Result<Committed, QueueError>;

    /// Make in-flight items idle longer than `min_idle` claimable again; returns how many.
    async fn reclaim_stale(&self, min_idle: Duration) -> Result<usize, QueueError>;

    /// Retention: remove finished items and dead letters that ended before `before` (ms),
    /// and run records last written before it. Nothing live (waiting, in flight, delayed,
    /// parked) is ever pruned. The default prunes nothing.
    async fn prune(&self, before: i64) -> Result<Pruned, QueueError> {
        let _ = before;
        Ok(Pruned::default())
    }

    /// At start: make claimable at once what an earlier run of this same `consumer` left in
    /// flight (it died with them). Only sound when no other live engine uses that name.
    /// Backends whose file one engine holds at a time do this when they open; the default
    /// does nothing.
    async fn recover(&self, consumer: &str) -> Result<usize, QueueError> {
        let _ = consumer;
        Ok(0)
    }

    /// At a clean shutdown, after the last wave this engine will run: make claimable at once
    /// whatever `consumer` still holds (claimed, never committed), and forget the consumer,
    /// so that a stopped engine leaves nothing pending for the others to wait out. A late
    /// commit of a released item is refused. The default does nothing (a backend whose file
    /// one engine holds takes everything back when it opens).
    async fn release(&self, consumer: &str) -> Result<usize, QueueError> {
        let _ = consumer;
        Ok(0)
    }

    /// The last step of a clean shutdown: let go of what this engine holds, even while a task
    /// somewhere still has a reference (an HTTP connection winding down), so that another
    /// engine can open the same queue at once. The SQLite backend finishes the jobs sent
    /// before, closes its file and releases its lock; calls after it fail as unavailable.
    /// The default does nothing.
    async fn close(&self) {}

    /// Promote delayed items due at `now` (ms); returns how many.
    async fn move_due(&self, now: i64) -> Result<usize, QueueError>;

    /// The earliest `not_before` among delayed items.
    async fn next_due(&self) -> Result<Option<i64>, QueueError>;

    async fn set_paused(&self, flow: &str, paused: bool) -> Result<(), QueueError>;
    async fn is_paused(&self, flow: &str) -> Result<bool, QueueError>;
    /// How many items of `flow` are parked now.
    async fn parked_count(&self, flow: &str) -> Result<usize, QueueError> {
        Ok(self
            .list(ListFilter {
                flow: Some(flow.to_string()),
                state: Some("parked".into()),
                after: None,
                limit: usize::MAX,
            })
            .await?
            .len())
    }

    /// Make every parked item of `flow` ready, oldest first; returns how many.
    async fn unpark(&self, flow: &str) -> Result<usize, QueueError>;
    /// Make the oldest parked item of `flow` ready, to run once although the flow is paused.
    async fn unpark_one(&self, flow: &str) -> Result<Option<Ulid>, QueueError>;
    /// Drop every waiting, delayed and parked item of `flow`; returns how many.
    async fn clear_flow(&self, flow: &str) -> Result<usize, QueueError>;

    async fn mark_done(&self, key: DoneKey, outputs: Vec<Vec<Message>>) -> Result<(), QueueError>;
    async fn was_done(&self, key: &DoneKey) -> Result<Option<Vec<Vec<Message>>>, QueueError>;

    /// Post the reply of a `respond: wave` webhook for item `id`.
    async fn post_reply(&self, id: Ulid, reply: Reply) -> Result<(), QueueError>;
    /// Wait up to `wait` for the reply to item `id`.
    async fn wait_reply(&self, id: Ulid, wait: Duration) -> Result<Option<Reply>, QueueError>;

    async fn stats(&self) -> Result<Stats, QueueError>;
    /// Dead letters, newest first.
    async fn dead_letters(&self, n: usize) -> Result<Vec<ItemView>, QueueError>;
    async fn get(&self, id: Ulid) -> Result<Option<ItemView>, QueueError>;
    async fn list(&self, filter: ListFilter) -> Result<Vec<ItemView>, QueueError>;
    /// Cancel a waiting, delayed or parked item by hand (outcome "cancelled by hand").
    async fn cancel(&self, id: Ulid) -> Result<(), QueueError>;
    /// Put a dead letter back as a new ready item (cause `replay:ID`); returns the new id.
    async fn replay(&self, id: Ulid) -> Result<Ulid, QueueError>;
    /// Drop a dead letter, keeping a record ("discarded by hand").
    async fn discard(&self, id: Ulid) -> Result<(), QueueError>;
}

/// The queue a URL names: `memory`, `sqlite:PATH` (or a path ending in `.db`),
/// `redis://HOST:PORT[/DB]` (`rediss://` for TLS), or a Redis Cluster by some of its nodes,
/// `redis-cluster://HOST:PORT[,HOST:PORT…]`; a Redis URL optionally with `?ns=NAME&shards=N`
/// and `poll=DURATION` and `dead_cap=N` ([`RedisOptions`]).
/// Every backend takes `?max_ready=N`: past that many ready items, `add` answers `Full`
/// (webhooks 429, MQTT acks withheld). Default 100,000.
pub async fn open(
    url: &str,
    failpoints: Failpoints,
) -> Result<std::sync::Arc<dyn WorkQueue>, QueueError> {
    use std::sync::Arc;
    let url = url.trim();
    let (url, max_ready) = take_max_ready(url)?;
    if url == "memory" {
        return Ok(Arc::new(MemoryQueue::with_limits(max_ready, failpoints)));
    }
    if let Some(path) = url
        .strip_prefix("sqlite:")
        .or_else(|| url.ends_with(".db").then_some(url.as_str()))
    {
        let path = path.strip_prefix("//").unwrap_or(path);
        if path.is_empty() {
            return Err(QueueError::Open(
                "`sqlite:` needs a path, as in sqlite:weir-data/queue.db".into(),
            ));
        }
        return Ok(Arc::new(SqliteQueue::open_with_limit(
            path, max_ready, failpoints,
        )?));
    }
    let url = url.as_str();
    if [
        "redis://",
        "rediss://",
        "redis-cluster://",
        "rediss-cluster://",
    ]
    .iter()
    .any(|s| url.starts_with(s))
    {
        let (url, opts) = redis_options(url, max_ready)?;
        return Ok(Arc::new(RedisQueue::connect(&url, opts, failpoints).await?));
    }
    Err(QueueError::Open(format!(
        "`{}` names no queue backend: use memory, sqlite:PATH, redis://HOST:PORT or redis-cluster://HOST:PORT,…",
        shown::url(url)
    )))
}

/// weir's own settings in a Redis URL's query (`ns`, `shards`, `poll`, `dead_cap`) as
/// options; the URL without them (what is left of the query is the Redis client's own).
fn redis_options(url: &str, max_ready: usize) -> Result<(String, RedisOptions), QueueError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut opts = RedisOptions {
        max_ready,
        ..RedisOptions::default()
    };
    let bad = |what: &str, v: &str, want: &str| {
        QueueError::Open(format!("`{what}={v}` in {}: {want}", shown::url(base)))
    };
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("ns", v)) if !v.is_empty() => opts.namespace = v.to_string(),
            Some(("shards", v)) => {
                opts.shards = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=1024).contains(n))
                    .ok_or_else(|| bad("shards", v, "a number from 1 to 1024"))?
            }
            Some(("poll", v)) => {
                let d = duration::parse(v).map_err(|e| bad("poll", v, &e))?;
                if !(Duration::from_millis(1)..=Duration::from_secs(60)).contains(&d) {
                    return Err(bad("poll", v, "a duration from 1ms to 60s"));
                }
                opts.poll = d;
            }
            Some(("dead_cap", v)) => {
                opts.dead_cap = v
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| bad("dead_cap", v, "a number above 0"))?
            }
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((url, opts))
}

/// Take `max_ready=N` out of a queue URL's query; the rest of the URL, and N.
fn take_max_ready(url: &str) -> Result<(String, usize), QueueError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), 100_000));
    };
    let mut max = 100_000;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("max_ready", v)) => {
                max = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    QueueError::Open(format!(
                        "`max_ready={v}` in {}: a number above 0",
                        shown::url(base)
                    ))
                })?
            }
            _ => rest.push(pair),
        }
    }
    Ok(if rest.is_empty() {
        (base.to_string(), max)
    } else {
        (format!("{base}?{}", rest.join("&")), max)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(url: &str) -> Result<(String, RedisOptions), String> {
        let (url, max_ready) = take_max_ready(url).map_err(|e| e.to_string())?;
        redis_options(&url, max_ready).map_err(|e| e.to_string())
    }

    #[test]
    fn a_redis_url_carries_weirs_settings_and_hands_the_rest_to_the_client() {
        let (url, o) = opts(
            "redis://127.0.0.1:6379/2?ns=shop&shards=4&poll=100ms&dead_cap=500&max_ready=7&protocol=resp3",
        )
        .unwrap();
        assert_eq!(url, "redis://127.0.0.1:6379/2?protocol=resp3");
        assert_eq!(o.namespace, "shop");
        assert_eq!(o.shards, 4);
        assert_eq!(o.poll, Duration::from_millis(100));
        assert_eq!(o.dead_cap, 500);
        assert_eq!(o.max_ready, 7);

        let (url, o) = opts("redis://127.0.0.1:6379").unwrap();
        let d = RedisOptions::default();
        assert_eq!(url, "redis://127.0.0.1:6379");
        assert_eq!(
            (o.poll, o.dead_cap, o.shards),
            (d.poll, d.dead_cap, d.shards)
        );
    }

    /// An engine that cannot open its Redis says which server, and not its password.
    #[tokio::test]
    async fn a_redis_url_is_named_in_an_error_without_its_password() {
        let port = testing::free_port();
        for (url, says) in [
            (
                format!("redis://:hunter2@127.0.0.1:{port}"),
                format!("cannot reach Redis at redis://:***@127.0.0.1:{port}"),
            ),
            (
                format!("redis://weir:hunter2@127.0.0.1:{port}?shards=x"),
                format!("`shards=x` in redis://weir:***@127.0.0.1:{port}"),
            ),
            (
                format!("redis://:hunter2@127.0.0.1:{port}?max_ready=0"),
                format!("`max_ready=0` in redis://:***@127.0.0.1:{port}"),
            ),
            (
                format!("redis-cluster://:hunter2@127.0.0.1:{port}"),
                format!("the Redis Cluster at redis-cluster://:***@127.0.0.1:{port}"),
            ),
            (
                "postgres://weir:hunter2@db/weir".to_string(),
                "`postgres://weir:***@db/weir` names no queue backend".to_string(),
            ),
        ] {
            let Err(e) = open(&url, Failpoints::new()).await else {
                panic!("{url} opened");
            };
            let e = e.to_string();
            assert!(e.contains(&says) && !e.contains("hunter2"), "{url}: {e}");
        }
    }

    #[test]
    fn a_bad_setting_in_a_redis_url_says_which_and_what_it_takes() {
        for (query, says) in [
            (
                "poll=5",
                "`poll=5` in redis://h:1: duration `5` needs a unit",
            ),
            (
                "poll=0ms",
                "`poll=0ms` in redis://h:1: a duration from 1ms to 60s",
            ),
            (
                "poll=2m",
                "`poll=2m` in redis://h:1: a duration from 1ms to 60s",
            ),
            (
                "dead_cap=0",
                "`dead_cap=0` in redis://h:1: a number above 0",
            ),
            (
                "dead_cap=many",
                "`dead_cap=many` in redis://h:1: a number above 0",
            ),
            (
                "shards=0",
                "`shards=0` in redis://h:1: a number from 1 to 1024",
            ),
        ] {
            let e = opts(&format!("redis://h:1?{query}")).unwrap_err();
            assert!(e.contains(says), "{query}: {e}");
        }
    }
}
