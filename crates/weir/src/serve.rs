//! The HTTP listeners. Each connection is served by hyper with a bound on how long its
//! request head may take and how long it may sit idle, and the open connections of a
//! listener are bounded: at the bound, the connection idle the longest is closed to make room,
//! so a flood of half-sent or idle connections never starves `/healthz` or the admin API of
//! file descriptors. A connection in the middle of a request is never closed for room.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How the HTTP listeners bound their clients ([`crate::EngineBuilder::http_limits`]).
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Open connections per listener. At the bound, the longest-idle connection is closed
    /// for a new one; when every connection is inside a request, the new one is refused.
    pub max_connections: usize,
    /// How long a client may take to send a request's head (its line and headers).
    pub header_timeout: Duration,
    /// How long a kept-alive connection may sit between requests.
    pub idle_timeout: Duration,
    /// How long an admin request may take, and a webhook's body to arrive.
    pub request_timeout: Duration,
    /// The largest body of an admin request or the dashboard's login form.
    pub max_admin_body: usize,
    /// The largest input of a run started by hand (`POST /api/flows/{id}/runs`).
    pub max_run_input: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(30),
            max_admin_body: 64 << 10,
            max_run_input: 1 << 20,
        }
    }
}

impl HttpLimits {
    /// The connection bound each of `listeners` may have with the process's file
    /// descriptors: past the soft limit, `accept` fails and nothing answers at all.
    pub(crate) fn fitted(mut self, listeners: usize) -> Self {
        if let Some(fds) = open_files_limit() {
            // Room for the queue's files, the broker and Redis connections, the logs.
            let room = fds.saturating_sub(128) / listeners.max(1) as u64;
            let room = usize::try_from(room).unwrap_or(usize::MAX).max(16);
            if room < self.max_connections {
                tracing::warn!(
                    max_connections = self.max_connections,
                    open_files = fds,
                    lowered_to = room,
                    "the open-files limit is too low for --max-connections; lowered"
                );
                self.max_connections = room;
            }
        }
        self
    }
}

/// The soft limit on open files, as Linux states it in `/proc/self/limits` (read there, not
/// through `getrlimit`, since the workspace forbids `unsafe`).
fn open_files_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// One open connection, shared by its task, its requests and the listener's table: how many
/// requests it is inside, when it last left one, and how to stop it. A request touches two
/// atomics and the clock; the table is locked only to add, remove or sweep connections.
struct Conn {
    busy: AtomicU32,
    /// Milliseconds since the listener started, when the connection last left a request
    /// (or opened).
    last: AtomicU64,
    /// Cancelled to stop the connection: for room or idleness (`closed`), or, as a child of
    /// the listener's token, for a shutdown, which lets its request in flight finish.
    stop: CancellationToken,
    closed: AtomicBool,
}

/// A listener's open connections.
struct Table {
    started: Instant,
    next: u64,
    conns: HashMap<u64, Arc<Conn>, foldhash::fast::RandomState>,
}

type Shared = Arc<Mutex<Table>>;

fn lock(t: &Shared) -> std::sync::MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

impl Table {
    fn now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Close `id` for good (its task drops it), taking it out of the table.
    fn close(&mut self, id: u64) {
        if let Some(c) = self.conns.remove(&id) {
            c.closed.store(true, Ordering::Relaxed);
            c.stop.cancel();
        }
    }
}

/// Make room for one more connection: the new one's id and state, or `None` when every open
/// one is inside a request.
fn admit(t: &Shared, max: usize, done: &CancellationToken) -> Option<(u64, Arc<Conn>)> {
    let mut table = lock(t);
    if table.conns.len() >= max {
        let idle = table
            .conns
            .iter()
            .filter(|(_, c)| c.busy.load(Ordering::Relaxed) == 0)
            .min_by_key(|(_, c)| c.last.load(Ordering::Relaxed))
            .map(|(id, _)| *id);
        metrics::counter!("weir_bounds_hit_total", "bound" => "http_connections").increment(1);
        table.close(idle?);
    }
    table.next += 1;
    let id = table.next;
    let conn = Arc::new(Conn {
        busy: AtomicU32::new(0),
        last: AtomicU64::new(table.now()),
        stop: done.child_token(),
        closed: AtomicBool::new(false),
    });
    table.conns.insert(id, conn.clone());
    Some((id, conn))
}

