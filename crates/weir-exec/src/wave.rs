//! One item's wave: deliver its outputs along the wires until nothing is left, then commit.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;
use weir_core::{now_ms, Message};
use weir_nodes::{Emit, NodeCx, NodeError, WaveOut};
use weir_queue::{
    Claimed, Committed, DoneKey, End, ItemKind, ItemState, Reply, StateKey, WaveEffects, WorkItem,
};
use weir_state::Overlay;

use std::sync::atomic::Ordering;

use crate::{backoff, Executor, FlowRt};

/// How a wave ended before its commit.
// Returned once per wave and consumed at once: boxing the big variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Outcome {
    Commit(WaveEffects, Extras),
    /// Stop without committing (a failpoint simulating a crash): the item is redelivered.
    Abandon,
}

/// What a wave leaves besides its effects: its webhook replies, and the
/// messages nodes with no wires out emitted (a run's outputs).
#[derive(Default)]
struct Extras {
    replies: Vec<Reply>,
    reached: Vec<Message>,
    /// A side effect done as the wave's last step, whose marker was left to the commit
    /// (the commit ends the item): if the commit is refused and the wave runs again, the
    /// marker is written first, so the effect is not done twice.
    unmarked: Option<(DoneKey, Vec<Vec<Message>>)>,
}

/// Runs of a wave whose commit met a conflict, before the item is left to redelivery.
const CONFLICT_RERUNS: usize = 5;

