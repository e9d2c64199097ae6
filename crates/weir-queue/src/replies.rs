//! Replies to `respond: wave` webhooks, for backends whose engine is the only one that can be
//! waiting for them (memory, and SQLite, whose file one engine holds at a time). A reply is
//! worth nothing once its HTTP request is gone, so it is kept in memory, bounded. Each waiter
//! is woken by its own reply alone.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use ulid::Ulid;

use crate::Reply;

const REPLIES_KEPT: usize = 10_000;

enum Slot {
    /// Posted before anyone waited for it.
    Posted(Reply),
    Waiting(oneshot::Sender<Reply>),
}

#[derive(Default)]
pub(crate) struct Replies {
    map: Mutex<BTreeMap<Ulid, Slot>>,
}

impl Replies {
    pub(crate) fn post(&self, id: Ulid, reply: Reply) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        match m.remove(&id) {
            Some(Slot::Waiting(tx)) => {
                let _ = tx.send(reply);
            }
            _ => {
                m.insert(id, Slot::Posted(reply));
                // ULIDs sort by time: the first are the oldest, whose waiters have given up.
                while m.len() > REPLIES_KEPT {
                    m.pop_first();
                }
            }
        }
    }

    pub(crate) async fn wait(&self, id: Ulid, wait: Duration) -> Option<Reply> {
        let rx = {
            let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(Slot::Posted(r)) = m.remove(&id) {
                return Some(r);
            }
            let (tx, rx) = oneshot::channel();
            m.insert(id, Slot::Waiting(tx));
            rx
        };
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(r)) => Some(r),
            _ => {
                let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(Slot::Waiting(_)) = m.get(&id) {
                    m.remove(&id);
                }
                None
            }
        }
    }
}
