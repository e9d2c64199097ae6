//! The MQTT transport: the broker settings, the publishing connection, and how a publish
//! becomes a message. The `mqtt-out` node publishes through the [`MqttHub`]; the `mqtt-in`
//! subscriptions ([`super::spawn_all`]) connect with its [`Broker`]s.
//!
//! A publish at QoS ≥ 1 is done only when the broker's PUBACK (QoS 2: PUBCOMP) for it comes
//! back. rumqttc's `publish()` returns when the packet is queued, so the connection's task
//! matches acknowledgements to callers: publishes leave in the order they were queued, each
//! `Outgoing::Publish(pkid)` gives the oldest waiting caller its packet id, and the ack for
//! that id answers it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet, QoS};
use serde_json::Value;
use tokio::sync::oneshot;
use weir_core::Message;

/// Why a publish failed, for its caller to decide what comes next.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PublishError {
    /// Publishing again cannot help: a topic one cannot publish to, a broker not known.
    #[error("{0}")]
    Permanent(String),
    /// The broker or the connection failed: publish again later.
    #[error("{0}")]
    Transient(String),
}

/// The broker weir talks to: `mqtt://[USER:PASSWORD@]HOST[:PORT][?client_id=ID&share=GROUP]`,
/// or `mqtts://…` for TLS (port 8883 by default; the system's root certificates, or
/// `ca=PATH` / `WEIR_MQTT_CA_FILE`), with credentials also from `WEIR_MQTT_USERNAME` /
/// `WEIR_MQTT_PASSWORD`, the client id stem from `WEIR_MQTT_CLIENT_ID` and the share group
/// from `WEIR_MQTT_SHARE`; `max_packet=BYTES` (default 1 MiB) bounds packets both ways and
/// `inflight=N` (default 20) the publishes awaiting their ack.
#[derive(Debug, Clone)]
pub struct Broker {
    pub host: String,
    pub port: u16,
    pub username: Option<String>,
    pub password: Option<String>,
    /// The stem of every client id weir uses with this broker. Stable across restarts, so
    /// the broker keeps each session (and its queued messages) while the engine is down.
    pub client_id: String,
    /// Largest packet in or out, in bytes (rumqttc's own default, 10 KiB, would drop the
    /// connection on one larger message).
    pub max_packet: usize,
    /// Publishes in flight (sent, not yet acknowledged) per connection. mosquitto stalls a
    /// client that has more than its `max_inflight_messages` (20) QoS 2 publishes out.
    pub inflight: u16,
    /// Several engines on one broker: subscribe as `$share/GROUP/FILTER`, so the broker hands
    /// each message to one of them (each engine then needs its own `client_id`).
    pub share: Option<String>,
    /// TLS to the broker (rustls, ring), checked when the URL is read.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// A TLS client configuration trusting `ca_file`, or the system's roots.
fn tls_config(ca_file: Option<&str>) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let pem =
                std::fs::read(path).map_err(|e| format!("cannot read the CA file {path}: {e}"))?;
            for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
                let cert = cert.map_err(|e| format!("{path}: not a PEM certificate: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("{path}: unusable certificate: {e}"))?;
            }
            if roots.is_empty() {
                return Err(format!("{path} holds no PEM certificate"));
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err("no system root certificates found; give the broker's CA with ca=PATH or WEIR_MQTT_CA_FILE".into());
            }
        }
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// The broker `weir run` uses unless told otherwise.
pub const DEFAULT_BROKER: &str = "mqtt://127.0.0.1:1883";

impl Broker {
    pub fn parse(url: &str) -> Result<Broker, String> {
        // In errors: the URL with its password hidden.
        let shown = weir_core::redact::url(url);
        let (tls, rest) = match url.split_once("://") {
            Some(("mqtt" | "tcp", rest)) => (false, rest),
            Some(("mqtts" | "ssl", rest)) => (true, rest),
            _ => {
                return Err(format!(
                    "`{shown}` is not a broker URL: mqtt://HOST:PORT or mqtts://HOST:PORT"
                ))
            }
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let rest = rest.trim_end_matches('/');
        let mut client_id = None;
        let mut share = None;
        let mut ca = None;
        let mut max_packet = 1 << 20;
        let mut inflight = 20;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("client_id", v)) if !v.is_empty() => client_id = Some(v.to_string()),
                Some(("ca", v)) if !v.is_empty() && tls => ca = Some(v.to_string()),
                Some(("inflight", v)) => {
                    inflight = v.parse().ok().filter(|n| (1..=1000).contains(n)).ok_or_else(|| {
                        format!("`{shown}`: `inflight={v}` is a number from 1 to 1000")
                    })?
                }
                Some(("max_packet", v)) => {
                    max_packet = v.parse().ok().filter(|n| (1024..=256 << 20).contains(n)).ok_or_else(|| {
                        format!("`{shown}`: `max_packet={v}` is a size in bytes from 1024 to 268435456")
                    })?
                }
                Some(("share", v)) if !v.is_empty() && !v.contains(['/', '+', '#']) => {
                    share = Some(v.to_string())
                }
                _ => {
                    return Err(format!(
                        "`{shown}`: unknown or empty setting `{pair}` (client_id=ID, share=GROUP, max_packet=BYTES, inflight=N; with mqtts, ca=PATH)"
                    ))
                }
            }
        }
        let (creds, hostport) = match rest.rsplit_once('@') {
            Some((c, h)) => (Some(c), h),
            None => (None, rest),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| format!("`{shown}`: `{p}` is not a port"))?,
            ),
            None => (hostport, if tls { 8883 } else { 1883 }),
        };
        if host.is_empty() {
            return Err(format!("`{shown}` names no host"));
        }
        let (username, password) = match creds {
            Some(c) => match c.split_once(':') {
                Some((u, p)) => (Some(u.to_string()), Some(p.to_string())),
                None => (Some(c.to_string()), None),
            },
            None => (None, None),
        };
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let tls = if tls {
            let ca = ca.or_else(|| env("WEIR_MQTT_CA_FILE"));
            Some(tls_config(ca.as_deref()).map_err(|e| format!("`{shown}`: {e}"))?)
        } else {
            None
        };
        Ok(Broker {
            host: host.to_string(),
            port,
            username: username.or_else(|| env("WEIR_MQTT_USERNAME")),
            password: password.or_else(|| env("WEIR_MQTT_PASSWORD")),
            client_id: client_id
                .or_else(|| env("WEIR_MQTT_CLIENT_ID"))
                .unwrap_or_else(|| "weir".into()),
            max_packet,
            inflight,
            share: share.or_else(|| env("WEIR_MQTT_SHARE")),
            tls,
        })
    }

    /// `WEIR_MQTT`, or the default broker.
    pub fn from_env() -> Result<Broker, String> {
        Broker::parse(&std::env::var("WEIR_MQTT").unwrap_or_else(|_| DEFAULT_BROKER.into()))
    }

    /// Options for one of weir's connections: a persistent session (clean session off) under
    /// the stable id `CLIENT_ID-SUFFIX`, acks by hand.
    pub fn options(&self, suffix: &str) -> MqttOptions {
        let mut o = MqttOptions::new(
            format!("{}-{suffix}", self.client_id),
            self.host.clone(),
            self.port,
        );
        o.set_keep_alive(Duration::from_secs(30))
            .set_clean_session(false)
            .set_manual_acks(true)
            // Any packet the protocol allows is read: one the connection refused would fail
            // it, and the broker would send it again at every reconnect, for ever, ahead of
            // everything behind it. A message past `max_packet` is dropped after it is read
            // (`mqtt_packet` in the bounds hit); one this engine would publish past it is
            // refused before it is sent.
            .set_max_packet_size(MQTT_MAX_PACKET, self.max_packet)
            .set_request_channel_capacity(4096)
            .set_inflight(self.inflight);
        if let Some(u) = &self.username {
            o.set_credentials(u.clone(), self.password.clone().unwrap_or_default());
        }
        if let Some(cfg) = &self.tls {
            o.set_transport(rumqttc::Transport::tls_with_config(
                rumqttc::TlsConfiguration::Rustls(cfg.clone()),
            ));
        }
        o
    }

    pub fn address(&self) -> String {
        let scheme = if self.tls.is_some() { "mqtts" } else { "mqtt" };
        format!("{scheme}://{}:{}", self.host, self.port)
    }

    /// What to subscribe to for `filter`: the filter itself, or its shared form.
    pub fn subscription(&self, filter: &str) -> String {
        match &self.share {
            Some(g) => format!("$share/{g}/{filter}"),
            None => filter.to_string(),
        }
    }
}

