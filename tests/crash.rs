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

fn in_flight(stats: &Value) -> u64 {
    ["in_flight", "delayed", "ready"]
        .iter()
        .map(|k| stats[*k].as_u64().unwrap_or(0))
        .sum()
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
    let stats = e.stats().await;
    assert!(
        in_flight(&stats) > 0,
        "work is really in flight before the kill: {stats}"
    );
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
