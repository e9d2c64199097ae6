//! Embedding weir with a node type of your own.
//!
//! `cargo run -p weir --example custom_node`, then
//! `curl -XPOST localhost:8081/hooks/shout -H 'content-type: application/json' -d '"hello"'`.

use std::sync::Arc;

use serde::Deserialize;
use weir::{config, Built, ConfigError, Emit, Engine, Node, NodeCx, NodeError, NodeFactory, Wires};

/// `type: shout` — upper-cases a text payload, `times` exclamation marks after it.
struct ShoutFactory;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ShoutConfig {
    #[serde(default = "one")]
    times: usize,
    #[serde(default)]
    to: Wires,
}

fn one() -> usize {
    1
}

struct Shout {
    times: usize,
}

impl NodeFactory for ShoutFactory {
    fn kind(&self) -> &str {
        "shout"
    }

    fn build(&self, y: &weir::flow::Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: ShoutConfig = config(y)?;
        if c.times > 10 {
            return Err(vec![ConfigError::at(y.pos, "`times` is at most 10")]);
        }
        Ok(Built {
            node: Arc::new(Shout { times: c.times }),
            ports: vec![c.to.0],
        })
    }
}

#[async_trait::async_trait]
impl Node for Shout {
    async fn call(&self, mut msg: weir::Message, _cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let text = msg["payload"]
            .as_str()
            .ok_or_else(|| NodeError::Permanent("shout needs a text payload".into()))?;
        msg["payload"] = format!("{}{}", text.to_uppercase(), "!".repeat(self.times)).into();
        Ok(Emit::one(msg))
    }
}

const FLOW: &str = r#"
id: shout
nodes:
  in: { type: webhook, path: shout, respond: wave, to: [loud] }
  loud: { type: shout, times: 3, to: [answer] }
  answer: { type: http-response }
"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let engine = Engine::builder()
        .node(ShoutFactory)
        .flow_str("shout.yaml", FLOW)
        .http("127.0.0.1:8081".parse()?)
        .build()?;
    engine
        .run(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await?;
    Ok(())
}
