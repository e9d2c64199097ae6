//! A small HTTP load generator for the benchmarks: `connections` keep-alive HTTP/1.1
//! connections, each sending one request after the other for a fixed time, with every
//! answer's latency and status kept. Each connection is one task that writes a request made
//! once and parses the answer in place (httparse), as wrk does, so the generator costs little
//! of the two cores it shares with the engine.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What a load run saw.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub elapsed: Duration,
    /// Answers by status code.
    pub statuses: BTreeMap<u16, u64>,
    /// Latency of every answer, sorted.
    pub latencies: Vec<Duration>,
    /// Requests that got no answer (connection errors).
    pub errors: u64,
    /// The bodies of the 2xx answers, when asked to keep them.
    pub bodies: Vec<Bytes>,
}

impl LoadReport {
    pub fn answered(&self) -> u64 {
        self.statuses.values().sum()
    }
    pub fn ok(&self) -> u64 {
        self.statuses
            .iter()
            .filter(|(s, _)| (200..300).contains(*s))
            .map(|(_, n)| n)
            .sum()
    }
    pub fn rate(&self) -> f64 {
        self.answered() as f64 / self.elapsed.as_secs_f64()
    }
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() as f64 * p).ceil() as usize).clamp(1, self.latencies.len());
        self.latencies[i - 1]
    }
}

/// What to send.
#[derive(Clone)]
pub struct LoadSpec {
    pub addr: std::net::SocketAddr,
    /// The request path, with `{n}` replaced by a running number (to spread over paths).
    pub path: String,
    /// How many distinct `{n}` values (paths) to cycle through.
    pub paths: usize,
    pub body: Bytes,
    pub connections: usize,
    pub duration: Duration,
    /// Stop after this many requests in all, if sooner.
    pub max_requests: Option<u64>,
    pub keep_bodies: bool,
}

/// Run the load; every connection sends until the time (or the request budget) is up.
pub async fn run(spec: LoadSpec) -> LoadReport {
    let budget = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
        spec.max_requests.unwrap_or(u64::MAX),
    ));
    let start = Instant::now();
    let deadline = start + spec.duration;
    let mut tasks = Vec::new();
    for c in 0..spec.connections {
        let spec = spec.clone();
        let budget = budget.clone();
        tasks.push(tokio::spawn(async move {
            connection(spec, c, deadline, budget).await
        }));
    }
    let mut report = LoadReport::default();
    for t in tasks {
        let r = t.await.expect("load task");
        for (s, n) in r.statuses {
            *report.statuses.entry(s).or_default() += n;
        }
        report.latencies.extend(r.latencies);
        report.errors += r.errors;
        report.bodies.extend(r.bodies);
    }
    report.elapsed = start.elapsed();
    report.latencies.sort_unstable();
    report
}

async fn connection(
    spec: LoadSpec,
    index: usize,
    deadline: Instant,
    budget: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> LoadReport {
    let mut r = LoadReport::default();
    let paths = spec.paths.max(1);
    // Each path's request, written out once, the first time this connection sends it.
    let mut requests: Vec<Option<Vec<u8>>> = vec![None; paths];
    let mut buf = BytesMut::with_capacity(16 * 1024);
    let mut n = index;
    'outer: while Instant::now() < deadline {
        let Ok(mut stream) = TcpStream::connect(spec.addr).await else {
            r.errors += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        buf.clear();
        while Instant::now() < deadline {
            if budget
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(1))
                .is_err()
            {
                break 'outer;
            }
            let req = requests[n % paths]
                .get_or_insert_with(|| request(&spec, n % paths))
                .as_slice();
            n += spec.connections;
            let t0 = Instant::now();
            if stream.write_all(req).await.is_err() {
                r.errors += 1;
                break;
            }
            match read_answer(&mut stream, &mut buf).await {
                Some(a) => {
                    r.latencies.push(t0.elapsed());
                    *r.statuses.entry(a.status).or_default() += 1;
                    if spec.keep_bodies && (200..300).contains(&a.status) {
                        r.bodies.push(a.body);
                    }
                    if a.close {
                        break;
                    }
                }
                None => {
                    r.errors += 1;
                    break;
                }
            }
        }
    }
    r
}

/// A POST of the spec's body to its path (`{n}` replaced by `i`), ready to write.
fn request(spec: &LoadSpec, i: usize) -> Vec<u8> {
    let path = spec.path.replace("{n}", &i.to_string());
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        spec.body.len()
    )
    .into_bytes();
    req.extend_from_slice(&spec.body);
    req
}

struct Answer {
    status: u16,
    body: Bytes,
    /// The server said it closes the connection after this answer.
    close: bool,
}

