//! `function`: a Rhai script gets `msg` and returns a message, an array of messages (fan-out)
//! or `()` (drop). `state.get(k)` / `state.set(k, v)` reach the node's durable memory.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rhai::{Dynamic, Engine, Scope, AST};
use serde::Deserialize;
use serde_json::Value;
use weir_core::Message;
use weir_flow::{Spanned, Yaml};

use crate::script::{self, from_dynamic, run_error, to_dynamic};
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    /// The Rhai script.
    script: Spanned<String>,
    #[serde(default)]
    to: Wires,
}

/// The script's view of node memory, diffed after the run into state writes.
#[derive(Clone, Default)]
struct ScriptState(Arc<Mutex<Memory>>);

/// (committed values as read, writes the script made: `None` deletes).
type Memory = (BTreeMap<String, Value>, BTreeMap<String, Option<Value>>);

pub struct Factory;

impl NodeFactory for Factory {
    fn kind(&self) -> &str {
        "function"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: Config = config(y)?;
        let engine = engine();
        let style = y
            .get("script")
            .map(|(_, v)| match v.kind {
                weir_flow::YamlKind::Str(_, s) => s,
                _ => weir_flow::Style::Plain,
            })
            .unwrap_or(weir_flow::Style::Plain);
        let ast =
            script::compile(engine, &c.script, c.script.pos, style, false).map_err(|e| vec![e])?;
        // A script that ends by naming `msg` (most do) runs without that last statement, and
        // its message is then taken out of the scope: evaluating `msg` copied the whole
        // message, which the scope then dropped.
        let body = ends_with_msg(&c.script)
            .and_then(|n| script::compile(engine, &c.script[..n], c.script.pos, style, false).ok());
        let (ast, takes_msg) = match body {
            Some(body) => (body, true),
            None => (ast, false),
        };
        let uses_state = names(&c.script, "state");
        Ok(Built {
            node: Arc::new(Function {
                ast,
                takes_msg,
                uses_state,
            }),
            ports: vec![c.to.0],
        })
    }
}

/// The engine every function node runs its script on: weir's limits, and `state` reaching
/// the node's memory. One for all of them (see [`script::shared`]).
fn engine() -> &'static Engine {
    static ENGINE: std::sync::OnceLock<Engine> = std::sync::OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut engine = script::engine();
        engine
            .register_type_with_name::<ScriptState>("State")
            .register_fn("get", |s: &mut ScriptState, k: &str| -> Dynamic {
                let g = s.0.lock().unwrap_or_else(|p| p.into_inner());
                match g.1.get(k) {
                    Some(Some(v)) => to_dynamic(v),
                    Some(None) => Dynamic::UNIT,
                    None => g.0.get(k).map(to_dynamic).unwrap_or(Dynamic::UNIT),
                }
            })
            .register_fn(
                "set",
                |s: &mut ScriptState,
                 k: &str,
                 v: Dynamic|
                 -> Result<(), Box<rhai::EvalAltResult>> {
                    // `()` deletes the key; a value JSON cannot hold is an error, never a
                    // deletion by surprise.
                    let v = from_dynamic(&v).map_err(|e| {
                        format!("state.set(\"{k}\", …): the value cannot be kept: {e}")
                    })?;
                    s.0.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .1
                        .insert(k.to_string(), Some(v).filter(|v| !v.is_null()));
                    Ok(())
                },
            );
        engine
    })
}

struct Function {
    /// The script, or all of it but its last statement `msg` when `takes_msg`.
    ast: AST,
    /// The result is `msg` as the script left it in the scope (see [`ends_with_msg`]).
    takes_msg: bool,
    uses_state: bool,
}

#[async_trait::async_trait]
impl Node for Function {
    fn stateful(&self) -> bool {
        self.uses_state
    }

    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        self.call_borrowed(&msg, cx).await
    }

    /// A script reads its input (as a copy in its own values) and returns new messages.
    async fn call_borrowed(&self, msg: &Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let mut scope = Scope::new();
        scope.push("msg", to_dynamic(msg));
        // A script that never names `state` cannot reach it: it gets none to carry.
        let state = match self.uses_state {
            true => {
                let state = ScriptState::default();
                state.0.lock().unwrap_or_else(|p| p.into_inner()).0 = cx.get_all().await?;
                scope.push("state", state.clone());
                Some(state)
            }
            false => None,
        };
        let out = script::running(cx, || {
            engine().eval_ast_with_scope::<Dynamic>(&mut scope, &self.ast)
        })
        .map_err(run_error)?;
        let out = match self.takes_msg {
            // The last `msg` of the scope is the one the dropped statement would have read.
            true => scope.remove::<Dynamic>("msg").unwrap_or(Dynamic::UNIT),
            false => out,
        };
        if let Some(state) = state {
            let writes = std::mem::take(&mut state.0.lock().unwrap_or_else(|p| p.into_inner()).1);
            for (k, v) in writes {
                cx.set(&k, v).await?;
            }
        }
        if out.is_unit() {
            return Ok(Emit::none());
        }
        match from_dynamic(&out)? {
            Value::Array(items) => {
                for m in &items {
                    check_message(m)?;
                }
                Ok(Emit::many(items))
            }
            m => {
                check_message(&m)?;
                Ok(Emit::one(m))
            }
        }
    }
}

