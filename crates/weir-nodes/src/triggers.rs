//! Source nodes: `webhook`, `cron`, `manual` (and `mqtt-in`, in mqtt.rs). They never run in a wave: a trigger journals
//! a cascade item at the source node, and the wave starts downstream of it. Their configs are
//! checked here so that a flow is validated as a whole.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use weir_core::Message;
use weir_flow::{Spanned, Yaml};

use crate::duration::Dur;
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};
pub use weir_triggers::spec::{Auth, CronSpec, MqttInSpec, Trigger, WebhookSpec};

/// A source node in a flow: it only carries its trigger, which the engine runs.
pub(crate) struct SourceNode(pub(crate) Trigger);

#[async_trait::async_trait]
impl Node for SourceNode {
    fn trigger(&self) -> Option<&Trigger> {
        Some(&self.0)
    }

    async fn call(&self, msg: Message, _cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        // Wired into from another node (allowed): pass the message on.
        Ok(Emit::one(msg))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WebhookConfig {
    path: Spanned<String>,
    #[serde(default = "post")]
    method: String,
    #[serde(default)]
    respond: Respond,
    timeout: Option<Dur>,
    auth: Option<AuthConfig>,
    /// Largest accepted body in bytes (default 1 MiB); larger ones get 413.
    #[serde(default = "mib")]
    max_body: usize,
    #[serde(default)]
    to: Wires,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Respond {
    #[default]
    Accepted,
    Wave,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthConfig {
    bearer_env: Option<Spanned<String>>,
    hmac_env: Option<Spanned<String>>,
    /// With `hmac_env`: a signed `X-Weir-Timestamp` within five minutes is required.
    #[serde(default)]
    timestamp: bool,
}

fn post() -> String {
    "POST".into()
}

fn mib() -> usize {
    1 << 20
}

pub struct WebhookFactory;

impl NodeFactory for WebhookFactory {
    fn kind(&self) -> &str {
        "webhook"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: WebhookConfig = config(y)?;
        let mut errors = Vec::new();
        let path = c.path.trim_matches('/').to_string();
        if path.is_empty()
            || !path
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_./".contains(ch))
        {
            errors.push(ConfigError::at(
                c.path.pos,
                "`path` is letters, digits and `-_./` (served at /hooks/<path>)",
            ));
        }
        let method = c.method.to_uppercase();
        if !["POST", "PUT", "PATCH", "GET", "DELETE"].contains(&method.as_str()) {
            let pos = y.get("method").map(|(_, v)| v.pos).unwrap_or(y.pos);
            errors.push(ConfigError::at(
                pos,
                format!("`{method}` is not a webhook method (POST, PUT, PATCH, GET, DELETE)"),
            ));
        }
        let timeout = match &c.timeout {
            Some(d) => d.get().map_err(|e| errors.push(e)).unwrap_or_default(),
            None => Duration::from_secs(30),
        };
        let secret =
            |s: &Spanned<String>, errors: &mut Vec<ConfigError>| match std::env::var(&s.value) {
                Ok(v) if !v.is_empty() => v,
                _ => {
                    errors.push(ConfigError::at(
                        s.pos,
                        format!("environment variable `{}` is not set", s.value),
                    ));
                    String::new()
                }
            };
        let auth = match &c.auth {
            None => None,
            Some(AuthConfig {
                bearer_env: Some(b),
                hmac_env: None,
                timestamp: false,
            }) => Some(Auth::Bearer {
                secret: secret(b, &mut errors),
            }),
            Some(AuthConfig {
                bearer_env: None,
                hmac_env: Some(h),
                timestamp,
            }) => Some(Auth::Hmac {
                secret: secret(h, &mut errors),
                timestamp: *timestamp,
            }),
            Some(_) => {
                let pos = y.get("auth").map(|(_, v)| v.pos).unwrap_or(y.pos);
                errors.push(ConfigError::at(
                    pos,
                    "`auth` takes exactly one of `bearer_env` or `hmac_env` (and `timestamp: \
                     true` only with `hmac_env`)",
                ));
                None
            }
        };
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Built {
            node: Arc::new(SourceNode(Trigger::Webhook(WebhookSpec {
                path,
                method,
                respond_wave: c.respond == Respond::Wave,
                timeout,
                auth,
                max_body: c.max_body,
            }))),
            ports: vec![c.to.0],
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CronConfig {
    /// 5 fields (minutes), 6 (seconds first) or 7 (and a year), as croner reads them.
    schedule: Spanned<String>,
    #[serde(default)]
    timezone: Option<Spanned<String>>,
    #[serde(default)]
    catch_up: CatchUp,
    #[serde(default)]
    payload: Option<serde_json::Value>,
    #[serde(default)]
    to: Wires,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum CatchUp {
    #[default]
    None,
    Last,
}

pub struct CronFactory;

impl NodeFactory for CronFactory {
    fn kind(&self) -> &str {
        "cron"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: CronConfig = config(y)?;
        let mut errors = Vec::new();
        let cron = c
            .schedule
            .parse::<croner::Cron>()
            .map_err(|e| {
                errors.push(ConfigError::at(
                    c.schedule.pos,
                    format!("bad cron expression `{}`: {e}", c.schedule.value),
                ))
            })
            .ok();
        let timezone = match &c.timezone {
            None => Some(chrono_tz::UTC),
            Some(tz) => tz
                .parse::<chrono_tz::Tz>()
                .map_err(|_| {
                    errors.push(ConfigError::at(
                        tz.pos,
                        format!(
                            "unknown time zone `{}` (use an IANA name such as Europe/Berlin)",
                            tz.value
                        ),
                    ))
                })
                .ok(),
        };
        match (cron, timezone) {
            (Some(cron), Some(timezone)) if errors.is_empty() => Ok(Built {
                node: Arc::new(SourceNode(Trigger::Cron(Box::new(CronSpec {
                    schedule: c.schedule.value.clone(),
                    cron,
                    timezone,
                    catch_up_last: c.catch_up == CatchUp::Last,
                    payload: c.payload,
                })))),
                ports: vec![c.to.0],
            }),
            _ => Err(errors),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ManualConfig {
    #[serde(default)]
    to: Wires,
}

pub struct ManualFactory;

impl NodeFactory for ManualFactory {
    fn kind(&self) -> &str {
        "manual"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: ManualConfig = config(y)?;
        Ok(Built {
            node: Arc::new(SourceNode(Trigger::Manual)),
            ports: vec![c.to.0],
        })
    }
}
