//! Rhai for scripts, conditions and `{{ expr }}` templates: compiled once at load, run with
//! limits so a runaway script fails its one message, never the engine.

use std::cell::RefCell;
use std::time::Instant;

use rhai::{Dynamic, Engine, Scope, AST};
use serde_json::Value;
use ulid::Ulid as ItemId;
use weir_flow::{Pos, Style};

use crate::{ConfigError, NodeCx, NodeError};

/// Operations a script may run for one message before it is stopped.
pub const MAX_OPERATIONS: u64 = 1_000_000;

/// Rhai's standard library, built once and shared by every engine: building it per engine
/// (one per node) cost each node's engine its own copy of hundreds of function entries.
fn standard_library() -> rhai::Shared<rhai::Module> {
    use rhai::packages::{Package, StandardPackage};
    static STD: std::sync::OnceLock<rhai::Shared<rhai::Module>> = std::sync::OnceLock::new();
    STD.get_or_init(|| StandardPackage::new().as_shared_module())
        .clone()
}

/// The engine every node's templates, conditions and `per` expressions run on: one for all
/// of them, since none registers anything of its own. An engine per node cost each node its
/// own copy of the engine's tables (a 1,000-flow engine idled 3.3 MiB higher).
pub fn shared() -> &'static Engine {
    static SHARED: std::sync::OnceLock<Engine> = std::sync::OnceLock::new();
    SHARED.get_or_init(engine)
}

/// Why a script was stopped by [`engine`]'s progress check.
const PAST_DEADLINE: &str = "past the node's timeout";

/// An engine with weir's limits: the standard library without what blocks (`sleep`) or
/// compiles code at run time (`eval`), no module resolver (a script cannot `import` a file),
/// a wall-clock bound (the node's timeout), and `print` and `debug` into the engine's log
/// with their control characters escaped.
pub fn engine() -> Engine {
    let mut e = Engine::new_raw();
    e.register_global_module(standard_library());
    // The engine's own functions are found before the library's: these take the place of
    // Rhai's `sleep`, which blocks the thread of the runtime the script runs on.
    let no_sleep = || -> Result<(), Box<rhai::EvalAltResult>> {
        Err(
            "sleep() is not available to scripts: they may not block the engine \
             (wait with a `delay` node)"
                .into(),
        )
    };
    e.register_fn("sleep", move |_: rhai::INT| no_sleep());
    e.register_fn("sleep", move |_: rhai::FLOAT| no_sleep());
    e.disable_symbol("eval");
    e.on_progress(|ops| {
        // Often enough that a script stops soon after its deadline, rarely enough that
        // reading the clock costs nothing next to the operations between two reads.
        if ops % 4096 != 0 {
            return None;
        }
        let past = RUNNING.with(|r| r.borrow().deadline.is_some_and(|d| Instant::now() >= d));
        past.then(|| Dynamic::from(PAST_DEADLINE))
    });
    e.on_print(|text| {
        let text = weir_core::redact::controls(text);
        RUNNING.with(|r| match &*r.borrow() {
            Running {
                flow,
                node,
                item: Some(item),
                ..
            } => {
                tracing::info!(target: "weir::script", flow = %flow, node = %node, %item, "{text}")
            }
            _ => tracing::info!(target: "weir::script", "{text}"),
        })
    });
    e.on_debug(|text, source, pos| {
        let text = weir_core::redact::controls(text);
        RUNNING.with(|r| match &*r.borrow() {
            Running { flow, node, item: Some(item), .. } => {
                tracing::debug!(target: "weir::script", flow = %flow, node = %node, %item, %pos, "{text}")
            }
            _ => tracing::debug!(target: "weir::script", source = source.unwrap_or(""), %pos, "{text}"),
        })
    });
    e.set_max_operations(MAX_OPERATIONS);
    e.set_max_call_levels(64);
    e.set_max_expr_depths(128, 64);
    e.set_max_string_size(4 << 20);
    e.set_max_array_size(100_000);
    e.set_max_map_size(100_000);
    e
}

