//! The admin API's door: a token when one is set, its own address when asked, and no
//! engine at all on an open address without a token.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;
use weir::{Engine, EngineError};
use weir_testkit::post_json;

const FLOW: &str = "nodes:\n  h: { type: webhook, path: in, to: [l] }\n  l: { type: log }\n";

fn builder() -> weir::EngineBuilder {
    Engine::builder()
        .queue_url("memory")
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .flow_str("f.yaml", FLOW)
}

async fn status(url: String, token: Option<&str>) -> u16 {
    let mut req = reqwest::Client::new().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn with_a_token_the_api_and_metrics_need_it_and_health_stays_open_and_metrics_count() {
    let e = builder()
        .admin_token(Some("s3cret".into()))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let base = format!("http://{}", e.admin_addr);
    assert_eq!(
        status(format!("{base}/api/stats"), None).await,
        401,
        "no token"
    );
    assert_eq!(
        status(format!("{base}/api/stats"), Some("wrong")).await,
        401,
        "a wrong token"
    );
    assert_eq!(
        status(format!("{base}/api/stats"), Some("s3cret")).await,
        200
    );
    assert_eq!(status(format!("{base}/api/flows"), None).await, 401);
    assert_eq!(
        status(format!("{base}/healthz"), None).await,
        200,
        "liveness stays open"
    );
    assert_eq!(
        status(format!("{base}/readyz"), None).await,
        200,
        "readiness stays open"
    );
    // Webhooks have their own auth (per flow); the admin token is not theirs.
    assert_eq!(post_json(&e, "in", json!(1)).await.status(), 202);
    let nowhere = reqwest::Client::new()
        .post(format!("http://{}/hooks/nowhere", e.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(nowhere.status(), 404);
    assert_eq!(
        status(format!("{base}/metrics"), None).await,
        401,
        "metrics need the token too"
    );
    let metrics = || async {
        reqwest::Client::new()
            .get(format!("{base}/metrics"))
            .bearer_auth("s3cret")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let text = weir_testkit::eventually(
        "the wave's end counted",
        Duration::from_secs(10),
        || async {
            let t = metrics().await;
            if t.contains(r#"weir_items_ended_total{flow="f",end="ack"}"#) {
                Ok(t)
            } else {
                Err(t)
            }
        },
    )
    .await;
    for want in [
        r#"weir_events_total{trigger="webhook",flow="f"}"#,
        r#"weir_items_ended_total{flow="f",end="ack"}"#,
        r#"weir_node_calls_total{kind="log"}"#,
        r#"weir_wave_seconds_bucket{flow="f",le="#,
        r#"weir_queue_items{state="ready"}"#,
        r#"weir_webhook_refused_total{status="404"}"#,
        "# HELP weir_events_total",
    ] {
        assert!(text.contains(want), "/metrics has {want}:\n{text}");
    }
    e.shutdown().await;
}

#[tokio::test]
async fn the_admin_api_can_have_its_own_address() {
    let e = builder()
        .admin(SocketAddr::from(([127, 0, 0, 1], 0)))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    assert_ne!(e.addr, e.admin_addr);
    assert_eq!(
        status(format!("http://{}/api/stats", e.admin_addr), None).await,
        200
    );
    assert_eq!(
        status(format!("http://{}/api/stats", e.addr), None).await,
        404,
        "not beside the webhooks"
    );
    assert_eq!(
        post_json(&e, "in", json!(1)).await.status(),
        202,
        "webhooks stay where they were"
    );
    e.shutdown().await;
}

#[tokio::test]
async fn an_open_admin_address_without_a_token_is_refused() {
    let r = builder()
        .http(SocketAddr::from(([0, 0, 0, 0], 0)))
        .build()
        .unwrap()
        .start()
        .await;
    match r {
        Err(EngineError::Config(m)) => {
            assert!(m.contains("not a loopback address, without a token"), "{m}")
        }
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("an engine with an open, unguarded admin API must not start"),
    }
    // Open webhooks are fine when the admin API is kept on loopback.
    let e = builder()
        .http(SocketAddr::from(([0, 0, 0, 0], 0)))
        .admin(SocketAddr::from(([127, 0, 0, 1], 0)))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    e.shutdown().await;
}

#[tokio::test]
async fn readyz_says_when_the_queue_does_not_answer() {
    let mut redis = weir_queue::testing::RedisServer::start();
    let e = builder()
        .queue_url(redis.url())
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let url = format!("http://{}/readyz", e.admin_addr);
    assert_eq!(status(url.clone(), None).await, 200);
    redis.stop();
    // The answer is kept for a second, so that probes cost the queue one read a second.
    weir_testkit::eventually(
        "not ready once Redis is down",
        Duration::from_secs(5),
        || async {
            match status(url.clone(), None).await {
                503 => Ok(()),
                s => Err(s),
            }
        },
    )
    .await;
    assert_eq!(
        status(format!("http://{}/healthz", e.admin_addr), None).await,
        200,
        "but the process lives"
    );
    redis.restart();
    weir_testkit::eventually(
        "ready again once Redis is back",
        Duration::from_secs(10),
        || async {
            match status(url.clone(), None).await {
                200 => Ok(()),
                other => Err(other),
            }
        },
    )
    .await;
    e.shutdown().await;
}

#[tokio::test]
async fn the_dashboard_session_opens_with_the_token_only_and_its_cookie_is_httponly_and_strict() {
    let e = builder()
        .admin_token(Some("s3cret".into()))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let base = format!("http://{}", e.admin_addr);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    // Without a session: the login form, not the dashboard.
    let page = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(html.contains("name=\"token\"") && !html.contains("id=\"flow-list\""));
    // The script and style are open (they hold nothing), the graph is not.
    assert_eq!(status(format!("{base}/ui/app.js"), None).await, 200);
    assert_eq!(
        status(format!("{base}/api/flows/f/graph.svg"), None).await,
        401
    );
    let wrong = http
        .post(format!("{base}/ui/login"))
        .form(&[("token", "nope")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    assert!(wrong.headers().get("set-cookie").is_none());
    let ok = http
        .post(format!("{base}/ui/login"))
        .form(&[("token", "s3cret")])
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 303);
    let cookie = ok.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_string();
    // With the session: the dashboard, its CSRF token in the page.
    let html = http
        .get(format!("{base}/"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = html
        .split("name=\"csrf\" content=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap()
        .to_string();
    assert_eq!(csrf.len(), 64, "{html}");
    let get = http
        .get(format!("{base}/api/stats"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 200, "reads need the cookie only");
    let pause = |token: Option<&str>| {
        let mut r = http
            .post(format!("{base}/api/flows/f/pause"))
            .header("cookie", &session);
        if let Some(t) = token {
            r = r.header("x-csrf-token", t);
        }
        r.send()
    };
    assert_eq!(pause(None).await.unwrap().status(), 403);
    assert_eq!(pause(Some("0000")).await.unwrap().status(), 403);
    assert_eq!(pause(Some(&csrf)).await.unwrap().status(), 200);
    assert!(e.queue.pausing().is_paused("f").await.unwrap());
    // Logged out, the cookie opens nothing.
    http.post(format!("{base}/ui/logout"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    let after = http
        .get(format!("{base}/api/stats"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), 401);
    e.shutdown().await;
}

#[tokio::test]
async fn node_figures_count_calls_failures_and_held_messages_and_the_graph_shows_them() {
    let flow = r#"
id: limited
nodes:
  in: { type: webhook, path: in, to: [limit] }
  limit: { type: rate-limit, rate: 1/min, to: [log] }
  log: { type: log }
"#;
    let e = start_one("limited.yaml", flow).await;
    for n in 0..4 {
        assert_eq!(post_json(&e, "in", json!({ "n": n })).await.status(), 202);
    }
    let base = format!("http://{}", e.admin_addr);
    let figures =
        node_figures_once(&e, "limited", |v| v[1]["held"] == 3 && v[2]["calls"] == 1).await;
    assert_eq!(figures[1]["id"], "limit");
    assert_eq!(figures[1]["calls"], 4, "{figures}");
    assert_eq!(figures[0]["trigger"], true);
    let svg = reqwest::get(format!("{base}/api/flows/limited/graph.svg"))
        .await
        .unwrap();
    assert_eq!(svg.headers()["content-type"], "image/svg+xml");
    let svg = svg.text().await.unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("data-node=\"limit\""));
    assert!(svg.contains("4 runs · 0 failed · 3 held"), "{svg}");
    assert_eq!(svg.matches("class=\"wire\"").count(), 2);
    assert_eq!(
        status(format!("{base}/api/flows/nope/nodes"), None).await,
        404
    );
    e.shutdown().await;
}

/// The benchmarks' nodes-per-wave flow (`accept_chain`): every node of the chain runs once
/// per event, so what the bench divides by is what ran.
#[tokio::test]
async fn the_benches_chain_of_function_nodes_runs_each_node_once_per_event() {
    let chain = weir_testkit::load::accept_chain("chain", "chain", 3);
    let e = start_one("chain.yaml", &chain).await;
    for n in 0..2 {
        assert_eq!(
            post_json(&e, "chain", json!({ "n": n })).await.status(),
            202
        );
    }
    let figures = node_figures_once(&e, "chain", |v| v[4]["calls"] == 2).await;
    let ran: Vec<(String, u64)> = figures
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["trigger"] == false)
        .map(|n| {
            (
                n["id"].as_str().unwrap().to_string(),
                n["calls"].as_u64().unwrap(),
            )
        })
        .collect();
    let want: Vec<(String, u64)> = ["shape", "shape2", "shape3", "log"]
        .iter()
        .map(|id| (id.to_string(), 2))
        .collect();
    assert_eq!(ran, want, "{figures}");
    e.shutdown().await;
}

/// `GET /api/flows/{flow}/nodes`, polled until `ready` holds of it (10 s at most).
async fn node_figures_once(
    e: &weir::RunningEngine,
    flow: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let url = &format!("http://{}/api/flows/{flow}/nodes", e.admin_addr);
    let ready = &ready;
    weir_testkit::eventually("the node figures", Duration::from_secs(10), || async move {
        let v: serde_json::Value = reqwest::get(url).await.unwrap().json().await.unwrap();
        if ready(&v) {
            Ok(v)
        } else {
            Err(v)
        }
    })
    .await
}

/// An engine on the memory queue with the one flow `yaml`, started.
async fn start_one(name: &str, yaml: &str) -> weir::RunningEngine {
    Engine::builder()
        .queue_url("memory")
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .flow_str(name, yaml)
        .build()
        .unwrap()
        .start()
        .await
        .unwrap()
}

/// The SQLite writer's wait (an event's journaling, a wave's commit: from the request to
/// its durable answer) is in /metrics by what was written, as the webhook bench reads it.
#[tokio::test]
async fn the_sqlite_queue_reports_how_long_its_writes_wait_for_durability() {
    let dir = tempfile::tempdir().unwrap();
    let e = builder()
        .queue_url(format!("sqlite:{}", dir.path().join("q.db").display()))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let base = format!("http://{}", e.admin_addr);
    let count = |write: &'static str| {
        let base = base.clone();
        async move {
            let label = format!(r#"write="{write}""#);
            weir_testkit::metric_sum_f64(&base, "weir_sqlite_wait_seconds_count", &[&label]).await
        }
    };
    let before = (count("journal").await, count("commit").await);
    assert_eq!(post_json(&e, "in", json!(1)).await.status(), 202);
    // Its journaling, then its wave's commit, each counted as what it is.
    weir_testkit::eventually("both writes counted", Duration::from_secs(10), || async {
        let now = (count("journal").await, count("commit").await);
        if now.0 > before.0 && now.1 > before.1 {
            Ok(())
        } else {
            Err(now)
        }
    })
    .await;
    let sum = weir_testkit::metric_sum_f64(&base, "weir_sqlite_wait_seconds_sum", &[]).await;
    assert!(sum > 0.0, "the waits add up to some time: {sum}");
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("# HELP weir_sqlite_wait_seconds"), "{text}");
    // Buckets, which add up across engines, not per-engine quantiles.
    assert!(
        text.contains(r#"weir_sqlite_wait_seconds_bucket{write="journal",le="0.001"}"#)
            && text.contains(r#"weir_sqlite_commit_seconds_bucket{le="0.001"}"#),
        "{text}"
    );
    e.shutdown().await;
}