impl Executor {
    /// Run `c`'s wave and commit it. `permit` is the wave's place in its flow's concurrency:
    /// given back once the nodes have run, before the commit, so a flow's next waves run
    /// while this one's commit waits for its fsync (the in-flight bound still holds them).
    /// A flow of `concurrency: 1` keeps it through the commit: strictly one at a time.
    pub(crate) async fn process(
        &self,
        flow: Option<Arc<FlowRt>>,
        c: Claimed,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let mut permit = permit;
        let mut replied = false;
        // At debug level: a span at info costs every wave a visit to the subscriber's
        // registry, filter and formatter (docs/performance.md). The events a wave logs at
        // info and above carry their flow and item themselves.
        let span = tracing::debug_span!("wave", flow = %c.item.flow, node = %c.item.node, item = %c.item.id, deliveries = c.item.deliveries);
        let started = std::time::Instant::now();
        async {
            for run in 0..CONFLICT_RERUNS {
                let outcome = match &flow {
                    None => Outcome::Commit(
                        WaveEffects::ending(End::DeadLetter(format!("flow `{}` is not loaded", c.item.flow))),
                        Extras::default(),
                    ),
                    Some(f) => match tokio::time::timeout(self.cfg.wave_deadline, self.prepare_and_run(f, &c, run)).await {
                        Ok(o) => o,
                        Err(_) => Outcome::Commit(self.deadline_passed(&c.item), Extras::default()),
                    },
                };
                let (mut fx, mut extras) = match outcome {
                    Outcome::Abandon => {
                        tracing::warn!(flow = %c.item.flow, item = %c.item.id, "wave abandoned before its commit (failpoint); the item will be redelivered");
                        return;
                    }
                    Outcome::Commit(fx, extras) => (fx, extras),
                };
                let unmarked = extras.unmarked.take();
                let end = crate::Ended::of(fx.end.as_ref());
                if flow.as_ref().is_some_and(|f| f.flow.concurrency > 1) {
                    drop(permit.take());
                }
                // A wave that writes no node state answers its webhook now: the event is
                // journaled already, and its commit can change nothing the answer shows (a
                // crash before it reruns the same wave for nobody; a conflict can only be
                // another engine owning the item, which runs the same wave). A wave that
                // writes state answers after its commit, so no answer shows state that was
                // not kept.
                if fx.state.is_empty() && fx.guards.is_empty() {
                    self.post_replies(&c, std::mem::take(&mut extras.replies), &mut replied)
                        .await;
                }
                // A waiting request whose chain ends here with no answer and nothing left to
                // answer it later is told so after the commit, not at its timeout; a chain
                // that goes on in one item alone (a retry, a delay) hands the wait on to it.
                let answered = replied || !extras.replies.is_empty();
                if let Some(r) = flow
                    .as_deref()
                    .and_then(|f| awaited(f, &c.item, answered, &mut fx))
                {
                    extras.replies.push(r);
                }
                if let Err(e) = self.account_run(&c.item, &mut fx, extras.reached).await {
                    tracing::warn!(flow = %c.item.flow, item = %c.item.id, error = %e, "cannot read the run's record; the item will be redelivered");
                    return;
                }
                match self.commit_with_retries(&c, fx).await {
                    Some(Committed::Done) => {
                        match &flow {
                            Some(f) => f.ended(end, started.elapsed()),
                            None => {
                                let flow = c.item.flow.clone();
                                metrics::counter!("weir_items_ended_total", "flow" => flow.clone(), "end" => end.label()).increment(1);
                                metrics::histogram!("weir_wave_seconds", "flow" => flow).record(started.elapsed().as_secs_f64());
                            }
                        }
                        self.post_replies(&c, extras.replies, &mut replied).await;
                        return;
                    }
                    Some(Committed::Conflict) => {
                        // A state version or a guard moved: run again. But an item this
                        // engine no longer holds (reclaimed by another engine while this
                        // one stalled, or ended by hand) is not run again here: its new
                        // owner runs it, and a rerun would only repeat side effects.
                        match self.queue.admin().get(c.item.id).await {
                            Ok(Some(v))
                                if !matches!(&v.state, ItemState::InFlight { consumer, .. } if *consumer == c.consumer) =>
                            {
                                tracing::warn!(
                                    flow = %c.item.flow,
                                    item = %c.item.id,
                                    state = v.state.name(),
                                    "commit refused: the item is no longer this engine's; not running it again"
                                );
                                metrics::counter!("weir_commits_refused_total", "why" => "not_owner").increment(1);
                                return;
                            }
                            _ => {
                                tracing::debug!(flow = %c.item.flow, item = %c.item.id, "commit conflict; running the wave again");
                                if let Some((key, outputs)) = unmarked {
                                    if let Err(e) = self.queue.mark_done(key, outputs).await {
                                        tracing::warn!(flow = %c.item.flow, item = %c.item.id, error = %e, "could not record a done marker; the item will be redelivered");
                                        return;
                                    }
                                }
                                continue;
                            }
                        }
                    }
                    None => return,
                }
            }
            tracing::warn!(flow = %c.item.flow, item = %c.item.id, "wave kept conflicting; the item is left for redelivery");
        }
        .instrument(span)
        .await
    }

    /// Post a wave's webhook replies, once per item however often its wave runs.
    async fn post_replies(&self, c: &Claimed, replies: Vec<Reply>, replied: &mut bool) {
        if *replied || replies.is_empty() {
            return;
        }
        *replied = true;
        for r in replies {
            if let Err(e) = self.queue.post_reply(c.item.root_id(), r).await {
                tracing::warn!(flow = %c.item.flow, item = %c.item.id, error = %e, "could not post the webhook reply");
            }
        }
    }

