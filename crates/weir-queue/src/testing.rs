//! A real redis-server for tests: started on a free loopback port with its own directory,
//! stopped by PID when dropped. Never a fixed port, never the machine's shared server.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free port on 127.0.0.1 (the listener is closed again before the port is used).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Whether process `pid` holds a socket listening on TCP port `port` (read from `/proc`).
/// A free port is only free when it is probed: another test's server may bind it first,
/// and then ours fails to start while the port answers all the same, so that two tests
/// would share one server. A server is ours once this holds.
pub fn listens_on(pid: u32, port: u16) -> bool {
    if !Path::new("/proc/net/tcp").exists() {
        // No /proc (not Linux): whoever answers on the port, as before this check.
        return std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let sockets: std::collections::HashSet<String> = fds
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let local_port = f
                    .get(1)
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|h| u16::from_str_radix(h, 16).ok());
                // State 0A is LISTEN; field 9 the socket's inode.
                local_port == Some(port)
                    && f.get(3) == Some(&"0A")
                    && f.get(9).is_some_and(|i| sockets.contains(*i))
            })
    })
}

/// `child` once it listens on `port`. When it exits without doing so (the port was taken,
/// or it failed to start) or `within` passes first, it is killed and reaped, and `None`.
pub fn listening(mut child: Child, port: u16, within: Duration) -> Option<Child> {
    let deadline = Instant::now() + within;
    loop {
        if listens_on(child.id(), port) {
            return Some(child);
        }
        if matches!(child.try_wait(), Ok(Some(_))) || Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Appends to the log file at `path`: a server's stderr, where it says why it did not start
/// (a bad option, say) before it opens its own log, which it also writes in append mode.
pub fn append_to(path: &Path) -> Stdio {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_or_else(|_| Stdio::null(), Stdio::from)
}

/// The last `n` lines of the text file at `path` (a server's log, for a failure message).
pub fn file_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A redis-server this test owns, with the append-only file on and fsynced on every write
/// (weir's recommended settings), in a temporary directory.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// Further arguments to redis-server, and the password they set, if any.
    extra: Vec<String>,
    password: Option<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A server that asks for `password` and, as a stock one does, keeps no append-only
    /// file; [`url`](Self::url) holds the password.
    pub fn start_with_password(password: &str) -> RedisServer {
        let mut s = Self::start_with(&["--requirepass", password, "--appendonly", "no"]);
        s.password = Some(password.into());
        s
    }

    /// A server with further arguments to redis-server (later ones win over weir's).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut s = RedisServer {
            port: free_port(),
            dir,
            child: None,
            extra: extra.iter().map(|a| a.to_string()).collect(),
            password: None,
        };
        // A port another test's server took between the probe and ours: another port.
        for _ in 0..5 {
            if s.spawn() {
                return s;
            }
            s.port = free_port();
        }
        panic!(
            "redis-server listened on none of five free ports (each taken, or it failed to \
             start); its log ends:\n{}",
            file_tail(&s.dir.path().join("redis.log"), 20)
        );
    }

    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/", self.port),
            None => format!("redis://127.0.0.1:{}/", self.port),
        }
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Start the server again (on the same port and files) after [`stop`](Self::stop).
    pub fn restart(&mut self) {
        assert!(
            self.spawn(),
            "redis-server could not listen on port {} again (taken by another process, or it failed to start); see {}",
            self.port,
            self.dir.path().join("redis.log").display()
        );
    }

    /// Start the server on `self.port`; false when another process holds that port.
    fn spawn(&mut self) -> bool {
        assert!(self.child.is_none(), "the server is already running");
        let log: PathBuf = self.dir.path().join("redis.log");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--dir", &self.dir.path().display().to_string()])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--save", ""])
            .args(["--logfile", &log.display().to_string()])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(append_to(&log))
            .spawn()
            .expect("redis-server starts (install it: apt-get install redis-server)");
        let Some(child) = listening(child, self.port, Duration::from_secs(10)) else {
            return false;
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                let mut buf = [0u8; 64];
                if s.write_all(b"PING\r\n").is_ok()
                    && matches!(s.read(&mut buf), Ok(n)
                        if buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"))
                {
                    return true;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not come up; see {}",
                self.port,
                log.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kill the server (SIGKILL, by PID) and wait for it to be gone.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A free port `p` on 127.0.0.1 whose cluster bus port `p + 10000` is free too.
fn free_cluster_port() -> u16 {
    for _ in 0..200 {
        let p = free_port();
        if p <= 55_535 && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return p;
        }
    }
    panic!("no free pair of loopback ports (p, p + 10000) for a cluster node");
}

/// A three-node Redis Cluster this test owns (no replicas), each node a redis-server with
/// the append-only file fsynced on every write, in a temporary directory; stopped by PID.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    dir: tempfile::TempDir,
    children: Vec<Child>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut c = RedisCluster {
            ports: Vec::new(),
            dir,
            children: Vec::new(),
        };
        for i in 0..3 {
            // A port another test's server took between the probe and ours: another port
            // (and fresh files for it).
            let mut last_log = PathBuf::new();
            let (port, child) = (0..5)
                .find_map(|attempt| {
                    let d = c.dir.path().join(format!("node-{i}-{attempt}"));
                    std::fs::create_dir(&d).expect("node directory");
                    last_log = d.join("redis.log");
                    // Three different ports (a port just freed can be handed out again).
                    let port = (0..100)
                        .map(|_| free_cluster_port())
                        .find(|p| !c.ports.contains(p))
                        .expect("three different free ports");
                    let child = Self::spawn_node(port, &d);
                    Some((port, listening(child, port, Duration::from_secs(10))?))
                })
                .unwrap_or_else(|| {
                    panic!(
                        "a cluster node listened on none of five free ports (each taken, or it \
                         failed to start); its log ends:\n{}",
                        file_tail(&last_log, 20)
                    )
                });
            c.children.push(child);
            c.ports.push(port);
        }
        for &p in &c.ports {
            c.wait_for(p, b"PING\r\n", b"+PONG");
        }
        let nodes: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli runs (it comes with redis-server: apt-get install redis-tools)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for &p in &c.ports {
            c.wait_for(p, b"CLUSTER INFO\r\n", b"cluster_state:ok");
        }
        c
    }

    /// One node of the cluster on `port`, its files in `dir`.
    fn spawn_node(port: u16, dir: &Path) -> Child {
        Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--dir", &dir.display().to_string()])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-config-file", "nodes.conf"])
            .args(["--cluster-node-timeout", "5000"])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--save", ""])
            .args(["--logfile", &dir.join("redis.log").display().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(append_to(&dir.join("redis.log")))
            .spawn()
            .expect("redis-server starts (install it: apt-get install redis-server)")
    }

    /// The nodes' process ids.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.id()).collect()
    }

    /// `redis-cluster://` with every node.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis-cluster://{}", nodes.join(","))
    }

    /// Until node `port` answers `ask` with something containing `want`.
    fn wait_for(&self, port: u16, ask: &[u8], want: &[u8]) {
        use std::io::{Read, Write};
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                let mut buf = [0u8; 4096];
                if s.write_all(ask).is_ok() {
                    if let Ok(n) = s.read(&mut buf) {
                        if buf[..n].windows(want.len()).any(|w| w == want) {
                            return;
                        }
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "cluster node {port} never answered {} with {}; see {}",
                String::from_utf8_lossy(ask).trim(),
                String::from_utf8_lossy(want),
                self.dir.path().display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_that_answers_is_not_taken_for_a_server_of_ours() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens_on(std::process::id(), port), "this process listens");
        let ours = RedisServer::start();
        assert!(listens_on(ours.pid().unwrap(), ours.port));
        assert!(
            !listens_on(std::process::id(), ours.port),
            "not this process"
        );
        // A second server sent to the first one's port cannot bind it, while the port goes
        // on answering: only the process check tells the two apart.
        let late = Command::new("redis-server")
            .args(["--port", &ours.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        assert!(std::net::TcpStream::connect(("127.0.0.1", ours.port)).is_ok());
        assert!(listening(late, ours.port, Duration::from_secs(10)).is_none());
    }
}
