//! The dashboard in a real browser (Debian's headless Chromium through chromedriver): log in
//! with the admin token, see a flow drawn with its nodes and wires, pause it with its button,
//! send an event and see it parked, step it and see it run. A screenshot is written for the
//! record (target/tmp/dashboard.png).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use weir::Engine;
use weir_testkit::browser::Browser;
use weir_testkit::{test_exec, wait_for, Sink};

const TOKEN: &str = "dashboard-test-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_draws_a_flow_pauses_it_parks_an_event_and_steps_it() {
    let sink = Sink::start().await;
    let data = tempfile::tempdir().unwrap();
    let flow = format!(
        r#"
id: orders
description: Orders from the shop, checked and sent to the warehouse.
nodes:
  in: {{ type: webhook, path: orders, to: [check] }}
  start: {{ type: manual, to: [check] }}
  check:
    type: function
    script: |
      if msg.payload.order == 13 {{ throw "unlucky order"; }}
      msg.payload.checked = true;
      msg
    to: [limit]
  limit: {{ type: rate-limit, rate: 50/s, to: [warehouse] }}
  warehouse: {{ type: http-request, url: "{}" }}
"#,
        sink.url("warehouse")
    );
    let engine = Engine::builder()
        .queue_url(format!("sqlite:{}/queue.db", data.path().display()))
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .exec_config(test_exec())
        .admin_token(Some(TOKEN.to_string()))
        .flow_str("orders.yaml", &flow)
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let base = format!("http://{}", engine.admin_addr);
    let browser = Browser::start(1280, 900).await;

    // The token is asked once, and a wrong one is refused.
    browser.goto(&format!("{base}/")).await;
    browser.type_into("#token", "not-it").await;
    browser.click("button[type=submit]").await;
    browser.wait_for(".error", Duration::from_secs(10)).await;
    browser.type_into("#token", TOKEN).await;
    browser.click("button[type=submit]").await;
    browser
        .wait_for("body[data-ready='1']", Duration::from_secs(15))
        .await;

    // The flow is drawn: one box per node, the trigger on the left, a wire per connection.
    browser
        .wait_for("#flow-orders svg.graph", Duration::from_secs(10))
        .await;
    assert_eq!(browser.count("#flow-orders svg.graph g.node").await, 5);
    for node in ["in", "start", "check", "limit", "warehouse"] {
        assert!(
            browser
                .find(&format!("#flow-orders g.node[data-node='{node}']"))
                .await
                .is_some(),
            "node {node} drawn"
        );
    }
    assert_eq!(browser.count("#flow-orders g.node.trigger").await, 2);
    assert_eq!(browser.count("#flow-orders path.wire").await, 4);
    assert!(browser
        .text("#flow-orders .badge")
        .await
        .contains("running"));

    // The session cookie is HttpOnly (the page's script cannot read it), and a change sent
    // with the cookie but without the CSRF token is refused.
    let seen = browser
        .eval_async(
            "const done = arguments[arguments.length - 1];
             fetch('/api/flows/orders/pause', { method: 'POST', credentials: 'same-origin' })
               .then(r => done({ status: r.status, cookie: document.cookie }));",
        )
        .await;
    assert_eq!(seen["status"], 403, "no CSRF token, no change: {seen}");
    assert!(
        !seen["cookie"]
            .as_str()
            .unwrap_or("")
            .contains("weir_session"),
        "{seen}"
    );
    assert!(!engine.queue.pausing().is_paused("orders").await.unwrap());

    // Pause with the button.
    browser
        .click("#flow-orders button[data-action='pause']")
        .await;
    browser
        .wait_for("#flow-orders[data-state='paused']", Duration::from_secs(10))
        .await;
    assert!(engine.queue.pausing().is_paused("orders").await.unwrap());

    // An event arrives and is parked: the header counts it, the parked table lists it.
    let r = reqwest::Client::new()
        .post(format!("http://{}/hooks/orders", engine.addr))
        .json(&json!({ "order": 7 }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    browser.click("#tabs button[data-tab='parked']").await;
    browser
        .wait_for(
            &format!("#items tr[data-id='{id}'][data-state='parked']"),
            Duration::from_secs(10),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while browser.text("#counts li[data-state='parked'] b").await != "1" {
        assert!(Instant::now() < deadline, "the header never counted it");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(browser
        .text("#flow-orders .parked")
        .await
        .contains("1 parked"));
    assert_eq!(sink.count(), 0, "parked, not run");
    let shot = browser.screenshot().await;

    // Step: it runs although the flow stays paused, and the graph counts the run.
    browser
        .click("#flow-orders button[data-action='step']")
        .await;
    wait_for(
        "the stepped event at the warehouse",
        Duration::from_secs(10),
        || sink.count() == 1,
    )
    .await;
    assert_eq!(sink.bodies()[0]["checked"], true);
    let deadline = Instant::now() + Duration::from_secs(10);
    while browser.count(&format!("#items tr[data-id='{id}']")).await > 0
        || !browser
            .text("#flow-orders g.node[data-node='warehouse'] text.figures")
            .await
            .starts_with("1 runs")
    {
        assert!(
            Instant::now() < deadline,
            "the page never showed the step: {}",
            browser.text("body").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        browser.text("#flow-orders .badge").await,
        "paused",
        "a step leaves the flow paused"
    );

    // A run with a JSON input, followed to its end on the page.
    browser
        .click("#flow-orders button[data-action='resume']")
        .await;
    browser
        .wait_for(
            "#flow-orders[data-state='running']",
            Duration::from_secs(10),
        )
        .await;
    browser
        .click("#flow-orders button[data-action='run']")
        .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !browser
        .text("#flow-orders .run-status")
        .await
        .contains("done")
    {
        assert!(
            Instant::now() < deadline,
            "the run never ended on the page: {}",
            browser.text("#flow-orders .run-status").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_for("the run at the warehouse", Duration::from_secs(10), || {
        sink.count() == 2
    })
    .await;

    // Cancel by hand from the table: the item leaves the waiting list and is listed among
    // what was ended by hand.
    browser
        .click("#flow-orders button[data-action='pause']")
        .await;
    browser
        .wait_for("#flow-orders[data-state='paused']", Duration::from_secs(10))
        .await;
    let post = |body: serde_json::Value| {
        let url = format!("http://{}/hooks/orders", engine.addr);
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 202);
            r.json::<serde_json::Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let doomed = post(json!({ "order": 8 })).await;
    browser.click("#tabs button[data-tab='parked']").await;
    browser
        .click(&format!(
            "#items tr[data-id='{doomed}'] button[data-action='cancel']"
        ))
        .await;
    browser.click("#tabs button[data-tab='ended']").await;
    let row = format!("#items tr[data-id='{doomed}']");
    browser.wait_for(&row, Duration::from_secs(10)).await;
    assert!(browser.text(&row).await.contains("cancelled by hand"));
    browser
        .click("#flow-orders button[data-action='resume']")
        .await;

    // A dead letter shows its reason; replay puts it back, discard ends it by hand.
    // (The event's wave goes on without the failed message, which becomes a dead letter
    // of its own.)
    post(json!({ "order": 13 })).await;
    browser.click("#tabs button[data-tab='dead']").await;
    browser
        .wait_for("#items tr[data-state='dead']", Duration::from_secs(20))
        .await;
    let dead = browser
        .attr("#items tr[data-state='dead']", "data-id")
        .await
        .unwrap();
    let row = format!("#items tr[data-id='{dead}']");
    let shown = browser.text(&row).await;
    assert!(
        shown.contains("check") && shown.contains("unlucky order"),
        "the reason names the node and the error: {shown}"
    );
    browser
        .click(&format!("{row} button[data-action='replay']"))
        .await;
    // The replay fails the same way: a new dead letter, and the replayed one leaves the
    // list. Discard ends the new one by hand.
    let deadline = Instant::now() + Duration::from_secs(20);
    let again = loop {
        let first = browser
            .attr("#items tr[data-state='dead']", "data-id")
            .await;
        if let Some(id) = first.filter(|id| *id != dead) {
            if browser.count(&row).await == 0 {
                break id;
            }
        }
        assert!(Instant::now() < deadline, "the replay never came back dead");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let row = format!("#items tr[data-id='{again}']");
    browser
        .click(&format!("{row} button[data-action='discard']"))
        .await;
    browser.click("#tabs button[data-tab='ended']").await;
    browser.wait_for(&row, Duration::from_secs(10)).await;
    assert!(browser.text(&row).await.contains("discarded by hand"));

    // For the record: the dashboard with the event parked.
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    std::fs::write(&path, &shot).unwrap();
    assert!(shot.starts_with(b"\x89PNG"), "a PNG");
    println!("screenshot: {}", path.display());
    drop(browser);
    engine.shutdown().await;
}
