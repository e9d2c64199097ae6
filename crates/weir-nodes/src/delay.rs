//! `delay`: made of delayed items and guards, never of in-memory timers.
//!
//! - `each`: every message waits `for`.
//! - `restart` (debounce): each message writes a fresh guard value and schedules itself with
//!   that guard; an older item finds the guard changed and ends as superseded.
//! - `keep`: while one message waits, new ones are dropped. The node remembers "waiting until
//!   T" rather than "waiting", so a timer that is cancelled by hand cannot block it for ever.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use ulid::Ulid;
use weir_core::Message;
use weir_flow::Yaml;

use crate::duration::Dur;
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(rename = "for")]
    wait: Dur,
    #[serde(default)]
    mode: Mode,
    #[serde(default)]
    to: Wires,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Mode {
    #[default]
    Each,
    Restart,
    Keep,
}

pub const TIMER_KEY: &str = "timer";
const UNTIL_KEY: &str = "waiting_until";

pub struct Factory;

impl NodeFactory for Factory {
    fn kind(&self) -> &str {
        "delay"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: Config = config(y)?;
        let wait = c.wait.get().map_err(|e| vec![e])?;
        Ok(Built {
            node: Arc::new(Delay { wait, mode: c.mode }),
            ports: vec![c.to.0],
        })
    }
}

struct Delay {
    wait: Duration,
    mode: Mode,
}

#[async_trait::async_trait]
impl Node for Delay {
    fn stateful(&self) -> bool {
        self.mode != Mode::Each
    }

    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        match self.mode {
            Mode::Each => cx.schedule(self.wait, msg, None),
            Mode::Restart => {
                let guard = Value::String(Ulid::new().to_string());
                cx.set(TIMER_KEY, Some(guard.clone())).await?;
                cx.schedule(self.wait, msg, Some((TIMER_KEY.to_string(), guard)));
            }
            Mode::Keep => {
                let now = cx.now_ms();
                let until = cx.get(UNTIL_KEY).await?.and_then(|v| v.as_i64());
                if until.is_some_and(|t| t > now) {
                    tracing::debug!(
                        flow = cx.flow,
                        node = cx.node,
                        "delay (keep): one is waiting, message dropped"
                    );
                    return Ok(Emit::none());
                }
                let due = now + self.wait.as_millis() as i64;
                cx.set(UNTIL_KEY, Some(due.into())).await?;
                cx.schedule(self.wait, msg, None);
            }
        }
        Ok(Emit::none())
    }
}
