use std::time::Duration;

use rusqlite::{params, Connection};
use ulid::Ulid;

use super::{rows::*, schema::*, tx::*, *};
use crate::{
    now_ms, Claimed, Committed, End, Failpoints, ItemKind, ItemState, QueueError, WaveEffects,
    WorkItem, WorkQueue,
};
use crate::{Admin, ClaimOnAdd, Pausing};

fn item(n: i64) -> WorkItem {
    WorkItem::cascade("f", "in", "t", vec![serde_json::json!({ "payload": n })])
}

/// The row's body is the file's format: the same bytes whoever writes it, and every
/// field an item can carry reads back as it was.
#[test]
fn a_body_is_written_in_the_journal_format_and_reads_back_whole() {
    let plain = item(1);
    let e = Encoded::new(&plain, plain.enqueued_at).unwrap();
    assert_eq!(e.body, r#"{"n":"in","o":[[{"payload":1}]],"c":"t"}"#);
    assert_eq!((e.flow.as_str(), e.due), ("f", None));
    let mut full = item(2);
    full.kind = ItemKind::Flush;
    full.attempt = 3;
    full.first_enqueued_at = full.enqueued_at - 5;
    full.guard_key = Some("g".into());
    full.guard_value = Some(serde_json::json!({ "v": 1 }));
    full.origin_id = Some(Ulid::new());
    full.run_id = Some("run-1".into());
    full.not_before = Some(full.enqueued_at + 60_000);
    full.deliveries = 2;
    let e = Encoded::new(&full, full.enqueued_at).unwrap();
    let cols = RowCols {
        id: &e.id,
        flow: e.flow.clone(),
        deliveries: e.deliveries,
        enqueued_at: e.enqueued_at,
        due: e.due,
    };
    assert_eq!(decode(&e.body, cols).unwrap(), full);
}

/// An `add_claimed` whose caller goes away (a webhook's client hung up) leaves no item
/// stranded in flight until the reclaim delay: whether its answer was never sent (the
/// caller gone before the commit) or sent and never read (gone after it), the item is
/// made ready again and the executor's claim gets it, its first delivery counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_added_claimed_for_a_caller_gone_is_ready_again() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    // Gone before the answer: the writer is busy with another job while the caller
    // gives up, so the answer finds nobody.
    let busy = tokio::spawn({
        let q = q.clone();
        async move {
            q.write(|_, _| {
                std::thread::sleep(Duration::from_millis(200));
                Ok(())
            })
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let early = item(1);
    let gone = tokio::time::timeout(
        Duration::from_millis(20),
        q.add_claimed("web", early.clone()),
    )
    .await;
    assert!(
        gone.is_err(),
        "answered while the writer was busy: {gone:?}"
    );
    busy.await.unwrap().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let again = claim_until(&q, deadline).await;
    assert_eq!((again.item.id, again.item.deliveries), (early.id, 2));
    // Gone after it: the answer waits unread in its channel when the caller drops it.
    let late = item(2);
    let before = q.batches();
    let mut call = Box::pin(q.add_claimed("web", late.clone()));
    assert!(poll_once(&mut call).await.is_none());
    while q.batches() == before {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never committed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The count moves just before the answers go out: give them a moment, so that it
    // is the unread answer, not an unsendable one, that this half drops.
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(call);
    let again = claim_until(&q, deadline).await;
    assert_eq!((again.item.id, again.item.deliveries), (late.id, 2));
}

/// The next item the executor's claim gets, waiting for it until `deadline`.
async fn claim_until(q: &SqliteQueue, deadline: std::time::Instant) -> Claimed {
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing came back to claim"
        );
        if let Some(c) = q
            .claim("exec", 1, Duration::from_millis(200))
            .await
            .unwrap()
            .pop()
        {
            return c;
        }
    }
}

/// Poll `f` once: its answer if it had one.
async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
    let polled =
        std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx)));
    match polled.await {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

/// Claims asking for different numbers of items reuse one prepared statement.
#[tokio::test]
async fn claims_of_any_size_do_not_prepare_the_claim_again() {
    let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
    q.add((0..20).map(item).collect()).await.unwrap();
    let mut got = 0;
    for max in [1, 2, 3, 5, 7, 2] {
        got += q.claim("a", max, Duration::ZERO).await.unwrap().len();
    }
    assert_eq!(got, 20, "1 + 2 + 3 + 5 + 7 + the last 2");
    let reprepared = q
        .write(|c, _| {
            Ok(c.cached(CLAIM_SQL)?
                .get_status(rusqlite::StatementStatus::RePrepare))
        })
        .await
        .unwrap();
    assert_eq!(reprepared, 0);
}

/// A job sent while the writer runs a batch's SQL joins that batch, so it waits for one
/// COMMIT, not for that one and then its own.
#[tokio::test]
async fn a_job_sent_while_a_batch_runs_joins_it() {
    let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
    let (started, running) = oneshot::channel();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let before = q.batches();
    let mut slow = std::pin::pin!(q.write(move |_, _| {
        let _ = started.send(());
        let _ = wait.recv_timeout(Duration::from_secs(10));
        Ok(())
    }));
    // Polled once: sent, and now the writer runs it.
    tokio::select! { biased; _ = &mut slow => panic!("answered before it ran"), _ = async {} => {} }
    running.await.unwrap();
    let one = item(1);
    let id = one.id;
    let mut add = std::pin::pin!(q.add(vec![one]));
    tokio::select! { biased; _ = &mut add => panic!("answered while the batch runs"), _ = async {} => {} }
    go.send(()).unwrap();
    slow.await.unwrap();
    add.await.unwrap();
    assert!(q.get(id).await.unwrap().is_some());
    assert_eq!(q.batches() - before, 1, "one transaction for both");
}

/// A claim gives each item its row, and the commit finds the item by it; a claim without
/// one (slot 0) is still committed, by id; and the row does not stand in for the lease:
/// a row whose lease has moved on refuses the commit.
#[tokio::test]
async fn commits_find_the_item_by_the_row_its_claim_gave() {
    let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
    q.add((0..3).map(item).collect()).await.unwrap();
    let c = q.claim("a", 3, Duration::ZERO).await.unwrap();
    assert!(
        c.iter().all(|c| c.receipt.slot > 0),
        "each claim gives the row"
    );
    // The commit's update goes straight to the row, never a scan.
    let plan = q
        .write(|c, _| {
            let mut p = c.prepare(&format!("EXPLAIN QUERY PLAN {COMMIT_PLAIN_SQL}"))?;
            let args = params![1, 1, "done", 0];
            let rows = p.query_map(args, |r| r.get::<_, String>(3))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?.join("; "))
        })
        .await
        .unwrap();
    assert!(!plan.contains("SCAN"), "{plan}");
    assert!(plan.contains("INTEGER PRIMARY KEY"), "{plan}");
    let mut by_id = c[1].clone();
    by_id.receipt.slot = 0;
    for (claimed, how) in [(&c[0], "by row"), (&by_id, "by id")] {
        let r = q
            .commit(claimed, WaveEffects::ending(End::Ack))
            .await
            .unwrap();
        assert_eq!(r, Committed::Done, "{how}");
        let v = q.get(claimed.item.id).await.unwrap().unwrap();
        assert!(
            matches!(v.state, ItemState::Finished { .. }),
            "{how}: {:?}",
            v.state
        );
    }
    // The third item is reclaimed and claimed again: the old claim's row is right, its
    // lease is not.
    assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 1);
    let again = q.claim("b", 1, Duration::ZERO).await.unwrap();
    assert_eq!(again[0].receipt.slot, c[2].receipt.slot);
    let stale = q
        .commit(&c[2], WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    assert_eq!(stale, Committed::Conflict);
    let r = q
        .commit(&again[0], WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    assert_eq!(r, Committed::Done);
}

/// Past `FINISHED_KEPT`, the oldest finished items go, a few in each batch that finishes
/// more; the newest stay for `get`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_items_past_the_bound_are_deleted_oldest_first() {
    let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
    let total = FINISHED_KEPT + 300;
    let mut first = None;
    let mut last = None;
    let mut done = 0;
    while done < total {
        let batch: Vec<WorkItem> = (0..500.min(total - done)).map(item).collect();
        first.get_or_insert(batch[0].id);
        last = Some(batch[batch.len() - 1].id);
        q.add(batch).await.unwrap();
        let claimed = q.claim("a", 500, Duration::ZERO).await.unwrap();
        let commits = claimed
            .iter()
            .map(|c| q.commit(c, WaveEffects::ending(End::Ack)));
        for r in futures::future::join_all(commits).await {
            assert_eq!(r.unwrap(), Committed::Done);
        }
        done += claimed.len() as i64;
    }
    // One more batch lets the last trim run.
    q.add(vec![item(0)]).await.unwrap();
    let kept: i64 = q
        .read_with(|c| {
            Ok(c.query_row(
                "SELECT count(*) FROM items WHERE st = 'finished'",
                [],
                |r| r.get(0),
            )?)
        })
        .await
        .unwrap();
    let held = q.write(|_, w| Ok(w.finished.len())).await.unwrap();
    assert_eq!(held, kept, "the writer holds what the file does");
    assert!(
        (FINISHED_KEPT - TRIM_CHUNK..=FINISHED_KEPT).contains(&kept),
        "{kept} finished items kept"
    );
    assert!(
        q.get(first.unwrap()).await.unwrap().is_none(),
        "the oldest went"
    );
    let newest = q
        .get(last.unwrap())
        .await
        .unwrap()
        .expect("the newest stays");
    assert!(matches!(newest.state, ItemState::Finished { .. }));
}

