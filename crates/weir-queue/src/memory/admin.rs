//! The memory queue's operator side: what the admin API reads and does, and pausing.

use std::collections::BTreeMap;

use ulid::Ulid;

use super::*;

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

    async fn resume(&self, flow: &str) -> Result<usize, QueueError> {
        let n = {
            let mut g = self.lock();
            g.paused.remove(flow);
            g.release_parked(flow)
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
