//! The machine's own ceilings, measured in the same run as the figure they bound, so every
//! benchmark prints weir's number beside what the hardware and the servers allow.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// What a durable write costs on this disk: how many a second, and the CPU time each takes
/// (the calling thread's, user + system: on a virtual disk the kernel's side of an fdatasync
/// is most of it, whatever the write's size).
#[derive(Debug, Clone, Copy)]
pub struct Fsync {
    pub per_second: f64,
    pub cpu_each: Duration,
}

/// Write 4 KiB over a block of a file already on disk + fdatasync in `dir`, as often as
/// possible for two seconds: what a write-ahead log costs once it has wrapped (SQLite's WAL
/// is written over in place after each checkpoint). Not an append: a file that grows makes
/// each fdatasync also write its new size through the file system's journal, which on these
/// virtual disks halves the rate and doubles the CPU (measured 2026-12-06: 2,900–3,000/s at
/// 143 µs against 5,900–6,600/s at 62–68 µs), and before 2026-12-06 this probe appended.
pub fn fsync_probe(dir: &Path) -> Fsync {
    use std::os::unix::fs::FileExt;
    const BLOCKS: u64 = 256;
    let path = dir.join("fsync-probe");
    let mut f = std::fs::File::create(&path).expect("probe file");
    let block = [7u8; 4096];
    for _ in 0..BLOCKS {
        f.write_all(&block).expect("probe file");
    }
    f.sync_all().expect("probe file");
    let cpu = thread_cpu_time();
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < Duration::from_secs(2) {
        f.write_all_at(&block, (n % BLOCKS) * 4096)
            .expect("probe write");
        f.sync_data().expect("probe fsync");
        n += 1;
    }
    let _ = std::fs::remove_file(path);
    Fsync {
        per_second: n as f64 / t.elapsed().as_secs_f64(),
        cpu_each: (thread_cpu_time().saturating_sub(cpu)) / n.max(1) as u32,
    }
}

/// What the bare SQLite queue did: items per second, and the process's CPU time (user +
/// system, every thread) per item.
#[derive(Debug, Clone, Copy)]
pub struct Bare {
    pub rate: f64,
    pub cpu_per_item: std::time::Duration,
    /// Bytes the process wrote (to its files, through `write`) per item.
    pub written_per_item: f64,
}

/// The batched-SQLite ceiling: a bare queue table in WAL mode with `synchronous=FULL`,
/// items added, claimed and acknowledged `per_tx` operations to a transaction (one fsync
/// each), for `secs` seconds (each item costs three operations).
pub fn sqlite_batched(dir: &Path, per_tx: usize, secs: f64) -> Bare {
    let path = dir.join("ceiling.db");
    let c = rusqlite::Connection::open(&path).expect("ceiling db");
    c.execute_batch(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;
         CREATE TABLE q (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
                         st TEXT NOT NULL, body TEXT NOT NULL);
         CREATE INDEX q_st ON q (st, seq);",
    )
    .expect("ceiling schema");
    let body = r#"{"payload":{"n":1},"topic":"bench"}"#;
    // One third of each transaction adds, one claims, one acknowledges.
    let third = (per_tx / 3).max(1);
    let t = Instant::now();
    let cpu = cpu_time(std::process::id());
    let written = bytes_written();
    let mut items = 0u64;
    let mut next = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        c.execute_batch("BEGIN IMMEDIATE").expect("begin");
        {
            let mut add = c
                .prepare_cached("INSERT INTO q (id, st, body) VALUES (?1, 'waiting', ?2)")
                .expect("add");
            for _ in 0..third {
                add.execute(rusqlite::params![format!("{next:026}"), body])
                    .expect("add");
                next += 1;
            }
            let mut claim = c
                .prepare_cached(
                    "UPDATE q SET st = 'in_flight' WHERE seq = (SELECT seq FROM q WHERE st = 'waiting' ORDER BY seq LIMIT 1) RETURNING seq",
                )
                .expect("claim");
            let mut claimed = Vec::with_capacity(third);
            for _ in 0..third {
                let seq: i64 = claim.query_row([], |r| r.get(0)).expect("claim");
                claimed.push(seq);
            }
            let mut ack = c
                .prepare_cached("DELETE FROM q WHERE seq = ?1")
                .expect("ack");
            for seq in claimed {
                ack.execute([seq]).expect("ack");
            }
        }
        c.execute_batch("COMMIT").expect("commit");
        items += third as u64;
    }
    let bare = Bare {
        rate: items as f64 / t.elapsed().as_secs_f64(),
        cpu_per_item: (cpu_time(std::process::id()) - cpu) / items.max(1) as u32,
        written_per_item: (bytes_written() - written) as f64 / items.max(1) as f64,
    };
    drop(c);
    for ext in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{ext}", path.display()));
    }
    bare
}

/// Bytes process `pid` has had written to storage so far (`write_bytes` of /proc/PID/io:
/// file writes, the WAL's frames and checkpoints, not socket traffic).
pub fn storage_written(pid: u32) -> u64 {
    io_count(&format!("/proc/{pid}/io"), "write_bytes:")
}

