//! Claiming: a round over the shards, poison entries set aside.

use super::records::*;
use super::RedisQueue;
use crate::{Claimed, QueueError};

impl RedisQueue {
    /// Up to `n` ready items of shard `p`, claimed and decoded (an undecodable one is
    /// dead-lettered with the reason, and the rest go on).
    pub(super) async fn claim_shard(
        &self,
        p: &str,
        consumer: &str,
        n: usize,
    ) -> Result<Vec<Claimed>, QueueError> {
        let flat: Vec<redis::Value> = self.run(&self.scripts.claim, p, &[&consumer, &n]).await?;
        let (lease, rows) = claimed_rows(flat)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let row = match row {
                Row::Item(row) => row,
                Row::Foreign { entry, fields } => {
                    // Not weir's: the script has already taken it out of the stream.
                    metrics::counter!("weir_redis_foreign_entries_total").increment(1);
                    tracing::warn!(
                        %entry,
                        // Debug: quoted and escaped, so its text cannot pass for lines of the log.
                        fields = ?fields,
                        "a stream entry weir did not write was found in the queue's stream and removed; \
                         whatever wrote it should use a webhook or MQTT instead"
                    );
                    continue;
                }
            };
            match row.decode(lease, consumer) {
                Ok(c) => out.push(c),
                // A poison entry: set it aside with the reason, go on with the rest.
                Err((entry, e)) => {
                    if let Err(err) = self.bury_undecodable(p, &entry, &e).await {
                        tracing::warn!(%entry, error = %err, "cannot set the undecodable item aside yet; it comes back after the reclaim delay");
                    }
                }
            }
        }
        Ok(out)
    }

    /// Dead-letter a claimed item of shard `p` whose body cannot be decoded, found by its
    /// entry (a claim's answer carries no id), and say so in the log.
    pub(super) async fn bury_undecodable(
        &self,
        p: &str,
        entry: &str,
        e: &serde_json::Error,
    ) -> Result<(), QueueError> {
        let reason = format!("undecodable item: {e}");
        let id: String = self.run(&self.scripts.bury, p, &[&entry, &reason]).await?;
        if id.is_empty() {
            tracing::warn!(%entry, error = %e, "an item that cannot be decoded was no longer in flight on this claim; left where it is");
        } else {
            tracing::error!(%id, %entry, error = %e, "an item that cannot be decoded is dead-lettered");
        }
        Ok(())
    }

    /// One claim over every shard, at most `max` items. With several shards, each is asked
    /// for a fair share at once (one round trip's latency, not one per shard), starting from
    /// a shard that turns with every round so that no shard's flows wait on another's; the
    /// rest of `max` then comes from the shards that had more. Items already claimed are
    /// handed out even when another shard fails (claimed and dropped, they would wait out
    /// the reclaim delay).
    pub(super) async fn claim_round(
        &self,
        consumer: &str,
        max: usize,
    ) -> Result<Vec<Claimed>, QueueError> {
        let shards = self.prefixes();
        if shards.len() == 1 {
            return self.claim_shard(&shards[0], consumer, max).await;
        }
        let k = shards.len();
        let first = self
            .next_shard
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % k;
        let order: Vec<&String> = (0..k).map(|i| &shards[(first + i) % k]).collect();
        let mut out = Vec::new();
        let mut more = Vec::new();
        let mut failed = None;
        // Shards in groups of at most what is still wanted (one each at least), until the
        // claim is full or every shard was asked.
        let mut i = 0;
        while i < k && out.len() < max && failed.is_none() {
            let want = max - out.len();
            let group = &order[i..i + (k - i).min(want)];
            let share = (want / group.len()).max(1);
            let answers = futures::future::join_all(
                group.iter().map(|p| self.claim_shard(p, consumer, share)),
            )
            .await;
            for (p, a) in group.iter().zip(answers) {
                match a {
                    Ok(got) => {
                        if got.len() == share {
                            more.push(*p);
                        }
                        out.extend(got);
                    }
                    Err(e) => failed = Some(e),
                }
            }
            i += group.len();
        }
        for p in more {
            if out.len() >= max || failed.is_some() {
                break;
            }
            match self.claim_shard(p, consumer, max - out.len()).await {
                Ok(got) => out.extend(got),
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) if out.is_empty() => Err(e),
            Some(e) => {
                tracing::warn!(error = %e, claimed = out.len(), "a shard could not be claimed from; handing out what the others gave");
                Ok(out)
            }
            None => Ok(out),
        }
    }
}
