//! weir's flow format.
//!
//! A flow is one YAML file: `id`, `description`, `concurrency` and `nodes`, a map keyed by node
//! id whose values name a `type` and that type's fields. This crate reads a file into a span
//! tree ([`yaml`]), checks the flow's own structure, resolves `${ENV}` secrets, and builds the
//! wiring graph ([`FlowGraph`], a petgraph graph). Node types are not known here: the node
//! library deserializes each node's fields through [`de::from_yaml`] and hands back its output
//! ports, so every problem in a file is reported at once as `file:line:column: message`.

pub mod de;
pub mod yaml;

use std::collections::HashSet;
use std::fmt;

use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::{Bfs, EdgeRef};

pub use de::{from_yaml, DeError, Spanned};
pub use yaml::{Pos, Style, Yaml, YamlKind};

/// One problem in a flow file, printed as `file:line:column: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub file: String,
    pub pos: Pos,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.pos.line, self.pos.col, self.message
        )
    }
}

/// Every problem found in one or more flows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

/// A flow file's structure, before its nodes are built.
#[derive(Debug, Clone)]
pub struct FlowDoc {
    pub file: String,
    pub id: Spanned<String>,
    pub description: Option<String>,
    /// Waves of this flow that may run at once (default 16; 1 = strict order).
    pub concurrency: usize,
    pub nodes: Vec<NodeDoc>,
}

/// One node as written: its id, its type, and the rest of its fields (type removed).
#[derive(Debug, Clone)]
pub struct NodeDoc {
    pub id: Spanned<String>,
    pub kind: Spanned<String>,
    pub body: Yaml,
}

pub const DEFAULT_CONCURRENCY: usize = 16;
const FLOW_FIELDS: &[&str] = &["id", "description", "concurrency", "nodes"];

/// Collects diagnostics for one file.
#[derive(Debug)]
pub struct Report {
    pub file: String,
    pub errors: Vec<Diagnostic>,
}

impl Report {
    pub fn new(file: impl Into<String>) -> Self {
        Report {
            file: file.into(),
            errors: Vec::new(),
        }
    }

    pub fn at(&mut self, pos: Pos, message: impl Into<String>) {
        self.errors.push(Diagnostic {
            file: self.file.clone(),
            pos,
            message: message.into(),
        });
    }

    /// Record a deserialization error, at `fallback` when it carries no position.
    pub fn de(&mut self, fallback: Pos, e: DeError) {
        self.at(e.pos.unwrap_or(fallback), e.message);
    }
}