/// The largest packet MQTT allows: a remaining length of at most 268,435,455 bytes and its
/// fixed header.
const MQTT_MAX_PACKET: usize = 268_435_455 + 5;

/// Backoff after the `n`th failure in a row: 100 ms doubling to 5 s.
pub fn reconnect_delay(n: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << n.min(6))).min(Duration::from_secs(5))
}

/// The callers of one publishing connection waiting for their publish to be acknowledged,
/// in the order of their publishes.
#[derive(Default)]
struct Waiters {
    /// Queued, not yet given a packet id, oldest first.
    queued: VecDeque<oneshot::Sender<()>>,
    /// Sent, waiting for the broker's ack.
    sent: HashMap<u16, oneshot::Sender<()>>,
    /// The connection failed: its callers were told, and it takes no more.
    closed: bool,
}

/// One publishing connection, from its connect to its first failure. A failed connection is
/// not reconnected: rumqttc would then resend, or (when the broker has lost the session)
/// silently drop, the publishes it held, and its events could no longer be matched to their
/// callers in order (a dropped publish's caller would be told "acknowledged" by the ack of a
/// later one). So its callers are failed, to publish again through the next connection.
struct Publisher {
    client: AsyncClient,
    waiters: Arc<Mutex<Waiters>>,
    /// This broker's publishing connections that failed in a row, for the log; handed on
    /// from each connection to the next.
    failures: Arc<std::sync::atomic::AtomicU32>,
    /// The broker's `max_packet`: a larger message is refused before it is sent.
    max_packet: usize,
}

