//! MQTT nodes: `mqtt-out`, which publishes through the engine's
//! [`MqttHub`], and the config of the `mqtt-in` source (whose
//! subscriptions weir-triggers runs).

use std::sync::Arc;

use rumqttc::QoS;
use serde::Deserialize;
use serde_json::Value;
use weir_core::Message;
use weir_flow::{Spanned, Yaml};
use weir_triggers::mqtt::{qos, MqttHub, PublishError};
use weir_triggers::spec::{MqttInSpec, Trigger};

use crate::script::{self, Template};
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

impl From<PublishError> for NodeError {
    fn from(e: PublishError) -> Self {
        match e {
            PublishError::Permanent(m) => NodeError::permanent(m),
            PublishError::Transient(m) => NodeError::transient(m),
        }
    }
}

// ---- mqtt-out ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutConfig {
    /// The topic; `{{ expr }}` parts are evaluated per message. Default: `msg.topic`.
    topic: Option<Spanned<String>>,
    /// 0, 1 (default) or 2.
    #[serde(default = "one")]
    qos: Spanned<u8>,
    #[serde(default)]
    retain: bool,
    /// A fixed payload instead of `msg.payload`.
    payload: Option<Value>,
    /// A broker the engine names (`--mqtt-broker NAME=URL`) instead of the default one.
    broker: Option<Spanned<String>>,
    #[serde(default)]
    to: Wires,
}

/// A node's `broker: NAME`, checked against the brokers the engine was given.
fn broker_name(
    hub: &MqttHub,
    b: &Option<Spanned<String>>,
    errors: &mut Vec<ConfigError>,
) -> Option<String> {
    let b = b.as_ref()?;
    if let Err(e) = hub.knows(&b.value) {
        errors.push(ConfigError::at(b.pos, e));
    }
    Some(b.value.clone())
}

/// A node's `qos`, or an error at it.
fn qos_at(q: &Spanned<u8>, errors: &mut Vec<ConfigError>) -> QoS {
    qos(q.value).unwrap_or_else(|| {
        errors.push(ConfigError::at(q.pos, "`qos` is 0, 1 or 2"));
        QoS::AtLeastOnce
    })
}

fn one() -> Spanned<u8> {
    Spanned {
        pos: Default::default(),
        value: 1,
    }
}

pub struct OutFactory(pub Arc<MqttHub>);

impl NodeFactory for OutFactory {
    fn kind(&self) -> &str {
        "mqtt-out"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: OutConfig = config(y)?;
        let mut errors = Vec::new();
        let topic = match &c.topic {
            Some(t) => {
                let tpl = Template::compile(t, t.pos).map_err(|e| errors.push(e)).ok();
                if let Some(tp) = &tpl {
                    if tp.is_literal() && !rumqttc::valid_topic(&t.value) {
                        errors.push(ConfigError::at(
                            t.pos,
                            format!(
                                "`{}` is not a topic one can publish to (no `+` or `#`)",
                                t.value
                            ),
                        ));
                    }
                }
                tpl
            }
            None => None,
        };
        let q = qos_at(&c.qos, &mut errors);
        let broker = broker_name(&self.0, &c.broker, &mut errors);
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Built {
            node: Arc::new(Out {
                hub: self.0.clone(),
                broker,
                topic,
                qos: q,
                retain: c.retain,
                payload: c.payload,
            }),
            ports: vec![c.to.0],
        })
    }
}

struct Out {
    hub: Arc<MqttHub>,
    broker: Option<String>,
    topic: Option<Template>,
    qos: QoS,
    retain: bool,
    payload: Option<Value>,
}

/// What goes on the wire: a string as it is, anything else as JSON.
pub fn payload_bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::String(s) => s.clone().into_bytes(),
        other => serde_json::to_vec(other).unwrap_or_default(),
    }
}

#[async_trait::async_trait]
impl Node for Out {
    fn side_effect(&self) -> bool {
        true
    }

    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let topic = match &self.topic {
            Some(t) => script::running(cx, || t.render(&msg))?,
            None => match msg.get("topic") {
                Some(Value::String(t)) => t.clone(),
                _ => {
                    return Err(NodeError::permanent(
                        "mqtt-out has no `topic` and the message has no `msg.topic`",
                    ))
                }
            },
        };
        let payload = payload_bytes(
            self.payload
                .as_ref()
                .or_else(|| msg.get("payload"))
                .unwrap_or(&Value::Null),
        );
        self.hub
            .publish(
                self.broker.as_deref(),
                &topic,
                self.qos,
                self.retain,
                payload,
            )
            .await?;
        Ok(Emit::one(msg))
    }
}

// ---- mqtt-in ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InConfig {
    /// A topic filter: `+` one level, `#` the rest.
    topic: Spanned<String>,
    #[serde(default = "one")]
    qos: Spanned<u8>,
    /// A broker the engine names (`--mqtt-broker NAME=URL`) instead of the default one.
    broker: Option<Spanned<String>>,
    #[serde(default)]
    to: Wires,
}

pub struct InFactory(pub Arc<MqttHub>);

impl NodeFactory for InFactory {
    fn kind(&self) -> &str {
        "mqtt-in"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: InConfig = config(y)?;
        let mut errors = Vec::new();
        if c.topic.is_empty() || !rumqttc::valid_filter(&c.topic) || c.topic.starts_with("$share/")
        {
            errors.push(ConfigError::at(
                c.topic.pos,
                format!(
                    "`{}` is not a topic filter (levels split by `/`, `+` for one level, `#` last for the rest)",
                    c.topic.value
                ),
            ));
        }
        let q = qos_at(&c.qos, &mut errors);
        let broker = broker_name(&self.0, &c.broker, &mut errors);
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Built {
            node: Arc::new(crate::triggers::SourceNode(Trigger::Mqtt(MqttInSpec {
                filter: c.topic.value,
                qos: q,
                broker,
            }))),
            ports: vec![c.to.0],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_is_published_as_its_text_or_its_json() {
        assert_eq!(payload_bytes(&Value::String("x".into())), b"x");
        assert_eq!(payload_bytes(&serde_json::json!({"a": 1})), br#"{"a":1}"#);
    }
}
