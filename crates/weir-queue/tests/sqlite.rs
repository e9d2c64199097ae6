//! What the SQLite backend promises beyond the shared contract: the file survives the
//! process, one engine holds it, a failed group commit fails every member and keeps nothing,
//! and concurrent callers share transactions.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use weir_queue::{
    Admin, ClaimsWait, Closing, Failpoints, QueueError, SqliteQueue, WorkItem, WorkQueue,
};

fn item(n: i64) -> WorkItem {
    WorkItem::cascade("f", "in", "test", vec![json!({ "payload": n })])
}

#[tokio::test]
async fn a_second_engine_on_the_same_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    let first = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    let second = SqliteQueue::open(&path, Failpoints::new());
    let Err(QueueError::Open(msg)) = second else {
        panic!("the second open must be refused");
    };
    assert!(msg.contains("in use by another weir engine"), "{msg}");
    drop(first);
    SqliteQueue::open(&path, Failpoints::new()).expect("free again once the first is closed");
}

/// A shutdown frees the file although a task still holds the queue (an HTTP connection
/// winding down after the server said it stopped): a restart right after must not be told
/// that another engine has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_queue_frees_its_file_while_something_still_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    let q = Arc::new(SqliteQueue::open(&path, Failpoints::new()).unwrap());
    let held = q.clone();
    q.add(vec![item(0)])
        .await
        .expect("accepted before the close");
    // An add racing the close: kept if it was accepted, not journaled if it was refused.
    let adding = {
        let q = q.clone();
        tokio::spawn(async move { q.add(vec![item(1)]).await })
    };
    tokio::task::yield_now().await;
    q.close().await;
    let before = adding.await.unwrap();
    let again = SqliteQueue::open(&path, Failpoints::new()).expect("free once closed");
    let after = held.add(vec![item(2)]).await;
    assert!(
        matches!(after, Err(QueueError::Unavailable(_))),
        "a closed queue refuses work: {after:?}"
    );
    let ready = again.stats().await.unwrap().ready;
    assert_eq!(
        ready,
        1 + usize::from(before.is_ok()),
        "what was accepted before the close is kept, what was refused is not: {before:?}"
    );
}

#[tokio::test]
async fn items_and_delivery_counts_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q/queue.db");
    let ids: Vec<_> = {
        let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
        let items: Vec<_> = (0..3).map(item).collect();
        let ids = items.iter().map(|i| i.id).collect();
        q.add(items).await.unwrap();
        // Claimed and never committed: the process "dies" holding it.
        let c = q.claim("a", 1, Duration::ZERO).await.unwrap();
        assert_eq!(c[0].item.deliveries, 1);
        ids
    };
    let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    let s = q.stats().await.unwrap();
    assert_eq!((s.ready, s.in_flight), (3, 0), "the orphan is ready again");
    assert!(s.durable);
    let c = q.claim("b", 10, Duration::ZERO).await.unwrap();
    assert_eq!(c.iter().map(|c| c.item.id).collect::<Vec<_>>(), ids);
    assert_eq!(
        c[0].item.deliveries, 2,
        "the first claim was counted durably"
    );
    assert_eq!(c[1].item.deliveries, 1);
}