/// One count of a /proc/…/io file (0 when it cannot be read).
fn io_count(path: &str, field: &str) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Bytes this process has written through `write` and `pwrite` so far (`wchar` in
/// /proc/self/io): what a SQLite transaction puts in its WAL, repeatable where timings are not.
pub fn bytes_written() -> u64 {
    io_count("/proc/self/io", "wchar:")
}

/// Bytes the calling thread has written through `write` and `pwrite` so far (`wchar` in
/// /proc/thread-self/io): a SQLite writer thread's WAL frames and checkpoints.
pub fn thread_bytes_written() -> u64 {
    io_count("/proc/thread-self/io", "wchar:")
}

/// Bytes written through `write` and `pwrite` so far by the threads of process `pid` whose
/// name starts with `name` (`wchar` of each one's /proc `io`).
fn threads_bytes_written(pid: u32, name: &str) -> u64 {
    threads(pid, name)
        .iter()
        .map(|t| io_count(&t.join("io").to_string_lossy(), "wchar:"))
        .sum()
}

/// Bytes the SQLite writer thread of the weir process `pid` has written so far.
pub fn writer_bytes_written(pid: u32) -> u64 {
    threads_bytes_written(pid, WRITER_THREAD)
}

/// What a SQLite transaction wrote, `bytes` over `transactions`, in KiB and in WAL frames
/// (a 4 KiB page and its 24-byte header each; checkpoints, which copy pages back into the
/// database file now and then, are counted in too).
pub fn per_transaction_written(bytes: u64, transactions: u64) -> String {
    let each = bytes as f64 / transactions.max(1) as f64;
    format!(
        "{:.1} KiB written a transaction (about {:.1} pages)",
        each / 1024.0,
        each / (4096.0 + 24.0)
    )
}

/// The transactions in the write-ahead log of the SQLite file `db`, page by page: what each
/// b-tree (table or index, by its name; page 1 is `sqlite_schema`'s) costs a transaction in
/// pages. Read while the engine runs (a clean stop checkpoints the log away): the frames of
/// the log's current round, up to its last commit, each page named by the b-tree it is in
/// now (pages outside every tree, or overflow pages: "(free list)"). `None` when there is no
/// log or no commit in it.
pub fn wal_pages(db: &Path) -> Option<WalPages> {
    let wal = std::fs::read(format!("{}-wal", db.display())).ok()?;
    let word = |b: &[u8], at: usize| u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    if wal.len() < 32 || word(&wal, 0) & !1 != 0x377f_0682 {
        return None;
    }
    let page = word(&wal, 8) as usize;
    let salts = (word(&wal, 16), word(&wal, 20));
    // Each frame: page number, the database's size after a commit (0 for the other frames
    // of a transaction), the log's salts, checksums; then the page.
    let (mut counted, mut pending, mut transactions) = (Vec::<u32>::new(), Vec::new(), 0u64);
    let mut at = 32;
    while at + 24 + page <= wal.len() && (word(&wal, at + 8), word(&wal, at + 12)) == salts {
        pending.push(word(&wal, at));
        if word(&wal, at + 4) != 0 {
            counted.append(&mut pending);
            transactions += 1;
        }
        at += 24 + page;
    }
    if transactions == 0 {
        return None;
    }
    // Each page as the last commit left it: its newest frame in the log, else the file.
    let mut newest = std::collections::HashMap::new();
    let mut at = 32;
    let last = 32 + counted.len() * (24 + page);
    while at < last {
        newest.insert(word(&wal, at), at + 24);
        at += 24 + page;
    }
    let file = std::fs::read(db).ok()?;
    let read = |n: u32| -> Option<&[u8]> {
        match newest.get(&n) {
            Some(&at) => wal.get(at..at + page),
            None => file.get((n as usize).checked_sub(1)? * page..n as usize * page),
        }
    };
    // The b-trees by their roots (page 1 is the schema's), each walked down its interior
    // pages (a table's 0x05, an index's 0x02: a child's number in each cell, and the
    // rightmost child in the header). This build of SQLite has no `dbstat` to ask.
    let c = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .ok()?;
    let mut roots = vec![("sqlite_schema".to_string(), 1u32)];
    let mut q = c
        .prepare("SELECT name, rootpage FROM sqlite_schema WHERE rootpage > 0")
        .ok()?;
    roots.extend(
        q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .ok()?
            .flatten(),
    );
    let mut owner = std::collections::HashMap::new();
    for (name, root) in roots {
        let mut todo = vec![root];
        while let Some(n) = todo.pop() {
            let Some(p) = read(n) else { continue };
            if owner.insert(n, name.clone()).is_some() {
                continue;
            }
            // The log is read as it is being written: a page that does not parse is left
            // unwalked rather than read out of bounds.
            let h = if n == 1 { 100 } else { 0 };
            let short = |at: usize| p.get(at..at + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
            let long = |at: usize| p.get(at..at + 4).map(|b| word(b, 0));
            if matches!(p.get(h), Some(0x05 | 0x02)) {
                let cells = short(h + 3).unwrap_or(0) as usize;
                todo.extend(long(h + 8));
                for i in 0..cells {
                    todo.extend(short(h + 12 + 2 * i).and_then(|at| long(at as usize)));
                }
            }
        }
    }
    let mut by_tree = std::collections::BTreeMap::<String, u64>::new();
    for p in &counted {
        let name = owner
            .get(p)
            .cloned()
            .unwrap_or_else(|| "(free list)".into());
        *by_tree.entry(name).or_default() += 1;
    }
    let mut by_tree: Vec<(String, f64)> = by_tree
        .into_iter()
        .map(|(name, n)| (name, n as f64 / transactions as f64))
        .collect();
    by_tree.sort_by(|a, b| b.1.total_cmp(&a.1));
    Some(WalPages {
        transactions,
        frames: counted.len() as u64,
        by_tree,
    })
}

/// What [`wal_pages`] read.
#[derive(Debug)]
pub struct WalPages {
    pub transactions: u64,
    pub frames: u64,
    /// Pages a transaction, by b-tree, most first.
    pub by_tree: Vec<(String, f64)>,
}

impl std::fmt::Display for WalPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} pages a transaction over the log's last {} transactions:",
            self.frames as f64 / self.transactions.max(1) as f64,
            self.transactions
        )?;
        for (i, (name, n)) in self.by_tree.iter().enumerate() {
            write!(f, "{} {name} {n:.2}", if i == 0 { "" } else { "," })?;
        }
        Ok(())
    }
}

