//! What the Redis backend promises beyond the shared contract: dead-letter evictions are
//! counted and recorded, never silent; unsafe persistence settings are reported; items of
//! one flow stay in their flow's shard; an entry weir did not write is removed with a count and
//! a warning, not in silence.

use std::time::Duration;

use serde_json::json;
use weir_queue::testing::{RedisCluster, RedisServer};
use weir_queue::{
    Admin, End, Failpoints, ItemState, RedisOptions, RedisQueue, WaveEffects, WorkItem, WorkQueue,
};

fn item(n: i64) -> WorkItem {
    WorkItem::cascade("f", "in", "test", vec![json!({ "payload": n })])
}

/// The payloads of claimed `item`s, in the order claimed.
fn payloads(got: &[weir_queue::Claimed]) -> Vec<i64> {
    got.iter()
        .map(|c| c.item.outputs[0][0]["payload"].as_i64().unwrap())
        .collect()
}

/// A plain connection to `server`, to read or write behind weir's back.
async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(server.url()).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

/// `CONFIG SET name value` on `server`.
async fn config_set(server: &RedisServer, name: &str, value: &str) {
    let mut c = raw(server).await;
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", name, value])
        .query_async(&mut c)
        .await
        .unwrap();
}

/// The error of a start that must be refused, checked to be one sentence.
async fn refused(url: &str, opts: RedisOptions) -> String {
    let Err(e) = RedisQueue::connect(url, opts, Failpoints::new()).await else {
        panic!("the start was accepted");
    };
    let e = e.to_string();
    assert!(!e.contains("  "), "one sentence, no runs of spaces: {e}");
    e
}

#[tokio::test]
async fn dead_letters_past_the_cap_are_evicted_visibly() {
    let server = RedisServer::start();
    // The cap as a user sets it, on the queue's URL (`RedisOptions::dead_cap`).
    let q = weir_queue::open(&format!("{}?dead_cap=3", server.url()), Failpoints::new())
        .await
        .unwrap();
    let items: Vec<_> = (0..5).map(item).collect();
    let ids: Vec<_> = items.iter().map(|i| i.id).collect();
    q.add(items).await.unwrap();
    for c in q.claim("a", 5, Duration::ZERO).await.unwrap() {
        let why = format!("bad {}", c.item.outputs[0][0]["payload"]);
        q.commit(&c, WaveEffects::ending(End::DeadLetter(why)))
            .await
            .unwrap();
    }
    let s = q.admin().stats().await.unwrap();
    assert_eq!((s.dead, s.dead_evicted), (3, 2), "{s:?}");
    let kept: Vec<_> = q
        .admin()
        .dead_letters(10)
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.item.id)
        .collect();
    assert_eq!(
        kept,
        vec![ids[4], ids[3], ids[2]],
        "the newest are kept, newest first"
    );
    match q.admin().get(ids[0]).await.unwrap().unwrap().state {
        ItemState::Finished { outcome, .. } => {
            assert!(
                outcome.contains("evicted from the dead letters"),
                "{outcome}"
            )
        }
        other => panic!("the evicted item says what became of it: {other:?}"),
    }
}

#[tokio::test]
async fn unsafe_persistence_is_reported() {
    let server = RedisServer::start();
    let q = RedisQueue::connect(&server.url(), RedisOptions::default(), Failpoints::new())
        .await
        .unwrap();
    assert!(
        q.check_persistence("test").await.is_empty(),
        "appendonly yes + appendfsync always is safe"
    );
    config_set(&server, "appendfsync", "everysec").await;
    let w = q.check_persistence("test").await;
    assert!(
        w.len() == 1 && w[0].contains("appendfsync everysec"),
        "{w:?}"
    );
    config_set(&server, "appendonly", "no").await;
    let w = q.check_persistence("test").await;
    assert!(
        w.len() == 1 && w[0].contains("without the append-only file"),
        "{w:?}"
    );
}

