//! The HTTP listeners. Each connection is served by hyper with a bound on how long its
//! request head may take and how long it may sit idle, and the open connections of a
//! listener are bounded: at the bound, the connection idle the longest is closed to make room,
//! so a flood of half-sent or idle connections never starves `/healthz` or the admin API of
//! file descriptors. A connection in the middle of a request is never closed for room.

use std::collections::HashMap;
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

/// One open connection: whether it is inside a request, since when it has been as it is,
/// and how to close it.
struct Conn {
    busy: u32,
    since: Instant,
    close: CancellationToken,
}

/// A listener's open connections.
#[derive(Default)]
struct Table {
    next: u64,
    conns: HashMap<u64, Conn>,
}

type Shared = Arc<Mutex<Table>>;

fn lock(t: &Shared) -> std::sync::MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// Make room for one more connection: `Some(id)` of the new one, or `None` when every open
/// one is inside a request.
fn admit(t: &Shared, max: usize) -> Option<(u64, CancellationToken)> {
    let mut table = lock(t);
    if table.conns.len() >= max {
        let idle = table
            .conns
            .iter()
            .filter(|(_, c)| c.busy == 0)
            .min_by_key(|(_, c)| c.since)
            .map(|(id, _)| *id);
        metrics::counter!("weir_bounds_hit_total", "bound" => "http_connections").increment(1);
        match idle {
            Some(id) => {
                if let Some(c) = table.conns.remove(&id) {
                    c.close.cancel();
                }
            }
            None => return None,
        }
    }
    table.next += 1;
    let id = table.next;
    let close = CancellationToken::new();
    table.conns.insert(
        id,
        Conn {
            busy: 0,
            since: Instant::now(),
            close: close.clone(),
        },
    );
    Some((id, close))
}

/// Marks a connection busy for as long as it lives: dropped with the request's future,
/// answered or not.
struct Busy {
    table: Shared,
    id: u64,
}

impl Busy {
    fn new(table: &Shared, id: u64) -> Busy {
        if let Some(c) = lock(table).conns.get_mut(&id) {
            c.busy += 1;
            c.since = Instant::now();
        }
        Busy {
            table: table.clone(),
            id,
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(c) = lock(&self.table).conns.get_mut(&self.id) {
            c.busy = c.busy.saturating_sub(1);
            c.since = Instant::now();
        }
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
    tasks.spawn(async move {
        let table: Shared = Default::default();
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
            let Some((id, close)) = admit(&table, limits.max_connections) else {
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
            tracker.spawn(connection(
                tcp,
                app.clone(),
                table.clone(),
                id,
                close,
                limits.clone(),
                done.clone(),
            ));
        }
    });
}

async fn connection(
    tcp: tokio::net::TcpStream,
    app: axum::Router,
    table: Shared,
    id: u64,
    close: CancellationToken,
    limits: HttpLimits,
    done: CancellationToken,
) {
    let service = {
        let table = table.clone();
        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let busy = Busy::new(&table, id);
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
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let conn = http.serve_connection(TokioIo::new(tcp), service);
    tokio::pin!(conn);
    let tick = (limits.idle_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "HTTP connection ended");
                }
                break;
            }
            // Closed for room: dropping the connection closes its socket.
            _ = close.cancelled() => break,
            _ = done.cancelled(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tokio::time::sleep(tick) => {
                let idle = lock(&table)
                    .conns
                    .get(&id)
                    .is_some_and(|c| c.busy == 0 && c.since.elapsed() >= limits.idle_timeout);
                if idle {
                    break;
                }
            }
        }
    }
    lock(&table).conns.remove(&id);
}