/// Resident memory of process `pid` now and at its peak (VmRSS, VmHWM), in KiB.
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU time process `pid` has used so far (user + system).
pub fn cpu_time(pid: u32) -> std::time::Duration {
    stat_cpu(&format!("/proc/{pid}/stat"))
}

/// The calling thread's CPU time (user + system).
pub fn thread_cpu_time() -> Duration {
    stat_cpu("/proc/thread-self/stat")
}

/// The /proc directories of the threads of process `pid` whose name starts with `name` (as
/// the kernel keeps it: at most 15 bytes, so `weir-sqlite-wri` for the SQLite writer; `""`
/// for all of them); none when the process is gone.
fn threads(pid: u32, name: &str) -> Vec<std::path::PathBuf> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .map(|t| t.path())
        .filter(|t| std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.starts_with(name)))
        .collect()
}

/// CPU time used so far by the threads of process `pid` whose name starts with `name`.
pub fn threads_cpu_time(pid: u32, name: &str) -> Duration {
    threads(pid, name)
        .iter()
        .map(|t| stat_cpu(&t.join("stat").to_string_lossy()))
        .sum()
}

/// The time the threads of `pid` whose name starts with `name` have spent ready to run but
/// waiting for a core (the second field of each one's /proc `schedstat`, nanoseconds), or
/// `None` where the kernel keeps no such count.
pub fn threads_runqueue_wait(pid: u32, name: &str) -> Option<Duration> {
    threads(pid, name)
        .iter()
        .map(|t| {
            let s = std::fs::read_to_string(t.join("schedstat")).ok()?;
            let waited: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
            Some(Duration::from_nanos(waited))
        })
        .sum()
}

/// User + system time from a `stat` file of /proc (a process's or a thread's).
fn stat_cpu(path: &str) -> Duration {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    // After ')': the state letter, then ppid … cmajflt, utime, stime (fields 14 and 15).
    let f: Vec<i64> = rest
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let ticks = f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0);
    // Clock ticks are 1/100 s on Linux.
    Duration::from_millis(ticks.max(0) as u64 * 10)
}

/// The whole machine's CPU time so far, from the first line of /proc/stat: time busy (user,
/// nice, system, interrupts, steal) and time in all (busy plus idle and I/O wait), summed
/// over every core. Two readings' difference says how many cores a run kept busy.
pub fn machine_cpu() -> (Duration, Duration) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let busy = at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
    let all = busy + at(3) + at(4);
    // Clock ticks are 1/100 s on Linux.
    (
        Duration::from_millis(busy * 10),
        Duration::from_millis(all * 10),
    )
}

/// CPU time over a run: of each process watched, and of the whole machine.
#[derive(Debug, Clone)]
pub struct CpuUse {
    /// Each watched process's CPU time (user + system, every thread), in the order given.
    pub of: Vec<Duration>,
    /// The machine's time busy, and in all, summed over its cores (see [`machine_cpu`]).
    pub busy: Duration,
    pub all: Duration,
}

impl CpuUse {
    /// A reading now, for `pids`; `since` makes it the CPU used from then.
    pub fn now(pids: &[u32]) -> CpuUse {
        let (busy, all) = machine_cpu();
        CpuUse {
            of: pids.iter().map(|p| cpu_time(*p)).collect(),
            busy,
            all,
        }
    }

    /// What was used from the reading `self` until now, for the same `pids`.
    pub fn since(&self, pids: &[u32]) -> CpuUse {
        let n = CpuUse::now(pids);
        CpuUse {
            // Saturating: a process gone since reads as no time at all.
            of: n
                .of
                .iter()
                .zip(&self.of)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
            busy: n.busy.saturating_sub(self.busy),
            all: n.all.saturating_sub(self.all),
        }
    }