/// Until `probe` holds, for 10 s at most.
async fn until<F: std::future::Future<Output = bool>>(what: &str, probe: impl Fn() -> F) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !probe().await {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A claim by `consumer` for at most `max` items, once it waits in the writer.
async fn waiting_claim(
    q: &Arc<SqliteQueue>,
    consumer: &'static str,
    max: usize,
) -> tokio::task::JoinHandle<Result<Vec<Claimed>, QueueError>> {
    let before = q.write(|_, w| Ok(w.waiters.len())).await.unwrap();
    let claim = {
        let q = q.clone();
        tokio::spawn(async move { q.claim(consumer, max, Duration::from_secs(5)).await })
    };
    until("the claim waits in the writer", || async {
        q.write(|_, w| Ok(w.waiters.len())).await.unwrap() > before
    })
    .await;
    claim
}

/// The items in flight are the writer's to count (schema 5 has no index of them): every
/// way into flight and out of it moves what `stats` shows, and it is what the file
/// holds, after a rolled-back batch too; a reclaim finds every one.
#[tokio::test]
async fn the_items_in_flight_are_counted_as_the_file_holds_them() {
    let fp = Failpoints::new();
    let q = Arc::new(SqliteQueue::temporary(fp.clone()).unwrap());
    let counted = |q: Arc<SqliteQueue>| async move {
        let shown = q.stats().await.unwrap().in_flight;
        let held: i64 = q
            .read_with(|c| {
                Ok(c.query_row(
                    "SELECT count(*) FROM items WHERE st = 'in_flight'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .await
            .unwrap();
        assert_eq!(shown as i64, held, "shown against the file");
        shown
    };
    // Into flight: by a claim, journaled claimed, handed to a claim waiting.
    q.add((0..4).map(item).collect()).await.unwrap();
    let c = q.claim("a", 4, Duration::ZERO).await.unwrap();
    assert_eq!(counted(q.clone()).await, 4);
    let direct = q.add_claimed("a", item(10)).await.unwrap().unwrap();
    assert_eq!(counted(q.clone()).await, 5);
    let waiting = waiting_claim(&q, "a", 1).await;
    q.add(vec![item(11)]).await.unwrap();
    let handed = waiting.await.unwrap().unwrap();
    assert_eq!(handed.len(), 1);
    assert_eq!(counted(q.clone()).await, 6);
    assert!(q.stats().await.unwrap().oldest_pending_age_ms.is_some());
    // Out of flight: finished by row and by id, dead-lettered, parked.
    let ack = |c: &Claimed| {
        let (q, c) = (q.clone(), c.clone());
        async move { q.commit(&c, WaveEffects::ending(End::Ack)).await.unwrap() }
    };
    assert_eq!(ack(&c[0]).await, Committed::Done);
    let mut by_id = c[1].clone();
    by_id.receipt.slot = 0;
    assert_eq!(ack(&by_id).await, Committed::Done);
    assert_eq!(counted(q.clone()).await, 4);
    let dead = WaveEffects::ending(End::DeadLetter("no".into()));
    assert_eq!(q.commit(&c[2], dead).await.unwrap(), Committed::Done);
    q.set_paused("f", true).await.unwrap();
    let park = WaveEffects::ending(End::Park);
    assert_eq!(q.commit(&direct, park).await.unwrap(), Committed::Done);
    assert_eq!(counted(q.clone()).await, 2);
    // A commit in a batch rolled back ended nothing.
    fp.arm("sqlite-batch", 1);
    assert!(q
        .commit(&c[3], WaveEffects::ending(End::Ack))
        .await
        .is_err());
    assert_eq!(counted(q.clone()).await, 2);
    // A claim taken back by a reclaim, and the rest by the reclaim of all.
    assert_eq!(q.reclaim_stale(Duration::from_secs(3600)).await.unwrap(), 0);
    assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 2);
    assert_eq!(counted(q.clone()).await, 0);
    assert_eq!(q.stats().await.unwrap().ready, 2);
}

/// An id is journaled once (schema 7 has no index of ids: the writer keeps the ids of
/// the millisecond it last wrote into): an add retried after its batch was rolled back is
/// journaled, one retried after it was journaled is not, whether the first is in the
/// same batch, the millisecond last written or an earlier one.
#[tokio::test]
async fn an_id_is_journaled_once_whatever_the_writer_remembers() {
    let fp = Failpoints::new();
    let q = SqliteQueue::temporary(fp.clone()).unwrap();
    async fn rows(q: &SqliteQueue) -> Result<i64, QueueError> {
        q.read_with(|c| Ok(c.query_row("SELECT count(*) FROM items", [], |r| r.get(0))?))
            .await
    }
    let (a, b) = (item(1), item(2));
    fp.arm("sqlite-batch", 1);
    assert!(q.add(vec![a.clone()]).await.is_err());
    assert_eq!(rows(&q).await.unwrap(), 0, "rolled back");
    q.add(vec![a.clone(), b.clone(), a.clone()]).await.unwrap();
    assert_eq!(rows(&q).await.unwrap(), 2, "the retry journaled, once");
    q.add(vec![b.clone()]).await.unwrap();
    // Another millisecond written in between: the first is read from the file again.
    tokio::time::sleep(Duration::from_millis(2)).await;
    q.add(vec![item(3)]).await.unwrap();
    q.add(vec![a.clone(), b.clone()]).await.unwrap();
    assert_eq!(rows(&q).await.unwrap(), 3);
    let x = q.add_claimed("c", a.clone()).await.unwrap();
    assert!(x.is_none(), "journaled before: that copy goes its own way");
    assert_eq!(rows(&q).await.unwrap(), 3);
}

/// The finished items are the writer's to keep (schema 6 has no index of them): every
/// way an item finishes, and every way a finished one is deleted, moves what the writer
/// holds, and it is what the file holds, oldest first, after a rolled-back batch too.
#[tokio::test]
async fn the_finished_items_are_kept_as_the_file_holds_them() {
    let fp = Failpoints::new();
    let q = Arc::new(SqliteQueue::temporary(fp.clone()).unwrap());
    let kept = |q: Arc<SqliteQueue>| async move {
        let held: Vec<(i64, i64)> = q
            .write(|_, w| Ok(w.finished.rows.iter().copied().collect()))
            .await
            .unwrap();
        let mut file: Vec<i64> = q
            .read_with(|c| {
                let mut s = c.prepare("SELECT seq FROM items WHERE st = 'finished'")?;
                let seqs = s.query_map([], |r| r.get(0))?;
                Ok(seqs.collect::<Result<_, _>>()?)
            })
            .await
            .unwrap();
        assert!(
            held.windows(2).all(|p| p[0].0 <= p[1].0),
            "oldest first: {held:?}"
        );
        let mut seqs: Vec<i64> = held.iter().map(|&(_, s)| s).collect();
        seqs.sort_unstable();
        file.sort_unstable();
        assert_eq!(seqs, file, "held against the file");
        seqs.len()
    };
    q.add((0..6).map(item).collect()).await.unwrap();
    let c = q.claim("a", 6, Duration::ZERO).await.unwrap();
    let ack = |c: &Claimed| {
        let (q, c) = (q.clone(), c.clone());
        async move { q.commit(&c, WaveEffects::ending(End::Ack)).await.unwrap() }
    };
    // Finished by a plain commit, by row and by id.
    assert_eq!(ack(&c[0]).await, Committed::Done);
    let mut by_id = c[1].clone();
    by_id.receipt.slot = 0;
    assert_eq!(ack(&by_id).await, Committed::Done);
    assert_eq!(kept(q.clone()).await, 2);
    // By a commit that writes more than its end.
    let mut more = WaveEffects::ending(End::Ack);
    more.follow_ups.push(item(20));
    assert_eq!(q.commit(&c[2], more).await.unwrap(), Committed::Done);
    assert_eq!(kept(q.clone()).await, 3);
    // A dead letter discarded, another replayed.
    for x in &c[3..5] {
        let dead = WaveEffects::ending(End::DeadLetter("no".into()));
        assert_eq!(q.commit(x, dead).await.unwrap(), Committed::Done);
    }
    assert_eq!(kept(q.clone()).await, 3);
    q.discard(c[3].item.id).await.unwrap();
    q.replay(c[4].item.id).await.unwrap();
    assert_eq!(kept(q.clone()).await, 5);
    // A commit in a batch rolled back finished nothing.
    fp.arm("sqlite-batch", 1);
    assert!(q
        .commit(&c[5], WaveEffects::ending(End::Ack))
        .await
        .is_err());
    assert_eq!(kept(q.clone()).await, 5);
    // Cancelled by hand; set aside with its flow (the follow-up, the replayed item), which
    // makes dead letters, not finished items.
    let waiting = item(30);
    q.add(vec![waiting.clone()]).await.unwrap();
    q.cancel(waiting.id).await.unwrap();
    assert_eq!(kept(q.clone()).await, 6);
    assert_eq!(q.clear_flow("f").await.unwrap(), 2);
    assert_eq!(kept(q.clone()).await, 6);
    // Pruned: those finished before the time go, the rest stay.
    let p = q.prune(now_ms() - 60_000).await.unwrap();
    assert_eq!((p.outcomes, kept(q.clone()).await), (0, 6));
    let p = q.prune(now_ms() + 1).await.unwrap();
    assert_eq!((p.outcomes, kept(q.clone()).await), (6, 0));
    assert_eq!(ack(&c[5]).await, Committed::Done);
    assert_eq!(kept(q.clone()).await, 1);
}

/// An item journaled claimed for a claim that was waiting in the writer (the row written
/// in flight as it is inserted) is where a stalled engine's items are taken back from.
#[tokio::test]
async fn an_item_handed_to_a_waiting_claim_is_taken_back_from_a_stalled_engine() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let claim = waiting_claim(&q, "stalled", 1).await;
    let it = item(1);
    let id = it.id;
    q.add(vec![it]).await.unwrap();
    let got = claim.await.unwrap().unwrap();
    assert_eq!(ids(&got), vec![id]);
    assert_eq!(q.reclaim_stale(Duration::from_secs(3600)).await.unwrap(), 0);
    assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 1);
    let again = q.claim("other", 10, Duration::ZERO).await.unwrap();
    assert_eq!(ids(&again), vec![id]);
    assert_eq!(again[0].item.deliveries, 2);
    assert_eq!(
        q.commit(&got[0], WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Conflict,
        "the stalled engine's late commit is refused"
    );
}

/// An item handed to a waiting claim as it was added (not decoded from its row) is the
/// item its row holds, as a claim after a restart would decode it: counted delivered
/// once, due now, with its messages, cause and retry history whole.
#[tokio::test]
async fn an_item_handed_on_as_added_is_the_item_its_row_holds() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let claim = waiting_claim(&q, "a", 1).await;
    let mut it = item(7);
    it.outputs = vec![vec![
        serde_json::json!({"payload": {"x": 1.5, "s": "é", "l": [1, null, true]}}),
    ]];
    it.attempt = 2;
    it.origin_id = Some(Ulid::new());
    it.first_enqueued_at = it.enqueued_at - 5_000;
    it.not_before = Some(now_ms() - 10);
    q.add(vec![it.clone()]).await.unwrap();
    let got = claim.await.unwrap().unwrap();
    let handed = got[0].item.clone();
    let seq = got[0].receipt.slot as i64;
    let decoded = q
        .write(move |c, _| {
            let (body, id, flow, enqueued_at): (String, String, String, i64) = c.query_row(
                "SELECT body, id, flow, enqueued_at FROM items WHERE seq = ?1",
                [seq],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )?;
            let cols = RowCols {
                id: &id,
                flow,
                deliveries: 1,
                enqueued_at,
                due: None,
            };
            decode(&body, cols).map_err(QueueError::Unavailable)
        })
        .await
        .unwrap();
    assert_eq!(handed, decoded);
    assert_eq!((handed.deliveries, handed.not_before), (1, None));
    assert_eq!(handed.outputs, it.outputs);
}

fn ids(got: &[Claimed]) -> Vec<Ulid> {
    got.iter().map(|c| c.item.id).collect()
}

/// Items added while claimers wait are journaled already claimed (one write of each
/// row): each goes to the oldest claimer with room, in the order added, counted as
/// delivered once, held by its claimer in the file, and committed like any claimed item.
#[tokio::test]
async fn items_added_while_claims_wait_are_journaled_claimed_in_order() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let a = waiting_claim(&q, "a", 2).await;
    let b = waiting_claim(&q, "b", 2).await;
    let items: Vec<WorkItem> = (0..3).map(item).collect();
    let want: Vec<Ulid> = items.iter().map(|i| i.id).collect();
    let changes = || q.write(|c, _| Ok(c.total_changes()));
    let before = changes().await.unwrap();
    q.add(items).await.unwrap();
    let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
    assert_eq!(
        changes().await.unwrap() - before,
        3,
        "one row written per item, not an insert and then a claim's update"
    );
    assert_eq!(ids(&a), want[..2], "the older claimer gets the first two");
    assert_eq!(ids(&b), want[2..], "the next one gets the third");
    for (c, who) in a.iter().map(|c| (c, "a")).chain(b.iter().map(|c| (c, "b"))) {
        assert_eq!(c.item.deliveries, 1);
        assert_eq!(c.consumer, who);
        let v = q.get(c.item.id).await.unwrap().expect("journaled");
        assert!(
            matches!(&v.state, ItemState::InFlight { consumer, .. } if consumer == who),
            "in flight for {who} in the file: {:?}",
            v.state
        );
        assert_eq!(v.item.deliveries, 1);
    }
    assert_eq!(q.write(|_, w| Ok(w.ready)).await.unwrap(), 0);
    for c in a.iter().chain(&b) {
        let r = q.commit(c, WaveEffects::ending(End::Ack)).await.unwrap();
        assert_eq!(r, Committed::Done);
    }
    let st = q.stats().await.unwrap();
    assert_eq!((st.ready, st.in_flight), (0, 0));
}

/// An item made ready in a transaction keeps its place ahead of items added after it in
/// the same transaction: those are not handed to a waiting claimer directly, past it.
#[tokio::test]
async fn an_item_added_does_not_pass_one_made_ready_before_it() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let mut later = item(0);
    later.not_before = Some(now_ms() + 3_600_000);
    let (first, second) = (later.id, item(1));
    let second_id = second.id;
    q.add(vec![later]).await.unwrap();
    let claim = waiting_claim(&q, "a", 5).await;
    // One transaction: the delayed item made ready, then a new item added.
    let rows = Encoded::all(&[second]).unwrap();
    q.write(move |c, w| {
        make_ready(c, w, "SELECT seq FROM items WHERE st = 'delayed'", [])?;
        insert_all(c, w, &rows)
    })
    .await
    .unwrap();
    let got = claim.await.unwrap().unwrap();
    assert_eq!(ids(&got), vec![first, second_id], "in the order made ready");
}

