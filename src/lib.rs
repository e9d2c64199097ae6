//! The weir test kit: start an engine on a free port, run an HTTP sink, wait for conditions.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::Value;
use weir::exec::ExecConfig;
use weir::{Engine, Failpoints, RunningEngine};

pub mod browser;
pub mod ceilings;
pub mod load;

/// Executor settings for tests: quick reclaim and retries, so redeliveries happen in seconds.
pub fn test_exec() -> ExecConfig {
    ExecConfig {
        reclaim_after: Duration::from_millis(800),
        retry_base: Duration::from_millis(100),
        retry_cap: Duration::from_secs(1),
        shutdown_grace: Duration::from_secs(5),
        // A call that hangs (a PUBACK lost with a broker restart) is retried in seconds.
        node_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Start an engine on 127.0.0.1 with a free port, on the memory queue.
pub async fn start(flows: &[(&str, &str)], fp: Failpoints) -> RunningEngine {
    start_on("memory", flows, fp).await
}

/// Start an engine on 127.0.0.1 with a free port, on the queue `url` names.
pub async fn start_on(url: &str, flows: &[(&str, &str)], fp: Failpoints) -> RunningEngine {
    start_with(url, None, flows, fp).await
}

/// Start an engine on 127.0.0.1 with a free port, on the queue `url` names, with executor
/// settings of the test's own (a short retention, a small in-flight bound…).
pub async fn start_exec(url: &str, exec: ExecConfig, flows: &[(&str, &str)]) -> RunningEngine {
    let mut b = Engine::builder()
        .queue_url(url)
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .exec_config(exec);
    for (name, src) in flows {
        b = b.flow_str(*name, *src);
    }
    b.build()
        .unwrap_or_else(|e| panic!("flows do not load:\n{e}"))
        .start()
        .await
        .expect("engine starts")
}

/// Start an engine on 127.0.0.1 with a free port, on the queue `url` names, with the MQTT
/// broker `mqtt`.
pub async fn start_with(
    url: &str,
    mqtt: Option<&str>,
    flows: &[(&str, &str)],
    fp: Failpoints,
) -> RunningEngine {
    let mut b = Engine::builder()
        .queue_url(url)
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .exec_config(test_exec())
        .failpoints(fp);
    if let Some(m) = mqtt {
        b = b.mqtt(m);
    }
    for (name, src) in flows {
        b = b.flow_str(*name, *src);
    }
    b.build()
        .unwrap_or_else(|e| panic!("flows do not load:\n{e}"))
        .start()
        .await
        .expect("engine starts")
}

/// What a sink received: when, at which path, what.
type Got = Arc<Mutex<Vec<(Instant, String, Value)>>>;

/// An HTTP server that records every JSON body POSTed to it, with when it arrived.
#[derive(Clone)]
pub struct Sink {
    pub addr: SocketAddr,
    got: Got,
    fail_with: Arc<Mutex<Vec<u16>>>,
    slow: Arc<std::sync::atomic::AtomicU64>,
}

impl Sink {
    pub async fn start() -> Sink {
        let got = Arc::new(Mutex::new(Vec::new()));
        let fail_with = Arc::new(Mutex::new(Vec::new()));
        let slow = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let state = (got.clone(), fail_with.clone(), slow.clone());
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
            slow,
        }
    }

    /// Take `ms` milliseconds over each answer (so that calls are in flight for a while).
    pub fn answer_after(&self, ms: u64) {
        self.slow.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}/{path}", self.addr)
    }

    /// The next answers will be these statuses (one each), before plain 200s again.
    pub fn fail_next(&self, statuses: &[u16]) {
        self.fail_with.lock().unwrap().extend_from_slice(statuses);
    }

    /// Field `n` of every body received, in order. Panics on a body without a whole `n`.
    pub fn ns(&self) -> Vec<u64> {
        self.bodies()
            .iter()
            .map(|b| {
                b["n"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("a body without `n`: {b}"))
            })
            .collect()
    }

    pub fn bodies(&self) -> Vec<Value> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .map(|(_, _, v)| v.clone())
            .collect()
    }

    pub fn received(&self) -> Vec<(Instant, Value)> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .map(|(t, _, v)| (*t, v.clone()))
            .collect()
    }

    /// What arrived at `path` (the part after the sink's address).
    pub fn received_at(&self, path: &str) -> Vec<(Instant, Value)> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p, _)| p == path)
            .map(|(t, _, v)| (*t, v.clone()))
            .collect()
    }

    pub fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }
}

