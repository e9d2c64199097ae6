//! The queue's contract, carried out in scripts.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use redis::AsyncCommands;
use ulid::Ulid;

use super::commit::*;
use super::keys;
use super::listener::*;
use super::records::*;
use super::scripts::*;
use super::RedisQueue;
use crate::{
    now_ms, Claimed, Committed, DoneKey, End, ItemState, ItemView, ListFilter, Message, QueueError,
    Reply, StateKey, Stats, WaveEffects, WorkItem, WorkQueue,
};

pub(super) fn full(n: i64) -> QueueError {
    QueueError::Full(n.max(0) as usize)
}

#[async_trait::async_trait]
impl WorkQueue for RedisQueue {
    async fn add(&self, items: Vec<WorkItem>) -> Result<(), QueueError> {
        // One script per shard: a batch is all-or-nothing within a shard (one shard by
        // default; a trigger's batch is one flow's, so one shard).
        let mut by_shard: Vec<(&str, Vec<&WorkItem>)> = Vec::new();
        for it in &items {
            let p = self.prefix_of(&it.flow);
            match by_shard.iter_mut().find(|(q, _)| *q == p) {
                Some((_, its)) => its.push(it),
                None => by_shard.push((p, vec![it])),
            }
        }
        let now = now_ms();
        for (p, its) in by_shard {
            // An id twice in one batch is journaled once, as the first.
            let mut ids = std::collections::HashSet::with_capacity(its.len());
            let its: Vec<&WorkItem> = its.into_iter().filter(|it| ids.insert(it.id)).collect();
            let (ready, later): (Vec<&WorkItem>, Vec<&WorkItem>) = its
                .into_iter()
                .partition(|it| it.not_before.is_none_or(|t| t <= now));
            let mut args: Vec<String> = Vec::with_capacity(2 + 3 * ready.len() + 6 * later.len());
            args.push(self.opts.max_ready.to_string());
            args.push(ready.len().to_string());
            for it in ready {
                args.extend([
                    it.id.to_string(),
                    it.deliveries.to_string(),
                    serde_json::to_string(it).map_err(corrupt)?,
                ]);
            }
            for it in later {
                let r = rec(it, None)?;
                args.extend([
                    r.id,
                    it.flow.clone(),
                    r.deliveries.to_string(),
                    r.enq,
                    r.due,
                    r.body,
                ]);
            }
            let args: Vec<&dyn RedisArg> = args.iter().map(|a| a as &dyn RedisArg).collect();
            let (r, n): (String, i64) = self.run(&self.scripts.add, p, &args).await?;
            if r == "full" {
                return Err(full(n));
            }
            self.made_ready();
        }
        Ok(())
    }

    async fn add_idempotent(&self, key: &str, item: WorkItem) -> Result<(Ulid, bool), QueueError> {
        let p = self.prefix_of(&item.flow);
        let payload = serde_json::to_string(&rec(&item, None)?).map_err(corrupt)?;
        let (r, v): (String, String) = self
            .run(
                &self.scripts.add_idempotent,
                p,
                &[
                    &keys::idempotency(p, key),
                    &self
                        .idempotency_ttl
                        .load(std::sync::atomic::Ordering::Relaxed)
                        .to_string(),
                    &self.opts.max_ready,
                    &payload,
                ],
            )
            .await?;
        match r.as_str() {
            "full" => Err(full(v.parse().unwrap_or(0))),
            "old" => Ok((Ulid::from_string(&v).map_err(corrupt)?, false)),
            _ => {
                self.made_ready();
                Ok((item.id, true))
            }
        }
    }

    async fn add_tick(
        &self,
        key: &StateKey,
        tick: i64,
        item: WorkItem,
    ) -> Result<bool, QueueError> {
        let p = self.prefix_of(&key.flow);
        let payload = serde_json::to_string(&rec(&item, None)?).map_err(corrupt)?;
        let r: i64 = self
            .run(
                &self.scripts.add_tick,
                p,
                &[
                    &keys::state(p, &key.flow, &key.node),
                    &keys::versions(p, &key.flow, &key.node),
                    &key.key.as_str(),
                    &tick.to_string(),
                    &payload,
                ],
            )
            .await?;
        if r == 1 {
            self.made_ready();
        }
        Ok(r == 1)
    }

