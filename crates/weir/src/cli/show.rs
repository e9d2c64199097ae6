//! What the CLI prints for people: small tables from the admin API's JSON (`--json` prints
//! the JSON itself, for scripts).

use serde_json::Value;

/// Which answer this is.
#[derive(Clone, Copy)]
pub enum View {
    Stats,
    Items,
    Item,
    Flows,
    /// An action's answer: its fields on one line.
    Done,
}

pub fn render(view: View, v: &Value) -> String {
    match view {
        View::Stats => stats(v),
        View::Items => items(v.as_array().map(Vec::as_slice).unwrap_or_default()),
        View::Item => item(v),
        View::Flows => flows(v.as_array().map(Vec::as_slice).unwrap_or_default()),
        View::Done => done(v),
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Columns padded to their widest cell. Control characters a stored value holds (a reason,
/// a payload, a flow's text) are shown escaped: they cannot move the cursor, recolour the
/// terminal or forge a line.
fn table(head: &[&str], rows: Vec<Vec<String>>) -> String {
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| {
            r.into_iter()
                .map(|c| weir_core::redact::controls(&c).into_owned())
                .collect()
        })
        .collect();
    let mut width: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = width[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(head.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

fn age(ms: &Value) -> String {
    match ms.as_i64() {
        None => "-".into(),
        Some(ms) if ms < 1000 => format!("{ms}ms"),
        Some(ms) if ms < 120_000 => format!("{:.1}s", ms as f64 / 1000.0),
        Some(ms) => format!("{:.1}m", ms as f64 / 60_000.0),
    }
}

fn stats(v: &Value) -> String {
    let rows = [
        "ready",
        "in_flight",
        "delayed",
        "parked",
        "dead",
        "dead_evicted",
    ]
    .iter()
    .map(|k| vec![k.replace('_', " "), text(&v[*k])])
    .chain([
        vec!["oldest pending".into(), age(&v["oldest_pending_age_ms"])],
        vec![
            "durable".into(),
            if v["durable"] == true { "yes" } else { "no" }.into(),
        ],
    ])
    .collect();
    table(&["", ""], rows)
        .lines()
        .skip(1)
        .map(|l| format!("{l}\n"))
        .collect()
}

/// A time in ms since the epoch, as UTC.
fn when(ms: &Value) -> String {
    ms.as_i64()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|| "-".into())
}

/// The one-line detail of an item's state.
fn detail(v: &Value) -> String {
    match v["state"].as_str().unwrap_or_default() {
        "in_flight" => format!("at {} since {}", text(&v["consumer"]), when(&v["since"])),
        "delayed" => format!("due {}", when(&v["due"])),
        "dead" => text(&v["reason"]),
        "finished" => text(&v["outcome"]),
        _ => String::new(),
    }
}

fn items(list: &[Value]) -> String {
    if list.is_empty() {
        return "(none)\n".into();
    }
    let rows = list
        .iter()
        .map(|v| {
            vec![
                text(&v["item"]["id"]),
                text(&v["state"]),
                text(&v["item"]["flow"]),
                text(&v["item"]["node"]),
                text(&v["item"]["deliveries"]),
                detail(v),
            ]
        })
        .collect();
    table(
        &["ID", "STATE", "FLOW", "NODE", "DELIVERIES", "DETAIL"],
        rows,
    )
}

fn item(v: &Value) -> String {
    let i = &v["item"];
    let mut rows = vec![
        vec!["id".into(), text(&i["id"])],
        vec!["state".into(), text(&v["state"])],
        vec!["flow".into(), text(&i["flow"])],
        vec!["node".into(), text(&i["node"])],
        vec!["cause".into(), text(&i["cause"])],
        vec!["deliveries".into(), text(&i["deliveries"])],
    ];
    let d = detail(v);
    if !d.is_empty() {
        rows.push(vec!["detail".into(), d]);
    }
    rows.push(vec!["outputs".into(), i["outputs"].to_string()]);
    table(&["", ""], rows)
        .lines()
        .skip(1)
        .map(|l| format!("{l}\n"))
        .collect()
}

fn flows(list: &[Value]) -> String {
    let rows = list
        .iter()
        .map(|f| {
            vec![
                text(&f["id"]),
                if f["paused"] == true {
                    "paused"
                } else {
                    "running"
                }
                .into(),
                f["nodes"].as_array().map(Vec::len).unwrap_or(0).to_string(),
                text(&f["file"]),
            ]
        })
        .collect();
    table(&["FLOW", "STATE", "NODES", "FILE"], rows)
}

fn done(v: &Value) -> String {
    match v.as_object() {
        Some(o) => {
            let parts: Vec<String> = o.iter().map(|(k, v)| format!("{k}: {}", text(v))).collect();
            parts.join(", ") + "\n"
        }
        None => format!("{}\n", text(v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_line_up() {
        let list = json!([
            {"item": {"id": "01A", "flow": "orders", "node": "in", "deliveries": 1}, "state": "waiting"},
            {"item": {"id": "01B", "flow": "f", "node": "send", "deliveries": 3}, "state": "dead", "reason": "node `send` failed: 404"},
        ]);
        let t = render(View::Items, &list);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "ID   STATE    FLOW    NODE  DELIVERIES  DETAIL");
        assert_eq!(
            lines[2],
            "01B  dead     f       send  3           node `send` failed: 404"
        );
        let s = render(
            View::Stats,
            &json!({"ready": 3, "in_flight": 0, "delayed": 1, "parked": 0, "dead": 2, "dead_evicted": 0, "oldest_pending_age_ms": 1500, "durable": true}),
        );
        assert!(s.contains("ready           3\n"), "{s}");
        assert!(s.contains("oldest pending  1.5s\n"), "{s}");
        assert!(s.contains("durable         yes\n"), "{s}");
        let d = render(
            View::Items,
            &json!([{"item": {"id": "01C", "flow": "f", "node": "w", "deliveries": 0}, "state": "delayed", "due": 1_800_000_000_000i64}]),
        );
        assert!(d.contains("due 2027-01-15T08:00:00Z"), "{d}");
    }

    #[test]
    fn stored_control_characters_are_shown_escaped() {
        let list = json!([
            {"item": {"id": "01A", "flow": "f", "node": "n", "deliveries": 1}, "state": "dead",
             "reason": "bad\n01Z  done\u{1b}[2J"},
        ]);
        let t = render(View::Items, &list);
        assert_eq!(t.lines().count(), 2, "{t}");
        assert!(!t.contains('\u{1b}'), "{t}");
        assert!(t.contains("bad\\n01Z  done\\u{1b}[2J"), "{t}");
    }
}
