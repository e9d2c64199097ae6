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

/// A redis-server this test owns, with the append-only file on and fsynced on every write
/// (weir's recommended settings), in a temporary directory.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut s = RedisServer {
            port: free_port(),
            dir,
            child: None,
        };
        s.restart();
        s
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
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
        assert!(self.child.is_none(), "the server is already running");
        let log: PathBuf = self.dir.path().join("redis.log");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--dir", &self.dir.path().display().to_string()])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--save", ""])
            .args(["--logfile", &log.display().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts (install it: apt-get install redis-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                let mut buf = [0u8; 64];
                if s.write_all(b"PING\r\n").is_ok()
                    && matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
                {
                    return;
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
            // Three different ports (a port just freed can be handed out again).
            let port = (0..100)
                .map(|_| free_cluster_port())
                .find(|p| !c.ports.contains(p))
                .expect("three different free ports");
            let d = c.dir.path().join(format!("node-{i}"));
            std::fs::create_dir(&d).expect("node directory");
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string()])
                .args(["--bind", "127.0.0.1"])
                .args(["--dir", &d.display().to_string()])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "5000"])
                .args(["--appendonly", "yes", "--appendfsync", "always"])
                .args(["--save", ""])
                .args(["--logfile", &d.join("redis.log").display().to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server starts (install it: apt-get install redis-server)");
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
