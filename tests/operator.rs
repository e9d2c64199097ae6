//! The operator's hands: pauses that outlive a restart, dead letters replayed and discarded
//! in bulk with outcomes left behind, a delayed item cancelled by hand that never runs.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use weir::Failpoints;
use weir_testkit::{
    get_json, post_admin, post_json, start_on, wait_for, wait_for_dead_letters, Sink,
};

async fn delete(base: &str, path: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .delete(format!("{base}{path}"))
        .header("x-weir-client", "test")
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_outlives_a_restart_and_its_parked_items_wait() {
    let sink = Sink::start().await;
    let flow = format!(
        "id: p\nconcurrency: 1\nnodes:\n  in: {{ type: webhook, path: p, to: [out] }}\n  out: {{ type: http-request, url: \"{}\" }}\n",
        sink.url("got")
    );
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_on(&queue, &[("p.yaml", &flow)], Failpoints::new()).await;
    post_admin(&e, "/api/flows/p/pause").await;
    for n in 0..3 {
        post_json(&e, "p", json!({ "n": n })).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while get_json(&e, "/api/stats").await["parked"] != 3 {
        assert!(Instant::now() < deadline, "three parked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.shutdown().await;
    let e = start_on(&queue, &[("p.yaml", &flow)], Failpoints::new()).await;
    let flows = get_json(&e, "/api/flows").await;
    assert_eq!(
        flows[0]["paused"], true,
        "still paused after the restart: {flows}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.count(), 0, "parked items wait");
    let stepped = post_admin(&e, "/api/flows/p/step").await;
    assert!(stepped["stepped"].is_string());
    wait_for("the stepped one", Duration::from_secs(10), || {
        sink.count() == 1
    })
    .await;
    assert_eq!(sink.bodies()[0]["n"], 0, "step releases the oldest");
    post_admin(&e, "/api/flows/p/resume").await;
    wait_for("the rest", Duration::from_secs(10), || sink.count() == 3).await;
    let ns: Vec<u64> = sink.ns();
    assert_eq!(ns, vec![0, 1, 2], "in order");
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_in_bulk_and_the_outcomes_they_leave() {
    let flow = r#"
id: picky
nodes:
  in: { type: webhook, path: in, to: [check] }
  check:
    type: function
    script: |
      if msg.payload.n % 2 == 1 { throw "odd " + msg.payload.n; }
      msg
"#;
    let e = start_on("memory", &[("picky.yaml", flow)], Failpoints::new()).await;
    let base = format!("http://{}", e.admin_addr);
    for n in 0..6 {
        post_json(&e, "in", json!({ "n": n })).await;
    }
    let dead = wait_for_dead_letters(&e, 3, Duration::from_secs(10)).await;
    assert!(
        dead.iter()
            .all(|d| d["reason"].as_str().unwrap().contains("script threw")),
        "{dead:?}"
    );
    // A bare bulk call is refused: it would empty the list by accident.
    assert_eq!(delete(&base, "/api/dead-letters").await.0, 400);
    // Replay them all: each fails again, and is listed again (as new items).
    let r: Value = reqwest::Client::new()
        .post(format!("{base}/api/dead-letters/replay?flow=picky"))
        .header("x-weir-client", "test")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["replayed"], 3, "{r}");
    // Each fails again: three new dead letters for the same messages (the first ones ended
    // as "replayed as …").
    let first: Vec<String> = dead
        .iter()
        .map(|d| d["item"]["id"].as_str().unwrap().to_string())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = get_json(&e, "/api/dead-letters").await;
        let now: Vec<&Value> = d.as_array().unwrap().iter().collect();
        let fresh = now
            .iter()
            .filter(|v| !first.contains(&v["item"]["id"].as_str().unwrap().to_string()))
            .count();
        if now.len() == 3 && fresh == 3 {
            let mut ns: Vec<u64> = now
                .iter()
                .map(|v| v["item"]["outputs"][0][0]["payload"]["n"].as_u64().unwrap())
                .collect();
            ns.sort_unstable();
            assert_eq!(ns, vec![1, 3, 5]);
            break;
        }
        assert!(Instant::now() < deadline, "the replays fail again: {d}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Discard those whose reason says "odd 3": one; then all.
    let (status, one) = delete(&base, "/api/dead-letters?reason=odd%203").await;
    assert_eq!((status, one["discarded"].as_u64()), (200, Some(1)), "{one}");
    let (_, rest) = delete(&base, "/api/dead-letters?all=true").await;
    assert_eq!(rest["discarded"], 2);
    assert_eq!(get_json(&e, "/api/dead-letters").await, json!([]));
    let outcomes = get_json(&e, "/api/outcomes?flow=picky&limit=100").await;
    let texts: Vec<&str> = outcomes
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        texts.iter().filter(|t| **t == "discarded by hand").count(),
        3,
        "{texts:?}"
    );
    assert_eq!(
        texts
            .iter()
            .filter(|t| t.starts_with("replayed as "))
            .count(),
        3,
        "{texts:?}"
    );
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_item_is_listed_with_its_due_time_and_cancelled_by_hand_never_runs() {
    let sink = Sink::start().await;
    let flow = format!(
        "id: later\nnodes:\n  in: {{ type: webhook, path: in, to: [wait] }}\n  wait: {{ type: delay, for: 600ms, to: [out] }}\n  out: {{ type: http-request, url: \"{}\" }}\n",
        sink.url("got")
    );
    let e = start_on("memory", &[("later.yaml", &flow)], Failpoints::new()).await;
    let base = format!("http://{}", e.admin_addr);
    post_json(&e, "in", json!({ "n": 1 })).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let delayed = loop {
        let l = get_json(&e, "/api/queue?state=delayed").await;
        if let Some(d) = l.as_array().and_then(|a| a.first()).cloned() {
            break d;
        }
        assert!(Instant::now() < deadline, "the delay's item is listed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        delayed["due"].as_i64().unwrap() > weir::queue::now_ms(),
        "with its due time: {delayed}"
    );
    let id = delayed["item"]["id"].as_str().unwrap();
    let (status, _) = delete(&base, &format!("/api/queue/{id}")).await;
    assert_eq!(status, 200);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(sink.count(), 0, "a cancelled timer never fires");
    let item = get_json(&e, &format!("/api/items/{id}")).await;
    assert_eq!(item["outcome"], "cancelled by hand", "{item}");
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_dead_letters_and_runs_are_pruned_past_the_retention() {
    let flow = r#"
id: short
nodes:
  in: { type: webhook, path: in, to: [check] }
  by_hand: { type: manual, to: [check] }
  check:
    type: function
    script: |
      if msg.payload == "bad" { throw "bad"; }
      msg
"#;
    let mut exec = weir_testkit::test_exec();
    exec.retention = Duration::from_millis(300);
    exec.prune_every = Duration::from_millis(100);
    let data = tempfile::tempdir().unwrap();
    let e = weir_testkit::start_exec(
        &format!("sqlite:{}/queue.db", data.path().display()),
        exec,
        &[("short.yaml", flow)],
    )
    .await;
    let base = format!("http://{}", e.admin_addr);
    let ok: Value = post_json(&e, "in", json!("fine"))
        .await
        .json()
        .await
        .unwrap();
    post_json(&e, "in", json!("bad")).await;
    let run: Value = reqwest::Client::new()
        .post(format!("{base}/api/flows/short/runs"))
        .json(&json!("fine"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = ok["id"].as_str().unwrap().to_string();
    let run = run["run_id"].as_str().unwrap().to_string();
    wait_for_dead_letters(&e, 1, Duration::from_secs(5)).await;
    // Kept while young, gone once past the retention.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let item = reqwest::get(format!("{base}/api/items/{id}"))
            .await
            .unwrap()
            .status();
        let dead = get_json(&e, "/api/dead-letters").await;
        let runs = reqwest::get(format!("{base}/api/runs/{run}"))
            .await
            .unwrap()
            .status();
        if item == 404 && dead == json!([]) && runs == 404 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pruned: item {item}, dead {dead}, run {runs}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"weir_pruned_total{what="outcomes"}"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"weir_pruned_total{what="dead_letters"}"#),
        "{metrics}"
    );
    e.shutdown().await;
}

/// A sink answering after `ms`, and flow `slow` (with `head` before its nodes): webhook `in`
/// → http-request to the sink.
async fn slow_flow(ms: u64, head: &str) -> (Sink, String) {
    let sink = Sink::start().await;
    sink.answer_after(ms);
    let flow = format!(
        "id: slow\n{head}nodes:\n  in: {{ type: webhook, path: in, to: [out] }}\n  out: {{ type: http-request, url: \"{}\" }}\n",
        sink.url("got")
    );
    (sink, flow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after_and_loses_nothing_accepted() {
    // One wave at a time, claimed by the executor (a flow with places free would start up to
    // `concurrency` of its webhook's waves where they are journaled), one item in flight: the
    // rest wait ready, and the queue is full past three.
    let (sink, flow) = slow_flow(300, "concurrency: 1\n").await;
    let mut exec = weir_testkit::test_exec();
    exec.max_in_flight = 1;
    let data = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}/queue.db?max_ready=3", data.path().display());
    let e = weir_testkit::start_exec(&url, exec, &[("slow.yaml", &flow)]).await;
    let mut accepted = Vec::new();
    let mut refused = 0;
    for n in 0..10 {
        let r = post_json(&e, "in", json!({ "n": n })).await;
        match r.status().as_u16() {
            202 => accepted.push(n),
            429 => {
                assert_eq!(r.headers()["retry-after"], "1");
                refused += 1;
            }
            other => panic!("{other}"),
        }
    }
    assert!(refused > 0, "past three ready items the queue is full");
    assert!(accepted.len() >= 3, "{accepted:?}");
    wait_for("every accepted event", Duration::from_secs(20), || {
        sink.count() == accepted.len()
    })
    .await;
    let got: Vec<u64> = sink.ns();
    assert_eq!(
        got, accepted,
        "what was accepted arrives, what was refused was never journaled"
    );
    e.shutdown().await;
}

/// 24 events behind a one-at-a-time flow whose call takes 100 ms: the last would wait 2.4 s
/// claimed in the engine, past a 1 s reclaim delay, and be taken back as stalled and
/// delivered again while its first delivery still waits. The engine holds only
/// `max_waiting` unstarted, so each event is delivered and called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_waiting_behind_a_slow_flow_are_not_taken_back_as_stalled() {
    let (sink, flow) = slow_flow(100, "concurrency: 1\n").await;
    let mut exec = weir_testkit::test_exec();
    exec.reclaim_after = Duration::from_secs(1);
    exec.max_waiting = 2;
    let data = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}/queue.db", data.path().display());
    let e = weir_testkit::start_exec(&url, exec, &[("slow.yaml", &flow)]).await;
    let events = 24;
    for n in 0..events {
        assert_eq!(post_json(&e, "in", json!({ "n": n })).await.status(), 202);
    }
    wait_for("every event at the sink", Duration::from_secs(30), || {
        sink.count() >= events
    })
    .await;
    // Time for a second delivery to show, had there been one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let got: Vec<u64> = sink.ns();
    assert_eq!(
        got,
        (0..events as u64).collect::<Vec<_>>(),
        "each once, in order"
    );
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_flow_parks_up_to_its_bound_and_dead_letters_the_rest_with_the_reason() {
    let flow = "id: held\nconcurrency: 1\nnodes:\n  in: { type: webhook, path: in, to: [l] }\n  l: { type: log }\n";
    let mut exec = weir_testkit::test_exec();
    exec.max_parked = 2;
    let e = weir_testkit::start_exec("memory", exec, &[("held.yaml", flow)]).await;
    post_admin(&e, "/api/flows/held/pause").await;
    for n in 0..4 {
        assert_eq!(post_json(&e, "in", json!({ "n": n })).await.status(), 202);
    }
    let dead = wait_for_dead_letters(&e, 2, Duration::from_secs(10)).await;
    for d in &dead {
        let reason = d["reason"].as_str().unwrap();
        assert!(
            reason.contains("paused with 2 items parked already"),
            "{reason}"
        );
    }
    assert_eq!(get_json(&e, "/api/stats").await["parked"], 2);
    e.shutdown().await;
}
