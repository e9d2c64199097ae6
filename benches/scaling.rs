//! Scaling out on one Redis (issue 9): throughput of one, two and three `weir` engines
//! sharing one queue, each figure beside the bare Redis Streams loop measured on the same
//! server in the same run, and the scaling ratio against one engine.
//!
//! The flow is webhook (202) → function → log. The load (16 keep-alive connections in all)
//! is split over the engines' webhooks; any engine may run any event. Each run checks that
//! the events the engines ran equal the events they accepted. Redis runs with
//! `appendonly yes`, `appendfsync always` (weir's recommended settings).
//! Run: `cargo bench --bench scaling` (`WEIR_BENCH_SECS` sets the length of each load,
//! default 8 s). On a machine with few cores the engines, Redis and the load generator share
//! them: the ratio then says what one more engine buys on this machine, not on one machine
//! each.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use weir_queue::testing::RedisServer;
use weir_testkit::ceilings::{cpu_time, redis_streams_loop};
use weir_testkit::load::{self, LoadSpec};
use weir_testkit::{metric_sum, WeirProcess};

const CONNECTIONS: usize = 16;

const FLOW: &str = r#"
id: bench-accept
nodes:
  hook: { type: webhook, path: bench-accept, to: [shape] }
  shape:
    type: function
    script: |
      msg.payload.seen = true;
      msg
    to: [log]
  log: { type: log, level: debug }
"#;

fn secs() -> Duration {
    let s: f64 = std::env::var("WEIR_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8.0);
    Duration::from_secs_f64(s)
}

struct Run {
    engines: usize,
    accepted: f64,
    end_to_end: f64,
    ran_by: Vec<u64>,
    cpu: Vec<f64>,
    redis_cpu: f64,
}

async fn run(engines: usize, duration: Duration, redis: &RedisServer, redis_pid: u32) -> Run {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bench.yaml"), FLOW).unwrap();
    let mut ps = Vec::new();
    for _ in 0..engines {
        ps.push(WeirProcess::start(dir.path(), &redis.url(), &[]).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let spec = |p: &WeirProcess, i: usize, d: Duration| LoadSpec {
        addr: p
            .base
            .trim_start_matches("http://")
            .parse::<SocketAddr>()
            .unwrap(),
        path: "/hooks/bench-accept".into(),
        paths: 1,
        body: Bytes::from_static(br#"{"temperature":21.5,"room":"kitchen"}"#),
        // 16 in all, split as evenly as they go.
        connections: CONNECTIONS / engines + usize::from(i < CONNECTIONS % engines),
        duration: d,
        max_requests: None,
        keep_bodies: false,
    };
    // Warm up, then measure.
    let warm: u64 = futures::future::join_all(
        ps.iter()
            .enumerate()
            .map(|(i, p)| load::run(spec(p, i, Duration::from_secs(1)))),
    )
    .await
    .iter()
    .map(|r| r.ok())
    .sum();
    let cpu0: Vec<Duration> = ps.iter().map(|p| cpu_time(p.pid())).collect();
    let rcpu0 = cpu_time(redis_pid);
    let t0 = Instant::now();
    let reports = futures::future::join_all(
        ps.iter()
            .enumerate()
            .map(|(i, p)| load::run(spec(p, i, duration))),
    )
    .await;
    let accepted: u64 = reports.iter().map(|r| r.ok()).sum();
    let accept_secs = t0.elapsed().as_secs_f64();
    // Until every engine has nothing ready or in flight (one queue: any engine's view).
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let s = ps[0].stats().await;
        if s["ready"] == 0 && s["in_flight"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the queue did not drain: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all = t0.elapsed().as_secs_f64();
    let cpu: Vec<f64> = ps
        .iter()
        .zip(cpu0)
        .map(|(p, c)| (cpu_time(p.pid()) - c).as_secs_f64() / all)
        .collect();
    let redis_cpu = (cpu_time(redis_pid) - rcpu0).as_secs_f64() / all;
    let mut ran_by = Vec::new();
    for p in &ps {
        ran_by.push(
            metric_sum(
                &p.base,
                "weir_items_ended_total",
                &["flow=\"bench-accept\""],
            )
            .await,
        );
    }
    assert_eq!(
        ran_by.iter().sum::<u64>(),
        warm + accepted,
        "every accepted event was journaled and run once, by one engine or another"
    );
    for p in ps {
        p.stop(Duration::from_secs(20)).await;
    }
    Run {
        engines,
        accepted: accepted as f64 / accept_secs,
        end_to_end: accepted as f64 / all,
        ran_by,
        cpu,
        redis_cpu,
    }
}

async fn bench() {
    let duration = secs();
    let redis = RedisServer::start();
    let redis_pid = redis.pid().expect("the bench's redis-server runs");
    println!(
        "redis: appendonly yes, appendfsync always (the server this bench starts, pid {redis_pid})"
    );
    println!(
        "load: {CONNECTIONS} keep-alive connections split over the engines, {duration:?} per run, on {} cores shared by everything",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    let before = redis_streams_loop(&redis.url(), 256, 200).await;
    let mut runs = Vec::new();
    for n in 1..=3 {
        let r = run(n, duration, &redis, redis_pid).await;
        println!(
            "{n} engine(s): {:.0} events/s accepted, {:.0}/s end to end; ran by engine {:?}; CPU per engine {:?}, redis-server {:.2}",
            r.accepted,
            r.end_to_end,
            r.ran_by,
            r.cpu.iter().map(|c| format!("{c:.2}")).collect::<Vec<_>>(),
            r.redis_cpu
        );
        runs.push(r);
    }
    let ceiling = before.max(redis_streams_loop(&redis.url(), 256, 200).await);
    println!("\n--- scaling on one Redis, beside the ceiling measured in this run ---");
    let one = runs[0].end_to_end;
    for r in &runs {
        println!(
            "{} engine(s): {:>6.0} events/s end to end ({:>6.0}/s accepted) | scaling vs 1 engine {:.2} | bare XADD+XREADGROUP+XACK (256 a round) {:.0}/s, ratio {:.2} | redis-server CPU {:.2} cores",
            r.engines,
            r.end_to_end,
            r.accepted,
            r.end_to_end / one,
            ceiling,
            r.end_to_end / ceiling,
            r.redis_cpu
        );
    }
}

fn main() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
}