    /// Commit, retrying while the backend is unavailable (up to the wave deadline).
    ///
    /// A commit that failed may still have gone through (its answer was lost on the way
    /// back). When a retry then meets a conflict and the item is no longer in flight, the
    /// item has ended — by this commit or another engine's — and the wave is not run again.
    async fn commit_with_retries(&self, c: &Claimed, fx: WaveEffects) -> Option<Committed> {
        let deadline = tokio::time::Instant::now() + self.cfg.wave_deadline;
        let mut delay = Duration::from_millis(20);
        let mut failed_before = false;
        loop {
            if self.failpoints.hit("commit-conflict") {
                // As if a state version had moved: the wave runs again.
                return Some(Committed::Conflict);
            }
            match self.queue.commit(c, fx.clone()).await {
                Ok(Committed::Conflict) if failed_before => {
                    return match self.queue.admin().get(c.item.id).await {
                        Ok(Some(v))
                            if v.state.name() != "in_flight" && v.state.name() != "waiting" =>
                        {
                            tracing::info!(
                                flow = %c.item.flow,
                                item = %c.item.id,
                                state = v.state.name(),
                                "a commit whose answer was lost had gone through"
                            );
                            Some(Committed::Done)
                        }
                        _ => Some(Committed::Conflict),
                    };
                }
                Ok(r) => return Some(r),
                Err(e) if tokio::time::Instant::now() + delay < deadline => {
                    failed_before = true;
                    tracing::warn!(flow = %c.item.flow, item = %c.item.id, error = %e, "commit failed; trying again");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    tracing::error!(flow = %c.item.flow, item = %c.item.id, error = %e, "commit failed; the item will be redelivered");
                    return None;
                }
            }
        }
    }

    /// The checks before a wave (§4: paused, guard, ceiling), then the wave itself.
    /// `run` counts the runs of this delivery (a commit conflict runs the wave again).
    async fn prepare_and_run(&self, f: &FlowRt, c: &Claimed, run: usize) -> Outcome {
        let item = &c.item;
        if !c.stepped {
            match self.queue.pausing().is_paused(&item.flow).await {
                Ok(true) => {
                    let end = match self.queue.parked_count(&item.flow).await {
                        Ok(n) if n >= self.cfg.max_parked => {
                            metrics::counter!("weir_bounds_hit_total", "bound" => "max_parked")
                                .increment(1);
                            End::DeadLetter(format!(
                                "flow `{}` is paused with {n} items parked already (max_parked {})",
                                item.flow, self.cfg.max_parked
                            ))
                        }
                        Ok(_) => End::Park,
                        Err(e) => {
                            tracing::warn!(flow = %item.flow, item = %item.id, error = %e, "cannot count the parked items");
                            return Outcome::Abandon;
                        }
                    };
                    return Outcome::Commit(WaveEffects::ending(end), Extras::default());
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(flow = %item.flow, item = %item.id, error = %e, "cannot read the flow's pause state");
                    return Outcome::Abandon;
                }
            }
        }
        let Some(start) = f.flow.node_index(&item.node) else {
            return Outcome::Commit(
                WaveEffects::ending(End::DeadLetter(format!(
                    "node `{}` is not in flow `{}` (was the flow changed?)",
                    item.node, item.flow
                ))),
                Extras::default(),
            );
        };
        let mut guards = Vec::new();
        if let (Some(k), Some(want)) = (&item.guard_key, &item.guard_value) {
            let key = StateKey::new(&item.flow, &item.node, k);
            match self.queue.read(&key).await {
                Ok(v) if v.value.as_ref() == Some(want) => guards.push((key, want.clone())),
                Ok(_) => {
                    return Outcome::Commit(WaveEffects::ending(End::Superseded), Extras::default())
                }
                Err(e) => {
                    tracing::warn!(flow = %item.flow, item = %item.id, error = %e, "cannot read a guard");
                    return Outcome::Abandon;
                }
            }
        }
        if item.deliveries > self.cfg.max_deliveries {
            return Outcome::Commit(
                WaveEffects::ending(End::DeadLetter(format!(
                    "delivered {} times without finishing (ceiling {})",
                    item.deliveries, self.cfg.max_deliveries
                ))),
                Extras::default(),
            );
        }
        // The first run of a first delivery can find no done marker: none was written yet.
        let fresh = run == 0 && item.deliveries <= 1;
        let mut out = self.run_wave(f, item, start, fresh).await;
        if let Outcome::Commit(fx, _) = &mut out {
            fx.guards = guards;
        }
        out
    }

