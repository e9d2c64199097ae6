//! Validation: every mistake reported at once, each at its exact file:line:column.

use weir::Library;

fn errors(file: &str, src: &str) -> Vec<String> {
    match Library::builtin().load_str(file, src) {
        Ok(_) => Vec::new(),
        Err(d) => d.0.iter().map(|d| d.to_string()).collect(),
    }
}

#[test]
fn three_mistakes_in_three_nodes_give_three_exact_errors() {
    let src = "\
id: shop
nodes:
  hook:
    type: webhook
    paht: orders
  wait:
    type: delay
    for: 5 parsecs
  send:
    type: http-request
    url: http://127.0.0.1:9/x
    to: [nowhere]
";
    assert_eq!(
        errors("flows/shop.yaml", src),
        vec![
            "flows/shop.yaml:5:5: node `hook`: unknown field `paht`, did you mean `path`?",
            "flows/shop.yaml:8:10: node `wait`: unknown unit `parsecs` in duration `5 parsecs` (use ms, s, m, h or d)",
            "flows/shop.yaml:12:10: wire to a missing node `nowhere`",
        ]
    );
}

#[test]
fn each_kind_of_mistake_has_its_position() {
    let cases: &[(&str, &str)] = &[
        ("nodes:\n  a: [1, 2\n", "f.yaml:3:1: YAML syntax"),
        ("nodes:\n  a:\n    type: frobnicate\n", "f.yaml:3:11: node `a`: unknown node type `frobnicate`"),
        ("nodes:\n  a:\n    type: log\n    levle: info\n", "f.yaml:4:5: node `a`: unknown field `levle`, did you mean `level`?"),
        ("nodes:\n  a:\n    type: delay\n    mode: each\n", "f.yaml:3:5: node `a`: missing required field `for`"),
        ("nodes:\n  a:\n    type: log\n    to: [b]\n", "f.yaml:4:10: wire to a missing node `b`"),
        ("nodes:\n  a:\n    type: log\n    to: b\n", "f.yaml:4:9: wire to a missing node `b`"),
        ("nodes:\n  t:\n    type: cron\n    schedule: \"61 * * * *\"\n", "f.yaml:4:15: node `t`: bad cron expression `61 * * * *`"),
        ("nodes:\n  d:\n    type: delay\n    for: soon\n", "f.yaml:4:10: node `d`: `soon` is not a duration"),
        ("nodes:\n  s:\n    type: switch\n    rules:\n      - if: msg.payload >\n        to: []\n", "f.yaml:5:26: node `s`: condition does not compile"),
        ("nodes:\n  f:\n    type: function\n    script: |\n      let x = 1;\n      let = 2;\n", "f.yaml:6:"),
        ("nodes:\n  a:\n    type: log\n  a:\n    type: log\n", "f.yaml:4:3: duplicate key `a`"),
        ("nodse: {}\n", "f.yaml:1:1: unknown field `nodse`, did you mean `nodes`?"),
        ("nodes:\n  a:\n    type: cron\n    schedule: '* * * * *'\n    timezone: Mars/Olympus\n", "f.yaml:5:15: node `a`: unknown time zone `Mars/Olympus`"),
        ("nodes:\n  m:\n    type: mqtt-in\n    topic: home/#/x\n", "f.yaml:4:12: node `m`: `home/#/x` is not a topic filter"),
        ("nodes:\n  m:\n    type: mqtt-in\n    topic: a/b\n    qos: 3\n", "f.yaml:5:10: node `m`: `qos` is 0, 1 or 2"),
        ("nodes:\n  o:\n    type: mqtt-out\n    topic: a/+/b\n", "f.yaml:4:12: node `o`: `a/+/b` is not a topic one can publish to"),
        ("nodes:\n  o:\n    type: mqtt-out\n    topic: 'a/{{ msg. }}'\n", "f.yaml:4:"),
        ("nodes:\n  r:\n    type: rate-limit\n    rate: 5/fortnight\n", "f.yaml:4:11: node `r`: `5/fortnight`: unknown period `fortnight`"),
        ("nodes:\n  r:\n    type: rate-limit\n    rate: 5/s\n    overflow: spill\n", "f.yaml:5:15: node `r`: unknown variant `spill`"),
        ("nodes:\n  r:\n    type: rate-limit\n    rate: 5/s\n    per: msg.payload.\n", "f.yaml:5:"),
        ("nodes:\n  r:\n    type: log\n    retry: { initial: 5s, max: 1s }\n", "f.yaml:4:12: node `r`: `retry` needs 0 < initial <= max"),
        ("nodes:\n  r:\n    type: log\n    retry: { initial: 5s, maxx: 1m }\n", "f.yaml:4:27: node `r`: unknown field `maxx`"),
    ];
    for (src, want) in cases {
        let got = errors("f.yaml", src);
        assert!(
            got.iter().any(|e| e.starts_with(want)),
            "for\n{src}\nwanted an error starting with {want:?}, got {got:?}"
        );
    }
}

#[test]
fn a_script_error_points_into_the_script() {
    let src = "nodes:\n  f:\n    type: function\n    script: |\n      let x = 1;\n      let = 2;\n";
    let got = errors("f.yaml", src);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].starts_with("f.yaml:6:"), "{got:?}");
    assert!(got[0].contains("script does not compile"), "{got:?}");
}

#[test]
fn duplicate_flow_ids_and_webhook_paths_across_files() {
    let a = (
        "a.yaml".to_string(),
        "id: same\nnodes:\n  h: { type: webhook, path: x }\n".to_string(),
    );
    let b = (
        "b.yaml".to_string(),
        "id: same\nnodes:\n  h: { type: webhook, path: y }\n".to_string(),
    );
    let c = (
        "c.yaml".to_string(),
        "id: other\nnodes:\n  h: { type: webhook, path: x }\n".to_string(),
    );
    let err = Library::builtin()
        .load_strs(&[a, b, c])
        .err()
        .expect("refused");
    let msgs: Vec<String> = err.0.iter().map(|d| d.to_string()).collect();
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("b.yaml:1:5: duplicate flow id `same` (also in a.yaml)")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("c.yaml:") && m.contains("/hooks/x is already served")),
        "{msgs:?}"
    );
}

#[test]
fn the_example_flows_validate() {
    let flows = Library::builtin()
        .load_paths(&[concat!(env!("CARGO_MANIFEST_DIR"), "/flows")])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(flows.len() >= 3);
}

#[test]
fn weir_validate_exits_1_with_the_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "nodes:\n  a:\n    type: nope\n  b:\n    type: log\n    to: [c]\n",
    )
    .unwrap();
    let out = std::process::Command::new(weir_testkit::weir_bin())
        .args(["validate", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let file = bad.display().to_string();
    assert!(
        err.contains(&format!("{file}:3:11: node `a`: unknown node type `nope`")),
        "{err}"
    );
    assert!(
        err.contains(&format!("{file}:6:10: wire to a missing node `c`")),
        "{err}"
    );
    let ok = std::process::Command::new(weir_testkit::weir_bin())
        .args(["validate", concat!(env!("CARGO_MANIFEST_DIR"), "/flows")])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}
