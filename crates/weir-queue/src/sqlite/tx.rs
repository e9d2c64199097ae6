//! The writer's operations: plain functions over a connection inside its transaction.

use rusqlite::{params, OptionalExtension, Row};
use ulid::Ulid;

use super::kept::*;
use super::rows::*;
use super::schema::*;
use super::stmt::*;
use crate::{
    now_ms, Committed, End, ItemState, ItemView, QueueError, StateKey, Versioned, WaveEffects,
    WorkItem,
};

/// Finished items kept for `get` (the operator's "what became of my event").
pub(super) const FINISHED_KEPT: i64 = 10_000;
/// Idempotency keys are remembered this long.
pub(super) const IDEMPOTENCY_KEPT_MS: i64 = 24 * 3600 * 1000;
/// Jobs in one transaction at most: bounds the latency of the first member.
pub(super) const MAX_BATCH: usize = 1024;
/// Batches between two prunes of old idempotency keys.
pub(super) const PRUNE_EVERY: u64 = 512;
/// Finished items past `FINISHED_KEPT` are deleted in the transactions that finish more,
/// at most this many at a time (never one long delete that stalls every caller behind it).
/// Each trim rewrites the pages at the old end of the table and of its indexes, whatever
/// it deletes, so fewer, larger trims write less; much larger ones lengthen the p99 of the
/// transactions they land in.
pub(super) const TRIM_CHUNK: i64 = 256;

/// Delete the finished row `seq` (one the writer keeps in `Finished`).
pub(super) const DELETE_FINISHED_SQL: &str = "DELETE FROM items WHERE seq = ?1 AND st = 'finished'";

/// Delete the oldest finished items past the newest `FINISHED_KEPT`, inside the writer's
/// transaction: the items a batch finishes are matched by about as many deletes in the same
/// batch, in chunks, so the cost is spread evenly instead of one long delete now and then.
pub(super) fn trim_finished(c: &Db<'_>, w: &mut Writer) -> Result<(), QueueError> {
    let mut del = c.cached(DELETE_FINISHED_SQL)?;
    // At most two chunks a batch: a backlog (a file opened with many more) goes down
    // over the next batches.
    for _ in 0..2 {
        if w.finished.len() <= FINISHED_KEPT {
            break;
        }
        w.recent.forget();
        for _ in 0..TRIM_CHUNK {
            let Some((_, seq)) = w.finished.rows.pop_front() else {
                break;
            };
            del.execute([seq])?;
        }
    }
    Ok(())
}

/// Drop idempotency keys past their day.
pub(super) fn prune(conn: &Db<'_>) -> Result<(), rusqlite::Error> {
    conn.execute(
        "DELETE FROM idempotency WHERE at < ?1",
        [now_ms() - IDEMPOTENCY_KEPT_MS],
    )?;
    Ok(())
}

pub(super) fn insert(c: &Db<'_>, w: &mut Writer, row: &Encoded) -> Result<(), QueueError> {
    insert_all(c, w, std::slice::from_ref(row))
}

