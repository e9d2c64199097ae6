//! Runs (DESIGN §8): start a flow by hand, follow it to the end, read its outputs — also
//! after a restart, and from the CLI.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use weir::Failpoints;
use weir_testkit::{get_json, start_on, WeirProcess};

const FLOW: &str = r#"
id: calc
nodes:
  start: { type: manual, to: [double] }
  double:
    type: function
    script: |
      if msg.payload.n == 13 { throw "unlucky"; }
      msg.payload = #{ n: msg.payload.n * 2 };
      msg
    to: [now, later]
  now: { type: log }
  later: { type: delay, for: 300ms, to: [done] }
  done: { type: set, set: { payload.late: true } }
"#;

async fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn wait_run(base: &str, run: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rec: Value = reqwest::get(format!("{base}/api/runs/{run}"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if rec["status"] == "done" || rec["status"] == "failed" {
            return rec;
        }
        assert!(Instant::now() < deadline, "the run never ended: {rec}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_done_when_everything_it_started_is_and_its_record_survives_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_on(&queue, &[("calc.yaml", FLOW)], Failpoints::new()).await;
    let base = format!("http://{}", e.admin_addr);
    let (status, body) = post(&base, "/api/flows/calc/runs", json!({ "n": 21 })).await;
    assert_eq!(status, 202, "{body}");
    let run = body["run_id"].as_str().unwrap().to_string();
    let first: Value = get_json(&e, &format!("/api/runs/{run}")).await;
    assert!(
        ["queued", "running"].contains(&first["status"].as_str().unwrap()),
        "{first}"
    );
    let t = Instant::now();
    let rec = wait_run(&base, &run).await;
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "done only after the delayed branch too"
    );
    assert_eq!(rec["status"], "done", "{rec}");
    let outputs = rec["outputs"].as_array().unwrap();
    assert_eq!(outputs.len(), 2, "one per leaf reached: {rec}");
    assert_eq!(
        outputs[0]["payload"],
        json!({ "n": 42 }),
        "the immediate branch first: what the log passed on"
    );
    assert_eq!(
        outputs[1]["payload"],
        json!({ "n": 42, "late": true }),
        "then what the delayed branch's last node made of it"
    );
    e.shutdown().await;

    // Run records are durable: a new engine on the same queue still answers for it.
    let e = start_on(&queue, &[("calc.yaml", FLOW)], Failpoints::new()).await;
    let again = get_json(&e, &format!("/api/runs/{run}")).await;
    assert_eq!(again["status"], "done");
    assert_eq!(again["outputs"], rec["outputs"]);
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_run_says_why_and_a_flow_without_manual_refuses_runs() {
    let hook = "nodes:\n  h: { type: webhook, path: x, to: [l] }\n  l: { type: log }\n";
    let e = start_on(
        "memory",
        &[("calc.yaml", FLOW), ("hook.yaml", hook)],
        Failpoints::new(),
    )
    .await;
    let base = format!("http://{}", e.admin_addr);
    let (_, body) = post(&base, "/api/flows/calc/runs", json!({ "n": 13 })).await;
    let rec = wait_run(&base, body["run_id"].as_str().unwrap()).await;
    assert_eq!(rec["status"], "failed", "{rec}");
    assert!(rec["error"].as_str().unwrap().contains("unlucky"), "{rec}");
    let (status, body) = post(&base, "/api/flows/hook/runs", json!(1)).await;
    assert_eq!(status, 400);
    assert!(
        body["error"].as_str().unwrap().contains("no `manual` node"),
        "{body}"
    );
    let (status, _) = post(&base, "/api/flows/nope/runs", json!(1)).await;
    assert_eq!(status, 404);
    let missing = reqwest::get(format!("{base}/api/runs/{}", ulid::Ulid::new()))
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_run_flow_waits_and_prints_the_outputs() {
    let flows = tempfile::tempdir().unwrap();
    std::fs::write(flows.path().join("calc.yaml"), FLOW).unwrap();
    let e = WeirProcess::start(flows.path(), "memory", &[]).await;
    let out = std::process::Command::new(weir_testkit::weir_bin())
        .args([
            "run-flow",
            "calc",
            "--input",
            r#"{"n": 5}"#,
            "--wait",
            "--api",
            &e.base,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(" done"), "{text}");
    assert!(text.contains(r#""n":10"#), "{text}");
    let failed = std::process::Command::new(weir_testkit::weir_bin())
        .args([
            "run-flow",
            "calc",
            "--input",
            r#"{"n": 13}"#,
            "--wait",
            "--api",
            &e.base,
        ])
        .output()
        .unwrap();
    assert_eq!(failed.status.code(), Some(1), "a failed run exits 1");
    e.stop(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_outputs_are_what_its_last_nodes_made() {
    let flow = r#"
id: shape
nodes:
  start: { type: manual, to: [square] }
  square:
    type: function
    script: |
      msg.payload = msg.payload * msg.payload;
      msg
"#;
    let e = start_on("memory", &[("shape.yaml", flow)], Failpoints::new()).await;
    let base = format!("http://{}", e.admin_addr);
    let (status, body) = post(&base, "/api/flows/shape/runs", json!(7)).await;
    assert_eq!(status, 202, "{body}");
    let rec = wait_run(&base, body["run_id"].as_str().unwrap()).await;
    assert_eq!(rec["status"], "done", "{rec}");
    assert_eq!(
        rec["outputs"],
        json!([{ "payload": 49 }]),
        "the function's result, not its input"
    );
    e.shutdown().await;
}