    /// The machine's cores kept busy on average: its busy share of the time, times every CPU
    /// the kernel counts. Under a CPU quota that is more than [`cores`] (which honours the
    /// quota), and the figure is the whole machine's, not the quota's.
    pub fn cores_busy(&self) -> f64 {
        kernel_cpus() as f64 * self.busy.as_secs_f64() / self.all.as_secs_f64().max(1e-9)
    }
}

/// The cores this process may use (a cgroup's CPU quota or affinity mask counted).
pub fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

/// The CPUs the kernel counts in /proc/stat (`cpu0`, `cpu1`, …), whatever the quota.
pub fn kernel_cpus() -> usize {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count()
        .max(1)
}

/// The bare Redis Streams ceiling: `batch` XADDs pipelined, one XREADGROUP of them, and one
/// XACK + XDEL pipeline, `rounds` times, on one connection. Items per second.
pub async fn redis_streams_loop(url: &str, batch: usize, rounds: u64) -> f64 {
    use redis::AsyncCommands;
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let _: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg(&["CREATE", "raw", "g", "0", "MKSTREAM"])
        .query_async(&mut c)
        .await;
    let t = Instant::now();
    for _ in 0..rounds {
        let mut p = redis::pipe();
        for _ in 0..batch {
            p.cmd("XADD")
                .arg("raw")
                .arg("*")
                .arg("id")
                .arg("x")
                .ignore();
        }
        let _: () = p.query_async(&mut c).await.unwrap();
        let r: redis::streams::StreamReadReply = c
            .xread_options(
                &["raw"],
                &[">"],
                &redis::streams::StreamReadOptions::default()
                    .group("g", "c")
                    .count(batch),
            )
            .await
            .unwrap();
        let ids: Vec<String> = r.keys[0].ids.iter().map(|e| e.id.clone()).collect();
        assert_eq!(ids.len(), batch);
        let _: () = redis::pipe()
            .xack("raw", "g", &ids)
            .ignore()
            .xdel("raw", &ids)
            .ignore()
            .query_async(&mut c)
            .await
            .unwrap();
    }
    (rounds * batch as u64) as f64 / t.elapsed().as_secs_f64()
}

/// The Redis server's CPU time so far: its main thread, user + system (where commands,
/// scripts and the append-only file's writes run).
pub async fn redis_server_cpu(url: &str) -> Duration {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut c)
        .await
        .unwrap();
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    let secs = match (
        field("used_cpu_user_main_thread"),
        field("used_cpu_sys_main_thread"),
    ) {
        (Some(u), Some(s)) => u + s,
        // Before Redis 6.2 there is only the whole process's figure.
        _ => field("used_cpu_user").unwrap_or(0.0) + field("used_cpu_sys").unwrap_or(0.0),
    };
    Duration::from_secs_f64(secs)
}