/// A transaction that gave a waiting claimer items and was then rolled back gave it
/// nothing: the add is told it failed, no row is left in flight, and the claimer goes
/// on waiting and gets the next item.
#[tokio::test]
async fn items_given_to_a_claim_in_a_rolled_back_batch_were_never_journaled() {
    let fp = Failpoints::new();
    let q = Arc::new(SqliteQueue::temporary(fp.clone()).unwrap());
    let claim = waiting_claim(&q, "a", 5).await;
    let lost = item(0);
    let lost_id = lost.id;
    fp.arm("sqlite-batch", 1);
    assert!(q.add(vec![lost]).await.is_err(), "the add is told");
    assert!(q.get(lost_id).await.unwrap().is_none(), "nothing journaled");
    assert_eq!(q.stats().await.unwrap().in_flight, 0);
    let next = item(1);
    let next_id = next.id;
    q.add(vec![next]).await.unwrap();
    let got = claim.await.unwrap().unwrap();
    assert_eq!(
        ids(&got),
        vec![next_id],
        "the claimer waited on and got the next"
    );
}

/// A claim made while older ones wait does not take, in the batch that journals it, an
/// item ahead of them: the oldest claim gets it. (The executor starts each claim's items
/// in the order it made its claims; a newer claim served first started a later item's
/// wave ahead of an earlier one's, out of journal order at a stateful node.)
#[tokio::test]
async fn a_new_claim_does_not_take_an_item_ahead_of_older_waiting_ones() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let older = waiting_claim(&q, "older", 1).await;
    // The writer is held busy while an add and then a new claim are sent, so that both
    // come in its next batch, in that order.
    let started = Arc::new(AtomicBool::new(false));
    let busy = {
        let (q, started) = (q.clone(), started.clone());
        tokio::spawn(async move {
            q.write(move |_, _| {
                started.store(true, Ordering::Release);
                std::thread::sleep(Duration::from_millis(300));
                Ok(())
            })
            .await
        })
    };
    until("the writer is busy", || async {
        started.load(Ordering::Acquire)
    })
    .await;
    let it = item(1);
    let id = it.id;
    let mut add = Box::pin(q.add(vec![it]));
    assert!(futures::poll!(&mut add).is_pending(), "the add is sent");
    let mut newer = Box::pin(q.claim("newer", 1, Duration::from_millis(300)));
    assert!(futures::poll!(&mut newer).is_pending(), "the claim is sent");
    busy.await.unwrap().unwrap();
    add.await.unwrap();
    let got = older.await.unwrap().unwrap();
    assert_eq!(
        got.iter().map(|c| c.item.id).collect::<Vec<_>>(),
        vec![id],
        "the older claim gets the item"
    );
    assert!(
        newer.await.unwrap().is_empty(),
        "the newer one waited behind it and got none"
    );
}