/// Close the connections that have sat outside a request for `idle` or longer, every so
/// often, until `done`.
async fn sweep(table: Shared, idle: Duration, done: CancellationToken) {
    let every = (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let idle = idle.as_millis() as u64;
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let mut t = lock(&table);
        let now = t.now();
        let quiet: Vec<u64> = t
            .conns
            .iter()
            .filter(|(_, c)| {
                c.busy.load(Ordering::Relaxed) == 0
                    && now.saturating_sub(c.last.load(Ordering::Relaxed)) >= idle
            })
            .map(|(id, _)| *id)
            .collect();
        for id in quiet {
            t.close(id);
        }
    }
}

/// Marks a connection inside a request for as long as it lives: dropped with the request's
/// future, answered or not.
struct Busy {
    conn: Arc<Conn>,
    started: Instant,
}

impl Busy {
    fn new(conn: &Arc<Conn>, started: Instant) -> Busy {
        conn.busy.fetch_add(1, Ordering::Relaxed);
        Busy {
            conn: conn.clone(),
            started,
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let c = &self.conn;
        c.last
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        c.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serve `app` on `listener` until `done`, then let the requests in flight finish.
pub(crate) fn spawn(
    tasks: &TaskTracker,
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    done: CancellationToken,
    what: &'static str,
) {
    let tracker = tasks.clone();
    let table: Shared = Arc::new(Mutex::new(Table {
        started: Instant::now(),
        next: 0,
        conns: HashMap::default(),
    }));
    tasks.spawn(sweep(table.clone(), limits.idle_timeout, done.clone()));
    tasks.spawn(async move {
        let started = lock(&table).started;
        loop {
            let (tcp, _) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors or a connection reset before it was taken: wait
                        // a little rather than spin, as hyper's and axum's servers do.
                        tracing::warn!(error = %e, server = what, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = done.cancelled() => break,
            };
            let Some((id, conn)) = admit(&table, limits.max_connections, &done) else {
                // Every connection is inside a request: this one is closed unanswered.
                drop(tcp);
                continue;
            };
            // Each answer goes out at once, as Go's and nginx's servers do: with Nagle's
            // algorithm the last part of an answer longer than a segment may wait for
            // the client's delayed ACK.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY not set");
            }
            let table = table.clone();
            let (app, header_timeout) = (app.clone(), limits.header_timeout);
            tracker.spawn(async move {
                connection(tcp, app, conn, started, header_timeout).await;
                lock(&table).conns.remove(&id);
            });
        }
    });
}

async fn connection(
    tcp: tokio::net::TcpStream,
    app: axum::Router,
    conn: Arc<Conn>,
    started: Instant,
    header_timeout: Duration,
) {
    let service = {
        let conn = conn.clone();
        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let busy = Busy::new(&conn, started);
            let call = tower::ServiceExt::oneshot(app.clone(), req.map(axum::body::Body::new));
            async move {
                let r = call.await;
                drop(busy);
                r
            }
        })
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    let served = http.serve_connection(TokioIo::new(tcp), service);
    tokio::pin!(served);
    tokio::select! {
        biased;
        r = served.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
            return;
        }
        _ = conn.stop.cancelled() => {}
    }
    // Closed for room or idleness: dropping the connection closes its socket. Shutting down:
    // the request in flight is answered, then the connection closes.
    if !conn.closed.load(Ordering::Relaxed) {
        served.as_mut().graceful_shutdown();
        if let Err(e) = served.await {
            tracing::debug!(error = %e, "HTTP connection ended");
        }
    }
}
