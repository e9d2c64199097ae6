//! `set`: change message fields without a script — `set:` literal values or `{{ expr }}`
//! templates at dotted paths, `delete:` paths, `copy:` (to: from).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;
use weir_core::Message;
use weir_flow::{Spanned, Yaml};

use crate::script::{self, delete_path, get_path, set_path, Template};
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    set: BTreeMap<String, Spanned<Value>>,
    #[serde(default)]
    delete: Vec<String>,
    #[serde(default)]
    copy: BTreeMap<String, String>,
    #[serde(default)]
    to: Wires,
}

enum SetValue {
    Literal(Value),
    Template(Template),
}

pub struct Factory;

impl NodeFactory for Factory {
    fn kind(&self) -> &str {
        "set"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: Config = config(y)?;
        if c.set.is_empty() && c.delete.is_empty() && c.copy.is_empty() {
            return Err(vec![ConfigError::at(
                y.pos,
                "a set node needs at least one of `set`, `delete` or `copy`",
            )]);
        }
        let mut errors = Vec::new();
        let mut sets = Vec::new();
        for (path, v) in c.set {
            match &v.value {
                Value::String(s) if s.contains("{{") => match Template::compile(s, v.pos) {
                    Ok(t) => sets.push((path, SetValue::Template(t))),
                    Err(e) => errors.push(e),
                },
                other => sets.push((path, SetValue::Literal(other.clone()))),
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Built {
            node: Arc::new(Set {
                sets,
                delete: c.delete,
                copy: c.copy.into_iter().collect(),
            }),
            ports: vec![c.to.0],
        })
    }
}

struct Set {
    sets: Vec<(String, SetValue)>,
    delete: Vec<String>,
    copy: Vec<(String, String)>,
}

#[async_trait::async_trait]
impl Node for Set {
    async fn call(&self, mut msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let original = msg.clone();
        for (to, from) in &self.copy {
            let v = get_path(&original, from).cloned().unwrap_or(Value::Null);
            set_path(&mut msg, to, v);
        }
        for (path, v) in &self.sets {
            let v = match v {
                SetValue::Literal(v) => v.clone(),
                SetValue::Template(t) => {
                    Value::String(script::running(cx, || t.render(&original))?)
                }
            };
            set_path(&mut msg, path, v);
        }
        for path in &self.delete {
            delete_path(&mut msg, path);
        }
        Ok(Emit::one(msg))
    }
}
