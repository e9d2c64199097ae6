//! Group commit: the waves' commits of a moment sent to one shard in one script call.

use std::collections::HashMap;
use std::sync::Arc;

use redis::Script;
use tokio::sync::oneshot;

use super::conn::*;
use super::keys;
use super::records::*;
use crate::{now_ms, QueueError};

/// One commit's script arguments (see `COMMIT`) and who waits for its word.
pub(super) type GroupedCommit = (CommitArgs, oneshot::Sender<Result<String, QueueError>>);

/// A commit as the group script takes it.
pub(super) enum CommitArgs {
    /// The item ends and nothing else is written: id, the `live` line its claim wrote, its
    /// entry, its finished record.
    Plain([String; 4]),
    /// Anything else: id, lease, flow, end, reason, effects, finished record.
    Full([String; 7]),
}

impl CommitArgs {
    pub(super) fn strings(&self) -> &[String] {
        match self {
            CommitArgs::Plain(a) => a,
            CommitArgs::Full(a) => a,
        }
    }
}

/// Commits waiting for their shard's next group call.
#[derive(Default)]
pub(super) struct CommitGroup {
    pub(super) waiting: Vec<GroupedCommit>,
    /// Tasks sending this shard's groups (at most `COMMIT_CALLS`); each stops when none is
    /// waiting.
    pub(super) flushing: usize,
}

pub(super) type CommitGroups = Arc<std::sync::Mutex<HashMap<String, CommitGroup>>>;

/// Commits in one script call at most (the call's arguments stay small).
pub(super) const COMMIT_GROUP: usize = 128;
/// Group calls of one shard on their way at once.
pub(super) const COMMIT_CALLS: usize = 2;

/// Send shard `p`'s waiting commits, a group per call, until none is waiting.
pub(super) async fn flush_commits(mut conn: Conn, script: Script, groups: CommitGroups, p: String) {
    loop {
        let batch: Vec<_> = {
            let mut g = groups.lock().unwrap_or_else(|e| e.into_inner());
            let Some(group) = g.get_mut(&p) else { return };
            if group.waiting.is_empty() {
                group.flushing -= 1;
                return;
            }
            let n = group.waiting.len().min(COMMIT_GROUP);
            group.waiting.drain(..n).collect()
        };
        // The plain ones first, as the script answers them.
        let (mut batch, full): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .partition(|(a, _)| matches!(a, CommitArgs::Plain(_)));
        let plain = batch.len();
        batch.extend(full);
        let mut inv = script.prepare_invoke();
        inv.key(keys::stream(&p))
            .arg(&p)
            .arg(now_ms().to_string())
            .arg(plain)
            .arg(batch.len() - plain);
        for (args, _) in &batch {
            for a in args.strings() {
                inv.arg(a);
            }
        }
        let answer: Result<Vec<String>, QueueError> =
            inv.invoke_async(&mut conn).await.map_err(unavailable);
        match answer {
            Ok(words) if words.len() == batch.len() => {
                for ((_, tx), w) in batch.into_iter().zip(words) {
                    let _ = tx.send(Ok(w));
                }
            }
            Ok(words) => {
                let e = format!(
                    "a group commit of {} answered {} words",
                    batch.len(),
                    words.len()
                );
                for (_, tx) in batch {
                    let _ = tx.send(Err(QueueError::Corrupt(e.clone())));
                }
            }
            Err(e) => {
                let e = e.to_string();
                for (_, tx) in batch {
                    let _ = tx.send(Err(QueueError::Unavailable(e.clone())));
                }
            }
        }
    }
}
