//! Trigger details: cron catch-up after downtime, HMAC-signed webhooks.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{json, Value};
use weir::queue::StateKey;
use weir::{Engine, MemoryQueue};
use weir_testkit::{clear_of_the_hour, test_exec, wait_for, Sink};

async fn start_on(q: weir::Queue, flow: &str) -> weir::RunningEngine {
    Engine::builder()
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .exec_config(test_exec())
        .queue(q)
        .flow_str("c.yaml", flow)
        .build()
        .unwrap()
        .start()
        .await
        .unwrap()
}

#[tokio::test]
async fn catch_up_last_fires_the_last_missed_tick_once_at_start() {
    // Across the top of an hour the schedule would also fire for real (a second tick).
    clear_of_the_hour(Duration::from_secs(30)).await;
    let sink = Sink::start().await;
    let q = weir::Queue::from(MemoryQueue::new());
    // The engine last fired this hourly schedule a day ago; it was down since.
    let day_ago = weir::queue::now_ms() - 24 * 3600 * 1000;
    let key = StateKey::new("c", "hourly", "last_tick");
    let seed = weir::queue::WorkItem::cascade("c", "hourly", "seed", vec![]);
    assert!(q.add_tick(&key, day_ago, seed).await.unwrap());
    let c = q.claim("seed", 1, Duration::ZERO).await.unwrap().remove(0);
    q.commit(&c, weir::queue::WaveEffects::ending(weir::queue::End::Ack))
        .await
        .unwrap();
    let flow = format!(
        r#"
id: c
nodes:
  hourly: {{ type: cron, schedule: "0 * * * *", catch_up: last, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("c")
    );
    let e = start_on(q.clone(), &flow).await;
    wait_for("the caught-up tick", Duration::from_secs(10), || {
        sink.count() == 1
    })
    .await;
    let tick: String = sink.bodies()[0].as_str().unwrap().to_string();
    assert!(
        tick.contains(":00:00"),
        "the last hourly tick, not now: {tick}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.count(), 1, "only the last missed tick, once");
    e.shutdown().await;
    // A restart does not fire it again: the tick is recorded.
    let e = start_on(q, &flow).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(sink.count(), 1);
    e.shutdown().await;
}

#[tokio::test]
async fn hmac_signed_webhooks_are_checked() {
    use hmac::{Hmac, Mac};
    std::env::set_var("WEIR_TEST_HMAC_KEY", "k3y");
    let flow =
        "nodes:\n  h: { type: webhook, path: signed, auth: { hmac_env: WEIR_TEST_HMAC_KEY } }\n";
    let e = start_on(MemoryQueue::new().into(), flow).await;
    let body = br#"{"order": 1}"#;
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(b"k3y").unwrap();
    mac.update(body);
    let sig: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let c = reqwest::Client::new();
    let url = format!("http://{}/hooks/signed", e.addr);
    let post = |sig: Option<String>| {
        let mut r = c
            .post(&url)
            .header("content-type", "application/json")
            .body(body.to_vec());
        if let Some(s) = sig {
            r = r.header("x-weir-signature", s);
        }
        r.send()
    };
    assert_eq!(post(None).await.unwrap().status(), 401);
    assert_eq!(post(Some("sha256=00".into())).await.unwrap().status(), 401);
    let ok = post(Some(format!("sha256={sig}"))).await.unwrap();
    assert_eq!(ok.status(), 202);
    let id = ok.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let item: Value = reqwest::get(format!("http://{}/api/items/{id}", e.addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        item["item"]["outputs"][0][0]["payload"],
        json!({"order": 1})
    );
    e.shutdown().await;
}

#[tokio::test]
async fn a_signed_timestamp_keeps_a_captured_request_from_being_replayed() {
    use hmac::{Hmac, Mac};
    std::env::set_var("WEIR_TEST_HMAC_TS_KEY", "k3y");
    let flow = "nodes:\n  h: { type: webhook, path: signed, auth: { hmac_env: WEIR_TEST_HMAC_TS_KEY, timestamp: true } }\n";
    let e = start_on(MemoryQueue::new().into(), flow).await;
    let body = br#"{"order": 1}"#;
    // `X-Weir-Signature` of `parts` one after another.
    let signature = |parts: &[&[u8]]| -> String {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(b"k3y").unwrap();
        for p in parts {
            mac.update(p);
        }
        let hex: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("sha256={hex}")
    };
    let sign = |ts: &str| signature(&[ts.as_bytes(), b".", body]);
    let url = format!("http://{}/hooks/signed", e.addr);
    let post = |ts: Option<String>, sig: String| {
        let mut r = reqwest::Client::new()
            .post(&url)
            .header("content-type", "application/json")
            .header("x-weir-signature", sig)
            .body(body.to_vec());
        if let Some(ts) = ts {
            r = r.header("x-weir-timestamp", ts);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    let now = (weir::now_ms() / 1000).to_string();
    assert_eq!(post(Some(now.clone()), sign(&now)).await, 202);
    // The body's signature alone, as without `timestamp`, is not enough.
    let plain = signature(&[body]);
    assert_eq!(post(None, plain).await, 401);
    // Captured ten minutes ago: refused, though its signature is right.
    let old = (weir::now_ms() / 1000 - 600).to_string();
    assert_eq!(post(Some(old.clone()), sign(&old)).await, 401);
    // A timestamp changed to now breaks the signature.
    assert_eq!(post(Some(now), sign(&old)).await, 401);
    e.shutdown().await;
}