    async fn claim(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Claimed>, QueueError> {
        {
            let mut back = self.recovered.lock().unwrap_or_else(|e| e.into_inner());
            if !back.is_empty() {
                let n = max.min(back.len());
                return Ok(back.drain(..n).collect());
            }
        }
        // Claims poll (a script cannot block): quickly at first, then less often, and at
        // once when this engine makes items ready. The wake-up is armed before each round, so
        // an add that lands while the round runs is not missed.
        let deadline = tokio::time::Instant::now() + wait;
        let (first, most) = self.poll_pauses();
        let mut pause = first;
        // Whether this round follows a wake-up by another engine's add, heard on the channel.
        let mut heard = false;
        loop {
            let woken = self.wakes.ready.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let adds_heard = self.wakes.heard.load(Ordering::Acquire);
            let out = self.claim_round(consumer, max).await?;
            if !out.is_empty() && heard {
                self.heard.adds_woke.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("weir_redis_adds_heard_total").increment(1);
            }
            if !out.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(out);
            }
            let left = deadline - tokio::time::Instant::now();
            let _waiting = WaitingClaim::new(&self.wakes.waiting);
            tokio::select! {
                _ = tokio::time::sleep(pause.min(left)) => {
                    pause = pause.saturating_mul(2).min(most);
                    heard = false;
                }
                _ = woken => {
                    pause = first;
                    heard = self.wakes.heard.load(Ordering::Acquire) != adds_heard;
                }
            }
        }
    }