/// Journal `rows` with prepared statements taken from the writer's kept ones once per batch,
/// not per row.
///
/// A row ready now, with nothing else ready and a claimer waiting with room, is journaled
/// already claimed for it: one write of the row, not an insert, then a read and a rewrite
/// of the whole row by `claim_ready`. It is what that claim would have taken, in the same
/// order: nothing else was ready, the oldest claimer with room gets it, and once one row
/// has gone to the ready order the rest follow it there.
pub(super) fn insert_all(c: &Db<'_>, w: &mut Writer, rows: &[Encoded]) -> Result<(), QueueError> {
    let mut ins = c.cached(
        "INSERT INTO items (seq, id, flow, st, ord, due, deliveries, enqueued_at, body)
         VALUES (?9, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    let mut ins_claimed = None;
    for row in rows {
        // An id seen before is the same item added again (a retried add): keep the first.
        let Some(seq) = new_row(c, &mut w.recent, row)? else {
            continue;
        };
        let (st, ord) = match row.due {
            Some(t) => {
                w.next_due = Some(w.next_due.map_or(t, |d| d.min(t)));
                ("delayed", None)
            }
            None => {
                w.ord += 1;
                if w.ready == 0 {
                    if let Some(x) = w
                        .waiters
                        .iter()
                        .position(|x| x.has_room() && x.takes(&row.flow))
                    {
                        let ins = match &mut ins_claimed {
                            Some(s) => s,
                            None => ins_claimed.insert(c.cached(INSERT_CLAIMED_SQL)?),
                        };
                        insert_claimed(ins, seq, w, x, row)?;
                        continue;
                    }
                }
                ("waiting", Some(w.ord))
            }
        };
        ins.execute(params![
            row.id,
            row.flow,
            st,
            ord,
            row.due,
            row.deliveries,
            row.enqueued_at,
            row.body,
            seq
        ])?;
        w.recent.wrote(seq, row.ulid);
        if st == "waiting" {
            w.ready += 1;
            w.woke = true;
        }
    }
    Ok(())
}

/// The row a new item takes (`rows_of` its id): the one after the largest of its id's
/// millisecond. `None` when the id was journaled before (an add retried after its answer
/// was lost): the first is kept.
pub(super) fn new_row(
    c: &Db<'_>,
    recent: &mut Recent,
    row: &Encoded,
) -> Result<Option<i64>, QueueError> {
    let (lo, hi) = rows_of(row.ulid);
    if recent.lo != Some(lo) {
        recent.read(c, lo, hi)?;
    }
    if recent.ids.contains(&row.ulid) {
        return Ok(None);
    }
    match recent.last {
        None => Ok(Some(lo)),
        Some(l) if l < hi => Ok(Some(l + 1)),
        _ => Err(QueueError::Unavailable(format!(
            "more than 2^{ROW_BITS} items with ids of one millisecond"
        ))),
    }
}

/// The condition that finds the item with an id among its millisecond's rows, with
/// `by_id`'s parameters.
macro_rules! by_id_sql {
    () => {
        "seq BETWEEN ?1 AND ?2 AND id = ?3"
    };
}

/// The parameters of `BY_ID` for `id`.
pub(super) fn by_id(id: Ulid) -> (i64, i64, String) {
    let (lo, hi) = rows_of(id);
    (lo, hi, id.to_string())
}

/// The row of the item `id`, if it is journaled.
pub(super) fn row_of(c: &Db<'_>, id: Ulid) -> Result<Option<i64>, rusqlite::Error> {
    c.cached(concat!("SELECT seq FROM items WHERE ", by_id_sql!()))?
        .query_row(by_id(id), |r| r.get(0))
        .optional()
}

/// A new row already in flight (`insert_claimed`).
pub(super) const INSERT_CLAIMED_SQL: &str = "INSERT INTO items
        (seq, id, flow, st, ord, deliveries, enqueued_at, body, lease, consumer, since)
    VALUES (?10, ?1, ?2, 'in_flight', ?3, ?4, ?5, ?6, ?7, ?8, ?9)";

/// Journal `row` in flight at `seq` (with `ins`, `INSERT_CLAIMED_SQL`), claimed for the
/// waiting claimer `w.waiters[x]`.
pub(super) fn insert_claimed(
    ins: &mut rusqlite::Statement<'_>,
    seq: i64,
    w: &mut Writer,
    x: usize,
    row: &Encoded,
) -> Result<(), QueueError> {
    let lease = w.lease + 1;
    let deliveries = row.deliveries + 1;
    write_in_flight(
        ins,
        seq,
        (&mut w.flying, &mut w.recent),
        row,
        w.ord,
        lease,
        &w.waiters[x].consumer,
    )?;
    w.lease = lease;
    w.woke = true;
    let item = row.item.take();
    w.waiters[x].taken.push(Taken {
        seq,
        lease,
        deliveries,
        stepped: false,
        body: match item {
            Some(_) => String::new(),
            None => row.body.clone(),
        },
        id: row.id.clone(),
        flow: row.flow.clone(),
        enqueued_at: row.enqueued_at,
        item,
    });
    Ok(())
}

/// Journal `x.row` in flight for `x.consumer` when nothing else is ready, so it passes
/// nothing in the ready order; otherwise journal it ready, as `add` does.
pub(super) fn add_claimed(c: &Db<'_>, w: &mut Writer, x: &AddClaimed) -> AddClaimedAnswer {
    if w.ready >= x.max_ready {
        return Err(QueueError::Full(w.ready.max(0) as usize));
    }
    let row = &x.row;
    if w.ready != 0 || row.due.is_some() {
        insert_all(c, w, std::slice::from_ref(row))?;
        return Ok(None);
    }
    let Some(seq) = new_row(c, &mut w.recent, row)? else {
        // The same id journaled before (a retried add): that copy goes its own way.
        return Ok(None);
    };
    w.ord += 1;
    let lease = w.lease + 1;
    let mut ins = c.cached(INSERT_CLAIMED_SQL)?;
    let to = (&mut w.flying, &mut w.recent);
    write_in_flight(&mut ins, seq, to, row, w.ord, lease, &x.consumer)?;
    w.lease = lease;
    Ok(Some((seq, lease)))
}

/// Write `row` in flight at `seq` for `consumer` under `lease`, its delivery counted, with
/// `ins` (`INSERT_CLAIMED_SQL`), and count it in `flying` and `recent`.
pub(super) fn write_in_flight(
    ins: &mut rusqlite::Statement<'_>,
    seq: i64,
    (flying, recent): (&mut InFlight, &mut Recent),
    row: &Encoded,
    ord: i64,
    lease: u64,
    consumer: &str,
) -> Result<(), QueueError> {
    let since = now_ms();
    ins.execute(params![
        row.id,
        row.flow,
        ord,
        row.deliveries + 1,
        row.enqueued_at,
        row.body,
        lease as i64,
        consumer,
        since,
        seq
    ])?;
    recent.wrote(seq, row.ulid);
    flying.claimed(seq, since, row.enqueued_at);
    Ok(())
}

pub(super) fn insert_dead(
    c: &Db<'_>,
    w: &mut Writer,
    row: &Encoded,
    reason: &str,
    now: i64,
) -> Result<(), QueueError> {
    let Some(seq) = new_row(c, &mut w.recent, row)? else {
        return Ok(());
    };
    c.cached(
        "INSERT INTO items (seq, id, flow, st, deliveries, reason, at, enqueued_at, body)
         VALUES (?8, ?1, ?2, 'dead', ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        row.id,
        row.flow,
        row.deliveries,
        reason,
        now,
        row.enqueued_at,
        row.body,
        seq
    ])?;
    w.recent.wrote(seq, row.ulid);
    Ok(())
}

/// An item row (selected with `ITEM_COLS`) as the operator sees it.
pub(super) fn view(r: &Row<'_>) -> rusqlite::Result<Result<ItemView, QueueError>> {
    let body: String = r.get(0)?;
    let deliveries: u32 = r.get(1)?;
    let due: Option<i64> = r.get(2)?;
    let st: String = r.get(3)?;
    let consumer: Option<String> = r.get(4)?;
    let since: Option<i64> = r.get(5)?;
    let reason: Option<String> = r.get(6)?;
    let at: Option<i64> = r.get(7)?;
    let id: String = r.get(8)?;
    let flow: String = r.get(9)?;
    let enqueued_at: i64 = r.get(10)?;
    let cols = RowCols {
        id: &id,
        flow: flow.clone(),
        deliveries,
        enqueued_at,
        due,
    };
    // A body that cannot be decoded is still shown (it is a dead letter by now).
    let decoded = decode(&body, cols).or_else(|_| {
        Ulid::from_string(&id)
            .map(|id| WorkItem::undecodable(id, &flow, &body))
            .map_err(|e| QueueError::Corrupt(e.to_string()))
    });
    Ok(decoded.and_then(|item| {
        let state = match st.as_str() {
            "waiting" => ItemState::Waiting,
            "in_flight" => ItemState::InFlight {
                consumer: consumer.unwrap_or_default(),
                since: since.unwrap_or(0),
            },
            "delayed" => ItemState::Delayed {
                due: due.unwrap_or(0),
            },
            "parked" => ItemState::Parked,
            "dead" => ItemState::Dead {
                reason: reason.unwrap_or_default(),
                at: at.unwrap_or(0),
            },
            "finished" => ItemState::Finished {
                outcome: reason.unwrap_or_default(),
                at: at.unwrap_or(0),
            },
            other => return Err(QueueError::Corrupt(format!("unknown item state `{other}`"))),
        };
        Ok(ItemView { item, state })
    }))
}

pub(super) fn get_view(c: &Db<'_>, id: Ulid) -> Result<Option<ItemView>, QueueError> {
    c.cached(concat!(
        "SELECT ",
        item_cols!(),
        " FROM items WHERE ",
        by_id_sql!()
    ))?
    .query_row(by_id(id), view)
    .optional()?
    .transpose()
}

pub(super) fn read_state(c: &Db<'_>, key: &StateKey) -> Result<Versioned, QueueError> {
    let row: Option<(Option<String>, i64)> = c
        .cached("SELECT value, version FROM state WHERE flow = ?1 AND node = ?2 AND key = ?3")?
        .query_row(params![key.flow, key.node, key.key], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    Ok(match row {
        None => Versioned::default(),
        Some((value, version)) => Versioned {
            value: value.as_deref().map(unjson).transpose()?,
            version: version as u64,
        },
    })
}

pub(super) fn write_state(
    c: &Db<'_>,
    key: &StateKey,
    value: Option<&serde_json::Value>,
) -> Result<(), QueueError> {
    let value = value.map(json).transpose()?;
    c.cached(
        "INSERT INTO state (flow, node, key, value, version) VALUES (?1, ?2, ?3, ?4, 1)
         ON CONFLICT (flow, node, key) DO UPDATE SET value = excluded.value, version = version + 1",
    )?
    .execute(params![key.flow, key.node, key.key, value])?;
    Ok(())
}

pub(super) fn item_state(c: &Db<'_>, id: Ulid) -> Result<Option<String>, QueueError> {
    Ok(
        c.cached(concat!("SELECT st FROM items WHERE ", by_id_sql!()))?
            .query_row(by_id(id), |r| r.get(0))
            .optional()?,
    )
}

/// End `id` as finished with `outcome`, and count it among the finished items kept.
pub(super) fn finish(
    c: &Db<'_>,
    w: &mut Writer,
    id: Ulid,
    outcome: &str,
    now: i64,
) -> Result<(), QueueError> {
    match row_of(c, id)? {
        Some(seq) => finish_row(c, w, seq, outcome, now),
        None => Ok(()),
    }
}

/// End the row `seq` as finished with `outcome`, and count it among the finished items kept.
pub(super) fn finish_row(
    c: &Db<'_>,
    w: &mut Writer,
    seq: i64,
    outcome: &str,
    now: i64,
) -> Result<(), QueueError> {
    c.cached(
        "UPDATE items SET st = 'finished', reason = ?2, at = ?3, due = NULL, consumer = NULL,
                          stepped = 0
         WHERE seq = ?1",
    )?
    .execute(params![seq, outcome, now])?;
    w.finished.push(now, seq);
    Ok(())
}

/// A wave's new items, encoded by the committer: its follow-ups and delayed items, and its
/// dead children with their reasons.
pub(super) struct NewRows {
    pub(super) items: Vec<Encoded>,
    pub(super) dead: Vec<(Encoded, String)>,
}

impl NewRows {
    /// Takes the wave's items out of `fx`.
    pub(super) fn take(fx: &mut WaveEffects) -> Result<NewRows, QueueError> {
        let mut items = Encoded::owning(std::mem::take(&mut fx.follow_ups))?;
        items.extend(Encoded::all(&std::mem::take(&mut fx.delayed))?);
        let now = now_ms();
        let dead = std::mem::take(&mut fx.dead)
            .into_iter()
            .map(|(item, why)| Ok((Encoded::new(&item, now)?, why)))
            .collect::<Result<_, QueueError>>()?;
        Ok(NewRows { items, dead })
    }
}

/// The commit of a wave that writes nothing but its end: ?1 the row, ?2 the lease, ?3 the
/// outcome, ?4 now.
pub(super) const COMMIT_PLAIN_SQL: &str = "UPDATE items SET st = 'finished', reason = ?3, at = ?4,
        due = NULL, consumer = NULL, stepped = 0
    WHERE seq = ?1 AND st = 'in_flight' AND lease = ?2";

/// `at` is the item's id and, when the claim gave it, its row.
pub(super) fn commit_wave(
    c: &Db<'_>,
    w: &mut Writer,
    at: (Ulid, Option<i64>),
    lease: u64,
    flow: &str,
    fx: WaveEffects,
    new: NewRows,
) -> Result<Committed, QueueError> {
    let (id, seq) = at;
    let plain = new.items.is_empty()
        && new.dead.is_empty()
        && fx.state.is_empty()
        && fx.guards.is_empty()
        && !w.marked.contains(&id);
    if plain {
        // The common wave (nothing written but its end): the ownership check is the
        // update's own condition, one statement.
        let outcome = match &fx.end {
            None | Some(End::Ack) => Some(fx.outcome.as_deref().unwrap_or("done")),
            Some(End::Superseded) => Some("superseded by a newer timer"),
            _ => None,
        };
        if let Some(outcome) = outcome {
            if w.failpoints.hit("commit") {
                return Err(QueueError::Unavailable("failpoint `commit` fired".into()));
            }
            // By row when the claim gave it: a look-up among its millisecond's rows fewer
            // (the row of an id never changes while it is in flight).
            let seq = match seq {
                Some(s) => s,
                None => match row_of(c, id)? {
                    Some(s) => s,
                    None => return Ok(Committed::Conflict),
                },
            };
            let now = now_ms();
            let n =
                c.cached(COMMIT_PLAIN_SQL)?
                    .execute(params![seq, lease as i64, outcome, now])?;
            if n != 1 {
                return Ok(Committed::Conflict);
            }
            w.flying.ended(seq);
            w.finished.push(now, seq);
            return Ok(Committed::Done);
        }
    }
    let owner: Option<(String, i64, i64)> = c
        .cached(concat!(
            "SELECT st, lease, seq FROM items WHERE ",
            by_id_sql!()
        ))?
        .query_row(by_id(id), |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()?;
    let row = match owner {
        Some((st, l, row)) if st == "in_flight" && l == lease as i64 => row,
        _ => return Ok(Committed::Conflict),
    };
    for s in &fx.state {
        if read_state(c, &s.key)?.version != s.read_version {
            return Ok(Committed::Conflict);
        }
    }
    for (key, want) in &fx.guards {
        if read_state(c, key)?.value.as_ref() != Some(want) {
            return Ok(Committed::Conflict);
        }
    }
    if fx.end == Some(End::Park) && !is_paused(c, flow)? {
        return Ok(Committed::Conflict);
    }
    let now = now_ms();
    insert_all(c, w, &new.items)?;
    for s in &fx.state {
        write_state(c, &s.key, s.value.as_ref())?;
    }
    if w.failpoints.hit("commit") {
        // Halfway: follow-ups and state are written; the batch is rolled back.
        return Err(QueueError::Unavailable("failpoint `commit` fired".into()));
    }
    for (row, reason) in &new.dead {
        insert_dead(c, w, row, reason, now)?;
    }
    // Done markers live until the item ends; one delivered again keeps them.
    let later = matches!(fx.end, Some(End::Later(_)));
    if !later && w.marked.remove(&id) {
        c.cached("DELETE FROM done WHERE item = ?1")?
            .execute([id.to_string()])?;
    }
    match fx.end.unwrap_or(End::Ack) {
        End::Ack => finish_row(c, w, row, fx.outcome.as_deref().unwrap_or("done"), now)?,
        End::Superseded => finish_row(c, w, row, "superseded by a newer timer", now)?,
        End::DeadLetter(reason) => {
            c.cached(
                "UPDATE items SET st = 'dead', reason = ?2, at = ?3, consumer = NULL, stepped = 0
                 WHERE seq = ?1",
            )?
            .execute(params![row, reason, now])?;
        }
        End::Park => {
            c.cached(
                "UPDATE items SET st = 'parked', consumer = NULL, stepped = 0 WHERE seq = ?1",
            )?
            .execute([row])?;
        }
        End::Later(due) => {
            c.cached(
                "UPDATE items SET st = 'delayed', due = ?2, consumer = NULL, stepped = 0
                 WHERE seq = ?1",
            )?
            .execute(params![row, due])?;
            w.next_due = Some(w.next_due.map_or(due, |d| d.min(due)));
        }
    }
    w.flying.ended(row);
    Ok(Committed::Done)
}

pub(super) fn is_paused(c: &Db<'_>, flow: &str) -> Result<bool, QueueError> {
    Ok(c.cached("SELECT 1 FROM paused WHERE flow = ?1")?
        .query_row([flow], |_| Ok(()))
        .optional()?
        .is_some())
}

/// The ready items, oldest first. No `LIMIT ?`: the bundled SQLite is built with STAT4, so
/// it reads a bound LIMIT while planning, and every claim asking for a different number made
/// it prepare the statement again. The rows
/// come in index order and the caller stops stepping at its `max`.
pub(super) const CLAIM_SQL: &str = "SELECT seq, body, deliveries, stepped, id, flow, enqueued_at
    FROM items WHERE st = 'waiting' ORDER BY ord";

/// As [`CLAIM_SQL`], passing over the ready items of the flows in `?1` (a JSON array).
pub(super) const CLAIM_PASSING_SQL: &str =
    "SELECT seq, body, deliveries, stepped, id, flow, enqueued_at
    FROM items WHERE st = 'waiting' AND flow NOT IN (SELECT value FROM json_each(?1))
    ORDER BY ord";

pub(super) fn claim_ready(
    c: &Db<'_>,
    w: &mut Writer,
    consumer: &str,
    max: usize,
    skip: Option<&[String]>,
) -> Result<Vec<Taken>, QueueError> {
    let skipped = match skip {
        Some(s) => serde_json::to_string(s).map_err(|e| QueueError::Corrupt(e.to_string()))?,
        None => String::new(),
    };
    let mut q = match skip {
        Some(_) => c.cached(CLAIM_PASSING_SQL)?,
        None => c.cached(CLAIM_SQL)?,
    };
    let args: &[&dyn rusqlite::ToSql] = match skip {
        Some(_) => &[&skipped],
        None => &[],
    };
    let mut rows: Vec<Taken> = q
        .query_map(args, |r| {
            Ok(Taken {
                seq: r.get(0)?,
                lease: 0,
                body: r.get(1)?,
                deliveries: r.get::<_, u32>(2)? + 1,
                stepped: r.get(3)?,
                id: r.get(4)?,
                flow: r.get(5)?,
                enqueued_at: r.get(6)?,
                item: None,
            })
        })?
        .take(max)
        .collect::<Result<_, _>>()?;
    drop(q);
    let now = now_ms();
    let mut take = c.cached(
        "UPDATE items SET st = 'in_flight', deliveries = ?2, lease = ?3, consumer = ?4, since = ?5
         WHERE seq = ?1",
    )?;
    for t in &mut rows {
        w.lease += 1;
        t.lease = w.lease;
        take.execute(params![t.seq, t.deliveries, w.lease as i64, consumer, now])?;
        w.ready -= 1;
        w.flying.claimed(t.seq, now, t.enqueued_at);
    }
    Ok(rows)
}

/// Make the items matched by `sql` (which selects `seq`, in the order wanted) ready, each
/// at the back of the ready order.
pub(super) fn make_ready(
    c: &Db<'_>,
    w: &mut Writer,
    sql: &'static str,
    args: impl rusqlite::Params,
) -> Result<usize, QueueError> {
    let seqs: Vec<i64> = c
        .cached(sql)?
        .query_map(args, |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let mut up = c.cached(
        "UPDATE items SET st = 'waiting', due = NULL, consumer = NULL, ord = ?2 WHERE seq = ?1",
    )?;
    for seq in &seqs {
        w.ord += 1;
        up.execute(params![seq, w.ord])?;
    }
    if !seqs.is_empty() {
        w.ready += seqs.len() as i64;
        w.woke = true;
    }
    Ok(seqs.len())
}