impl Publisher {
    fn closed(&self) -> bool {
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .closed
    }
}

/// The engine's MQTT side shared by its nodes: the default broker and any named ones, and,
/// started on first use, one publishing connection per broker.
#[derive(Default)]
pub struct MqttHub {
    default: Mutex<Option<Broker>>,
    named: Mutex<HashMap<String, Broker>>,
    /// Set once the engine has given its brokers: from then on a node naming an unknown one
    /// is refused at load (before that, as in `weir validate`, names are taken on trust).
    configured: std::sync::atomic::AtomicBool,
    publishers: tokio::sync::Mutex<HashMap<String, Arc<Publisher>>>,
}

impl MqttHub {
    /// Use `broker` as the default (the default default is `WEIR_MQTT` or [`DEFAULT_BROKER`]).
    pub fn set_broker(&self, broker: Broker) {
        *self.default.lock().unwrap_or_else(|p| p.into_inner()) = Some(broker);
        self.configured
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Add a broker that flows name with `broker: NAME`.
    pub fn add_broker(&self, name: &str, broker: Broker) {
        self.named
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), broker);
        self.configured
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a flow may name `name` (always, until the engine has given its brokers).
    pub fn knows(&self, name: &str) -> Result<(), String> {
        let named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        if named.contains_key(name) || !self.configured.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let mut known: Vec<&str> = named.keys().map(String::as_str).collect();
        known.sort_unstable();
        Err(if known.is_empty() {
            format!("no broker named `{name}` (name brokers with --mqtt-broker NAME=URL)")
        } else {
            format!("no broker named `{name}` (known: {})", known.join(", "))
        })
    }

    /// The broker a node names, or the default one.
    pub fn broker(&self, name: Option<&str>) -> Result<Broker, String> {
        if let Some(n) = name {
            self.knows(n)?;
            return self
                .named
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(n)
                .cloned()
                .ok_or_else(|| format!("no broker named `{n}`"));
        }
        let mut b = self.default.lock().unwrap_or_else(|p| p.into_inner());
        match &*b {
            Some(b) => Ok(b.clone()),
            None => {
                let d = Broker::from_env()?;
                *b = Some(d.clone());
                Ok(d)
            }
        }
    }

