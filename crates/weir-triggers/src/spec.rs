//! What drives each source node, as the node library reads it from a flow: a webhook's
//! path and answer, a cron schedule, an MQTT filter. Triggers run from these alone.

use std::time::Duration;

/// What drives a source node.
#[derive(Debug, Clone)]
pub enum Trigger {
    Webhook(WebhookSpec),
    Cron(Box<CronSpec>),
    Mqtt(MqttInSpec),
    Manual,
}

/// What an `mqtt-in` node subscribes to.
#[derive(Debug, Clone, PartialEq)]
pub struct MqttInSpec {
    pub filter: String,
    pub qos: rumqttc::QoS,
    /// A broker the engine names, or the default one.
    pub broker: Option<String>,
}

#[derive(Debug, Clone)]
pub struct WebhookSpec {
    /// Served at `/hooks/<path>`.
    pub path: String,
    pub method: String,
    /// Wait for the wave's `http-response` instead of answering 202 at once.
    pub respond_wave: bool,
    pub timeout: Duration,
    pub auth: Option<Auth>,
    pub max_body: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Auth {
    /// `Authorization: Bearer <value of this variable>`.
    Bearer { secret: String },
    /// `X-Weir-Signature: sha256=<hex HMAC-SHA256 of the body>` with this variable's value.
    /// With `timestamp`, the request also carries `X-Weir-Timestamp: <Unix seconds>` within
    /// five minutes of the engine's clock, and the signature covers `<timestamp>.<body>`: a
    /// captured request cannot be replayed later.
    Hmac { secret: String, timestamp: bool },
}

#[derive(Debug, Clone)]
pub struct CronSpec {
    pub schedule: String,
    pub cron: croner::Cron,
    pub timezone: chrono_tz::Tz,
    /// After downtime, fire the last missed tick once.
    pub catch_up_last: bool,
    pub payload: Option<serde_json::Value>,
}

/// A source node of a loaded flow: where its events are journaled, and what drives it.
#[derive(Debug, Clone)]
pub struct Source {
    pub flow: String,
    pub node: String,
    pub trigger: Trigger,
}
