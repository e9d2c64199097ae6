//! Reload: new flows in force without a restart; a removed flow's waiting work set aside as
//! dead letters; an invalid set refused with its errors while the running one goes on.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{json, Value};
use weir_testkit::{get_json, post_json, WeirProcess};

const A1: &str = "id: a\nnodes:\n  in: { type: webhook, path: a, respond: wave, to: [r] }\n  r: { type: http-response, status: 201 }\n";
const A2: &str = "id: a\nnodes:\n  in: { type: webhook, path: a, respond: wave, to: [r] }\n  r: { type: http-response, status: 202 }\n";
const B: &str =
    "id: b\nnodes:\n  in: { type: webhook, path: b, to: [w] }\n  w: { type: delay, for: 1h }\n";
const C: &str = "id: c\nnodes:\n  in: { type: webhook, path: c, respond: wave, to: [r] }\n  r: { type: http-response }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_swaps_the_flows_clears_removed_ones_and_refuses_a_broken_set() {
    let dir = tempfile::tempdir().unwrap();
    let w = |f: &str, s: &str| std::fs::write(dir.path().join(f), s).unwrap();
    w("a.yaml", A1);
    w("b.yaml", B);
    let e = weir::Engine::builder()
        .queue_url("memory")
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .flows_dir(dir.path())
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    assert_eq!(post_json(&e, "a", json!(1)).await.status(), 201);
    assert_eq!(post_json(&e, "b", json!(1)).await.status(), 202);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while get_json(&e, "/api/stats").await["delayed"] != 1 {
        assert!(std::time::Instant::now() < deadline, "b's timer is waiting");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b_item = get_json(&e, "/api/queue?state=delayed").await[0]["item"]["id"].clone();

    // a changes, b goes, c comes.
    w("a.yaml", A2);
    std::fs::remove_file(dir.path().join("b.yaml")).unwrap();
    w("c.yaml", C);
    let r: Value = reqwest::Client::new()
        .post(format!("http://{}/api/reload", e.admin_addr))
        .header("x-weir-client", "test")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["flows"], json!(["a", "c"]), "{r}");
    assert_eq!(
        (
            r["added"].clone(),
            r["removed"].clone(),
            r["cleared"].clone()
        ),
        (json!(["c"]), json!(["b"]), json!(1))
    );
    assert_eq!(
        post_json(&e, "a", json!(1)).await.status(),
        202,
        "the new version of a answers"
    );
    assert_eq!(
        post_json(&e, "c", json!(1)).await.status(),
        200,
        "c is served"
    );
    assert_eq!(
        post_json(&e, "b", json!(1)).await.status(),
        404,
        "b is gone"
    );
    let item = get_json(&e, &format!("/api/items/{}", b_item.as_str().unwrap())).await;
    assert_eq!(item["state"], "dead", "never silently: {item}");
    assert_eq!(
        item["reason"], "flow `b` was removed by a reload; replay once it is back",
        "{item}"
    );

    // A broken file: refused with where and what, and the running flows go on.
    w(
        "c.yaml",
        "id: c\nnodes:\n  in: { type: webhook, path: c, to: [nowhere] }\n",
    );
    let resp = reqwest::Client::new()
        .post(format!("http://{}/api/reload", e.admin_addr))
        .header("x-weir-client", "test")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 422);
    let body: Value = resp.json().await.unwrap();
    let errors = body["errors"].as_array().unwrap();
    assert!(
        errors[0]
            .as_str()
            .unwrap()
            .ends_with("c.yaml:3:38: wire to a missing node `nowhere`"),
        "{body}"
    );
    assert_eq!(
        post_json(&e, "c", json!(1)).await.status(),
        200,
        "the running version of c stays"
    );
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_flows_folder() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), A1).unwrap();
    let p = WeirProcess::start(dir.path(), "memory", &[]).await;
    assert_eq!(p.post("a", &json!(1)).await.0, 201);
    std::fs::write(dir.path().join("c.yaml"), C).unwrap();
    let pid = p.pid();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while p.post("c", &json!(1)).await.0 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "c served after SIGHUP"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(p.stop(Duration::from_secs(10)).await, Some(0));
}
