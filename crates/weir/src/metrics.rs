//! `/metrics`: weir's counters and histograms in the Prometheus text format.
//!
//! The recorder is process-wide (metrics has one global recorder): the first engine installs
//! it, later ones in the same process share it. An embedder that installed a recorder of
//! its own keeps it, and `/metrics` says so.
//!
//! The recorder keeps every histogram sample until it is folded into its buckets, which it
//! does at a scrape or an upkeep; each running engine runs the upkeep ([`upkeep`]), so an
//! engine that nobody scrapes does not grow by every sample it records.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// Seconds, from a millisecond to a minute: how long waves take.
const WAVE_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Seconds, from 50 µs to a second: how long the SQLite writer's COMMITs and writes take
/// (an fsync is 0.1–0.5 ms on the disks measured; a write waits about two transactions).
const SQLITE_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

pub fn handle() -> Result<&'static PrometheusHandle, &'static str> {
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full("weir_wave_seconds".into()), WAVE_BUCKETS)
                .map_err(|e| e.to_string())?
                // Buckets rather than quantiles, so that engines' figures add up.
                .set_buckets_for_metric(Matcher::Prefix("weir_sqlite_".into()), SQLITE_BUCKETS)
                .map_err(|e| e.to_string())?
                .install_recorder()
                .map_err(|e| format!("another metrics recorder is installed in this process: {e}"))
        })
        .as_ref()
        .map_err(String::as_str)
}

/// How often the samples histograms recorded are folded into their buckets. Until then the
/// recorder holds each one (about 8 bytes; under a webhook load, three or so an event), so
/// this bounds what it holds to about a second's worth.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Fold the recorded histogram samples into their buckets every [`UPKEEP_EVERY`] until `stop`.
/// `metrics-exporter-prometheus` does this by itself only when it serves the scrapes;
/// `/metrics` is weir's own route, so the engine does it.
pub async fn upkeep(handle: &'static PrometheusHandle, stop: CancellationToken) {
    let mut every = tokio::time::interval(UPKEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = every.tick() => handle.run_upkeep(),
        }
    }
}

/// Describe the metrics once, so that `/metrics` carries their help text.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "weir_events_total",
        "Events journaled, by trigger (webhook, mqtt, cron) and flow"
    );
    describe_counter!(
        "weir_items_ended_total",
        "Items ended by their wave's commit, by flow and end (ack, dead_letter, park, superseded)"
    );
    describe_counter!(
        "weir_retries_total",
        "Node failures scheduled for a retry at that node, by flow and node"
    );
    describe_counter!(
        "weir_dead_letters_total",
        "Messages dead-lettered inside waves, by flow and node"
    );
    describe_counter!("weir_node_calls_total", "Node calls, by node type");
    describe_counter!(
        "weir_node_failures_total",
        "Node calls that failed, by node type"
    );
    describe_counter!(
        "weir_rate_limit_held_total",
        "Messages held back by a rate limit, by flow and node"
    );
    describe_counter!(
        "weir_rate_limit_dropped_total",
        "Messages dropped by a rate limit, by flow and node"
    );
    describe_histogram!(
        "weir_wave_seconds",
        Unit::Seconds,
        "Time from a wave's start to its commit, by flow"
    );
    describe_gauge!("weir_queue_items", "Items in the queue now, by state");
    describe_counter!(
        "weir_sqlite_transactions_total",
        "SQLite transactions committed by the writer (one fsync each)"
    );
    describe_counter!(
        "weir_sqlite_jobs_total",
        "Queue operations carried by those transactions (group commit: jobs / transactions)"
    );
    describe_histogram!(
        "weir_sqlite_commit_seconds",
        Unit::Seconds,
        "Time of each SQLite COMMIT, its fsync included"
    );
    describe_histogram!(
        "weir_sqlite_wait_seconds",
        Unit::Seconds,
        "Time a queue write took from its request to its durable answer: waiting for the transaction under way, then its own; by what was written (write: journal, an event journaled; commit, a wave's commit; other)"
    );
    describe_gauge!(
        "weir_mqtt_subscribed",
        "1 while the broker has acknowledged an mqtt-in connection's subscription, by broker, client id and filter; 0 from start until then and while the connection is made again (what the broker gets for the filter meanwhile reaches the engine only if its session was kept)"
    );
    describe_gauge!(
        "weir_redis_reply_channel_listening",
        "1 while this engine listens for the replies other engines post for its waiting `respond: wave` requests and for the items they add while none of their claims waits (Redis); 0 while it cannot, and polls for them up to 25 ms late (a process running several engines: how many listen)"
    );
    describe_counter!(
        "weir_redis_replies_heard_total",
        "`respond: wave` requests that found the reply another engine posted when it was heard on the channel, not at a poll (Redis)"
    );
    describe_counter!(
        "weir_redis_adds_heard_total",
        "Claims of this engine that took items another engine added while none of its own claims waited, woken by the add heard on the channel, not at a poll (Redis)"
    );
    describe_counter!(
        "weir_redis_foreign_entries_total",
        "Entries found in a queue's Redis stream that weir did not write (added by another program), each removed with a warning that gives its fields"
    );
    describe_gauge!(
        "weir_dead_letters_evicted",
        "Dead letters evicted past the backend's cap, all told"
    );
    describe_counter!(
        "weir_pruned_total",
        "Outcomes, dead letters and run records pruned past the retention"
    );
}