/// The leanest script design for a Redis work queue that still checks a commit the way
/// weir's does, measured as a floor (`redis_lean_scripts`). Unlike weir's backend it keeps no
/// record per item: the stream entry holds the body while the item is ready or in flight,
/// one hash maps each in-flight id to its lease, and a finished item leaves only a short
/// outcome (no body) in one hash. The client sends every key and value already formatted,
/// so the scripts do no per-item string work beyond comparing leases.
const LEAN_ADD: &str = r#"
local P = ARGV[1]
local n = tonumber(ARGV[2])
if redis.call('XLEN', P .. 's') > 100000 then return 'full' end
local ids = {}
for i = 1, n do ids[i] = ARGV[1 + 2 * i] end
local seen = redis.call('ZMSCORE', P .. 'index', unpack(ids))
local scored = {}
for i = 1, n do
  if not seen[i] then
    redis.call('XADD', P .. 's', '*', 'id', ids[i], 'd', '0', 'body', ARGV[2 + 2 * i])
    scored[#scored + 1] = 0
    scored[#scored + 1] = ids[i]
  end
end
if #scored > 0 then redis.call('ZADD', P .. 'index', unpack(scored)) end
return 'ok'
"#;

const LEAN_CLAIM: &str = r#"
local P = ARGV[1]
local r = redis.pcall('XREADGROUP', 'GROUP', 'g', ARGV[2], 'COUNT', ARGV[3], 'STREAMS', P .. 's', '>')
if type(r) == 'table' and r.err then
  redis.call('XGROUP', 'CREATE', P .. 's', 'g', '0', 'MKSTREAM')
  r = redis.call('XREADGROUP', 'GROUP', 'g', ARGV[2], 'COUNT', ARGV[3], 'STREAMS', P .. 's', '>')
end
if not r then return {} end
local entries = r[1][2]
local lease = redis.call('INCRBY', P .. 'lease', #entries) - #entries
local set, out = {}, {}
for i, e in ipairs(entries) do
  lease = lease + 1
  set[2 * i - 1] = e[2][2]
  set[2 * i] = lease
  out[i] = {e[1], e[2][2], lease, tonumber(e[2][4]) + 1, e[2][6]}
end
if #set > 0 then
  -- Kept a hash table, as weir keeps its own (a listpack would be scanned at every access).
  redis.call('HSETNX', P .. 'live', '~', string.rep('.', 1000))
  redis.call('HSET', P .. 'live', unpack(set))
end
return out
"#;

/// ARGV: the prefix, n, then n ids, n leases, n entry ids, n done-marker keys, n outcome
/// pairs (id, outcome).
const LEAN_COMMIT: &str = r#"
local P = ARGV[1]
local n = tonumber(ARGV[2])
local I, L, E, D, O = 3, 3 + n, 3 + 2 * n, 3 + 3 * n, 3 + 4 * n
local cur = redis.call('HMGET', P .. 'live', unpack(ARGV, I, I + n - 1))
for i = 1, n do
  if cur[i] ~= ARGV[L + i - 1] then return 'conflict' end
end
redis.call('HSET', P .. 'out', unpack(ARGV, O, O + 2 * n - 1))
redis.call('HDEL', P .. 'live', unpack(ARGV, I, I + n - 1))
redis.call('XACK', P .. 's', 'g', unpack(ARGV, E, E + n - 1))
redis.call('XDEL', P .. 's', unpack(ARGV, E, E + n - 1))
redis.call('DEL', unpack(ARGV, D, D + n - 1))
local m = redis.call('RPUSH', P .. 'finished', unpack(ARGV, I, I + n - 1))
if m > 10000 + 256 then
  local old = redis.call('LPOP', P .. 'finished', math.min(m - 10000, 1024))
  redis.call('HDEL', P .. 'out', unpack(old))
  redis.call('ZREM', P .. 'index', unpack(old))
end
return 'done'
"#;

/// An item claimed by the lean design: its entry, id, lease, delivery count and body.
type LeanEntry = (String, String, u64, u64, String);

/// The lean design's three calls, on one namespace.
#[derive(Clone)]
struct Lean {
    add: std::sync::Arc<redis::Script>,
    claim: std::sync::Arc<redis::Script>,
    commit: std::sync::Arc<redis::Script>,
    prefix: &'static str,
}

impl Lean {
    fn new(prefix: &'static str) -> Lean {
        Lean {
            add: std::sync::Arc::new(redis::Script::new(LEAN_ADD)),
            claim: std::sync::Arc::new(redis::Script::new(LEAN_CLAIM)),
            commit: std::sync::Arc::new(redis::Script::new(LEAN_COMMIT)),
            prefix,
        }
    }

    async fn add(&self, c: &mut redis::aio::MultiplexedConnection, ids: &[String], body: &str) {
        let mut inv = self.add.prepare_invoke();
        inv.arg(self.prefix).arg(ids.len());
        for id in ids {
            inv.arg(id).arg(body);
        }
        let r: String = inv.invoke_async(c).await.unwrap();
        assert_eq!(r, "ok");
    }

    async fn claim(
        &self,
        c: &mut redis::aio::MultiplexedConnection,
        consumer: &str,
        n: usize,
    ) -> Vec<LeanEntry> {
        self.claim
            .prepare_invoke()
            .arg(self.prefix)
            .arg(consumer)
            .arg(n)
            .invoke_async(c)
            .await
            .unwrap()
    }

    async fn commit(&self, c: &mut redis::aio::MultiplexedConnection, got: &[LeanEntry]) {
        let prefix = self.prefix;
        let mut inv = self.commit.prepare_invoke();
        inv.arg(prefix).arg(got.len());
        for e in got {
            inv.arg(&e.1);
        }
        for e in got {
            inv.arg(e.2);
        }
        for e in got {
            inv.arg(&e.0);
        }
        for e in got {
            inv.arg(format!("{prefix}done:{}", e.1));
        }
        for e in got {
            inv.arg(&e.1)
                .arg(format!("finished {} {} ok", weir_queue::now_ms(), e.3));
        }
        let r: String = inv.invoke_async(c).await.unwrap();
        assert_eq!(r, "done", "no commit of the lean design conflicts");
    }
}

/// Where a run's ids for the lean design start: past any earlier run's on the same server
/// (an id already indexed would be taken for a retried add and skipped).
fn lean_first_id() -> u64 {
    weir_queue::now_ms() as u64 * 1_000_000
}

/// `n` ids for the lean design, numbered on from `next`.
fn lean_ids(next: &mut u64, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            *next += 1;
            format!("{next:026}")
        })
        .collect()
}

/// The leanest script design (see [`LEAN_ADD`]) run as the bare loop is: `batch` items
/// added in one call, claimed in one, committed in one, `rounds` times, with `body` as each
/// item's body. Items per second; every commit must succeed.
pub async fn redis_lean_scripts(url: &str, body: &str, batch: usize, rounds: u64) -> f64 {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let lean = Lean::new("{lean}:");
    let mut next = lean_first_id();
    let t = Instant::now();
    for _ in 0..rounds {
        lean.add(&mut c, &lean_ids(&mut next, batch), body).await;
        let got = lean.claim(&mut c, "c", batch).await;
        assert_eq!(got.len(), batch, "every item added is claimed");
        lean.commit(&mut c, &got).await;
    }
    (rounds * batch as u64) as f64 / t.elapsed().as_secs_f64()
}

/// A queue as the pipelined load drives it (see [`drive_pipelined`]).
pub trait Pipelined: Clone + Send + Sync + 'static {
    /// What one claim hands out, committed as a whole.
    type Unit: Send + 'static;
    /// Add one batch.
    fn add(&self) -> impl std::future::Future<Output = ()> + Send;
    /// Claim for consumer `i` (0 or 1); nothing when nothing is ready (after a wait, so
    /// that the consumer does not spin).
    fn claim(&self, i: usize) -> impl std::future::Future<Output = Vec<Self::Unit>> + Send;
    /// Commit one unit, which must succeed: the items it carried.
    fn commit(&self, u: Self::Unit) -> impl std::future::Future<Output = usize> + Send;
}

