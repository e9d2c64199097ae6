//! How an item is kept in its row: the compact `body` and the columns beside it.

use std::borrow::Cow;

use ulid::Ulid;

use crate::{now_ms, ItemKind, Message, QueueError, WorkItem, ITEM_VERSION};

/// The columns [`view`](super::tx::view) reads, as a literal for `concat!` (every statement
/// is a constant: the statement cache knows it by its address).
macro_rules! item_cols {
    () => {
        "body, deliveries, due, st, consumer, since, reason, at, id, flow, enqueued_at"
    };
}
pub(super) use item_cols;

impl From<rusqlite::Error> for QueueError {
    fn from(e: rusqlite::Error) -> Self {
        QueueError::Unavailable(format!("sqlite: {e}"))
    }
}

pub(super) fn json<T: serde::Serialize>(v: &T) -> Result<String, QueueError> {
    serde_json::to_string(v).map_err(|e| QueueError::Corrupt(e.to_string()))
}

pub(super) fn unjson<T: serde::de::DeserializeOwned>(s: &str) -> Result<T, QueueError> {
    serde_json::from_str(s).map_err(|e| QueueError::Corrupt(e.to_string()))
}

/// An item as this journal keeps it in its row's `body`: only what the row's columns (`id`,
/// `flow`, `deliveries`, `enqueued_at`, `due`) do not already hold, under one-letter names,
/// with the usual values left out. A row is written up to four times (add, claim, commit,
/// delete) and every page it is on is written whole each time, so the row's size is paid
/// four times per item: the whole item as JSON was 230 bytes for a one-field message, this
/// is 50. Rows written before (the whole `WorkItem` as JSON, schema 2) read through the
/// aliases; their extra fields are what the columns hold. Written from a borrowed item (no
/// copy of its messages to encode it), read into owned values.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct Stored<'a> {
    #[serde(rename = "n", alias = "node")]
    pub(super) node: Cow<'a, str>,
    #[serde(rename = "o", alias = "outputs")]
    pub(super) outputs: Cow<'a, [Vec<Message>]>,
    #[serde(rename = "c", alias = "cause")]
    pub(super) cause: Cow<'a, str>,
    #[serde(
        rename = "k",
        alias = "kind",
        default = "cascade",
        skip_serializing_if = "is_cascade"
    )]
    pub(super) kind: ItemKind,
    #[serde(
        rename = "a",
        alias = "attempt",
        default,
        skip_serializing_if = "is_zero"
    )]
    pub(super) attempt: u32,
    /// Left out when it is the row's `enqueued_at` (an item that was not made again).
    #[serde(
        rename = "f",
        alias = "first_enqueued_at",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub(super) first_enqueued_at: Option<i64>,
    #[serde(
        rename = "gk",
        alias = "guard_key",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub(super) guard_key: Option<Cow<'a, str>>,
    #[serde(
        rename = "gv",
        alias = "guard_value",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub(super) guard_value: Option<Cow<'a, serde_json::Value>>,
    #[serde(
        rename = "og",
        alias = "origin_id",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub(super) origin_id: Option<Ulid>,
    #[serde(
        rename = "r",
        alias = "run_id",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub(super) run_id: Option<Cow<'a, str>>,
    #[serde(
        rename = "w",
        alias = "awaited",
        default,
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub(super) awaited: bool,
}

pub(super) fn cascade() -> ItemKind {
    ItemKind::Cascade
}

pub(super) fn is_cascade(k: &ItemKind) -> bool {
    *k == ItemKind::Cascade
}

pub(super) fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What a row holds of an item besides its `body`.
pub(super) struct RowCols<'a> {
    pub(super) id: &'a str,
    pub(super) flow: String,
    pub(super) deliveries: u32,
    pub(super) enqueued_at: i64,
    pub(super) due: Option<i64>,
}

