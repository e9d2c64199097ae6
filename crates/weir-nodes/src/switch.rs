//! `switch`: Rhai conditions over `msg`; the first rule that matches (or, with
//! `match: all`, every one) routes the message to that rule's `to:`, `else:` otherwise.

use std::sync::Arc;

use rhai::AST;
use serde::Deserialize;
use weir_core::Message;
use weir_flow::{Spanned, Yaml};

use crate::script;
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    rules: Vec<Rule>,
    #[serde(default, rename = "else")]
    otherwise: Wires,
    #[serde(default, rename = "match")]
    mode: Mode,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Mode {
    #[default]
    First,
    All,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    #[serde(rename = "if")]
    cond: Spanned<String>,
    #[serde(default)]
    to: Wires,
}

pub struct Factory;

impl NodeFactory for Factory {
    fn kind(&self) -> &str {
        "switch"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: Config = config(y)?;
        let engine = script::shared();
        let mut errors = Vec::new();
        let mut conds = Vec::new();
        let mut ports = Vec::new();
        for r in c.rules {
            match script::compile(engine, &r.cond, r.cond.pos, weir_flow::Style::Plain, true) {
                Ok(ast) => conds.push(ast),
                Err(e) => errors.push(e),
            }
            ports.push(r.to.0);
        }
        ports.push(c.otherwise.0);
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Built {
            node: Arc::new(Switch {
                all: c.mode == Mode::All,
                conds,
            }),
            ports,
        })
    }
}

struct Switch {
    all: bool,
    conds: Vec<AST>,
}

#[async_trait::async_trait]
impl Node for Switch {
    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let mut ports = vec![Vec::new(); self.conds.len() + 1];
        let mut matched = false;
        for (i, ast) in self.conds.iter().enumerate() {
            let v = script::running(cx, || script::eval(ast, &msg))?;
            let hit = v.as_bool().map_err(|t| {
                NodeError::Permanent(format!("switch rule {} gave {t}, not true or false", i + 1))
            })?;
            if hit {
                ports[i].push(msg.clone());
                matched = true;
                if !self.all {
                    break;
                }
            }
        }
        if !matched {
            ports[self.conds.len()].push(msg);
        }
        Ok(Emit(ports))
    }
}