/// Under load, as the engine runs a queue: a producer adds `batches` batches of `batch`
/// while fewer than `ahead` batches are in flight (the backlog bounded, as the engine's is,
/// so the figure is a sustained rate, not a burst into memory), and two consumers (the
/// executor keeps two claims waiting) claim what is ready and commit each unit in a task of
/// its own, all at once. The time until every item was committed, once; a run where no
/// item is committed for 30 s fails, saying how many were, rather than waiting forever.
pub async fn drive_pipelined<Q: Pipelined>(
    q: Q,
    batches: u64,
    batch: usize,
    ahead: usize,
) -> Duration {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let total = batches as usize * batch;
    let room = std::sync::Arc::new(tokio::sync::Semaphore::new(ahead * batch));
    let done = std::sync::Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    let producer = {
        let (q, room) = (q.clone(), room.clone());
        tokio::spawn(async move {
            for _ in 0..batches {
                room.acquire_many(batch as u32).await.unwrap().forget();
                q.add().await;
            }
        })
    };
    let consumers: Vec<_> = (0..2)
        .map(|i| {
            let (q, room, done) = (q.clone(), room.clone(), done.clone());
            tokio::spawn(async move {
                let mut commits = tokio::task::JoinSet::new();
                while done.load(Ordering::Acquire) < total {
                    for u in q.claim(i).await {
                        let (q, room, done) = (q.clone(), room.clone(), done.clone());
                        commits.spawn(async move {
                            let n = q.commit(u).await;
                            done.fetch_add(n, Ordering::AcqRel);
                            room.add_permits(n);
                        });
                    }
                    while let Some(r) = commits.try_join_next() {
                        r.unwrap();
                    }
                }
                while let Some(r) = commits.join_next().await {
                    r.unwrap();
                }
            })
        })
        .collect();
    let mut seen = (0, Instant::now());
    for mut c in consumers {
        loop {
            tokio::select! {
                r = &mut c => {
                    r.unwrap();
                    break;
                }
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    let now = done.load(Ordering::Acquire);
                    if now != seen.0 {
                        seen = (now, Instant::now());
                    }
                    assert!(
                        seen.1.elapsed() < Duration::from_secs(30),
                        "no item committed for 30 s: {now} of {total}"
                    );
                }
            }
        }
    }
    let took = t.elapsed();
    producer.await.unwrap();
    assert_eq!(
        done.load(Ordering::Acquire),
        total,
        "every item added was claimed and committed once"
    );
    took
}

/// The item the queue benchmarks journal: a small cascade, as a webhook's would be.
pub fn queue_item() -> weir_queue::WorkItem {
    weir_queue::WorkItem::cascade(
        "bench",
        "in",
        "bench",
        vec![serde_json::json!({ "payload": { "n": 1 } })],
    )
}

/// weir's queue driven by [`drive_pipelined`] as the engine runs it: adds of `batch` items,
/// claims of up to `batch`, and each claimed item committed on its own (as its wave would
/// be), acknowledged with nothing else written.
#[derive(Clone)]
pub struct QueuePipe {
    q: std::sync::Arc<dyn weir_queue::WorkQueue>,
    batch: usize,
}

impl QueuePipe {
    pub fn new(q: std::sync::Arc<dyn weir_queue::WorkQueue>, batch: usize) -> Self {
        QueuePipe { q, batch }
    }
}

impl Pipelined for QueuePipe {
    type Unit = weir_queue::Claimed;

    async fn add(&self) {
        self.q
            .add((0..self.batch).map(|_| queue_item()).collect())
            .await
            .unwrap();
    }

    async fn claim(&self, _: usize) -> Vec<weir_queue::Claimed> {
        self.q
            .claim("bench", self.batch, Duration::from_millis(20))
            .await
            .unwrap()
    }

    async fn commit(&self, c: weir_queue::Claimed) -> usize {
        let r = self
            .q
            .commit(&c, weir_queue::WaveEffects::ending(weir_queue::End::Ack))
            .await
            .unwrap();
        assert_eq!(r, weir_queue::Committed::Done);
        1
    }
}

