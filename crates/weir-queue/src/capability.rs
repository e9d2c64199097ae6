//! What a backend may do besides the core contract, each ability a trait of its own, and the
//! [`Queue`] handle that carries the core queue with the abilities its backend has.
//!
//! The executor, the triggers and the admin API hold a [`Queue`]: a missing ability is a
//! `None` they hold, never a yes/no question asked of the backend at run time.

use std::sync::Arc;

use ulid::Ulid;

use crate::{Claimed, ItemView, ListFilter, Pruned, QueueError, Stats, WorkItem, WorkQueue};
pub use weir_state::SharedQuotas;

/// The operator's view and hand: what is queued, what died and why, and the means to put it
/// right. Every backend has it.
#[async_trait::async_trait]
pub trait Admin: Send + Sync {
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
    /// Set every waiting, delayed and parked item of `flow` (a flow a reload removed) aside
    /// as a dead letter with [`removed_flow_reason`](crate::removed_flow_reason); returns
    /// how many.
    async fn clear_flow(&self, flow: &str) -> Result<usize, QueueError>;
    /// Retention: remove finished items and dead letters that ended before `before` (ms),
    /// and run records last written before it. Nothing live (waiting, in flight, delayed,
    /// parked) is ever pruned.
    async fn prune(&self, before: i64) -> Result<Pruned, QueueError>;

    /// How many delayed items each node of `flow` has waiting (a node's own flush timers
    /// not counted), for the dashboard. Counted where the backend can count; by default,
    /// from a listing of at most [`LISTED_AT_MOST`] items.
    async fn delayed_by_node(
        &self,
        flow: &str,
    ) -> Result<std::collections::BTreeMap<String, u64>, QueueError> {
        let mut held = std::collections::BTreeMap::new();
        let delayed = self
            .list(ListFilter {
                flow: Some(flow.to_string()),
                state: Some("delayed".into()),
                after: None,
                limit: LISTED_AT_MOST,
            })
            .await?;
        for v in delayed {
            if v.item.kind != crate::ItemKind::Flush {
                *held.entry(v.item.node).or_default() += 1;
            }
        }
        Ok(held)
    }

    /// The ids of the newest `limit` dead letters of `flow` (or of every flow) whose reason
    /// contains `reason` (or any), for the bulk actions. Selected by id where the backend
    /// can; by default, from the newest [`LISTED_AT_MOST`] dead letters.
    async fn dead_ids(
        &self,
        flow: Option<&str>,
        reason: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Ulid>, QueueError> {
        Ok(self
            .dead_letters(LISTED_AT_MOST)
            .await?
            .into_iter()
            .filter(|v| dead_matches(v, flow, reason))
            .take(limit)
            .map(|v| v.item.id)
            .collect())
    }
}

/// The most items the default counts and selections of [`Admin`] read.
pub const LISTED_AT_MOST: usize = 10_000;

/// Whether a dead letter is of `flow` and its reason contains `reason` (either if `None`).
pub(crate) fn dead_matches(v: &ItemView, flow: Option<&str>, reason: Option<&str>) -> bool {
    flow.is_none_or(|f| f == v.item.flow)
        && match (reason, &v.state) {
            (None, _) => true,
            (Some(want), crate::ItemState::Dead { reason, .. }) => reason.contains(want),
            _ => false,
        }
}

/// Pausing a flow. Items of a paused flow park, kept per flow in journal order; `unpark`
/// makes all of them ready, oldest first; `unpark_one` makes exactly the oldest ready and
/// hands it out with `stepped = true`, so it runs although the flow is paused. Every backend
/// has it.
#[async_trait::async_trait]
pub trait Pausing: Send + Sync {
    async fn set_paused(&self, flow: &str, paused: bool) -> Result<(), QueueError>;
    async fn is_paused(&self, flow: &str) -> Result<bool, QueueError>;
    /// Resume `flow` in one step: it is no longer paused and its parked items are ready,
    /// oldest first, at once, so that nothing arriving meanwhile runs before them. Returns
    /// how many were parked.
    async fn resume(&self, flow: &str) -> Result<usize, QueueError>;
    /// Make the oldest parked item of `flow` ready, to run once although the flow is paused.
    async fn unpark_one(&self, flow: &str) -> Result<Option<Ulid>, QueueError>;
    /// How many items of `flow` are parked: counted, not listed (the executor asks for each
    /// item of a paused flow).
    async fn parked(&self, flow: &str) -> Result<usize, QueueError>;
}

/// Consumers that come and go on a backend several engines share (Redis). A backend whose
/// file one engine holds at a time takes everything back when it opens, and has no need of
/// this.
#[async_trait::async_trait]
pub trait Consumers: Send + Sync {
    /// At start: make claimable at once what an earlier run of this same `consumer` left in
    /// flight (it died with them). Only sound when no other live engine uses that name.
    async fn recover(&self, consumer: &str) -> Result<usize, QueueError>;

