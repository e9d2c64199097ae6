//! MQTT: the transport ([`MqttHub`], [`Broker`]) and the `mqtt-in` subscriptions, where every
//! message becomes a journaled work item before it is acknowledged.
//!
//! - **One connection per distinct topic filter**, whatever number of flows use it, each with
//!   its own persistent session under a stable client id (`CLIENT_ID-in-<hash of filter>`).
//!   A delivery then always belongs to one subscription, so overlapping filters (which a
//!   broker may serve once per matching subscription, as mosquitto does) never send a flow
//!   the same message twice; each flow on the filter gets its own item.
//! - **Acks by hand, after journaling, in arrival order.** The connection's task only reads;
//!   a second task takes whatever has arrived, journals it in one `add` (never waiting to fill
//!   a batch: the broker's in-flight window is small), then acks each message in order. A
//!   crash between the two costs a redelivery, never the message. A journal that fails is
//!   retried in process while the broker holds the messages; at shutdown nothing more is
//!   acked, and the broker redelivers the rest to the next session.
//! - **Reconnects with backoff**, resubscribing on every new connection; a broker that is
//!   down at start is retried the same way and stops nothing else.
//! - **Several engines** on one broker subscribe as `$share/GROUP/FILTER` (`share=GROUP`), so
//!   each message is journaled by one of them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rumqttc::{AsyncClient, Event, Packet, Publish, QoS, SubscribeReasonCode};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use weir_queue::{Queue, WorkItem};

use crate::spec::{Source, Trigger};
use crate::Intake;

mod hub;

pub use hub::{message, qos, reconnect_delay, Broker, MqttHub, PublishError, DEFAULT_BROKER};

/// A flow's source node on one filter.
#[derive(Debug, Clone)]
struct Route {
    flow: String,
    node: String,
}

/// Messages journaled per `add` at most.
const MAX_BATCH: usize = 512;

/// Messages read from the broker and not yet journaled, per subscription, past which a QoS 0
/// message (which the broker would not send again) is dropped and counted. QoS 1 and 2
/// messages are bounded by the broker's window of messages in flight to a client (they
/// wait for their acks); the reader never waits for room, since the acks that make room go
/// out through the connection it polls.
const MAX_WAITING: usize = 4 * MAX_BATCH;

/// A message read from the broker, on its way to the journal. One larger than the
/// connection's `max_packet` comes without its payload, to be acknowledged in its turn and
/// not journaled.
struct Arrived {
    p: Publish,
    oversized: bool,
}

/// Subscribe for every `mqtt-in` node among `sources`: one connection per distinct filter and
/// broker. Fails (starting nothing) when a node names a broker the hub does not know.
pub fn spawn_all(
    queue: Queue,
    sources: &[Source],
    hub: &MqttHub,
    intake: Intake,
    tracker: &TaskTracker,
    stop: CancellationToken,
) -> Result<(), String> {
    type Key = (Option<String>, String);
    let mut by_filter: std::collections::BTreeMap<Key, (QoS, Vec<Route>)> = Default::default();
    for s in sources {
        if let Trigger::Mqtt(spec) = &s.trigger {
            let e = by_filter
                .entry((spec.broker.clone(), spec.filter.clone()))
                .or_insert((spec.qos, Vec::new()));
            if (spec.qos as u8) > (e.0 as u8) {
                e.0 = spec.qos;
            }
            e.1.push(Route {
                flow: s.flow.clone(),
                node: s.node.clone(),
            });
        }
    }
    let mut plan = Vec::new();
    for ((name, filter), (qos, routes)) in by_filter {
        let broker = hub.broker(name.as_deref())?;
        if broker.share.is_some() && broker.client_id == "weir" {
            tracing::warn!(broker = %broker.address(), "MQTT shared subscriptions with the default client id `weir`: engines sharing a broker need one each (client_id=… or WEIR_MQTT_CLIENT_ID), or they take each other's sessions");
        }
        plan.push((broker, filter, qos, routes));
    }
    for (broker, filter, qos, routes) in plan {
        let options = broker.options(&suffix(&filter));
        let subscribed = metrics::gauge!(
            "weir_mqtt_subscribed",
            "broker" => broker.address(),
            "client" => options.client_id(),
            "filter" => broker.subscription(&filter),
        );
        let (client, events) = AsyncClient::new(options, 1024);
        let (tx, rx) = mpsc::unbounded_channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let (q, c, i, s) = (queue.clone(), client.clone(), intake.clone(), stop.clone());
        let r = routes.clone();
        let w = waiting.clone();
        tracker.spawn(async move { journal(q, c, rx, w, r, i, s).await });
        let link = Link {
            client,
            filter: broker.subscription(&filter),
            qos,
            broker: broker.address(),
            subscribed,
            max_packet: broker.max_packet,
            waiting,
        };
        let s = stop.clone();
        tracker.spawn(async move { read(events, link, tx, s).await });
    }
    Ok(())
}