/// Schema 7's step gives a row whose id is no ULID (none is written so; a file edited by
/// hand) a row at its journaling's time, whatever the rows around it in id order, and the
/// file opens with every item.
#[tokio::test]
async fn a_row_whose_id_is_no_ulid_does_not_stop_the_migration() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    let (a, b) = (item(1), item(2));
    {
        let c = Connection::open(&path).unwrap();
        c.execute_batch("PRAGMA journal_mode=WAL").unwrap();
        for step in &MIGRATIONS[..6] {
            step.apply(&c).unwrap();
        }
        c.pragma_update(None, "user_version", 6).unwrap();
        let w = |id: &str, enqueued_at: i64, body: &str| {
            c.execute(
                "INSERT INTO items (id, flow, st, ord, enqueued_at, body)
                 VALUES (?1, 'f', 'waiting', 1, ?2, ?3)",
                params![id, enqueued_at, body],
            )
            .unwrap();
        };
        for it in [&a, &b] {
            let e = Encoded::new(it, now_ms()).unwrap();
            w(&e.id, e.enqueued_at, &e.body);
        }
        // After both in id order, at a millisecond long before theirs.
        w("zz-not-a-ulid", 1_000, "{}");
    }
    let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    assert!(q.get(a.id).await.unwrap().is_some());
    assert!(q.get(b.id).await.unwrap().is_some());
    let odd: i64 = q
        .read_with(|c| {
            Ok(c.query_row(
                "SELECT seq FROM items WHERE id = 'zz-not-a-ulid'",
                [],
                |r| r.get(0),
            )?)
        })
        .await
        .unwrap();
    assert_eq!(odd, 1_000 << ROW_BITS);
}

