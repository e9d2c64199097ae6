//! add → claim → ack through each durable backend, one item at a time and in batches, each
//! figure printed beside the ceiling measured in the same run on the same machine:
//! - sqlite: one at a time, fsyncs per second on the data directory (write 4 KiB +
//!   fdatasync); batched, a bare SQLite queue table (WAL, `synchronous=FULL`) doing add,
//!   claim and ack 256 operations to a transaction;
//! - redis: a bare XADD + XREADGROUP + XACK round trip on the same server (one at a time,
//!   and pipelined in batches of the same size).
//!
//! Each ceiling is measured before and after weir's runs, and the better of the two is the
//! one weir's figure is divided by: the disk and the server drift over a run. Redis
//! pipelined, the case its target is set on, is also run in alternating rounds with the bare
//! loop, and its ratio is the median of theirs (`Paired`): there the drift between two runs
//! a minute apart was as large as the ratio's distance from its target.
//!
//! Every iteration checks that what was journaled was claimed and committed: the number
//! journaled equals the number sent. Run: `cargo bench --bench queue`.
//!
//! The process allocates with mimalloc, as the `weir` binary does by default: the queue is
//! measured as the daemon runs it (the ceilings' loops run in the same process, on the same
//! allocator).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::json;
use weir_queue::testing::RedisServer;
use weir_queue::{
    Admin, Committed, End, Failpoints, RedisOptions, RedisQueue, Reply, SqliteQueue, WaveEffects,
    WorkQueue,
};
use weir_testkit::ceilings::{
    bytes_written, cpu_time, drive_pipelined, fsync_probe, queue_item as item,
    redis_lean_pipelined, redis_lean_scripts, redis_server_cpu, redis_streams_loop, sqlite_batched,
    QueuePipe,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Items per batched iteration: as many as the bare ceiling puts in one transaction.
const BATCH: usize = 256;

/// Items per second measured over every iteration criterion ran.
#[derive(Default)]
struct Tally {
    items: u64,
    time: Duration,
    /// The process's CPU time (every thread) over the whole case.
    cpu: Duration,
    /// Bytes the process wrote over the whole case.
    written: u64,
}

impl Tally {
    fn rate(&self) -> f64 {
        self.items as f64 / self.time.as_secs_f64().max(1e-9)
    }

    fn cpu_per_item(&self) -> Duration {
        self.cpu / self.items.max(1) as u32
    }

    fn written_per_item(&self) -> f64 {
        self.written as f64 / self.items.max(1) as f64
    }
}

async fn one_at_a_time(q: &dyn WorkQueue, n: u64) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        q.add(vec![item()]).await.unwrap();
        let c = q.claim("bench", 1, Duration::ZERO).await.unwrap();
        assert_eq!(c.len(), 1, "the item journaled is the item claimed");
        let r = q
            .commit(&c[0], WaveEffects::ending(End::Ack))
            .await
            .unwrap();
        assert_eq!(r, Committed::Done);
    }
    t.elapsed()
}

/// One add of `BATCH` items, claims until all are back, then every commit at once (as the
/// executor's concurrent waves do).
async fn batched(q: &dyn WorkQueue, batches: u64) -> Duration {
    let t = Instant::now();
    for _ in 0..batches {
        q.add((0..BATCH).map(|_| item()).collect()).await.unwrap();
        let mut claimed = Vec::with_capacity(BATCH);
        while claimed.len() < BATCH {
            let c = q
                .claim("bench", BATCH - claimed.len(), Duration::ZERO)
                .await
                .unwrap();
            assert!(!c.is_empty(), "every item journaled comes back");
            claimed.extend(c);
        }
        let commits = claimed
            .iter()
            .map(|c| q.commit(c, WaveEffects::ending(End::Ack)));
        for r in futures::future::join_all(commits).await {
            assert_eq!(r.unwrap(), Committed::Done);
        }
    }
    t.elapsed()
}

/// Batches the producer may have journaled ahead of the consumers: the backlog is bounded, as
/// the engine's is (`max_ready`), so the figure is a sustained rate, not a burst into memory.
const AHEAD: usize = 4;

/// Under load, as the engine runs the queue (`drive_pipelined`): a producer journals
/// batches of `BATCH` while two consumers claim what is ready and commit each item as its
/// own wave does, all at once. Adds, claims and commits meet in the writer's transactions;
/// the encoding and decoding run on other threads meanwhile.
async fn pipelined(q: Arc<dyn WorkQueue>, batches: u64) -> Duration {
    drive_pipelined(QueuePipe::new(q, BATCH), batches, BATCH, AHEAD).await
}