/// Read a flow file's structure. `stem` is the file name without extension, the default id.
/// Problems are added to `report`; `None` when the file could not be read as a flow at all.
pub fn parse_flow(src: &str, stem: &str, report: &mut Report) -> Option<FlowDoc> {
    let mut root = match yaml::parse(src) {
        Ok(y) => y,
        Err(errors) => {
            for e in errors {
                report.at(e.pos, e.message);
            }
            return None;
        }
    };
    resolve_env(&mut root, report);
    let Some(entries) = root.as_map() else {
        report.at(
            root.pos,
            format!(
                "a flow is a map with `id` and `nodes`, found {}",
                root.type_name()
            ),
        );
        return None;
    };
    let mut id = Spanned {
        pos: Pos { line: 1, col: 1 },
        value: stem.to_string(),
    };
    let mut description = None;
    let mut concurrency = DEFAULT_CONCURRENCY;
    let mut nodes = Vec::new();
    let mut saw_nodes = false;
    for (k, v) in entries {
        let key = k.key_string();
        match key.as_str() {
            "id" => match v.as_str() {
                Some(s) if valid_id(s) => {
                    id = Spanned {
                        pos: v.pos,
                        value: s.to_string(),
                    }
                }
                _ => report.at(
                    v.pos,
                    "a flow id is letters, digits, `-` and `_` (it appears in URLs and keys)",
                ),
            },
            "description" => match v.as_str() {
                Some(s) => description = Some(s.to_string()),
                None => report.at(v.pos, "`description` is text"),
            },
            "concurrency" => match v.kind {
                YamlKind::Int(n) if (1..=10_000).contains(&n) => concurrency = n as usize,
                _ => report.at(v.pos, "`concurrency` is a whole number from 1 to 10000"),
            },
            "nodes" => {
                saw_nodes = true;
                nodes = parse_nodes(v, report);
            }
            other => {
                let hint = de::suggest(other, FLOW_FIELDS)
                    .map(|s| format!(", did you mean `{s}`?"))
                    .unwrap_or_else(|| format!(" (a flow has: {})", FLOW_FIELDS.join(", ")));
                report.at(k.pos, format!("unknown field `{other}`{hint}"));
            }
        }
    }
    if !saw_nodes {
        report.at(root.pos, "missing required field `nodes`");
    }
    // An id taken from the file's name obeys the rule an `id:` obeys.
    if id.value == stem && !valid_id(stem) && !entries.iter().any(|(k, _)| k.key_string() == "id") {
        report.at(
            Pos { line: 1, col: 1 },
            format!(
                "the file's name `{stem}` is not a flow id (letters, digits, `-` and `_`, at \
                 most 128): rename the file or give the flow an `id:`"
            ),
        );
    }
    Some(FlowDoc {
        file: report.file.clone(),
        id,
        description,
        concurrency,
        nodes,
    })
}

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn parse_nodes(v: &Yaml, report: &mut Report) -> Vec<NodeDoc> {
    let Some(entries) = v.as_map() else {
        report.at(
            v.pos,
            format!(
                "`nodes` is a map of node id to node, found {}",
                v.type_name()
            ),
        );
        return Vec::new();
    };
    let mut out = Vec::new();
    for (k, body) in entries {
        let id = k.key_string();
        if !valid_id(&id) {
            report.at(
                k.pos,
                format!("node id `{id}`: use letters, digits, `-` and `_`"),
            );
            continue;
        }
        let Some(fields) = body.as_map() else {
            report.at(
                body.pos,
                format!(
                    "node `{id}` is a map with a `type`, found {}",
                    body.type_name()
                ),
            );
            continue;
        };
        let Some((_, kind)) = body.get("type") else {
            report.at(k.pos, format!("node `{id}`: missing required field `type`"));
            continue;
        };
        let Some(kind_s) = kind.as_str() else {
            report.at(kind.pos, "`type` is the name of a node type");
            continue;
        };
        let rest: Vec<(Yaml, Yaml)> = fields
            .iter()
            .filter(|(k, _)| k.as_str() != Some("type"))
            .cloned()
            .collect();
        out.push(NodeDoc {
            id: Spanned {
                pos: k.pos,
                value: id,
            },
            kind: Spanned {
                pos: kind.pos,
                value: kind_s.to_string(),
            },
            body: Yaml {
                pos: body.pos,
                kind: YamlKind::Map(rest),
            },
        });
    }
    out
}

/// The fields whose text is Rhai code (a function's `script`, a switch rule's `if`, a
/// rate limit's `per`): a variable's value enters them as a string literal, never as code.
const CODE_FIELDS: [&str; 3] = ["script", "if", "per"];

/// Replace `${NAME}` in every string with the environment variable's value. In code (a
/// [`CODE_FIELDS`] field, or inside a template's `{{ }}`) the value goes in as a quoted
/// string literal. A missing variable, a `WEIR_*` one (the engine's own settings and
/// secrets) or a value that a template would take for code is an error at the string; the
/// value itself is never put into a message.
fn resolve_env(y: &mut Yaml, report: &mut Report) {
    resolve_in(y, false, report)
}

