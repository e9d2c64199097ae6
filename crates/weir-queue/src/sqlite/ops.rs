//! The queue's contract, carried out: each call is a job for the writer or a read.

use std::time::Duration;

use rusqlite::{params, OptionalExtension};
use tokio::sync::oneshot;
use ulid::Ulid;

use super::kept::*;
use super::metrics::*;
use super::rows::*;
use super::schema::*;
use super::tx::*;
use super::writer::*;
use super::*;
use crate::Receipt;
use crate::{
    now_ms, Claimed, Committed, DoneKey, ItemState, ItemView, ListFilter, Message, QueueError,
    Reply, StateError, StateKey, StateRead, Stats, Versioned, WaveEffects, WorkItem, WorkQueue,
};

#[async_trait::async_trait]
impl StateRead for SqliteQueue {
    async fn read(&self, key: &StateKey) -> Result<Versioned, StateError> {
        let key = key.clone();
        self.read_with(move |c| read_state(c, &key))
            .await
            .map_err(|e| StateError(e.to_string()))
    }

    async fn count_node_keys(
        &self,
        flow: &str,
        node: &str,
        prefix: &str,
    ) -> Result<usize, StateError> {
        let (flow, node, prefix) = (flow.to_string(), node.to_string(), prefix.to_string());
        self.read_with(move |c| {
            let n: i64 = c
                .cached(
                    "SELECT count(*) FROM state
                     WHERE flow = ?1 AND node = ?2 AND value IS NOT NULL
                       AND substr(key, 1, length(?3)) = ?3",
                )?
                .query_row(params![flow, node, prefix], |r| r.get(0))?;
            Ok(n as usize)
        })
        .await
        .map_err(|e: QueueError| StateError(e.to_string()))
    }

    async fn read_node(
        &self,
        flow: &str,
        node: &str,
    ) -> Result<Vec<(String, Versioned)>, StateError> {
        let (flow, node) = (flow.to_string(), node.to_string());
        self.read_with(move |c| {
            let rows: Vec<(String, Option<String>, i64)> = c
                .cached(
                    "SELECT key, value, version FROM state
                     WHERE flow = ?1 AND node = ?2 AND value IS NOT NULL",
                )?
                .query_map(params![flow, node], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })?
                .collect::<Result<_, _>>()?;
            rows.into_iter()
                .map(|(k, v, version)| {
                    Ok((
                        k,
                        Versioned {
                            value: v.as_deref().map(unjson).transpose()?,
                            version: version as u64,
                        },
                    ))
                })
                .collect()
        })
        .await
        .map_err(|e| StateError(e.to_string()))
    }
}

impl crate::ClaimsWait for SqliteQueue {
    /// Four: with two, the claim loop's turn (hand out one answer, send the next claim)
    /// sometimes outlasted a transaction, and an item journaled meanwhile was claimed a
    /// transaction later (one more fsync); with four that is rare.
    fn claims_ahead(&self) -> usize {
        4
    }
}

#[async_trait::async_trait]
impl crate::Closing for SqliteQueue {
    async fn close(&self) {
        let _ = self.jobs.send(Msg::Close);
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = writer {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
    }
}

#[async_trait::async_trait]
impl WorkQueue for SqliteQueue {
    async fn add(&self, items: Vec<WorkItem>) -> Result<(), QueueError> {
        let max = self.max_ready;
        let rows = Encoded::owning(items)?;
        self.write_as(Wait::Journal, move |c, w| {
            if w.ready + rows.len() as i64 > max {
                return Err(QueueError::Full(w.ready.max(0) as usize));
            }
            insert_all(c, w, &rows)?;
            // Handed back to be freed here: freed on the writer's thread, memory allocated
            // on another one costs the writer the lock of that thread's allocator arena.
            Ok((rows, w.failpoints.hit("add-reply-lost")))
        })
        .await
        .and_then(|(_, lost)| match lost {
            false => Ok(()),
            true => Err(QueueError::Unavailable(
                "failpoint `add-reply-lost` fired (the add went through)".into(),
            )),
        })
    }

