//! Whole-engine tests: a real engine on a free port, driven over HTTP as a user would.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use weir::{Failpoints, RunningEngine};
use weir_testkit::{get_json, post_admin, post_json, start, start_on, wait_for, Sink};

const SECS: Duration = Duration::from_secs(10);

/// Items parked now, from `/api/stats`.
async fn parked(e: &RunningEngine) -> u64 {
    get_json(e, "/api/stats").await["parked"].as_u64().unwrap()
}

/// Wait until at least `n` items are parked.
async fn wait_parked(e: &RunningEngine, n: u64) {
    wait_stats(e, "items parked", |s| s["parked"].as_u64() >= Some(n)).await;
}

/// Wait (up to `SECS`) until `/api/stats` satisfies `cond`, naming `what` and the last
/// stats seen if it never does.
async fn wait_stats(e: &RunningEngine, what: &str, cond: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + SECS;
    loop {
        let s = get_json(e, "/api/stats").await;
        if cond(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: never seen; last {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The item id of an accepted (202) webhook request's answer.
async fn accepted_id(r: reqwest::Response) -> String {
    let body = r.json::<Value>().await.unwrap();
    body["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id: {body}"))
        .to_string()
}

/// The answer goes back, and the message goes on past the nodes that answer and log where
/// they are wired (they skip their copy of it only where nothing is wired).
#[tokio::test]
async fn webhook_echo_is_answered_by_the_wave() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  hook: {{ type: webhook, path: echo, respond: wave, to: [shape] }}
  shape:
    type: function
    script: |
      msg.payload = #{{ echoed: msg.payload.word + "!" }};
      msg
    to: [answer]
  answer: {{ type: http-response, status: 201, headers: {{ x-flow: echo }}, to: [note] }}
  note: {{ type: log, to: [after, last] }}
  after: {{ type: http-request, url: "{}" }}
  last: {{ type: http-response, status: 500 }}
"#,
        sink.url("after")
    );
    let e = start(&[("echo.yaml", &flow)], Failpoints::new()).await;
    let r = post_json(&e, "echo", json!({"word": "hello"})).await;
    assert_eq!(r.status(), 201);
    assert_eq!(r.headers()["x-flow"], "echo");
    assert!(r.headers().contains_key("x-weir-item"));
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"echoed": "hello!"})
    );
    wait_for("the message past the answer", SECS, || sink.count() == 1).await;
    assert_eq!(sink.bodies(), vec![json!({"echoed": "hello!"})]);
    e.shutdown().await;
}

/// A script's result is what it ends with, however it ends: naming `msg` last (which weir
/// runs by taking the message out of the script's scope), a `msg` of its own, a closure that
/// shares `msg`, an early `return` or `exit`, or an `exit` reached by a name the script
/// builds. Two scripts may define functions of the same name, each its own.
#[tokio::test]
async fn a_function_answers_what_its_script_ends_with() {
    let mut nodes = String::from("nodes:\n");
    for (name, script) in [
        ("plain", "msg.payload.n += 1;\nmsg"),
        (
            "block",
            "if msg.payload.n > 0 { msg.payload.big = true }\nmsg",
        ),
        ("shadowed", "let msg = #{ payload: \"mine\" };\nmsg"),
        (
            "shared",
            "let f = || msg.payload.n * 10;\nmsg.payload.m = f.call();\nmsg",
        ),
        (
            "returns",
            "if msg.payload.n > 5 { return #{ payload: \"early\" }; }\nmsg",
        ),
        (
            "exits",
            "if msg.payload.n > 5 { exit(#{ payload: \"exited\" }); }\nmsg",
        ),
        (
            "built",
            "if msg.payload.n > 5 { let f = Fn(\"ex\" + \"it\"); f.call(#{ payload: \"built\" }); }\nmsg",
        ),
        ("commented", "msg.payload.c = 1;\nmsg // passed on"),
        // Every function node runs on one engine: a function a script defines stays its own.
        ("fna", "fn f(x) { x + 1 }\nmsg.payload.f = f(msg.payload.n);\nmsg"),
        ("fnb", "fn f(x) { x * 100 }\nmsg.payload.f = f(msg.payload.n);\nmsg"),
    ] {
        nodes.push_str(&format!(
            "  {name}: {{ type: webhook, path: {name}, respond: wave, to: [{name}-run] }}\n  {name}-run:\n    type: function\n    script: {script:?}\n    to: [{name}-answer]\n  {name}-answer: {{ type: http-response }}\n"
        ));
    }
    let e = start(&[("ends.yaml", &nodes)], Failpoints::new()).await;
    for (path, n, want) in [
        ("plain", 1, json!({"n": 2})),
        ("block", 1, json!({"n": 1, "big": true})),
        ("block", 0, json!({"n": 0})),
        ("shadowed", 1, json!("mine")),
        ("shared", 2, json!({"n": 2, "m": 20})),
        ("returns", 1, json!({"n": 1})),
        ("returns", 9, json!("early")),
        ("exits", 1, json!({"n": 1})),
        ("exits", 9, json!("exited")),
        ("built", 1, json!({"n": 1})),
        ("built", 9, json!("built")),
        ("commented", 1, json!({"n": 1, "c": 1})),
        ("fna", 2, json!({"n": 2, "f": 3})),
        ("fnb", 2, json!({"n": 2, "f": 200})),
    ] {
        let r = post_json(&e, path, json!({ "n": n })).await;
        assert_eq!(r.status(), 200, "{path} {n}");
        let body = r.text().await.unwrap();
        let got = serde_json::from_str(&body).unwrap_or(Value::String(body));
        assert_eq!(got, want, "{path} {n}");
    }
    e.shutdown().await;
}