/// The client id suffix of a filter's connection: stable across restarts and builds.
fn suffix(filter: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in filter.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("in-{h:016x}")
}

/// One subscribing connection, as its reading task sees it.
struct Link {
    client: AsyncClient,
    /// What it subscribes to (the shared form with `share=`).
    filter: String,
    qos: QoS,
    /// The broker's address, for the log.
    broker: String,
    /// `weir_mqtt_subscribed`: 1 from the broker's acknowledgement of the subscription until
    /// the connection fails. Meanwhile, what the broker gets for the filter reaches this
    /// engine only if its session was kept.
    subscribed: metrics::Gauge,
    /// The largest message journaled; a larger one is acknowledged, counted and logged.
    max_packet: usize,
    /// Messages handed to the journal task and not yet taken by it.
    waiting: Arc<AtomicUsize>,
}

/// Own the connection: read, hand publishes to the journal task, resubscribe on connect.
async fn read(
    mut events: rumqttc::EventLoop,
    link: Link,
    tx: mpsc::UnboundedSender<Arrived>,
    stop: CancellationToken,
) {
    let Link {
        client,
        filter,
        qos,
        broker,
        subscribed,
        max_packet,
        waiting,
    } = link;
    let mut failures = 0u32;
    subscribed.set(0.0);
    loop {
        let ev = tokio::select! {
            _ = stop.cancelled() => break,
            ev = events.poll() => ev,
        };
        match ev {
            Ok(Event::Incoming(Packet::ConnAck(c))) => {
                if failures > 0 {
                    tracing::info!(%broker, %filter, "connected to the broker again");
                } else {
                    tracing::info!(%broker, %filter, session_present = c.session_present, "subscribing");
                }
                failures = 0;
                if let Err(e) = client.subscribe(filter.as_str(), qos).await {
                    tracing::error!(%filter, error = %e, "cannot subscribe");
                }
            }
            Ok(Event::Incoming(Packet::SubAck(s))) => {
                if s.return_codes.contains(&SubscribeReasonCode::Failure) {
                    tracing::error!(%broker, %filter, "the broker refused the subscription (check its ACL)");
                } else {
                    tracing::debug!(%broker, %filter, "subscribed");
                    subscribed.set(1.0);
                }
            }
            Ok(Event::Incoming(Packet::Publish(mut p))) => {
                let oversized = p.payload.len() > max_packet;
                if oversized {
                    // Read, so that it does not come back at every connection and hold up
                    // the messages behind it; acknowledged in its turn, never journaled.
                    metrics::counter!("weir_bounds_hit_total", "bound" => "mqtt_packet")
                        .increment(1);
                    tracing::warn!(
                        %broker,
                        topic = %weir_core::redact::controls(&p.topic),
                        bytes = p.payload.len(),
                        max_packet,
                        retained = p.retain,
                        "an MQTT message larger than max_packet was dropped (acknowledged, not journaled)"
                    );
                    p.payload = Default::default();
                }
                if p.qos == QoS::AtMostOnce && waiting.load(Ordering::Relaxed) >= MAX_WAITING {
                    metrics::counter!("weir_bounds_hit_total", "bound" => "mqtt_intake")
                        .increment(1);
                    metrics::counter!("weir_mqtt_dropped_total", "filter" => filter.clone())
                        .increment(1);
                    continue;
                }
                waiting.fetch_add(1, Ordering::Relaxed);
                if tx.send(Arrived { p, oversized }).is_err() {
                    break;
                }
            }
            Ok(_) => {}
            Err(e) => {
                subscribed.set(0.0);
                failures += 1;
                if failures == 1 || failures.is_multiple_of(50) {
                    tracing::warn!(%broker, %filter, error = %e, failures, "MQTT connection failing; retrying");
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(reconnect_delay(failures)) => {}
                }
            }
        }
    }
    subscribed.set(0.0);
}