/// The item a row holds. `Err` is a body (or an id) that cannot be read: a poison row.
pub(super) fn decode(body: &str, cols: RowCols<'_>) -> Result<WorkItem, String> {
    let s: Stored = serde_json::from_str(body).map_err(|e| e.to_string())?;
    let id = Ulid::from_string(cols.id).map_err(|e| format!("the row's id: {e}"))?;
    Ok(WorkItem {
        version: ITEM_VERSION,
        id,
        kind: s.kind,
        flow: cols.flow,
        node: s.node.into_owned(),
        outputs: s.outputs.into_owned(),
        cause: s.cause.into_owned(),
        not_before: cols.due,
        guard_key: s.guard_key.map(Cow::into_owned),
        guard_value: s.guard_value.map(Cow::into_owned),
        deliveries: cols.deliveries,
        attempt: s.attempt,
        origin_id: s.origin_id,
        enqueued_at: cols.enqueued_at,
        first_enqueued_at: s.first_enqueued_at.unwrap_or(cols.enqueued_at),
        run_id: s.run_id.map(Cow::into_owned),
        awaited: s.awaited,
    })
}

/// An item encoded for the writer by its caller: the JSON is made on the caller's thread, so
/// the one writer thread (every durable write goes through it) only runs SQL.
pub(super) struct Encoded {
    pub(super) id: String,
    pub(super) ulid: Ulid,
    pub(super) flow: String,
    /// Not before this time; `None` = ready now.
    pub(super) due: Option<i64>,
    pub(super) deliveries: u32,
    pub(super) enqueued_at: i64,
    pub(super) body: String,
    /// The item itself, when its caller gave it up ([`Encoded::owning`]): handed to a
    /// claimer waiting in the same transaction (`insert_claimed`), it is not decoded again
    /// from `body`. Taken at most once.
    pub(super) item: std::cell::Cell<Option<WorkItem>>,
}

impl Encoded {
    pub(super) fn new(item: &WorkItem, now: i64) -> Result<Encoded, QueueError> {
        let WorkItem {
            version: _,
            id,
            kind,
            flow,
            node,
            outputs,
            cause,
            not_before,
            guard_key,
            guard_value,
            deliveries,
            attempt,
            origin_id,
            enqueued_at,
            first_enqueued_at,
            run_id,
            awaited,
        } = item;
        let body = json(&Stored {
            node: Cow::Borrowed(node),
            outputs: Cow::Borrowed(outputs),
            cause: Cow::Borrowed(cause),
            kind: *kind,
            attempt: *attempt,
            first_enqueued_at: (first_enqueued_at != enqueued_at).then_some(*first_enqueued_at),
            guard_key: guard_key.as_deref().map(Cow::Borrowed),
            guard_value: guard_value.as_ref().map(Cow::Borrowed),
            origin_id: *origin_id,
            run_id: run_id.as_deref().map(Cow::Borrowed),
            awaited: *awaited,
        })?;
        Ok(Encoded {
            id: id.to_string(),
            ulid: *id,
            flow: flow.clone(),
            due: not_before.filter(|&t| t > now),
            deliveries: *deliveries,
            enqueued_at: *enqueued_at,
            body,
            item: Default::default(),
        })
    }

    /// `all`, keeping each item to hand on as it is.
    pub(super) fn owning(items: Vec<WorkItem>) -> Result<Vec<Encoded>, QueueError> {
        let now = now_ms();
        items
            .into_iter()
            .map(|i| {
                let e = Encoded::new(&i, now)?;
                e.item.set(Some(i));
                Ok(e)
            })
            .collect()
    }

    pub(super) fn all(items: &[WorkItem]) -> Result<Vec<Encoded>, QueueError> {
        let now = now_ms();
        items.iter().map(|i| Encoded::new(i, now)).collect()
    }
}

/// A claimed row as the writer hands it out: decoded into a [`Claimed`] by the claimer.
pub(super) struct Taken {
    pub(super) seq: i64,
    pub(super) lease: u64,
    pub(super) deliveries: u32,
    pub(super) stepped: bool,
    pub(super) body: String,
    pub(super) id: String,
    pub(super) flow: String,
    pub(super) enqueued_at: i64,
    /// The item as its caller journaled it, when the writer had it (`body` is then empty).
    pub(super) item: Option<WorkItem>,
}