    /// At a clean shutdown, after the last wave this engine will run: make claimable at once
    /// whatever `consumer` still holds (claimed, never committed), and forget the consumer,
    /// so that a stopped engine leaves nothing pending for the others to wait out. A late
    /// commit of a released item MUST be refused.
    async fn release(&self, consumer: &str) -> Result<usize, QueueError>;
}

/// A backend that holds something only one process may hold (the SQLite file and its lock).
#[async_trait::async_trait]
pub trait Closing: Send + Sync {
    /// The last step of a clean shutdown: let go of what this engine holds, even while a task
    /// somewhere still has a reference (an HTTP connection winding down), so that another
    /// engine can open the same queue at once. Calls after it fail as unavailable.
    async fn close(&self);
}

/// Journal an item already claimed for its caller, who runs its wave at once (the webhook
/// fast path).
#[async_trait::async_trait]
pub trait ClaimOnAdd: Send + Sync {
    /// Journal `item` and, when nothing else is ready (so it passes nothing in journal
    /// order), claim it for `consumer` in the same write. `None` when it was journaled
    /// ready instead, for the executor to claim. A caller gone before the answer MUST leave
    /// nothing stranded: the item is made ready again, its delivery counted.
    async fn add_claimed(
        &self,
        consumer: &str,
        item: WorkItem,
    ) -> Result<Option<Claimed>, QueueError>;
}

/// Claims that wait in the backend: a claim waiting for work is answered in the very
/// transaction that journals an item, and the backend promotes delayed items by itself as
/// they fall due, so the executor need not call `move_due` before each claim.
pub trait ClaimsWait: Send + Sync {
    /// How many claims the executor keeps waiting at once. With one, an item journaled while
    /// the previous answer is being handed out waits for a later transaction; a second claim
    /// waiting meanwhile takes it at once.
    fn claims_ahead(&self) -> usize;
}

/// Claims that pass over the ready items of some flows: the executor names the flows whose
/// waves are all taken, so that one flow's backlog holds up no other flow. The items passed
/// over keep their places.
#[async_trait::async_trait]
pub trait SkipsFlows: Send + Sync {
    /// As [`WorkQueue::claim`], passing over the ready items of the flows in `skip`.
    async fn claim_skipping(
        &self,
        consumer: &str,
        max: usize,
        wait: std::time::Duration,
        skip: Arc<[String]>,
    ) -> Result<Vec<Claimed>, QueueError>;
}

/// A queue and the abilities its backend has: what the executor, the triggers and the admin
/// API hold. It derefs to the core [`WorkQueue`]; a clone is one reference more.
#[derive(Clone)]
pub struct Queue(Arc<Parts>);

#[derive(Clone)]
struct Parts {
    work: Arc<dyn WorkQueue>,
    admin: Arc<dyn Admin>,
    pausing: Arc<dyn Pausing>,
    durable: bool,
    consumers: Option<Arc<dyn Consumers>>,
    closing: Option<Arc<dyn Closing>>,
    quotas: Option<Arc<dyn SharedQuotas>>,
    claim_on_add: Option<Arc<dyn ClaimOnAdd>>,
    claims_wait: Option<Arc<dyn ClaimsWait>>,
    skips_flows: Option<Arc<dyn SkipsFlows>>,
}

impl Queue {
    /// A backend with the abilities every backend has; `durable` is `false` where a crash
    /// loses everything (the memory backend). Add the others with the `with_` calls.
    pub fn new<Q: WorkQueue + Admin + Pausing + 'static>(q: Arc<Q>, durable: bool) -> Queue {
        Queue(Arc::new(Parts {
            work: q.clone(),
            admin: q.clone(),
            pausing: q,
            durable,
            consumers: None,
            closing: None,
            quotas: None,
            claim_on_add: None,
            claims_wait: None,
            skips_flows: None,
        }))
    }

