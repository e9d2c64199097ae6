//! The `weir` binary as a user runs it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Spawns `weir` as `command(port)` builds it for a free port, and returns it once it listens
/// there. A port another test's process took between the probe and ours: another port.
fn spawn_listening(mut command: impl FnMut(u16) -> Command) -> (std::process::Child, u16) {
    (0..5)
        .find_map(|_| {
            let port = free_port();
            let child = command(port).spawn().unwrap();
            weir_queue::testing::listening(child, port, Duration::from_secs(20))
                .map(|child| (child, port))
        })
        .expect("weir listens on one of five free ports")
}

#[tokio::test]
async fn weir_run_serves_flows_and_exits_0_on_sigterm() {
    let broker = weir_testkit::Mosquitto::start();
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let (mut child, port) = spawn_listening(|port| {
        let mut c = Command::new(weir_testkit::weir_bin());
        c.args([
            "run",
            concat!(env!("CARGO_MANIFEST_DIR"), "/flows"),
            "--http",
            &format!("127.0.0.1:{port}"),
            "--queue",
            &queue,
            "--mqtt",
            &broker.url(),
            "--grace",
            "5",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        c
    });
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while reqwest::get(format!("{base}/healthz")).await.is_err() {
        assert!(Instant::now() < deadline, "engine did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = reqwest::Client::new()
        .post(format!("{base}/hooks/echo"))
        .json(&serde_json::json!({"hi": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["echo"], serde_json::json!({"hi": 1}));
    // The thermostat example: a cold kitchen switches its heater on.
    let heater =
        weir_testkit::MqttPeer::connect(broker.port, "heater", Some("home/+/heater/set")).await;
    let sensor = weir_testkit::MqttPeer::connect(broker.port, "sensor", None).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while heater.count() == 0 {
        // Until the engine's subscription is up, a publish may find no one; send again.
        sensor
            .client
            .publish(
                "home/kitchen/temperature",
                rumqttc::QoS::AtLeastOnce,
                false,
                r#"{"celsius": 16.5}"#,
            )
            .await
            .unwrap();
        assert!(
            Instant::now() < deadline,
            "the heater was never switched on"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (topic, payload) = heater.received().remove(0);
    assert_eq!(topic, "home/kitchen/heater/set");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&payload).unwrap(),
        serde_json::json!({"on": true})
    );
    let out = Command::new(weir_testkit::weir_bin())
        .args(["queue", "stats", "--url", &base])
        .output()
        .unwrap();
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("durable") && l.ends_with("yes")),
        "the default queue is durable:\n{table}"
    );
    let json = Command::new(weir_testkit::weir_bin())
        .args(["queue", "stats", "--json", "--api", &base])
        .output()
        .unwrap();
    let stats: serde_json::Value =
        serde_json::from_slice(&json.stdout).expect("--json prints JSON");
    assert_eq!(stats["durable"], true);
    let flows = Command::new(weir_testkit::weir_bin())
        .args(["flow", "ls", "--url", &base])
        .output()
        .unwrap();
    let flows = String::from_utf8_lossy(&flows.stdout);
    assert!(flows.starts_with("FLOW"), "{flows}");
    assert!(
        flows
            .lines()
            .any(|l| l.starts_with("thermostat") && l.contains("running")),
        "{flows}"
    );
    // A second engine on the same queue file refuses to start, and says why.
    let second = Command::new(weir_testkit::weir_bin())
        .args(["run", concat!(env!("CARGO_MANIFEST_DIR"), "/flows")])
        .args([
            "--http",
            &format!("127.0.0.1:{}", free_port()),
            "--queue",
            &queue,
        ])
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(1));
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("in use by another weir engine"), "{err}");
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert_eq!(status.code(), Some(0), "clean exit on SIGTERM");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("weir did not exit after SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn weir_graph_prints_dot_and_mermaid() {
    let f = concat!(env!("CARGO_MANIFEST_DIR"), "/flows/orders.yaml");
    let dot = Command::new(weir_testkit::weir_bin())
        .args(["graph", f])
        .output()
        .unwrap();
    let dot = String::from_utf8_lossy(&dot.stdout);
    assert!(dot.starts_with("digraph \"orders\""), "{dot}");
    assert!(
        dot.contains("\"size\" -> \"log_small\" [label=\"1\"]"),
        "{dot}"
    );
    let mm = Command::new(weir_testkit::weir_bin())
        .args(["graph", f, "--format", "mermaid"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&mm.stdout).contains("tag_big -->|0| settle"));
}

#[tokio::test]
async fn weir_backup_copies_the_queue_while_the_engine_runs() {
    let data = tempfile::tempdir().unwrap();
    let queue = format!("sqlite:{}/queue.db", data.path().display());
    let flows = tempfile::tempdir().unwrap();
    // A flow that holds what it gets (a long delay): the backup must have it.
    std::fs::write(
        flows.path().join("hold.yaml"),
        "nodes:\n  h: { type: webhook, path: hold, to: [w] }\n  w: { type: delay, for: 1h }\n",
    )
    .unwrap();
    let e = weir_testkit::WeirProcess::start(flows.path(), &queue, &[]).await;
    for n in 0..5 {
        assert_eq!(e.post("hold", &serde_json::json!({ "n": n })).await.0, 202);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats().await["delayed"] != 5 {
        assert!(Instant::now() < deadline, "five delayed items");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let copy = data.path().join("copy.db");
    let out = Command::new(weir_testkit::weir_bin())
        .args(["backup", &copy.display().to_string(), "--queue", &queue])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The copy is a queue of its own, with the five timers in it.
    let q = weir_queue::SqliteQueue::open(&copy, weir_queue::Failpoints::new()).unwrap();
    use weir_queue::Admin;
    assert_eq!(q.stats().await.unwrap().delayed, 5);
    // It does not overwrite.
    let again = Command::new(weir_testkit::weir_bin())
        .args(["backup", &copy.display().to_string(), "--queue", &queue])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists already"));
    e.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn a_config_file_sits_below_the_environment_and_the_flags() {
    let dir = tempfile::tempdir().unwrap();
    let flows = flows_dir(
        &dir.path().join("flows"),
        "echo.yaml",
        "nodes:\n  h: { type: webhook, path: echo, respond: wave, to: [r] }\n  r: { type: http-response, status: 201 }\n",
    );
    let conf = dir.path().join("weir.toml");
    let write_conf = |port: u16| {
        std::fs::write(
            &conf,
            format!(
                "flows = \"{}\"\nqueue = \"sqlite:{}/queue.db\"\nhttp = \"127.0.0.1:{port}\"\ngrace = 5\nretry_initial = \"2s\"\n\n[brokers]\ncloud = \"mqtt://127.0.0.1:1\"\n",
                flows.display(),
                dir.path().display()
            ),
        )
        .unwrap()
    };
    let up = |port: u16| async move {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = reqwest::Client::new()
                .post(format!("http://127.0.0.1:{port}/hooks/echo"))
                .json(&serde_json::json!(1))
                .send()
                .await
            {
                return r.status().as_u16();
            }
            assert!(Instant::now() < deadline, "nothing on port {port}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // The file alone: its address, its flows, its queue.
    let (mut a, file_port) = spawn_listening(|port| {
        write_conf(port);
        let mut c = Command::new(weir_testkit::weir_bin());
        c.args(["run", "--config", &conf.display().to_string()])
            .env_remove("WEIR_HTTP")
            .stderr(Stdio::null());
        c
    });
    assert_eq!(up(file_port).await, 201);
    assert!(dir.path().join("queue.db").exists(), "the file's queue");
    let _ = a.kill();
    let _ = a.wait();
    // The environment wins over the file, whose port is held meanwhile (by us, or by
    // whoever took it since): an engine that took the file's address would not start.
    let _hold = std::net::TcpListener::bind(("127.0.0.1", file_port));
    let (mut b, env_port) = spawn_listening(|port| {
        let mut c = Command::new(weir_testkit::weir_bin());
        c.args(["run", "--config", &conf.display().to_string()])
            .env("WEIR_HTTP", format!("127.0.0.1:{port}"))
            .stderr(Stdio::null());
        c
    });
    assert_eq!(up(env_port).await, 201);
    let _ = b.kill();
    let _ = b.wait();
    // A key that does not exist is an error that names it.
    std::fs::write(&conf, "queue = \"memory\"\nhtpp = \"127.0.0.1:1\"\n").unwrap();
    let bad = Command::new(weir_testkit::weir_bin())
        .args(["run", "--config", &conf.display().to_string()])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("weir.toml") && err.contains("htpp"), "{err}");
}

/// `weir run` that cannot start says why, once, and exits 1: a bad flow (with its
/// file:line:column), a queue file another engine holds, an address in use.
#[test]
fn weir_run_says_once_why_it_cannot_start() {
    let run = |args: &[&str]| {
        let out = Command::new(weir_testkit::weir_bin())
            .arg("run")
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let flows = flows_dir(
        &dir.path().join("flows"),
        "b.yaml",
        "id: b\nnodes:\n  x: { type: nope }\n",
    );
    let http = format!("127.0.0.1:{}", free_port());
    let (code, err) = run(&[
        flows.to_str().unwrap(),
        "--queue",
        "memory",
        "--http",
        &http,
    ]);
    assert_eq!(code, Some(1), "{err}");
    let file = flows.join("b.yaml").display().to_string();
    assert!(
        err.starts_with(&format!(
            "error: {file}:3:14: node `x`: unknown node type `nope`"
        )),
        "{err}"
    );
    assert_eq!(
        err.matches("unknown node type").count(),
        1,
        "said once: {err}"
    );

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = taken.local_addr().unwrap().to_string();
    let (code, err) = run(&[
        &one_webhook_flow(dir.path()),
        "--queue",
        "memory",
        "--http",
        &at,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("cannot listen on {at}: ")), "{err}");
    assert_eq!(err.matches("in use").count(), 1, "said once: {err}");
}

/// Logs written to a file (or a pipe, or the journal) are plain text: the colours are for a
/// terminal only.
#[tokio::test]
async fn logs_to_a_file_carry_no_colour_codes() {
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("weir.log");
    let (mut child, _) = run_logging(&one_webhook_flow(data.path()), &log, &[]).await;
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(" INFO "), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes in a log file: {text:?}"
    );
}

/// A `--reclaim-after` no longer than a wave may run (60 s) is warned of at start: a wave
/// still running past it would be taken back and run a second time. The default is not.
#[tokio::test]
async fn a_reclaim_delay_shorter_than_a_wave_may_run_is_warned_of() {
    let data = tempfile::tempdir().unwrap();
    let flows = one_webhook_flow(data.path());
    for (extra, warned) in [(&["--reclaim-after", "30"][..], true), (&[][..], false)] {
        let log = data.path().join("weir.log");
        let (mut child, _) = run_logging(&flows, &log, extra).await;
        let _ = child.kill();
        let _ = child.wait();
        let text = std::fs::read_to_string(&log).unwrap();
        let line = text.lines().find(|l| l.contains("--reclaim-after"));
        assert_eq!(line.is_some(), warned, "{extra:?}: {text}");
        if let Some(line) = line {
            assert!(
                line.contains("WARN") && line.contains("run a second time"),
                "{line}"
            );
        }
    }
}

/// `weir run FLOWS --queue memory` on a port of its own choosing, at the default log filter,
/// with the flags `extra`, its log written to `log`; once it has logged its start, the
/// process and the address it listens on.
async fn run_logging(
    flows: &str,
    log: &std::path::Path,
    extra: &[&str],
) -> (std::process::Child, String) {
    // Port 0: the address is read from the log, and no other process can hold it.
    let mut child = Command::new(weir_testkit::weir_bin())
        .args(["run", flows])
        .args(["--queue", "memory", "--http", "127.0.0.1:0"])
        .args(extra)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("weir engine started")) {
            let at = line.split("addr=").nth(1).unwrap_or("");
            let at = at.split_whitespace().next().unwrap_or("").to_string();
            return (child, at);
        }
        if Instant::now() > deadline || matches!(child.try_wait(), Ok(Some(_))) {
            let _ = child.kill();
            panic!("no start line logged within 20 s:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

/// The flows folder `flows`, made with one file in it.
fn flows_dir(flows: &std::path::Path, file: &str, yaml: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(flows).unwrap();
    std::fs::write(flows.join(file), yaml).unwrap();
    flows.to_path_buf()
}

/// A flows directory under `dir` with one webhook flow and nothing that needs a broker.
fn one_webhook_flow(dir: &std::path::Path) -> String {
    flows_dir(
        &dir.join("hook-only"),
        "in.yaml",
        "id: in\nnodes:\n  hook: { type: webhook, path: in, to: [log] }\n  log: { type: log }\n",
    )
    .display()
    .to_string()
}

/// A script's `print` and a node's failure name the flow, the node and the item in the log,
/// so that the lines of a busy engine can be told apart and found by the item's id.
#[tokio::test]
async fn a_scripts_print_and_a_node_failure_name_their_flow_node_and_item() {
    let data = tempfile::tempdir().unwrap();
    let flows = flows_dir(
        &data.path().join("flows"),
        "printer.yaml",
        r#"id: printer
nodes:
  hook: { type: webhook, path: check, to: [check] }
  check:
    type: function
    script: |
      print("checking " + msg.payload.n);
      if msg.payload.n > 1 { throw "too big" }
      msg
"#,
    );
    let log = data.path().join("weir.log");
    let (mut child, addr) = run_logging(&flows.display().to_string(), &log, &[]).await;
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    let answer: serde_json::Value = reqwest::Client::new()
        .post(format!("http://{addr}/hooks/check"))
        .json(&serde_json::json!({ "n": 2 }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = answer["id"].as_str().unwrap().to_string();
    let text = loop {
        let text = read();
        if text.contains("node failed") || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    let line = |what: &str| {
        text.lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no line with {what:?} in the log:\n{text}"))
            .to_string()
    };
    for l in [line("checking 2"), line("node failed")] {
        for want in ["flow=printer", "node=check", &format!("item={id}")] {
            assert!(l.contains(want), "{want} missing from {l:?}");
        }
    }
    assert!(line("node failed").contains("too big"), "{text}");
}