/// Whose script runs on this thread now: what its `print` and `debug` lines name. Scripts
/// run synchronously, so the thread that starts one is the thread it prints on.
#[derive(Default)]
struct Running {
    flow: String,
    node: String,
    item: Option<ItemId>,
    /// When the node's call times out: a script still running then is stopped.
    deadline: Option<Instant>,
}

thread_local! {
    static RUNNING: RefCell<Running> = RefCell::new(Running::default());
}

/// Run `f`, which evaluates scripts of `cx`'s node, so that their `print` lines name the
/// flow, the node and the item. (The wave's span is at debug level: it costs too much at
/// info to make for every wave.)
pub fn running<T>(cx: &NodeCx<'_>, f: impl FnOnce() -> T) -> T {
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            RUNNING.with(|r| {
                let mut r = r.borrow_mut();
                r.item = None;
                r.deadline = None;
            });
        }
    }
    RUNNING.with(|r| {
        let mut r = r.borrow_mut();
        r.flow.clear();
        r.flow.push_str(cx.flow);
        r.node.clear();
        r.node.push_str(cx.node);
        r.item = Some(cx.item.id);
        // The clock is read only where a script runs, not for every node call.
        r.deadline = cx.timeout().map(|t| Instant::now() + t);
    });
    let _done = Done;
    f()
}

/// Where a script's own line:column lands in the flow file.
pub fn file_pos(at: Pos, style: Style, err: &rhai::ParseError) -> Pos {
    let p = err.position();
    let line = p.line().unwrap_or(1);
    let col = p.position().unwrap_or(1);
    match style {
        // A block scalar's span starts at its first line of text, after the indentation.
        Style::Block => Pos {
            line: at.line + line - 1,
            col: at.col + col - 1,
        },
        Style::Quoted if line == 1 => Pos {
            line: at.line,
            col: at.col + col,
        },
        _ if line == 1 => Pos {
            line: at.line,
            col: at.col + col - 1,
        },
        _ => Pos {
            line: at.line + line - 1,
            col,
        },
    }
}

pub fn compile(
    engine: &Engine,
    src: &str,
    at: Pos,
    style: Style,
    expression: bool,
) -> Result<AST, ConfigError> {
    let r = if expression {
        engine.compile_expression(src)
    } else {
        engine.compile(src)
    };
    r.map_err(|e| {
        let what = if expression { "condition" } else { "script" };
        ConfigError::at(
            file_pos(at, style, &e),
            format!("{what} does not compile: {}", e.0),
        )
    })
}

/// A message's JSON as a script's value: null is `()`, an integer that fits `i64` an
/// integer and any other number a float, an object a map. What `rhai::serde::to_dynamic`
/// makes of it, built directly (it runs for every message a script sees): through serde it
/// cost more calls and copies. Maps are filled by insertion, not collected: a collected
/// `BTreeMap` is sorted in a buffer first, which costs more than inserting a message's few
/// keys, already in order.
pub fn to_dynamic(v: &Value) -> Dynamic {
    match v {
        Value::Null => Dynamic::UNIT,
        Value::Bool(b) => Dynamic::from_bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Dynamic::from_int(i),
            // A u64 past i64::MAX, or a float.
            None => Dynamic::from_float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Dynamic::from(rhai::ImmutableString::from(s.as_str())),
        Value::Array(a) => Dynamic::from_array(a.iter().map(to_dynamic).collect()),
        Value::Object(o) => {
            let mut m = rhai::Map::new();
            for (k, v) in o {
                m.insert(k.as_str().into(), to_dynamic(v));
            }
            Dynamic::from_map(m)
        }
    }
}

/// A script's value as JSON, as `rhai::serde::from_dynamic` makes it (a char is a string, a
/// float that is not finite is null), built directly for the values JSON has. Anything else
/// in it (a blob, a timestamp, a function pointer, a value shared with a closure, a Rust
/// type) sends the whole value through serde, so its result or its error is serde's.
pub fn from_dynamic(d: &Dynamic) -> Result<Value, NodeError> {
    match json_of(d) {
        Some(v) => Ok(v),
        None => rhai::serde::from_dynamic::<Value>(d).map_err(|e| {
            NodeError::Permanent(format!("script returned a value that is not JSON: {e}"))
        }),
    }
}