    pub fn with_consumers(mut self, c: Arc<dyn Consumers>) -> Self {
        Arc::make_mut(&mut self.0).consumers = Some(c);
        self
    }

    pub fn with_closing(mut self, c: Arc<dyn Closing>) -> Self {
        Arc::make_mut(&mut self.0).closing = Some(c);
        self
    }

    pub fn with_quotas(mut self, q: Arc<dyn SharedQuotas>) -> Self {
        Arc::make_mut(&mut self.0).quotas = Some(q);
        self
    }

    pub fn with_claim_on_add(mut self, c: Arc<dyn ClaimOnAdd>) -> Self {
        Arc::make_mut(&mut self.0).claim_on_add = Some(c);
        self
    }

    pub fn with_claims_wait(mut self, c: Arc<dyn ClaimsWait>) -> Self {
        Arc::make_mut(&mut self.0).claims_wait = Some(c);
        self
    }

    pub fn with_skips_flows(mut self, c: Arc<dyn SkipsFlows>) -> Self {
        Arc::make_mut(&mut self.0).skips_flows = Some(c);
        self
    }

    pub fn admin(&self) -> &dyn Admin {
        &*self.0.admin
    }

    pub fn pausing(&self) -> &dyn Pausing {
        &*self.0.pausing
    }

    /// `false` for the memory backend: a crash loses everything.
    pub fn durable(&self) -> bool {
        self.0.durable
    }

    pub fn consumers(&self) -> Option<&dyn Consumers> {
        self.0.consumers.as_deref()
    }

    /// Quotas every engine on the backend shares (Redis); `None` where one engine holds the
    /// backend, so a quota in its memory is already the only one.
    pub fn quotas(&self) -> Option<&Arc<dyn SharedQuotas>> {
        self.0.quotas.as_ref()
    }

    pub fn claim_on_add(&self) -> Option<&dyn ClaimOnAdd> {
        self.0.claim_on_add.as_deref()
    }

    pub fn claims_wait(&self) -> Option<&dyn ClaimsWait> {
        self.0.claims_wait.as_deref()
    }

    pub fn skips_flows(&self) -> Option<&Arc<dyn SkipsFlows>> {
        self.0.skips_flows.as_ref()
    }

    /// How many items of `flow` are parked now.
    pub async fn parked_count(&self, flow: &str) -> Result<usize, QueueError> {
        self.pausing().parked(flow).await
    }

    /// Let go of the backend at the end of a clean shutdown, where it holds anything.
    pub async fn close(&self) {
        if let Some(c) = &self.0.closing {
            c.close().await;
        }
    }
}

impl std::ops::Deref for Queue {
    type Target = dyn WorkQueue;

    fn deref(&self) -> &Self::Target {
        &*self.0.work
    }
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("durable", &self.0.durable)
            .field("consumers", &self.0.consumers.is_some())
            .field("closing", &self.0.closing.is_some())
            .field("quotas", &self.0.quotas.is_some())
            .field("claim_on_add", &self.0.claim_on_add.is_some())
            .field("claims_wait", &self.0.claims_wait.is_some())
            .field("skips_flows", &self.0.skips_flows.is_some())
            .finish()
    }
}
