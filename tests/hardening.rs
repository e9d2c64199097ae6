//! What one hostile client may cost the engine: bodies, connections, pages of other sites.
//! Run against the `weir` binary where the cost is the process's (memory, descriptors).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;
use weir_testkit::{start, WeirProcess};

#[path = "support/tls.rs"]
mod tls;

const FLOW: &str = r#"
id: f
nodes:
  go: { type: manual, to: [out] }
  hook: { type: webhook, path: in, to: [out] }
  out: { type: log }
"#;

fn flows() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.yaml"), FLOW).unwrap();
    dir
}

/// A `/proc/PID/status` figure in KiB (`VmRSS`, `VmHWM`).
fn proc_kib(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Send `POST path` with a body of `len` bytes, declared (or, `chunked`, not) and write as
/// much of it as the engine takes, while another thread reads the answer: its status code.
fn post_huge(base: &str, path: &str, content_type: &str, len: usize, chunked: bool) -> u16 {
    let addr = base.trim_start_matches("http://").to_string();
    let mut tcp = TcpStream::connect(&addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut reader = tcp.try_clone().unwrap();
    let answer = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&got).to_string()
    });
    let length = match chunked {
        true => "Transfer-Encoding: chunked".to_string(),
        false => format!("Content-Length: {len}"),
    };
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nX-Weir-Client: test\r\n\
         Content-Type: {content_type}\r\n{length}\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).unwrap();
    let chunk = vec![b' '; 1 << 20];
    let mut sent = 0;
    while sent < len {
        let r = match chunked {
            true => tcp
                .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .and_then(|_| tcp.write_all(&chunk))
                .and_then(|_| tcp.write_all(b"\r\n")),
            false => tcp.write_all(&chunk),
        };
        if r.is_err() {
            break;
        }
        sent += chunk.len();
    }
    if chunked {
        let _ = tcp.write_all(b"0\r\n\r\n");
    }
    let text = answer.join().unwrap();
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no answer to {path} after {sent} bytes: {text:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_bodies_are_refused_at_their_limit_without_growing_the_engine() {
    let dir = flows();
    let p = WeirProcess::start(dir.path(), "memory", &[]).await;
    let before = proc_kib(p.pid(), "VmRSS");
    let base = p.base.clone();
    let codes = tokio::task::spawn_blocking(move || {
        // 300 MiB in all, on the routes that answer before any token is asked for.
        [
            ("/ui/login", "application/x-www-form-urlencoded"),
            ("/api/flows/f/runs", "application/json"),
            ("/api/reload", "application/json"),
        ]
        .map(|(path, ct)| (path, post_huge(&base, path, ct, 100 << 20, false)))
    })
    .await
    .unwrap();
    for (path, code) in codes {
        assert_eq!(code, 413, "{path}");
    }
    let peak = proc_kib(p.pid(), "VmHWM");
    assert!(
        peak.saturating_sub(before) < 64 << 10,
        "the engine grew from {before} KiB to a peak of {peak} KiB"
    );
    // A body sent in chunks, with no length declared, is cut at the limit too.
    let base = p.base.clone();
    let code = tokio::task::spawn_blocking(move || {
        post_huge(
            &base,
            "/api/flows/f/runs",
            "application/json",
            100 << 20,
            true,
        )
    })
    .await
    .unwrap();
    assert_eq!(code, 413);
    let peak = proc_kib(p.pid(), "VmHWM");
    assert!(peak.saturating_sub(before) < 64 << 10, "peak {peak} KiB");
    // Within the limit, a run starts.
    let r = reqwest::Client::new()
        .post(format!("{}/api/flows/f/runs", p.base))
        .json(&json!({ "n": 1 }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
}

#[tokio::test(flavor = "multi_thread")]
async fn half_sent_requests_neither_starve_the_engine_nor_stay_open() {
    let dir = flows();
    // A machine with a low open-files limit: a thousand connections would take them all.
    let p = WeirProcess::start_limited(
        dir.path(),
        "memory",
        &["--header-timeout", "2s", "--idle-timeout", "3s"],
        600,
    )
    .await;
    let addr = p.base.trim_start_matches("http://").to_string();
    let mut held = Vec::new();
    for _ in 0..1000 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        use tokio::io::AsyncWriteExt;
        // The head of a request, never finished.
        let _ = s
            .write_all(b"POST /hooks/in HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            .await;
        held.push(s);
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let health = http.get(format!("{}/healthz", p.base)).send().await;
    assert_eq!(
        health.map(|r| r.status().as_u16()).ok(),
        Some(200),
        "/healthz answers beside a thousand half-sent requests"
    );
    let stats = http
        .get(format!("{}/api/stats", p.base))
        .send()
        .await
        .map(|r| r.status().as_u16());
    assert_eq!(stats.ok(), Some(200), "so does the admin API");
    // Every half-sent request is closed by the engine, for room or at its header timeout.
    let deadline = Instant::now() + Duration::from_secs(20);
    let closed = futures::future::join_all(held.into_iter().map(|mut s| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 512];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                // An answer (408) before the close.
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }))
    .await;
    let open = closed.iter().filter(|c| !**c).count();
    assert_eq!(open, 0, "half-sent requests still open after 20 s");
    // A kept-alive connection that goes quiet is closed too.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        let r = tokio::time::timeout(Duration::from_secs(15), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(r.is_ok(), "an idle kept-alive connection is closed");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_pages_of_other_sites_change_nothing_and_read_nothing() {
    let e = start(&[("f.yaml", FLOW)], Default::default()).await;
    let base = format!("http://{}", e.admin_addr);
    let http = reqwest::Client::new();
    let paused = || async {
        let v: serde_json::Value = reqwest::get(format!("{base}/api/flows"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v[0]["paused"].as_bool().unwrap()
    };
    // What a form or a `fetch` of another site can send without a preflight.
    let r = http
        .post(format!("{base}/api/flows/f/pause"))
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // The client header from a page of another origin.
    let r = http
        .post(format!("{base}/api/flows/f/pause"))
        .header("x-weir-client", "page")
        .header("origin", "http://evil.example")
        .header("sec-fetch-site", "cross-site")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(!paused().await, "nothing was paused");
    // A page whose name was rebound to 127.0.0.1 names its own host.
    for path in ["/api/queue", "/api/dead-letters", "/"] {
        let r = http
            .get(format!("{base}{path}"))
            .header("host", "evil.example:8080")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 421, "{path}");
    }
    let r = http
        .get(format!("{base}/healthz"))
        .header("host", "pod-7:8080")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "probes answer under any name");
    // The CLI's way (and the dashboard's) works.
    let r = http
        .post(format!("{base}/api/flows/f/pause"))
        .header("x-weir-client", "cli")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(paused().await);
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flows_answer_cannot_script_the_dashboards_origin() {
    let flow = r#"
id: page
nodes:
  hook: { type: webhook, path: page, respond: wave, to: [answer] }
  answer:
    type: http-response
    status: 200
    headers: { content-type: text/html }
"#;
    let e = start(&[("page.yaml", flow)], Default::default()).await;
    let r = reqwest::Client::new()
        .post(format!("http://{}/hooks/page", e.addr))
        .header("content-type", "text/plain")
        .body("<script>fetch('/api/queue')</script>")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/html");
    assert_eq!(r.headers()["x-content-type-options"], "nosniff");
    assert_eq!(r.headers()["content-security-policy"], "sandbox");
    // A refusal carries them too.
    let r = reqwest::Client::new()
        .post(format!("http://{}/hooks/nowhere", e.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["content-security-policy"], "sandbox");
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_script_that_sleeps_fails_its_message_and_the_engine_answers_on() {
    let flow = r#"
id: nap
nodes:
  hook: { type: webhook, path: nap, to: [doze] }
  doze:
    type: function
    script: |
      sleep(12);
      msg
"#;
    let e = start(&[("nap.yaml", flow)], Default::default()).await;
    for n in 0..2 {
        let r = weir_testkit::post_json(&e, "nap", json!({ "n": n })).await;
        assert_eq!(r.status(), 202);
    }
    let t = Instant::now();
    let r = reqwest::Client::new()
        .get(format!("http://{}/healthz", e.admin_addr))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(t.elapsed() < Duration::from_secs(2), "/healthz waited");
    let dead = weir_testkit::wait_for_dead_letters(&e, 2, Duration::from_secs(10)).await;
    for d in dead {
        let reason = d["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("sleep() is not available"), "{d}");
    }
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redis_password_is_never_logged_nor_shown_in_help() {
    let redis = weir_queue::testing::RedisServer::start_with_password("hunter2-secret");
    let dir = flows();
    let p = WeirProcess::start(dir.path(), &redis.url(), &[]).await;
    // A stock server keeps no append-only file: the engine warns, naming the server.
    weir_testkit::wait_for("the persistence warning", Duration::from_secs(10), || {
        p.log().contains("append-only")
    })
    .await;
    let log = p.log();
    assert!(!log.contains("hunter2"), "{log}");
    assert!(log.contains(":***@127.0.0.1"), "{log}");
    drop(p);
    let help = std::process::Command::new(weir_testkit::weir_bin())
        .args(["run", "--help"])
        .env("WEIR_QUEUE", redis.url())
        .env("WEIR_MQTT", "mqtt://weir:hunter2-secret@127.0.0.1:1883")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("WEIR_QUEUE"), "{help}");
    assert!(!help.contains("hunter2"), "{help}");
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_keys_are_bounded_and_never_ignored() {
    let e = start(&[("f.yaml", FLOW)], Default::default()).await;
    let url = format!("http://{}/hooks/in", e.addr);
    let post = |key: reqwest::header::HeaderValue| {
        let url = url.clone();
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .header("idempotency-key", key)
                .json(&json!({ "n": 1 }))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<serde_json::Value>().await.unwrap())
        }
    };
    let long = reqwest::header::HeaderValue::from_str(&"k".repeat(256)).unwrap();
    let (status, body) = post(long).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("256 bytes"));
    // A key that is not ASCII (UTF-8 bytes, as a client sends them) deduplicates like any.
    let key = || reqwest::header::HeaderValue::from_bytes("заказ-7".as_bytes()).unwrap();
    let (s1, first) = post(key()).await;
    let (s2, again) = post(key()).await;
    assert_eq!((s1, s2), (202, 202));
    assert_eq!(first["id"], again["id"], "the retry is the same event");
    let ok = reqwest::header::HeaderValue::from_str(&"k".repeat(255)).unwrap();
    assert_eq!(post(ok).await.0, 202);
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn state_set_of_a_value_json_cannot_hold_throws_and_keeps_the_key() {
    let flow = r#"
id: keep
nodes:
  hook: { type: webhook, path: keep, to: [mem] }
  mem:
    type: function
    script: |
      if msg.payload == 1 { state.set("k", "kept"); } else { state.set("k", Fn("f")); }
      msg
"#;
    let e = start(&[("keep.yaml", flow)], Default::default()).await;
    assert_eq!(
        weir_testkit::post_json(&e, "keep", json!(1)).await.status(),
        202
    );
    assert_eq!(
        weir_testkit::post_json(&e, "keep", json!(2)).await.status(),
        202
    );
    let dead = weir_testkit::wait_for_dead_letters(&e, 1, Duration::from_secs(10)).await;
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(reason.contains("the value cannot be kept"), "{reason}");
    let key = weir::queue::StateKey::new("keep", "mem", "k");
    let v = e.queue.read(&key).await.unwrap();
    assert_eq!(v.value, Some(json!("kept")));
    e.shutdown().await;
}

/// A redis-server this test owns that speaks only TLS; killed by PID when dropped.
struct TlsRedis(std::process::Child);

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rediss_connects_over_tls_and_verifies_the_server() {
    // A CA, and a server certificate for 127.0.0.1 signed by it.
    let certs = tempfile::tempdir().unwrap();
    tls::write_ca_and_server(certs.path());
    let path = |f: &str| certs.path().join(f).display().to_string();
    let port = weir_queue::testing::free_port();
    let child = std::process::Command::new("redis-server")
        .args(["--port", "0", "--tls-port", &port.to_string()])
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--dir", &certs.path().display().to_string()])
        .args(["--tls-cert-file", &path("server.pem")])
        .args(["--tls-key-file", &path("server.key")])
        .args(["--tls-ca-cert-file", &path("ca.pem")])
        .args(["--tls-auth-clients", "no"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("redis-server starts");
    let _server = TlsRedis(
        weir_queue::testing::listening(child, port, Duration::from_secs(10))
            .expect("redis-server listens for TLS"),
    );
    let url = format!("rediss://127.0.0.1:{port}/?ca={}", path("ca.pem"));
    let q = weir::queue::open(&url, Default::default()).await.unwrap();
    let item = weir::queue::WorkItem::cascade("f", "in", "test", vec![json!({ "payload": 1 })]);
    q.add(vec![item]).await.unwrap();
    assert_eq!(q.admin().stats().await.unwrap().ready, 1);
    // Without the CA, the server's certificate does not verify: no connection.
    let plain = format!("rediss://127.0.0.1:{port}/");
    let Err(e) = weir::queue::open(&plain, Default::default()).await else {
        panic!("connected to a server whose certificate does not verify");
    };
    assert!(e.to_string().contains("cannot reach Redis"), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flow_named_by_a_file_follows_the_id_rule() {
    let e = weir::Engine::builder()
        .flow_str("bad name.yaml", "nodes: { a: { type: log } }\n")
        .queue_url("memory")
        .build();
    let Err(e) = e else {
        panic!("a flow named `bad name` loaded");
    };
    assert!(
        e.to_string()
            .contains("the file's name `bad name` is not a flow id"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn http_request_bounds_answers_and_keeps_its_headers_at_home() {
    use axum::routing::get;
    // Another origin, which records whatever reaches it.
    let stolen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let s2 = stolen.clone();
    let thief = axum::Router::new().fallback(move |h: axum::http::HeaderMap| {
        let s2 = s2.clone();
        async move {
            let key = h.get("x-api-key").map(|v| v.to_str().unwrap().to_string());
            s2.lock().unwrap().push(key.unwrap_or_default());
            "got it"
        }
    });
    let l2 = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let thief_at = l2.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l2, thief).await });
    let app = axum::Router::new()
        .route("/big", get(|| async { vec![b'x'; 11 << 20] }))
        .route(
            "/hop",
            get(move || async move {
                axum::response::Redirect::temporary(&format!("http://{thief_at}/steal"))
            }),
        )
        .route(
            "/bad",
            get(|| async { (axum::http::StatusCode::BAD_REQUEST, "e".repeat(100_000)) }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    let flow = format!(
        r#"
id: out
nodes:
  hook: {{ type: webhook, path: out, to: [pick] }}
  pick:
    type: switch
    rules:
      - {{ if: 'msg.payload == "big"', to: [big] }}
      - {{ if: 'msg.payload == "hop"', to: [hop] }}
      - {{ if: 'msg.payload == "bad"', to: [bad] }}
  big: {{ type: http-request, method: GET, url: "http://{at}/big" }}
  hop:
    type: http-request
    method: GET
    url: "http://{at}/hop"
    headers: {{ x-api-key: s3cret }}
  bad: {{ type: http-request, method: GET, url: "http://{at}/bad" }}
"#
    );
    let e = start(&[("out.yaml", flow.as_str())], Default::default()).await;
    for what in ["big", "hop", "bad"] {
        let r = weir_testkit::post_json(&e, "out", json!(what)).await;
        assert_eq!(r.status(), 202);
    }
    let dead = weir_testkit::wait_for_dead_letters(&e, 3, Duration::from_secs(20)).await;
    let reasons: Vec<String> = dead
        .iter()
        .map(|d| d["reason"].as_str().unwrap().to_string())
        .collect();
    let find = |what: &str| {
        reasons
            .iter()
            .find(|r| r.contains(what))
            .unwrap_or_else(|| panic!("no reason with {what}: {reasons:?}"))
    };
    assert!(find("/big").contains("larger than max_response (10485760 bytes)"));
    assert!(find("/hop").contains("a redirect not followed"));
    assert!(find("/bad").len() < 1_000, "{}", find("/bad").len());
    assert!(
        stolen.lock().unwrap().is_empty(),
        "the node's headers reached another origin"
    );
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_webhooks_bearer_token_is_checked_before_its_body_is_read() {
    std::env::set_var("HARDENING_HOOK_TOKEN", "t0ken");
    let flow = r#"
id: locked
nodes:
  hook: { type: webhook, path: locked, auth: { bearer_env: HARDENING_HOOK_TOKEN }, to: [out] }
  out: { type: log }
"#;
    let e = start(&[("locked.yaml", flow)], Default::default()).await;
    // A body of 100 MiB declared, of which nothing is sent: the answer comes from the
    // headers alone.
    let mut tcp = tokio::net::TcpStream::connect(e.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcp.write_all(
        format!(
            "POST /hooks/locked HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            e.addr,
            100 << 20
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf))
        .await
        .expect("answered without the body")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    e.shutdown().await;
}
