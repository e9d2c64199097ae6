use super::*;

fn executor(queue: Queue, flows: &[(&str, &str)]) -> Arc<Executor> {
    executor_of(&weir_nodes::Library::builtin(), queue, flows)
}

/// An executor of `flows`, loaded with the node types of `lib`.
fn executor_of(lib: &weir_nodes::Library, queue: Queue, flows: &[(&str, &str)]) -> Arc<Executor> {
    let flows = flows
        .iter()
        .map(|(file, src)| lib.load_str(file, src).expect("flow loads"))
        .collect();
    Executor::new(
        queue,
        Arc::new(Flows::new(flows)),
        ExecConfig::default(),
        Failpoints::new(),
    )
}

/// A wave starts where its item is journaled only where no order can be passed: a flow
/// that runs waves side by side, with a place free, whose wave reaches no stateful node
/// (their calls queue in journal order). (A queue that cannot claim as it journals,
/// Redis, gives no place at all: the conformance suite checks it says so.)
#[test]
fn a_wave_starts_where_journaled_only_where_it_passes_no_order() {
    const ECHO: &str = "nodes:\n  h: { type: webhook, path: e, respond: wave, to: [a] }\n  a: { type: http-response }\n";
    let serial = format!("concurrency: 1\n{ECHO}");
    let two = format!("concurrency: 2\n{ECHO}");
    let counted = "nodes:\n  h: { type: webhook, path: c, respond: wave, to: [n] }\n  n: { type: function, script: 'state.set(\"n\", 1); msg', to: [a] }\n  a: { type: http-response }\n";
    let delayed = "nodes:\n  h: { type: webhook, path: d, respond: wave, to: [d] }\n  d: { type: delay, for: 1s, mode: restart, to: [a] }\n  a: { type: http-response }\n";
    let flows = [
        ("echo.yaml", ECHO),
        ("serial.yaml", serial.as_str()),
        ("two.yaml", two.as_str()),
        ("counted.yaml", counted),
        ("delayed.yaml", delayed),
    ];
    let ex = executor(weir_queue::MemoryQueue::new().into(), &flows);
    assert!(ex.place_for("echo", "h").is_some());
    assert!(ex.place_for("serial", "h").is_none(), "concurrency 1");
    assert!(
        ex.place_for("counted", "h").is_none(),
        "a function with state"
    );
    assert!(ex.place_for("delayed", "h").is_none(), "a debounce");
    assert!(ex.place_for("gone", "h").is_none(), "a flow not loaded");
    let held = [ex.place_for("two", "h"), ex.place_for("two", "h")];
    assert!(held.iter().all(Option::is_some));
    assert!(ex.place_for("two", "h").is_none(), "both places held");
    drop(held);
    assert!(ex.place_for("two", "h").is_some(), "places given back");
}

/// A wave its caller runs ([`Executor::start_claimed`]) and drops before the end (a
/// webhook's client hung up, or the reply came before the commit) runs to its end on its
/// own: its item is finished, not left in flight until the reclaim delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_started_wave_dropped_before_its_end_still_ends() {
    const ECHO: &str = "nodes:\n  h: { type: webhook, path: e, respond: wave, to: [f] }\n  f: { type: function, script: 'msg.payload.seen = true; msg', to: [a] }\n  a: { type: http-response }\n";
    let q = Queue::from(weir_queue::SqliteQueue::temporary(Failpoints::new()).unwrap());
    let ex = executor(q.clone(), &[("echo.yaml", ECHO)]);
    let mut ids = Vec::new();
    for polled in [false, true] {
        let place = ex.place_for("echo", "h").expect("a place");
        let msg = serde_json::json!({ "payload": { "n": 1 } });
        let item = weir_queue::WorkItem::cascade("echo", "h", "t", vec![msg]);
        let id = item.id;
        let c = q
            .claim_on_add()
            .unwrap()
            .add_claimed(&ex.cfg.consumer, item)
            .await
            .unwrap();
        let mut wave = ex.start_claimed(place, c.expect("claimed: nothing else is ready"));
        if polled {
            // Run as a webhook does: as far as its reply, which comes before the commit.
            let reply = wave.run_until(q.wait_reply(id, Duration::from_secs(10)));
            let body = reply.await.unwrap().expect("a reply").body;
            let body: serde_json::Value = serde_json::from_str(body.json()).unwrap();
            assert_eq!(body["seen"], true, "the function ran");
        }
        drop(wave);
        ids.push(id);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for id in ids {
        loop {
            let state = q.admin().get(id).await.unwrap().expect("journaled").state;
            if state.name() == "finished" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the wave did not end: {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `type: boom`, a node that panics: a bug in a node type of an embedder's.
struct Boom;

#[async_trait::async_trait]
impl weir_nodes::Node for Boom {
    async fn call(
        &self,
        _: weir_core::Message,
        _: &mut weir_nodes::NodeCx<'_>,
    ) -> Result<weir_nodes::Emit, weir_nodes::NodeError> {
        panic!("boom");
    }
}

impl weir_nodes::NodeFactory for Boom {
    fn kind(&self) -> &str {
        "boom"
    }

    fn build(
        &self,
        _: &weir_flow::Yaml,
    ) -> Result<weir_nodes::Built, Vec<weir_nodes::ConfigError>> {
        Ok(weir_nodes::Built {
            node: Arc::new(Boom),
            ports: vec![],
        })
    }
}

/// A node that panics in a wave its caller runs fails that wave alone, as it would in a
/// task of its own: the caller (a webhook's request) goes on to its reply's timeout, the
/// wave's place is given back, and the item is left in flight for redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_panics_in_a_started_wave_fails_that_wave_alone() {
    const BOOM: &str = "concurrency: 2\nnodes:\n  h: { type: webhook, path: b, respond: wave, to: [b] }\n  b: { type: boom }\n";
    let mut lib = weir_nodes::Library::builtin();
    lib.register(Boom);
    let q = Queue::from(weir_queue::SqliteQueue::temporary(Failpoints::new()).unwrap());
    let ex = executor_of(&lib, q.clone(), &[("boom.yaml", BOOM)]);
    let place = ex.place_for("boom", "h").expect("a place");
    let item = weir_queue::WorkItem::cascade("boom", "h", "t", vec![serde_json::json!({})]);
    let id = item.id;
    let c = q
        .claim_on_add()
        .unwrap()
        .add_claimed(&ex.cfg.consumer, item)
        .await
        .unwrap();
    let mut wave = ex.start_claimed(place, c.expect("claimed"));
    let reply = wave.run_until(q.wait_reply(id, Duration::from_millis(300)));
    assert!(reply.await.unwrap().is_none(), "no reply: the wave failed");
    drop(wave);
    let held = [ex.place_for("boom", "h"), ex.place_for("boom", "h")];
    assert!(held.iter().all(Option::is_some), "the place was given back");
    let state = q.admin().get(id).await.unwrap().expect("journaled").state;
    assert_eq!(state.name(), "in_flight", "left for redelivery");
}

#[test]
fn backoff_doubles_with_jitter_up_to_the_cap() {
    let (base, cap) = (Duration::from_secs(1), Duration::from_secs(300));
    for attempt in 1..=12 {
        let want = Duration::from_secs(1 << (attempt - 1)).min(cap);
        let got = backoff(base, cap, attempt);
        assert!(
            got >= want.mul_f64(0.8) && got <= want.mul_f64(1.2).min(cap),
            "{attempt}: {got:?}"
        );
    }
    assert!(backoff(base, cap, 1000) <= cap, "never past the cap");
}