    async fn commit(&self, claimed: &Claimed, fx: WaveEffects) -> Result<Committed, QueueError> {
        let item = &claimed.item;
        let p = self.prefix_of(&item.flow);
        let (kind, reason): (_, std::borrow::Cow<str>) = match &fx.end {
            None | Some(End::Ack) => ("ack", fx.outcome.as_deref().unwrap_or("done").into()),
            Some(End::Superseded) => ("ack", "superseded by a newer timer".into()),
            Some(End::DeadLetter(r)) => ("dead", r.as_str().into()),
            Some(End::Park) => ("park", "".into()),
            Some(End::Later(due)) => ("later", due.to_string().into()),
        };
        let mut items = Vec::new();
        for it in fx.follow_ups.iter().chain(&fx.delayed) {
            items.push(rec(it, None)?);
        }
        let mut dead = Vec::new();
        for (it, why) in &fx.dead {
            dead.push(rec(it, Some(why))?);
        }
        let state = fx
            .state
            .iter()
            .map(|w| {
                let p = self.prefix_of(&w.key.flow);
                Ok(serde_json::json!({
                    "hk": keys::state(p, &w.key.flow, &w.key.node),
                    "vk": keys::versions(p, &w.key.flow, &w.key.node),
                    "key": w.key.key,
                    "read": w.read_version,
                    "del": w.value.is_none(),
                    "value": w.value.as_ref().map(serde_json::to_string).transpose().map_err(corrupt)?.unwrap_or_default(),
                }))
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        let guards = fx
            .guards
            .iter()
            .map(|(k, want)| {
                let p = self.prefix_of(&k.flow);
                Ok(serde_json::json!({
                    "hk": keys::state(p, &k.flow, &k.node),
                    "key": k.key,
                    "want": serde_json::to_string(want).map_err(corrupt)?,
                }))
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        let fail = self.failpoints.hit("commit");
        let reply_lost = self.failpoints.hit("commit-reply-lost");
        // The common wave ends its item and writes nothing else: no JSON to decode.
        let effects = if items.is_empty()
            && dead.is_empty()
            && state.is_empty()
            && guards.is_empty()
            && !fail
        {
            String::new()
        } else {
            let fx = serde_json::json!({
                "items": items, "dead": dead, "state": state, "guards": guards, "fail": fail,
            });
            serde_json::to_string(&fx).map_err(corrupt)?
        };
        // An acknowledged item's finished record is written as the client made it (its
        // fields as one line of JSON, a newline, the body): the script only checks the
        // claim, with no per-item work of its own.
        let record = if kind == "ack" {
            let fields = FinishedFields {
                st: "finished",
                reason: &reason,
                at: AsText(now_ms()),
                flow: &item.flow,
                deliveries: AsText(item.deliveries),
                enq: AsText(item.enqueued_at),
            };
            let mut rec = serde_json::to_string(&fields).map_err(corrupt)?;
            // Called so: `rec.push` would find `RedisArg::push` first.
            String::push(&mut rec, '\n');
            // The body as journaled (its deliveries and due time are the record's own
            // fields, which a view reads instead).
            if claimed.receipt.journaled.is_empty() {
                rec.push_str(&serde_json::to_string(item).map_err(corrupt)?);
            } else {
                rec.push_str(&claimed.receipt.journaled);
            }
            rec
        } else {
            String::new()
        };
        let args = if kind == "ack" && effects.is_empty() && !claimed.receipt.entry.is_empty() {
            // The line its claim wrote in `live` (see `CLAIM`): lease, entry, the
            // deliveries before this one.
            let mut n = itoa::Buffer::new();
            let mut line = String::with_capacity(48);
            line.push_str(n.format(claimed.lease));
            String::push(&mut line, ' ');
            line.push_str(&claimed.receipt.entry);
            String::push(&mut line, ' ');
            line.push_str(n.format(item.deliveries.saturating_sub(1)));
            CommitArgs::Plain([
                item.id.to_string(),
                line,
                claimed.receipt.entry.clone(),
                record,
            ])
        } else {
            CommitArgs::Full([
                item.id.to_string(),
                claimed.lease.to_string(),
                item.flow.clone(),
                kind.to_string(),
                reason.into_owned(),
                effects,
                record,
            ])
        };
        let r = self.commit_grouped(p, args).await?;
        if r == "failed" {
            return Err(QueueError::Unavailable("failpoint `commit` fired".into()));
        }
        if reply_lost {
            return Err(QueueError::Unavailable(
                "failpoint `commit-reply-lost` fired (the commit went through)".into(),
            ));
        }
        if r == "done" && !fx.follow_ups.is_empty() {
            self.made_ready();
        }
        Ok(if r == "done" {
            Committed::Done
        } else {
            Committed::Conflict
        })
    }

    async fn reclaim_stale(&self, min_idle: Duration) -> Result<usize, QueueError> {
        let mut n = 0;
        let idle = (min_idle.as_millis() as u64).to_string();
        for p in self.prefixes() {
            let mut cursor = "0-0".to_string();
            for round in 0..RECLAIM_ROUNDS {
                if round + 1 == RECLAIM_ROUNDS {
                    tracing::warn!(
                        looked_at = RECLAIM_ROUNDS * RECLAIM_BATCH,
                        "reclaim pass stopped at its bound; the rest of the pending entries wait for the next pass"
                    );
                }
                let (got, next): (usize, String) = self
                    .run(
                        &self.scripts.reclaim,
                        p,
                        &[&"weir-reclaimer", &idle, &cursor, &RECLAIM_BATCH],
                    )
                    .await?;
                n += got;
                if next == "0-0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(n)
    }

    async fn move_due(&self, now: i64) -> Result<usize, QueueError> {
        let mut n = 0;
        let now = now.to_string();
        for p in self.prefixes() {
            let got: usize = self
                .run(&self.scripts.move_due, p, &[&now, &PROMOTE_BATCH])
                .await?;
            n += got;
        }
        Ok(n)
    }

    async fn next_due(&self) -> Result<Option<i64>, QueueError> {
        let mut best: Option<i64> = None;
        let mut c = self.conn.clone();
        for p in self.prefixes() {
            let first: Vec<(String, f64)> = c
                .zrange_withscores(keys::delayed(p), 0, 0)
                .await
                .map_err(unavailable)?;
            if let Some((_, t)) = first.first() {
                let t = *t as i64;
                best = Some(best.map_or(t, |b| b.min(t)));
            }
        }
        Ok(best)
    }

    async fn mark_done(&self, key: DoneKey, outputs: Vec<Vec<Message>>) -> Result<(), QueueError> {
        let p = self.prefix_of(&key.flow);
        let k = keys::done(p, &key.item.to_string());
        let v = serde_json::to_string(&outputs).map_err(corrupt)?;
        let mut c = self.conn.clone();
        redis::pipe()
            .hset(&k, done_field(&key), v)
            .ignore()
            .expire(&k, DONE_TTL_SECS)
            .ignore()
            .query_async::<()>(&mut c)
            .await
            .map_err(unavailable)
    }

    async fn was_done(&self, key: &DoneKey) -> Result<Option<Vec<Vec<Message>>>, QueueError> {
        let p = self.prefix_of(&key.flow);
        let mut c = self.conn.clone();
        let v: Option<String> = c
            .hget(keys::done(p, &key.item.to_string()), done_field(key))
            .await
            .map_err(unavailable)?;
        v.map(|v| serde_json::from_str(&v).map_err(corrupt))
            .transpose()
    }

    async fn post_reply(&self, id: Ulid, reply: Reply) -> Result<(), QueueError> {
        let k = keys::reply(&self.opts.namespace, &id.to_string());
        let v = serde_json::to_string(&reply).map_err(corrupt)?;
        let waiter = self
            .reply_waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned();
        let mut c = self.conn.clone();
        redis::pipe()
            .rpush(&k, v)
            .ignore()
            .expire(&k, REPLY_TTL_SECS)
            .ignore()
            .query_async::<()>(&mut c)
            .await
            .map_err(unavailable)?;
        if waiter.is_none() {
            // No request waits here; it may wait at another engine. Name the reply on the
            // channel, now that the reply is kept (a waiter that hears it finds it), without
            // holding up the wave: only a hint is at stake, and the waiter's poll finds the
            // reply if the publish is lost. Not in the pipeline above: a refused publish (a
            // Redis user without pub/sub rights) would fail the whole post, and a cluster's
            // pipeline stays within one slot, which a channel has none of.
            let channel = keys::replies_posted(&self.opts.namespace);
            tokio::spawn(async move {
                if let Err(e) = c.publish::<_, _, i64>(channel, id.to_string()).await {
                    tracing::debug!(%id, error = %e, "a posted reply was not named on the channel");
                }
            });
        }
        if let Some(w) = waiter {
            // Kept as a permit if the waiter is between two polls.
            w.notify.notify_one();
        }
        Ok(())
    }

    async fn wait_reply(&self, id: Ulid, wait: Duration) -> Result<Option<Reply>, QueueError> {
        // Polled rather than BLPOP: a blocking read would hold a connection per waiter. A
        // reply posted by this engine (the usual case: the engine that journaled the event
        // claims it) wakes the poll at once; one posted by another engine, through the
        // channel of posted replies.
        let k = keys::reply(&self.opts.namespace, &id.to_string());
        let deadline = tokio::time::Instant::now() + wait;
        let (first, most) = self.poll_pauses();
        let mut pause = first;
        let mut c = self.conn.clone();
        let woken = Arc::new(ReplyWake::default());
        let _registered = ReplyWaiter::new(&self.reply_waiters, id, woken.clone());
        // Whether the look below follows a wake-up by the channel of posted replies.
        let mut heard = false;
        loop {
            let v: Option<String> = c.lpop(&k, None).await.map_err(unavailable)?;
            if let Some(v) = v {
                if heard {
                    self.heard.woke.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("weir_redis_replies_heard_total").increment(1);
                }
                return serde_json::from_str(&v).map(Some).map_err(corrupt);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            tokio::select! {
                _ = tokio::time::sleep(pause.min(deadline - now)) => {
                    pause = pause.saturating_mul(2).min(most);
                    heard = false;
                }
                _ = woken.notify.notified() => heard = woken.heard.swap(false, Ordering::AcqRel),
            }
        }
    }
}

#[async_trait::async_trait]
impl crate::Consumers for RedisQueue {
    async fn recover(&self, consumer: &str) -> Result<usize, QueueError> {
        // Everything pending for this consumer is taken in one pass (bounded per shard):
        // claimed again in place, and handed out by the next claims before anything newer.
        let mut back = Vec::new();
        for p in self.prefixes() {
            let flat: Vec<redis::Value> = self
                .run(
                    &self.scripts.recover,
                    p,
                    &[&consumer, &(RECLAIM_BATCH * RECLAIM_ROUNDS)],
                )
                .await?;
            let (lease, rows) = claimed_rows(flat)?;
            for row in rows {
                // `RECOVER` answers only items in flight on their entries, never a foreign one.
                let Row::Item(row) = row else { continue };
                match row.decode(lease, consumer) {
                    Ok(c) => back.push(c),
                    Err((entry, e)) => self.bury_undecodable(p, &entry, &e).await?,
                }
            }
        }
        let n = back.len();
        self.recovered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(back);
        Ok(n)
    }

    async fn release(&self, consumer: &str) -> Result<usize, QueueError> {
        let mut n = 0;
        for p in self.prefixes() {
            for _ in 0..RECLAIM_ROUNDS {
                let (got, left): (usize, usize) = self
                    .run(&self.scripts.release, p, &[&consumer, &RECLAIM_BATCH])
                    .await?;
                n += got;
                if left == 0 {
                    break;
                }
            }
        }
        Ok(n)
    }
}

#[async_trait::async_trait]
impl crate::Admin for RedisQueue {
    /// Finished items and dead letters; run records (hashes per flow) are left to the
    /// server's memory policy for now.
    async fn prune(&self, before: i64) -> Result<crate::Pruned, QueueError> {
        let mut p = crate::Pruned::default();
        // Keys set from now on live no longer than what retention keeps; those set before
        // expire at their own time (a day at most).
        let kept = (crate::now_ms() - before) / 1000;
        self.idempotency_ttl.store(
            kept.clamp(1, IDEMPOTENCY_TTL_SECS),
            std::sync::atomic::Ordering::Relaxed,
        );
        let before = before.to_string();
        for shard in self.prefixes() {
            let (o, d): (usize, usize) = self
                .run(&self.scripts.prune, shard, &[&before, &10_000usize])
                .await?;
            p.outcomes += o;
            p.dead += d;
        }
        Ok(p)
    }

    async fn clear_flow(&self, flow: &str) -> Result<usize, QueueError> {
        // A page of each kind of item per call, so that no one call holds the server long.
        const PAGE: usize = 500;
        let p = self.prefix_of(flow);
        let (mut cursor, mut rank, mut total) = ("-".to_string(), 0i64, 0);
        loop {
            let (n, next, next_rank, parked_left): (usize, String, i64, i64) = self
                .run(
                    &self.scripts.clear_flow,
                    p,
                    &[&flow, &PAGE, &cursor.as_str(), &rank.to_string()],
                )
                .await?;
            total += n;
            if next.is_empty() && next_rank < 0 && parked_left == 0 {
                return Ok(total);
            }
            (cursor, rank) = (next, next_rank);
        }
    }

    async fn stats(&self) -> Result<Stats, QueueError> {
        let mut s = Stats {
            durable: true,
            ..Default::default()
        };
        let now = now_ms();
        for p in self.prefixes() {
            let (ready, in_flight, delayed, parked, dead, enq, evicted): (
                i64,
                i64,
                i64,
                i64,
                i64,
                String,
                u64,
            ) = self.run(&self.scripts.stats, p, &[]).await?;
            s.ready += ready.max(0) as usize;
            s.in_flight += in_flight.max(0) as usize;
            s.delayed += delayed.max(0) as usize;
            s.parked += parked.max(0) as usize;
            s.dead += dead.max(0) as usize;
            s.dead_evicted += evicted;
            if let Ok(t) = enq.parse::<i64>() {
                let age = now - t;
                s.oldest_pending_age_ms = Some(s.oldest_pending_age_ms.map_or(age, |a| a.max(age)));
            }
        }
        Ok(s)
    }

    async fn dead_letters(&self, n: usize) -> Result<Vec<ItemView>, QueueError> {
        let mut out = Vec::new();
        let mut c = self.conn.clone();
        for p in self.prefixes() {
            let newest: redis::streams::StreamRangeReply = c
                .xrevrange_count(keys::dead(p), "+", "-", n)
                .await
                .map_err(unavailable)?;
            for e in newest.ids {
                let Some(id) = e.get::<String>("id") else {
                    continue;
                };
                if let Some(v) = self.record(p, &id).await? {
                    out.push(v);
                }
            }
        }
        let at = |v: &ItemView| match v.state {
            ItemState::Dead { at, .. } => at,
            _ => 0,
        };
        // Stable: within a shard the stream's own order (newest first) breaks ties.
        out.sort_by_key(|v| std::cmp::Reverse(at(v)));
        out.truncate(n);
        Ok(out)
    }

    async fn get(&self, id: Ulid) -> Result<Option<ItemView>, QueueError> {
        Ok(self.find(id).await?.map(|(_, v)| v))
    }

    async fn list(&self, f: ListFilter) -> Result<Vec<ItemView>, QueueError> {
        let limit = if f.limit == 0 { 100 } else { f.limit };
        let mut out = Vec::new();
        let mut c = self.conn.clone();
        let shards = match &f.flow {
            Some(flow) => vec![self.prefix_of(flow)],
            None => self.prefixes().iter().map(String::as_str).collect(),
        };
        for p in shards {
            let mut from = f
                .after
                .map(|a| format!("({a}"))
                .unwrap_or_else(|| "-".into());
            let mut taken = 0;
            // Pages of ids in ULID order, filtered, until enough match (bounded).
            for _ in 0..1000 {
                let ids: Vec<String> = c
                    .zrangebylex_limit(keys::index(p), &from, "+", 0, 200)
                    .await
                    .map_err(unavailable)?;
                let Some(last) = ids.last().cloned() else {
                    break;
                };
                for id in &ids {
                    if let Some(v) = self.record(p, id).await? {
                        let flow_ok = f.flow.as_ref().is_none_or(|fl| *fl == v.item.flow);
                        let state_ok = f.state.as_ref().is_none_or(|s| s == v.state.name());
                        if flow_ok && state_ok {
                            out.push(v);
                            taken += 1;
                        }
                    } else {
                        // The record was pruned; drop its id from the index too.
                        let _: () = c.zrem(keys::index(p), id).await.map_err(unavailable)?;
                    }
                    if taken >= limit {
                        break;
                    }
                }
                if taken >= limit {
                    break;
                }
                from = format!("({last}");
            }
        }
        out.sort_by_key(|v| v.item.id);
        out.truncate(limit);
        Ok(out)
    }

    async fn cancel(&self, id: Ulid) -> Result<(), QueueError> {
        self.on_item(&self.scripts.cancel, id, None, |st| match st {
            "in_flight" => {
                QueueError::Conflict(format!("item {id} is in flight; it ends with its wave"))
            }
            "dead" => {
                QueueError::Conflict(format!("item {id} is a dead letter: discard or replay it"))
            }
            _ => QueueError::Conflict(format!("item {id} has finished")),
        })
        .await
    }

    async fn replay(&self, id: Ulid) -> Result<Ulid, QueueError> {
        let Some((_, v)) = self.find(id).await? else {
            return Err(QueueError::NotFound(id));
        };
        let item = v.item.replayed();
        let new_id = item.id;
        let payload = serde_json::to_string(&rec(&item, None)?).map_err(corrupt)?;
        self.on_item(&self.scripts.replay, id, Some(payload), |_| {
            QueueError::Conflict(format!("item {id} is not a dead letter"))
        })
        .await?;
        Ok(new_id)
    }

    async fn discard(&self, id: Ulid) -> Result<(), QueueError> {
        self.on_item(&self.scripts.discard, id, None, |_| {
            QueueError::Conflict(format!("item {id} is not a dead letter"))
        })
        .await
    }
}

#[async_trait::async_trait]
impl crate::Pausing for RedisQueue {
    async fn parked(&self, flow: &str) -> Result<usize, QueueError> {
        let mut c = self.conn.clone();
        c.llen(keys::parked(self.prefix_of(flow), flow))
            .await
            .map_err(unavailable)
    }

    async fn set_paused(&self, flow: &str, paused: bool) -> Result<(), QueueError> {
        let key = keys::paused(self.prefix_of(flow));
        let mut c = self.conn.clone();
        if paused {
            c.sadd::<_, _, ()>(key, flow).await.map_err(unavailable)
        } else {
            c.srem::<_, _, ()>(key, flow).await.map_err(unavailable)
        }
    }

    async fn is_paused(&self, flow: &str) -> Result<bool, QueueError> {
        let mut c = self.conn.clone();
        c.sismember(keys::paused(self.prefix_of(flow)), flow)
            .await
            .map_err(unavailable)
    }

    async fn resume(&self, flow: &str) -> Result<usize, QueueError> {
        self.run(&self.scripts.resume, self.prefix_of(flow), &[&flow])
            .await
    }

    async fn unpark_one(&self, flow: &str) -> Result<Option<Ulid>, QueueError> {
        let r: Option<String> = self
            .run(&self.scripts.unpark_one, self.prefix_of(flow), &[&flow])
            .await?;
        r.map(|id| Ulid::from_string(&id).map_err(corrupt))
            .transpose()
    }
}

impl From<RedisQueue> for crate::Queue {
    fn from(q: RedisQueue) -> Self {
        let q = std::sync::Arc::new(q);
        crate::Queue::new(q.clone(), true)
            .with_consumers(q.clone())
            .with_quotas(q)
    }
}