type SinkState = (Got, Arc<Mutex<Vec<u16>>>, Arc<std::sync::atomic::AtomicU64>);

async fn record(
    State((got, fail, slow)): State<SinkState>,
    axum::extract::Path(path): axum::extract::Path<String>,
    Json(body): Json<Value>,
) -> (axum::http::StatusCode, Json<Value>) {
    let ms = slow.load(std::sync::atomic::Ordering::Relaxed);
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = {
        let mut f = fail.lock().unwrap();
        if f.is_empty() {
            200
        } else {
            f.remove(0)
        }
    };
    if status == 200 {
        got.lock().unwrap().push((Instant::now(), path, body));
    }
    (
        axum::http::StatusCode::from_u16(status).unwrap(),
        Json(serde_json::json!({"ok": status == 200})),
    )
}

/// An hourly schedule (`0 * * * *`) also fires for real at the top of the hour. A test of the
/// ticks missed while an engine was down waits here, when the next hour is less than `margin`
/// away, until it has passed: then the only ticks it sees are those it set up.
pub async fn clear_of_the_hour(margin: Duration) {
    const HOUR_MS: u128 = 3_600_000;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    let left = Duration::from_millis((HOUR_MS - now.as_millis() % HOUR_MS) as u64);
    if left < margin {
        tokio::time::sleep(left + Duration::from_secs(1)).await;
    }
}

/// Poll `probe` every 20 ms until it answers `Ok`, and return what it found; after `within`,
/// panic with `what` and the last thing it saw instead (its `Err`).
pub async fn eventually<T, E, Fut>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Fut,
) -> T
where
    E: std::fmt::Debug,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + within;
    loop {
        match probe().await {
            Ok(found) => return found,
            Err(seen) => assert!(
                Instant::now() < deadline,
                "timed out after {within:?} waiting for {what}; last seen: {seen:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    reqwest::get(format!("http://{}{path}", engine.admin_addr))
        .await
        .expect("engine answers")
        .json()
        .await
        .expect("JSON")
}

/// Wait until the engine lists at least `n` dead letters (newest first), or panic.
pub async fn wait_for_dead_letters(
    engine: &RunningEngine,
    n: usize,
    within: Duration,
) -> Vec<Value> {
    eventually(&format!("{n} dead letters"), within, || async move {
        let d = get_json(engine, "/api/dead-letters").await;
        match d.as_array() {
            Some(list) if list.len() >= n => Ok(list.clone()),
            _ => Err(d),
        }
    })
    .await
}

pub async fn post_admin(engine: &RunningEngine, path: &str) -> Value {
    reqwest::Client::new()
        .post(format!("http://{}{path}", engine.admin_addr))
        .header("x-weir-client", "test")
        .send()
        .await
        .expect("engine answers")
        .json()
        .await
        .expect("JSON")
}

/// `cargo build` for the `weir` binary, run from a test or a bench, in the environment a
/// shell would give it. Cargo sets the package's variables (`CARGO_PKG_NAME`,
/// `CARGO_MANIFEST_DIR`, …) for the test process it runs, and `ring`'s build script is run
/// again whenever one of them changes: a build inheriting them and one made from a shell
/// (`bash benches/run` starts with one) each made the other rebuild the release binary,
/// minutes of fat LTO each time.
fn cargo_build() -> std::process::Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = std::process::Command::new(cargo);
    c.args(["build", "-q", "-p", "weir", "--bin", "weir"]);
    for (k, _) in std::env::vars_os() {
        let set_for_the_test = k.to_str().is_some_and(|k| {
            k.starts_with("CARGO_PKG_")
                || matches!(
                    k,
                    "CARGO_MANIFEST_DIR"
                        | "CARGO_MANIFEST_PATH"
                        | "CARGO_CRATE_NAME"
                        | "CARGO_BIN_NAME"
                        | "CARGO_PRIMARY_PACKAGE"
                        | "CARGO_TARGET_TMPDIR"
                )
        });
        if set_for_the_test {
            c.env_remove(k);
        }
    }
    c
}

/// An HTTP client for a test's calls to an engine that give up after 10 s: an engine that
/// accepts a connection and never answers fails the test with the call's error, instead of
/// holding it until CI's own limit.
pub fn patient() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTP client")
}

