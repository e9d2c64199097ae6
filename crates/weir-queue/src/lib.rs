//! The work-queue contract of weir and its backends.
//!
//! Every external event becomes a [`WorkItem`] journaled through [`WorkQueue::add`] before
//! anything runs; the executor claims items, runs their waves, and ends each item with exactly
//! one [`WorkQueue::commit`] that carries all of the wave's effects. [`WorkQueue`] is the core
//! every backend implements; what a backend may do besides (the operator's view, pausing,
//! consumers, shared quotas, claiming as it journals) is a trait of [`capability`], and a
//! [`Queue`] carries the core with the abilities its backend has. The [`memory`] backend is
//! for tests and throwaway runs (not durable); [`sqlite`] is the embedded default and
//! [`redis`] lets several engines share the work. All run the same [`conformance`] suite.

pub mod capability;
mod item;
pub mod memory;
mod open;
pub mod redis;
mod replies;
pub mod sqlite;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod testing;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use ulid::Ulid;

pub use capability::{
    Admin, ClaimOnAdd, ClaimsWait, Closing, Consumers, Pausing, Queue, SharedQuotas, SkipsFlows,
};
pub use item::{ItemKind, WorkItem, ITEM_VERSION};
pub use memory::MemoryQueue;
pub use open::open;
pub use redis::{RedisOptions, RedisQueue};
pub use sqlite::SqliteQueue;
/// The shared vocabulary, re-exported where the queue's own types use it.
pub use weir_core::{now_ms, Failpoints, Message};
pub use weir_state::{Quota, StateError, StateKey, StateRead, StateWrite, Versioned};

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

/// A claimed item: the item as journaled (with `deliveries` already bumped), the lease that
/// proves this engine still owns it when it commits, and the backend's receipt for it.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub item: WorkItem,
    pub lease: u64,
    pub consumer: String,
    /// The item was handed out by a step of its paused flow: it runs instead of parking again.
    pub stepped: bool,
    /// What the backend that claimed it needs to find and check it at its commit.
    pub receipt: Receipt,
}

/// What a backend keeps with a claim so that its commit finds and checks the item without
/// looking it up again. Opaque outside the backends of this crate; another backend leaves
/// it empty (`Receipt::default()`) and finds the item by its id.
#[derive(Debug, Clone, Default)]
pub struct Receipt {
    /// SQLite: the item's row; 0 when unknown.
    pub(crate) slot: u64,
    /// Redis: the stream entry this claim read, so the commit can check and acknowledge it
    /// as is; empty otherwise.
    pub(crate) entry: String,
    /// Redis: the item's JSON as journaled, so that a commit records the finished item
    /// without encoding it again; empty otherwise.
    pub(crate) journaled: String,
}

impl Receipt {
    /// A receipt naming the row the item is at.
    pub(crate) fn row(slot: u64) -> Receipt {
        Receipt {
            slot,
            ..Receipt::default()
        }
    }

    /// A receipt naming the stream entry read, with the item's JSON as journaled.
    pub(crate) fn entry(entry: String, journaled: String) -> Receipt {
        Receipt {
            slot: 0,
            entry,
            journaled,
        }
    }
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
        Ok(Claimed::new(item, lease, consumer, stepped))
    }

    /// `item` claimed for `consumer` under `lease`, with an empty receipt.
    pub fn new(item: WorkItem, lease: u64, consumer: &str, stepped: bool) -> Self {
        Claimed {
            item,
            lease,
            consumer: consumer.to_string(),
            stepped,
            receipt: Receipt::default(),
        }
    }

    /// The same claim with the backend's receipt.
    pub(crate) fn with_receipt(mut self, receipt: Receipt) -> Self {
        self.receipt = receipt;
        self
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
    /// Not done: the same item (its id, its deliveries, its done markers) is delayed until
    /// this time (ms), then delivered again. A wave past its deadline ends so.
    Later(i64),
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

/// The reason a removed flow's pending items are dead-lettered with: replayable once the
/// flow is back.
pub fn removed_flow_reason(flow: &str) -> String {
    format!("flow `{flow}` was removed by a reload; replay once it is back")
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

/// The queue contract: the core every backend MUST implement as described here; the
/// conformance suite checks each sentence it can. What a backend may do besides is in the
/// traits of [`capability`], carried with the queue by a [`Queue`].
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
///   MUST answer `Conflict` and write nothing when the receipt's lease is no longer the
///   item's current one, when a state version differs from the one read, when a guard does
///   not hold, or when ending with `Park` and the flow is not paused.
/// - **Delayed items** become ready when `move_due` runs at or after their `not_before`;
///   promotion neither loses nor duplicates an item.
/// - **Done markers** survive until the commit that ends their item, which deletes them.
/// - **Idempotency.** `add_idempotent` with a key seen before adds nothing and returns the
///   first item's id; `add_tick` journals one item per cron tick, however many engines fire.
/// - **Replies** posted for an item reach whichever engine waits for them, once.
#[async_trait::async_trait]
pub trait WorkQueue: StateRead + Send + Sync {
    /// Journal items (ready now, or delayed when `not_before` is in the future).
    async fn add(&self, items: Vec<WorkItem>) -> Result<(), QueueError>;

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

    /// Promote delayed items due at `now` (ms); returns how many.
    async fn move_due(&self, now: i64) -> Result<usize, QueueError>;

    /// The earliest `not_before` among delayed items.
    async fn next_due(&self) -> Result<Option<i64>, QueueError>;

    async fn mark_done(&self, key: DoneKey, outputs: Vec<Vec<Message>>) -> Result<(), QueueError>;
    async fn was_done(&self, key: &DoneKey) -> Result<Option<Vec<Vec<Message>>>, QueueError>;

    /// Post the reply of a `respond: wave` webhook for item `id`.
    async fn post_reply(&self, id: Ulid, reply: Reply) -> Result<(), QueueError>;
    /// Wait up to `wait` for the reply to item `id`.
    async fn wait_reply(&self, id: Ulid, wait: Duration) -> Result<Option<Reply>, QueueError>;
}