/// The answer is the payload: a string as its text, anything else as its JSON.
#[tokio::test]
async fn a_string_payload_is_answered_as_text_and_any_other_as_json() {
    let flow = r#"
nodes:
  hook: { type: webhook, path: say, respond: wave, to: [pick] }
  pick:
    type: function
    script: |
      msg.payload = msg.payload.answer;
      msg
    to: [answer]
  answer: { type: http-response }
"#;
    let e = start(&[("say.yaml", flow)], Failpoints::new()).await;
    let text = "say \"hi\"\nété \\ done";
    for (answer, kind, body) in [
        (json!(text), "text/plain; charset=utf-8", text.to_string()),
        (json!(42), "application/json", "42".to_string()),
        (json!(null), "application/json", "null".to_string()),
        (
            json!([1, "two"]),
            "application/json",
            r#"[1,"two"]"#.to_string(),
        ),
        (
            json!("{\"not\": \"parsed\"}"),
            "text/plain; charset=utf-8",
            r#"{"not": "parsed"}"#.to_string(),
        ),
    ] {
        let r = post_json(&e, "say", json!({ "answer": answer })).await;
        assert_eq!(r.status(), 200, "{answer}");
        assert_eq!(r.headers()["content-type"], kind, "{answer}");
        assert_eq!(r.text().await.unwrap(), body, "{answer}");
    }
    e.shutdown().await;
}

#[tokio::test]
async fn respond_wave_without_an_answer_times_out_with_504_and_the_id() {
    let flow = r#"
nodes:
  hook: { type: webhook, path: slow, respond: wave, timeout: 300ms, to: [wait] }
  wait: { type: delay, for: 2s, to: [answer] }
  answer: { type: http-response }
"#;
    let e = start(&[("slow.yaml", flow)], Failpoints::new()).await;
    let t = Instant::now();
    let r = post_json(&e, "slow", json!(1)).await;
    assert_eq!(r.status(), 504);
    assert!(t.elapsed() < Duration::from_secs(2));
    let body: Value = r.json().await.unwrap();
    let id = body["id"].as_str().unwrap().to_string();
    let item = get_json(&e, &format!("/api/items/{id}")).await;
    assert_eq!(
        item["item"]["id"],
        id.as_str(),
        "the event was accepted: {item}"
    );
    e.shutdown().await;
}

/// A `respond: wave` request whose wave ends with no answer and nothing left that could
/// answer it later is told so once the wave is committed, not with a 504 at its timeout
/// (20 s here: a 504 would fail each assertion on the status): 500 naming the dead letters
/// when the wave failed, whole or where a node failed, 502 when it ended without reaching an
/// `http-response`. A wave that leaves a delay behind still waits (the test above). On each
/// backend: the answer travels through it.
#[tokio::test]
async fn respond_wave_whose_wave_ends_unanswered_is_told_at_once() {
    unanswered_is_told_at_once("memory").await;
}

#[tokio::test]
async fn respond_wave_whose_wave_ends_unanswered_is_told_at_once_on_sqlite() {
    let data = tempfile::tempdir().unwrap();
    unanswered_is_told_at_once(&format!("sqlite:{}/queue.db", data.path().display())).await;
}

#[tokio::test]
async fn respond_wave_whose_wave_ends_unanswered_is_told_at_once_on_redis() {
    let redis = weir_queue::testing::RedisServer::start();
    unanswered_is_told_at_once(&redis.url()).await;
}

async fn unanswered_is_told_at_once(queue: &str) {
    let flow = r#"
nodes:
  failing: { type: webhook, path: failing, respond: wave, timeout: 20s, to: [check] }
  dropping: { type: webhook, path: dropping, respond: wave, timeout: 20s, to: [which] }
  looping: { type: webhook, path: looping, respond: wave, timeout: 20s, to: [a] }
  check:
    type: function
    script: |
      if msg.payload.poison == true { throw "cannot digest " + msg.payload.n; }
      msg
    to: [answer]
  which:
    type: switch
    rules:
      - if: msg.payload.n > 10
        to: [answer]
  a: { type: set, set: { payload.x: 1 }, to: [b] }
  b: { type: set, set: { payload.y: 2 }, to: [a] }
  answer: { type: http-response }
"#;
    let e = start_on(queue, &[("unanswered.yaml", flow)], Failpoints::new()).await;
    // Answered as ever when the wave reaches its http-response.
    let r = post_json(&e, "failing", json!({"n": 1})).await;
    assert_eq!(r.status(), 200);
    let r = post_json(&e, "dropping", json!({"n": 11})).await;
    assert_eq!(r.status(), 200);

    // A node fails permanently: its input is dead-lettered and the request hears which.
    let r = post_json(&e, "failing", json!({"n": 2, "poison": true})).await;
    let (id, body) = told(r, 500).await;
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("cannot digest 2"), "{body}");
    let dead = body["dead_letters"][0].as_str().unwrap();
    let item = get_json(&e, &format!("/api/items/{dead}")).await;
    assert_eq!(item["state"], "dead", "the dead letter is kept: {item}");
    assert_eq!(
        item["item"]["outputs"][0][0]["payload"]["n"], 2,
        "with the input it failed on: {item}"
    );
    wait_finished(&e, &id).await;

    // The whole wave dead-letters (a loop past the step bound): the item itself is named.
    let r = post_json(&e, "looping", json!({})).await;
    let (_, body) = told(r, 500).await;
    assert!(
        body["error"].as_str().unwrap().contains("step bound"),
        "{body}"
    );
    assert_eq!(body["dead_letters"][0], body["id"], "{body}");
    let item = get_json(&e, &format!("/api/items/{}", body["id"].as_str().unwrap())).await;
    assert_eq!(item["state"], "dead", "{item}");

    // Nothing failed, nothing answered: the switch dropped the message.
    let r = post_json(&e, "dropping", json!({"n": 3})).await;
    let (id, body) = told(r, 502).await;
    reached_no_answer(&body);
    wait_finished(&e, &id).await;
    e.shutdown().await;
}

