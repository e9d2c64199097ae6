//! The weir test kit: start an engine on a free port, run an HTTP sink, wait for conditions.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::Value;
use weir::weir_exec::ExecConfig;
use weir::{Engine, Failpoints, RunningEngine};

/// Executor settings for tests: quick reclaim and retries, so redeliveries happen in seconds.
pub fn test_exec() -> ExecConfig {
    ExecConfig {
        reclaim_after: Duration::from_millis(800),
        retry_base: Duration::from_millis(100),
        retry_cap: Duration::from_secs(1),
        shutdown_grace: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Start an engine on 127.0.0.1 with a free port, on the memory queue.
pub async fn start(flows: &[(&str, &str)], fp: Failpoints) -> RunningEngine {
    start_on("memory", flows, fp).await
}

/// Start an engine on 127.0.0.1 with a free port, on the queue `url` names.
pub async fn start_on(url: &str, flows: &[(&str, &str)], fp: Failpoints) -> RunningEngine {
    let mut b = Engine::builder()
        .queue_url(url)
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .exec_config(test_exec())
        .failpoints(fp);
    for (name, src) in flows {
        b = b.flow_str(*name, *src);
    }
    b.build()
        .unwrap_or_else(|e| panic!("flows do not load:\n{e}"))
        .start()
        .await
        .expect("engine starts")
}

/// An HTTP server that records every JSON body POSTed to it, with when it arrived.
#[derive(Clone)]
pub struct Sink {
    pub addr: SocketAddr,
    got: Arc<Mutex<Vec<(Instant, Value)>>>,
    fail_with: Arc<Mutex<Vec<u16>>>,
}

impl Sink {
    pub async fn start() -> Sink {
        let got = Arc::new(Mutex::new(Vec::new()));
        let fail_with = Arc::new(Mutex::new(Vec::new()));
        let state = (got.clone(), fail_with.clone());
        let app = Router::new()
            .route("/{*path}", post(record))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind sink");
        let addr = listener.local_addr().expect("sink addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        Sink {
            addr,
            got,
            fail_with,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}/{path}", self.addr)
    }

    /// The next answers will be these statuses (one each), before plain 200s again.
    pub fn fail_next(&self, statuses: &[u16]) {
        self.fail_with.lock().unwrap().extend_from_slice(statuses);
    }

    pub fn bodies(&self) -> Vec<Value> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .map(|(_, v)| v.clone())
            .collect()
    }

    pub fn received(&self) -> Vec<(Instant, Value)> {
        self.got.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }
}

type SinkState = (Arc<Mutex<Vec<(Instant, Value)>>>, Arc<Mutex<Vec<u16>>>);

async fn record(
    State((got, fail)): State<SinkState>,
    Json(body): Json<Value>,
) -> (axum::http::StatusCode, Json<Value>) {
    let status = {
        let mut f = fail.lock().unwrap();
        if f.is_empty() {
            200
        } else {
            f.remove(0)
        }
    };
    if status == 200 {
        got.lock().unwrap().push((Instant::now(), body));
    }
    (
        axum::http::StatusCode::from_u16(status).unwrap(),
        Json(serde_json::json!({"ok": status == 200})),
    )
}

/// Wait until `cond` holds, polling, or panic with `what` after `within`.
pub async fn wait_for<F: FnMut() -> bool>(what: &str, within: Duration, mut cond: F) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(cond(), "timed out after {within:?} waiting for: {what}");
}

/// POST JSON to the engine's webhook `path`.
pub async fn post_json(engine: &RunningEngine, path: &str, body: Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("http://{}/hooks/{path}", engine.addr))
        .json(&body)
        .send()
        .await
        .expect("engine answers")
}

/// GET an admin path as JSON.
pub async fn get_json(engine: &RunningEngine, path: &str) -> Value {
    reqwest::get(format!("http://{}{path}", engine.addr))
        .await
        .expect("engine answers")
        .json()
        .await
        .expect("JSON")
}

pub async fn post_admin(engine: &RunningEngine, path: &str) -> Value {
    reqwest::Client::new()
        .post(format!("http://{}{path}", engine.addr))
        .send()
        .await
        .expect("engine answers")
        .json()
        .await
        .expect("JSON")
}

/// The `weir` binary of this build (built on demand when a test runs alone).
pub fn weir_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .to_path_buf();
    let bin = dir.join("weir");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args(["build", "-q", "-p", "weir", "--bin", "weir"])
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the weir binary failed");
    }
    bin
}