    async fn add_idempotent(&self, key: &str, item: WorkItem) -> Result<(Ulid, bool), QueueError> {
        let key = key.to_string();
        let max = self.max_ready;
        let id = item.id;
        let row = Encoded::new(&item, now_ms())?;
        self.write_as(Wait::Journal, move |c, w| {
            let first: Option<String> = c
                .cached("SELECT id FROM idempotency WHERE key = ?1")?
                .query_row([&key], |r| r.get(0))
                .optional()?;
            if let Some(first) = first {
                let id =
                    Ulid::from_string(&first).map_err(|e| QueueError::Corrupt(e.to_string()))?;
                return Ok((id, false));
            }
            if w.ready >= max {
                return Err(QueueError::Full(w.ready.max(0) as usize));
            }
            c.cached("INSERT INTO idempotency (key, id, at) VALUES (?1, ?2, ?3)")?
                .execute(params![key, row.id, now_ms()])?;
            insert(c, w, &row)?;
            Ok((id, true))
        })
        .await
    }

    async fn add_tick(
        &self,
        key: &StateKey,
        tick: i64,
        item: WorkItem,
    ) -> Result<bool, QueueError> {
        let key = key.clone();
        let row = Encoded::new(&item, now_ms())?;
        self.write_as(Wait::Journal, move |c, w| {
            let last = read_state(c, &key)?.value.and_then(|v| v.as_i64());
            if last.is_some_and(|l| l >= tick) {
                return Ok(false);
            }
            write_state(c, &key, Some(&tick.into()))?;
            insert(c, w, &row)?;
            Ok(true)
        })
        .await
    }

    async fn claim(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Claimed>, QueueError> {
        self.claim_passing(consumer, max, wait, None).await
    }

    async fn commit(&self, claimed: &Claimed, fx: WaveEffects) -> Result<Committed, QueueError> {
        let (id, lease, flow) = (claimed.item.id, claimed.lease, claimed.item.flow.clone());
        let seq = (claimed.receipt.slot > 0).then_some(claimed.receipt.slot as i64);
        let mut fx = fx;
        let new = NewRows::take(&mut fx)?;
        self.write_as(Wait::Commit, move |c, w| {
            commit_wave(c, w, (id, seq), lease, &flow, fx, new)
        })
        .await
    }

    async fn reclaim_stale(&self, min_idle: Duration) -> Result<usize, QueueError> {
        let before = now_ms() - min_idle.as_millis() as i64;
        self.write(move |c, w| {
            // The items in flight are the writer's to know (no index over the file).
            let stale: Vec<i64> = w
                .flying
                .rows
                .iter()
                .filter(|(_, &(since, _))| since <= before)
                .map(|(&seq, _)| seq)
                .collect();
            ready_again(c, w, &stale)
        })
        .await
    }

    async fn move_due(&self, now: i64) -> Result<usize, QueueError> {
        self.write(move |c, w| {
            make_ready(
                c,
                w,
                "SELECT seq FROM items WHERE st = 'delayed' AND due <= ?1 ORDER BY due, seq",
                [now],
            )
        })
        .await
    }

    async fn next_due(&self) -> Result<Option<i64>, QueueError> {
        self.read_with(|c| {
            Ok(c.cached("SELECT min(due) FROM items WHERE st = 'delayed'")?
                .query_row([], |r| r.get(0))?)
        })
        .await
    }

    async fn mark_done(&self, key: DoneKey, outputs: Vec<Vec<Message>>) -> Result<(), QueueError> {
        self.write(move |c, w| {
            w.marked.insert(key.item);
            c.cached(
                "INSERT OR REPLACE INTO done (item, node, position, outputs) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![
                key.item.to_string(),
                key.node,
                key.position,
                json(&outputs)?
            ])?;
            Ok(())
        })
        .await
    }

    async fn was_done(&self, key: &DoneKey) -> Result<Option<Vec<Vec<Message>>>, QueueError> {
        let key = key.clone();
        self.read_with(move |c| {
            let row: Option<String> = c
                .cached("SELECT outputs FROM done WHERE item = ?1 AND node = ?2 AND position = ?3")?
                .query_row(params![key.item.to_string(), key.node, key.position], |r| {
                    r.get(0)
                })
                .optional()?;
            row.as_deref().map(unjson).transpose()
        })
        .await
    }

    async fn post_reply(&self, id: Ulid, reply: Reply) -> Result<(), QueueError> {
        self.replies.post(id, reply);
        Ok(())
    }