/// A request whose wave goes on in one item alone, a retry or a delay, waits for that item,
/// and is told at once when that item's wave, too, ends without an answer: after a node
/// retried until it expired, 500 naming the dead letter; after a delay whose message a
/// switch dropped, 502. A chain that does answer is answered as ever, retries and all, and
/// a wave that leaves two items hands the wait to neither (the first to end unanswered does
/// not answer for the other). On each backend: the mark on the item survives its journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn respond_wave_chain_that_ends_unanswered_is_told_at_once() {
    unanswered_chain_is_told_at_once("memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn respond_wave_chain_that_ends_unanswered_is_told_at_once_on_sqlite() {
    let data = tempfile::tempdir().unwrap();
    unanswered_chain_is_told_at_once(&format!("sqlite:{}/queue.db", data.path().display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn respond_wave_chain_that_ends_unanswered_is_told_at_once_on_redis() {
    let redis = weir_queue::testing::RedisServer::start();
    unanswered_chain_is_told_at_once(&redis.url()).await;
}

async fn unanswered_chain_is_told_at_once(queue: &str) {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  flaky: {{ type: webhook, path: flaky, respond: wave, timeout: 20s, to: [call] }}
  call: {{ type: http-request, url: "{}", retry: {{ initial: 50ms, max: 100ms }}, to: [answer] }}
  later: {{ type: webhook, path: later, respond: wave, timeout: 20s, to: [wait] }}
  wait: {{ type: delay, for: 200ms, to: [which] }}
  both: {{ type: webhook, path: both, respond: wave, timeout: 20s, to: [soon, late] }}
  soon: {{ type: delay, for: 50ms, to: [which] }}
  late: {{ type: delay, for: 400ms, to: [answer] }}
  which:
    type: switch
    rules:
      - if: msg.payload.n > 10
        to: [answer]
  answer: {{ type: http-response }}
"#,
        sink.url("got")
    );
    let mut exec = weir_testkit::test_exec();
    exec.max_age = Duration::from_millis(800);
    let e = weir_testkit::start_exec(queue, exec, &[("chain.yaml", &flow)]).await;

    // Answered by the chain as ever: after two retries, and after the delay.
    sink.fail_next(&[503, 503]);
    let r = post_json(&e, "flaky", json!({"n": 1})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"ok": true}));
    assert_eq!(sink.count(), 1, "the third call went through");
    let r = post_json(&e, "later", json!({"n": 11})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"n": 11}));

    // The delay's message dropped by the switch: 502, not a 504 at 20 s.
    let r = post_json(&e, "later", json!({"n": 3})).await;
    let (_, body) = told(r, 502).await;
    reached_no_answer(&body);

    // Two items left: the one whose message is dropped first does not answer for the other,
    // which answers later.
    let r = post_json(&e, "both", json!({"n": 4})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"n": 4}));

    // The node keeps failing until its retries expire: 500 with the dead letter.
    sink.fail_next(&[503; 1000]);
    let r = post_json(&e, "flaky", json!({"n": 2})).await;
    let (id, body) = told(r, 500).await;
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("expired") && error.contains("503"), "{body}");
    let dead = body["dead_letters"][0].as_str().unwrap();
    assert_ne!(dead, id, "the dead letter is the last retry: {body}");
    let item = get_json(&e, &format!("/api/items/{dead}")).await;
    assert_eq!(item["state"], "dead", "{item}");
    assert_eq!(item["item"]["origin_id"], id.as_str(), "{item}");
    assert_eq!(
        item["item"]["outputs"][0][0]["payload"]["n"], 2,
        "with the input it failed on: {item}"
    );
    e.shutdown().await;
}

/// A password in an http-request's URL is sent (as basic auth) and never shown, and neither
/// is a secret query parameter's value (`?api_key=`, `&token=`): a failure's reason, which
/// the dead letter, the log and a `respond: wave` answer carry, names the server with `***`
/// in their places, whether the server answered 4xx or could not be reached at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_a_url_is_never_shown_in_a_failure() {
    let sink = Sink::start().await;
    let closed = weir_queue::testing::free_port();
    let with_password = |url: String| url.replace("http://", "http://weir:hunter2@");
    let flow = format!(
        r#"
nodes:
  refused: {{ type: webhook, path: refused, respond: wave, timeout: 20s, to: [told] }}
  told: {{ type: http-request, url: "{}", to: [answer] }}
  away: {{ type: webhook, path: away, respond: wave, timeout: 20s, to: [gone] }}
  gone: {{ type: http-request, url: "http://weir:hunter2@127.0.0.1:{closed}/x?n=2&token=t0k3n", retry: {{ initial: 50ms, max: 100ms }}, to: [answer] }}
  answer: {{ type: http-response }}
"#,
        with_password(sink.url("in")) + "?api_key=s3cr3t&n=1"
    );
    let mut exec = weir_testkit::test_exec();
    exec.max_age = Duration::from_millis(500);
    let e = weir_testkit::start_exec("memory", exec, &[("secret.yaml", &flow)]).await;

    sink.fail_next(&[404]);
    let r = post_json(&e, "refused", json!({"n": 1})).await;
    let (_, body) = told(r, 500).await;
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("answered 404")
            && error.contains("http://weir:***@127.0.0.1:")
            && error.contains("/in?api_key=***&n=1"),
        "{body}"
    );
    assert!(!body.to_string().contains("hunter2"), "{body}");
    assert!(!body.to_string().contains("s3cr3t"), "{body}");
    let dead = body["dead_letters"][0].as_str().unwrap();
    let item = get_json(&e, &format!("/api/items/{dead}")).await;
    assert!(!item.to_string().contains("hunter2"), "{item}");
    assert!(!item.to_string().contains("s3cr3t"), "{item}");

    let r = post_json(&e, "away", json!({"n": 2})).await;
    let (_, body) = told(r, 500).await;
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("expired")
            && error.contains(&format!("weir:***@127.0.0.1:{closed}/x?n=2&token=***")),
        "{body}"
    );
    assert!(!body.to_string().contains("hunter2"), "{body}");
    assert!(!body.to_string().contains("t0k3n"), "{body}");
    e.shutdown().await;
}

