//! `log`: logs each message through tracing.

use std::sync::Arc;

use serde::Deserialize;
use weir_core::Message;
use weir_flow::Yaml;

use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    level: Level,
    #[serde(default)]
    to: Wires,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum Level {
    Debug,
    #[default]
    Info,
    Warn,
}

pub struct Factory;

impl NodeFactory for Factory {
    fn kind(&self) -> &str {
        "log"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: Config = config(y)?;
        Ok(Built {
            node: Arc::new(Log { level: c.level }),
            ports: vec![c.to.0],
        })
    }
}

struct Log {
    level: Level,
}

#[async_trait::async_trait]
impl Node for Log {
    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        self.log(&msg, cx);
        Ok(Emit::one(msg))
    }

    /// The message goes on only where it is wired.
    async fn call_borrowed(&self, msg: &Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        self.log(msg, cx);
        Ok(cx.pass_on(msg))
    }
}

impl Log {
    fn log(&self, msg: &Message, cx: &NodeCx<'_>) {
        let item = cx.item.id;
        match self.level {
            Level::Debug => tracing::debug!(flow = cx.flow, node = cx.node, %item, %msg, "log"),
            Level::Info => tracing::info!(flow = cx.flow, node = cx.node, %item, %msg, "log"),
            Level::Warn => tracing::warn!(flow = cx.flow, node = cx.node, %item, %msg, "log"),
        }
    }
}