    async fn wait_reply(&self, id: Ulid, wait: Duration) -> Result<Option<Reply>, QueueError> {
        Ok(self.replies.wait(id, wait).await)
    }
}

impl SqliteQueue {
    /// Claim up to `max` ready items in journal order, passing over those of the flows in
    /// `skip`, waiting in the writer up to `wait` for one.
    async fn claim_passing(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
        skip: Option<std::sync::Arc<[String]>>,
    ) -> Result<Vec<Claimed>, QueueError> {
        // Always looks (an indexed LIMIT query): the ready count only bounds `add`, it never
        // decides whether an item can be claimed. Finding nothing, the claim waits in the
        // writer, which answers it by `wait` at the latest.
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Msg::Job(Job::Claim(Waiter {
                consumer: consumer.to_string(),
                max,
                deadline: std::time::Instant::now() + wait,
                reply,
                taken: Vec::new(),
                skip,
            })))
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        let taken = rx
            .await
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))??;
        // Decoded here, off the writer's thread.
        let mut out = Vec::with_capacity(taken.len());
        for mut t in taken {
            let cols = RowCols {
                id: &t.id,
                flow: std::mem::take(&mut t.flow),
                deliveries: t.deliveries,
                enqueued_at: t.enqueued_at,
                // A claimed item is due now, whenever it was due.
                due: None,
            };
            let item = match t.item.take() {
                // As decoding its row would give it: counted delivered, due now.
                Some(mut item) => {
                    item.deliveries = t.deliveries;
                    item.not_before = None;
                    Ok(item)
                }
                None => decode(&t.body, cols),
            };
            match item {
                Ok(item) => out.push(
                    Claimed::new(item, t.lease, consumer, t.stepped)
                        .with_receipt(Receipt::row(t.seq as u64)),
                ),
                Err(e) => {
                    // A poison row: set aside with the reason; the ones around it go on.
                    // If setting it aside fails, the items claimed with it are still handed
                    // out (dropping them would strand them in flight); the poison row stays
                    // in flight until a reclaim pass or the next start brings it back.
                    tracing::error!(seq = t.seq, error = %e, "an item that cannot be decoded is dead-lettered");
                    let reason = format!("undecodable item: {e}");
                    let buried = self
                        .write(move |c, w| {
                            let n = c.cached(
                            "UPDATE items SET st = 'dead', reason = ?3, at = ?4, consumer = NULL
                             WHERE seq = ?1 AND st = 'in_flight' AND lease = ?2",
                        )?
                        .execute(params![
                            t.seq,
                            t.lease as i64,
                            reason,
                            now_ms()
                        ])?;
                            if n > 0 {
                                w.flying.ended(t.seq);
                            }
                            Ok(())
                        })
                        .await;
                    if let Err(e) = buried {
                        tracing::warn!(seq = t.seq, error = %e, "could not dead-letter an undecodable item; it comes back after a reclaim pass or a restart");
                    }
                }
            }
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl crate::ClaimOnAdd for SqliteQueue {
    async fn add_claimed(
        &self,
        consumer: &str,
        item: WorkItem,
    ) -> Result<Option<Claimed>, QueueError> {
        let row = Encoded::new(&item, now_ms())?;
        let (reply, rx) = oneshot::channel();
        let sent = std::time::Instant::now();
        self.jobs
            .send(Msg::Job(Job::AddClaimed(Box::new(AddClaimed {
                row,
                consumer: consumer.to_string(),
                max_ready: self.max_ready,
                reply,
            }))))
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        let mut answer = Unreceived {
            rx: Some(rx),
            jobs: self.jobs.clone(),
        };
        let got = answer
            .receive()
            .await
            .map_err(|_| QueueError::Unavailable("the SQLite writer has stopped".into()))?;
        Wait::Journal.record(sent.elapsed());
        Ok(got?.map(|(seq, lease)| {
            let mut item = item;
            item.deliveries += 1;
            // A claimed item is due now.
            item.not_before = None;
            Claimed::new(item, lease, consumer, false).with_receipt(Receipt::row(seq as u64))
        }))
    }
}

#[async_trait::async_trait]
impl crate::Admin for SqliteQueue {
    async fn delayed_by_node(
        &self,
        flow: &str,
    ) -> Result<std::collections::BTreeMap<String, u64>, QueueError> {
        let flow = flow.to_string();
        self.read_with(move |c| {
            // The node and kind are in the body (`Stored`'s short names, or the long ones of
            // rows written before them); counted here, not read out.
            c.cached(
                "SELECT coalesce(json_extract(body, '$.n'), json_extract(body, '$.node')),
                        count(*)
                   FROM items
                  WHERE st = 'delayed' AND flow = ?1
                    AND coalesce(json_extract(body, '$.k'), json_extract(body, '$.kind'),
                                 'cascade') != 'flush'
                  GROUP BY 1",
            )?
            .query_map([&flow], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64))
            })?
            .map(|r| r.map_err(QueueError::from))
            .collect()
        })
        .await
    }

    async fn dead_ids(
        &self,
        flow: Option<&str>,
        reason: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Ulid>, QueueError> {
        let (flow, reason) = (flow.map(str::to_string), reason.map(str::to_string));
        self.read_with(move |c| {
            let ids: Vec<String> = c
                .cached(
                    "SELECT id FROM items
                      WHERE st = 'dead' AND (?1 IS NULL OR flow = ?1)
                        AND (?2 IS NULL OR instr(reason, ?2) > 0)
                      ORDER BY at DESC, seq DESC LIMIT ?3",
                )?
                .query_map(params![flow, reason, limit as i64], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            ids.iter()
                .map(|id| Ulid::from_string(id).map_err(|e| QueueError::Corrupt(e.to_string())))
                .collect()
        })
        .await
    }

    async fn prune(&self, before: i64) -> Result<crate::Pruned, QueueError> {
        self.write(move |c, w| {
            // The finished items are the writer's to know (no index over the file).
            w.recent.forget();
            let mut del = c.cached(DELETE_FINISHED_SQL)?;
            let mut outcomes = 0;
            let mut kept = std::collections::VecDeque::with_capacity(w.finished.rows.len());
            for (at, seq) in std::mem::take(&mut w.finished.rows) {
                if at < before {
                    outcomes += del.execute([seq])?;
                } else {
                    kept.push_back((at, seq));
                }
            }
            w.finished.rows = kept;
            let dead = c.execute("DELETE FROM items WHERE st = 'dead' AND at < ?1", [before])?;
            // Idempotency keys live a day, or the retention if shorter.
            c.execute("DELETE FROM idempotency WHERE at < ?1", [before])?;
            let runs = c.execute(
                "DELETE FROM state WHERE node = ?1
                   AND json_extract(value, '$.updated_at') < ?2",
                params![crate::RUNS_NODE, before],
            )?;
            Ok(crate::Pruned {
                outcomes,
                dead,
                runs,
            })
        })
        .await
    }

    async fn clear_flow(&self, flow: &str) -> Result<usize, QueueError> {
        let flow = flow.to_string();
        self.write(move |c, w| {
            let ready: i64 = c.query_row(
                "SELECT count(*) FROM items WHERE flow = ?1 AND st = 'waiting'",
                [&flow],
                |r| r.get(0),
            )?;
            let now = now_ms();
            let cleared = c.execute(
                "UPDATE items SET st = 'dead', reason = ?3, at = ?2, due = NULL, stepped = 0
                 WHERE flow = ?1 AND st IN ('waiting', 'delayed', 'parked')",
                params![flow, now, crate::removed_flow_reason(&flow)],
            )?;
            w.ready -= ready;
            Ok(cleared)
        })
        .await
    }

    async fn stats(&self) -> Result<Stats, QueueError> {
        let in_flight = self.in_flight.clone();
        self.read_with(move |c| {
            let mut s = Stats {
                durable: true,
                ..Default::default()
            };
            let now = now_ms();
            // One query per state, each on that state's own index.
            for (st, sql) in [
                (
                    "waiting",
                    "SELECT count(*), min(enqueued_at) FROM items WHERE st = 'waiting'",
                ),
                (
                    "delayed",
                    "SELECT count(*), min(enqueued_at) FROM items WHERE st = 'delayed'",
                ),
                (
                    "parked",
                    "SELECT count(*), min(enqueued_at) FROM items WHERE st = 'parked'",
                ),
                (
                    "dead",
                    "SELECT count(*), min(enqueued_at) FROM items WHERE st = 'dead'",
                ),
            ] {
                let (n, oldest): (i64, Option<i64>) = c
                    .cached(sql)?
                    .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                let n = n as usize;
                match st {
                    "waiting" => s.ready = n,
                    "delayed" => s.delayed = n,
                    "parked" => s.parked = n,
                    _ => s.dead = n,
                }
                if st == "waiting" {
                    if let Some(t) = oldest {
                        let age = now - t;
                        s.oldest_pending_age_ms =
                            Some(s.oldest_pending_age_ms.map_or(age, |a| a.max(age)));
                    }
                }
            }
            // The items in flight, which the writer counts, after those waiting: an item
            // claimed in between is counted once or twice, never missed.
            let flying = *in_flight.lock().unwrap_or_else(|p| p.into_inner());
            s.in_flight = flying.count;
            if let Some(t) = flying.oldest {
                let age = now - t;
                s.oldest_pending_age_ms = Some(s.oldest_pending_age_ms.map_or(age, |a| a.max(age)));
            }
            Ok(s)
        })
        .await
    }

    async fn dead_letters(&self, n: usize) -> Result<Vec<ItemView>, QueueError> {
        self.read_with(move |c| {
            c.cached(concat!(
                "SELECT ",
                item_cols!(),
                " FROM items WHERE st = 'dead' ORDER BY at DESC, seq DESC LIMIT ?1"
            ))?
            .query_map([n as i64], view)?
            .map(|r| r?)
            .collect()
        })
        .await
    }

    async fn get(&self, id: Ulid) -> Result<Option<ItemView>, QueueError> {
        self.read_with(move |c| get_view(c, id)).await
    }

    async fn list(&self, f: ListFilter) -> Result<Vec<ItemView>, QueueError> {
        let limit = if f.limit == 0 { 100 } else { f.limit };
        self.read_with(move |c| {
            // In the order of the rows, which is that of their ids' milliseconds (`rows_of`;
            // there is no index of ids): each millisecond's rows are read whole, and sorted
            // by id, until `limit` are found.
            let after = f.after.map(|a| a.to_string());
            let from = f.after.map_or(0, |a| rows_of(a).0);
            let mut q = c.cached(concat!(
                "SELECT ",
                item_cols!(),
                ", seq FROM items
                 WHERE seq >= ?1 AND (?2 IS NULL OR flow = ?2) AND (?3 IS NULL OR st = ?3)
                 ORDER BY seq"
            ))?;
            let mut rows = q.query(params![from, f.flow, f.state])?;
            let mut found: Vec<ItemView> = Vec::new();
            let mut ms = None;
            while let Some(r) = rows.next()? {
                let at = r.get::<_, i64>(11)? >> ROW_BITS;
                if found.len() >= limit && ms != Some(at) {
                    break;
                }
                ms = Some(at);
                if let Some(a) = &after {
                    if r.get::<_, String>(8)?.as_str() <= a.as_str() {
                        continue;
                    }
                }
                found.push(view(r)??);
            }
            found.sort_by_key(|v| v.item.id);
            found.truncate(limit);
            Ok(found)
        })
        .await
    }

    async fn cancel(&self, id: Ulid) -> Result<(), QueueError> {
        self.write(move |c, w| match item_state(c, id)?.as_deref() {
            None => Err(QueueError::NotFound(id)),
            Some(st @ ("waiting" | "delayed" | "parked")) => {
                if st == "waiting" {
                    w.ready -= 1;
                }
                finish(c, w, id, "cancelled by hand", now_ms())
            }
            Some("in_flight") => Err(QueueError::Conflict(format!(
                "item {id} is in flight; it ends with its wave"
            ))),
            Some("dead") => Err(QueueError::Conflict(format!(
                "item {id} is a dead letter: discard or replay it"
            ))),
            Some(_) => Err(QueueError::Conflict(format!("item {id} has finished"))),
        })
        .await
    }

    async fn replay(&self, id: Ulid) -> Result<Ulid, QueueError> {
        self.write(move |c, w| {
            let Some(v) = get_view(c, id)? else {
                return Err(QueueError::NotFound(id));
            };
            if !matches!(v.state, ItemState::Dead { .. }) {
                return Err(QueueError::Conflict(format!(
                    "item {id} is not a dead letter"
                )));
            }
            let item = v.item.replayed();
            let new_id = item.id;
            let now = now_ms();
            finish(c, w, id, &format!("replayed as {new_id}"), now)?;
            insert(c, w, &Encoded::new(&item, now)?)?;
            Ok(new_id)
        })
        .await
    }

    async fn discard(&self, id: Ulid) -> Result<(), QueueError> {
        self.write(move |c, w| match item_state(c, id)?.as_deref() {
            None => Err(QueueError::NotFound(id)),
            Some("dead") => finish(c, w, id, "discarded by hand", now_ms()),
            Some(_) => Err(QueueError::Conflict(format!(
                "item {id} is not a dead letter"
            ))),
        })
        .await
    }
}

#[async_trait::async_trait]
impl crate::Pausing for SqliteQueue {
    async fn parked(&self, flow: &str) -> Result<usize, QueueError> {
        let flow = flow.to_string();
        self.read_with(move |c| {
            let n: i64 = c
                .cached("SELECT count(*) FROM items WHERE st = 'parked' AND flow = ?1")?
                .query_row([&flow], |r| r.get(0))?;
            Ok(n as usize)
        })
        .await
    }

    async fn set_paused(&self, flow: &str, paused: bool) -> Result<(), QueueError> {
        let name = flow.to_string();
        let _one_at_a_time = self.pausing.lock().await;
        self.write(move |c, _| {
            if paused {
                c.execute("INSERT OR IGNORE INTO paused (flow) VALUES (?1)", [&name])?;
            } else {
                c.execute("DELETE FROM paused WHERE flow = ?1", [&name])?;
            }
            Ok(())
        })
        .await?;
        let mut set = self.paused.write().unwrap_or_else(|p| p.into_inner());
        if paused {
            set.insert(flow.to_string());
        } else {
            set.remove(flow);
        }
        Ok(())
    }

    async fn is_paused(&self, flow: &str) -> Result<bool, QueueError> {
        Ok(self
            .paused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(flow))
    }

    async fn resume(&self, flow: &str) -> Result<usize, QueueError> {
        let name = flow.to_string();
        let _one_at_a_time = self.pausing.lock().await;
        let n = self
            .write(move |c, w| {
                c.execute("DELETE FROM paused WHERE flow = ?1", [&name])?;
                // In the same transaction, and back at their places in the ready order
                // (parking kept each its `ord`).
                let n = c.execute(
                    "UPDATE items SET st = 'waiting', consumer = NULL, stepped = 0
                     WHERE flow = ?1 AND st = 'parked'",
                    [&name],
                )?;
                if n > 0 {
                    w.ready += n as i64;
                    w.woke = true;
                }
                Ok(n)
            })
            .await?;
        self.paused
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(flow);
        Ok(n)
    }

    async fn unpark_one(&self, flow: &str) -> Result<Option<Ulid>, QueueError> {
        let flow = flow.to_string();
        self.write(move |c, w| {
            let oldest: Option<(i64, String)> = c
                .cached(
                    "SELECT seq, id FROM items WHERE flow = ?1 AND st = 'parked'
                     ORDER BY ord LIMIT 1",
                )?
                .query_row([&flow], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?;
            let Some((seq, id)) = oldest else {
                return Ok(None);
            };
            // It keeps its place in the ready order, and runs although the flow is paused.
            c.execute(
                "UPDATE items SET st = 'waiting', stepped = 1 WHERE seq = ?1",
                [seq],
            )?;
            w.ready += 1;
            w.woke = true;
            Ulid::from_string(&id)
                .map(Some)
                .map_err(|e| QueueError::Corrupt(e.to_string()))
        })
        .await
    }
}

impl From<SqliteQueue> for crate::Queue {
    fn from(q: SqliteQueue) -> Self {
        let q = std::sync::Arc::new(q);
        crate::Queue::new(q.clone(), true)
            .with_claim_on_add(q.clone())
            .with_claims_wait(q.clone())
            .with_skips_flows(q.clone())
            .with_closing(q)
    }
}

#[async_trait::async_trait]
impl crate::SkipsFlows for SqliteQueue {
    async fn claim_skipping(
        &self,
        consumer: &str,
        max: usize,
        wait: Duration,
        skip: std::sync::Arc<[String]>,
    ) -> Result<Vec<Claimed>, QueueError> {
        let skip = (!skip.is_empty()).then_some(skip);
        self.claim_passing(consumer, max, wait, skip).await
    }
}
