//! The benchmarks' load generator on its own, for profiling a running engine:
//! `cargo run --release --example load -- 127.0.0.1:8080 /hooks/echo [connections] [secs] [paths]`
//! (with `paths`, a `{n}` in the path runs over 0…paths-1, as in `/hooks/p{n}`).

use std::time::Duration;

use bytes::Bytes;
use weir_testkit::load::{run, LoadSpec};

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let addr = args
        .first()
        .expect("usage: load ADDR PATH [connections] [secs] [paths]")
        .parse()
        .expect("ADDR as 127.0.0.1:PORT");
    let path = args.get(1).cloned().unwrap_or_else(|| "/hooks/echo".into());
    let connections = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(16);
    let secs: f64 = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(10.0);
    let paths = args.get(4).and_then(|v| v.parse().ok()).unwrap_or(1);
    let r = run(LoadSpec {
        addr,
        path,
        paths,
        body: Bytes::from_static(br#"{"temperature":21.5,"room":"kitchen"}"#),
        connections,
        duration: Duration::from_secs_f64(secs),
        max_requests: None,
        keep_bodies: false,
    })
    .await;
    println!(
        "{:.0}/s p50 {:.2} ms p99 {:.2} ms statuses {:?} errors {}",
        r.rate(),
        r.percentile(0.5).as_secs_f64() * 1e3,
        r.percentile(0.99).as_secs_f64() * 1e3,
        r.statuses,
        r.errors
    );
}