/// [`from_dynamic`]'s direct way, or `None` where the value holds anything but JSON's kinds.
/// Each kind is asked with `is_*` before it is read: a failed `as_*` names the type it found,
/// which costs more than the whole conversion of a small value.
fn json_of(d: &Dynamic) -> Option<Value> {
    if d.is_shared() {
        None
    } else if d.is_unit() {
        Some(Value::Null)
    } else if d.is_string() {
        let s = d.as_immutable_string_ref().ok()?;
        Some(Value::String(s.as_str().to_owned()))
    } else if d.is_map() {
        let m = d.as_map_ref().ok()?;
        let mut o = serde_json::Map::new();
        for (k, v) in m.iter() {
            o.insert(k.as_str().to_owned(), json_of(v)?);
        }
        Some(Value::Object(o))
    } else if d.is_int() {
        Some(Value::from(d.as_int().ok()?))
    } else if d.is_float() {
        let f = d.as_float().ok()?;
        Some(serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number))
    } else if d.is_bool() {
        Some(Value::Bool(d.as_bool().ok()?))
    } else if d.is_array() {
        let a = d.as_array_ref().ok()?;
        let mut out = Vec::with_capacity(a.len());
        for v in a.iter() {
            out.push(json_of(v)?);
        }
        Some(Value::Array(out))
    } else if d.is_char() {
        Some(Value::String(d.as_char().ok()?.to_string()))
    } else {
        None
    }
}

/// Turn a script failure into the node error it means for the message.
#[allow(clippy::boxed_local)] // rhai hands its errors over boxed
pub fn run_error(e: Box<rhai::EvalAltResult>) -> NodeError {
    use rhai::EvalAltResult as E;
    match *e {
        E::ErrorRuntime(v, pos) => {
            let m = if v.is_string() {
                v.into_string().unwrap_or_default()
            } else {
                v.to_string()
            };
            NodeError::Permanent(format!("script threw at {pos}: {m}"))
        }
        E::ErrorTooManyOperations(pos) => NodeError::Permanent(format!(
            "script stopped at {pos}: more than {MAX_OPERATIONS} operations (a runaway loop?)"
        )),
        E::ErrorTerminated(_, pos) => NodeError::Permanent(format!(
            "script stopped at {pos}: still running {PAST_DEADLINE}"
        )),
        other => NodeError::Permanent(format!("script failed: {other}")),
    }
}

/// Evaluate a compiled expression with `msg` in scope, on the [`shared`] engine.
pub fn eval(ast: &AST, msg: &Value) -> Result<Dynamic, NodeError> {
    let mut scope = Scope::new();
    scope.push("msg", to_dynamic(msg));
    shared()
        .eval_ast_with_scope::<Dynamic>(&mut scope, ast)
        .map_err(run_error)
}

/// A string with `{{ expr }}` parts, compiled and rendered on the [`shared`] engine.
#[derive(Clone)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Clone)]
enum Part {
    Lit(String),
    Expr(AST),
}

impl Template {
    pub fn compile(src: &str, at: Pos) -> Result<Template, ConfigError> {
        let mut parts = Vec::new();
        let mut rest = src;
        let mut offset = 0;
        while let Some(start) = rest.find("{{") {
            if start > 0 {
                parts.push(Part::Lit(rest[..start].to_string()));
            }
            let Some(len) = rest[start..].find("}}") else {
                return Err(ConfigError::at(at, "`{{` without a closing `}}`"));
            };
            let expr = &rest[start + 2..start + len];
            let ast = shared().compile_expression(expr.trim()).map_err(|e| {
                ConfigError::at(
                    Pos {
                        line: at.line,
                        col: at.col + offset + start + 2,
                    },
                    format!("`{{{{ {} }}}}` does not compile: {}", expr.trim(), e.0),
                )
            })?;
            parts.push(Part::Expr(ast));
            offset += start + len + 2;
            rest = &rest[start + len + 2..];
        }
        if !rest.is_empty() {
            parts.push(Part::Lit(rest.to_string()));
        }
        Ok(Template { parts })
    }