#[tokio::test]
async fn a_file_from_a_newer_weir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    drop(SqliteQueue::open(&path, Failpoints::new()).unwrap());
    let c = rusqlite::Connection::open(&path).unwrap();
    c.pragma_update(None, "user_version", 999).unwrap();
    drop(c);
    let Err(QueueError::Open(msg)) = SqliteQueue::open(&path, Failpoints::new()) else {
        panic!("a newer schema must be refused");
    };
    assert!(msg.contains("newer weir"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_adds_share_transactions() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let before = q.batches();
    let tasks: Vec<_> = (0..400)
        .map(|n| {
            let q = q.clone();
            tokio::spawn(async move { q.add(vec![item(n)]).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let used = q.batches() - before;
    assert_eq!(q.stats().await.unwrap().ready, 400);
    assert!(
        used < 200,
        "400 concurrent adds took {used} transactions: group commit is not merging them"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_fails_every_member_and_keeps_none() {
    let fp = Failpoints::new();
    let q = Arc::new(SqliteQueue::temporary(fp.clone()).unwrap());
    fp.arm("sqlite-batch", 1);
    let tasks: Vec<_> = (0..100)
        .map(|n| {
            let q = q.clone();
            tokio::spawn(async move {
                let it = item(n);
                let id = it.id;
                (id, q.add(vec![it]).await)
            })
        })
        .collect();
    let mut failed = 0;
    for t in tasks {
        let (id, r) = t.await.unwrap();
        let stored = q.get(id).await.unwrap();
        match r {
            Ok(()) => assert!(stored.is_some(), "an accepted item is in the journal"),
            Err(e) => {
                assert!(matches!(e, QueueError::Unavailable(_)), "{e}");
                assert!(stored.is_none(), "a refused item left nothing behind");
                failed += 1;
            }
        }
    }
    assert!(failed >= 1, "the failpoint failed one batch");
    assert_eq!(q.stats().await.unwrap().ready, 100 - failed);
}

/// The row the queue gives an item with id `id` (schema 7: its id's time, then its place
/// among that millisecond's), for the first such item.
fn row_at(id: ulid::Ulid) -> i64 {
    (id.timestamp_ms() as i64) << 20
}

#[tokio::test]
async fn rows_written_before_bodies_were_compact_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    drop(SqliteQueue::open(&path, Failpoints::new()).unwrap());
    // Schema 2 kept the whole item as its JSON in `body`.
    let it = weir_queue::conformance::unusual_item("f");
    let c = rusqlite::Connection::open(&path).unwrap();
    c.execute(
        "INSERT INTO items (seq, id, flow, st, ord, deliveries, enqueued_at, body)
         VALUES (?4, ?1, 'f', 'waiting', 0, 0, ?2, ?3)",
        rusqlite::params![
            it.id.to_string(),
            it.enqueued_at,
            serde_json::to_string(&it).unwrap(),
            row_at(it.id)
        ],
    )
    .unwrap();
    drop(c);
    let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    let got = q.claim("a", 10, Duration::ZERO).await.unwrap();
    let want = WorkItem {
        deliveries: 1,
        ..it.clone()
    };
    assert_eq!(got[0].item, want);
    assert_eq!(q.get(it.id).await.unwrap().unwrap().item, want);
}

#[tokio::test]
async fn a_poison_row_is_dead_lettered_alone_and_the_rest_flow() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    q.add(vec![item(1)]).await.unwrap();
    drop(q);
    // Something wrote a row no weir can read (a bad restore, a bug in an older build).
    let c = rusqlite::Connection::open(&path).unwrap();
    let poison = ulid::Ulid::new();
    c.execute(
        "INSERT INTO items (seq, id, flow, st, ord, enqueued_at, body) VALUES (?2, ?1, 'f', 'waiting', 0, 0, '{not json')",
        rusqlite::params![poison.to_string(), row_at(poison)],
    )
    .unwrap();
    drop(c);
    let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    q.add(vec![item(2)]).await.unwrap();
    let got = q.claim("a", 10, Duration::ZERO).await.unwrap();
    let ns: Vec<i64> = got
        .iter()
        .map(|c| c.item.outputs[0][0]["payload"].as_i64().unwrap())
        .collect();
    assert_eq!(ns, vec![1, 2], "the items around the poison are handed out");
    assert_eq!(
        q.stats().await.unwrap().in_flight,
        2,
        "the poison is not counted in flight"
    );
    let dead = q.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].item.id, poison);
    match &dead[0].state {
        weir_queue::ItemState::Dead { reason, .. } => {
            assert!(reason.starts_with("undecodable item"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_to_an_idle_engine_is_journaled_and_claimed_in_one_transaction() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let waiting = {
        let q = q.clone();
        tokio::spawn(async move { q.claim("c", 8, Duration::from_secs(10)).await })
    };
    // The claim is waiting in the writer (it found nothing).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = q.batches();
    let it = item(1);
    let id = it.id;
    q.add(vec![it]).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiting claim is answered at once")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].item.id, got[0].item.deliveries), (id, 1));
    assert_eq!(
        q.batches() - before,
        1,
        "add and claim shared one transaction"
    );
    let v = q.get(id).await.unwrap().unwrap();
    assert_eq!(v.state.name(), "in_flight");
    assert_eq!(v.item.deliveries, 1, "the delivery is counted durably");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_claim_ends_empty_at_its_deadline() {
    let q = SqliteQueue::temporary(Failpoints::new()).unwrap();
    let t = std::time::Instant::now();
    let got = q.claim("c", 8, Duration::from_millis(200)).await.unwrap();
    assert!(got.is_empty());
    assert!(
        t.elapsed() >= Duration::from_millis(190),
        "{:?}",
        t.elapsed()
    );
    // The writer goes on serving other jobs meanwhile and after.
    q.add(vec![item(1)]).await.unwrap();
    assert_eq!(q.claim("c", 8, Duration::ZERO).await.unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_claimed_for_a_claimer_that_gave_up_are_ready_again() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    // A claim abandoned while it waits (its engine stops claiming).
    let gone = {
        let q = q.clone();
        tokio::spawn(async move { q.claim("c", 8, Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    gone.abort();
    let _ = gone.await;
    q.add(vec![item(1), item(2)]).await.unwrap();
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while got.len() < 2 {
        assert!(std::time::Instant::now() < deadline, "items lost: {got:?}");
        got.extend(q.claim("d", 8, Duration::from_millis(100)).await.unwrap());
    }
    let n: Vec<_> = got
        .iter()
        .map(|c| c.item.outputs[0][0]["payload"].clone())
        .collect();
    assert_eq!(n, vec![json!(1), json!(2)], "in journal order");
}

/// The executor keeps `claims_ahead` claims waiting: while the first one's items are handed
/// out, the second takes the next item in the very transaction that journals it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_waiting_claim_takes_the_next_item_in_its_own_transaction() {
    let q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    assert!(q.claims_ahead() >= 2);
    let wait = || {
        let q = q.clone();
        tokio::spawn(async move { q.claim("c", 8, Duration::from_secs(10)).await })
    };
    let (first, second) = (wait(), wait());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (a, b) = (item(1), item(2));
    let (id_a, id_b) = (a.id, b.id);
    q.add(vec![a]).await.unwrap();
    // One claim takes the first item; the other is still waiting.
    let (got, still_waiting) = match tokio::time::timeout(
        Duration::from_secs(5),
        futures::future::select(first, second),
    )
    .await
    .expect("a waiting claim is answered at once")
    {
        futures::future::Either::Left((got, other)) => (got, other),
        futures::future::Either::Right((got, other)) => (got, other),
    };
    let got = got.unwrap().unwrap();
    assert_eq!(
        got.iter().map(|c| c.item.id).collect::<Vec<_>>(),
        vec![id_a]
    );
    let before = q.batches();
    q.add(vec![b]).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), still_waiting)
        .await
        .expect("the second claim is answered at once")
        .unwrap()
        .unwrap();
    assert_eq!(
        next.iter().map(|c| c.item.id).collect::<Vec<_>>(),
        vec![id_b]
    );
    assert_eq!(
        q.batches() - before,
        1,
        "the second item was journaled and claimed in one transaction"
    );
}

#[cfg(unix)]
#[tokio::test]
async fn the_queue_files_are_its_owners_alone() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data").join("queue.db");
    let q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    q.add(vec![item(1)]).await.unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir.path().join("data")), 0o700);
    for f in ["queue.db", "queue.db.lock", "queue.db-wal"] {
        let p = dir.path().join("data").join(f);
        assert!(p.exists(), "{f}");
        assert_eq!(mode(&p), 0o600, "{f}");
    }
}
