//! Chaos: a steady load of webhook and MQTT events through delays, a rate limit and an
//! http-request sink, while the engine is SIGKILLed at random moments and the broker (and
//! Redis) restarted now and then. At the end every accepted event has reached the sink, the
//! duplicates are counted and printed, and nothing is left in flight, delayed or held.
//!
//! The short version runs in CI (10 kills per backend); `WEIR_CHAOS_ROUNDS=N` runs longer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use weir_queue::testing::RedisServer;
use weir_testkit::{Mosquitto, MqttPeer, Sink, WeirProcess};

fn flows(sink: &Sink) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let hook = format!(
        r#"
id: hook
nodes:
  in: {{ type: webhook, path: ev, to: [wait] }}
  wait: {{ type: delay, for: 150ms, to: [limit] }}
  limit: {{ type: rate-limit, rate: 200/s, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("hook")
    );
    let mqtt = format!(
        r#"
id: mqtt
nodes:
  in: {{ type: mqtt-in, topic: "chaos/+", qos: 1, to: [limit] }}
  limit: {{ type: rate-limit, rate: 200/s, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("mqtt")
    );
    std::fs::write(dir.path().join("hook.yaml"), hook).unwrap();
    std::fs::write(dir.path().join("mqtt.yaml"), mqtt).unwrap();
    dir
}

/// A small deterministic generator, so a failing run can be repeated.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

async fn chaos(queue: &str, mut redis: Option<&mut RedisServer>, label: &str) {
    let rounds: usize = std::env::var("WEIR_CHAOS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let sink = Sink::start().await;
    let dir = flows(&sink);
    let mut broker = Mosquitto::start();
    let args = ["--mqtt", &broker.url(), "--consumer", "chaos"];
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let arg_refs = || args.iter().map(String::as_str).collect::<Vec<_>>();
    let device = MqttPeer::connect(broker.port, "chaos-device", None).await;
    let mut rng = Lcg(0x5eed ^ label.len() as u64);
    let accepted: Arc<Mutex<Vec<u64>>> = Arc::default();
    let mut published = 0u64;
    let mut next_hook = 0u64;
    let mut e = WeirProcess::start(dir.path(), queue, &arg_refs()).await;
    // The engine's MQTT session exists from here on: what the broker takes waits for it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for round in 0..rounds {
        // Load for a random while: webhooks from one task, MQTT from here.
        let running = Arc::new(AtomicBool::new(true));
        let poster = {
            let (base, acc, run) = (e.base.clone(), accepted.clone(), running.clone());
            let start = next_hook;
            tokio::spawn(async move {
                let c = reqwest::Client::new();
                let mut n = start;
                while run.load(Ordering::Relaxed) {
                    let r = c
                        .post(format!("{base}/hooks/ev"))
                        .json(&json!({ "n": n }))
                        .send()
                        .await;
                    if r.is_ok_and(|r| r.status() == 202) {
                        acc.lock().unwrap().push(n);
                    }
                    n += 1;
                    tokio::time::sleep(Duration::from_millis(6)).await;
                }
                n
            })
        };
        let until = Instant::now() + Duration::from_millis(200 + rng.next(600));
        while Instant::now() < until {
            let body = serde_json::to_vec(&json!({ "m": published })).unwrap();
            device
                .client
                .publish(
                    format!("chaos/{}", published % 4),
                    rumqttc::QoS::AtLeastOnce,
                    false,
                    body,
                )
                .await
                .unwrap();
            published += 1;
            tokio::time::sleep(Duration::from_millis(8)).await;
        }
        // Kill it mid-stride.
        e.kill();
        running.store(false, Ordering::Relaxed);
        next_hook = poster.await.unwrap();
        // Now and then the broker, or Redis, goes down too.
        match rng.next(4) {
            0 => {
                broker.stop();
                broker.restart();
            }
            1 => {
                if let Some(r) = redis.as_deref_mut() {
                    r.stop();
                    r.restart();
                }
            }
            _ => {}
        }
        e = WeirProcess::start(dir.path(), queue, &arg_refs()).await;
        if round % 3 == 0 {
            println!(
                "[{label}] round {round}: {} webhooks accepted, {published} published so far",
                accepted.lock().unwrap().len()
            );
        }
    }
    let accepted = accepted.lock().unwrap().clone();
    let count = |path: &str, key: &str| {
        let mut seen: HashMap<u64, usize> = HashMap::new();
        for (at, b) in sink.received_at(path) {
            let _ = at;
            if let Some(n) = b[key].as_u64() {
                *seen.entry(n).or_default() += 1;
            }
        }
        seen
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let hooks = count("hook", "n");
        let msgs = count("mqtt", "m");
        let lost_hooks: Vec<u64> = accepted
            .iter()
            .filter(|n| !hooks.contains_key(n))
            .copied()
            .collect();
        let lost_msgs: Vec<u64> = (0..published).filter(|m| !msgs.contains_key(m)).collect();
        if lost_hooks.is_empty() && lost_msgs.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let stats = e.stats().await;
            let items = reqwest::get(format!("{}/api/dead-letters?limit=3", e.base))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            panic!(
                "[{label}] not delivered: {} webhooks {:?}…, {} mqtt {:?}…; stats {stats}; items {items}",
                lost_hooks.len(),
                &lost_hooks[..lost_hooks.len().min(10)],
                lost_msgs.len(),
                &lost_msgs[..lost_msgs.len().min(10)]
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Nothing stuck: no item in flight, waiting or delayed, nothing held by the limits.
    let deadline = Instant::now() + Duration::from_secs(20);
    let stats = loop {
        let s = e.stats().await;
        let busy: u64 = ["ready", "in_flight", "delayed", "parked"]
            .iter()
            .map(|k| s[*k].as_u64().unwrap_or(0))
            .sum();
        if busy == 0 {
            break s;
        }
        assert!(Instant::now() < deadline, "the queue drains: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(stats["dead"], 0, "nothing dead-lettered: {stats}");
    assert_eq!(e.stop(Duration::from_secs(15)).await, Some(0));
    let q = weir_queue::open(queue, weir_queue::Failpoints::new())
        .await
        .unwrap();
    for flow in ["hook", "mqtt"] {
        let held = q.read_node(flow, "limit").await.unwrap();
        assert!(
            held.is_empty(),
            "[{label}] {flow}: nothing held by the rate limit: {held:?}"
        );
    }
    let twice = |m: HashMap<u64, usize>| m.values().map(|c| c - 1).sum::<usize>();
    println!(
        "[{label}] {rounds} SIGKILLs: {} webhooks accepted and {published} MQTT messages published, all delivered; duplicates: {} webhook, {} mqtt",
        accepted.len(),
        twice(count("hook", "n")),
        twice(count("mqtt", "m"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_sqlite() {
    let data = tempfile::tempdir().unwrap();
    chaos(
        &format!("sqlite:{}/queue.db", data.path().display()),
        None,
        "sqlite",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_redis() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    chaos(&url, Some(&mut redis), "redis").await;
}
