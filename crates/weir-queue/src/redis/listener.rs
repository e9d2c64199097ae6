//! The pub/sub listener: replies and new items that other engines name, heard at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;

use ulid::Ulid;

/// The `respond: wave` requests waiting at this engine, each woken by its own item's reply.
pub(super) type ReplyWaiters = std::sync::Mutex<HashMap<Ulid, Arc<ReplyWake>>>;

/// What wakes one waiting request: its reply posted here, or heard on the channel of posted
/// replies (then `heard` says so, and the request counts itself woken by the channel if the
/// wake-up is what found its reply).
#[derive(Default)]
pub(super) struct ReplyWake {
    pub(super) notify: tokio::sync::Notify,
    pub(super) heard: AtomicBool,
}

/// Listen on the namespace's channels of posted replies (`keys::replies_posted`) and of
/// added items (`keys::items_added`): wake the request of this engine that waits for each
/// reply, and this engine's waiting claims when another engine names an add. Connects again
/// after a pause whenever the connection ends. Only a hint: every waiter and claim polls all
/// the same, so while the channels are not heard what another engine posts or adds is found
/// by the poll, up to `poll` later (`RedisOptions::poll`). Ends when the queue is dropped.
pub(super) async fn hear_other_engines(
    client: redis::Client,
    channels: [String; 2],
    waiters: Weak<ReplyWaiters>,
    heard: Weak<Heard>,
    wakes: Arc<ClaimWakes>,
    poll: Duration,
) {
    let [channel, added] = channels;
    let mut pause = Duration::from_millis(100);
    // The first failure is said at `warn` (pub/sub refused to this user stays so); the
    // retries that follow, at `debug`.
    let mut said = false;
    // Counted off however this task ends, an abort when the queue is dropped included.
    let mut gauge = ListeningGauge::new();
    loop {
        gauge.set(false);
        let subscribed = async {
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(&[&channel, &added]).await?;
            Ok::<_, redis::RedisError>(ps)
        };
        match tokio::time::timeout(Duration::from_secs(2), subscribed).await {
            Ok(Ok(mut ps)) => {
                pause = Duration::from_millis(100);
                match heard.upgrade() {
                    Some(h) => h.listening.store(true, Ordering::Release),
                    None => return,
                }
                gauge.set(true);
                let mut posted = ps.on_message();
                while let Some(m) = posted.next().await {
                    let Some(waiters) = waiters.upgrade() else {
                        return;
                    };
                    let Ok(id) = m.get_payload::<String>() else {
                        continue;
                    };
                    if m.get_channel_name() == added {
                        // Another engine's add (this one's own are told at once, not here).
                        if id != wakes.me && wakes.waiting.load(Ordering::Acquire) > 0 {
                            // Counted by each claim this wake-up lets take items.
                            wakes.heard.fetch_add(1, Ordering::AcqRel);
                            wakes.ready.notify_waiters();
                        }
                        continue;
                    }
                    let Ok(id) = id.parse::<Ulid>() else { continue };
                    let waiter = waiters
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&id)
                        .cloned();
                    if let Some(w) = waiter {
                        // Counted by the request, if this wake-up is what finds its reply.
                        w.heard.store(true, Ordering::Release);
                        w.notify.notify_one();
                    }
                }
                match heard.upgrade() {
                    Some(h) => h.listening.store(false, Ordering::Release),
                    None => return,
                }
                tracing::debug!(
                    "the channels of other engines' replies and adds were cut; listening again"
                );
            }
            Ok(Err(e)) if !said => {
                said = true;
                tracing::warn!(%channel, error = %e, poll = ?poll, "cannot listen for the replies other engines post and the items they add; until it can, they are found by polling, up to `poll` later");
            }
            Ok(Err(e)) => {
                tracing::debug!(%channel, error = %e, "cannot listen for other engines' replies and adds yet");
            }
            Err(_) => {
                tracing::debug!(%channel, "no answer within 2 s to listening for other engines' replies and adds; they are found by polling meanwhile");
            }
        }
        if waiters.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// This queue's part of `weir_redis_reply_channel_listening`, the reply channels the
/// process listens on (an engine's: 1, or 0 while it cannot): counted on while subscribed,
/// off when not, and off however the listener's task ends, an abort when the queue is
/// dropped included. Off goes through the handle that counted on, so a queue made before
/// the process had a recorder takes nothing off the others' count.
pub(super) struct ListeningGauge(pub(super) Option<metrics::Gauge>);

impl ListeningGauge {
    /// Off, and shown as 0 until this queue listens (a user without pub/sub rights sees
    /// it stay there).
    pub(super) fn new() -> Self {
        metrics::gauge!("weir_redis_reply_channel_listening").increment(0.0);
        ListeningGauge(None)
    }

    pub(super) fn set(&mut self, on: bool) {
        match (on, self.0.take()) {
            (true, None) => {
                let g = metrics::gauge!("weir_redis_reply_channel_listening");
                g.increment(1.0);
                self.0 = Some(g);
            }
            (false, Some(g)) => g.decrement(1.0),
            (_, kept) => self.0 = kept,
        }
    }
}

impl Drop for ListeningGauge {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// What the listener of other engines' replies and adds has heard.
#[derive(Default)]
pub(super) struct Heard {
    /// Subscribed to the channels now.
    pub(super) listening: AtomicBool,
    /// Requests of this engine that found their reply, posted by another engine, when the
    /// channel woke them (not at a poll).
    pub(super) woke: AtomicU64,
    /// Claims of this engine that took items when an add another engine named woke them
    /// (not at a poll).
    pub(super) adds_woke: AtomicU64,
}

/// What wakes this engine's waiting claims: the items it makes ready itself, at once; those
/// another engine makes ready, through the namespace's channel of added items, named there
/// only by an engine that has no claim of its own waiting to take them. A quiet engine takes
/// its own lone items without waking the others (who would all race for each); a busy one
/// lets an idle one start its items at once instead of at its next poll (up to
/// `RedisOptions::poll`, 25 ms, later).
pub(super) struct ClaimWakes {
    /// Told when items are made ready here, or heard to be made ready by another engine.
    pub(super) ready: tokio::sync::Notify,
    /// Adds of other engines heard so far (each one told through `ready`): a claim woken
    /// while it moved was woken by the channel.
    pub(super) heard: AtomicU64,
    /// This engine's claims waiting for work now.
    pub(super) waiting: AtomicUsize,
    /// This engine's name on the channel, so that it does not wake itself.
    pub(super) me: String,
    /// When this engine last named an add on the channel (ms since the epoch): at most one
    /// a millisecond, so a busy engine's adds cost the server a few hundred publishes a
    /// second at most, however many it makes.
    pub(super) named_at: AtomicI64,
}

/// One of this engine's claims waiting for work, counted in `ClaimWakes::waiting` until it
/// stops waiting, however it stops.
pub(super) struct WaitingClaim<'a>(pub(super) &'a AtomicUsize);

impl<'a> WaitingClaim<'a> {
    pub(super) fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::AcqRel);
        WaitingClaim(n)
    }
}

impl Drop for WaitingClaim<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The listener of other engines' replies and adds, stopped with the queue.
pub(super) struct Listener(pub(super) tokio::task::AbortHandle);

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A `respond: wave` request's place in `reply_waiters`, given up however its wait ends.
pub(super) struct ReplyWaiter<'a> {
    pub(super) map: &'a ReplyWaiters,
    pub(super) id: Ulid,
}

impl<'a> ReplyWaiter<'a> {
    pub(super) fn new(map: &'a ReplyWaiters, id: Ulid, woken: Arc<ReplyWake>) -> Self {
        map.lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, woken);
        ReplyWaiter { map, id }
    }
}

impl Drop for ReplyWaiter<'_> {
    fn drop(&mut self) {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}