fn resolve_in(y: &mut Yaml, code: bool, report: &mut Report) {
    match &mut y.kind {
        YamlKind::Str(s, _) if s.contains("${") => {
            let mut out = String::new();
            let mut rest = s.as_str();
            while let Some(start) = rest.find("${") {
                out.push_str(&rest[..start]);
                let after = &rest[start + 2..];
                let Some(end) = after.find('}') else {
                    report.at(y.pos, "`${` without a closing `}`");
                    return;
                };
                let name = &after[..end];
                if name.starts_with("WEIR_") {
                    report.at(
                        y.pos,
                        format!(
                            "`${{{name}}}`: a flow may not read `WEIR_*` variables, which hold \
                             the engine's own settings and secrets"
                        ),
                    );
                    return;
                }
                // Inside a template's `{{ }}` when the text written before it (not the values
                // put in, which may hold braces) opens one it has not closed.
                let in_template = {
                    let so_far = &s[..s.len() - rest.len() + start];
                    so_far.rfind("{{") > so_far.rfind("}}")
                };
                match std::env::var(name) {
                    Ok(v) if code || in_template => {
                        // JSON's string syntax is also a Rhai string literal's.
                        out.push_str(&serde_json::Value::String(v).to_string())
                    }
                    Ok(v) if v.contains("{{") => {
                        report.at(
                            y.pos,
                            format!(
                                "the value of `{name}` holds `{{{{`, which a template would run \
                                 as code: use it inside `{{{{ }}}}` or in a script"
                            ),
                        );
                        return;
                    }
                    Ok(v) => out.push_str(&v),
                    Err(_) => {
                        report.at(y.pos, format!("environment variable `{name}` is not set"));
                        return;
                    }
                }
                rest = &after[end + 1..];
            }
            out.push_str(rest);
            *s = out;
        }
        YamlKind::Seq(items) => items.iter_mut().for_each(|i| resolve_in(i, code, report)),
        YamlKind::Map(entries) => entries.iter_mut().for_each(|(k, v)| {
            let code = code || k.as_str().is_some_and(|k| CODE_FIELDS.contains(&k));
            resolve_in(v, code, report)
        }),
        _ => {}
    }
}

/// A flow's wiring: node `i` of the flow is graph node `i`; an edge's weight is the output port.
#[derive(Debug, Clone)]
pub struct FlowGraph {
    pub graph: DiGraph<String, usize>,
    /// Per node, per output port: the nodes wired to it, sorted (looked up on every message,
    /// so worked out once at load).
    wires: Vec<Vec<Vec<usize>>>,
}

impl FlowGraph {
    /// Build the graph from each node's output ports (a list of wire targets per port),
    /// reporting every wire to a node that does not exist.
    pub fn build(
        ids: &[String],
        ports: &[Vec<Vec<Spanned<String>>>],
        report: &mut Report,
    ) -> FlowGraph {
        let mut graph = DiGraph::new();
        for id in ids {
            graph.add_node(id.clone());
        }
        for (from, node_ports) in ports.iter().enumerate() {
            for (port, wires) in node_ports.iter().enumerate() {
                let mut seen = HashSet::new();
                for w in wires {
                    match ids.iter().position(|i| *i == w.value) {
                        Some(to) if seen.insert(to) => {
                            graph.add_edge(NodeIndex::new(from), NodeIndex::new(to), port);
                        }
                        Some(_) => {}
                        None => {
                            let known: Vec<&str> = ids.iter().map(String::as_str).collect();
                            let hint = de::suggest(&w.value, &known)
                                .map(|s| format!(", did you mean `{s}`?"))
                                .unwrap_or_default();
                            report.at(w.pos, format!("wire to a missing node `{}`{hint}", w.value));
                        }
                    }
                }
            }
        }
        let wires = (0..ids.len())
            .map(|from| {
                let n = NodeIndex::new(from);
                let ports = graph.edges(n).map(|e| *e.weight() + 1).max().unwrap_or(0);
                (0..ports)
                    .map(|port| {
                        let mut t: Vec<usize> = graph
                            .edges(n)
                            .filter(|e| *e.weight() == port)
                            .map(|e| e.target().index())
                            .collect();
                        t.sort_unstable();
                        t
                    })
                    .collect()
            })
            .collect();
        FlowGraph { graph, wires }
    }