/// The `weir` binary of these sources, brought up to date by cargo at the first call in a
/// test process; `WEIR_BIN` names another one to use instead (to measure two builds in turn
/// with a bench that runs one).
pub fn weir_bin() -> std::path::PathBuf {
    // Built (or found up to date) once per test process: a binary left from an earlier
    // build of other sources would be measured or tested in their place.
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("WEIR_BIN") {
            let bin = std::path::PathBuf::from(bin);
            assert!(bin.is_file(), "WEIR_BIN={} is not a file", bin.display());
            return bin;
        }
        let exe = std::env::current_exe().expect("test binary path");
        let dir = exe
            .parent()
            .and_then(|d| d.parent())
            .expect("target dir")
            .to_path_buf();
        // A benchmark runs from target/release: build the binary it measures the same way.
        let release = dir.ends_with("release");
        let status = cargo_build()
            .args(release.then_some("--release"))
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the weir binary failed");
        dir.join("weir")
    })
    .clone()
}

/// The release `weir` binary built with other features (`args`, say `["--no-default-features"]`
/// for the C library's malloc), in a target directory of its own (`target/build-…`), so that
/// the default binary beside it is left as it is. Cargo brings it up to date at each call;
/// the first is a cold build (minutes).
pub fn weir_bin_with(args: &[&str]) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("bench binary path");
    let target = exe
        .parent()
        .and_then(|d| d.parent())
        .and_then(|d| d.parent())
        .expect("target dir")
        .join(format!("build{}", args.concat().replace([',', ' '], "-")));
    let status = cargo_build()
        .arg("--release")
        .args(args)
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building weir with {args:?} failed");
    target.join("release").join("weir")
}

