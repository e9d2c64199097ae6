//! Scaling out on one Redis (issue 9): throughput of one, two and three `weir` engines
//! sharing one queue, each figure beside the bare Redis Streams loop measured on the same
//! server in the same run, and the scaling ratio against one engine.
//!
//! Six flows, each webhook (202) → function → log. The load (16 keep-alive connections in
//! all) is split over the engines' webhooks and the flows; any engine may run any event. A
//! last run puts three engines on a three-node Redis Cluster with the flows in 8 shards. Each run checks that
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
use weir_testkit::load::{self, accept_flow, bench_secs, LoadSpec};
use weir_testkit::{metric_sum, WeirProcess};

const CONNECTIONS: usize = 16;

/// Flows in the bench: the load is spread over their webhooks (`/hooks/bench-N`).
const FLOWS: usize = 6;

fn flow(i: usize) -> String {
    accept_flow(&format!("bench-{i}"), &format!("bench-{i}"))
}

struct Run {
    engines: usize,
    on: &'static str,
    accepted: f64,
    end_to_end: f64,
    ran_by: Vec<u64>,
    cpu: Vec<f64>,
    redis_cpu: f64,
}

/// `engines` engines on the queue `url`; `servers` are the Redis processes (for their CPU).
async fn run(engines: usize, duration: Duration, url: &str, servers: &[u32]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..FLOWS {
        std::fs::write(dir.path().join(format!("bench-{i}.yaml")), flow(i)).unwrap();
    }
    let mut ps = Vec::new();
    for _ in 0..engines {
        ps.push(WeirProcess::start(dir.path(), url, &[]).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let spec = |p: &WeirProcess, i: usize, d: Duration| LoadSpec {
        addr: p
            .base
            .trim_start_matches("http://")
            .parse::<SocketAddr>()
            .unwrap(),
        path: "/hooks/bench-{n}".into(),
        paths: FLOWS,
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
    let server_cpu = || servers.iter().map(|p| cpu_time(*p)).sum::<Duration>();
    let rcpu0 = server_cpu();
    let t0 = Instant::now();
    let reports = futures::future::join_all(
        ps.iter()
            .enumerate()
            .map(|(i, p)| load::run(spec(p, i, duration))),
    )
    .await;
    let accepted: u64 = reports.iter().map(|r| r.ok()).sum();
    // Requests that got no answer (a connection cut): the engine may have journaled them.
    let unanswered: u64 = reports.iter().map(|r| r.errors).sum();
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
    let redis_cpu = (server_cpu() - rcpu0).as_secs_f64() / all;
    // An engine counts a wave once its commit is answered, a moment after the queue shows
    // the item ended: give the count a few seconds to catch up (the drain said every item
    // ended; a count still short after that is an event lost).
    let settle = Instant::now() + Duration::from_secs(5);
    let ran_by = loop {
        let mut ran_by = Vec::new();
        for p in &ps {
            ran_by.push(metric_sum(&p.base, "weir_items_ended_total", &["flow=\"bench-"]).await);
        }
        if ran_by.iter().sum::<u64>() >= warm + accepted || Instant::now() > settle {
            break ran_by;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let statuses: Vec<_> = reports.iter().map(|r| &r.statuses).collect();
    assert_eq!(
        ran_by.iter().sum::<u64>(),
        warm + accepted,
        "every accepted event was journaled and run once, by one engine or another (ran by \
         engine {ran_by:?}; accepted {warm} warming up and {accepted} after; answers by \
         status {statuses:?}; {unanswered} requests got no answer)"
    );
    for p in ps {
        p.stop(Duration::from_secs(20)).await;
    }
    Run {
        engines,
        on: "",
        accepted: accepted as f64 / accept_secs,
        end_to_end: accepted as f64 / all,
        ran_by,
        cpu,
        redis_cpu,
    }
}

async fn bench() {
    let duration = bench_secs();
    let redis = RedisServer::start();
    let redis_pid = redis.pid().expect("the bench's redis-server runs");
    println!("redis: appendonly yes, appendfsync always (the servers this bench starts)");
    println!(
        "load: {CONNECTIONS} keep-alive connections split over the engines and over {FLOWS} flows, {duration:?} per run, on {} cores shared by everything",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    let before = redis_streams_loop(&redis.url(), 256, 200).await;
    let mut runs = Vec::new();
    for n in 1..=3 {
        let mut r = run(n, duration, &redis.url(), &[redis_pid]).await;
        r.on = "one redis-server";
        runs.push(r);
    }
    let ceiling = before.max(redis_streams_loop(&redis.url(), 256, 200).await);
    drop(redis);
    // The same three engines on a three-node Redis Cluster, the flows spread over 8 shards.
    let cluster = weir_queue::testing::RedisCluster::start();
    let url = format!("{}?shards=8", cluster.url());
    let mut r = run(3, duration, &url, &cluster.pids()).await;
    r.on = "3-node Redis Cluster, 8 shards";
    runs.push(r);
    drop(cluster);
    for r in &runs {
        println!(
            "{} engine(s) on {}: {:.0} events/s accepted, {:.0}/s end to end; ran by engine {:?}; CPU per engine {:?}, Redis {:.2}",
            r.engines,
            r.on,
            r.accepted,
            r.end_to_end,
            r.ran_by,
            r.cpu.iter().map(|c| format!("{c:.2}")).collect::<Vec<_>>(),
            r.redis_cpu
        );
    }
    println!("\n--- scaling on Redis, beside the ceiling measured in this run ---");
    println!(
        "durability: redis appendonly yes, appendfsync always (every write fsynced before its answer), on every server this bench starts"
    );
    let one = runs[0].end_to_end;
    for r in &runs {
        println!(
            "{} engine(s) on {}: {:>6.0} events/s end to end ({:>6.0}/s accepted) | scaling vs 1 engine {:.2} | bare XADD+XREADGROUP+XACK on one server (256 a round) {:.0}/s, ratio {:.2} | Redis CPU {:.2} cores",
            r.engines,
            r.on,
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