    /// The nodes wired to output `port` of node `from`, in a stable order.
    pub fn targets(&self, from: usize, port: usize) -> &[usize] {
        self.wires
            .get(from)
            .and_then(|p| p.get(port))
            .map_or(&[], Vec::as_slice)
    }

    /// Whether the node has no wires out (its messages are a flow's outputs).
    pub fn is_leaf(&self, node: usize) -> bool {
        self.wires
            .get(node)
            .is_none_or(|p| p.iter().all(Vec::is_empty))
    }

    /// Every node reachable from `from`'s outputs, `from` included.
    pub fn reachable(&self, from: usize) -> Vec<usize> {
        let mut bfs = Bfs::new(&self.graph, NodeIndex::new(from));
        let mut out = Vec::new();
        while let Some(n) = bfs.next(&self.graph) {
            out.push(n.index());
        }
        out.sort_unstable();
        out
    }

    /// Graphviz DOT. `kinds[i]` labels node i with its type.
    pub fn to_dot(&self, flow: &str, kinds: &[String]) -> String {
        let mut s = format!("digraph \"{}\" {{\n  rankdir=LR;\n", flow.replace('"', "'"));
        for n in self.graph.node_indices() {
            s.push_str(&format!(
                "  \"{0}\" [label=\"{0}\\n({1})\", shape=box];\n",
                self.graph[n],
                kinds.get(n.index()).map(String::as_str).unwrap_or("?")
            ));
        }
        for e in self.graph.edge_references() {
            s.push_str(&format!(
                "  \"{}\" -> \"{}\" [label=\"{}\"];\n",
                self.graph[e.source()],
                self.graph[e.target()],
                e.weight()
            ));
        }
        s.push_str("}\n");
        s
    }