#[tokio::test]
async fn a_flows_keys_live_in_its_shard() {
    let server = RedisServer::start();
    let opts = RedisOptions {
        shards: 4,
        ..RedisOptions::default()
    };
    let q = RedisQueue::connect(&server.url(), opts, Failpoints::new())
        .await
        .unwrap();
    let flows = ["orders", "alerts", "thermostat", "billing", "audit"];
    q.add(
        flows
            .iter()
            .map(|f| WorkItem::cascade(f, "in", "t", vec![]))
            .collect(),
    )
    .await
    .unwrap();
    let mut c = raw(&server).await;
    for f in flows {
        let k = weir_queue::redis::keys::shard_of(f, 4);
        let key = weir_queue::redis::keys::stream(&weir_queue::redis::keys::prefix("weir", k));
        let entries: Vec<redis::Value> = redis::cmd("XRANGE")
            .arg(&key)
            .arg("-")
            .arg("+")
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(!entries.is_empty(), "flow {f} has its entry in shard {k}");
    }
    assert_eq!(
        q.stats().await.unwrap().ready,
        flows.len(),
        "stats fan out over shards"
    );
}

#[tokio::test]
async fn a_poison_entry_is_dead_lettered_alone_and_the_rest_flow() {
    let server = RedisServer::start();
    let q = RedisQueue::connect(&server.url(), RedisOptions::default(), Failpoints::new())
        .await
        .unwrap();
    q.add(vec![item(1)]).await.unwrap();
    // A second item whose body is corrupt, written behind weir's back as weir would have
    // written it (its stream entry and its line in `live`), then a third.
    let bad_id = ulid::Ulid::new();
    let mut c = raw(&server).await;
    let p = weir_queue::redis::keys::prefix("weir", 0);
    let entry: String = redis::cmd("XADD")
        .arg(weir_queue::redis::keys::stream(&p))
        .arg("*")
        .arg(&["id", &bad_id.to_string(), "d", "0"])
        .arg(&["body", "{not json"])
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::pipe()
        .hset(
            weir_queue::redis::keys::live(&p),
            bad_id.to_string(),
            &entry,
        )
        .zadd(weir_queue::redis::keys::index(&p), bad_id.to_string(), 0)
        .query_async(&mut c)
        .await
        .unwrap();
    q.add(vec![item(3)]).await.unwrap();
    let got = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        payloads(&got),
        vec![1, 3],
        "the items around the poison are handed out"
    );
    let dead = q.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].item.id, bad_id);
    match &dead[0].state {
        ItemState::Dead { reason, .. } => {
            assert!(reason.starts_with("undecodable item"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn an_engine_with_another_number_of_shards_is_refused_with_the_way_out() {
    let server = RedisServer::start();
    let opts = |shards| RedisOptions {
        shards,
        ..RedisOptions::default()
    };
    let first = RedisQueue::connect(&server.url(), opts(4), Failpoints::new()).await;
    assert!(first.is_ok());
    let same = RedisQueue::connect(&server.url(), opts(4), Failpoints::new()).await;
    assert!(same.is_ok(), "the same number is fine");
    let e = refused(&server.url(), opts(2)).await;
    assert!(
        e.contains("4 shards") && e.contains("shards=2") && e.contains("ns="),
        "{e}"
    );
    let other_ns = RedisOptions {
        namespace: "other".into(),
        ..opts(2)
    };
    assert!(
        RedisQueue::connect(&server.url(), other_ns, Failpoints::new())
            .await
            .is_ok(),
        "another namespace keeps its own"
    );
}

#[tokio::test]
async fn a_busy_shard_does_not_starve_the_flows_of_another() {
    use weir_queue::redis::keys::shard_of;
    let server = RedisServer::start();
    let opts = RedisOptions {
        shards: 4,
        ..RedisOptions::default()
    };
    let q = RedisQueue::connect(&server.url(), opts, Failpoints::new())
        .await
        .unwrap();
    // A busy flow in the first shard, a quiet one in the last.
    let name = |shard: u32| {
        (0..)
            .map(|i| format!("flow-{i}"))
            .find(|f| shard_of(f, 4) == shard)
            .unwrap()
    };
    let (busy, quiet) = (name(0), name(3));
    let many: Vec<WorkItem> = (0..200)
        .map(|n| WorkItem::cascade(&busy, "in", "test", vec![json!({ "payload": n })]))
        .collect();
    q.add(many).await.unwrap();
    let lone = WorkItem::cascade(&quiet, "in", "test", vec![json!({ "payload": "lone" })]);
    let lone_id = lone.id;
    q.add(vec![lone]).await.unwrap();
    let got = q.claim("a", 16, Duration::ZERO).await.unwrap();
    assert_eq!(got.len(), 16, "a claim still fills up from the busy shard");
    assert!(
        got.iter().any(|c| c.item.id == lone_id),
        "the quiet flow's item is in the first claim, not after the busy flow's 200"
    );
    // Within the busy flow, journal order holds.
    let ns: Vec<i64> = got
        .iter()
        .filter(|c| c.item.flow == busy)
        .map(|c| c.item.outputs[0][0]["payload"].as_i64().unwrap())
        .collect();
    assert_eq!(ns, (0..15).collect::<Vec<_>>());
}

/// Past the 10,000 finished records kept per shard, the oldest go, many in one call and
/// unread: only finished records, never an item still waiting, delayed or dead. Commits go
/// in up to two group calls at once here, as under load.
#[tokio::test]
async fn the_oldest_finished_records_go_and_no_live_item_with_them() {
    let server = RedisServer::start();
    let q = RedisQueue::connect(&server.url(), RedisOptions::default(), Failpoints::new())
        .await
        .unwrap();
    let mut later = item(-1);
    later.not_before = Some(weir_queue::now_ms() + 3_600_000);
    let (delayed, dead) = (later.id, item(-2));
    let dead_id = dead.id;
    q.add(vec![later, dead]).await.unwrap();
    let c = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    assert_eq!(c.item.id, dead_id);
    q.commit(&c, WaveEffects::ending(End::DeadLetter("bad".into())))
        .await
        .unwrap();

    let mut finished = Vec::new();
    for round in 0..21 {
        let items: Vec<_> = (0..512).map(|i| item(round * 512 + i)).collect();
        finished.extend(items.iter().map(|i| i.id));
        q.add(items).await.unwrap();
        let claimed = q.claim("a", 512, Duration::ZERO).await.unwrap();
        assert_eq!(claimed.len(), 512);
        let commits = claimed
            .iter()
            .map(|c| q.commit(c, WaveEffects::ending(End::Ack)));
        for r in futures::future::join_all(commits).await {
            assert_eq!(r.unwrap(), weir_queue::Committed::Done);
        }
    }

    let mut kept = Vec::new();
    for id in &finished {
        if let Some(v) = q.get(*id).await.unwrap() {
            assert!(matches!(v.state, ItemState::Finished { .. }), "{v:?}");
            kept.push(*id);
        }
    }
    assert!(
        (10_000..=10_256).contains(&kept.len()),
        "{} of {} finished records kept",
        kept.len(),
        finished.len()
    );
    assert_eq!(
        kept,
        finished[finished.len() - kept.len()..],
        "the newest are the ones kept"
    );
    assert!(matches!(
        q.get(delayed).await.unwrap().unwrap().state,
        ItemState::Delayed { .. }
    ));
    assert!(matches!(
        q.get(dead_id).await.unwrap().unwrap().state,
        ItemState::Dead { .. }
    ));
}

/// `live`, the hash holding the line of each waiting or in-flight item, stays a hash table
/// however few items it holds. Redis keeps a small hash as a listpack (up to 128 fields by
/// default, 512 in Debian's redis.conf), and every read and write of a batch's lines would
/// then scan it from its start; it also deleted the hash each time the queue emptied.
#[tokio::test]
async fn the_live_hash_stays_a_hash_table_however_few_items_it_holds() {
    let server = RedisServer::start();
    config_set(&server, "hash-max-listpack-entries", "512").await;
    let q = RedisQueue::connect(&server.url(), RedisOptions::default(), Failpoints::new())
        .await
        .unwrap();
    let mut c = raw(&server).await;
    let mut encoding = async move || -> Option<String> {
        redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(weir_queue::redis::keys::live(
                &weir_queue::redis::keys::prefix("weir", 0),
            ))
            .query_async(&mut c)
            .await
            .unwrap()
    };
    for round in 0..2 {
        let one = item(round);
        let id = one.id;
        q.add(vec![one]).await.unwrap();
        assert_eq!(
            encoding().await.as_deref(),
            Some("hashtable"),
            "round {round}, waiting"
        );
        let claimed = q.claim("a", 8, Duration::ZERO).await.unwrap();
        assert_eq!(
            claimed.len(),
            1,
            "round {round}: the one item, and nothing else"
        );
        assert_eq!(claimed[0].item.id, id);
        assert_eq!(
            encoding().await.as_deref(),
            Some("hashtable"),
            "round {round}, in flight"
        );
        let r = q.commit(&claimed[0], WaveEffects::ending(End::Ack)).await;
        assert_eq!(r.unwrap(), weir_queue::Committed::Done);
        // Nothing is live now; the hash stays, so the next item does not start it over.
        assert_eq!(
            encoding().await.as_deref(),
            Some("hashtable"),
            "round {round}, empty"
        );
        let s = q.stats().await.unwrap();
        assert_eq!((s.ready, s.in_flight), (0, 0), "round {round}");
    }
}

#[tokio::test]
async fn a_namespace_an_earlier_weir_wrote_is_refused_with_the_way_out() {
    let server = RedisServer::start();
    let mut c = raw(&server).await;
    // An earlier weir recorded its shards and no layout.
    let _: () = redis::cmd("SET")
        .arg(weir_queue::redis::keys::meta("weir", "shards"))
        .arg(1)
        .query_async(&mut c)
        .await
        .unwrap();
    let e = refused(&server.url(), RedisOptions::default()).await;
    assert!(
        e.contains("namespace `weir`") && e.contains("layout 1") && e.contains("ns="),
        "{e}"
    );
    let fresh = RedisOptions {
        namespace: "fresh".into(),
        ..RedisOptions::default()
    };
    let q = RedisQueue::connect(&server.url(), fresh.clone(), Failpoints::new())
        .await
        .unwrap();
    q.add(vec![item(1)]).await.unwrap();
    assert!(
        RedisQueue::connect(&server.url(), fresh, Failpoints::new())
            .await
            .is_ok(),
        "a namespace this weir wrote opens again"
    );
}

/// A claim committed several times at once (a retry racing its first try), plainly and
/// with effects, in one group or in several: one commit ends the item, the rest conflict,
/// and the item is recorded once.
#[tokio::test]
async fn a_claim_committed_twice_at_once_ends_its_item_once() {
    let server = RedisServer::start();
    let q = RedisQueue::connect(&server.url(), RedisOptions::default(), Failpoints::new())
        .await
        .unwrap();
    q.add((0..20).map(item).collect()).await.unwrap();
    let got = q.claim("a", 20, Duration::ZERO).await.unwrap();
    assert_eq!(got.len(), 20);
    let commits = got.iter().flat_map(|c| {
        [
            q.commit(c, WaveEffects::ending(End::Ack)),
            q.commit(c, WaveEffects::ending(End::Ack)),
            q.commit(c, WaveEffects::ending(End::DeadLetter("by hand".into()))),
        ]
    });
    let words = futures::future::join_all(commits).await;
    let mut dead = 0;
    for (c, three) in got.iter().zip(words.chunks(3)) {
        let done: Vec<usize> = (0..3)
            .filter(|&i| *three[i].as_ref().unwrap() == weir_queue::Committed::Done)
            .collect();
        assert_eq!(
            done.len(),
            1,
            "one commit of {} ends it: {three:?}",
            c.item.id
        );
        let state = q.get(c.item.id).await.unwrap().unwrap().state;
        if done[0] == 2 {
            dead += 1;
            assert!(matches!(state, ItemState::Dead { .. }), "{state:?}");
        } else {
            assert!(matches!(state, ItemState::Finished { .. }), "{state:?}");
        }
    }
    let s = q.stats().await.unwrap();
    assert_eq!((s.ready, s.in_flight, s.dead), (0, 0, dead));
    // Each finished item is listed once among the finished records.
    let mut c = raw(&server).await;
    let p = weir_queue::redis::keys::prefix("weir", 0);
    let listed: Vec<String> = redis::cmd("LRANGE")
        .arg(format!("{p}finished"))
        .arg(0)
        .arg(-1)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(listed.len(), 20 - dead, "{listed:?}");
}

/// Wait up to 10 s for `cond`, checking every 10 ms.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}, within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A request waits at `waiter` for a reply that `poster` posts once it surely waits (it
/// registers before its first poll): the status the request gets.
async fn posted_by(waiter: &RedisQueue, poster: &RedisQueue) -> Option<u16> {
    let id = ulid::Ulid::new();
    let reply = weir_queue::Reply {
        status: 200,
        headers: vec![],
        body: json!({ "ok": true }).into(),
    };
    let (got, posted) = tokio::join!(waiter.wait_reply(id, Duration::from_secs(10)), async {
        tokio::time::sleep(LATER).await;
        poster.post_reply(id, reply).await
    });
    posted.unwrap();
    got.unwrap().map(|r| r.status)
}

/// `n` replies posted by `there` for requests waiting at `here`, each arriving: how many of
/// them the channel woke. A poll of the waiter that lands between a reply and its name on the
/// channel finds the reply first (the channel is only a hint), so a busy machine may let some
/// be found that way.
async fn heard_of(n: usize, here: &RedisQueue, there: &RedisQueue) -> u64 {
    let before = here.replies_heard();
    for _ in 0..n {
        assert_eq!(posted_by(here, there).await, Some(200), "the reply arrived");
    }
    here.replies_heard() - before
}

/// How long after a request starts waiting (or a claim) the tests of the channels post its
/// reply (or add its item).
const LATER: Duration = Duration::from_millis(600);

/// Options whose waiters poll at most every 2 s. Their polls fall about 2, 6, 14, …, 510 and
/// 1,022 ms after they start, so what is posted or added [`LATER`] has some 400 ms to be
/// heard on the channel before a poll finds it. At the default 25 ms, a busy machine's
/// channel lost that race often enough to fail these tests (CI, 2026-12-07: one of three).
fn slow_polls(opts: RedisOptions) -> RedisOptions {
    RedisOptions {
        poll: Duration::from_secs(2),
        ..opts
    }
}

/// Two engines on the queue at `url`.
async fn two_engines(url: &str, opts: RedisOptions) -> (RedisQueue, RedisQueue) {
    let connect = || RedisQueue::connect(url, opts.clone(), Failpoints::new());
    (connect().await.unwrap(), connect().await.unwrap())
}

/// Once `here` listens on the channel, replies `there` posts for `of` requests waiting at
/// `here` wake at least `least` of them (not all: see [`heard_of`]).
async fn the_channel_wakes_requests(here: &RedisQueue, there: &RedisQueue, least: u64, of: usize) {
    until("the engine listens for posted replies", || {
        here.hears_other_engines()
    })
    .await;
    let heard = heard_of(of, here, there).await;
    assert!(
        heard >= least,
        "the channel woke {heard} of {of} requests, fewer than {least}"
    );
}

/// `busy` adds one item while `idle` has a claim waiting (for up to 10 s) and, when
/// `busy_waits`, `busy` has one too: whether `idle`'s claims were woken by the channel of
/// added items (a poll of `idle` may find the item first, or `busy`'s claim be between two
/// rounds when the add lands, so a test counts the rounds that were, of three).
async fn woke_the_idle_one(busy: &RedisQueue, idle: &RedisQueue, busy_waits: bool) -> bool {
    let one = item(7);
    let id = one.id;
    let before = idle.adds_heard();
    let idle_claim = async {
        // Waiting past the add either way.
        let wait = if busy_waits {
            LATER + Duration::from_millis(300)
        } else {
            Duration::from_secs(10)
        };
        idle.claim("idle", 1, wait).await.unwrap()
    };
    let busy_claim = async {
        if busy_waits {
            busy.claim("busy", 1, Duration::from_secs(10))
                .await
                .unwrap()
        } else {
            Vec::new()
        }
    };
    let add = async {
        tokio::time::sleep(LATER).await;
        busy.add(vec![one]).await.unwrap();
    };
    let (theirs, mine, ()) = tokio::join!(idle_claim, busy_claim, add);
    let claimed: Vec<_> = theirs.iter().chain(&mine).map(|c| c.item.id).collect();
    assert_eq!(claimed, [id], "the item was claimed, once");
    for c in theirs.iter().chain(&mine) {
        busy.commit(c, WaveEffects::ending(End::Ack)).await.unwrap();
    }
    idle.adds_heard() > before
}

/// Of `rounds` rounds of [`woke_the_idle_one`], how many `idle`'s claims were woken in.
async fn idle_woken_of(rounds: u32, busy: &RedisQueue, idle: &RedisQueue, busy_waits: bool) -> u32 {
    let mut woken = 0;
    for _ in 0..rounds {
        woken += woke_the_idle_one(busy, idle, busy_waits).await as u32;
    }
    woken
}

/// How many messages `ps` has received: each one until none comes for 500 ms.
async fn drained(ps: &mut redis::aio::PubSub) -> usize {
    let mut got = ps.on_message();
    let mut n = 0;
    while let Ok(Some(_)) = tokio::time::timeout(
        Duration::from_millis(500),
        futures::StreamExt::next(&mut got),
    )
    .await
    {
        n += 1;
    }
    n
}

/// An engine that adds an item with no claim of its own waiting names the add on the
/// namespace's channel, and another engine's waiting claim takes the item at once instead of
/// at its next poll. An engine whose own claim waits takes its lone item itself and names
/// no add, so idle engines do not all race for every item. A subscriber of the test's own
/// reads the channel.
#[tokio::test]
async fn an_add_where_no_claim_waits_wakes_the_claims_of_another_engine() {
    let server = RedisServer::start();
    let (busy, idle) = two_engines(&server.url(), slow_polls(RedisOptions::default())).await;
    until("both engines listen", || {
        busy.hears_other_engines() && idle.hears_other_engines()
    })
    .await;
    let mut ps = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    ps.subscribe(weir_queue::redis::keys::items_added("weir"))
        .await
        .unwrap();
    let woken = idle_woken_of(3, &busy, &idle, false).await;
    assert!(
        woken >= 2,
        "the channel woke the idle engine's claim in {woken} of 3"
    );
    assert_eq!(
        drained(&mut ps).await,
        3,
        "each add was named on the channel"
    );
    let woken = idle_woken_of(3, &busy, &idle, true).await;
    let named = drained(&mut ps).await;
    // A round's add may land while the busy engine's claim is between two rounds.
    assert!(
        named <= 1 && woken <= named as u32,
        "an engine whose own claim waited named its add in {named} of 3 rounds, and woke the other in {woken}"
    );
    let s = busy.stats().await.unwrap();
    assert_eq!((s.ready, s.in_flight), (0, 0));
}

/// A `respond: wave` request waits at the engine that journaled its event; its wave may run,
/// and its reply be posted, at another. That engine names the reply on the namespace's
/// channel, and the waiting engine, which listens there, wakes the request at once rather
/// than at its next poll. The channel is only a hint (a waiter polls all the same), and after
/// the server is killed and started again, listening resumes by itself.
#[tokio::test]
async fn a_reply_another_engine_posts_wakes_the_request_waiting_for_it() {
    let mut server = RedisServer::start();
    let (here, there) = two_engines(&server.url(), slow_polls(RedisOptions::default())).await;
    the_channel_wakes_requests(&here, &there, 2, 3).await;
    assert_eq!(
        there.replies_heard(),
        0,
        "nothing waited where they were posted"
    );

    // A reply posted by the engine where the request waits wakes it directly, not through
    // the channel.
    let heard = here.replies_heard();
    assert_eq!(posted_by(&here, &here).await, Some(200));
    assert_eq!(
        here.replies_heard(),
        heard,
        "no message on the channel for it"
    );

    // The server killed: the channel is cut. Started again: listening resumes by itself.
    server.stop();
    until("the cut is noticed", || !here.hears_other_engines()).await;
    server.restart();
    // Each engine's connection comes back on its first use after the restart.
    for q in [&here, &there] {
        let mut tries = 0;
        while q.stats().await.is_err() {
            tries += 1;
            assert!(tries < 100, "the engine reaches the restarted server");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    the_channel_wakes_requests(&here, &there, 2, 3).await;
}

/// In a Redis Cluster every node hears a publish, so an engine listening on one hears the
/// replies that any engine posts, and the adds it names, whichever node keeps them. A
/// publish crosses the cluster's bus between nodes; with the default 25 ms polls, two of
/// three woken by it was seen to fail on a busy machine (CI, 2026-12-06). With the slow
/// polls of [`slow_polls`] it has some 400 ms to arrive, and must wake three of five.
#[tokio::test]
async fn another_engines_replies_and_adds_wake_their_waiters_in_a_cluster_too() {
    let cluster = RedisCluster::start();
    let opts = RedisOptions {
        shards: 4,
        ..RedisOptions::default()
    };
    let (here, there) = two_engines(&cluster.url(), slow_polls(opts)).await;
    the_channel_wakes_requests(&here, &there, 3, 5).await;
    let woken = idle_woken_of(5, &there, &here, false).await;
    assert!(
        woken >= 3,
        "the channel woke the idle engine's claim in {woken} of 5 rounds"
    );
}

/// A Redis user without pub/sub rights (Redis 7 gives a new user no channels unless told):
/// the engine cannot listen and its publishes are refused, yet every reply still reaches its
/// request and every item added at one engine the claim waiting at the other, found by
/// polling, and neither posting nor adding ever fails for it.
#[tokio::test]
async fn without_pub_sub_rights_replies_and_items_still_cross_engines() {
    let server = RedisServer::start();
    let mut c = raw(&server).await;
    redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "weir",
            "on",
            ">secret",
            "~*",
            "+@all",
            "resetchannels",
        ])
        .query_async::<()>(&mut c)
        .await
        .unwrap();
    let url = server.url().replace("redis://", "redis://weir:secret@");
    let (here, there) = two_engines(&url, RedisOptions::default()).await;
    assert_eq!(heard_of(3, &here, &there).await, 0, "found by polling");
    assert_eq!(posted_by(&here, &here).await, Some(200));
    assert_eq!(
        idle_woken_of(3, &there, &here, false).await,
        0,
        "found by polling"
    );
    assert!(
        !here.hears_other_engines(),
        "the channel is refused to this user"
    );
}

/// The gauges this process sets, by name: a recorder of this test's own (the process-wide
/// one would also count other tests' queues).
#[derive(Default)]
struct Gauges(std::sync::Mutex<std::collections::HashMap<String, f64>>);

struct GaugeOf(std::sync::Arc<Gauges>, String);

impl metrics::GaugeFn for GaugeOf {
    fn increment(&self, v: f64) {
        *self.0 .0.lock().unwrap().entry(self.1.clone()).or_default() += v;
    }
    fn decrement(&self, v: f64) {
        self.increment(-v);
    }
    fn set(&self, v: f64) {
        self.0 .0.lock().unwrap().insert(self.1.clone(), v);
    }
}

impl metrics::CounterFn for GaugeOf {
    fn increment(&self, v: u64) {
        metrics::GaugeFn::increment(self, v as f64);
    }
    fn absolute(&self, v: u64) {
        metrics::GaugeFn::set(self, v as f64);
    }
}

struct Recorder(std::sync::Arc<Gauges>);

impl metrics::Recorder for Recorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(std::sync::Arc::new(GaugeOf(
            self.0.clone(),
            key.name().to_string(),
        )))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(std::sync::Arc::new(GaugeOf(
            self.0.clone(),
            key.name().to_string(),
        )))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// `weir_redis_reply_channel_listening` counts the queues of this process that listen for
/// posted replies: each counts 1 while it listens and takes it off once dropped (its
/// listener is stopped mid-wait, which used to leave the gauge as it was), so one queue's
/// end does not hide another that still listens.
#[test]
fn the_listening_gauge_counts_each_queue_until_it_is_dropped() {
    let server = RedisServer::start();
    let gauges = std::sync::Arc::new(Gauges::default());
    let listening = {
        let g = gauges.clone();
        move || {
            g.0.lock()
                .unwrap()
                .get("weir_redis_reply_channel_listening")
                .copied()
                .unwrap_or(-1.0)
        }
    };
    let recorder = Recorder(gauges.clone());
    // A runtime on this thread only, so that the listeners' tasks record to this recorder.
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let (one, two) = two_engines(&server.url(), RedisOptions::default()).await;
                until("both queues listen for posted replies", || {
                    one.hears_other_engines() && two.hears_other_engines()
                })
                .await;
                assert_eq!(listening(), 2.0, "both queues listen");
                drop(one);
                until("the dropped queue is counted off", || listening() == 1.0).await;
                assert!(two.hears_other_engines(), "the other still listens");
                drop(two);
                until("the gauge goes back to 0", || listening() == 0.0).await;
            })
    });
}

