//! The webhook benchmarks of issue 8, each against the `weir` binary on its durable default
//! (SQLite, WAL, `synchronous=FULL`), each figure beside a ceiling measured in the same run:
//!
//! 1. echo, `respond: wave` (webhook → function → http-response), 16 connections: requests
//!    per second and p99, beside a bare axum server doing the same JSON echo with no journal
//!    (the HTTP stack and the load generator on these cores), the fsync rate, and the least
//!    durable echo: the bare server answering after a group-committed SQLite insert, once
//!    as that alone and once also writing each row again, finished with its outcome, after
//!    the answer (the two writes weir's promises take, and nothing else);
//! 2. accepted (202) then run (webhook → function → log): events per second accepted, and the
//!    time until every one of them has run;
//! 3. memory: resident when idle with the example flows loaded, and the peak after the loads;
//! 4. start to first healthy answer;
//! 5. 1,000 flows loaded vs 1: cost per accepted event.
//!
//! Each scenario checks that the number journaled equals the number sent (the engine's own
//! count of items ended). Run: `cargo bench --bench webhook` (`WEIR_BENCH_SECS` sets the
//! length of each load, default 8 s). The 1,000-flow comparison runs both sides on fresh
//! engines, alternating (`WEIR_BENCH_ROUNDS`, default 3), and takes the median;
//! `WEIR_BENCH_ONLY=flows` runs it alone. `WEIR_BENCH_ONLY=alloc` compares the default build (on
//! mimalloc) with `--no-default-features` (the C library's malloc) the same way (rate, CPU per
//! event, idle memory). `WEIR_BENCH_ONLY=echo` runs the echo against the least durable echo,
//! with and without its outcome written (below), in turn.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};
use weir_testkit::ceilings::{
    cores, cpu_time, fsync_probe, per_transaction_written, round_trip, rss_kib, transactions,
    wal_pages, writer_bytes_written, CpuUse, Writer,
};
use weir_testkit::load::{self, accept_chain, accept_flow, bench_secs, LoadReport, LoadSpec};
use weir_testkit::{metric_sum, weir_bin, weir_bin_with, Mosquitto, WeirProcess};

const CONNECTIONS: usize = 16;

const ECHO: &str = r#"
id: bench-echo
nodes:
  hook: { type: webhook, path: bench-echo, respond: wave, timeout: 10s, to: [shape] }
  shape:
    type: function
    script: |
      msg.payload = #{ echo: msg.payload, ok: true };
      msg
    to: [answer]
  answer: { type: http-response, status: 200 }
"#;

fn addr(base: &str) -> SocketAddr {
    base.trim_start_matches("http://").parse().expect("address")
}

