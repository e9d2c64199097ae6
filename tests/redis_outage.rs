//! The Redis backend when things break: the server restarts in the middle of a load, and two
//! engines race for one item.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use weir::Failpoints;
use weir_queue::testing::RedisServer;
use weir_queue::{
    Admin, Committed, End, RedisOptions, RedisQueue, WaveEffects, WorkItem, WorkQueue,
};
use weir_testkit::{post_json, start_on, wait_for, Sink};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_mid_load_costs_503s_not_events() {
    let mut redis = RedisServer::start();
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  in: {{ type: webhook, path: load, to: [wait] }}
  wait: {{ type: delay, for: 200ms, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("got")
    );
    let e = start_on(&redis.url(), &[("load.yaml", &flow)], Failpoints::new()).await;
    let mut accepted = BTreeSet::new();
    let mut refused = 0;
    let send = |n: u64| {
        let e = &e;
        async move {
            (
                n,
                post_json(e, "load", json!({ "n": n }))
                    .await
                    .status()
                    .as_u16(),
            )
        }
    };
    for n in 0..100 {
        let (n, s) = send(n).await;
        assert_eq!(s, 202, "accepted while Redis is up");
        accepted.insert(n);
    }
    redis.stop();
    for n in 100..120 {
        let (n, s) = send(n).await;
        match s {
            202 => {
                accepted.insert(n);
            }
            503 => refused += 1,
            other => panic!("while Redis is down a webhook answers 503, not {other}"),
        }
        // Down for a while: the executor meets the outage too, and must ride it out.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        refused >= 19,
        "Redis is down: webhooks answer 503 ({refused} did)"
    );
    redis.restart();
    // The engine comes back by itself: keep posting until it accepts again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut n = 200;
    loop {
        let (m, s) = send(n).await;
        if s == 202 {
            accepted.insert(m);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "webhooks are accepted again once Redis is back (last answer {s})"
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for n in 300..400 {
        let (n, s) = send(n).await;
        assert_eq!(s, 202);
        accepted.insert(n);
    }
    wait_for(
        "every accepted event, before and after the restart",
        Duration::from_secs(30),
        || {
            let got: BTreeSet<u64> = sink
                .bodies()
                .iter()
                .filter_map(|b| b["n"].as_u64())
                .collect();
            accepted.is_subset(&got)
        },
    )
    .await;
    println!(
        "{} accepted and delivered, {refused} refused with 503 while Redis was down",
        accepted.len()
    );
    e.shutdown().await;
}

#[tokio::test]
async fn a_stalled_engine_loses_its_item_to_another_and_its_late_commit_is_refused() {
    let redis = RedisServer::start();
    let url = redis.url();
    let connect = || RedisQueue::connect(&url, RedisOptions::default(), Failpoints::new());
    let a = Arc::new(connect().await.unwrap());
    let b = Arc::new(connect().await.unwrap());
    let item = WorkItem::cascade("f", "in", "test", vec![json!({"payload": 1})]);
    let id = item.id;
    a.add(vec![item]).await.unwrap();
    let stalled = a
        .claim("engine-a", 1, Duration::ZERO)
        .await
        .unwrap()
        .remove(0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(b.reclaim_stale(Duration::from_millis(20)).await.unwrap(), 1);
    let taken = b
        .claim("engine-b", 1, Duration::ZERO)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(taken.item.id, id);
    assert_eq!(taken.item.deliveries, 2);
    let late = WaveEffects {
        follow_ups: vec![WorkItem::cascade("f", "next", "test", vec![])],
        ..WaveEffects::ending(End::Ack)
    };
    assert_eq!(a.commit(&stalled, late).await.unwrap(), Committed::Conflict);
    assert_eq!(
        b.commit(&taken, WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Done
    );
    let s = b.stats().await.unwrap();
    assert_eq!(
        (s.ready, s.in_flight),
        (0, 0),
        "the late commit left no follow-up: {s:?}"
    );
}
