//! The work item: one unit of journaled work.

use serde::{Deserialize, Serialize};
use ulid::Ulid;
use weir_core::{now_ms, Message};

/// The format version written into every item, so an upgraded engine reads older journals.
pub const ITEM_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ItemKind {
    /// Run what is downstream of `node`'s outputs (or, with `attempt > 0`, run `node` itself
    /// again with the input it failed on).
    Cascade,
    /// Release what a node's rate limit held back.
    Flush,
    /// A whole batch run that carries only its run id.
    Run,
}

/// One unit of journaled work (DESIGN §2). Fields that are `None` are left out of its JSON:
/// most items have none of them, and the journal writes each item's JSON up to four times
/// (add, claim, commit, delete), a page at a time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkItem {
    pub version: u32,
    /// Minted when the item is made, never reused: the 202 answer, cancel, done markers and
    /// `respond: wave` all use it.
    pub id: Ulid,
    pub kind: ItemKind,
    pub flow: String,
    pub node: String,
    /// What `node` emitted, per output port. For a retry at a node (`attempt > 0`), the input
    /// it is to run with, as `[[msg]]`.
    pub outputs: Vec<Vec<Message>>,
    /// Where it came from: `webhook:PATH`, `cron:NODE`, `delay:NODE`, `retry:NODE`, `replay:ID`…
    pub cause: String,
    /// Not to run before this time (ms since the epoch); `None` = ready now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<i64>,
    /// A key in `node`'s memory that must still hold `guard_value` when the item runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard_value: Option<serde_json::Value>,
    /// Bumped durably at each claim.
    pub deliveries: u32,
    /// Which try of a per-node retry (0 = not a retry).
    pub attempt: u32,
    /// The item this one descends from (retries, delays): the wave's reply goes to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin_id: Option<Ulid>,
    pub enqueued_at: i64,
    pub first_enqueued_at: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// A `respond: wave` request still waits for an answer from this item's chain, and this
    /// item is all that is left of the chain (a retry or a delay its wave left alone): if
    /// its wave, too, ends with no answer and leaves nothing behind, the request is told so
    /// at once instead of at its timeout. Set by the executor; left out of the JSON when
    /// false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub awaited: bool,
}

impl WorkItem {
    /// A cascade item: the given messages leave `node` on output port 0.
    pub fn cascade(flow: &str, node: &str, cause: impl Into<String>, msgs: Vec<Message>) -> Self {
        let now = now_ms();
        WorkItem {
            version: ITEM_VERSION,
            id: Ulid::new(),
            kind: ItemKind::Cascade,
            flow: flow.to_string(),
            node: node.to_string(),
            outputs: vec![msgs],
            cause: cause.into(),
            not_before: None,
            guard_key: None,
            guard_value: None,
            deliveries: 0,
            attempt: 0,
            origin_id: None,
            enqueued_at: now,
            first_enqueued_at: now,
            run_id: None,
            awaited: false,
        }
    }

    /// A follow-up made by the wave of `self`: inherits the origin and the run.
    pub fn follow_up(
        &self,
        node: &str,
        cause: impl Into<String>,
        outputs: Vec<Vec<Message>>,
    ) -> Self {
        WorkItem {
            outputs,
            origin_id: Some(self.root_id()),
            run_id: self.run_id.clone(),
            ..WorkItem::cascade(&self.flow, node, cause, Vec::new())
        }
    }

    /// The item whose event started this chain (itself unless it is a follow-up).
    pub fn root_id(&self) -> Ulid {
        self.origin_id.unwrap_or(self.id)
    }

    /// The new item a replayed dead letter becomes: a fresh id and delivery count, the same
    /// work.
    pub fn replayed(&self) -> WorkItem {
        let now = now_ms();
        WorkItem {
            id: Ulid::new(),
            cause: format!("replay:{}", self.id),
            deliveries: 0,
            attempt: self.attempt.min(1),
            not_before: None,
            guard_key: None,
            guard_value: None,
            origin_id: Some(self.root_id()),
            enqueued_at: now,
            first_enqueued_at: now,
            // The request its chain answered is long gone.
            awaited: false,
            ..self.clone()
        }
    }

    pub fn is_due(&self, now: i64) -> bool {
        self.not_before.is_none_or(|t| t <= now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields left out when they are `None`.
    const OPTIONAL: [&str; 5] = [
        "not_before",
        "guard_key",
        "guard_value",
        "origin_id",
        "run_id",
    ];

    #[test]
    fn an_items_json_leaves_out_what_it_does_not_have_and_older_journals_still_read() {
        let item = WorkItem::cascade("f", "in", "test", vec![serde_json::json!({"payload": 1})]);
        let text = serde_json::to_string(&item).unwrap();
        for absent in OPTIONAL {
            assert!(!text.contains(absent), "{absent} is written: {text}");
        }
        assert_eq!(serde_json::from_str::<WorkItem>(&text).unwrap(), item);
        // An item journaled by an earlier version, with every field written out.
        let mut old: serde_json::Value = serde_json::to_value(&item).unwrap();
        for absent in OPTIONAL {
            old[absent] = serde_json::Value::Null;
        }
        assert_eq!(serde_json::from_value::<WorkItem>(old).unwrap(), item);
        let timer = WorkItem {
            not_before: Some(5),
            guard_key: Some("k".into()),
            guard_value: Some(serde_json::json!(3)),
            origin_id: Some(Ulid::new()),
            run_id: Some("r".into()),
            ..item
        };
        let back: WorkItem = serde_json::from_str(&serde_json::to_string(&timer).unwrap()).unwrap();
        assert_eq!(back, timer);
        // `awaited` is written only when set, and read back.
        assert!(!text.contains("awaited"), "{text}");
        let heir = WorkItem {
            awaited: true,
            ..timer
        };
        let back: WorkItem = serde_json::from_str(&serde_json::to_string(&heir).unwrap()).unwrap();
        assert!(back.awaited);
        assert_eq!(back, heir);
    }
}