    pub fn is_literal(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Lit(_)))
    }

    pub fn render(&self, msg: &Value) -> Result<String, NodeError> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Lit(s) => out.push_str(s),
                Part::Expr(ast) => {
                    let d = eval(ast, msg)?;
                    if d.is_string() {
                        out.push_str(&d.into_string().unwrap_or_default());
                    } else {
                        match from_dynamic(&d)? {
                            Value::Null => {}
                            v => out.push_str(&v.to_string()),
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// `payload.size` → the value at that dotted path of a message.
pub fn get_path<'a>(msg: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(msg, |v, k| v.get(k))
}

/// Set a dotted path, making objects on the way.
pub fn set_path(msg: &mut Value, path: &str, value: Value) {
    let mut cur = msg;
    let mut keys = path.split('.').peekable();
    while let Some(k) = keys.next() {
        if !cur.is_object() {
            *cur = Value::Object(Default::default());
        }
        let obj = cur.as_object_mut().expect("made an object above");
        if keys.peek().is_none() {
            obj.insert(k.to_string(), value);
            return;
        }
        cur = obj.entry(k.to_string()).or_insert(Value::Null);
    }
}

pub fn delete_path(msg: &mut Value, path: &str) {
    let (parent, last) = match path.rsplit_once('.') {
        Some((p, l)) => (p, l),
        None => ("", path),
    };
    let target = if parent.is_empty() {
        Some(msg)
    } else {
        parent.split('.').try_fold(msg, |v, k| v.get_mut(k))
    };
    if let Some(Value::Object(o)) = target {
        o.remove(last);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    fn run_script(src: &str) -> Result<rhai::Dynamic, super::NodeError> {
        let e = super::engine();
        let ast = e
            .compile(src)
            .map_err(|e| super::NodeError::Permanent(e.to_string()))?;
        e.eval_ast::<rhai::Dynamic>(&ast).map_err(super::run_error)
    }

    #[test]
    fn a_script_cannot_sleep_and_fails_its_message_at_once() {
        for src in ["sleep(12); 1", "sleep(1e300); 1", "sleep(-1); 1"] {
            let t = Instant::now();
            let e = run_script(src).unwrap_err().to_string();
            assert!(e.contains("sleep() is not available"), "{src}: {e}");
            assert!(t.elapsed() < Duration::from_secs(1), "{src}");
        }
    }

    #[test]
    fn eval_is_off() {
        let e = run_script("eval(\"40 + 2\")").unwrap_err().to_string();
        assert!(e.contains("eval"), "{e}");
    }

    #[test]
    fn a_script_running_past_its_nodes_timeout_is_stopped() {
        super::RUNNING.with(|r| r.borrow_mut().deadline = Some(Instant::now()));
        let e = run_script("let n = 0; loop { n += 1; }");
        super::RUNNING.with(|r| r.borrow_mut().deadline = None);
        let e = e.unwrap_err().to_string();
        assert!(e.contains("past the node's timeout"), "{e}");
        // Without a deadline the same script is stopped by its operation count.
        let e = run_script("let n = 0; loop { n += 1; }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("operations"), "{e}");
    }

    use super::*;
    use serde_json::json;

    /// Run `src` as a script against `{}` and give the failure's reason.
    fn fails_with(src: &str) -> String {
        let ast = shared().compile(src).expect("compiles");
        match eval(&ast, &json!({})) {
            Err(NodeError::Permanent(reason)) => reason,
            other => panic!("{src}: expected a permanent failure, got {other:?}"),
        }
    }

    #[test]
    fn every_sandbox_limit_fails_the_message_and_says_which() {
        assert!(fails_with("loop {}").contains("operations"));
        let s = fails_with(r#"let s = "x"; loop { s += s; }"#);
        assert!(s.to_lowercase().contains("string"), "{s}");
        let a = fails_with("let a = []; loop { a += [1, 2, 3, 4, 5, 6, 7, 8]; a += a; }");
        assert!(a.to_lowercase().contains("array"), "{a}");
        let d = fails_with("fn f(n) { f(n + 1) } f(0)");
        assert!(
            d.to_lowercase().contains("stack") || d.contains("call"),
            "{d}"
        );
        // No way out of the sandbox: there is no file, process or network function.
        let f = fails_with(r#"open("/etc/passwd")"#);
        assert!(f.contains("not found"), "{f}");
        let i = fails_with(r#"import "/etc/passwd" as p; 1"#);
        assert!(i.to_lowercase().contains("module"), "{i}");
    }

    /// The direct conversions give what rhai's serde gives, value for value, both ways; what
    /// JSON has no kind for fails as it does through serde.
    #[test]
    fn messages_convert_as_serde_converts_them() {
        let values = [
            json!(null),
            json!(true),
            json!(0),
            json!(-7),
            json!(i64::MAX),
            json!(i64::MIN),
            json!(u64::MAX),
            json!(21.5),
            json!(-0.0),
            json!(1e300),
            json!(""),
            json!("kitchen ünïcode and a string longer than twenty-three bytes"),
            json!([]),
            json!([1, "two", 3.5, null, [false], {"k": {}}]),
            json!({}),
            json!({"payload": {"temperature": 21.5, "room": "kitchen", "tags": ["a", 1]}, "topic": "t"}),
        ];
        for v in &values {
            let ours = to_dynamic(v);
            let serde = rhai::serde::to_dynamic(v).unwrap();
            assert_eq!(format!("{ours:?}"), format!("{serde:?}"), "to_dynamic({v})");
            assert_eq!(ours.type_name(), serde.type_name(), "to_dynamic({v})");
            // Back as serde brings it back (u64::MAX became a float both ways).
            let back = rhai::serde::from_dynamic::<Value>(&serde).unwrap();
            assert_eq!(from_dynamic(&ours).unwrap(), back, "back from {ours:?}");
        }
        // Values only a script makes: each gives serde's JSON, or fails where serde fails.
        let e = engine();
        let scripts = [
            "'c'",
            "1.0 / 0.0",
            "0.0 / 0.0",
            "[1, 'x', #{a: ()}]",
            "#{a: 'b', n: [1.5, 2]}",
            "blob(3)",
            "timestamp()",
            "Fn(\"f\")",
            "let x = 1; let f = || x; x",
            "let m = #{a: 1}; let f = || m; [m, 2]",
            "[1, blob(1)]",
            "#{t: timestamp()}",
        ];
        let made = scripts.map(|src| (src, e.eval::<Dynamic>(src).expect(src)));
        // A value shared with a closure (a script's own result comes out unshared).
        let shared = ("a shared value", Dynamic::from_int(1).into_shared());
        for (src, d) in made.into_iter().chain([shared]) {
            let serde = rhai::serde::from_dynamic::<Value>(&d);
            match (from_dynamic(&d), serde) {
                (Ok(ours), Ok(theirs)) => assert_eq!(ours, theirs, "{src}"),
                (Err(NodeError::Permanent(m)), Err(_)) => assert!(m.contains("not JSON"), "{m}"),
                (ours, theirs) => panic!("{src}: ours {ours:?}, serde's {theirs:?}"),
            }
        }
    }

    #[test]
    fn templates_render_expressions() {
        let t =
            Template::compile("alerts/{{ msg.payload.room }}/{{ 1 + 1 }}", Pos::default()).unwrap();
        let out = t.render(&json!({"payload": {"room": "kitchen"}})).unwrap();
        assert_eq!(out, "alerts/kitchen/2");
    }

    #[test]
    fn paths() {
        let mut m = json!({"payload": {"a": 1, "secret": 2}});
        set_path(&mut m, "payload.b.c", json!(3));
        delete_path(&mut m, "payload.secret");
        assert_eq!(m, json!({"payload": {"a": 1, "b": {"c": 3}}}));
        assert_eq!(get_path(&m, "payload.b.c"), Some(&json!(3)));
    }

    #[test]
    fn runaway_script_is_stopped() {
        let ast = shared().compile("loop { }").unwrap();
        let err = eval(&ast, &json!({})).unwrap_err();
        assert!(
            matches!(err, NodeError::Permanent(ref m) if m.contains("operations")),
            "{err:?}"
        );
    }
}
