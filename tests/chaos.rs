//! Chaos: a steady load of webhook and MQTT events through delays, a rate limit and an
//! http-request sink, while the engine is SIGKILLed at random moments and the broker (and
//! Redis) restarted now and then. At the end every accepted event has reached the sink, the
//! duplicates are counted and printed, and nothing is left in flight, delayed or held.
//!
//! The short version runs in CI (10 kills per backend); `WEIR_CHAOS_ROUNDS=N` runs longer.
//! On Redis it also runs with three engines sharing the queue (one of them killed each
//! round, the others going on; MQTT through a shared subscription).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use weir_queue::testing::RedisServer;
use weir_testkit::{patient, until_subscribed, Mosquitto, MqttPeer, Sink, WeirProcess};

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

async fn chaos(queue: &str, mut redis: Option<&mut RedisServer>, label: &str, engines: usize) {
    let rounds: usize = std::env::var("WEIR_CHAOS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let sink = Sink::start().await;
    let dir = flows(&sink);
    let mut broker = Mosquitto::start();
    // Each engine a stable consumer name (a restarted one takes back at once what it left)
    // and, with several, its own MQTT client id on a shared subscription.
    let args: Vec<Vec<String>> = (0..engines)
        .map(|i| {
            let mqtt = if engines == 1 {
                broker.url()
            } else {
                format!("{}?client_id=chaos-{i}&share=weir", broker.url())
            };
            let mut a = vec!["--mqtt".to_string(), mqtt];
            a.extend(["--consumer".to_string(), format!("chaos-{i}")]);
            a.extend(["--reclaim-after".to_string(), "2".to_string()]);
            a
        })
        .collect();
    let arg_refs = |i: usize| args[i].iter().map(String::as_str).collect::<Vec<_>>();
    let device = MqttPeer::connect(broker.port, "chaos-device", None).await;
    let mut rng = Lcg(0x5eed ^ (label.len() + engines) as u64);
    let accepted: Arc<Mutex<Vec<u64>>> = Arc::default();
    let mut published = 0u64;
    let mut next_hook = 0u64;
    let mut es = Vec::new();
    for i in 0..engines {
        es.push(WeirProcess::start(dir.path(), queue, &arg_refs(i)).await);
    }
    // The engines' MQTT sessions exist from here on: what the broker takes waits for them.
    for e in &es {
        until_subscribed(&e.base, &[], 1).await;
    }
    for round in 0..rounds {
        // Load for a random while: webhooks from one task (to every engine in turn), MQTT
        // from here.
        let running = Arc::new(AtomicBool::new(true));
        let poster = {
            let bases: Vec<String> = es.iter().map(|e| e.base.clone()).collect();
            let (acc, run) = (accepted.clone(), running.clone());
            let start = next_hook;
            tokio::spawn(async move {
                let c = patient();
                let mut n = start;
                while run.load(Ordering::Relaxed) {
                    let base = &bases[n as usize % bases.len()];
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
        // Kill one mid-stride (the others go on).
        let victim = rng.next(engines as u64) as usize;
        es[victim].kill();
        running.store(false, Ordering::Relaxed);
        next_hook = tokio::time::timeout(Duration::from_secs(30), poster)
            .await
            .expect("the webhook poster stops within 30 s")
            .unwrap();
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
        es[victim] = WeirProcess::start(dir.path(), queue, &arg_refs(victim)).await;
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
            let stats = es[0].stats().await;
            let items = patient()
                .get(format!("{}/api/dead-letters?limit=3", es[0].base))
                .send()
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
        let s = es[0].stats().await;
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
    for e in es {
        assert_eq!(e.stop(Duration::from_secs(15)).await, Some(0));
    }
    let opened = weir_queue::open(queue, weir_queue::Failpoints::new());
    let q = tokio::time::timeout(Duration::from_secs(30), opened)
        .await
        .unwrap_or_else(|_| panic!("[{label}] opening the queue took over 30 s"))
        .unwrap();
    for flow in ["hook", "mqtt"] {
        let read = tokio::time::timeout(Duration::from_secs(30), q.read_node(flow, "limit"));
        let held = read
            .await
            .unwrap_or_else(|_| panic!("[{label}] reading {flow}'s limit took over 30 s"))
            .unwrap();
        assert!(
            held.is_empty(),
            "[{label}] {flow}: nothing held by the rate limit: {held:?}"
        );
    }
    let twice = |m: HashMap<u64, usize>| m.values().map(|c| c - 1).sum::<usize>();
    println!(
        "[{label}] {rounds} SIGKILLs of one of {engines} engine(s): {} webhooks accepted and {published} MQTT messages published, all delivered; duplicates: {} webhook, {} mqtt",
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
        1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_redis() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    chaos(&url, Some(&mut redis), "redis", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_three_engines_on_redis() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    chaos(&url, Some(&mut redis), "redis×3", 3).await;
}