/// A `weir run` process this test owns, on a free port; killed by PID when dropped.
pub struct WeirProcess {
    pub base: String,
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl WeirProcess {
    /// `weir run FLOWS --queue QUEUE` with extra arguments; waits until it answers /healthz.
    pub async fn start(flows: &std::path::Path, queue: &str, extra: &[&str]) -> WeirProcess {
        Self::start_bin(&weir_bin(), flows, queue, extra).await
    }

    /// As [`WeirProcess::start`], with another build of `weir` (see [`weir_bin_with`]).
    pub async fn start_bin(
        bin: &std::path::Path,
        flows: &std::path::Path,
        queue: &str,
        extra: &[&str],
    ) -> WeirProcess {
        Self::start_under(bin, None, flows, queue, extra).await
    }

    /// As [`WeirProcess::start`], with at most `nofile` open files (`prlimit`), as on a
    /// machine whose limit is low.
    pub async fn start_limited(
        flows: &std::path::Path,
        queue: &str,
        extra: &[&str],
        nofile: u32,
    ) -> WeirProcess {
        Self::start_under(&weir_bin(), Some(nofile), flows, queue, extra).await
    }

    async fn start_under(
        bin: &std::path::Path,
        nofile: Option<u32>,
        flows: &std::path::Path,
        queue: &str,
        extra: &[&str],
    ) -> WeirProcess {
        // A port another test's process took between the probe and ours: another port.
        for _ in 0..5 {
            let port = weir_queue::testing::free_port();
            if let Some(p) = Self::try_start(bin, nofile, flows, queue, extra, port).await {
                return p;
            }
        }
        panic!("weir found each of five free ports taken before it could listen");
    }

    async fn try_start(
        bin: &std::path::Path,
        nofile: Option<u32>,
        flows: &std::path::Path,
        queue: &str,
        extra: &[&str],
        port: u16,
    ) -> Option<WeirProcess> {
        let log = std::env::temp_dir().join(format!("weir-test-{port}.log"));
        // prlimit sets the limit and then becomes the engine: the PID is the engine's.
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = std::process::Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg("--").arg(bin);
                c
            }
            None => std::process::Command::new(bin),
        };
        let child = cmd
            .arg("run")
            .arg(flows)
            .args(["--queue", queue, "--http", &format!("127.0.0.1:{port}")])
            .args(["--grace", "5"])
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("WEIR_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("weir starts");
        let mut p = WeirProcess {
            base: format!("http://127.0.0.1:{port}"),
            child,
            log: log.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let http = patient();
        loop {
            // Ours once its process listens on the port: an engine that merely answers
            // there may be another test's.
            if weir_queue::testing::listens_on(p.child.id(), port)
                && http.get(format!("{}/healthz", p.base)).send().await.is_ok()
            {
                return Some(p);
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.contains("cannot listen on") {
                    return None;
                }
                panic!("weir exited with {status} before it served; log:\n{text}");
            }
            assert!(
                Instant::now() < deadline,
                "weir did not come up; see {}",
                log.display()
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the engine has logged so far (stderr, at `WEIR_TEST_LOG` or warn).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, as a crash would; waits until the process is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit (code 0) within `within`.
    pub async fn stop(mut self, within: Duration) -> Option<i32> {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.code();
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        self.kill();
        None
    }

    pub async fn stats(&self) -> Value {
        patient()
            .get(format!("{}/api/stats", self.base))
            .send()
            .await
            .expect("engine answers")
            .json()
            .await
            .expect("JSON")
    }

    /// POST a JSON body to webhook `path`; the status and the answer's body.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        match reqwest::Client::new()
            .post(format!("{}/hooks/{path}", self.base))
            .json(body)
            .send()
            .await
        {
            Ok(r) => {
                let status = r.status().as_u16();
                (status, r.json().await.unwrap_or(Value::Null))
            }
            Err(_) => (0, Value::Null),
        }
    }
}

impl Drop for WeirProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A mosquitto broker this test owns, on a free loopback port, with persistence on and
/// `max_queued_messages` raised (the stock 1000 silently drops QoS 1 messages for a client
/// that is away); stopped by PID when dropped.
pub struct Mosquitto {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
}

impl Mosquitto {
    pub fn start() -> Mosquitto {
        Self::start_with("")
    }

    /// On a port chosen by the test.
    pub fn start_on(port: u16) -> Mosquitto {
        Self::start_at(port, "")
    }

    /// With more configuration lines (another listener, say) after weir's test settings.
    pub fn start_with(extra: &str) -> Mosquitto {
        // A port another test's broker took between the probe and ours: another port.
        let mut last = String::new();
        for _ in 0..5 {
            match Self::try_start_at(weir_queue::testing::free_port(), extra) {
                Ok(m) => return m,
                Err(log) => last = log,
            }
        }
        panic!(
            "mosquitto listened on none of five free ports (each taken, or it failed to start); \
             its log ends:\n{last}"
        );
    }

    fn start_at(port: u16, extra: &str) -> Mosquitto {
        Self::try_start_at(port, extra).unwrap_or_else(|log| {
            panic!("mosquitto could not listen on port {port}; its log ends:\n{log}")
        })
    }

    /// The broker on `port`, or the end of its log when it did not listen there.
    fn try_start_at(port: u16, extra: &str) -> Result<Mosquitto, String> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let conf = format!(
            // `user root`: started as root, mosquitto would otherwise switch to the user
            // `mosquitto`, which cannot write the test's directory — no persistence file (a
            // restart would forget every session) and no log.
            "user root\nper_listener_settings false\nallow_anonymous true\npersistence true\n\
             persistence_location {dir}/\nautosave_interval 1\nmax_queued_messages 1000000\n\
             max_inflight_messages 20\nlog_dest file {dir}/mosquitto.log\n\
             listener {port} 127.0.0.1\n{extra}\n",
            dir = dir.path().display()
        );
        std::fs::write(dir.path().join("mosquitto.conf"), conf).expect("write the config");
        let mut m = Mosquitto {
            port,
            dir,
            child: None,
        };
        if m.spawn() {
            Ok(m)
        } else {
            Err(m.log_tail(20))
        }
    }

    /// The broker's process id (for a benchmark reading its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// The `broker` label an engine puts on its MQTT metrics for this broker.
    pub fn label(&self) -> String {
        broker_label(self.port)
    }

    /// Start it again (same port, same persistence file) after [`stop`](Self::stop).
    pub fn restart(&mut self) {
        assert!(
            self.spawn(),
            "mosquitto could not listen on port {} again (taken by another process, or it failed to start); see {}",
            self.port,
            self.dir.path().join("mosquitto.log").display()
        );
    }

    /// Start the broker on `self.port`; false when another process holds that port.
    fn spawn(&mut self) -> bool {
        assert!(self.child.is_none(), "mosquitto is already running");
        let child = std::process::Command::new("mosquitto")
            .arg("-c")
            .arg(self.dir.path().join("mosquitto.conf"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(weir_queue::testing::append_to(
                &self.dir.path().join("mosquitto.log"),
            ))
            .spawn()
            .expect("mosquitto starts (install it: apt-get install mosquitto)");
        // Ours once its process listens on the port: a broker that merely answers there may
        // be another test's.
        self.child = weir_queue::testing::listening(child, self.port, Duration::from_secs(10));
        self.child.is_some()
    }

    /// The broker's whole log, across its restarts.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("mosquitto.log")).unwrap_or_default()
    }

    /// The last `n` lines of the broker's log (for a test's failure message).
    pub fn log_tail(&self, n: usize) -> String {
        weir_queue::testing::file_tail(&self.dir.path().join("mosquitto.log"), n)
    }

    /// SIGTERM (mosquitto saves its sessions and queued messages) and wait for the exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A test's own MQTT client (a device, an observer): polls in the background, acks what it
/// receives, and keeps it; reconnects by itself.
/// What a peer received: (topic, payload, when).
type Received = Arc<Mutex<Vec<(String, Vec<u8>, Instant)>>>;

pub struct MqttPeer {
    pub client: rumqttc::AsyncClient,
    got: Received,
    task: tokio::task::JoinHandle<()>,
}

impl MqttPeer {
    /// Publish `{"n": N}` for each N of `range` as QoS 1 on `sensors/dK/reading`, K = N mod
    /// `devices`.
    pub async fn publish_numbers(&self, range: std::ops::Range<u64>, devices: u64) {
        for n in range {
            self.client
                .publish(
                    format!("sensors/d{}/reading", n % devices),
                    rumqttc::QoS::AtLeastOnce,
                    false,
                    serde_json::to_vec(&serde_json::json!({ "n": n })).unwrap(),
                )
                .await
                .unwrap();
        }
    }

    /// Publish `payload` (not JSON, so that counts of numbers pass it by) on `topic` every
    /// 200 ms until `observer` has received it back, through the engine, for up to 10 s.
    /// An engine subscribes after it has started, and what the broker gets before that is
    /// not the engine's to keep: a test that counts every message waits for this first.
    pub async fn until_routed(&self, topic: &str, payload: &str, observer: &MqttPeer) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let back = || {
            observer
                .received()
                .iter()
                .any(|(_, p)| p == payload.as_bytes())
        };
        while !back() {
            assert!(
                Instant::now() < deadline,
                "nothing published on {topic} came back through the engine within 10 s"
            );
            self.client
                .publish(topic, rumqttc::QoS::AtLeastOnce, false, payload)
                .await
                .unwrap();
            let wait = Instant::now() + Duration::from_millis(200);
            while !back() && Instant::now() < wait {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    /// Connect as `id` (a persistent session) and subscribe to `filter` if given; returns
    /// once the subscription is acknowledged. At most 20 of its publishes are in flight.
    pub async fn connect(port: u16, id: &str, filter: Option<&str>) -> MqttPeer {
        Self::connect_with(port, id, filter, 20).await
    }

    /// As [`MqttPeer::connect`], with at most `inflight` of its publishes in flight.
    pub async fn connect_with(
        port: u16,
        id: &str,
        filter: Option<&str>,
        inflight: u16,
    ) -> MqttPeer {
        let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
        o.set_clean_session(false)
            .set_keep_alive(Duration::from_secs(30))
            // Room to publish a message larger than an engine takes (its default is 1 MiB).
            .set_max_packet_size(4 << 20, 4 << 20)
            .set_request_channel_capacity(10_000)
            .set_inflight(inflight);
        let (client, mut events) = rumqttc::AsyncClient::new(o, 10_000);
        let got: Received = Arc::default();
        let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
        let mut subscribed_tx = Some(subscribed_tx);
        let (g, c, f) = (got.clone(), client.clone(), filter.map(str::to_string));
        let task = tokio::spawn(async move {
            loop {
                match events.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) => {
                        if let Some(f) = &f {
                            let _ = c.subscribe(f.as_str(), rumqttc::QoS::AtLeastOnce).await;
                        } else if let Some(tx) = subscribed_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => {
                        if let Some(tx) = subscribed_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                        g.lock().unwrap().push((
                            p.topic.clone(),
                            p.payload.to_vec(),
                            Instant::now(),
                        ));
                    }
                    Ok(_) => {}
                    Err(rumqttc::ConnectionError::RequestsDone) => return,
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(10), subscribed)
            .await
            .expect("the test's MQTT client connects")
            .ok();
        MqttPeer { client, got, task }
    }

    /// Everything received so far: (topic, payload).
    pub fn received(&self) -> Vec<(String, Vec<u8>)> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .map(|(t, p, _)| (t.clone(), p.clone()))
            .collect()
    }

    /// Payloads with the moment each arrived.
    pub fn arrivals(&self) -> Vec<(Instant, Vec<u8>)> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .map(|(_, p, at)| (*at, p.clone()))
            .collect()
    }

    pub fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }

    /// Received payloads that are JSON, parsed.
    pub fn json(&self) -> Vec<Value> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(_, p, _)| serde_json::from_slice(p).ok())
            .collect()
    }
}

impl Drop for MqttPeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The `broker` label an engine puts on its MQTT metrics for a broker on this machine's
/// `port` (also before anything listens there).
pub fn broker_label(port: u16) -> String {
    format!("broker=\"mqtt://127.0.0.1:{port}\"")
}

/// Wait, for up to 10 s, until the engine at `base` holds `n` MQTT subscriptions its brokers
/// have acknowledged (`weir_mqtt_subscribed`) among the series whose labels contain every one
/// of `labels` (say the broker's `broker="mqtt://127.0.0.1:PORT"`: one process may run the
/// engines of several tests). What a broker gets before then is not the engine's to keep.
/// With `n` 0: until the engine has seen its subscriptions gone.
pub async fn until_subscribed(base: &str, labels: &[&str], n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = metric_sum(base, "weir_mqtt_subscribed", labels).await;
        if now == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{now} of {n} MQTT subscriptions acknowledged after 10 s ({labels:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The sum of a Prometheus counter's series at `base/metrics` whose labels contain every one
/// of `labels`.
pub async fn metric_sum(base: &str, name: &str, labels: &[&str]) -> u64 {
    metric_sum_f64(base, name, labels).await as u64
}

/// As [`metric_sum`], unrounded: for sums of seconds (a histogram's `_sum`).
pub async fn metric_sum_f64(base: &str, name: &str, labels: &[&str]) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
}