    async fn run_wave(&self, f: &FlowRt, item: &WorkItem, start: usize, fresh: bool) -> Outcome {
        let flow = &f.flow;
        let mut pending: VecDeque<(usize, Message)> = VecDeque::new();
        if item.attempt > 0 || item.kind == ItemKind::Flush {
            // A retry at a node (run it again with the input it failed on), or a flush (the
            // node releases what it held back).
            for m in item.outputs.first().into_iter().flatten() {
                pending.push_back((start, m.clone()));
            }
        } else {
            for (port, msgs) in item.outputs.iter().enumerate() {
                for &t in flow.graph.targets(start, port) {
                    for m in msgs {
                        pending.push_back((t, m.clone()));
                    }
                }
            }
        }
        let mut overlay = Overlay::new();
        let mut out = WaveOut::default();
        let mut fx = WaveEffects::ending(End::Ack);
        let mut failures = Vec::new();
        let mut steps = 0usize;
        // A run's outputs: what the nodes with no wires out emit (a function's result, what
        // a sink passes on). Such a node is told it has wires out in a run, so that it emits.
        let run = item.run_id.is_some();
        let mut reached = Vec::new();
        let mut unmarked = None;
        while let Some((n, msg)) = pending.pop_front() {
            steps += 1;
            if steps > self.cfg.step_bound {
                metrics::counter!("weir_bounds_hit_total", "bound" => "wave_steps").increment(1);
                return Outcome::Commit(
                    WaveEffects::ending(End::DeadLetter(format!(
                        "the wave exceeded its step bound of {} node calls (a loop in the graph?)",
                        self.cfg.step_bound
                    ))),
                    Extras::default(),
                );
            }
            let position = steps as u32;
            let node = &flow.nodes[n];
            // Only side effects keep done markers: their key is made for them alone.
            let done_key = || DoneKey {
                flow: item.flow.clone(),
                item: item.id,
                node: node.id.clone(),
                position,
            };
            let recorded = if node.node.side_effect() && !fresh {
                match self.queue.was_done(&done_key()).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(flow = %item.flow, item = %item.id, node = %node.id, error = %e, "cannot read a done marker");
                        return Outcome::Abandon;
                    }
                }
            } else {
                None
            };
            let result = match recorded {
                Some(outputs) => {
                    tracing::debug!(flow = %item.flow, item = %item.id, node = %node.id, "side effect already done for this item; replaying its outputs");
                    Ok(Emit(outputs))
                }
                None => {
                    f.counts[n].called(&node.kind);
                    let mut cx = NodeCx::new(
                        &flow.id,
                        &node.id,
                        item,
                        &*self.queue,
                        &mut overlay,
                        &mut out,
                    )
                    .with_quotas(self.queue.quotas().map(|q| &**q as _))
                    .with_wires_out(run || !flow.graph.is_leaf(n))
                    .with_timeout(self.cfg.node_timeout);
                    let r = match tokio::time::timeout(
                        self.cfg.node_timeout,
                        node.node.call_borrowed(&msg, &mut cx),
                    )
                    .instrument(tracing::debug_span!("node", node = %node.id, kind = %node.kind))
                    .await
                    {
                        Ok(r) => r,
                        Err(_) => Err(NodeError::transient(format!(
                            "node `{}` timed out after {:?}",
                            node.id, self.cfg.node_timeout
                        ))),
                    };
                    if let (true, Ok(emit)) = (node.node.side_effect(), &r) {
                        // Recorded right after the effect, before the wave goes on. When the
                        // wave has nothing left to run after it, the commit that follows at
                        // once is the record: it ends the item, which is never run again,
                        // and a crash before it repeats the effect exactly as a crash before
                        // a marker would. One durable write per message fewer.
                        let last = pending.is_empty()
                            && emit.0.iter().enumerate().all(|(port, msgs)| {
                                msgs.is_empty() || flow.graph.targets(n, port).is_empty()
                            });
                        let marked = if last {
                            // What the replay of the marker would emit goes nowhere but to
                            // a run's outputs.
                            let outputs = if run { emit.0.clone() } else { Vec::new() };
                            unmarked = Some((done_key(), outputs));
                            Ok(())
                        } else {
                            self.queue.mark_done(done_key(), emit.0.clone()).await
                        };
                        if let Err(e) = marked {
                            tracing::warn!(flow = %item.flow, item = %item.id, node = %node.id, error = %e, "could not record a done marker; a redelivery may repeat this effect");
                        }
                        if self.failpoints.any()
                            && self
                                .failpoints
                                .hit(&format!("after:{}/{}", flow.id, node.id))
                        {
                            return Outcome::Abandon;
                        }
                    }
                    r
                }
            };
            match result {
                Ok(Emit(ports)) if run && flow.graph.is_leaf(n) => {
                    reached.extend(ports.into_iter().flatten());
                }
                Ok(Emit(ports)) => {
                    for (port, msgs) in ports.into_iter().enumerate() {
                        // Each target but the last gets a copy; the last takes the message.
                        let Some((&last, rest)) = flow.graph.targets(n, port).split_last() else {
                            continue;
                        };
                        for m in msgs {
                            for &t in rest {
                                pending.push_back((t, m.clone()));
                            }
                            pending.push_back((last, m));
                        }
                    }
                }
                Err(e) => {
                    metrics::counter!("weir_node_failures_total", "kind" => node.kind.clone())
                        .increment(1);
                    f.counts[n].failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(flow = %item.flow, item = %item.id, node = %node.id, deliveries = item.deliveries, error = %e, "node failed");
                    failures.push(format!("node `{}`: {e}", node.id));
                    self.failure(item, &node.id, node.retry, msg, e, &mut fx);
                }
            }
        }
        fx.state = overlay.into_writes();
        fx.delayed.extend(out.scheduled);
        fx.dead.extend(out.dead);
        let replies = out.replies;
        if !failures.is_empty() {
            // Which items carry the failures on: an operator goes from the outcome to them.
            let ids = |items: &mut dyn Iterator<Item = &WorkItem>| {
                items
                    .map(|i| i.id.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let mut outcome = format!("done with failures: {}", failures.join("; "));
            let dead = ids(&mut fx.dead.iter().map(|(i, _)| i));
            if !dead.is_empty() {
                outcome.push_str(&format!("; dead letters: {dead}"));
            }
            let retries = ids(&mut fx.delayed.iter().filter(|i| i.cause.starts_with("retry:")));
            if !retries.is_empty() {
                outcome.push_str(&format!("; retries: {retries}"));
            }
            fx.outcome = Some(outcome);
        }
        Outcome::Commit(
            fx,
            Extras {
                replies,
                reached,
                unmarked,
            },
        )
    }

    /// A node failed on `input`: retry it at that node later, or dead-letter the input.
    fn failure(
        &self,
        item: &WorkItem,
        node: &str,
        retry: Option<weir_nodes::Retry>,
        input: Message,
        e: NodeError,
        fx: &mut WaveEffects,
    ) {
        let (base, cap) = retry
            .map(|r| (r.initial, r.max))
            .unwrap_or((self.cfg.retry_base, self.cfg.retry_cap));
        let wait = |attempt| backoff(base, cap, attempt);
        let labels = [("flow", item.flow.clone()), ("node", node.to_string())];
        let dead_before = fx.dead.len();
        let attempt = if item.node == node && item.attempt > 0 {
            item.attempt + 1
        } else {
            1
        };
        let mut retry = item.follow_up(node, format!("retry:{node}"), vec![vec![input]]);
        retry.attempt = attempt;
        retry.first_enqueued_at = item.first_enqueued_at;
        let now = now_ms();
        match e {
            NodeError::Permanent(reason) => {
                fx.dead
                    .push((retry, format!("node `{node}` failed: {reason}")));
            }
            NodeError::Transient {
                reason,
                retry_after,
            } => {
                if now - item.first_enqueued_at > self.cfg.max_age.as_millis() as i64 {
                    fx.dead.push((
                        retry,
                        format!(
                            "expired: node `{node}` kept failing for longer than the maximum age ({:?}): {reason}",
                            self.cfg.max_age
                        ),
                    ));
                } else {
                    // A server's Retry-After is honoured, within this node's cap.
                    let after = retry_after
                        .map(|d| d.min(cap))
                        .unwrap_or_else(|| wait(attempt));
                    retry.not_before = Some(now + after.as_millis() as i64);
                    fx.delayed.push(retry);
                }
            }
            NodeError::Unclassified(reason) => {
                if attempt >= self.cfg.max_deliveries {
                    fx.dead.push((
                        retry,
                        format!("node `{node}` failed {attempt} times: {reason}"),
                    ));
                } else {
                    retry.not_before = Some(now + wait(attempt).as_millis() as i64);
                    fx.delayed.push(retry);
                }
            }
        }
        if fx.dead.len() > dead_before {
            metrics::counter!("weir_dead_letters_total", &labels).increment(1);
        } else {
            metrics::counter!("weir_retries_total", &labels).increment(1);
        }
    }

    /// The wave ran past its deadline: a transient failure of the whole item. The same item
    /// (its id, its deliveries, its done markers, so what it did is not done again) is
    /// delivered again after a backoff; past the delivery ceiling or the maximum age it is
    /// dead-lettered instead, so a wave that always overruns ends.
    fn deadline_passed(&self, item: &WorkItem) -> WaveEffects {
        let why = format!(
            "the wave passed its deadline of {:?}",
            self.cfg.wave_deadline
        );
        let now = now_ms();
        if item.deliveries >= self.cfg.max_deliveries {
            return WaveEffects::ending(End::DeadLetter(format!(
                "{why} on each of its {} deliveries (ceiling {})",
                item.deliveries, self.cfg.max_deliveries
            )));
        }
        if now - item.first_enqueued_at > self.cfg.max_age.as_millis() as i64 {
            return WaveEffects::ending(End::DeadLetter(format!(
                "expired: {why}, and the event is older than the maximum age ({:?})",
                self.cfg.max_age
            )));
        }
        let wait = backoff(
            self.cfg.retry_base,
            self.cfg.retry_cap,
            item.deliveries.max(1),
        );
        WaveEffects {
            outcome: Some(format!("{why}; delivered again later")),
            ..WaveEffects::ending(End::Later(now + wait.as_millis() as i64))
        }
    }
}

