//! The registry of node types and the loader that turns flow files into runnable flows.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use weir_flow::{
    parse_flow, Diagnostic, Diagnostics, FlowGraph, Pos, Report, Spanned, Yaml, YamlKind,
};

use crate::triggers::Trigger;
use crate::{Node, NodeFactory};

/// A node of a loaded flow.
pub struct LoadedNode {
    pub id: String,
    pub kind: String,
    pub node: Arc<dyn Node>,
    /// `retry: { initial, max }` on the node: its own backoff for transient failures.
    pub retry: Option<Retry>,
}

/// How a node's transient failures are retried: `initial`, doubling (with jitter) up to
/// `max`. Any node may set it; the engine's default applies otherwise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retry {
    pub initial: std::time::Duration,
    pub max: std::time::Duration,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RetryConfig {
    initial: crate::duration::Dur,
    max: crate::duration::Dur,
}

/// Take the `retry:` field, which every node type has, out of a node's fields.
fn split_retry(body: &Yaml) -> (Yaml, Option<&Yaml>) {
    match &body.kind {
        YamlKind::Map(entries) if body.get("retry").is_some() => {
            let rest = entries
                .iter()
                .filter(|(k, _)| k.as_str() != Some("retry"))
                .cloned()
                .collect();
            (
                Yaml {
                    pos: body.pos,
                    kind: YamlKind::Map(rest),
                },
                body.get("retry").map(|(_, v)| v),
            )
        }
        _ => (body.clone(), None),
    }
}

fn retry_of(y: &Yaml) -> Result<Retry, Vec<crate::ConfigError>> {
    let c: RetryConfig = crate::config(y)?;
    let initial = c.initial.get().map_err(|e| vec![e])?;
    let max = c.max.get().map_err(|e| vec![e])?;
    if initial.is_zero() || max < initial {
        return Err(vec![crate::ConfigError::at(
            y.pos,
            "`retry` needs 0 < initial <= max",
        )]);
    }
    Ok(Retry { initial, max })
}

/// A validated flow, ready to run.
pub struct LoadedFlow {
    pub id: String,
    /// Where the id was written (line 1 when it defaults to the file stem).
    pub id_pos: Pos,
    pub file: String,
    pub description: Option<String>,
    pub concurrency: usize,
    pub nodes: Vec<LoadedNode>,
    pub graph: FlowGraph,
    index: HashMap<String, usize>,
    /// For each node: the stateful nodes a wave starting there may call (sorted).
    serial: Vec<Vec<usize>>,
}

impl LoadedFlow {
    pub fn node_index(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// The stateful nodes a wave entering at `node` may call, in a fixed order.
    pub fn stateful_from(&self, node: usize) -> &[usize] {
        self.serial.get(node).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn kinds(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.kind.clone()).collect()
    }

    /// Source nodes and what drives them.
    pub fn triggers(&self) -> impl Iterator<Item = (&str, &Trigger)> {
        self.nodes
            .iter()
            .filter_map(|n| n.node.trigger().map(|t| (n.id.as_str(), t)))
    }
}

/// The node types an engine knows. [`Library::builtin`] has weir's own; applications add
/// theirs with [`Library::register`].
#[derive(Clone)]
pub struct Library {
    factories: HashMap<String, Arc<dyn NodeFactory>>,
    mqtt: Arc<weir_triggers::mqtt::MqttHub>,
}

impl Default for Library {
    fn default() -> Self {
        Self::builtin()
    }
}

impl Library {
    pub fn empty() -> Self {
        Library {
            factories: HashMap::new(),
            mqtt: Arc::default(),
        }
    }

    pub fn builtin() -> Self {
        let mut l = Library::empty();
        l.register(crate::function::Factory);
        l.register(crate::switch::Factory);
        l.register(crate::set::Factory);
        l.register(crate::delay::Factory);
        l.register(crate::rate_limit::Factory);
        l.register(crate::log::Factory);
        l.register(crate::http::RequestFactory);
        l.register(crate::http::ResponseFactory);
        l.register(crate::triggers::WebhookFactory);
        l.register(crate::triggers::CronFactory);
        l.register(crate::triggers::ManualFactory);
        l.register(crate::mqtt::InFactory(l.mqtt.clone()));
        l.register(crate::mqtt::OutFactory(l.mqtt.clone()));
        l
    }