/// Journal what has arrived, then ack it, in arrival order.
async fn journal(
    queue: Queue,
    client: AsyncClient,
    mut rx: mpsc::UnboundedReceiver<Arrived>,
    waiting: Arc<AtomicUsize>,
    routes: Vec<Route>,
    intake: Intake,
    stop: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => return,
            p = rx.recv() => match p { Some(p) => p, None => return },
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        waiting.fetch_sub(batch.len(), Ordering::Relaxed);
        // Each route but the last gets a copy of the message; the last takes it.
        let build = || -> Vec<WorkItem> {
            let mut items = Vec::with_capacity(batch.len() * routes.len());
            for Arrived { p, oversized } in &batch {
                let Some((last, rest)) = routes.split_last() else {
                    continue;
                };
                if *oversized {
                    continue;
                }
                let msg = message(&p.topic, p.qos, p.retain, &p.payload);
                let cause = ["mqtt:", &p.topic].concat();
                for r in rest {
                    items.push(WorkItem::cascade(
                        &r.flow,
                        &r.node,
                        cause.clone(),
                        vec![msg.clone()],
                    ));
                }
                items.push(WorkItem::cascade(&last.flow, &last.node, cause, vec![msg]));
            }
            items
        };
        // A retry adds the same items again, by id: an add whose answer was lost but that
        // went through is then journaled once. Rebuilt only for a retry, not copied for
        // every add.
        let mut first = Some(build());
        let ids: Vec<_> = first.iter().flatten().map(|i| i.id).collect();
        let mut failures = 0u32;
        loop {
            // Shutting down: acknowledge nothing more; the broker redelivers to the next session.
            if !intake.is_open() || stop.is_cancelled() {
                return;
            }
            let items = first.take().unwrap_or_else(|| {
                let mut again = build();
                for (it, id) in again.iter_mut().zip(&ids) {
                    it.id = *id;
                }
                again
            });
            // Only oversized messages: nothing to journal, only their acks to send.
            if items.is_empty() {
                break;
            }
            match queue.add(items).await {
                Ok(()) => {
                    let journaled = batch.iter().filter(|a| !a.oversized).count();
                    for r in &routes {
                        metrics::counter!("weir_events_total", "trigger" => "mqtt", "flow" => r.flow.clone())
                            .increment(journaled as u64);
                    }
                    break;
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(50) {
                        tracing::warn!(error = %e, messages = batch.len(), "MQTT messages not journaled yet (not acknowledged: the broker keeps them); retrying");
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(reconnect_delay(failures)) => {}
                    }
                }
            }
        }
        for Arrived { p, .. } in &batch {
            if let Err(e) = client.ack(p).await {
                tracing::warn!(error = %e, "cannot acknowledge an MQTT message; the broker will send it again");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn filter_ids_are_stable() {
        assert_eq!(
            super::suffix("home/+/temperature"),
            super::suffix("home/+/temperature")
        );
        assert_ne!(super::suffix("a/#"), super::suffix("a/+"));
    }
}
