//! Items as Redis keeps them: the records scripts write and read, and what they answer.

use std::collections::HashMap;

use serde::Serialize;
use ulid::Ulid;

use crate::{Claimed, DoneKey, ItemState, ItemView, QueueError, Receipt, WorkItem};

/// An item as the scripts take it.
#[derive(Serialize)]
pub(super) struct Rec<'a> {
    pub(super) id: String,
    pub(super) flow: &'a str,
    pub(super) body: String,
    pub(super) due: String,
    pub(super) enq: String,
    pub(super) deliveries: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reason: Option<&'a str>,
}

pub(super) fn rec<'a>(item: &'a WorkItem, reason: Option<&'a str>) -> Result<Rec<'a>, QueueError> {
    Ok(Rec {
        id: item.id.to_string(),
        flow: &item.flow,
        body: serde_json::to_string(item).map_err(|e| QueueError::Corrupt(e.to_string()))?,
        due: item.not_before.map(|t| t.to_string()).unwrap_or_default(),
        enq: item.enqueued_at.to_string(),
        deliveries: item.deliveries,
        reason,
    })
}

/// The first line of a finished record (see `finished_record` in scripts/helpers.lua): values as
/// text, as a hash would hold them.
#[derive(Serialize)]
pub(super) struct FinishedFields<'a> {
    pub(super) st: &'static str,
    pub(super) reason: &'a str,
    pub(super) at: AsText<i64>,
    pub(super) flow: &'a str,
    pub(super) deliveries: AsText<u32>,
    pub(super) enq: AsText<i64>,
}

/// A number serialized as JSON text (`"12"`), with no string made for it.
pub(super) struct AsText<T>(pub(super) T);

impl<T: itoa::Integer + Copy> Serialize for AsText<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(itoa::Buffer::new().format(self.0))
    }
}

/// One row of what `CLAIM` and `RECOVER` answer.
pub(super) enum Row {
    Item(ClaimedRow),
    /// An entry weir did not write, which the script has already taken out of the stream:
    /// its fields as text (cut to 200 bytes), to report.
    Foreign {
        entry: String,
        fields: String,
    },
}

/// An item claimed, as the scripts answer it.
pub(super) struct ClaimedRow {
    pub(super) entry: String,
    /// Counted with this delivery.
    pub(super) deliveries: u32,
    pub(super) stepped: bool,
    pub(super) body: String,
}

impl ClaimedRow {
    /// The item claimed under `lease`, keeping its entry and its JSON as read; or its entry
    /// and why its body cannot be decoded (a poison entry, for the caller to set aside).
    pub(super) fn decode(
        self,
        lease: u64,
        consumer: &str,
    ) -> Result<Claimed, (String, serde_json::Error)> {
        match Claimed::decode(&self.body, self.deliveries, lease, consumer, self.stepped) {
            Ok(c) => Ok(c.with_receipt(Receipt::entry(self.entry, self.body))),
            Err(e) => Err((self.entry, e)),
        }
    }
}

/// The lease and the rows of a claim's flat answer (the lease, then three values an item;
/// nothing at all when there was nothing to claim).
pub(super) fn claimed_rows(flat: Vec<redis::Value>) -> Result<(u64, Vec<Row>), QueueError> {
    let bad = |why: String| corrupt(format!("a claim's answer: {why}"));
    let mut it = flat.into_iter();
    let Some(lease) = it.next() else {
        return Ok((0, Vec::new()));
    };
    let lease: u64 = redis::from_redis_value(lease).map_err(|e| bad(e.to_string()))?;
    if !it.len().is_multiple_of(3) {
        return Err(bad(format!(
            "{} values after the lease, not three an item",
            it.len()
        )));
    }
    let text = |v: redis::Value| match v {
        redis::Value::BulkString(b) => Ok(b),
        other => Err(bad(format!("{other:?} where text was expected"))),
    };
    let mut rows = Vec::with_capacity(it.len() / 3);
    while let (Some(entry), Some(d), Some(body)) = (it.next(), it.next(), it.next()) {
        let entry = String::from_utf8(text(entry)?).map_err(|e| bad(e.to_string()))?;
        let d = text(d)?;
        let body = text(body)?;
        if d.is_empty() {
            // Text to show, whatever bytes it holds.
            rows.push(Row::Foreign {
                entry,
                fields: String::from_utf8_lossy(&body).into_owned(),
            });
            continue;
        }
        let (d, stepped) = match d.strip_suffix(b"s") {
            Some(d) => (d, true),
            None => (&d[..], false),
        };
        let before: u32 = std::str::from_utf8(d)
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| bad(format!("deliveries {:?}", String::from_utf8_lossy(d))))?;
        rows.push(Row::Item(ClaimedRow {
            entry,
            deliveries: before.saturating_add(1),
            stepped,
            // weir's own bodies are UTF-8 JSON.
            body: String::from_utf8(body).map_err(|e| bad(e.to_string()))?,
        }));
    }
    Ok((lease, rows))
}

pub(super) fn unavailable(e: redis::RedisError) -> QueueError {
    QueueError::Unavailable(format!("redis: {e}"))
}

pub(super) fn corrupt(e: impl std::fmt::Display) -> QueueError {
    QueueError::Corrupt(e.to_string())
}

/// Something a script takes as an argument.
pub(super) trait RedisArg: Sync {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>);
}

impl RedisArg for String {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(self.as_str());
    }
}

impl RedisArg for &str {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(*self);
    }
}

impl RedisArg for usize {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(*self);
    }
}

pub(super) fn field<'a>(h: &'a HashMap<String, String>, k: &str) -> Option<&'a str> {
    h.get(k).map(String::as_str)
}

pub(super) fn num(h: &HashMap<String, String>, k: &str) -> i64 {
    field(h, k).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// An item record as the operator sees it.
pub(super) fn view(id: &str, h: &HashMap<String, String>) -> Result<ItemView, QueueError> {
    let body = field(h, "body").unwrap_or_default();
    // A body that cannot be decoded is still shown (it is a dead letter by now).
    let mut item: WorkItem = match serde_json::from_str(body) {
        Ok(item) => item,
        Err(_) => WorkItem::undecodable(
            Ulid::from_string(id).map_err(corrupt)?,
            field(h, "flow").unwrap_or_default(),
            body,
        ),
    };
    item.deliveries = num(h, "deliveries") as u32;
    item.not_before = field(h, "due").and_then(|d| d.parse().ok());
    let text = |k| field(h, k).unwrap_or_default().to_string();
    let state = match field(h, "st").unwrap_or_default() {
        "waiting" => ItemState::Waiting,
        "in_flight" => ItemState::InFlight {
            consumer: text("consumer"),
            since: num(h, "since"),
        },
        "delayed" => ItemState::Delayed { due: num(h, "due") },
        "parked" => ItemState::Parked,
        "dead" => ItemState::Dead {
            reason: text("reason"),
            at: num(h, "at"),
        },
        "finished" => ItemState::Finished {
            outcome: text("reason"),
            at: num(h, "at"),
        },
        other => return Err(corrupt(format!("unknown item state `{other}`"))),
    };
    Ok(ItemView { item, state })
}

pub(super) fn done_field(key: &DoneKey) -> String {
    format!("{}/{}", key.node, key.position)
}