/// An entry that another program adds to the queue's stream is not run, and does not vanish
/// in silence either: the claim that finds it removes it and counts it in
/// `weir_redis_foreign_entries_total` (with a warning naming its fields), and the items
/// around it flow.
#[test]
fn an_entry_weir_did_not_write_is_removed_and_counted() {
    let server = RedisServer::start();
    let gauges = std::sync::Arc::new(Gauges::default());
    let recorder = Recorder(gauges.clone());
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let q =
                    RedisQueue::connect(&server.url(), RedisOptions::default(), Failpoints::new())
                        .await
                        .unwrap();
                q.add(vec![item(1)]).await.unwrap();
                let mut c = raw(&server).await;
                let stream =
                    weir_queue::redis::keys::stream(&weir_queue::redis::keys::prefix("weir", 0));
                let foreign: String = redis::cmd("XADD")
                    .arg(&stream)
                    .arg("*")
                    // Its text, cut to 200 bytes for the warning, ends inside a character.
                    .arg(&["temperature", "21.5", "notes", &"é".repeat(150)])
                    .query_async(&mut c)
                    .await
                    .unwrap();
                q.add(vec![item(3)]).await.unwrap();
                let got = q.claim("a", 10, Duration::ZERO).await.unwrap();
                assert_eq!(
                    payloads(&got),
                    vec![1, 3],
                    "the items around the entry are handed out"
                );
                let counted = gauges
                    .0
                    .lock()
                    .unwrap()
                    .get("weir_redis_foreign_entries_total")
                    .copied();
                assert_eq!(counted, Some(1.0), "the entry is counted");
                let left: Vec<redis::Value> = redis::cmd("XRANGE")
                    .arg(&stream)
                    .arg(&foreign)
                    .arg(&foreign)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                assert!(left.is_empty(), "the entry is out of the stream: {left:?}");
                assert!(q.dead_letters(10).await.unwrap().is_empty());
                // Nothing comes back for it later either.
                for g in got {
                    q.commit(&g, WaveEffects::ending(End::Ack)).await.unwrap();
                }
                assert!(q.claim("a", 10, Duration::ZERO).await.unwrap().is_empty());
            })
    });
}

#[tokio::test]
async fn a_removed_flows_backlog_is_set_aside_a_page_at_a_time() {
    let server = RedisServer::start();
    let q = weir_queue::open(&server.url(), Failpoints::new())
        .await
        .unwrap();
    // More than a page of each kind, the other flow's items among them.
    let mut items = Vec::new();
    for n in 0..1_200 {
        let mut waiting = item(n);
        waiting.flow = if n % 4 == 0 { "g".into() } else { "f".into() };
        let mut later = item(n);
        later.flow = waiting.flow.clone();
        later.not_before = Some(weir_queue::now_ms() + 3_600_000);
        items.push(waiting);
        items.push(later);
    }
    q.add(items).await.unwrap();
    assert_eq!(q.admin().clear_flow("f").await.unwrap(), 1_800);
    let s = q.admin().stats().await.unwrap();
    assert_eq!((s.ready, s.delayed, s.dead), (300, 300, 1_800), "{s:?}");
    let left = q.claim("a", 1_000, Duration::ZERO).await.unwrap();
    assert!(left.iter().all(|c| c.item.flow == "g"));
}