/// A `respond: wave` request whose chain is ending without an answer. The chain is the
/// request's first wave (started at a `respond: wave` webhook), then, while each wave leaves
/// exactly one item behind (a retry, a delay), that item, marked `awaited`. A wave of the
/// chain that answers nothing and leaves more than one item hands the wait on to none of
/// them: the request waits for its timeout, as any of them may still answer it. One that
/// leaves nothing is answered here: 500 with the reasons and the dead letters' ids when it
/// dead-lettered, whole or where a node failed; 502 when it ended without reaching an
/// `http-response` (a switch that dropped the message, say). Either body names the request's
/// item, as the 504 of a timeout does. `None` for every other wave (`answered`: this one
/// has answered already).
fn awaited(f: &FlowRt, item: &WorkItem, answered: bool, fx: &mut WaveEffects) -> Option<Reply> {
    let waiting = !answered
        && (item.awaited || (item.origin_id.is_none() && f.answering.contains(&item.node)));
    let left = fx.follow_ups.len() + fx.delayed.len();
    for heir in fx.follow_ups.iter_mut().chain(fx.delayed.iter_mut()) {
        heir.awaited = waiting && left == 1 && heir.kind == ItemKind::Cascade;
    }
    if left > 0 || !waiting {
        return None;
    }
    let (status, error, dead): (u16, String, Vec<String>) = match &fx.end {
        Some(End::DeadLetter(why)) => (
            500,
            format!("the wave failed and its event was dead-lettered: {why}"),
            vec![item.id.to_string()],
        ),
        Some(End::Ack) if !fx.dead.is_empty() => (
            500,
            format!(
                "the wave failed before an http-response and was dead-lettered where it failed: {}",
                fx.dead
                    .iter()
                    .map(|(_, why)| why.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            fx.dead.iter().map(|(d, _)| d.id.to_string()).collect(),
        ),
        Some(End::Ack) => (
            502,
            "the wave ended without reaching an http-response node".to_string(),
            Vec::new(),
        ),
        _ => return None,
    };
    let mut body = serde_json::json!({ "id": item.root_id().to_string(), "error": error });
    if !dead.is_empty() {
        body["dead_letters"] = dead.into();
    }
    Some(Reply {
        status,
        headers: Vec::new(),
        body: body.into(),
    })
}

/// Runs (DESIGN §8) keep their record in the flow's node memory under this pseudo-node.
pub const RUNS: &str = weir_queue::RUNS_NODE;

/// A run's record: what `GET /api/runs/<id>` answers.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunRecord {
    /// queued | running | done | failed
    pub status: String,
    /// The messages the run's nodes with no wires out emitted, in order.
    pub outputs: Vec<Message>,
    pub error: Option<String>,
    /// Items of the run not yet ended (the run is over at 0).
    pub pending: i64,
    /// When the record was last written (ms): retention prunes by it.
    #[serde(default)]
    pub updated_at: i64,
}

impl Executor {
    /// Keep the run's record in step with this wave, in the same commit: one item of the run
    /// ends, its follow-ups carry the run on, what a leaf emitted is an output.
    async fn account_run(
        &self,
        item: &WorkItem,
        fx: &mut WaveEffects,
        reached: Vec<Message>,
    ) -> Result<(), weir_state::StateError> {
        let Some(run) = &item.run_id else {
            return Ok(());
        };
        // A parked item, or one delivered again later, has not ended: the run waits for it.
        if matches!(fx.end, Some(End::Park) | Some(End::Later(_))) {
            return Ok(());
        }
        let key = StateKey::new(&item.flow, RUNS, run);
        let mut overlay = Overlay::new();
        let stored = overlay.get(&*self.queue, &key).await?;
        let mut rec: RunRecord = stored
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or(RunRecord {
                pending: 1,
                ..Default::default()
            });
        let carried = fx
            .follow_ups
            .iter()
            .chain(&fx.delayed)
            .filter(|i| i.run_id.as_ref() == Some(run))
            .count() as i64;
        rec.pending = (rec.pending - 1 + carried).max(0);
        rec.outputs.extend(reached);
        let failed: Vec<String> = match &fx.end {
            Some(End::DeadLetter(r)) => vec![r.clone()],
            _ => Vec::new(),
        }
        .into_iter()
        .chain(fx.dead.iter().map(|(_, r)| r.clone()))
        .collect();
        if !failed.is_empty() {
            let mut all: Vec<String> = rec.error.take().into_iter().collect();
            all.extend(failed);
            rec.error = Some(all.join("; "));
        }
        rec.updated_at = now_ms();
        rec.status = match (rec.pending, &rec.error) {
            (p, _) if p > 0 => "running",
            (_, Some(_)) => "failed",
            _ => "done",
        }
        .into();
        let value =
            serde_json::to_value(&rec).map_err(|e| weir_state::StateError(e.to_string()))?;
        overlay.set(&*self.queue, key, Some(value)).await?;
        fx.state.extend(overlay.into_writes());
        Ok(())
    }
}