    /// A Mermaid flowchart.
    pub fn to_mermaid(&self, kinds: &[String]) -> String {
        let mut s = String::from("flowchart LR\n");
        for n in self.graph.node_indices() {
            s.push_str(&format!(
                "  {0}[\"{0} ({1})\"]\n",
                self.graph[n],
                kinds.get(n.index()).map(String::as_str).unwrap_or("?")
            ));
        }
        for e in self.graph.edge_references() {
            s.push_str(&format!(
                "  {} -->|{}| {}\n",
                self.graph[e.source()],
                e.weight(),
                self.graph[e.target()]
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structure_errors_are_all_reported() {
        let src = "id: demo\nnodse: {}\nnodes:\n  a:\n    to: [b]\n  b:\n    type: 3\n";
        let mut r = Report::new("demo.yaml");
        let doc = parse_flow(src, "demo", &mut r).unwrap();
        let msgs: Vec<String> = r.errors.iter().map(|d| d.to_string()).collect();
        assert_eq!(
            msgs,
            vec![
                "demo.yaml:2:1: unknown field `nodse`, did you mean `nodes`?",
                "demo.yaml:4:3: node `a`: missing required field `type`",
                "demo.yaml:7:11: `type` is the name of a node type",
            ]
        );
        assert!(doc.nodes.is_empty());
    }

    #[test]
    fn wires_to_missing_nodes_are_reported_where_written() {
        let ids = vec!["a".to_string(), "b".to_string()];
        let w = |s: &str, line| Spanned {
            pos: Pos { line, col: 9 },
            value: s.to_string(),
        };
        let mut r = Report::new("f.yaml");
        let g = FlowGraph::build(&ids, &[vec![vec![w("b", 3), w("c", 4)]], vec![]], &mut r);
        assert_eq!(
            r.errors[0].to_string(),
            "f.yaml:4:9: wire to a missing node `c`"
        );
        assert_eq!(g.targets(0, 0), [1]);
        assert!(g.is_leaf(1));
        assert_eq!(g.reachable(0), vec![0, 1]);
    }

    #[test]
    fn env_secrets_are_resolved_and_missing_ones_reported() {
        std::env::set_var("FLOW_TEST_SECRET_X", "s3cret");
        let src = "nodes:\n  a:\n    type: log\n    k: \"Bearer ${FLOW_TEST_SECRET_X}\"\n    m: ${FLOW_NOT_SET_EVER}\n";
        let mut r = Report::new("f.yaml");
        let doc = parse_flow(src, "f", &mut r).unwrap();
        assert_eq!(doc.id.value, "f");
        assert_eq!(
            doc.nodes[0].body.get("k").unwrap().1.as_str(),
            Some("Bearer s3cret")
        );
        assert_eq!(r.errors.len(), 1);
        assert!(r.errors[0].message.contains("FLOW_NOT_SET_EVER"));
        assert!(!r.errors[0].message.contains("s3cret"));
    }

    #[test]
    fn an_id_from_the_file_name_is_checked_like_one_written() {
        let mut r = Report::new("my flow.yaml");
        parse_flow("nodes: {}\n", "my flow", &mut r);
        assert_eq!(r.errors.len(), 1);
        assert!(r.errors[0]
            .to_string()
            .starts_with("my flow.yaml:1:1: the file's name `my flow` is not a flow id"));
        let mut r = Report::new("my flow.yaml");
        parse_flow("id: mine\nnodes: {}\n", "my flow", &mut r);
        assert!(r.errors.is_empty(), "an `id:` stands in for the name");
    }

    #[test]
    fn env_values_enter_code_as_string_literals_and_weir_names_are_refused() {
        std::env::set_var("FLOW_TEST_CODE", "1); exit(\"owned\"); (\"");
        std::env::set_var("FLOW_TEST_BRACES", "{{ 40 + 2 }}");
        let src =
            "nodes:\n  a:\n    type: function\n    script: \"let k = ${FLOW_TEST_CODE}; msg\"\n  \
                   b:\n    type: set\n    set: { t: \"x/{{ ${FLOW_TEST_CODE} }}/y\" }\n";
        let mut r = Report::new("f.yaml");
        let doc = parse_flow(src, "f", &mut r).unwrap();
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(
            doc.nodes[0].body.get("script").unwrap().1.as_str(),
            Some(r#"let k = "1); exit(\"owned\"); (\""; msg"#)
        );
        let set = doc.nodes[1].body.get("set").unwrap().1;
        assert_eq!(
            set.get("t").unwrap().1.as_str(),
            Some(r#"x/{{ "1); exit(\"owned\"); (\"" }}/y"#)
        );
        // A value that closes braces does not end the template for the next one.
        std::env::set_var("FLOW_TEST_CLOSES", "}}");
        let src = "nodes:\n  b:\n    type: set\n    set: { t: \"{{ ${FLOW_TEST_CLOSES} + ${FLOW_TEST_CODE} }}\" }\n";
        let mut r = Report::new("f.yaml");
        let doc = parse_flow(src, "f", &mut r).unwrap();
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        let set = doc.nodes[0].body.get("set").unwrap().1;
        assert_eq!(
            set.get("t").unwrap().1.as_str(),
            Some(r#"{{ "}}" + "1); exit(\"owned\"); (\"" }}"#)
        );
        for (text, says) in [
            (
                "k: ${WEIR_ADMIN_TOKEN}",
                "`${WEIR_ADMIN_TOKEN}`: a flow may not read `WEIR_*`",
            ),
            (
                "k: \"a/${FLOW_TEST_BRACES}\"",
                "the value of `FLOW_TEST_BRACES` holds `{{`",
            ),
        ] {
            let src = format!("nodes:\n  a:\n    type: log\n    {text}\n");
            let mut r = Report::new("f.yaml");
            parse_flow(&src, "f", &mut r);
            assert_eq!(r.errors.len(), 1, "{text}");
            let e = r.errors[0].to_string();
            assert!(e.starts_with(&format!("f.yaml:4:8: {says}")), "{e}");
            assert!(!r.errors[0].message.contains("40 + 2"));
        }
    }
}
