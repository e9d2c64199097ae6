//! Crash safety, as DESIGN §11 asks: a `weir run` process with real work in flight is killed
//! with SIGKILL and started again on the same queue; every event that got a 202 reaches the
//! sink. Once on the SQLite default, once on a redis-server the test owns.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use weir_queue::testing::RedisServer;
use weir_testkit::{wait_for, Sink, WeirProcess};

const FLOW: &str = r#"
id: crash
nodes:
  in: { type: webhook, path: crash, to: [wait] }
  wait: { type: delay, for: 300ms, mode: each, to: [deliver] }
  deliver: { type: http-request, url: "SINK" }
"#;

fn flows_dir(sink: &Sink) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("crash.yaml"),
        FLOW.replace("SINK", &sink.url("got")),
    )
    .unwrap();
    dir
}

/// POST `range` as `{"n": i}`, `parallel` at a time; the n of every 202, with its item id.
async fn post_all(
    e: &WeirProcess,
    range: std::ops::Range<u64>,
    parallel: usize,
) -> BTreeMap<u64, String> {
    let mut accepted = BTreeMap::new();
    let ns: Vec<u64> = range.collect();
    for chunk in ns.chunks(parallel) {
        let answers = futures::future::join_all(
            chunk
                .iter()
                .map(|n| async move { (*n, e.post("crash", &json!({ "n": n })).await) }),
        )
        .await;
        for (n, (status, body)) in answers {
            if status == 202 {
                accepted.insert(n, body["id"].as_str().unwrap_or_default().to_string());
            }
        }
    }
    accepted
}

fn arrived(sink: &Sink) -> HashMap<u64, usize> {
    let mut seen = HashMap::new();
    for b in sink.bodies() {
        if let Some(n) = b["n"].as_u64() {
            *seen.entry(n).or_default() += 1;
        }
    }
    seen
}

fn count(stats: &Value, what: &str) -> u64 {
    stats[what].as_u64().unwrap_or(0)
}

async fn kill_mid_load_and_restart(queue: &str, label: &str) {
    let sink = Sink::start().await;
    sink.answer_after(20);
    let flows = flows_dir(&sink);
    // A stable consumer name: the restarted engine takes back at once what it left in flight.
    let args = ["--consumer", "crash-test"];
    let mut e = WeirProcess::start(flows.path(), queue, &args).await;

    // 1. Kill while work is in flight, delayed and waiting.
    let mut accepted = post_all(&e, 0..300, 16).await;
    assert_eq!(
        accepted.len(),
        300,
        "every event is accepted while the engine runs"
    );
    // Kill only once a snapshot shows waves in flight and timers waiting at the same time.
    let deadline = Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let s = e.stats().await;
        if count(&s, "in_flight") > 0 && count(&s, "delayed") > 0 {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "no moment with work in flight and delayed: {s}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    e.kill();
    let before_restart = arrived(&sink).len();
    println!("[{label}] killed with {stats} pending; {before_restart} of 300 had arrived");

    let mut e = WeirProcess::start(flows.path(), queue, &args).await;
    wait_for(
        "every accepted event after the restart",
        Duration::from_secs(60),
        || {
            let seen = arrived(&sink);
            accepted.keys().all(|n| seen.contains_key(n))
        },
    )
    .await;

    // 2. Kill right after a burst of 202s: none of them may be lost.
    let burst = post_all(&e, 1000..1200, 50).await;
    e.kill();
    assert!(!burst.is_empty());
    accepted.extend(burst);
    let e = WeirProcess::start(flows.path(), queue, &args).await;
    let t = Instant::now();
    wait_for(
        "every event of the burst after the second restart",
        Duration::from_secs(60),
        || {
            let seen = arrived(&sink);
            accepted.keys().all(|n| seen.contains_key(n))
        },
    )
    .await;
    let seen = arrived(&sink);
    let twice: usize = seen.values().map(|c| c - 1).sum();
    println!(
        "[{label}] all {} accepted events arrived ({:?} after the second restart); {twice} arrived more than once",
        accepted.len(),
        t.elapsed()
    );
    assert!(
        seen.keys().all(|n| accepted.contains_key(n)),
        "nothing arrives that was not sent"
    );
    assert_eq!(
        e.stop(Duration::from_secs(15)).await,
        Some(0),
        "clean exit on SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sigkill_mid_load_loses_nothing() {
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    kill_mid_load_and_restart(&queue, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigkill_mid_load_loses_nothing() {
    let redis = RedisServer::start();
    kill_mid_load_and_restart(&redis.url(), "redis").await;
}

/// The SQLite journal refusing writes (a full disk, say): webhooks answer 503 and journal
/// nothing, the engine stays up, and once writes succeed again everything accepted flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_write_failures_cost_503s_not_events() {
    let sink = Sink::start().await;
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let flow = FLOW.replace("SINK", &sink.url("got"));
    let fp = weir::Failpoints::new();
    let e = weir_testkit::start_on(&queue, &[("crash.yaml", &flow)], fp.clone()).await;
    let post = |n: u64| weir_testkit::post_json(&e, "crash", json!({ "n": n }));
    assert_eq!(post(1).await.status(), 202);
    // Every transaction fails from now on, until disarmed.
    fp.arm("sqlite-batch", u32::MAX);
    for n in 2..12 {
        let r = post(n).await;
        assert_eq!(
            r.status(),
            503,
            "a write that failed is refused, not half-accepted"
        );
    }
    let stats = reqwest::get(format!("http://{}/api/stats", e.addr))
        .await
        .unwrap();
    assert!(stats.status().is_success() || stats.status() == 503);
    fp.arm("sqlite-batch", 0);
    assert_eq!(
        post(100).await.status(),
        202,
        "accepted again once writes succeed"
    );
    wait_for(
        "the events accepted before and after",
        Duration::from_secs(20),
        || {
            let seen = arrived(&sink);
            seen.contains_key(&1) && seen.contains_key(&100)
        },
    )
    .await;
    let seen = arrived(&sink);
    assert!(
        (2..12).all(|n| !seen.contains_key(&n)),
        "refused events were not journaled"
    );
    e.shutdown().await;
}