/// Lone items on an idle queue, one at a time.
const LONE: usize = 40;

/// A lone event on an idle queue, as a quiet engine sees it: its claim has been waiting a
/// while when the item is added (40–64 ms, varied so that a claim that polls is caught at
/// every point between two polls). The time from the add's call to the claim's return, beside
/// the add's own (the least it can be); then a `respond: wave` reply, from its post to the
/// return of the request waiting for it, beside the post's own. Medians of `LONE` rounds.
async fn lone(q: Arc<dyn WorkQueue>, name: &str) -> String {
    let (mut add, mut claimed, mut post, mut replied) = (vec![], vec![], vec![], vec![]);
    for i in 0..LONE {
        let idle = lone_idle(i);
        let (a, cl, id) = lone_item(&q, &q, idle).await;
        add.push(a);
        claimed.push(cl);
        let (p, r) = lone_reply(&q, &q, id, idle).await;
        post.push(p);
        replied.push(r);
    }
    let (add, claimed, post, replied) =
        (median(add), median(claimed), median(post), median(replied));
    format!(
        "{name} lone item (a claim waiting 40–64 ms before it): added → claimed {claimed:.2} ms | the add alone {add:.2} ms | ratio {:.2}; reply posted → received {replied:.2} ms | the post alone {post:.2} ms | ratio {:.2}",
        claimed / add,
        replied / post
    )
}

