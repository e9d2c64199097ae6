//! Cron: one task per cron node; each tick is journaled as one cascade item, claimed through
//! the queue (`add_tick`) so that a tick is journaled once however many engines fire it.

use std::time::Duration;

use chrono::{TimeZone, Utc};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use weir_queue::{Queue, StateKey, WorkItem, WorkQueue};

use crate::spec::{CronSpec, Source, Trigger};

const LAST_TICK: &str = "last_tick";

/// Start a task for every cron schedule among `sources`.
pub fn spawn_all(
    queue: Queue,
    sources: &[Source],
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) {
    for s in sources {
        if let Trigger::Cron(spec) = &s.trigger {
            let (q, flow, node, spec, stop) = (
                queue.clone(),
                s.flow.clone(),
                s.node.clone(),
                (**spec).clone(),
                shutdown.clone(),
            );
            tracker.spawn(async move { run(q, flow, node, spec, stop).await });
        }
    }
}

fn tick_item(flow: &str, node: &str, spec: &CronSpec, tick: chrono::DateTime<Utc>) -> WorkItem {
    let payload = spec
        .payload
        .clone()
        .unwrap_or_else(|| json!(tick.to_rfc3339()));
    WorkItem::cascade(
        flow,
        node,
        format!("cron:{node}"),
        vec![json!({ "payload": payload, "topic": node, "tick": tick.to_rfc3339() })],
    )
}

async fn journal(
    q: &dyn WorkQueue,
    flow: &str,
    node: &str,
    spec: &CronSpec,
    tick: chrono::DateTime<Utc>,
    stop: &CancellationToken,
) {
    let key = StateKey::new(flow, node, LAST_TICK);
    let mut delay = Duration::from_millis(100);
    loop {
        match q
            .add_tick(
                &key,
                tick.timestamp_millis(),
                tick_item(flow, node, spec, tick),
            )
            .await
        {
            Ok(journaled) => {
                if journaled {
                    metrics::counter!("weir_events_total", "trigger" => "cron", "flow" => flow.to_string())
                        .increment(1);
                }
                return;
            }
            Err(e) => {
                tracing::warn!(flow, node, error = %e, "cron tick not journaled yet; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

async fn run(q: Queue, flow: String, node: String, spec: CronSpec, stop: CancellationToken) {
    let tz = spec.timezone;
    if spec.catch_up_last {
        let key = StateKey::new(&flow, &node, LAST_TICK);
        let last = q
            .read(&key)
            .await
            .ok()
            .and_then(|v| v.value)
            .and_then(|v| v.as_i64());
        let now = Utc::now().with_timezone(&tz);
        if let (Some(last), Ok(prev)) = (last, spec.cron.find_previous_occurrence(&now, false)) {
            if prev.timestamp_millis() > last {
                tracing::info!(flow, node, tick = %prev, "catching up the last tick missed while down");
                journal(&*q, &flow, &node, &spec, prev.with_timezone(&Utc), &stop).await;
            }
        }
    }
    loop {
        let now = Utc::now().with_timezone(&tz);
        let next = match spec.cron.find_next_occurrence(&now, false) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(flow, node, error = %e, "cron schedule has no next time; stopping it");
                return;
            }
        };
        let wait = (next.with_timezone(&Utc) - Utc::now())
            .to_std()
            .unwrap_or(Duration::ZERO);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let tick = Utc
            .timestamp_millis_opt(next.timestamp_millis())
            .single()
            .unwrap_or_else(Utc::now);
        journal(&*q, &flow, &node, &spec, tick, &stop).await;
    }
}