/// Read one HTTP/1.1 answer from `stream`, leaving in `buf` whatever came after it. `None`
/// when the connection ends or sends something that is not an answer.
async fn read_answer(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<Answer> {
    loop {
        if let Some(parsed) = parse_answer(buf)? {
            return Some(parsed);
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(16 * 1024);
        }
        if stream.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// One whole answer off the front of `buf`: `Some(None)` when more bytes are needed, `None`
/// when it is not HTTP.
fn parse_answer(buf: &mut BytesMut) -> Option<Option<Answer>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut res = httparse::Response::new(&mut headers);
    let head = match res.parse(buf).ok()? {
        httparse::Status::Partial => return Some(None),
        httparse::Status::Complete(n) => n,
    };
    let status = res.code?;
    let (mut length, mut chunked, mut close) = (None, false, false);
    for h in res.headers.iter() {
        let v = std::str::from_utf8(h.value).ok()?.trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            length = Some(v.parse::<usize>().ok()?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.eq_ignore_ascii_case("chunked");
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        }
    }
    if (100..200).contains(&status) || status == 204 || status == 304 {
        length = Some(0);
    }
    if chunked {
        let Some((body, used)) = dechunk(&buf[head..])? else {
            return Some(None);
        };
        buf.advance(head + used);
        return Some(Some(Answer {
            status,
            body,
            close,
        }));
    }
    // Without a length or chunks the body runs to the end of the connection; the bench's
    // servers never answer so.
    let length = length?;
    if buf.len() < head + length {
        return Some(None);
    }
    buf.advance(head);
    let body = buf.split_to(length).freeze();
    Some(Some(Answer {
        status,
        body,
        close,
    }))
}

/// A chunked body: `Some(None)` until it is all there, then the body and the bytes it took.
fn dechunk(b: &[u8]) -> Option<Option<(Bytes, usize)>> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let Some(eol) = b[at..].windows(2).position(|w| w == b"\r\n") else {
            return Some(None);
        };
        let line = std::str::from_utf8(&b[at..at + eol]).ok()?;
        let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
        at += eol + 2;
        if size == 0 {
            // No trailers from the bench's servers: the empty line ends the body.
            return Some((b.len() >= at + 2).then(|| (Bytes::from(body), at + 2)));
        }
        // A size no answer could have is not HTTP (and must not overflow the sums).
        let end = at.checked_add(size)?.checked_add(2)?;
        if b.len() < end {
            return Some(None);
        }
        body.extend_from_slice(&b[at..at + size]);
        at = end;
    }
}

/// A flow for the accepted-then-run benchmarks: webhook `path` (202) → function → log.
pub fn accept_flow(id: &str, path: &str) -> String {
    accept_chain(id, path, 1)
}

/// Webhook `path` (202) → `functions` function nodes in a row (at least one) → log: what
/// a wave costs per node it runs.
pub fn accept_chain(id: &str, path: &str, functions: usize) -> String {
    let name = |i: usize| match i {
        1 => "shape".to_string(),
        i => format!("shape{i}"),
    };
    let functions = functions.max(1);
    let mut yaml = format!(
        "\nid: {id}\nnodes:\n  hook: {{ type: webhook, path: {path}, to: [{}] }}\n",
        name(1)
    );
    for i in 1..=functions {
        let next = if i == functions {
            "log".into()
        } else {
            name(i + 1)
        };
        yaml.push_str(&format!(
            "  {}:\n    type: function\n    script: |\n      msg.payload.seen = true;\n      msg\n    to: [{next}]\n",
            name(i)
        ));
    }
    yaml.push_str("  log: { type: log, level: debug }\n");
    yaml
}

/// The length of each benchmark load: `WEIR_BENCH_SECS`, default 8 s.
pub fn bench_secs() -> Duration {
    let s: f64 = std::env::var("WEIR_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8.0);
    Duration::from_secs_f64(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(buf: &mut BytesMut) -> Option<Option<(u16, Bytes, bool)>> {
        parse_answer(buf).map(|a| a.map(|a| (a.status, a.body, a.close)))
    }

    #[test]
    fn an_answer_that_comes_in_pieces_is_read_once_whole_and_what_follows_is_kept() {
        let whole = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloHTTP/1.1 202";
        for cut in [0, 10, 38, 40] {
            let mut buf = BytesMut::from(&whole[..cut]);
            assert!(matches!(answer(&mut buf), Some(None)), "cut at {cut}");
        }
        let mut buf = BytesMut::from(&whole[..]);
        assert_eq!(
            answer(&mut buf),
            Some(Some((200, Bytes::from_static(b"hello"), false)))
        );
        assert_eq!(&buf[..], b"HTTP/1.1 202", "the next answer's start stays");
    }

    #[test]
    fn a_chunked_answer_and_a_closing_one_are_read() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n"[..],
        );
        assert_eq!(
            answer(&mut buf),
            Some(Some((200, Bytes::from_static(b"abcde"), true)))
        );
        assert!(buf.is_empty());
        let mut part =
            BytesMut::from(&b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nab"[..]);
        assert!(matches!(answer(&mut part), Some(None)));
    }

    #[test]
    fn what_is_not_an_answer_ends_the_connection() {
        let mut buf = BytesMut::from(&b"SSH-2.0-OpenSSH\r\n\r\n"[..]);
        assert!(answer(&mut buf).is_none());
        let mut buf = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"[..]);
        assert!(answer(&mut buf).is_none());
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nffffffffffffffff\r\n"[..],
        );
        assert!(answer(&mut buf).is_none(), "a chunk size past any memory");
    }
}