/// The lean design driven by [`drive_pipelined`]: each claim's items committed in one call.
#[derive(Clone)]
struct LeanPipe {
    lean: Lean,
    c: redis::aio::MultiplexedConnection,
    body: std::sync::Arc<str>,
    batch: usize,
    next: std::sync::Arc<std::sync::Mutex<u64>>,
}

impl Pipelined for LeanPipe {
    type Unit = Vec<LeanEntry>;

    async fn add(&self) {
        let ids = lean_ids(&mut self.next.lock().unwrap(), self.batch);
        self.lean.add(&mut self.c.clone(), &ids, &self.body).await;
    }

    async fn claim(&self, i: usize) -> Vec<Vec<LeanEntry>> {
        let got = self
            .lean
            .claim(&mut self.c.clone(), ["c0", "c1"][i], self.batch)
            .await;
        if got.is_empty() {
            tokio::time::sleep(Duration::from_micros(200)).await;
            return Vec::new();
        }
        vec![got]
    }

    async fn commit(&self, got: Vec<LeanEntry>) -> usize {
        self.lean.commit(&mut self.c.clone(), &got).await;
        got.len()
    }
}

/// The lean design pipelined as weir's pipelined case is ([`drive_pipelined`]), each
/// claim's items committed in one call. Items per second; every commit must succeed.
pub async fn redis_lean_pipelined(
    url: &str,
    body: &str,
    batch: usize,
    rounds: u64,
    ahead: usize,
) -> f64 {
    let client = redis::Client::open(url).unwrap();
    let q = LeanPipe {
        lean: Lean::new("{leanp}:"),
        c: client.get_multiplexed_async_connection().await.unwrap(),
        body: body.into(),
        batch,
        next: std::sync::Arc::new(std::sync::Mutex::new(lean_first_id())),
    };
    let took = drive_pipelined(q, rounds, batch, ahead).await;
    (rounds as usize * batch) as f64 / took.as_secs_f64()
}

/// The SQLite writer thread so far: its CPU time, and the time spent inside its COMMITs.
pub struct Writer {
    at: Instant,
    cpu: Duration,
    /// Ready to run, waiting for a core.
    runqueue: Option<Duration>,
    in_commit: f64,
    /// Writes answered, and their time from request to durable answer, summed.
    writes: f64,
    waited: f64,
    /// The same for the events journaled alone (what a request's answer waits for; a
    /// wave's commit is sent once the answer is on its way).
    journaled: f64,
    journal_waited: f64,
    /// Bytes the writer thread has written (its WAL frames and checkpoints).
    written: u64,
}

