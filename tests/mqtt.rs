//! MQTT in and out, end to end against a mosquitto the test owns: every message journaled
//! before it is acknowledged, every publish done only when the broker acknowledged it.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};
use weir::Failpoints;

#[path = "support/tls.rs"]
mod tls;
use weir_testkit::{
    broker_label, eventually, get_json, start_with, until_subscribed, wait_for, Mosquitto,
    MqttPeer, WeirProcess,
};

const DOUBLE: &str = r#"
id: double
nodes:
  in: { type: mqtt-in, topic: "sensors/+/reading", qos: 1, to: [double] }
  double:
    type: function
    script: |
      if type_of(msg.payload) == "map" { msg.payload.n = msg.payload.n * 2; }
      msg
    to: [out]
  out: { type: mqtt-out, topic: "results/{{ msg.topic }}", qos: 1 }
"#;

/// How often each `n / 2` arrived (the flow doubles `n`).
fn arrivals(observer: &MqttPeer) -> HashMap<u64, usize> {
    let mut seen = HashMap::new();
    for v in observer.json() {
        if let Some(n) = v["n"].as_u64() {
            *seen.entry(n / 2).or_default() += 1;
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_messages_in_through_a_function_and_out() {
    let broker = Mosquitto::start();
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_with(
        &queue,
        Some(&broker.url()),
        &[("double.yaml", DOUBLE)],
        Failpoints::new(),
    )
    .await;
    let observer = MqttPeer::connect(broker.port, "observer", Some("results/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    device
        .until_routed("sensors/probe/reading", "probe", &observer)
        .await;
    device.publish_numbers(0..2000, 5).await;
    device
        .client
        .publish(
            "sensors/d9/reading",
            rumqttc::QoS::AtLeastOnce,
            false,
            "hello, not JSON",
        )
        .await
        .unwrap();
    // On a timeout, what the engine holds says where the missing messages are.
    let started = std::time::Instant::now();
    let within = Duration::from_secs(60);
    eventually("2000 doubled messages and the text one", within, || async {
        let seen = arrivals(&observer);
        let text = observer
            .received()
            .iter()
            .any(|(_, p)| p == b"hello, not JSON");
        if seen.len() == 2000 && text {
            return Ok(());
        }
        if started.elapsed() + Duration::from_secs(1) < within {
            return Err(json!({ "arrived": seen.len() }));
        }
        let missing: Vec<u64> = (0..2000)
            .filter(|n| !seen.contains_key(n))
            .take(20)
            .collect();
        Err(json!({
            "arrived": seen.len(),
            "the text one": text,
            "missing (the first 20)": missing,
            "queue": get_json(&e, "/api/stats").await,
            "dead letters": get_json(&e, "/api/dead-letters").await,
        }))
    })
    .await;
    for v in observer.json() {
        assert_eq!(
            v["n"].as_u64().unwrap() % 2,
            0,
            "every message went through the function: {v}"
        );
    }
    let (topic, _) = observer
        .received()
        .into_iter()
        .find(|(_, p)| p == b"hello, not JSON")
        .unwrap();
    assert_eq!(
        topic, "results/sensors/d9/reading",
        "the topic template ran"
    );
    e.shutdown().await;
}

/// A journal write whose answer is lost after it went through: mqtt-in hears an error and
/// adds the same messages again, as the same items, so each is journaled (and so published)
/// once, and acknowledged to the broker only after the retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_answer_lost_is_retried_without_duplicates() {
    let broker = Mosquitto::start();
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let fp = Failpoints::new();
    fp.arm("add-reply-lost", 3);
    let e = start_with(
        &queue,
        Some(&broker.url()),
        &[("double.yaml", DOUBLE)],
        fp.clone(),
    )
    .await;
    let observer = MqttPeer::connect(broker.port, "observer", Some("results/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    device
        .until_routed("sensors/probe/reading", "probe", &observer)
        .await;
    device.publish_numbers(0..300, 5).await;
    wait_for("300 doubled messages", Duration::from_secs(60), || {
        arrivals(&observer).len() == 300
    })
    .await;
    assert!(!fp.hit("add-reply-lost"), "the failpoint fired three times");
    // Everything journaled has run: a second copy of any message would have run too.
    let q = e.queue.clone();
    weir_testkit::eventually("the queue to be empty", Duration::from_secs(30), || {
        let q = q.clone();
        async move {
            let s = q.admin().stats().await.map_err(|e| e.to_string())?;
            match (s.ready, s.in_flight) {
                (0, 0) => Ok(()),
                other => Err(format!("ready, in flight: {other:?}")),
            }
        }
    })
    .await;
    let twice: Vec<_> = arrivals(&observer)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(twice.is_empty(), "published more than once: {twice:?}");
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_five_thousand_in_flight_loses_none() {
    let broker = Mosquitto::start();
    let flows = tempfile::tempdir().unwrap();
    std::fs::write(flows.path().join("double.yaml"), DOUBLE).unwrap();
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let args = ["--mqtt", &broker.url()];
    let observer = MqttPeer::connect(broker.port, "observer", Some("results/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    let mut e = WeirProcess::start(flows.path(), &queue, &args).await;
    // The engine subscribed before the device starts (its session then exists).
    device
        .until_routed("sensors/probe/reading", "probe", &observer)
        .await;
    device.publish_numbers(0..5000, 5).await;
    wait_for(
        "some messages through before the kill",
        Duration::from_secs(30),
        || observer.count() >= 300,
    )
    .await;
    let before = arrivals(&observer).len();
    e.kill();
    println!("killed with {before} of 5000 through");
    assert!(before < 5000, "the kill came while messages were in flight");
    let e = WeirProcess::start(flows.path(), &queue, &args).await;
    wait_for(
        "all 5000 after the restart",
        Duration::from_secs(120),
        || arrivals(&observer).len() == 5000,
    )
    .await;
    let seen = arrivals(&observer);
    let twice: usize = seen.values().map(|c| c - 1).sum();
    println!("all 5000 arrived; {twice} arrived more than once");
    assert_eq!(e.stop(Duration::from_secs(15)).await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_mid_stream_loses_nothing() {
    let mut broker = Mosquitto::start();
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_with(
        &queue,
        Some(&broker.url()),
        &[("double.yaml", DOUBLE)],
        Failpoints::new(),
    )
    .await;
    let observer = MqttPeer::connect(broker.port, "observer", Some("results/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    device
        .until_routed("sensors/probe/reading", "probe", &observer)
        .await;
    device.publish_numbers(0..300, 5).await;
    wait_for("the first 300", Duration::from_secs(30), || {
        arrivals(&observer).len() == 300
    })
    .await;
    broker.stop();
    // The engine sees its subscription gone, and has it again once the broker is back.
    let base = format!("http://{}", e.admin_addr);
    until_subscribed(&base, &[&broker.label()], 0).await;
    broker.restart();
    until_subscribed(&base, &[&broker.label()], 1).await;
    device.publish_numbers(300..600, 5).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while arrivals(&observer).len() < 600 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = arrivals(&observer);
    if seen.len() < 600 {
        // Say where the missing ones are: never journaled, stuck in the queue, or lost on
        // the way out (the engine's counters), with the broker's own log.
        let missing: Vec<u64> = (0..600).filter(|n| !seen.contains_key(n)).collect();
        let admin = |path: &'static str| {
            let url = format!("http://{}{path}", e.addr);
            async move { reqwest::get(url).await.unwrap().text().await.unwrap() }
        };
        let (stats, metrics) = (admin("/api/stats").await, admin("/metrics").await);
        let counters: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("weir_events_total") || l.starts_with("weir_items_ended"))
            .collect();
        panic!(
            "{} of 600 arrived after the broker restart; missing: {missing:?}\n\
             stats: {stats}\ncounters: {counters:#?}\nbroker log:\n{}",
            seen.len(),
            broker.log_tail(40)
        );
    }
    let stats: Value = reqwest::get(format!("http://{}/api/stats", e.addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["dead"], 0, "{stats}");
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_on_a_shared_subscription_journal_each_message_once() {
    let broker = Mosquitto::start();
    let flow = |name: &str| {
        format!(
            r#"
id: shared
nodes:
  in: {{ type: mqtt-in, topic: "sensors/+/reading", qos: 1, to: [mark] }}
  mark: {{ type: set, set: {{ payload.by: {name} }}, to: [out] }}
  out: {{ type: mqtt-out, topic: "results/{{{{ msg.topic }}}}", qos: 1 }}
"#
        )
    };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (fa, fb) = (flow("a"), flow("b"));
    let engine = |dir: &tempfile::TempDir, name: &str| {
        (
            format!("sqlite:{}/queue.db", dir.path().display()),
            format!("{}?client_id=engine-{name}&share=weir", broker.url()),
        )
    };
    let ((qa, ma), (qb, mb)) = (engine(&da, "a"), engine(&db, "b"));
    let a = start_with(&qa, Some(&ma), &[("shared.yaml", &fa)], Failpoints::new()).await;
    let b = start_with(&qb, Some(&mb), &[("shared.yaml", &fb)], Failpoints::new()).await;
    let observer = MqttPeer::connect(broker.port, "observer", Some("results/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    let at = broker.label();
    for (e, name) in [(&a, "a"), (&b, "b")] {
        let client = format!("client=\"engine-{name}-in-");
        until_subscribed(&format!("http://{}", e.admin_addr), &[&at, &client], 1).await;
    }
    device.publish_numbers(0..400, 5).await;
    wait_for(
        "400 messages through one engine or the other",
        Duration::from_secs(30),
        || observer.count() >= 400,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = observer.json();
    let mut ns: Vec<u64> = out.iter().filter_map(|v| v["n"].as_u64()).collect();
    ns.sort_unstable();
    assert_eq!(
        ns,
        (0..400).collect::<Vec<_>>(),
        "each message once, none twice"
    );
    let by_a = out.iter().filter(|v| v["by"] == "a").count();
    println!("engine a took {by_a}, engine b {}", 400 - by_a);
    assert!(
        by_a > 0 && by_a < 400,
        "the broker shared the work ({by_a} to a)"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtts_with_a_ca_file() {
    // A CA, and a broker certificate for 127.0.0.1 signed by it.
    let certs = tempfile::tempdir().unwrap();
    tls::write_ca_and_server(certs.path());
    let path = |f: &str| certs.path().join(f).display().to_string();
    let tls_port = weir_queue::testing::free_port();
    let broker = Mosquitto::start_with(&format!(
        "listener {tls_port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\n",
        path("ca.pem"),
        path("server.pem"),
        path("server.key")
    ));
    // The engine talks TLS; the test's own clients use the plain listener of the same broker.
    let url = format!("mqtts://127.0.0.1:{tls_port}?ca={}", path("ca.pem"));
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_with(
        &queue,
        Some(&url),
        &[("double.yaml", DOUBLE)],
        Failpoints::new(),
    )
    .await;
    let observer = MqttPeer::connect(broker.port, "observer", Some("results/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    device
        .until_routed("sensors/probe/reading", "probe", &observer)
        .await;
    device.publish_numbers(0..50, 5).await;
    wait_for(
        "50 messages through the TLS connections",
        Duration::from_secs(30),
        || arrivals(&observer).len() == 50,
    )
    .await;
    e.shutdown().await;
    // A CA that did not sign the broker's certificate is refused: nothing gets through.
    let other_key = rcgen::KeyPair::generate().unwrap();
    let mut other = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    other.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::fs::write(
        path("other.pem"),
        other.self_signed(&other_key).unwrap().pem(),
    )
    .unwrap();
    let wrong = format!(
        "mqtts://127.0.0.1:{tls_port}?ca={}&client_id=wrong",
        path("other.pem")
    );
    let data2 = tempfile::tempdir().unwrap();
    let queue2 = format!("sqlite:{}/queue.db", data2.path().display());
    let e = start_with(
        &queue2,
        Some(&wrong),
        &[("double.yaml", DOUBLE)],
        Failpoints::new(),
    )
    .await;
    let before = observer.count();
    device.publish_numbers(50..60, 5).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        observer.count(),
        before,
        "an untrusted broker gets no connection"
    );
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_bridges_two_named_brokers() {
    let (plant, cloud) = (Mosquitto::start(), Mosquitto::start());
    let flow = r#"
id: bridge
nodes:
  in: { type: mqtt-in, topic: "sensors/+/reading", to: [out] }
  out: { type: mqtt-out, broker: cloud, topic: "plant/{{ msg.topic }}" }
"#;
    let data = tempfile::tempdir().unwrap();
    let e = weir::Engine::builder()
        .queue_url(format!("sqlite:{}/queue.db", data.path().display()))
        .mqtt(plant.url())
        .mqtt_broker("cloud", cloud.url())
        .http("127.0.0.1:0".parse().unwrap())
        .flow_str("bridge.yaml", flow)
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let observer = MqttPeer::connect(cloud.port, "observer", Some("plant/#")).await;
    let device = MqttPeer::connect(plant.port, "device", None).await;
    until_subscribed(&format!("http://{}", e.admin_addr), &[&plant.label()], 1).await;
    device.publish_numbers(0..20, 5).await;
    wait_for(
        "20 messages carried from one broker to the other",
        Duration::from_secs(20),
        || observer.count() == 20,
    )
    .await;
    assert!(observer.received()[0].0.starts_with("plant/sensors/"));
    e.shutdown().await;

    // A broker name the engine was not given is refused at load, where it is written.
    let err = weir::Engine::builder()
        .mqtt(plant.url())
        .mqtt_broker("cloud", cloud.url())
        .flow_str(
            "bad.yaml",
            "nodes:\n  o:\n    type: mqtt-out\n    broker: clod\n    topic: x\n",
        )
        .build()
        .err()
        .expect("an unknown broker is refused");
    assert!(
        err.to_string()
            .contains("bad.yaml:4:13: node `o`: no broker named `clod` (known: cloud)"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos_0_and_2_and_three_flows_on_one_filter() {
    let broker = Mosquitto::start();
    let flow = |id: &str, qin: u8, qout: u8| {
        format!(
            r#"
id: {id}
nodes:
  in: {{ type: mqtt-in, topic: "q/#", qos: {qin}, to: [out] }}
  out: {{ type: mqtt-out, topic: "done/{id}", qos: {qout} }}
"#
        )
    };
    // Three flows on the same filter (one connection, one subscription): two publish at QoS 2
    // (more publishes in flight together than mosquitto allows a client: 20), one at QoS 0.
    let (f2, f0, f2b) = (
        flow("exact", 2, 2),
        flow("loose", 2, 0),
        flow("exact2", 2, 2),
    );
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_with(
        &queue,
        Some(&broker.url()),
        &[
            ("exact.yaml", &f2),
            ("loose.yaml", &f0),
            ("exact2.yaml", &f2b),
        ],
        Failpoints::new(),
    )
    .await;
    let observer = MqttPeer::connect(broker.port, "observer", Some("done/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    // One connection and one subscription for the three flows on the filter.
    until_subscribed(&format!("http://{}", e.admin_addr), &[&broker.label()], 1).await;
    for n in 0..50u64 {
        device
            .client
            .publish("q/x", rumqttc::QoS::ExactlyOnce, false, n.to_string())
            .await
            .unwrap();
    }
    wait_for("50 through each flow", Duration::from_secs(20), || {
        observer.count() >= 150
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = observer.received();
    for id in ["exact", "loose", "exact2"] {
        let mut ns: Vec<u64> = got
            .iter()
            .filter(|(t, _)| t == &format!("done/{id}"))
            .map(|(_, p)| String::from_utf8_lossy(p).parse().unwrap())
            .collect();
        ns.sort_unstable();
        assert_eq!(
            ns,
            (0..50).collect::<Vec<_>>(),
            "flow {id}: each message once, as a number"
        );
    }
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_down_at_start_is_waited_for_and_stops_nothing_else() {
    // Nothing listens on this port yet.
    let port = weir_queue::testing::free_port();
    let flows = [
        ("double.yaml", DOUBLE),
        ("hook.yaml", "nodes:\n  h: { type: webhook, path: ping, respond: wave, to: [r] }\n  r: { type: http-response }\n"),
    ];
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_with(
        &queue,
        Some(&format!("mqtt://127.0.0.1:{port}")),
        &flows,
        Failpoints::new(),
    )
    .await;
    let r = weir_testkit::post_json(&e, "ping", json!("up")).await;
    assert_eq!(
        r.status(),
        200,
        "the other flows run while the broker is down"
    );
    let (base, at) = (format!("http://{}", e.admin_addr), broker_label(port));
    assert_eq!(
        weir_testkit::metric_sum(&base, "weir_mqtt_subscribed", &[&at]).await,
        0,
        "no subscription while the broker is down"
    );
    // Down a while, the engine retrying; then the broker comes up on that port, and the
    // engine connects and subscribes by itself.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let broker = Mosquitto::start_on(port);
    let observer = MqttPeer::connect(broker.port, "observer", Some("results/#")).await;
    let device = MqttPeer::connect(broker.port, "device", None).await;
    until_subscribed(&base, &[&at], 1).await;
    device.publish_numbers(0..20, 5).await;
    wait_for(
        "the 20 published once it was up",
        Duration::from_secs(20),
        || arrivals(&observer).len() == 20,
    )
    .await;
    e.shutdown().await;
}

/// A broker that comes back without its sessions (here: persistence off) has forgotten what
/// the engine's publishing client had sent it unacknowledged, and the client drops what it
/// still held queued. No wave may take such a publish for done: every message reaches the
/// broker at least once (its own log lists what it received), however the restart falls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_forgets_its_sessions_still_gets_every_publish() {
    const N: u64 = 600;
    let mut broker = Mosquitto::start_with("persistence false\nlog_type all");
    let e = start_with(
        "memory",
        Some(&broker.url()),
        &[(
            "out.yaml",
            r#"
id: out
nodes:
  hook: { type: webhook, path: out, to: [out] }
  out: { type: mqtt-out, topic: "out/{{ msg.payload.n }}", qos: 1 }
"#,
        )],
        Failpoints::new(),
    )
    .await;
    let e = std::sync::Arc::new(e);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let posters: Vec<_> = (0..8)
        .map(|_| {
            let (e, next) = (e.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if n >= N {
                        return;
                    }
                    let r = weir_testkit::post_json(&e, "out", json!({ "n": n })).await;
                    assert_eq!(r.status(), 202);
                }
            })
        })
        .collect();
    wait_for("a third of the events in", Duration::from_secs(30), || {
        next.load(std::sync::atomic::Ordering::SeqCst) >= N / 3
    })
    .await;
    broker.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    broker.restart();
    for p in posters {
        p.await.unwrap();
    }
    // Every wave ended: nothing ready, in flight or waiting for a retry.
    eventually("every wave ended", Duration::from_secs(90), || async {
        let s = get_json(&e, "/api/stats").await;
        let left = ["ready", "in_flight", "delayed"]
            .iter()
            .map(|k| s[k].as_u64().unwrap_or(1))
            .sum::<u64>();
        if left == 0 {
            Ok(())
        } else {
            Err(s)
        }
    })
    .await;
    let log = broker.log();
    let received: std::collections::HashSet<u64> = log
        .lines()
        .filter(|l| l.contains("Received PUBLISH from"))
        .filter_map(|l| l.split("'out/").nth(1)?.split('\'').next()?.parse().ok())
        .collect();
    let missing: Vec<u64> = (0..N).filter(|n| !received.contains(n)).collect();
    assert!(
        missing.is_empty(),
        "{} of {N} publishes never reached the broker, though their waves ended: {missing:?}\n\
         dead letters: {}",
        missing.len(),
        get_json(&e, "/api/dead-letters").await
    );
    // And none was given up on: a failed connection's publishes are retried, not left to
    // time out until their item is dead-lettered.
    let stats = get_json(&e, "/api/stats").await;
    assert_eq!(stats["dead"], 0, "{stats}");
    if let Ok(e) = std::sync::Arc::try_unwrap(e) {
        e.shutdown().await;
    }
}

const BIG_IN: &str = r#"
id: big
nodes:
  in: { type: mqtt-in, topic: "big/#", qos: 1, to: [out] }
  out: { type: mqtt-out, topic: "seen/{{ msg.topic }}", qos: 1 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_past_max_packet_is_dropped_visibly_and_the_rest_flow() {
    let broker = Mosquitto::start();
    let device = MqttPeer::connect(broker.port, "device", None).await;
    let huge = vec![b'x'; 1_200_000];
    // A retained one, sent at every subscribe.
    device
        .client
        .publish(
            "big/retained",
            rumqttc::QoS::AtLeastOnce,
            true,
            huge.clone(),
        )
        .await
        .unwrap();
    let e = start_with(
        "memory",
        Some(&broker.url()),
        &[("big.yaml", BIG_IN)],
        Failpoints::new(),
    )
    .await;
    let base = format!("http://{}", e.admin_addr);
    let observer = MqttPeer::connect(broker.port, "observer", Some("seen/#")).await;
    device.until_routed("big/probe", "probe", &observer).await;
    device
        .client
        .publish("big/huge", rumqttc::QoS::AtLeastOnce, false, huge)
        .await
        .unwrap();
    device
        .client
        .publish("big/after", rumqttc::QoS::AtLeastOnce, false, "after")
        .await
        .unwrap();
    wait_for(
        "the message behind the huge one",
        Duration::from_secs(20),
        || {
            observer
                .received()
                .iter()
                .any(|(t, p)| t == "seen/big/after" && p == b"after")
        },
    )
    .await;
    eventually(
        "both huge messages counted",
        Duration::from_secs(10),
        || {
            let base = base.clone();
            async move {
                let n = weir_testkit::metric_sum(&base, "weir_bounds_hit_total", &["mqtt_packet"])
                    .await;
                if n >= 2 {
                    Ok(())
                } else {
                    Err(n)
                }
            }
        },
    )
    .await;
    assert!(
        !observer.received().iter().any(|(t, _)| t.contains("huge")),
        "nothing of the huge message was journaled"
    );
    e.shutdown().await;
}

const BIG_OUT: &str = r#"
id: shout
nodes:
  loud: { type: webhook, path: loud, to: [grow] }
  grow:
    type: function
    script: |
      let s = "x";
      while s.len() < 1200000 { s += s; }
      msg.payload = s;
      msg
    to: [out]
  quiet: { type: webhook, path: quiet, to: [out] }
  out: { type: mqtt-out, topic: "seen/shout", qos: 1 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_past_max_packet_fails_that_message_not_the_connection() {
    let broker = Mosquitto::start();
    let e = start_with(
        "memory",
        Some(&broker.url()),
        &[("shout.yaml", BIG_OUT)],
        Failpoints::new(),
    )
    .await;
    let observer = MqttPeer::connect(broker.port, "observer", Some("seen/#")).await;
    let post = |path: &'static str| {
        let url = format!("http://{}/hooks/{path}", e.addr);
        async move {
            reqwest::Client::new()
                .post(url)
                .json(&json!("hi"))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(post("quiet").await, 202);
    assert_eq!(post("loud").await, 202);
    let dead = weir_testkit::wait_for_dead_letters(&e, 1, Duration::from_secs(20)).await;
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(reason.contains("max_packet"), "{reason}");
    assert_eq!(post("quiet").await, 202);
    wait_for("both quiet messages out", Duration::from_secs(20), || {
        observer
            .received()
            .iter()
            .filter(|(_, p)| p == b"\"hi\"" || p == b"hi")
            .count()
            >= 2
    })
    .await;
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos0_flood_while_the_queue_fails_is_bounded_and_counted() {
    let broker = Mosquitto::start();
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let flow = r#"
id: flood
nodes:
  in: { type: mqtt-in, topic: "flood/#", qos: 0, to: [out] }
  out: { type: log }
"#;
    let fp = Failpoints::new();
    let e = start_with(
        &queue,
        Some(&broker.url()),
        &[("flood.yaml", flow)],
        fp.clone(),
    )
    .await;
    let base = format!("http://{}", e.admin_addr);
    until_subscribed(&base, &[&broker.label()], 1).await;
    // The queue refuses every write: what arrives waits in the engine, up to its bound.
    fp.arm("sqlite-batch", u32::MAX);
    let device = MqttPeer::connect(broker.port, "device", None).await;
    for n in 0..6_000 {
        device
            .client
            .publish("flood/x", rumqttc::QoS::AtMostOnce, false, n.to_string())
            .await
            .unwrap();
    }
    eventually(
        "QoS 0 messages past the bound dropped and counted",
        Duration::from_secs(20),
        || {
            let base = base.clone();
            async move {
                let dropped = weir_testkit::metric_sum(&base, "weir_mqtt_dropped_total", &[]).await;
                let hit =
                    weir_testkit::metric_sum(&base, "weir_bounds_hit_total", &["mqtt_intake"])
                        .await;
                if dropped > 0 && hit >= dropped {
                    Ok(())
                } else {
                    Err(json!({ "dropped": dropped, "bound hit": hit }))
                }
            }
        },
    )
    .await;
    fp.arm("sqlite-batch", 0);
    e.shutdown().await;
}