fn spec(addr: SocketAddr, path: &str, paths: usize, duration: Duration) -> LoadSpec {
    LoadSpec {
        addr,
        path: path.to_string(),
        paths,
        body: Bytes::from_static(br#"{"temperature":21.5,"room":"kitchen"}"#),
        connections: CONNECTIONS,
        duration,
        max_requests: None,
        keep_bodies: false,
    }
}

/// Wait until the engine has nothing ready or in flight; how long that took.
async fn drained(p: &WeirProcess, within: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let s = p.stats().await;
        let left = s["ready"].as_u64().unwrap_or(1) + s["in_flight"].as_u64().unwrap_or(1);
        if left == 0 {
            return t.elapsed();
        }
        assert!(t.elapsed() < within, "the queue did not drain: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn line(r: &LoadReport) -> String {
    format!(
        "{:>7.0}/s  p50 {:>6.2} ms  p99 {:>6.2} ms  ({} answers, statuses {:?}, {} errors)",
        r.rate(),
        r.percentile(0.50).as_secs_f64() * 1e3,
        r.percentile(0.99).as_secs_f64() * 1e3,
        r.answered(),
        r.statuses,
        r.errors
    )
}

/// The same JSON echo as the echo flow, served by a bare axum server with no journal.
async fn bare_echo(duration: Duration) -> LoadReport {
    let app = Router::new().route(
        "/hooks/bench-echo",
        post(|Json(v): Json<Value>| async move { Json(json!({ "echo": v, "ok": true })) }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(l, app).await });
    let r = load::run(spec(a, "/hooks/bench-echo", 1, duration)).await;
    server.abort();
    r
}

/// What the least durable echo did besides its load: the rows it wrote, those it wrote again
/// as finished, the transactions they took, and the CPU time of its process and of its writer
/// thread.
struct DurableEcho {
    load: LoadReport,
    rows: u64,
    finished: u64,
    transactions: u64,
    cpu: Duration,
    writer_cpu: Duration,
    /// Bytes its writer thread wrote (WAL frames, checkpoints).
    written: u64,
    /// The requests' waits for their rows to be durable, summed.
    waited: Duration,
}

impl DurableEcho {
    fn costs(&self) -> String {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / self.load.ok().max(1) as f64;
        format!(
            "{:.1} requests a transaction, CPU a request {:.1} µs (its writer {:.1}); {}; {}",
            self.rows as f64 / self.transactions.max(1) as f64,
            per(self.cpu),
            per(self.writer_cpu),
            per_transaction_written(self.written, self.transactions),
            round_trip(
                CONNECTIONS,
                self.load.rate(),
                self.waited.div_f64(self.rows.max(1) as f64)
            )
        )
    }
}

/// Set to a directory, this bench's binary serves the least durable echo there instead (see
/// [`durable_echo`]).
const LEAST_ECHO: &str = "WEIR_BENCH_LEAST_ECHO";

/// Set as well, the least durable echo also writes each request's outcome (see
/// [`serve_least_echo`]).
const LEAST_ECHO_OUTCOME: &str = "WEIR_BENCH_LEAST_ECHO_OUTCOME";

/// The least a durable echo can be, as a ceiling for weir's: the bare axum echo above, but
/// each request's body is first inserted into an SQLite table (WAL, `synchronous=FULL`) by one
/// writer thread that commits whatever arrived while its last transaction ran, and whatever
/// arrives while the new one's inserts run (weir's group commit, with none of its work: no
/// claim, no wave, no commit of the wave, no metrics). The answer waits for the fsync. It runs
/// in a process of its own (this binary again), on a runtime like weir's, so that it shares
/// the cores with the load generator as weir does.
///
/// With `outcome`, each request's outcome is written too, after its answer (weir's second
/// write: see [`serve_least_echo`]).
async fn durable_echo(dir: &Path, duration: Duration, outcome: bool) -> DurableEcho {
    use std::io::{BufRead, Write};
    let mut server = std::process::Command::new(std::env::current_exe().unwrap());
    server.env(LEAST_ECHO, dir);
    if outcome {
        server.env(LEAST_ECHO_OUTCOME, "1");
    }
    let mut server = server
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the least durable echo starts");
    let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first)
        .expect("the least durable echo's address");
    let a: SocketAddr = first
        .trim()
        .parse()
        .expect("the least durable echo's address");
    load::run(spec(a, "/hooks/bench-echo", 1, Duration::from_secs(1))).await;
    let mut stdin = server.stdin.take().unwrap();
    writeln!(stdin, "load").unwrap();
    let mut counting = String::new();
    out.read_line(&mut counting)
        .expect("the least durable echo counts from now");
    assert_eq!(counting.trim(), "counting");
    let cpu = cpu_time(server.id());
    let load = load::run(spec(a, "/hooks/bench-echo", 1, duration)).await;
    let cpu = cpu_time(server.id()) - cpu;
    writeln!(stdin, "end").unwrap();
    drop(stdin);
    let mut last = String::new();
    out.read_line(&mut last)
        .expect("the least durable echo's count");
    let n: Vec<u64> = last
        .split_whitespace()
        .map(|w| w.parse().expect("a count"))
        .collect();
    assert!(
        server.wait().unwrap().success(),
        "the least durable echo failed"
    );
    let echo = DurableEcho {
        load,
        rows: n[0],
        transactions: n[1],
        cpu,
        writer_cpu: Duration::from_nanos(n[2]),
        finished: n[3],
        written: n[4],
        waited: Duration::from_nanos(n[5]),
    };
    assert!(
        echo.rows >= echo.load.ok(),
        "every answer of the least durable echo was written first: {} rows for {} answers",
        echo.rows,
        echo.load.ok()
    );
    if outcome {
        // Its second write is what it measures: every row answered in the load was finished
        // too, but for the last answers (one a connection at most) still on their way.
        assert!(
            echo.finished + CONNECTIONS as u64 >= echo.rows,
            "the least durable echo with its outcome finished {} of its {} rows",
            echo.finished,
            echo.rows
        );
    }
    echo
}

/// The least durable echo's process: writes its address, serves, answers `counting` to the
/// first line on its standard input, and writes what it did between that line and the second
/// (`rows transactions writer-CPU-ns finished-rows writer-bytes waited-ns`), then ends. With
/// `WEIR_BENCH_LEAST_ECHO_OUTCOME` set, each row is written in flight and, once the answer
/// is on its way, written again as finished with its outcome:
/// the two writes weir's promises take (journaled before anything runs; the item and its
/// outcome kept), with nothing else.
fn serve_least_echo(dir: &Path) {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::{mpsc, Arc};
    enum Job {
        /// A request's body: answered with its row once it is durable.
        Add(Bytes, tokio::sync::oneshot::Sender<i64>),
        /// A row whose answer went out: now finished.
        Finish(i64),
    }
    let outcome = std::env::var_os(LEAST_ECHO_OUTCOME).is_some();
    let (tx, rx) = mpsc::channel::<Job>();
    let path = dir.join("least-echo.db");
    let db = path.clone();
    // rows, transactions, writer CPU (ns), rows finished, bytes the writer wrote, and the
    // time the requests waited for their rows to be durable (ns, summed): read when the
    // load ends.
    let counts = Arc::new([
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
    ]);
    let seen = counts.clone();
    let waits = counts.clone();
    std::thread::spawn(move || {
        let c = rusqlite::Connection::open(&db).expect("least echo db");
        c.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;
             CREATE TABLE log (seq INTEGER PRIMARY KEY, st TEXT NOT NULL, outcome TEXT,
                               at INTEGER, body BLOB NOT NULL);",
        )
        .expect("least echo schema");
        let cpu = weir_testkit::ceilings::thread_cpu_time();
        let wrote = weir_testkit::ceilings::thread_bytes_written();
        let mut held = Vec::new();
        while let Ok(first) = rx.recv() {
            c.execute_batch("BEGIN IMMEDIATE").expect("begin");
            let mut next = Some(first);
            let mut finished = 0;
            {
                let mut add = c
                    .prepare_cached("INSERT INTO log (st, body) VALUES ('in_flight', ?1)")
                    .expect("insert");
                let mut finish = c
                    .prepare_cached(
                        "UPDATE log SET st = 'finished', outcome = 'done', at = ?2 WHERE seq = ?1",
                    )
                    .expect("update");
                while let Some(job) = next.take() {
                    match job {
                        Job::Add(body, answer) => {
                            add.execute([&body[..]]).expect("insert");
                            held.push((c.last_insert_rowid(), answer));
                        }
                        Job::Finish(seq) => {
                            finished +=
                                finish.execute([seq, weir_queue::now_ms()]).expect("update");
                        }
                    }
                    next = rx.try_recv().ok();
                }
            }
            c.execute_batch("COMMIT").expect("commit");
            seen[0].fetch_add(held.len() as u64, Relaxed);
            seen[1].fetch_add(1, Relaxed);
            seen[3].fetch_add(finished as u64, Relaxed);
            let used = weir_testkit::ceilings::thread_cpu_time() - cpu;
            seen[2].store(used.as_nanos() as u64, Relaxed);
            seen[4].store(
                weir_testkit::ceilings::thread_bytes_written() - wrote,
                Relaxed,
            );
            for (seq, answer) in held.drain(..) {
                let _ = answer.send(seq);
            }
        }
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores().round().max(1.0) as usize)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let app = Router::new().route(
            "/hooks/bench-echo",
            post(move |body: Bytes| {
                let tx = tx.clone();
                let waits = waits.clone();
                async move {
                    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
                        return Err(axum::http::StatusCode::BAD_REQUEST);
                    };
                    let (answer, durable) = tokio::sync::oneshot::channel();
                    let sent = Instant::now();
                    tx.send(Job::Add(body, answer))
                        .map_err(|_| axum::http::StatusCode::SERVICE_UNAVAILABLE)?;
                    let seq = durable
                        .await
                        .map_err(|_| axum::http::StatusCode::SERVICE_UNAVAILABLE)?;
                    waits[5].fetch_add(sent.elapsed().as_nanos() as u64, Relaxed);
                    let answer = Json(json!({ "echo": v, "ok": true }));
                    if outcome {
                        // As weir commits a wave after its reply: nobody waits for it.
                        let _ = tx.send(Job::Finish(seq));
                    }
                    Ok(answer)
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        // A line when the warm-up is over, another when the load is: what the writer did
        // between them.
        let lines = tokio::task::spawn_blocking(move || {
            let read = || {
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
                counts.iter().map(|c| c.load(Relaxed)).collect::<Vec<u64>>()
            };
            let from = read();
            // Counted from here: the load starts only once this line is out, so that none of
            // its rows are counted before it.
            println!("counting");
            let to = read();
            let counted: Vec<String> = to
                .iter()
                .zip(&from)
                .map(|(t, f)| (t - f).to_string())
                .collect();
            println!("{}", counted.join(" "));
        });
        let _ = lines.await;
    });
    for ext in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{ext}", path.display()));
    }
}

/// The CPU time of the engine and of this process (the load generator), and the engine's
/// SQLite transactions, from the start of a load.
struct Watch {
    pids: [u32; 2],
    cpu: CpuUse,
    transactions: u64,
    writer: Writer,
}

/// The most requests a second that any engine answering after an fsync of one log could
/// serve over `CONNECTIONS`, from this run's bare HTTP rate and fsync rate: the connections
/// over (a bare HTTP round trip + 1.5 fsyncs: a request waits out the rest of the flush
/// under way, which began before it came, then a whole one of its own).
#[derive(Clone, Copy)]
struct Floor {
    bare_rate: f64,
    fsyncs: f64,
}

impl Floor {
    /// weir's own round trip, and where it went, are in `Watch::report`'s lines.
    fn line(self) -> String {
        let trip = CONNECTIONS as f64 * 1e6 / self.bare_rate.max(1.0);
        let flush = 1.5e6 / self.fsyncs.max(1.0);
        let most = CONNECTIONS as f64 * 1e6 / (trip + flush);
        format!(
            "  the floor of a round trip here: bare HTTP {trip:.0} µs + 1.5 fsyncs {flush:.0} µs, so at most {most:.0}/s for any engine that answers after an fsync"
        )
    }
}

impl Watch {
    async fn start(p: &WeirProcess) -> Watch {
        let pids = [p.pid(), std::process::id()];
        Watch {
            pids,
            cpu: CpuUse::now(&pids),
            transactions: transactions(&p.base).await,
            writer: Writer::now(&p.base, p.pid()).await,
        }
    }

    /// Where the CPU of the load went over its `n` requests, and what the machine's cores
    /// allow: the most requests a second that the engine and the generator together could
    /// make at that cost, and the CPU a request that `target` a second would leave the
    /// engine. An engine under its share that still misses the target is held by latency
    /// (each connection waits on its request), not by the cores. `fsync` is what one
    /// fdatasync costs the CPU (the probe's), shared by the requests of a transaction. And
    /// where a request's round trip went at the load's `rate`: waiting for the writer, or
    /// outside it.
    async fn report(
        self,
        p: &WeirProcess,
        n: u64,
        rate: f64,
        fsync: Duration,
        target: f64,
    ) -> String {
        let used = self.cpu.since(&self.pids);
        let committed = transactions(&p.base).await - self.transactions;
        let now = Writer::now(&p.base, p.pid()).await;
        let trip = round_trip(CONNECTIONS, rate, self.writer.journal_waited(&now));
        let writer = self.writer.since(&now, committed, fsync);
        let per = |d: Duration| d.as_secs_f64() * 1e6 / n.max(1) as f64;
        let (engine, load) = (per(used.of[0]), per(used.of[1]));
        let per_tx = n as f64 / committed.max(1) as f64;
        let cores = cores();
        format!(
            "  CPU a request: engine {engine:.1} µs (of it ~{:.1} µs in fdatasyncs: {per_tx:.1} requests a transaction), load generator {load:.1} µs ({:.2} of {cores:.0} cores busy); the cores allow at most {:.0}/s at that cost, and {target:.0}/s leaves the engine {:.1} µs\n{writer}\n  weir: {trip}",
            fsync.as_secs_f64() * 1e6 / per_tx,
            used.cores_busy(),
            cores * 1e6 / (engine + load).max(0.001),
            cores * 1e6 / target - load
        )
    }
}

/// Copy the example flows and write the bench's own beside them.
fn flows_dir(dir: &Path, extra: &[(String, String)]) {
    std::fs::create_dir_all(dir).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("flows");
    for e in std::fs::read_dir(examples).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    for (name, src) in extra {
        std::fs::write(dir.join(name), src).unwrap();
    }
}

/// Start `weir run` and time it to its first healthy answer (polled every half millisecond).
fn time_to_healthy(flows: &Path, queue: &str, mqtt: &str) -> Duration {
    let port = weir_queue::testing::free_port();
    let t = Instant::now();
    let mut child = std::process::Command::new(weir_bin())
        .arg("run")
        .arg(flows)
        .args(["--queue", queue, "--http", &format!("127.0.0.1:{port}")])
        .args(["--mqtt", mqtt])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("weir starts");
    let deadline = t + Duration::from_secs(10);
    let took = loop {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
            let mut buf = Vec::new();
            let _ = s.read_to_end(&mut buf);
            if buf.starts_with(b"HTTP/1.1 200") {
                break t.elapsed();
            }
        }
        assert!(Instant::now() < deadline, "weir did not become healthy");
        std::thread::sleep(Duration::from_micros(500));
    };
    let _ = child.kill();
    let _ = child.wait();
    took
}

