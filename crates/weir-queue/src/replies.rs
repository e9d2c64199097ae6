//! Replies to `respond: wave` webhooks, for backends whose engine is the only one that can be
//! waiting for them (memory, and SQLite, whose file one engine holds at a time). A reply is
//! worth nothing once its HTTP request is gone, so it is kept in memory, bounded.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use ulid::Ulid;

use crate::Reply;

const REPLIES_KEPT: usize = 10_000;

#[derive(Default)]
pub(crate) struct Replies {
    map: Mutex<BTreeMap<Ulid, Reply>>,
    posted: Notify,
}

impl Replies {
    pub(crate) fn post(&self, id: Ulid, reply: Reply) {
        {
            let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
            m.insert(id, reply);
            // ULIDs sort by time: the first are the oldest, whose waiters have given up.
            while m.len() > REPLIES_KEPT {
                m.pop_first();
            }
        }
        self.posted.notify_waiters();
    }

    pub(crate) async fn wait(&self, id: Ulid, wait: Duration) -> Option<Reply> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.posted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self
                .map
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id)
            {
                return Some(r);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}