    /// The MQTT side the library's nodes share: which broker, and the publishing connection.
    pub fn mqtt(&self) -> Arc<weir_triggers::mqtt::MqttHub> {
        self.mqtt.clone()
    }

    /// Add (or replace) a node type.
    pub fn register(&mut self, f: impl NodeFactory + 'static) -> &mut Self {
        self.factories.insert(f.kind().to_string(), Arc::new(f));
        self
    }

    pub fn kinds(&self) -> Vec<&str> {
        let mut k: Vec<&str> = self.factories.keys().map(String::as_str).collect();
        k.sort_unstable();
        k
    }

    /// Load one flow from text. `file` names it in messages; its stem is the default id.
    pub fn load_str(&self, file: &str, src: &str) -> Result<LoadedFlow, Diagnostics> {
        let mut report = Report::new(file);
        let stem = Path::new(file)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("flow")
            .to_string();
        let flow = self.load_into(src, &stem, &mut report);
        match flow {
            Some(f) if report.errors.is_empty() => Ok(f),
            _ => Err(Diagnostics(report.errors)),
        }
    }

    fn load_into(&self, src: &str, stem: &str, report: &mut Report) -> Option<LoadedFlow> {
        let doc = parse_flow(src, stem, report)?;
        let mut nodes = Vec::new();
        let mut ports: Vec<Vec<Vec<Spanned<String>>>> = Vec::new();
        let mut ok = true;
        for n in &doc.nodes {
            let Some(factory) = self.factories.get(&n.kind.value) else {
                let kinds = self.kinds();
                let hint = weir_flow::de::suggest(&n.kind.value, &kinds)
                    .map(|s| format!(", did you mean `{s}`?"))
                    .unwrap_or_else(|| format!(" (known: {})", kinds.join(", ")));
                report.at(
                    n.kind.pos,
                    format!(
                        "node `{}`: unknown node type `{}`{hint}",
                        n.id.value, n.kind.value
                    ),
                );
                ok = false;
                continue;
            };
            let (body, retry) = split_retry(&n.body);
            let retry = match retry.map(retry_of).transpose() {
                Ok(r) => r,
                Err(errors) => {
                    ok = false;
                    for e in errors {
                        report.at(e.pos, format!("node `{}`: {}", n.id.value, e.message));
                    }
                    None
                }
            };
            match factory.build(&body) {
                Ok(built) => {
                    nodes.push(LoadedNode {
                        id: n.id.value.clone(),
                        kind: n.kind.value.clone(),
                        node: built.node,
                        retry,
                    });
                    // A wire written as one string carries its owner's position.
                    let fixed = built
                        .ports
                        .into_iter()
                        .map(|p| {
                            p.into_iter()
                                .map(|w| Spanned {
                                    pos: if w.pos == Pos::default() {
                                        n.id.pos
                                    } else {
                                        w.pos
                                    },
                                    value: w.value,
                                })
                                .collect()
                        })
                        .collect();
                    ports.push(fixed);
                }
                Err(errors) => {
                    ok = false;
                    for e in errors {
                        report.at(e.pos, format!("node `{}`: {}", n.id.value, e.message));
                    }
                }
            }
        }
        if !ok {
            // Still check the wires of the nodes that did build, against every node id.
            let ids: Vec<String> = doc.nodes.iter().map(|n| n.id.value.clone()).collect();
            for node_ports in &ports {
                for wires in node_ports {
                    for w in wires {
                        if !ids.contains(&w.value) {
                            report.at(w.pos, format!("wire to a missing node `{}`", w.value));
                        }
                    }
                }
            }
            return None;
        }
        let ids: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
        let graph = FlowGraph::build(&ids, &ports, report);
        let index: HashMap<String, usize> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), i))
            .collect();
        let serial = (0..nodes.len())
            .map(|i| {
                graph
                    .reachable(i)
                    .into_iter()
                    .filter(|j| nodes[*j].node.stateful())
                    .collect()
            })
            .collect();
        Some(LoadedFlow {
            id: doc.id.value,
            id_pos: doc.id.pos,
            file: doc.file,
            description: doc.description,
            concurrency: doc.concurrency,
            nodes,
            graph,
            index,
            serial,
        })
    }

    /// Load every `*.yaml` / `*.yml` of a folder (or the given files), checking flows against
    /// each other too: duplicate flow ids, two webhooks on one path and method.
    pub fn load_paths(&self, paths: &[impl AsRef<Path>]) -> Result<Vec<LoadedFlow>, Diagnostics> {
        let mut files = Vec::new();
        let mut errors = Vec::new();
        for p in paths {
            let p = p.as_ref();
            if p.is_dir() {
                match std::fs::read_dir(p) {
                    Ok(rd) => {
                        let mut found: Vec<_> = rd
                            .filter_map(Result::ok)
                            .map(|e| e.path())
                            .filter(|f| {
                                matches!(
                                    f.extension().and_then(|e| e.to_str()),
                                    Some("yaml" | "yml")
                                )
                            })
                            .collect();
                        found.sort();
                        files.extend(found);
                    }
                    Err(e) => errors.push(Diagnostic {
                        file: p.display().to_string(),
                        pos: Pos { line: 1, col: 1 },
                        message: format!("cannot read folder: {e}"),
                    }),
                }
            } else {
                files.push(p.to_path_buf());
            }
        }
        let mut flows = Vec::new();
        for f in files {
            let name = f.display().to_string();
            match std::fs::read_to_string(&f) {
                Ok(src) => match self.load_str(&name, &src) {
                    Ok(flow) => flows.push(flow),
                    Err(d) => errors.extend(d.0),
                },
                Err(e) => errors.push(Diagnostic {
                    file: name,
                    pos: Pos { line: 1, col: 1 },
                    message: format!("cannot read file: {e}"),
                }),
            }
        }
        cross_check(&flows, &mut errors);
        if errors.is_empty() {
            Ok(flows)
        } else {
            Err(Diagnostics(errors))
        }
    }

    /// Load flows given as (name, text) pairs, with the same cross-checks.
    pub fn load_strs(&self, sources: &[(String, String)]) -> Result<Vec<LoadedFlow>, Diagnostics> {
        let mut flows = Vec::new();
        let mut errors = Vec::new();
        for (name, src) in sources {
            match self.load_str(name, src) {
                Ok(f) => flows.push(f),
                Err(d) => errors.extend(d.0),
            }
        }
        cross_check(&flows, &mut errors);
        if errors.is_empty() {
            Ok(flows)
        } else {
            Err(Diagnostics(errors))
        }
    }
}

fn cross_check(flows: &[LoadedFlow], errors: &mut Vec<Diagnostic>) {
    let mut ids: HashMap<&str, &str> = HashMap::new();
    let mut hooks: HashMap<(String, String), (&str, &str)> = HashMap::new();
    for f in flows {
        if let Some(first) = ids.insert(&f.id, &f.file) {
            errors.push(Diagnostic {
                file: f.file.clone(),
                pos: f.id_pos,
                message: format!("duplicate flow id `{}` (also in {first})", f.id),
            });
        }
        for (node, t) in f.triggers() {
            if let Trigger::Webhook(w) = t {
                let key = (w.method.clone(), w.path.clone());
                if let Some((other_flow, other_node)) = hooks.insert(key, (&f.id, node)) {
                    errors.push(Diagnostic {
                        file: f.file.clone(),
                        pos: Pos { line: 1, col: 1 },
                        message: format!(
                            "node `{node}`: webhook {} /hooks/{} is already served by flow `{other_flow}` node `{other_node}`",
                            w.method, w.path
                        ),
                    });
                }
            }
        }
    }
}