/// What one accepted load against a fresh engine showed.
struct Accepted {
    /// Events accepted per second.
    rate: f64,
    /// The engine's CPU time (every thread) per event, until all had run.
    cpu: Duration,
    /// Resident memory 1 s after the engine answered its first health check (KiB).
    idle_kib: u64,
}

/// One accepted load against a fresh engine (the binary `bin`) whose flows are the examples
/// and `n` accept flows (paths p0…p{n-1}), each running `functions` function nodes in a
/// row; checks that every 202 ran once.
async fn accepted_over(
    bin: &Path,
    root: &Path,
    (n, functions): (usize, usize),
    mqtt: &str,
    duration: Duration,
) -> Accepted {
    let dir = root.join(format!("flows-{n}-{}", next_dir()));
    let flows: Vec<(String, String)> = (0..n)
        .map(|i| {
            (
                format!("f{i:04}.yaml"),
                accept_chain(&format!("f{i:04}"), &format!("p{i}"), functions),
            )
        })
        .collect();
    flows_dir(&dir, &flows);
    let queue = format!("sqlite:{}/queue.db", dir.display());
    let p = WeirProcess::start_bin(bin, &dir, &queue, &["--mqtt", mqtt]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (idle_kib, _) = rss_kib(p.pid());
    let cpu = cpu_time(p.pid());
    let m = load::run(spec(addr(&p.base), "/hooks/p{n}", n, duration)).await;
    drained(&p, Duration::from_secs(120)).await;
    let per_event = (cpu_time(p.pid()) - cpu) / m.ok().max(1) as u32;
    println!(
        "weir accepted, {n:>4} flow(s) of {functions:>2} function(s): {}  engine CPU {:.1} µs/event, idle {:.1} MiB",
        line(&m),
        per_event.as_secs_f64() * 1e6,
        idle_kib as f64 / 1024.0
    );
    // The bench's own flows only (f0000…; the examples beside them run cron ticks).
    let ended = metric_sum(&p.base, "weir_items_ended_total", &["flow=\"f"]).await;
    assert_eq!(ended, m.ok(), "every 202 was journaled and run once");
    p.stop(Duration::from_secs(10)).await;
    Accepted {
        rate: m.rate(),
        cpu: per_event,
        idle_kib,
    }
}

/// A number for each engine's directory, so that rounds do not share a queue file.
fn next_dir() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}