/// Whether `script` names `word` as a whole word anywhere (in code, a string or a comment).
/// A script reaches its node's memory as `state.get(k)`, as `get(state, k)`, or through a
/// variable it assigns `state` to: all of them name it, and a script that names it only in
/// a comment is taken as stateful too, which costs it only running one call at a time.
fn names(script: &str, word: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    script.match_indices(word).any(|(at, _)| {
        !script[..at].chars().next_back().is_some_and(ident)
            && !script[at + word.len()..].chars().next().is_some_and(ident)
    })
}

/// Where the script's last statement, a bare `msg`, starts, when its result is `msg`
/// whichever way it runs: it names neither `return` nor `exit` (either would end it with
/// another value), nor `eval` or `Fn` (either can reach `exit` by a name the script builds),
/// and the `msg` follows a `;` or a block's `}` (so it is a statement of its own, not the end
/// of an expression). The text before it must compile on its own too, or the script runs
/// whole.
fn ends_with_msg(script: &str) -> Option<usize> {
    if ["return", "exit", "eval", "Fn"]
        .iter()
        .any(|w| names(script, w))
    {
        return None;
    }
    let rest = script.trim_end();
    let rest = rest.strip_suffix(';').unwrap_or(rest).trim_end();
    let before = rest.strip_suffix("msg")?;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    if before.chars().next_back().is_some_and(ident) {
        return None;
    }
    matches!(before.trim_end().chars().next_back(), Some(';' | '}')).then_some(before.len())
}

fn check_message(m: &Value) -> Result<(), NodeError> {
    if m.is_object() {
        Ok(())
    } else {
        Err(NodeError::Permanent(format!(
            "a script returns a message (a map such as #{{payload: 1}}), an array of them or (); it returned {m}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::{ends_with_msg, names};

    #[test]
    fn a_script_ending_in_msg_is_run_without_it_only_where_that_cannot_change_its_result() {
        for (script, body) in [
            ("msg.payload.n += 1;\nmsg", "msg.payload.n += 1;\n"),
            ("msg.a = 1; msg;\n", "msg.a = 1; "),
            (
                "if msg.a > 1 { msg.b = 2 }\nmsg\n",
                "if msg.a > 1 { msg.b = 2 }\n",
            ),
            (
                "let msg = #{ payload: 1 };msg",
                "let msg = #{ payload: 1 };",
            ),
        ] {
            assert_eq!(ends_with_msg(script), Some(body.len()), "{script:?}");
            assert_eq!(&script[..body.len()], body);
        }
        for whole in [
            "msg",
            "  msg  ",
            "msg.payload = 1",
            "msg.a = 1; mymsg",
            "msg.a = 1; this.msg",
            "msg.a = 1 + msg",
            "msg.a = 1; msg // passed on",
            "if msg.a > 1 { return (); } msg",
            "if msg.a > 1 { exit(()); } msg",
            "fn f(x) { return x; } msg.a = f(1); msg",
            "let f = Fn(\"ex\" + \"it\"); f.call(()); msg",
            "eval(\"ex\" + \"it(())\"); msg",
        ] {
            assert_eq!(ends_with_msg(whole), None, "{whole:?}");
        }
    }

    #[test]
    fn a_script_names_state_as_a_whole_word() {
        for yes in [
            "state.get(\"n\")",
            "get(state, \"n\")",
            "let s = state; s.set(\"n\", 1)",
            "msg // keeps no state",
            "(state)",
        ] {
            assert!(names(yes, "state"), "{yes}");
        }
        for no in [
            "msg",
            "msg.payload.statement = 1; msg",
            "let my_state = 1; msg",
            "restate",
        ] {
            assert!(!names(no, "state"), "{no}");
        }
    }
}
