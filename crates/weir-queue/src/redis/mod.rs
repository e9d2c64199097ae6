//! Redis Streams: the backend for several engines sharing work.
//!
//! - Ready items are entries of a stream read through the consumer group `weir`; a claimed
//!   entry stays pending until its commit acknowledges and deletes it, and an engine that
//!   dies leaves its entries pending for `XAUTOCLAIM` to hand to the living. Nothing is ever
//!   trimmed: an entry is deleted when its item ends.
//! - A ready or in-flight item's record is its stream entry (id, the deliveries it had when
//!   the entry was made, body; the flow and when it was enqueued are read from the body off
//!   the hot path) and its line in one hash, `live`: `ENTRY` while it waits, `LEASE ENTRY
//!   BEFORE` once claimed, BEFORE being the deliveries before this one (who holds it, and
//!   since when, are the group's pending entry's). A claim writes the line in the same
//!   script that reads the entry, so the count is the item's own, exactly, and a commit from
//!   an engine whose lease is gone is refused: a plain acknowledgement (the item ends,
//!   nothing else is written) sends the line its claim wrote and the script compares it
//!   whole. A claim and an acknowledgement therefore touch no key of the item's own: every
//!   write they make is one command for the whole batch, as in the bare pipelined loop the
//!   benchmarks compare against. Delayed, parked and dead items have a hash each; a finished
//!   item leaves its record (outcome, when, body) in the hash `out`, the newest 10,000 per
//!   shard kept.
//! - Delayed items wait in a sorted set; promotion is one script (remove, append, mark), so
//!   a crash can neither lose nor duplicate one. Parked items are a list per flow, unparked
//!   by one script. Dead letters are a capped stream; an eviction is counted and recorded.
//!   Done markers are a hash per item with a TTL; node state is two hashes per node (values
//!   and versions).
//! - A wave's commit is one script that refuses when the lease moved, a state version moved,
//!   a guard no longer holds, or a park meets a flow that is no longer paused; it checks all
//!   of that before it writes anything, because Redis does not roll a script back.
//! - Keys are in shards by flow (see [`keys`]); the default is one shard.
//!
//! Durability is the server's: weir checks `appendonly`/`appendfsync` at start and warns when
//! an acknowledged write can be lost. With replication, a failover can lose acknowledged
//! writes unless the replica had them; weir does not use WAIT.

mod claim;
mod commit;
mod conn;
pub mod keys;
mod listener;
mod ops;
mod options;
mod records;
mod scripts;
mod start;
mod state;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use redis::{AsyncCommands, Script};
use tokio::sync::oneshot;
use ulid::Ulid;

use crate::{now_ms, Claimed, Failpoints, ItemView, QueueError};
use commit::*;
use conn::*;
use listener::*;
use records::*;
use scripts::*;

pub use options::RedisOptions;
pub use scripts::DEAD_CAP;

/// The Redis Streams queue.
pub struct RedisQueue {
    conn: Conn,
    opts: RedisOptions,
    /// Each shard's key prefix, made once (an add and a commit name theirs for every item).
    shard_prefixes: Vec<String>,
    scripts: Scripts,
    failpoints: Failpoints,
    /// Items `recover` claimed again, handed out by the next claims first.
    recovered: std::sync::Mutex<std::collections::VecDeque<Claimed>>,
    commits: CommitGroups,
    /// The shard the next claim starts with (turning, so that none waits on another).
    next_shard: std::sync::atomic::AtomicUsize,
    /// Wakes this engine's claims polling for work: at once for items it made ready (an
    /// add, a commit that may carry follow-ups), through the channel of added items for
    /// those another engine made ready while it had no claim waiting.
    wakes: Arc<ClaimWakes>,
    /// `respond: wave` requests waiting at this engine, by item: a reply this engine posts
    /// wakes its waiter at once; one another engine posts wakes it through the namespace's
    /// channel of posted replies (or, while that is not heard, the waiter's poll finds it).
    reply_waiters: Arc<ReplyWaiters>,
    heard: Arc<Heard>,
    /// How long an idempotency key is kept: a day, or the retention if shorter (learned
    /// from the engine's prune, which is given what retention keeps).
    idempotency_ttl: std::sync::atomic::AtomicI64,
    _listener: Listener,
    /// Something that must live as long as the queue (a test's own redis-server).
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl RedisQueue {
    /// A poll's first pause and its longest (`RedisOptions::poll`, at least 1 ms so that a
    /// waiter never spins).
    fn poll_pauses(&self) -> (Duration, Duration) {
        let most = self.opts.poll.max(Duration::from_millis(1));
        (Duration::from_millis(2).min(most), most)
    }

    /// Whether this engine hears, at this moment, the replies other engines post for its
    /// waiting `respond: wave` requests and the adds they name (through the namespace's
    /// channels of posted replies and added items). While it does not (Redis unreachable,
    /// or pub/sub refused to this user), those replies and items are found by polling, up to
    /// `RedisOptions::poll` (25 ms) later; nothing is lost either way.
    pub fn hears_other_engines(&self) -> bool {
        self.heard.listening.load(Ordering::Acquire)
    }

    /// How many `respond: wave` requests waiting at this engine were woken by a reply that
    /// another engine posted (heard on the channel, not found by a poll).
    pub fn replies_heard(&self) -> u64 {
        self.heard.woke.load(Ordering::Relaxed)
    }

    /// How many of this engine's waiting claims took items when an add another engine named
    /// on the channel of added items woke them (not found by a poll).
    pub fn adds_heard(&self) -> u64 {
        self.heard.adds_woke.load(Ordering::Relaxed)
    }

    /// Items were made ready here: wake this engine's waiting claims, and when none waits,
    /// name the add on the channel of added items (at most once a millisecond), so that
    /// another engine's waiting claims take them at once. Sent on its own, without holding
    /// up the add: only a hint is at stake, and the other engines' polls find the items if
    /// it is lost (or refused: a Redis user without pub/sub rights).
    fn made_ready(&self) {
        self.wakes.ready.notify_waiters();
        if self.wakes.waiting.load(Ordering::Acquire) > 0 {
            return;
        }
        let now = now_ms();
        let last = self.wakes.named_at.load(Ordering::Relaxed);
        if now <= last
            || self
                .wakes
                .named_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let mut c = self.conn.clone();
        let channel = keys::items_added(&self.opts.namespace);
        let me = self.wakes.me.clone();
        tokio::spawn(async move {
            if let Err(e) = c.publish::<_, _, i64>(channel, me).await {
                tracing::debug!(error = %e, "an add was not named on the channel of added items");
            }
        });
    }

    /// Keep `x` alive as long as the queue (a test's server, say).
    pub fn keeping(mut self, x: impl std::any::Any + Send + Sync) -> Self {
        self._keep = Some(Box::new(x));
        self
    }

    fn prefix_of(&self, flow: &str) -> &str {
        match self.shard_prefixes.as_slice() {
            [one] => one,
            all => &all[keys::shard_of(flow, self.opts.shards) as usize],
        }
    }

    fn prefixes(&self) -> &[String] {
        &self.shard_prefixes
    }

    /// Run a script in shard `p` (its stream key routes it to the right node of a cluster).
    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        p: &str,
        args: &[&dyn RedisArg],
    ) -> Result<T, QueueError> {
        let mut inv = script.prepare_invoke();
        inv.key(keys::stream(p)).arg(p).arg(now_ms().to_string());
        for a in args {
            a.push(&mut inv);
        }
        let mut c = self.conn.clone();
        inv.invoke_async(&mut c).await.map_err(unavailable)
    }

