//! A small HTTP load generator for the benchmarks: `connections` keep-alive HTTP/1.1
//! connections, each sending one request after the other for a fixed time, with every
//! answer's latency and status kept. Written on hyper's client connection directly, so the
//! generator costs little of the two cores it shares with the engine.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;

/// What a load run saw.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub elapsed: Duration,
    /// Answers by status code.
    pub statuses: BTreeMap<u16, u64>,
    /// Latency of every answer, sorted.
    pub latencies: Vec<Duration>,
    /// Requests that got no answer (connection errors).
    pub errors: u64,
    /// The bodies of the 2xx answers, when asked to keep them.
    pub bodies: Vec<Bytes>,
}

impl LoadReport {
    pub fn answered(&self) -> u64 {
        self.statuses.values().sum()
    }
    pub fn ok(&self) -> u64 {
        self.statuses
            .iter()
            .filter(|(s, _)| (200..300).contains(*s))
            .map(|(_, n)| n)
            .sum()
    }
    pub fn rate(&self) -> f64 {
        self.answered() as f64 / self.elapsed.as_secs_f64()
    }
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() as f64 * p).ceil() as usize).clamp(1, self.latencies.len());
        self.latencies[i - 1]
    }
}

/// What to send.
#[derive(Clone)]
pub struct LoadSpec {
    pub addr: std::net::SocketAddr,
    /// The request path, with `{n}` replaced by a running number (to spread over paths).
    pub path: String,
    /// How many distinct `{n}` values (paths) to cycle through.
    pub paths: usize,
    pub body: Bytes,
    pub connections: usize,
    pub duration: Duration,
    /// Stop after this many requests in all, if sooner.
    pub max_requests: Option<u64>,
    pub keep_bodies: bool,
}

/// Run the load; every connection sends until the time (or the request budget) is up.
pub async fn run(spec: LoadSpec) -> LoadReport {
    let budget = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
        spec.max_requests.unwrap_or(u64::MAX),
    ));
    let start = Instant::now();
    let deadline = start + spec.duration;
    let mut tasks = Vec::new();
    for c in 0..spec.connections {
        let spec = spec.clone();
        let budget = budget.clone();
        tasks.push(tokio::spawn(async move {
            connection(spec, c, deadline, budget).await
        }));
    }
    let mut report = LoadReport::default();
    for t in tasks {
        let r = t.await.expect("load task");
        for (s, n) in r.statuses {
            *report.statuses.entry(s).or_default() += n;
        }
        report.latencies.extend(r.latencies);
        report.errors += r.errors;
        report.bodies.extend(r.bodies);
    }
    report.elapsed = start.elapsed();
    report.latencies.sort_unstable();
    report
}

async fn connection(
    spec: LoadSpec,
    index: usize,
    deadline: Instant,
    budget: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> LoadReport {
    let mut r = LoadReport::default();
    let mut n = index;
    'outer: while Instant::now() < deadline {
        let Ok(stream) = tokio::net::TcpStream::connect(spec.addr).await else {
            r.errors += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let Ok((mut send, conn)) = http1::handshake(TokioIo::new(stream)).await else {
            r.errors += 1;
            continue;
        };
        let driver = tokio::spawn(conn);
        while Instant::now() < deadline {
            if budget
                .fetch_update(
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                    |b| b.checked_sub(1),
                )
                .is_err()
            {
                break 'outer;
            }
            let path = spec
                .path
                .replace("{n}", &(n % spec.paths.max(1)).to_string());
            n += spec.connections;
            let req = hyper::Request::post(path)
                .header("host", "bench")
                .header("content-type", "application/json")
                .body(Full::new(spec.body.clone()))
                .expect("request");
            let t0 = Instant::now();
            let answer = async {
                let resp = send.send_request(req).await?;
                let status = resp.status().as_u16();
                let body = resp.into_body().collect().await?.to_bytes();
                Ok::<_, hyper::Error>((status, body))
            }
            .await;
            match answer {
                Ok((status, body)) => {
                    r.latencies.push(t0.elapsed());
                    *r.statuses.entry(status).or_default() += 1;
                    if spec.keep_bodies && (200..300).contains(&status) {
                        r.bodies.push(body);
                    }
                }
                Err(_) => {
                    r.errors += 1;
                    break;
                }
            }
        }
        driver.abort();
    }
    r
}

/// A flow for the accepted-then-run benchmarks: webhook `path` (202) → function → log.
pub fn accept_flow(id: &str, path: &str) -> String {
    accept_chain(id, path, 1)
}

/// Webhook `path` (202) → `functions` function nodes in a row (at least one) → log: what
/// a wave costs per node it runs.
pub fn accept_chain(id: &str, path: &str, functions: usize) -> String {
    let name = |i: usize| match i {
        1 => "shape".to_string(),
        i => format!("shape{i}"),
    };
    let functions = functions.max(1);
    let mut yaml = format!(
        "\nid: {id}\nnodes:\n  hook: {{ type: webhook, path: {path}, to: [{}] }}\n",
        name(1)
    );
    for i in 1..=functions {
        let next = if i == functions {
            "log".into()
        } else {
            name(i + 1)
        };
        yaml.push_str(&format!(
            "  {}:\n    type: function\n    script: |\n      msg.payload.seen = true;\n      msg\n    to: [{next}]\n",
            name(i)
        ));
    }
    yaml.push_str("  log: { type: log, level: debug }\n");
    yaml
}

/// The length of each benchmark load: `WEIR_BENCH_SECS`, default 8 s.
pub fn bench_secs() -> Duration {
    let s: f64 = std::env::var("WEIR_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8.0);
    Duration::from_secs_f64(s)
}
