//! The promises "nothing lost, nothing repeated, everything visible" where a wave overruns,
//! on SQLite and on Redis.

use std::time::Duration;

use serde_json::json;
use weir_testkit::{post_json, start_exec, test_exec, wait_for_dead_letters, Sink};

/// A side effect, then a call slower than the wave may run.
fn flow(fast: &str, slow: &str) -> String {
    format!(
        r#"
id: overrun
nodes:
  hook: {{ type: webhook, path: overrun, to: [notify] }}
  notify: {{ type: http-request, url: "{fast}", to: [slow] }}
  slow: {{ type: http-request, url: "{slow}" }}
"#
    )
}

async fn a_wave_past_its_deadline_keeps_its_item_and_repeats_no_effect(queue: &str) {
    let (fast, slow) = (Sink::start().await, Sink::start().await);
    slow.answer_after(3_000);
    let mut exec = test_exec();
    exec.wave_deadline = Duration::from_millis(500);
    exec.max_deliveries = 3;
    let f = flow(&fast.url("done"), &slow.url("slow"));
    let e = start_exec(queue, exec, &[("overrun.yaml", f.as_str())]).await;
    let r = post_json(&e, "overrun", json!({ "n": 1 })).await;
    assert_eq!(r.status(), 202);
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // It always overruns: dead-lettered at the delivery ceiling, not journaled again for ever.
    let dead = wait_for_dead_letters(&e, 1, Duration::from_secs(30)).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        dead[0]["item"]["id"],
        id.as_str(),
        "the same item throughout"
    );
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("passed its deadline") && reason.contains("3 deliveries"),
        "{reason}"
    );
    assert_eq!(
        fast.count(),
        1,
        "the side effect before the overrun ran once"
    );
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wave_past_its_deadline_on_sqlite() {
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    a_wave_past_its_deadline_keeps_its_item_and_repeats_no_effect(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wave_past_its_deadline_on_redis() {
    let redis = weir_queue::testing::RedisServer::start();
    a_wave_past_its_deadline_keeps_its_item_and_repeats_no_effect(&redis.url()).await;
}

/// A side effect as a wave's last step keeps no marker of its own (the commit that ends the
/// item is its record); if that commit is refused and the wave runs again, it is not done
/// twice.
async fn a_last_step_effect_runs_once_through_a_refused_commit(queue: &str) {
    let sink = Sink::start().await;
    let flow = format!(
        "id: last\nnodes:\n  hook: {{ type: webhook, path: last, to: [send] }}\n  send: {{ type: http-request, url: \"{}\" }}\n",
        sink.url("sent")
    );
    let fp = weir::Failpoints::new();
    fp.arm("commit-conflict", 1);
    let e = weir_testkit::start_on(queue, &[("last.yaml", flow.as_str())], fp.clone()).await;
    let r = post_json(&e, "last", json!({ "n": 1 })).await;
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    weir_testkit::eventually("the item done", Duration::from_secs(10), || {
        let path = format!("/api/items/{id}");
        let e = &e;
        async move {
            let v = weir_testkit::get_json(e, &path).await;
            match v["state"].as_str() {
                Some("finished") => Ok(()),
                _ => Err(v),
            }
        }
    })
    .await;
    assert!(!fp.hit("commit-conflict"), "the refused commit happened");
    assert_eq!(sink.count(), 1, "the last step's effect, once");
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_step_effect_runs_once_on_sqlite() {
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    a_last_step_effect_runs_once_through_a_refused_commit(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_step_effect_runs_once_on_redis() {
    let redis = weir_queue::testing::RedisServer::start();
    a_last_step_effect_runs_once_through_a_refused_commit(&redis.url()).await;
}

/// An event whose wave ended with failures names the items that carry them on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_with_failures_names_its_dead_letters() {
    let flow = r#"
id: split
nodes:
  hook: { type: webhook, path: split, to: [bad, good] }
  bad: { type: function, script: 'throw "no"' }
  good: { type: log }
"#;
    let e = weir_testkit::start(&[("split.yaml", flow)], weir::Failpoints::new()).await;
    let r = post_json(&e, "split", json!(1)).await;
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let dead = wait_for_dead_letters(&e, 1, Duration::from_secs(10)).await;
    let dead_id = dead[0]["item"]["id"].as_str().unwrap().to_string();
    let item = weir_testkit::get_json(&e, &format!("/api/items/{id}")).await;
    let outcome = item["outcome"].as_str().unwrap_or_default();
    assert!(
        outcome.starts_with("done with failures") && outcome.contains(&dead_id),
        "{item}"
    );
    let stats = weir_testkit::get_json(&e, "/api/stats").await;
    assert!(stats["next_due"].is_null(), "nothing delayed: {stats}");
    e.shutdown().await;
}

/// One slow flow with a backlog holds up no other flow: the executor's claims pass over the
/// ready items of a flow whose waves are all taken (SQLite and memory; Redis claims in
/// journal order within a shard).
async fn a_slow_flows_backlog_holds_up_no_other_flow(queue: &str) {
    let slow = Sink::start().await;
    slow.answer_after(2_000);
    let flows = [
        (
            "a.yaml",
            format!(
                "id: a\nconcurrency: 4\nnodes:\n  hook: {{ type: webhook, path: a, to: [call] }}\n  call: {{ type: http-request, url: \"{}\" }}\n",
                slow.url("a")
            ),
        ),
        (
            "b.yaml",
            "id: b\nnodes:\n  hook: { type: webhook, path: b, respond: wave, timeout: 5s, to: [r] }\n  r: { type: http-response, status: 200 }\n".to_string(),
        ),
    ];
    let flows: Vec<(&str, &str)> = flows.iter().map(|(n, f)| (*n, f.as_str())).collect();
    let e = start_exec(queue, test_exec(), &flows).await;
    let http = reqwest::Client::new();
    let url = format!("http://{}/hooks/a", e.addr);
    let posts = (0..1_000).map(|n| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            http.post(url)
                .json(&json!({ "n": n }))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    for s in futures::future::join_all(posts).await {
        assert_eq!(s, 202);
    }
    // `a` has a backlog of about a thousand, draining four at a time every two seconds.
    // Each of `b`'s requests is answered within its 5 s timeout (504 otherwise).
    for _ in 0..3 {
        let r = post_json(&e, "b", json!("hi")).await;
        assert_eq!(
            r.status(),
            200,
            "b answered, not held up behind a's backlog"
        );
    }
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_flow_holds_up_no_other_on_sqlite() {
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    a_slow_flows_backlog_holds_up_no_other_flow(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_flow_holds_up_no_other_on_memory() {
    a_slow_flows_backlog_holds_up_no_other_flow("memory").await;
}

/// A drop fails what waits on it: a `respond: wave` request waiting for an item cancelled by
/// hand hears so at once, and a run whose item was cancelled before it ran failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_cancelled_by_hand_answers_its_waiting_request_and_fails_its_run() {
    let flow = r#"
id: later
nodes:
  hook: { type: webhook, path: later, respond: wave, timeout: 20s, to: [wait] }
  go: { type: manual, to: [wait] }
  wait: { type: delay, for: 1h, to: [r] }
  r: { type: http-response, status: 200 }
"#;
    let e = weir_testkit::start(&[("later.yaml", flow)], weir::Failpoints::new()).await;
    let base = format!("http://{}", e.admin_addr);
    let url = format!("http://{}/hooks/later", e.addr);
    let waiting = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .json(&json!(1))
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap(),
        )
    });
    let delayed = weir_testkit::eventually("the delay's timer", Duration::from_secs(10), || {
        let e = &e;
        async move {
            let v = weir_testkit::get_json(e, "/api/queue?state=delayed").await;
            match v[0]["item"]["id"].as_str() {
                Some(id) => Ok(id.to_string()),
                None => Err(v),
            }
        }
    })
    .await;
    let http = reqwest::Client::new();
    let r = http
        .delete(format!("{base}/api/queue/{delayed}"))
        .header("x-weir-client", "test")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (status, body) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("answered at once, not at its 20 s timeout")
        .unwrap();
    assert_eq!(status, 409, "{body}");
    assert!(body["error"]
        .as_str()
        .unwrap()
        .contains("cancelled by hand"));

    // A run of a paused flow parks its first item; cancelled, the run failed.
    weir_testkit::post_admin(&e, "/api/flows/later/pause").await;
    let run = http
        .post(format!("{base}/api/flows/later/runs"))
        .json(&json!(2))
        .send()
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_string();
    weir_testkit::eventually("the run's item parked", Duration::from_secs(10), || {
        let e = &e;
        async move {
            match weir_testkit::get_json(e, "/api/stats").await["parked"].as_u64() {
                Some(1) => Ok(()),
                other => Err(other),
            }
        }
    })
    .await;
    let r = http
        .delete(format!("{base}/api/queue/{run}"))
        .header("x-weir-client", "test")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let rec = weir_testkit::get_json(&e, &format!("/api/runs/{run}")).await;
    assert_eq!(rec["status"], "failed", "{rec}");
    assert_eq!(rec["error"], "cancelled by hand", "{rec}");
    e.shutdown().await;
}