impl Writer {
    /// The writer of the engine whose admin API is at `base`, in process `pid`.
    pub async fn now(base: &str, pid: u32) -> Writer {
        let m = |name| crate::metric_sum_f64(base, name, &[]);
        let journal = |name| crate::metric_sum_f64(base, name, &[r#"write="journal""#]);
        Writer {
            at: Instant::now(),
            cpu: threads_cpu_time(pid, WRITER_THREAD),
            runqueue: threads_runqueue_wait(pid, WRITER_THREAD),
            in_commit: m("weir_sqlite_commit_seconds_sum").await,
            writes: m("weir_sqlite_wait_seconds_count").await,
            waited: m("weir_sqlite_wait_seconds_sum").await,
            journaled: journal("weir_sqlite_wait_seconds_count").await,
            journal_waited: journal("weir_sqlite_wait_seconds_sum").await,
            written: writer_bytes_written(pid),
        }
    }

    /// How busy the writer was since `self`, the share of the time inside COMMIT, each
    /// COMMIT's time, and how long a write waited. Every event is written twice (its
    /// journaling, its wave's commit) and every request waits for the first, so a writer
    /// near 100 % is the chain every request waits on. A COMMIT's time is partly CPU (its
    /// fdatasync's, `fsync_cpu` each, counted once). Claims are not writes here: they wait
    /// for work by design.
    pub fn since(self, now: &Writer, committed: u64, fsync_cpu: Duration) -> String {
        let wall = (now.at - self.at).as_secs_f64();
        let waited = self.waited(now).as_secs_f64() * 1e6;
        let cpu = (now.cpu - self.cpu).as_secs_f64() / wall;
        let commit = (now.in_commit - self.in_commit) / wall;
        let fsyncs = committed as f64 * fsync_cpu.as_secs_f64() / wall;
        let cycle = wall * 1e6 / committed.max(1) as f64;
        // Time the writer was ready but the cores were taken: it lengthens its COMMITs (an
        // fsync's end is noticed only once the thread runs again) and its SQL alike.
        let for_a_core = match (self.runqueue, now.runqueue) {
            (Some(a), Some(b)) => format!(
                ", waiting for a core {:.0} % of the time ({:.0} µs a transaction)",
                (b - a).as_secs_f64() / wall * 100.0,
                (b - a).as_secs_f64() * 1e6 / committed.max(1) as f64
            ),
            _ => String::new(),
        };
        format!(
            "  the SQLite writer: busy about {:.0} % of the time (on the CPU {:.0} %, inside COMMIT {:.0} %, {:.0} µs a COMMIT, its fdatasync included{for_a_core}); a transaction every {cycle:.0} µs, and a write (journaling, commit) waited {waited:.0} µs for its durable answer, {:.1} transactions' time; {}",
            ((cpu + commit - fsyncs) * 100.0).clamp(0.0, 100.0),
            cpu * 100.0,
            commit * 100.0,
            commit * wall * 1e6 / committed.max(1) as f64,
            waited / cycle,
            per_transaction_written(now.written.saturating_sub(self.written), committed)
        )
    }

    /// How long a write (journaling, commit) waited for its durable answer since `self`, on
    /// average.
    pub fn waited(&self, now: &Writer) -> Duration {
        let each = (now.waited - self.waited) / (now.writes - self.writes).max(1.0);
        Duration::from_secs_f64(each.max(0.0))
    }

    /// How long an event's journaling waited for its durable answer since `self`, on
    /// average: the part of a request's round trip spent waiting for the writer. (A wave's
    /// commit, sent once the answer is on its way, is not part of it; on the echo load the
    /// journalings waited about a tenth longer than all writes on average.)
    pub fn journal_waited(&self, now: &Writer) -> Duration {
        let each =
            (now.journal_waited - self.journal_waited) / (now.journaled - self.journaled).max(1.0);
        Duration::from_secs_f64(each.max(0.0))
    }
}

/// Where a request's round trip went, for a server whose writes are made durable by one
/// writer: `connections` each waiting for its answer at `rate` requests a second, each
/// request's durable write waiting `waited`. What is outside the writer is the HTTP
/// exchange, the server's own work and its turns on the cores.
pub fn round_trip(connections: usize, rate: f64, waited: Duration) -> String {
    let trip = connections as f64 * 1e6 / rate.max(1.0);
    let waited = waited.as_secs_f64() * 1e6;
    format!(
        "a round trip {trip:.0} µs: {waited:.0} waiting for the durable write, {:.0} outside the writer",
        trip - waited
    )
}

/// The SQLite writer's thread name, as the kernel keeps it (15 bytes).
const WRITER_THREAD: &str = "weir-sqlite-wri";

/// Transactions the SQLite writer of the engine at `base` has committed so far.
pub async fn transactions(base: &str) -> u64 {
    crate::metric_sum(base, "weir_sqlite_transactions_total", &[]).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 16 connections at 16,000 requests a second take 1 ms a round trip each; what the
    /// durable write did not take of it was spent outside the writer.
    #[test]
    fn a_round_trip_is_split_at_the_durable_write() {
        assert_eq!(
            round_trip(16, 16_000.0, Duration::from_micros(600)),
            "a round trip 1000 µs: 600 waiting for the durable write, 400 outside the writer"
        );
    }

    /// The log's transactions are counted and each page is named by its b-tree: a table
    /// with an index, written a row a transaction, writes a page of each a transaction
    /// (while neither splits), and nothing of other tables.
    #[test]
    fn the_log_is_read_transaction_by_transaction_and_page_by_tree() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        let c = rusqlite::Connection::open(&db).unwrap();
        c.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0))
            .unwrap();
        c.execute_batch(
            "PRAGMA wal_autocheckpoint=0;
             CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT);
             CREATE INDEX t_v ON t (v);
             CREATE TABLE other (x);",
        )
        .unwrap();
        // Trees of more than one level, so that their newest pages are found by walking down
        // from their roots; then a round of the log of its own.
        c.execute_batch(
            "WITH RECURSIVE n(k) AS (SELECT 1 UNION ALL SELECT k + 1 FROM n WHERE k < 3000)
             INSERT INTO t SELECT k, printf('%0100d', k) FROM n",
        )
        .unwrap();
        c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        for k in 0..20 {
            c.execute("INSERT INTO t VALUES (?1 + 5000, 'v')", [k])
                .unwrap();
        }
        let got = wal_pages(&db).expect("a log with commits");
        assert_eq!(got.transactions, 20, "{got}");
        let of = |name: &str| {
            got.by_tree
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0.0, |(_, x)| *x)
        };
        assert_eq!((of("t"), of("t_v")), (1.0, 1.0), "{got}");
        assert_eq!(of("other"), 0.0, "{got}");
        assert_eq!(
            got.frames,
            40 + (of("sqlite_schema") * 20.0).round() as u64,
            "{got}"
        );
        drop(c);
        assert!(wal_pages(&dir.path().join("none.db")).is_none());
    }

    /// The benches' "cores busy" scales the machine's busy share by the CPUs /proc/stat
    /// lists: it must find them all (at least the cores this process may use).
    #[test]
    fn the_kernel_counts_at_least_the_cores_this_process_may_use() {
        assert!(
            kernel_cpus() >= cores() as usize,
            "{} < {}",
            kernel_cpus(),
            cores()
        );
        let before = CpuUse::now(&[std::process::id()]);
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(300) {
            std::hint::black_box(t.elapsed());
        }
        let busy = before.since(&[std::process::id()]).cores_busy();
        // This thread spun the whole time: at least most of one core was busy.
        assert!(busy > 0.5 && busy <= kernel_cpus() as f64 + 0.01, "{busy}");
    }
}