    async fn publisher(&self, name: Option<&str>) -> Result<Arc<Publisher>, PublishError> {
        let key = name.unwrap_or_default().to_string();
        let mut all = self.publishers.lock().await;
        let failures = match all.get(&key) {
            Some(p) if !p.closed() => return Ok(p.clone()),
            Some(p) => p.failures.clone(),
            None => Default::default(),
        };
        let broker = self.broker(name).map_err(PublishError::Permanent)?;
        // A clean session: a connection lives until its first failure and keeps nothing for
        // the next (a persistent one would let the broker hold QoS 2 packet ids that the next
        // connection, numbering from 1 again, would collide with).
        let mut options = broker.options("out");
        options.set_clean_session(true);
        let (client, mut events) = AsyncClient::new(options, 4096);
        let waiters = Arc::new(Mutex::new(Waiters::default()));
        let w = waiters.clone();
        let address = broker.address();
        let f = failures.clone();
        // Ends at the connection's first failure, or when the hub (and so the client) is
        // dropped.
        tokio::spawn(async move {
            use std::sync::atomic::Ordering::Relaxed;
            loop {
                match events.poll().await {
                    Ok(ev) => {
                        if matches!(ev, Event::Incoming(Packet::ConnAck(_)))
                            && f.swap(0, Relaxed) > 0
                        {
                            tracing::info!(broker = %address, "publishing connection is back");
                        }
                        track(&w, ev);
                    }
                    Err(rumqttc::ConnectionError::RequestsDone) => return,
                    Err(e) => {
                        let n = f.fetch_add(1, Relaxed) + 1;
                        if n == 1 || n.is_multiple_of(50) {
                            tracing::warn!(broker = %address, error = %e, failures = n, "cannot publish to the broker; the publishes waiting are retried through a new connection");
                        }
                        // Its callers' senders go: each is told the publish was not acknowledged.
                        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                        w.closed = true;
                        w.queued.clear();
                        w.sent.clear();
                        return;
                    }
                }
            }
        });
        let p = Arc::new(Publisher {
            client,
            waiters,
            failures,
            max_packet: broker.max_packet,
        });
        all.insert(key, p.clone());
        Ok(p)
    }

    /// Publish through broker `name` (or the default) and wait until the broker has it
    /// (QoS ≥ 1) or it is sent (QoS 0). A message too large for the connection's
    /// `max_packet` fails permanently, before it is sent: it would fail the connection that
    /// every flow publishes through.
    pub async fn publish(
        &self,
        name: Option<&str>,
        topic: &str,
        qos: QoS,
        retain: bool,
        payload: Vec<u8>,
    ) -> Result<(), PublishError> {
        if !rumqttc::valid_topic(topic) {
            return Err(PublishError::Permanent(format!(
                "`{topic}` is not a topic one can publish to"
            )));
        }
        let p = self.publisher(name).await?;
        let max_packet = p.max_packet;
        // The packet: its fixed header (at most 5 bytes), the topic with its length, a packet
        // id (QoS 1 and 2), the payload.
        let size = 5 + 2 + topic.len() + 2 + payload.len();
        if size > max_packet {
            metrics::counter!("weir_bounds_hit_total", "bound" => "mqtt_packet").increment(1);
            return Err(PublishError::Permanent(format!(
                "the message to `{topic}` makes a packet of {size} bytes, more than the \
                 broker's max_packet ({max_packet} bytes)"
            )));
        }
        let (tx, rx) = oneshot::channel();
        {
            // Queue the caller and the packet together, so that their orders agree.
            let mut w = p.waiters.lock().unwrap_or_else(|e| e.into_inner());
            if w.closed {
                return Err(PublishError::Transient(
                    "the connection to the broker failed; publishing again later".into(),
                ));
            }
            p.client
                .try_publish(topic, qos, retain, payload)
                .map_err(|e| PublishError::Transient(format!("cannot queue the publish: {e}")))?;
            w.queued.push_back(tx);
        }
        rx.await.map_err(|_| {
            PublishError::Transient(
                "the connection to the broker failed before it acknowledged the publish".into(),
            )
        })
    }
}

/// Match the connection's events to the callers waiting for them.
fn track(w: &Mutex<Waiters>, ev: Event) {
    let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
    match ev {
        Event::Outgoing(Outgoing::Publish(0)) => {
            if let Some(tx) = w.queued.pop_front() {
                let _ = tx.send(());
            }
        }
        // A packet id already waiting is a resend, not a new publish (rumqttc resends only
        // after a reconnect, which a connection here never makes: see `Publisher`).
        Event::Outgoing(Outgoing::Publish(pkid)) if !w.sent.contains_key(&pkid) => {
            if let Some(tx) = w.queued.pop_front() {
                w.sent.insert(pkid, tx);
            }
        }
        Event::Incoming(Packet::PubAck(a)) => {
            if let Some(tx) = w.sent.remove(&a.pkid) {
                let _ = tx.send(());
            }
        }
        Event::Incoming(Packet::PubComp(c)) => {
            if let Some(tx) = w.sent.remove(&c.pkid) {
                let _ = tx.send(());
            }
        }
        _ => {}
    }
}