/// A request told its wave ended unanswered: `status`, and a body naming the request's own
/// item (the one its `x-weir-item` header names). Returns that id and the body.
async fn told(r: reqwest::Response, status: u16) -> (String, Value) {
    assert_eq!(r.status(), status);
    let id = r.headers()["x-weir-item"].to_str().unwrap().to_string();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["id"], id.as_str(), "the request's own item: {body}");
    (id, body)
}

/// A 502's body: the wave reached no `http-response`, and nothing was dead-lettered.
fn reached_no_answer(body: &Value) {
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("without reaching an http-response"),
        "{body}"
    );
    assert!(body.get("dead_letters").is_none(), "{body}");
}

#[tokio::test]
async fn switch_routes_by_rule_and_else() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  in: {{ type: webhook, path: route, to: [which] }}
  which:
    type: switch
    rules:
      - if: msg.payload.n > 10
        to: [big]
      - if: msg.payload.n > 5
        to: [medium]
    else: [small]
  big: {{ type: set, set: {{ payload.kind: big }}, to: [out] }}
  medium: {{ type: set, set: {{ payload.kind: medium }}, to: [out] }}
  small: {{ type: set, set: {{ payload.kind: small }}, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("route")
    );
    let e = start(&[("route.yaml", &flow)], Failpoints::new()).await;
    for n in [20, 7, 1] {
        assert_eq!(post_json(&e, "route", json!({"n": n})).await.status(), 202);
    }
    wait_for("three routed messages", SECS, || sink.count() == 3).await;
    let mut kinds: Vec<(i64, String)> = sink
        .bodies()
        .iter()
        .map(|b| {
            (
                b["n"].as_i64().unwrap(),
                b["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            (1, "small".into()),
            (7, "medium".into()),
            (20, "big".into())
        ]
    );
    e.shutdown().await;
}

#[tokio::test]
async fn debounce_sends_only_the_last_message_timed_from_the_last() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  in: {{ type: webhook, path: bounce, to: [quiet] }}
  quiet: {{ type: delay, for: 600ms, mode: restart, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("bounce")
    );
    let e = start(&[("bounce.yaml", &flow)], Failpoints::new()).await;
    let mut last_sent = Instant::now();
    for n in 0..5 {
        assert_eq!(post_json(&e, "bounce", json!({"n": n})).await.status(), 202);
        last_sent = Instant::now();
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    wait_for("the debounced message", SECS, || sink.count() >= 1).await;
    // Give any wrongly surviving timer time to fire too.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let got = sink.received();
    assert_eq!(
        got.len(),
        1,
        "only the last of the burst: {:?}",
        sink.bodies()
    );
    assert_eq!(got[0].1, json!({"n": 4}));
    assert!(
        got[0].0.duration_since(last_sent) >= Duration::from_millis(550),
        "timed from the last message"
    );
    let stats = get_json(&e, "/api/stats").await;
    assert_eq!(stats["delayed"], 0);
    e.shutdown().await;
}

#[tokio::test]
async fn each_delays_every_message() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  in: {{ type: webhook, path: wait, to: [hold] }}
  hold: {{ type: delay, for: 400ms, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("each")
    );
    let e = start(&[("wait.yaml", &flow)], Failpoints::new()).await;
    let sent = Instant::now();
    for n in 0..3 {
        post_json(&e, "wait", json!({"n": n})).await;
    }
    let stats = get_json(&e, "/api/stats").await;
    assert!(
        stats["delayed"].as_u64().unwrap()
            + stats["ready"].as_u64().unwrap()
            + stats["in_flight"].as_u64().unwrap()
            >= 1
    );
    wait_for("three delayed messages", SECS, || sink.count() == 3).await;
    for (at, _) in sink.received() {
        assert!(at.duration_since(sent) >= Duration::from_millis(380));
    }
    e.shutdown().await;
}

#[tokio::test]
async fn a_seconds_cron_ticks_about_once_a_second() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  every: {{ type: cron, schedule: "* * * * * *", to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("tick")
    );
    let e = start(&[("tick.yaml", &flow)], Failpoints::new()).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let n = sink.count();
    assert!((2..=5).contains(&n), "{n} ticks in 3.5 s");
    let ticks: Vec<String> = sink
        .bodies()
        .iter()
        .map(|b| b.as_str().unwrap().to_string())
        .collect();
    let mut dedup = ticks.clone();
    dedup.dedup();
    assert_eq!(ticks, dedup, "each tick journaled once");
    e.shutdown().await;
}

#[tokio::test]
async fn paused_flow_parks_step_runs_the_oldest_resume_runs_the_rest_in_order() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
concurrency: 1
nodes:
  in: {{ type: webhook, path: p, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("p")
    );
    let e = start(&[("paused.yaml", &flow)], Failpoints::new()).await;
    assert_eq!(
        post_admin(&e, "/api/flows/paused/pause").await["paused"],
        true
    );
    for n in 0..4 {
        post_json(&e, "p", json!({"n": n})).await;
    }
    wait_parked(&e, 4).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.count(), 0, "a paused flow runs nothing");
    let step = post_admin(&e, "/api/flows/paused/step").await;
    assert!(step["stepped"].is_string());
    wait_for("the stepped item", SECS, || sink.count() == 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        sink.bodies(),
        vec![json!({"n": 0})],
        "step runs exactly the oldest"
    );
    assert_eq!(parked(&e).await, 3);
    let flows = get_json(&e, "/api/flows").await;
    assert_eq!(flows[0]["paused"], true, "still paused after a step");
    assert_eq!(
        flows[0]["parked"], 3,
        "each flow says how many it holds parked"
    );
    post_admin(&e, "/api/flows/paused/resume").await;
    wait_for("the rest", SECS, || sink.count() == 4).await;
    assert_eq!(
        sink.bodies(),
        (0..4).map(|n| json!({"n": n})).collect::<Vec<_>>(),
        "in order"
    );
    e.shutdown().await;
}

#[tokio::test]
async fn a_poison_message_is_dead_lettered_while_the_others_flow() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  in: {{ type: webhook, path: mixed, to: [check] }}
  check:
    type: function
    script: |
      if msg.payload.poison == true {{ throw "cannot digest " + msg.payload.n; }}
      if msg.payload.spin == true {{ loop {{ }} }}
      msg
    to: [out]
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("mixed")
    );
    let e = start(&[("mixed.yaml", &flow)], Failpoints::new()).await;
    let msgs = [
        json!({"n": 1}),
        json!({"n": 2, "poison": true}),
        json!({"n": 3, "spin": true}),
        json!({"n": 4}),
    ];
    for m in msgs {
        assert_eq!(post_json(&e, "mixed", m).await.status(), 202);
    }
    wait_for("the two good messages", SECS, || sink.count() == 2).await;
    let mut ns: Vec<i64> = sink
        .bodies()
        .iter()
        .map(|b| b["n"].as_i64().unwrap())
        .collect();
    ns.sort();
    assert_eq!(ns, vec![1, 4]);
    let deadline = Instant::now() + SECS;
    let dead = loop {
        let d = get_json(&e, "/api/dead-letters").await;
        if d.as_array().unwrap().len() == 2 || Instant::now() > deadline {
            break d;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let reasons: Vec<String> = dead
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["reason"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(reasons.len(), 2, "{dead}");
    assert!(
        reasons.iter().any(|r| r.contains("cannot digest 2")),
        "{reasons:?}"
    );
    // Each carries the message its node failed on, as it arrived.
    let inputs: Vec<&Value> = dead
        .as_array()
        .unwrap()
        .iter()
        .map(|d| &d["item"]["outputs"][0][0]["payload"])
        .collect();
    for m in [
        json!({"n": 2, "poison": true}),
        json!({"n": 3, "spin": true}),
    ] {
        assert!(inputs.contains(&&m), "{m} among {inputs:?}");
    }
    assert!(
        reasons.iter().any(|r| r.contains("operations")),
        "{reasons:?}"
    );
    // A dead letter can be replayed: it fails the same way, and is listed again.
    let id = dead[0]["item"]["id"].as_str().unwrap();
    let replayed = post_admin(&e, &format!("/api/dead-letters/{id}/replay")).await;
    assert!(replayed["id"].is_string(), "{replayed}");
    e.shutdown().await;
}

#[tokio::test]
async fn a_side_effect_happens_once_across_a_redelivery_and_the_rest_of_the_wave_runs() {
    let effects = Sink::start().await;
    let after = Sink::start().await;
    let flow = format!(
        r#"
nodes:
  in: {{ type: webhook, path: once, to: [charge] }}
  charge: {{ type: http-request, url: "{}", to: [note] }}
  note:
    type: function
    script: |
      msg.payload = #{{ charged: msg.status }};
      msg
    to: [tell]
  tell: {{ type: http-request, url: "{}" }}
"#,
        effects.url("charge"),
        after.url("after")
    );
    let fp = Failpoints::new();
    // The first wave stops dead right after the charge and its done marker, as a crash would.
    fp.arm("after:once/charge", 1);
    let e = start(&[("once.yaml", &flow)], fp).await;
    let r = post_json(&e, "once", json!({"order": 7})).await;
    let id = accepted_id(r).await;
    wait_for("the wave downstream of the charge", SECS, || {
        after.count() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(effects.count(), 1, "the charge happened once");
    assert_eq!(after.bodies(), vec![json!({"charged": 200})]);
    let item = get_json(&e, &format!("/api/items/{id}")).await;
    assert_eq!(
        item["item"]["deliveries"], 2,
        "the item was redelivered: {item}"
    );
    assert_eq!(item["state"], "finished");
    e.shutdown().await;
}

#[tokio::test]
async fn a_failing_sink_is_retried_at_that_node_only() {
    let counter = Sink::start().await;
    let sink = Sink::start().await;
    sink.fail_next(&[503, 503]);
    let flow = format!(
        r#"
nodes:
  in: {{ type: webhook, path: retry, to: [first] }}
  first: {{ type: http-request, url: "{}", to: [second] }}
  second: {{ type: http-request, url: "{}" }}
"#,
        counter.url("first"),
        sink.url("second")
    );
    let e = start(&[("retry.yaml", &flow)], Failpoints::new()).await;
    post_json(&e, "retry", json!({"x": 1})).await;
    wait_for("delivery after two 503s", SECS, || sink.count() == 1).await;
    assert_eq!(counter.count(), 1, "upstream did not run again");
    e.shutdown().await;
}

#[tokio::test]
async fn a_loop_in_the_graph_is_dead_lettered_not_spun() {
    let flow = r#"
nodes:
  in: { type: webhook, path: loop, to: [a] }
  a: { type: set, set: { payload.x: 1 }, to: [b] }
  b: { type: set, set: { payload.y: 2 }, to: [a] }
"#;
    let e = start(&[("loop.yaml", flow)], Failpoints::new()).await;
    let id = accepted_id(post_json(&e, "loop", json!({})).await).await;
    let deadline = Instant::now() + SECS;
    loop {
        let item = get_json(&e, &format!("/api/items/{id}")).await;
        if item["state"] == "dead" {
            assert!(
                item["reason"].as_str().unwrap().contains("step bound"),
                "{item}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "not dead-lettered: {item}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.shutdown().await;
}

#[tokio::test]
async fn webhook_answers_clear_errors() {
    std::env::set_var("WEIR_TEST_HOOK_TOKEN", "sesame");
    let flow = r#"
nodes:
  open: { type: webhook, path: open, max_body: 64 }
  locked: { type: webhook, path: locked, auth: { bearer_env: WEIR_TEST_HOOK_TOKEN } }
"#;
    let e = start(&[("hooks.yaml", flow)], Failpoints::new()).await;
    let c = reqwest::Client::new();
    let url = |p: &str| format!("http://{}/hooks/{p}", e.addr);
    assert_eq!(c.post(url("missing")).send().await.unwrap().status(), 404);
    assert_eq!(c.get(url("open")).send().await.unwrap().status(), 405);
    assert_eq!(
        c.post(url("open"))
            .body("x".repeat(65))
            .send()
            .await
            .unwrap()
            .status(),
        413
    );
    let bad_json = c
        .post(url("open"))
        .header("content-type", "application/json")
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(bad_json.status(), 400);
    assert!(bad_json.text().await.unwrap().contains("malformed JSON"));
    assert_eq!(
        c.post(url("open"))
            .body(vec![0xff, 0xfe])
            .send()
            .await
            .unwrap()
            .status(),
        415
    );
    let text = c
        .post(url("open"))
        .body("plain words")
        .send()
        .await
        .unwrap();
    assert_eq!(text.status(), 202);
    assert_eq!(text.headers()["content-type"], "application/json");
    let id = accepted_id(text).await;
    let item = get_json(&e, &format!("/api/items/{id}")).await;
    assert_eq!(
        item["item"]["id"],
        id.as_str(),
        "the 202 names the item: {item}"
    );
    assert_eq!(c.post(url("locked")).send().await.unwrap().status(), 401);
    assert_eq!(
        c.post(url("locked"))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        c.post(url("locked"))
            .bearer_auth("sesame")
            .send()
            .await
            .unwrap()
            .status(),
        202
    );
    let stats = get_json(&e, "/api/stats").await;
    let accepted = ["ready", "in_flight"]
        .iter()
        .map(|k| stats[k].as_u64().unwrap())
        .sum::<u64>();
    assert!(accepted <= 2, "refused requests journaled nothing: {stats}");
    // The same Idempotency-Key gives back the first id; without a key, the same request sent
    // again is another event (README: a client that retries without one journals a second).
    let id_of = |key: Option<&'static str>| {
        let mut r = c.post(url("open")).body("a");
        if let Some(key) = key {
            r = r.header("idempotency-key", key);
        }
        async move {
            let v: Value = r.send().await.unwrap().json().await.unwrap();
            v["id"].as_str().unwrap().to_string()
        }
    };
    let first = id_of(Some("k1")).await;
    assert_eq!(id_of(Some("k1")).await, first);
    let (one, two) = (id_of(None).await, id_of(None).await);
    assert!(one != two && one != first, "two new events: {one}, {two}");
    for id in [one, two] {
        weir_testkit::eventually(&format!("{id} to run"), SECS, || async {
            let item = get_json(&e, &format!("/api/items/{id}")).await;
            match item["state"] == "finished" {
                true => Ok(()),
                false => Err(item),
            }
        })
        .await;
    }
    e.shutdown().await;
}

#[tokio::test]
async fn function_state_is_durable_node_memory() {
    let sink = Sink::start().await;
    let flow = format!(
        r#"
concurrency: 4
nodes:
  in: {{ type: webhook, path: count, to: [count] }}
  count:
    type: function
    script: |
      let n = state.get("n");
      if n == () {{ n = 0; }}
      n += 1;
      state.set("n", n);
      msg.payload = n;
      msg
    to: [out]
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("count")
    );
    let e = start(&[("count.yaml", &flow)], Failpoints::new()).await;
    for _ in 0..10 {
        post_json(&e, "count", json!(null)).await;
    }
    wait_for("ten counts", SECS, || sink.count() == 10).await;
    let mut got: Vec<i64> = sink.bodies().iter().map(|b| b.as_i64().unwrap()).collect();
    got.sort();
    assert_eq!(got, (1..=10).collect::<Vec<_>>(), "no lost update");
    e.shutdown().await;
}

/// A script keeps what it writes to its memory however it names `state`: as the argument of
/// `get` and `set`, or through a variable it assigned `state` to, not only as `state.set`.
#[tokio::test]
async fn state_reached_any_way_is_kept() {
    let flow = r#"
nodes:
  hook: { type: webhook, path: count, respond: wave, to: [count] }
  count:
    type: function
    script: |
      let mine = state;
      let n = get(mine, "n");
      if n == () { n = 0; }
      set(state, "n", n + 1);
      msg.payload = n + 1;
      msg
    to: [answer]
  answer: { type: http-response }
"#;
    let e = start(&[("count.yaml", flow)], Failpoints::new()).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = post_json(&e, "count", json!(null)).await;
        assert_eq!(r.status(), 200);
        got.push(r.json::<Value>().await.unwrap());
    }
    assert_eq!(got, vec![json!(1), json!(2), json!(3)]);
    e.shutdown().await;
}

/// A burst over two flows let go at once (a resume): each flow's waves start in journal
/// order, whether a wave found a free place at once or waited behind others of its flow, so a
/// one-at-a-time flow delivers in order and a stateful node sees its messages in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_two_flows_keeps_each_flows_journal_order() {
    let sink = Sink::start().await;
    let serial = format!(
        r#"
concurrency: 1
nodes:
  in: {{ type: webhook, path: s, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("s")
    );
    let seen = r#"
concurrency: 8
nodes:
  in: { type: webhook, path: c, to: [seen] }
  seen:
    type: function
    script: |
      let seen = state.get("seen");
      if seen == () { seen = []; }
      seen.push(msg.payload.n);
      state.set("seen", seen);
      msg
"#;
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_on(
        &queue,
        &[("serial.yaml", &serial), ("seen.yaml", seen)],
        Failpoints::new(),
    )
    .await;
    for f in ["serial", "seen"] {
        post_admin(&e, &format!("/api/flows/{f}/pause")).await;
    }
    const N: u64 = 150;
    for n in 0..N {
        for path in ["s", "c"] {
            let r = post_json(&e, path, json!({ "n": n })).await;
            assert_eq!(r.status(), 202);
        }
    }
    wait_parked(&e, 2 * N).await;
    for f in ["seen", "serial"] {
        post_admin(&e, &format!("/api/flows/{f}/resume")).await;
    }
    wait_for("the serial flow's deliveries", 3 * SECS, || {
        sink.count() == N as usize
    })
    .await;
    assert_eq!(
        sink.ns(),
        (0..N).collect::<Vec<_>>(),
        "one at a time, in order"
    );
    let deadline = Instant::now() + 3 * SECS;
    let seen = loop {
        let kept = e.queue.read_node("seen", "seen").await.unwrap();
        let seen = kept
            .iter()
            .find(|(k, _)| k == "seen")
            .and_then(|(_, v)| v.value.clone())
            .unwrap_or(Value::Null);
        if seen.as_array().is_some_and(|a| a.len() == N as usize) {
            break seen;
        }
        assert!(Instant::now() < deadline, "the stateful node saw {seen}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        seen,
        json!((0..N).collect::<Vec<_>>()),
        "the node's memory saw them in journal order"
    );
    e.shutdown().await;
}

#[tokio::test]
async fn shutdown_refuses_new_events_and_finishes() {
    let flow = r#"
nodes:
  in: { type: webhook, path: s }
"#;
    let e = start(&[("s.yaml", flow)], Failpoints::new()).await;
    let addr = e.addr;
    assert_eq!(post_json(&e, "s", json!(1)).await.status(), 202);
    tokio::time::timeout(SECS, e.shutdown())
        .await
        .expect("shutdown finishes");
    assert!(
        reqwest::Client::new()
            .post(format!("http://{addr}/hooks/s"))
            .send()
            .await
            .is_err(),
        "server stopped"
    );
}

/// `respond: wave` answers a wave that writes no node state as soon as it has run (its event
/// is journaled already; the commit changes nothing the answer shows), and a wave that writes
/// state only once its commit is kept: no answer ever shows a count that was not kept.
#[tokio::test]
async fn respond_wave_answers_stateful_waves_only_after_their_commit() {
    let flow = r#"
nodes:
  echo: { type: webhook, path: echo, respond: wave, timeout: 300ms, to: [answer] }
  count: { type: webhook, path: count, respond: wave, timeout: 300ms, to: [add] }
  add:
    type: function
    script: |
      let n = state.get("n");
      if n == () { n = 0; }
      n += 1;
      state.set("n", n);
      msg.payload = n;
      msg
    to: [answer]
  answer: { type: http-response }
"#;
    let fp = Failpoints::new();
    let e = start(&[("both.yaml", flow)], fp.clone()).await;
    // The next five commits fail (retried 20, 40, 80, 160, 320 ms apart): well past the
    // 300 ms the webhooks wait.
    fp.arm("commit", 5);
    let r = post_json(&e, "echo", json!("hi")).await;
    assert_eq!(
        r.status(),
        200,
        "a stateless wave is answered before its commit"
    );
    let echo_id = r.headers()["x-weir-item"].to_str().unwrap().to_string();
    assert_eq!(r.text().await.unwrap(), "hi");
    wait_finished(&e, &echo_id).await;
    fp.arm("commit", 5);
    let r = post_json(&e, "count", json!(null)).await;
    assert_eq!(
        r.status(),
        504,
        "a stateful wave is not answered while its state cannot be kept"
    );
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    wait_finished(&e, &id).await;
    let r = post_json(&e, "count", json!(null)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!(2),
        "the first count was kept, once"
    );
    e.shutdown().await;
}

/// Wait until item `id` has finished (its wave committed).
async fn wait_finished(e: &weir::RunningEngine, id: &str) {
    let deadline = Instant::now() + SECS;
    loop {
        let item = get_json(e, &format!("/api/items/{id}")).await;
        if item["state"] == "finished" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "item {id} did not finish: {item}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `respond: wave` request whose wave can start at once starts it where the event is
/// journaled, not after the executor claims it: so it is answered even while every place
/// the executor claims into is held by a slow wave of another flow. On the durable default
/// and in memory alike.
#[tokio::test]
async fn respond_wave_is_answered_while_the_executors_places_are_held() {
    let echo = r#"
nodes:
  hook: { type: webhook, path: echo, respond: wave, timeout: 2s, to: [shape] }
  shape: { type: function, script: "msg.payload = msg.payload + 1; msg", to: [answer] }
  answer: { type: http-response, status: 200 }
"#;
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite:{}", dir.path().join("q.db").display());
    for url in ["memory", sqlite.as_str()] {
        let (e, sink, delivered) = with_the_executors_place_held(url, echo).await;
        // One after the other, each committed before the next: the engine starts one such
        // wave at once here (its `max_in_flight`), and the next would wait for the
        // executor's place.
        for n in 0..3 {
            let r = post_json(&e, "echo", json!(n)).await;
            assert_eq!(r.status(), 200, "{url}: {:?}", r.text().await);
            let id = r.headers()["x-weir-item"].to_str().unwrap().to_string();
            assert_eq!(r.json::<Value>().await.unwrap(), json!(n + 1), "{url}");
            wait_finished(&e, &id).await;
        }
        assert_eq!(
            sink.count(),
            delivered,
            "{url}: answered while the slow wave still held its place"
        );
        e.shutdown().await;
    }
}

/// An accepted (202) event's wave that can start at once starts where the event is
/// journaled too, as a task of its own: so it runs even while every place the executor
/// claims into is held by a slow wave of another flow.
#[tokio::test]
async fn an_accepted_event_runs_while_the_executors_places_are_held() {
    let quick = r#"
nodes:
  hook: { type: webhook, path: quick, to: [shape] }
  shape: { type: function, script: "msg.payload = msg.payload + 1; msg", to: [done] }
  done: { type: log }
"#;
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite:{}", dir.path().join("q.db").display());
    for url in ["memory", sqlite.as_str()] {
        let (e, sink, delivered) = with_the_executors_place_held(url, quick).await;
        // One after the other: the engine starts one such wave at once here (its
        // `max_in_flight`), and the next would wait for the executor's place.
        for n in 0..3 {
            let r = post_json(&e, "quick", json!(n)).await;
            assert_eq!(r.status(), 202, "{url}");
            wait_finished(&e, &accepted_id(r).await).await;
        }
        // Had they waited for the executor's place, they would have ended only after the
        // slow wave had delivered.
        assert_eq!(
            sink.count(),
            delivered,
            "{url}: run while the slow wave still held its place"
        );
        e.shutdown().await;
    }
}

/// The waves webhooks start themselves are bounded engine-wide too, by `max_in_flight` (each
/// flow's `concurrency` alone would let a thousand flows run sixteen thousand at once): past
/// it an event is journaled for the executor to claim, and waits there for a place.
#[tokio::test]
async fn the_waves_webhooks_start_themselves_are_bounded_by_max_in_flight() {
    // Its calls wait 4 s for the sink too.
    let slow = r#"
nodes:
  in: { type: webhook, path: also, to: [out] }
  out: { type: http-request, url: "{sink}" }
"#;
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite:{}", dir.path().join("q.db").display());
    for url in ["memory", sqlite.as_str()] {
        // The executor's one place is held; the engine may start one wave where it journals.
        let (e, _sink, _) = with_the_executors_place_held(url, slow).await;
        let mut ids = Vec::new();
        for n in 0..2 {
            let r = post_json(&e, "also", json!(n)).await;
            assert_eq!(r.status(), 202, "{url}");
            ids.push(accepted_id(r).await);
        }
        // The first started where it was journaled; the second waits, ready, for the
        // executor (without the bound it would have started too: three in flight).
        wait_stats(&e, &format!("{url}: two in flight and one ready"), |s| {
            s["in_flight"] == 2 && s["ready"] == 1
        })
        .await;
        // The bound was hit, and that is counted as every bound is.
        let base = format!("http://{}", e.admin_addr);
        let hits = weir_testkit::metric_sum(
            &base,
            "weir_bounds_hit_total",
            &[r#"bound="webhook_waves""#],
        )
        .await;
        assert!(hits >= 1, "{url}: the bound's hits counted: {hits}");
        // Once the slow waves end, it runs too.
        for id in &ids {
            wait_finished(&e, id).await;
        }
        e.shutdown().await;
    }
}

/// A paused flow parks the accepted events of its webhook also where the request starts the
/// wave itself (a flow of `concurrency` over 1 with places free): none runs until the flow
/// is resumed, then each runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_flow_parks_the_waves_its_webhook_starts() {
    let sink = Sink::start().await;
    let flow = format!(
        "nodes:\n  in: {{ type: webhook, path: q, to: [out] }}\n  out: {{ type: http-request, url: \"{}\" }}\n",
        sink.url("got")
    );
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let e = start_on(&queue, &[("q.yaml", &flow)], Failpoints::new()).await;
    post_admin(&e, "/api/flows/q/pause").await;
    for n in 0..3 {
        assert_eq!(post_json(&e, "q", json!({ "n": n })).await.status(), 202);
    }
    wait_parked(&e, 3).await;
    assert_eq!(sink.count(), 0, "nothing ran while paused");
    post_admin(&e, "/api/flows/q/resume").await;
    wait_for("the three", SECS, || sink.count() == 3).await;
    let mut ns = sink.ns();
    ns.sort();
    assert_eq!(ns, vec![0, 1, 2], "each once");
    e.shutdown().await;
}

/// An engine on `url` with the flow `other` and a flow `hold` whose one slow wave (its call
/// answered after 4 s; at `concurrency: 1`, so the executor claims it) holds the only place
/// the executor claims into (`max_in_flight: 1`); the sink it waits on, and what that sink
/// had received. `{sink}` in `other` is the sink's URL.
async fn with_the_executors_place_held(url: &str, other: &str) -> (RunningEngine, Sink, usize) {
    let sink = Sink::start().await;
    sink.answer_after(4000);
    let other = other.replace("{sink}", &sink.url("other"));
    let hold = format!(
        r#"
concurrency: 1
nodes:
  in: {{ type: webhook, path: hold, to: [out] }}
  out: {{ type: http-request, url: "{}" }}
"#,
        sink.url("slow")
    );
    let mut exec = weir_testkit::test_exec();
    exec.max_in_flight = 1;
    // Not taken back as stalled while they run (the test kit's 800 ms would).
    exec.reclaim_after = Duration::from_secs(60);
    let e =
        weir_testkit::start_exec(url, exec, &[("hold.yaml", &hold), ("other.yaml", &other)]).await;
    let delivered = sink.count();
    assert_eq!(post_json(&e, "hold", json!(1)).await.status(), 202);
    wait_stats(&e, &format!("{url}: the slow wave in flight"), |s| {
        s["in_flight"] == 1
    })
    .await;
    (e, sink, delivered)
}