/// A file of schema 3 (`seq` AUTOINCREMENT) opens with every item where it was, in its
/// state, with its row; new items take rows after the largest; journaling no longer
/// writes `sqlite_sequence`; (schemas 5 and 6) the indexes of the items in flight and of
/// those finished are gone, the writer keeping them instead; and (schema 7) the index of
/// ids is gone, each row's `seq` made from its id's time.
#[tokio::test]
async fn a_schema_3_file_keeps_its_items_and_drops_autoincrement() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    let (waiting, finished, in_flight) = (item(1), item(2), item(3));
    {
        let c = Connection::open(&path).unwrap();
        c.execute_batch("PRAGMA journal_mode=WAL").unwrap();
        for step in &MIGRATIONS[..3] {
            step.apply(&c).unwrap();
        }
        c.pragma_update(None, "user_version", 3).unwrap();
        let w =
            |it: &WorkItem, seq: i64, st: &str| {
                let e = Encoded::new(it, now_ms()).unwrap();
                c.execute(
                "INSERT INTO items (seq, id, flow, st, ord, deliveries, enqueued_at, body, reason)
                 VALUES (?1, ?2, ?3, ?4, ?1, 1, ?5, ?6, ?7)",
                params![seq, e.id, e.flow, st, e.enqueued_at, e.body,
                        (st == "finished").then_some("done")],
            )
            .unwrap();
            };
        w(&waiting, 7, "waiting");
        w(&finished, 40, "finished");
        w(&in_flight, 41, "in_flight");
        // The largest row was deleted once: AUTOINCREMENT remembers it.
        c.execute(
            "UPDATE sqlite_sequence SET seq = 90 WHERE name = 'items'",
            [],
        )
        .unwrap();
    }
    let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    let (version, table): (i64, String) = q
        .read_with(|c| {
            Ok((
                c.query_row("PRAGMA user_version", [], |r| r.get(0))?,
                c.query_row(
                    "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'items'",
                    [],
                    |r| r.get(0),
                )?,
            ))
        })
        .await
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    assert!(!table.contains("AUTOINCREMENT"), "{table}");
    let indexes: Vec<String> = q
        .read_with(|c| {
            let mut s = c.prepare(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'items'
                 ORDER BY name",
            )?;
            let names = s.query_map([], |r| r.get(0))?;
            Ok(names.collect::<Result<_, _>>()?)
        })
        .await
        .unwrap();
    assert_eq!(
        indexes,
        ["items_dead", "items_due", "items_parked", "items_ready"]
    );
    // Schema 7: every row's `seq` is its id's time, then its place among the ids of
    // that millisecond.
    let rows: Vec<(i64, String)> = q
        .read_with(|c| {
            let mut s = c.prepare("SELECT seq, id FROM items ORDER BY seq")?;
            let rows = s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(rows.collect::<Result<_, _>>()?)
        })
        .await
        .unwrap();
    let mut by_id = rows.clone();
    by_id.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(rows, by_id, "rows in the order of their ids");
    for (seq, id) in &rows {
        let id = Ulid::from_string(id).unwrap();
        assert_eq!(*seq >> ROW_BITS, id.timestamp_ms() as i64, "{id}");
    }
    let row = |id: Ulid| rows.iter().find(|r| r.1 == id.to_string()).unwrap().0;
    let state = |id| {
        let q = &q;
        async move { q.get(id).await.unwrap().unwrap().state.name() }
    };
    assert_eq!(state(waiting.id).await, "waiting");
    assert_eq!(state(finished.id).await, "finished");
    let held = q
        .write(|_, w| Ok(w.finished.rows.iter().copied().collect::<Vec<_>>()))
        .await
        .unwrap();
    assert_eq!(
        held,
        [(0, row(finished.id))],
        "the finished item, kept by the writer"
    );
    assert_eq!(
        state(in_flight.id).await,
        "waiting",
        "left in flight: ready again"
    );
    let got = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(q.stats().await.unwrap().in_flight, 2);
    assert_eq!(
        got.iter()
            .map(|c| (c.item.id, c.receipt.slot))
            .collect::<Vec<_>>(),
        vec![
            (waiting.id, row(waiting.id) as u64),
            (in_flight.id, row(in_flight.id) as u64)
        ],
        "their rows, in the ready order"
    );
    assert_eq!(
        got[1].item.deliveries, 2,
        "its delivery counted before stays"
    );
    let new = item(4);
    q.add(vec![new.clone()]).await.unwrap();
    let (seq, sequence): (i64, i64) = q
        .read_with(move |c| {
            Ok((
                c.query_row(
                    "SELECT seq FROM items WHERE id = ?1",
                    [new.id.to_string()],
                    |r| r.get(0),
                )?,
                c.query_row(
                    "SELECT count(*) FROM sqlite_sequence WHERE name = 'items'",
                    [],
                    |r| r.get(0),
                )?,
            ))
        })
        .await
        .unwrap();
    assert_eq!(
        seq >> ROW_BITS,
        new.id.timestamp_ms() as i64,
        "a new row at its id's time"
    );
    assert_eq!(sequence, 0, "nothing kept in sqlite_sequence");
    for c in &got {
        let r = q.commit(c, WaveEffects::ending(End::Ack)).await.unwrap();
        assert_eq!(r, Committed::Done, "a claim of a migrated row commits");
    }
    let next = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(next.len(), 1);
}

/// Reads past the reader's bound wait for room instead of being dropped: with the reader
/// held and more reads sent than it keeps waiting, every one is answered once it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_past_the_readers_bound_wait_for_room_and_all_answer() {
    let q = std::sync::Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let (go, hold) = std::sync::mpsc::channel::<()>();
    let (holding, on_hold) = tokio::sync::oneshot::channel::<()>();
    let held = {
        let q = q.clone();
        tokio::spawn(async move {
            q.read_with(move |_| {
                let _ = holding.send(());
                let _ = hold.recv();
                Ok(())
            })
            .await
        })
    };
    // The reader is held before any other read is sent: none of them can slip in first.
    on_hold.await.unwrap();
    let reads: Vec<_> = (0..READS_WAITING + 100)
        .map(|_| {
            let q = q.clone();
            tokio::spawn(async move { q.get(Ulid::new()).await })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while q.reader.capacity() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the reads never filled the bound"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    go.send(()).unwrap();
    held.await.unwrap().unwrap();
    for r in reads {
        assert!(
            r.await.unwrap().unwrap().is_none(),
            "an unknown id reads as none"
        );
    }
}