pub fn qos(n: u8) -> Option<QoS> {
    match n {
        0 => Some(QoS::AtMostOnce),
        1 => Some(QoS::AtLeastOnce),
        2 => Some(QoS::ExactlyOnce),
        _ => None,
    }
}

/// The message an MQTT publish becomes: a JSON payload as JSON, other UTF-8 text as a string,
/// anything else as base64 text with `msg.encoding = "base64"`.
pub fn message(topic: &str, qos: QoS, retain: bool, payload: &[u8]) -> Message {
    use base64::Engine as _;
    let mut msg = serde_json::json!({
        "topic": topic,
        "qos": qos as u8,
        "retain": retain,
    });
    let body = match serde_json::from_slice::<Value>(payload) {
        Ok(v) => v,
        Err(_) => match std::str::from_utf8(payload) {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => {
                msg["encoding"] = "base64".into();
                Value::String(base64::engine::general_purpose::STANDARD.encode(payload))
            }
        },
    };
    msg["payload"] = body;
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_urls() {
        let b = Broker::parse("mqtt://u:p@broker.local:1884").unwrap();
        assert_eq!((b.host.as_str(), b.port), ("broker.local", 1884));
        assert_eq!(
            (b.username.as_deref(), b.password.as_deref()),
            (Some("u"), Some("p"))
        );
        assert_eq!(Broker::parse("mqtt://h").unwrap().port, 1883);
        assert!(Broker::parse("http://h")
            .unwrap_err()
            .contains("not a broker URL"));
        assert!(Broker::parse("mqtt://h:x")
            .unwrap_err()
            .contains("not a port"));
    }

    #[test]
    fn a_bad_broker_url_is_named_without_its_password() {
        for (url, says) in [
            (
                "mqtt://u:hunter2@h:x",
                "`mqtt://u:***@h:x`: `x` is not a port",
            ),
            (
                "mqtt://u:hunter2@h?bogus=1",
                "`mqtt://u:***@h?bogus=1`: unknown or empty",
            ),
            (
                "mqtt://u:hunter2@h?inflight=0",
                "`mqtt://u:***@h?inflight=0`: `inflight=0`",
            ),
            ("mqtt://u:hunter2@", "`mqtt://u:***@` names no host"),
        ] {
            let e = Broker::parse(url).unwrap_err();
            assert!(e.contains(says) && !e.contains("hunter2"), "{url}: {e}");
        }
    }

    #[test]
    fn payloads_become_messages() {
        let m = message("a/b", QoS::AtLeastOnce, false, br#"{"t": 21.5}"#);
        assert_eq!(m["payload"]["t"], 21.5);
        assert_eq!(
            (m["topic"].as_str(), m["qos"].as_u64()),
            (Some("a/b"), Some(1))
        );
        assert_eq!(message("a", QoS::AtMostOnce, true, b"on")["payload"], "on");
        let bin = message("a", QoS::AtMostOnce, false, &[0xff, 0x00]);
        assert_eq!(
            (bin["payload"].as_str(), bin["encoding"].as_str()),
            (Some("/wA="), Some("base64"))
        );
    }

    #[test]
    fn acks_reach_the_callers_in_order_and_resends_are_not_new_publishes() {
        let w = Mutex::new(Waiters::default());
        let (a, mut ra) = oneshot::channel();
        let (b, mut rb) = oneshot::channel();
        w.lock().unwrap().queued.extend([a, b]);
        track(&w, Event::Outgoing(Outgoing::Publish(7)));
        track(&w, Event::Outgoing(Outgoing::Publish(7))); // resent after a reconnect
        track(&w, Event::Outgoing(Outgoing::Publish(8)));
        track(&w, Event::Incoming(Packet::PubAck(rumqttc::PubAck::new(8))));
        assert!(ra.try_recv().is_err(), "7 is not acknowledged yet");
        assert!(rb.try_recv().is_ok(), "8 is");
        track(&w, Event::Incoming(Packet::PubAck(rumqttc::PubAck::new(7))));
        assert!(ra.try_recv().is_ok());
    }
}