/// Rounds of an alternating comparison: `WEIR_BENCH_ROUNDS`, default 3.
fn rounds() -> usize {
    std::env::var("WEIR_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1)
}

/// `WEIR_BENCH_ONLY=flows`: the 1,000-flow comparison alone.
async fn flows_only(duration: Duration) {
    let tmp = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start();
    let line = thousand_flows_vs_one(tmp.path(), &broker.url(), duration).await;
    println!("\n{line}");
}

/// 1 flow against 1,000, each on a fresh engine of the same flows folder's shape, in turn
/// (`rounds()` of each): the median of the rounds' ratios, so that the machine's moment moves
/// one round and both sides of a ratio share theirs. (Until 2026-12-07 the full run measured
/// 1,000 flows once against the accepted bench's engine, with the example flows loaded,
/// minutes earlier: 1.27× in its 03:54 run, where alternating rounds right after gave
/// 1.06–1.20×, median 1.11×.)
async fn thousand_flows_vs_one(root: &Path, mqtt: &str, duration: Duration) -> String {
    let bin = weir_bin();
    let (mut rates, mut cpus, mut ones, mut manys) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds() {
        let one = accepted_over(&bin, root, (1, 1), mqtt, duration).await;
        let many = accepted_over(&bin, root, (1000, 1), mqtt, duration).await;
        let cpu = many.cpu.as_secs_f64() / one.cpu.as_secs_f64();
        println!(
            "  1,000 flows vs 1: rate {:.2}×, engine CPU per event {cpu:.2}×",
            one.rate / many.rate
        );
        rates.push(one.rate / many.rate);
        cpus.push(cpu);
        ones.push(one.rate);
        manys.push(many.rate);
    }
    format!(
        "1,000 flows loaded (events spread over all of them) vs 1, fresh engines in turn: {:.0} vs {:.0} events/s accepted (medians); cost per event by rate {}, by engine CPU {} | target ≤ 1.2×",
        middle(manys),
        middle(ones),
        median(rates, "×"),
        median(cpus, "×")
    )
}

/// The median of `v`.
fn middle(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sorted, with the median: a slow moment of the machine moves one round, not the median.
fn median(mut v: Vec<f64>, unit: &str) -> String {
    v.sort_by(f64::total_cmp);
    let all = v.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>();
    format!("median {:.2}{unit} of {all:?}", v[v.len() / 2])
}

/// `WEIR_BENCH_ONLY=alloc`: the default `weir` (on mimalloc) against the one built with
/// `--no-default-features`, on the C library's malloc (built here, in a target directory of
/// its own).
async fn alloc_only(duration: Duration) {
    compare(
        ("glibc", weir_bin_with(&["--no-default-features"])),
        ("mimalloc (default)", weir_bin()),
        duration,
    )
    .await
}

/// `WEIR_BENCH_ONLY=ab`: two builds of `weir`, the binaries `WEIR_BENCH_A` and
/// `WEIR_BENCH_B` (copy `target/release/weir` aside before and after a change).
async fn ab_only(duration: Duration) {
    let bin = |var: &str| {
        let p = PathBuf::from(std::env::var(var).unwrap_or_else(|_| {
            panic!("WEIR_BENCH_ONLY=ab compares the binaries WEIR_BENCH_A and WEIR_BENCH_B; {var} is not set")
        }));
        assert!(p.is_file(), "{var}={} is not a file", p.display());
        p
    };
    compare(
        ("A", bin("WEIR_BENCH_A")),
        ("B", bin("WEIR_BENCH_B")),
        duration,
    )
    .await
}

/// Two builds of `weir` on fresh engines in turn, `WEIR_BENCH_ROUNDS` times: the accepted
/// load's rate, the engine's CPU per event, and the memory when idle, `b` against `a`.
async fn compare((a_name, a): (&str, PathBuf), (b_name, b): (&str, PathBuf), duration: Duration) {
    let tmp = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start();
    let (mut rates, mut cpus, mut idle) = (Vec::new(), Vec::new(), [Vec::new(), Vec::new()]);
    for _ in 0..rounds() {
        let x = accepted_over(&a, tmp.path(), (1, 1), &broker.url(), duration).await;
        let y = accepted_over(&b, tmp.path(), (1, 1), &broker.url(), duration).await;
        println!(
            "  {b_name} vs {a_name}: rate {:.2}×, engine CPU per event {:.2}×, idle {:+.1} MiB",
            y.rate / x.rate,
            y.cpu.as_secs_f64() / x.cpu.as_secs_f64(),
            (y.idle_kib as f64 - x.idle_kib as f64) / 1024.0
        );
        rates.push(y.rate / x.rate);
        cpus.push(y.cpu.as_secs_f64() / x.cpu.as_secs_f64());
        idle[0].push(x.idle_kib as f64 / 1024.0);
        idle[1].push(y.idle_kib as f64 / 1024.0);
    }
    let [a_idle, b_idle] = idle;
    println!(
        "\n{b_name} vs {a_name} (fresh engines, alternating): rate {}, engine CPU per event {}; idle {a_name} {}, {b_name} {} | target ≤ 15 MiB idle",
        median(rates, "×"),
        median(cpus, "×"),
        median(a_idle, " MiB"),
        median(b_idle, " MiB")
    );
}

/// The echo against the least durable echo, with and without its outcome written,
/// `WEIR_BENCH_ROUNDS` times in turn, weir on a fresh engine each round: the ratios alone,
/// without the rest of the benches.
async fn echo_only(duration: Duration) {
    let tmp = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start();
    let (mut ratios, mut kept) = (Vec::new(), Vec::new());
    for round in 0..rounds() {
        // The three in a turning order, so that none always runs first or last.
        let (mut least, mut keeping, mut echo) = (None, None, None);
        for turn in 0..3 {
            match (round + turn) % 3 {
                0 => least = Some(durable_echo(tmp.path(), duration, false).await),
                1 => keeping = Some(durable_echo(tmp.path(), duration, true).await),
                _ => {
                    let dir = tmp.path().join(format!("echo-{round}"));
                    echo = Some(weir_echo(&dir, &broker, duration).await);
                }
            }
        }
        let (least, keeping, echo) = (least.unwrap(), keeping.unwrap(), echo.unwrap());
        println!(
            "least durable echo: {}\n  {}",
            line(&least.load),
            least.costs()
        );
        println!(
            "  with its outcome: {}\n  {}",
            line(&keeping.load),
            keeping.costs()
        );
        let (echo, writes) = echo;
        println!("weir echo:          {}\n  {writes}", line(&echo));
        ratios.push(echo.rate() / least.load.rate());
        kept.push(echo.rate() / keeping.load.rate());
    }
    println!(
        "\nweir echo vs the least durable echo (alternating): {}; vs the same with its outcome written: {}",
        median(ratios, "×"),
        median(kept, "×")
    );
}

/// weir's echo on a fresh engine in `dir`: a second of warm-up, then the load; with what
/// its SQLite transactions carried and wrote.
async fn weir_echo(dir: &Path, broker: &Mosquitto, duration: Duration) -> (LoadReport, String) {
    flows_dir(dir, &[("bench-echo.yaml".into(), ECHO.into())]);
    let queue = format!("sqlite:{}/queue.db", dir.display());
    let p = WeirProcess::start(dir, &queue, &["--mqtt", &broker.url()]).await;
    let a = addr(&p.base);
    load::run(spec(a, "/hooks/bench-echo", 1, Duration::from_secs(1))).await;
    let (committed, wrote) = (transactions(&p.base).await, writer_bytes_written(p.pid()));
    let writer = Writer::now(&p.base, p.pid()).await;
    let echo = load::run(spec(a, "/hooks/bench-echo", 1, duration)).await;
    let committed = transactions(&p.base).await - committed;
    let wrote = writer_bytes_written(p.pid()) - wrote;
    let waited = writer.journal_waited(&Writer::now(&p.base, p.pid()).await);
    let pages = wal_pages(&dir.join("queue.db"));
    p.stop(Duration::from_secs(10)).await;
    let mut writes = format!(
        "{:.1} requests a transaction; {}; {}",
        echo.ok() as f64 / committed.max(1) as f64,
        per_transaction_written(wrote, committed),
        round_trip(CONNECTIONS, echo.rate(), waited)
    );
    if let Some(pages) = pages {
        writes.push_str(&format!("\n  the WAL after the load: {pages}"));
    }
    (echo, writes)
}

async fn bench() {
    let duration = bench_secs();
    match std::env::var("WEIR_BENCH_ONLY").as_deref() {
        Ok("flows") => return flows_only(duration).await,
        Ok("echo") => return echo_only(duration).await,
        Ok("alloc") => return alloc_only(duration).await,
        Ok("ab") => return ab_only(duration).await,
        _ => {}
    }
    let tmp = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start();
    let probe = fsync_probe(tmp.path());
    let (fsync, fsync_cpu) = (probe.per_second, probe.cpu_each.as_secs_f64() * 1e6);
    println!("weir binary: {}", weir_bin().display());
    println!("queue: sqlite, WAL, synchronous=FULL (every commit fsynced); fsync ceiling here: {fsync:.0}/s, {fsync_cpu:.0} µs of CPU each");
    println!("load: {CONNECTIONS} keep-alive connections, {duration:?} per run, generator on the same 2 cores\n");
    let mut summary = vec![format!(
        "durability: sqlite WAL, synchronous=FULL (every commit fsynced); fsync ceiling in this run {fsync:.0}/s, each costing {fsync_cpu:.0} µs of CPU (a request of `respond: wave` waits for one, a 202 for one; a transaction carries several)"
    )];

    // ---- start to first healthy answer, with the example flows ----
    let examples = tmp.path().join("examples");
    flows_dir(&examples, &[]);
    let mut starts: Vec<Duration> = (0..5)
        .map(|i| {
            let q = format!("sqlite:{}/start-{i}/queue.db", tmp.path().display());
            time_to_healthy(&examples, &q, &broker.url())
        })
        .collect();
    starts.sort();
    summary.push(format!(
        "start → first healthy answer: median {:.1} ms (of 5: {:?}) | target ≤ 100 ms",
        starts[2].as_secs_f64() * 1e3,
        starts
            .iter()
            .map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
    ));

    // ---- the engine under load ----
    let flows = tmp.path().join("flows");
    flows_dir(
        &flows,
        &[
            ("bench-echo.yaml".into(), ECHO.into()),
            (
                "bench-accept.yaml".into(),
                accept_flow("bench-accept", "bench-accept"),
            ),
        ],
    );
    let queue = format!("sqlite:{}/queue.db", tmp.path().display());
    let mqtt = broker.url();
    let p = WeirProcess::start(&flows, &queue, &["--mqtt", &mqtt]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (idle, _) = rss_kib(p.pid());
    let a = addr(&p.base);

    // echo: the ceiling first, then weir.
    let bare = bare_echo(duration).await;
    println!("bare axum echo (no journal): {}", line(&bare));
    let floor = Floor {
        bare_rate: bare.rate(),
        fsyncs: fsync,
    };
    let durable = durable_echo(tmp.path(), duration, false).await;
    println!("least durable echo:          {}", line(&durable.load));
    let keeping = durable_echo(tmp.path(), duration, true).await;
    println!("  with its outcome written:  {}", line(&keeping.load));
    let least = format!(
        "  the least durable echo here (the bare echo, each request's body inserted into SQLite by one writer thread, group commit, synchronous=FULL, answered after the fsync; a process of its own): {:.0} req/s, p99 {:.2} ms; {}\n  the same, each request's row also written finished with its outcome after the answer (the two writes weir's promises take, nothing else): {:.0} req/s, p99 {:.2} ms; {}",
        durable.load.rate(),
        durable.load.percentile(0.99).as_secs_f64() * 1e3,
        durable.costs(),
        keeping.load.rate(),
        keeping.load.percentile(0.99).as_secs_f64() * 1e3,
        keeping.costs()
    );
    let warm = load::run(spec(a, "/hooks/bench-echo", 1, Duration::from_secs(1))).await;
    let watch = Watch::start(&p).await;
    let echo = load::run(spec(a, "/hooks/bench-echo", 1, duration)).await;
    // Read while the engine runs: a clean stop checkpoints the log away.
    let pages = wal_pages(&tmp.path().join("queue.db"));
    println!("weir echo, respond: wave:    {}", line(&echo));
    drained(&p, Duration::from_secs(60)).await;
    let echo_cpu = watch
        .report(&p, echo.ok(), echo.rate(), probe.cpu_each, 23_000.0)
        .await;
    let ended = metric_sum(&p.base, "weir_items_ended_total", &["flow=\"bench-echo\""]).await;
    assert_eq!(
        ended,
        warm.ok() + echo.ok(),
        "every answered echo was journaled and ended once"
    );
    assert_eq!(echo.ok(), echo.answered(), "every echo answered 200");
    summary.push(format!(
        "webhook echo (respond: wave): {:.0} req/s, p99 {:.2} ms | bare HTTP echo {:.0} req/s, ratio {:.2}; least durable echo {:.0} req/s, ratio {:.2}; with its outcome written {:.0} req/s, ratio {:.2} | targets ≥ 23,000 req/s, p99 ≤ 4 ms",
        echo.rate(),
        echo.percentile(0.99).as_secs_f64() * 1e3,
        bare.rate(),
        echo.rate() / bare.rate(),
        durable.load.rate(),
        echo.rate() / durable.load.rate(),
        keeping.load.rate(),
        echo.rate() / keeping.load.rate()
    ));
    summary.push(echo_cpu);
    if let Some(pages) = pages {
        summary.push(format!("  the WAL after the load: {pages}"));
    }
    summary.push(floor.line());
    summary.push(least);

    // accepted (202), then run.
    let t0 = Instant::now();
    let watch = Watch::start(&p).await;
    let acc = load::run(spec(a, "/hooks/bench-accept", 1, duration)).await;
    println!("weir accepted (202):         {}", line(&acc));
    let after = drained(&p, Duration::from_secs(120)).await;
    let acc_cpu = watch
        .report(&p, acc.ok(), acc.rate(), probe.cpu_each, 30_000.0)
        .await;
    let all_run = t0.elapsed();
    let ended = metric_sum(
        &p.base,
        "weir_items_ended_total",
        &["flow=\"bench-accept\""],
    )
    .await;
    assert_eq!(ended, acc.ok(), "every 202 was journaled and run once");
    summary.push(format!(
        "webhook accepted (202) → function → log: {:.0} events/s accepted, all {} run {:.0} ms after the load ({:.0} events/s end to end) | bare HTTP {:.0} req/s, ratio {:.2}; least durable echo {:.0} req/s, ratio {:.2} | target ≥ 30,000/s",
        acc.rate(),
        acc.ok(),
        after.as_secs_f64() * 1e3,
        acc.ok() as f64 / all_run.as_secs_f64(),
        bare.rate(),
        acc.rate() / bare.rate(),
        durable.load.rate(),
        acc.rate() / durable.load.rate()
    ));
    summary.push(acc_cpu);
    summary.push(floor.line());
    let (_, peak) = rss_kib(p.pid());
    summary.push(format!(
        "resident memory: idle {:.1} MiB with the example flows loaded, peak {:.1} MiB after the loads | targets ≤ 15 MiB idle, ≤ 60 MiB peak",
        idle as f64 / 1024.0,
        peak as f64 / 1024.0
    ));
    p.stop(Duration::from_secs(10)).await;

    // ---- 1,000 flows loaded vs 1 ----
    summary.push(thousand_flows_vs_one(tmp.path(), &mqtt, duration).await);

    // ---- nodes per wave: webhook → 1, 4, 16 function nodes → log ----
    const CHAINS: [usize; 3] = [1, 4, 16];
    let mut chains = Vec::new();
    for functions in CHAINS {
        chains.push(accepted_over(&weir_bin(), tmp.path(), (1, functions), &mqtt, duration).await);
    }
    let us = |a: &Accepted| a.cpu.as_secs_f64() * 1e6;
    summary.push(format!(
        "nodes per wave (webhook → 1 / 4 / 16 function nodes → log, fresh engines): {:.0} / {:.0} / {:.0} events/s accepted, engine CPU {:.1} / {:.1} / {:.1} µs an event: each function node {:.1} µs more; a wave commits once however many nodes it runs",
        chains[0].rate,
        chains[1].rate,
        chains[2].rate,
        us(&chains[0]),
        us(&chains[1]),
        us(&chains[2]),
        (us(&chains[2]) - us(&chains[0])) / (CHAINS[2] - CHAINS[0]) as f64
    ));

    println!("\n--- webhook benchmarks, beside the ceilings measured in this run ---");
    for s in summary {
        println!("{s}");
    }
}

fn main() {
    if let Some(dir) = std::env::var_os(LEAST_ECHO) {
        return serve_least_echo(Path::new(&dir));
    }
    // `cargo bench` passes `--bench`; a filter argument is not used here.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
}