/// A claim waits at `claimer` for `idle`, then `adder` adds one item: the add's own time,
/// the time from the add's call to the claim's return, and the item (acknowledged).
async fn lone_item(
    adder: &Arc<dyn WorkQueue>,
    claimer: &Arc<dyn WorkQueue>,
    idle: Duration,
) -> (Duration, Duration, ulid::Ulid) {
    let waiting = {
        let q = claimer.clone();
        tokio::spawn(async move { q.claim("lone", 1, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(idle).await;
    let t = Instant::now();
    adder.add(vec![item()]).await.unwrap();
    let add = t.elapsed();
    let got = waiting.await.unwrap().unwrap();
    let claimed = t.elapsed();
    let [c] = &got[..] else {
        panic!(
            "the waiting claim got {} items, not the one added",
            got.len()
        )
    };
    let ack = claimer
        .commit(c, WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    assert_eq!(ack, Committed::Done);
    (add, claimed, c.item.id)
}

/// As in [`lone`], but across two engines on the same Redis: an item added by one whose own
/// claims are all busy (none waits), claimed by the other; and a reply posted by one for a
/// request waiting at the other (its wave ran there).
async fn lone_across(here: Arc<dyn WorkQueue>, there: Arc<dyn WorkQueue>) -> String {
    let (mut add, mut claimed, mut post, mut replied) = (vec![], vec![], vec![], vec![]);
    for i in 0..LONE {
        let (a, c, _) = lone_item(&there, &here, lone_idle(i)).await;
        add.push(a);
        claimed.push(c);
        let (p, r) = lone_reply(&here, &there, ulid::Ulid::new(), lone_idle(i)).await;
        post.push(p);
        replied.push(r);
    }
    let (add, claimed, post, replied) =
        (median(add), median(claimed), median(post), median(replied));
    format!(
        "redis  lone item added by another engine (none of its claims waiting): added → claimed {claimed:.2} ms | the add alone {add:.2} ms | ratio {:.2}\nredis  lone reply posted by another engine: posted → received {replied:.2} ms | the post alone {post:.2} ms | ratio {:.2}",
        claimed / add,
        replied / post
    )
}

/// How long round `i` of a lone measurement leaves the queue idle first: 40–64 ms.
fn lone_idle(i: usize) -> Duration {
    Duration::from_millis(40 + (i as u64 * 13) % 25)
}

/// A request waits at `waiter` for item `id`'s reply for `idle`, then `poster` posts it: the
/// post's own time, and the time from the post's call to the request's return.
async fn lone_reply(
    waiter: &Arc<dyn WorkQueue>,
    poster: &Arc<dyn WorkQueue>,
    id: ulid::Ulid,
    idle: Duration,
) -> (Duration, Duration) {
    let waiting = {
        let q = waiter.clone();
        tokio::spawn(async move { q.wait_reply(id, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(idle).await;
    let t = Instant::now();
    let reply = Reply {
        status: 200,
        headers: vec![],
        body: json!({ "ok": true }).into(),
    };
    poster.post_reply(id, reply).await.unwrap();
    let post = t.elapsed();
    let got = waiting.await.unwrap().unwrap();
    let replied = t.elapsed();
    assert_eq!(
        got.map(|r| r.status),
        Some(200),
        "the reply posted came back"
    );
    (post, replied)
}

/// The median of `v`, in milliseconds.
fn median(v: Vec<Duration>) -> f64 {
    middle(v.iter().map(|d| d.as_secs_f64() * 1e3).collect())
}

/// The middle value of `v` (the upper one of an even count).
fn middle(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Run one case under criterion; returns the items and time of every iteration it ran.
fn measure(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    group: &str,
    name: &str,
    per_iter: u64,
    q: &Arc<dyn WorkQueue>,
) -> Tally {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let cpu = cpu_time(std::process::id());
    let written = bytes_written();
    let mut g = c.benchmark_group(group);
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(per_iter));
    g.bench_function(name, |b| {
        b.to_async(rt).iter_custom(|iters| {
            let (q, tally, name) = (q.clone(), tally.clone(), name.to_string());
            async move {
                let d = match name.as_str() {
                    "single" => one_at_a_time(&*q, iters).await,
                    "batched" => batched(&*q, iters).await,
                    _ => pipelined(q, iters).await,
                };
                let mut t = tally.lock().unwrap();
                t.items += iters * per_iter;
                t.time += d;
                d
            }
        })
    });
    g.finish();
    let mut t = std::mem::take(&mut *tally.lock().unwrap());
    t.cpu = cpu_time(std::process::id()) - cpu;
    t.written = bytes_written() - written;
    t
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut report = Vec::new();
    // `WEIR_BENCH_BACKEND=sqlite` (or `redis`) runs one backend alone, for profiling.
    let only = std::env::var("WEIR_BENCH_BACKEND").unwrap_or_default();
    if only.is_empty() || only == "sqlite" {
        sqlite_cases(c, &rt, &mut report);
    }
    if only.is_empty() || only == "redis" {
        redis_cases(c, &rt, &mut report);
    }
    println!("\n--- add → claim → ack, beside the ceilings measured in this run ---");
    for line in report {
        println!("{line}");
    }
}

fn sqlite_cases(c: &mut Criterion, rt: &tokio::runtime::Runtime, report: &mut Vec<String>) {
    // In the summary too, which is what `benches/run` keeps.
    report.push("durability: sqlite WAL, synchronous=FULL (every commit fsynced)".into());
    let sqlite_q = Arc::new(SqliteQueue::temporary(Failpoints::new()).unwrap());
    let sqlite: Arc<dyn WorkQueue> = sqlite_q.clone();
    let dir = tempfile::tempdir().unwrap();
    let fsync = fsync_probe(dir.path()).per_second;
    let bare_before = sqlite_batched(dir.path(), BATCH, 3.0);
    println!(
        "sqlite: WAL, synchronous=FULL; fsync ceiling on this machine: {fsync:.0}/s; bare batched queue (256 operations per transaction): {:.0} items/s",
        bare_before.rate
    );
    let mut sqlite_runs = Vec::new();
    for (name, per_iter) in [
        ("single", 1u64),
        ("batched", BATCH as u64),
        ("pipelined", BATCH as u64),
    ] {
        let tx_before = sqlite_q.batches();
        let tally = measure(c, rt, "sqlite", name, per_iter, &sqlite);
        let rate = tally.rate();
        // Both counts cover the same runs (criterion's warm-up included).
        let per_tx = tally.items as f64 / ((sqlite_q.batches() - tx_before) as f64).max(1.0);
        sqlite_runs.push((
            name,
            per_iter,
            rate,
            per_tx,
            tally.cpu_per_item(),
            tally.written_per_item(),
        ));
    }
    // The disk's speed drifts over a run: the ceiling is measured before and after weir's
    // runs, and the better of the two is the one weir is held to.
    let bare_after = sqlite_batched(dir.path(), BATCH, 3.0);
    let bare = bare_before.rate.max(bare_after.rate);
    let bare_cpu = bare_before.cpu_per_item.min(bare_after.cpu_per_item);
    let bare_written = bare_before
        .written_per_item
        .min(bare_after.written_per_item);
    let fsync = fsync.max(fsync_probe(dir.path()).per_second);
    for (name, per_iter, rate, per_tx, cpu, written) in sqlite_runs {
        let tx_rate = rate / per_tx;
        report.push(if per_iter == 1 {
            format!(
                "sqlite {name:>9}: {rate:>9.0} items/s | {per_tx:>5.2} items per transaction, {tx_rate:>5.0} transactions/s | fsync ceiling {fsync:>5.0}/s | ratio {:.2}",
                tx_rate / fsync
            )
        } else {
            format!(
                "sqlite {name:>9}: {rate:>9.0} items/s | {per_tx:>5.1} items per transaction | bare batched SQLite {bare:>7.0} items/s | ratio {:.2} | per item: CPU {:.1} µs, bare {:.1} µs; written {written:.0} B, bare {bare_written:.0} B",
                rate / bare,
                cpu.as_secs_f64() * 1e6,
                bare_cpu.as_secs_f64() * 1e6,
            )
        });
    }
    report.push(rt.block_on(lone(sqlite.clone(), "sqlite")));
    let s = rt.block_on(sqlite_q.stats()).unwrap();
    assert_eq!(
        (s.ready, s.in_flight),
        (0, 0),
        "everything journaled was acknowledged"
    );
}

fn redis_cases(c: &mut Criterion, rt: &tokio::runtime::Runtime, report: &mut Vec<String>) {
    report.push(
        "durability: redis appendonly yes, appendfsync always (every write fsynced before its answer)"
            .into(),
    );
    let server = RedisServer::start();
    // An engine on the bench's server.
    let engine = || -> Arc<RedisQueue> {
        let url = server.url();
        let q = RedisQueue::connect(&url, RedisOptions::default(), Failpoints::new());
        Arc::new(rt.block_on(q).unwrap())
    };
    let redis_own = engine();
    let redis_q: Arc<dyn WorkQueue> = redis_own.clone();
    println!("redis: appendonly yes, appendfsync always (the server this bench starts)");
    let raw_single = rt.block_on(redis_streams_loop(&server.url(), 1, 2000));
    let raw_batched = rt.block_on(redis_streams_loop(&server.url(), BATCH, 200));
    let cases = [
        ("single", 1u64),
        ("batched", BATCH as u64),
        ("pipelined", BATCH as u64),
    ];
    let rates: Vec<f64> = cases
        .iter()
        .map(|&(name, per_iter)| measure(c, rt, "redis", name, per_iter, &redis_q).rate())
        .collect();
    // As for SQLite: the better of the ceilings measured before and after weir's runs.
    let raw_single = raw_single.max(rt.block_on(redis_streams_loop(&server.url(), 1, 2000)));
    let raw_batched = raw_batched.max(rt.block_on(redis_streams_loop(&server.url(), BATCH, 200)));
    for ((name, ceiling), rate) in [("single", raw_single), ("batched", raw_batched)]
        .into_iter()
        .zip(&rates)
    {
        report.push(format!(
            "redis  {name:>9}: {rate:>9.0} items/s | raw XADD+XREADGROUP+XACK {ceiling:>7.0}/s | ratio {:.2}",
            rate / ceiling
        ));
    }
    let criterion_pipelined = rates[2];
    let paired = Paired::run(rt, &server.url(), &redis_q);
    report.push(format!(
        "redis  pipelined: {:>9.0} items/s | raw XADD+XREADGROUP+XACK {:>7.0}/s | ratio {:.2}, the median of {} alternating rounds ({}); criterion's run above, {:.0} items/s, against the better of the bare runs before and after it: {:.2}",
        paired.weir,
        paired.bare,
        paired.ratio,
        paired.ratios.len(),
        paired
            .ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        criterion_pipelined,
        criterion_pipelined / raw_batched
    ));
    report.push(redis_server_floor(rt, &server.url(), &redis_q, paired.bare));
    report.push(rt.block_on(lone(redis_q.clone(), "redis ")));
    report.push(rt.block_on(lone_across(redis_q.clone(), engine())));
    let s = rt.block_on(redis_own.stats()).unwrap();
    assert_eq!(
        (s.ready, s.in_flight),
        (0, 0),
        "everything journaled was acknowledged"
    );
}

/// The pipelined Redis case against the bare loop, in alternating rounds of the same number
/// of items. This machine's speed drifts by up to 1.5x within a minute, and the two runs
/// that criterion and the bare loop make alone are seconds to minutes apart: their ratio
/// measures that drift as much as weir. The median of the rounds' ratios does not lean on
/// any one moment.
struct Paired {
    /// Each round's weir rate over its bare rate, in the order run.
    ratios: Vec<f64>,
    ratio: f64,
    /// The medians of the rounds' rates (items a second).
    weir: f64,
    bare: f64,
}

impl Paired {
    const ROUNDS: usize = 5;
    /// Batches of `BATCH` a round, each side.
    const BATCHES: u64 = 200;

    fn run(rt: &tokio::runtime::Runtime, url: &str, q: &Arc<dyn WorkQueue>) -> Paired {
        let items = (Self::BATCHES * BATCH as u64) as f64;
        let mut ratios = Vec::new();
        let (mut weirs, mut bares) = (Vec::new(), Vec::new());
        for _ in 0..Self::ROUNDS {
            let bare = rt.block_on(redis_streams_loop(url, BATCH, Self::BATCHES));
            let weir = items
                / rt.block_on(pipelined(q.clone(), Self::BATCHES))
                    .as_secs_f64();
            ratios.push(weir / bare);
            weirs.push(weir);
            bares.push(bare);
        }
        Paired {
            ratio: middle(ratios.clone()),
            weir: middle(weirs),
            bare: middle(bares),
            ratios,
        }
    }
}

/// Where the Redis ratio is bounded: the server's CPU time per item (its main thread, where
/// every command and script runs) for the bare loop, for weir's pipelined case, and for the
/// leanest script design that still checks each commit's lease (see
/// `weir_testkit::ceilings::redis_lean_scripts`: no record per item, no body kept once an
/// item finishes). A design whose items cost the server `c` µs each cannot pass 10⁶ / `c`
/// items per second, whatever the client does: that rate over the bare loop's is the most
/// its ratio can be.
fn redis_server_floor(
    rt: &tokio::runtime::Runtime,
    url: &str,
    q: &Arc<dyn WorkQueue>,
    bare_rate: f64,
) -> String {
    const ROUNDS: u64 = 200;
    let items = (ROUNDS * BATCH as u64) as f64;
    // The server's CPU per item over `run`, and the items per second `run` reached.
    let per_item = |run: &dyn Fn() -> f64| {
        let before = rt.block_on(redis_server_cpu(url));
        let rate = run();
        let cpu = rt.block_on(redis_server_cpu(url)) - before;
        (cpu.as_secs_f64() * 1e6 / items, rate)
    };
    let (bare, _) = per_item(&|| rt.block_on(redis_streams_loop(url, BATCH, ROUNDS)));
    let client_cpu = cpu_time(std::process::id());
    let (weir, _) = per_item(&|| items / rt.block_on(pipelined(q.clone(), ROUNDS)).as_secs_f64());
    let client_cpu = (cpu_time(std::process::id()) - client_cpu).as_secs_f64() * 1e6 / items;
    let body = serde_json::to_string(&item()).unwrap();
    let (lean, lean_rate) =
        per_item(&|| rt.block_on(redis_lean_scripts(url, &body, BATCH, ROUNDS)));
    let (lean_p, lean_p_rate) =
        per_item(&|| rt.block_on(redis_lean_pipelined(url, &body, BATCH, ROUNDS, AHEAD)));
    let most = |cpu: f64| (1e6 / cpu, 1e6 / cpu / bare_rate);
    let ((weir_most, weir_ratio), (lean_most, lean_ratio)) = (most(weir), most(lean));
    format!(
        "redis server CPU per item: bare loop {bare:.1} µs | weir pipelined {weir:.1} µs (and {client_cpu:.1} µs in weir's own process), so at most {weir_most:.0} items/s, ratio ≤ {weir_ratio:.2} | leanest checked script design {lean:.1} µs, at most {lean_most:.0}/s, ratio ≤ {lean_ratio:.2}; it ran at {lean_rate:.0}/s one batch at a time (ratio {:.2}) and at {lean_p_rate:.0}/s pipelined as weir's case is ({lean_p:.1} µs, ratio {:.2})",
        lean_rate / bare_rate,
        lean_p_rate / bare_rate
    )
}

criterion_group!(benches, bench);
criterion_main!(benches);