    /// Commit through shard `p`'s group: commits that arrive while the shard's calls are on
    /// their way (at most `COMMIT_CALLS`) go together in the next (one script, one fsync on
    /// the server), with no timer.
    async fn commit_grouped(&self, p: &str, args: CommitArgs) -> Result<String, QueueError> {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut groups = self.commits.lock().unwrap_or_else(|e| e.into_inner());
            // The shard's group is there after its first commit: no key made for each.
            let g = match groups.get_mut(p) {
                Some(g) => g,
                None => groups.entry(p.to_string()).or_default(),
            };
            g.waiting.push((args, tx));
            let lead = g.flushing < COMMIT_CALLS;
            if lead {
                g.flushing += 1;
            }
            lead
        };
        if lead {
            let (conn, script, groups, p) = (
                self.conn.clone(),
                self.scripts.commit.clone(),
                self.commits.clone(),
                p.to_string(),
            );
            tokio::spawn(flush_commits(conn, script, groups, p));
        }
        rx.await
            .map_err(|_| QueueError::Unavailable("the commit was dropped".into()))?
    }

    async fn record(&self, p: &str, id: &str) -> Result<Option<ItemView>, QueueError> {
        let pairs: Vec<String> = self.run(&self.scripts.get, p, &[&id]).await?;
        if pairs.is_empty() {
            return Ok(None);
        }
        let mut h: HashMap<String, String> = HashMap::with_capacity(pairs.len() / 2);
        let mut it = pairs.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            h.insert(k, v);
        }
        if let Some(rec) = h.remove("json") {
            // A finished record: a line of JSON whose values are text (as a hash's would
            // be), a newline, the body.
            let (line, body) = rec.split_once('\n').unwrap_or((&rec, ""));
            let fields: HashMap<String, serde_json::Value> =
                serde_json::from_str(line).map_err(corrupt)?;
            h = fields
                .into_iter()
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => (k, s),
                    other => (k, other.to_string()),
                })
                .collect();
            h.insert("body".into(), body.to_string());
        }
        view(id, &h).map(Some)
    }

    /// Find an item's record in whichever shard holds it.
    async fn find(&self, id: Ulid) -> Result<Option<(String, ItemView)>, QueueError> {
        let id = id.to_string();
        for p in self.prefixes() {
            if let Some(v) = self.record(p, &id).await? {
                return Ok(Some((p.clone(), v)));
            }
        }
        Ok(None)
    }

    /// An operator's script on one item, answering `ok` or the state that refused it.
    async fn on_item(
        &self,
        script: &Script,
        id: Ulid,
        extra: Option<String>,
        refuse: impl Fn(&str) -> QueueError,
    ) -> Result<(), QueueError> {
        let Some((p, _)) = self.find(id).await? else {
            return Err(QueueError::NotFound(id));
        };
        let ids = id.to_string();
        let r: String = match &extra {
            Some(x) => self.run(script, &p, &[&ids, x]).await?,
            None => self.run(script, &p, &[&ids]).await?,
        };
        match r.as_str() {
            "ok" => Ok(()),
            "missing" => Err(QueueError::NotFound(id)),
            st => Err(refuse(st)),
        }
    }
}
