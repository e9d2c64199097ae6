//! The flows an engine runs, each with what the executor keeps for it: its places
//! (`concurrency`), the order of waves through its stateful nodes, and its figures.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{oneshot, Semaphore};
use weir_nodes::LoadedFlow;

/// How a wave's commit ended its item, as `weir_items_ended_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    Ack,
    DeadLetter,
    Park,
    Superseded,
    /// Not an ending: the item comes back later (a wave past its deadline).
    Later,
}

impl Ended {
    pub(crate) fn of(end: Option<&weir_queue::End>) -> Ended {
        match end {
            Some(weir_queue::End::DeadLetter(_)) => Ended::DeadLetter,
            Some(weir_queue::End::Park) => Ended::Park,
            Some(weir_queue::End::Superseded) => Ended::Superseded,
            Some(weir_queue::End::Later(_)) => Ended::Later,
            Some(weir_queue::End::Ack) | None => Ended::Ack,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Ended::Ack => "ack",
            Ended::DeadLetter => "dead_letter",
            Ended::Park => "park",
            Ended::Superseded => "superseded",
            Ended::Later => "later",
        }
    }
}

/// A loaded flow with what the executor keeps for it.
pub struct FlowRt {
    pub flow: LoadedFlow,
    pub(crate) permits: Arc<Semaphore>,
    /// Per node: the receiver the next wave through that (stateful) node must wait on.
    tails: Vec<Mutex<Option<oneshot::Receiver<()>>>>,
    /// Per node: what this engine has seen it do since the flow was loaded.
    pub counts: Vec<NodeCounts>,
    /// The flow's Prometheus series, by end (see [`FlowRt::ended`]).
    ended: [std::sync::OnceLock<metrics::Counter>; 5],
    wave_seconds: std::sync::OnceLock<metrics::Histogram>,
    /// The flow's `respond: wave` webhooks, whose requests wait for their wave's answer.
    pub(crate) answering: Box<[String]>,
}

/// A node's calls and failures in this engine since its flow was loaded (the dashboard's
/// figures; the Prometheus counters add up by node type).
#[derive(Debug, Default)]
pub struct NodeCounts {
    pub calls: std::sync::atomic::AtomicU64,
    pub failures: std::sync::atomic::AtomicU64,
    /// `weir_node_calls_total` for the node's type (see [`FlowRt::ended`]).
    calls_total: std::sync::OnceLock<metrics::Counter>,
}

impl NodeCounts {
    /// Count a call, here and in `weir_node_calls_total{kind}`.
    pub(crate) fn called(&self, kind: &str) {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.calls_total
            .get_or_init(|| metrics::counter!("weir_node_calls_total", "kind" => kind.to_string()))
            .increment(1);
    }
}

impl FlowRt {
    /// Whether a `respond: wave` webhook at `node` waits for its items' answers.
    pub fn answers_at(&self, node: &str) -> bool {
        self.answering.iter().any(|n| n == node)
    }

    pub fn new(flow: LoadedFlow) -> Self {
        let n = flow.nodes.len();
        let answering = flow
            .nodes
            .iter()
            .filter(|n| {
                matches!(n.node.trigger(), Some(weir_nodes::Trigger::Webhook(w)) if w.respond_wave)
            })
            .map(|n| n.id.clone())
            .collect();
        FlowRt {
            answering,
            permits: Arc::new(Semaphore::new(flow.concurrency)),
            tails: (0..n).map(|_| Mutex::new(None)).collect(),
            counts: (0..n).map(|_| NodeCounts::default()).collect(),
            ended: Default::default(),
            wave_seconds: Default::default(),
            flow,
        }
    }

    /// Count a wave ended by its commit, and how long it took. The series' handles are
    /// made at their first use, after the engine has installed its recorder, and kept:
    /// looking each one up in the recorder by its labels at every event was a hash of the
    /// labels and a search of a registry that grows with the flows (with 1,000 flows loaded,
    /// one series per flow).
    pub(crate) fn ended(&self, end: Ended, took: std::time::Duration) {
        let flow = &self.flow.id;
        self.ended[end as usize]
            .get_or_init(|| {
                metrics::counter!("weir_items_ended_total", "flow" => flow.clone(), "end" => end.label())
            })
            .increment(1);
        self.wave_seconds
            .get_or_init(|| metrics::histogram!("weir_wave_seconds", "flow" => flow.clone()))
            .record(took.as_secs_f64());
    }

    /// Take a place in line at each of `nodes`, now (journal order). Returns what to wait for
    /// before running and what to drop once committed.
    pub(crate) fn queue_for(
        &self,
        nodes: &[usize],
    ) -> (Vec<oneshot::Receiver<()>>, Vec<oneshot::Sender<()>>) {
        let mut wait = Vec::new();
        let mut hold = Vec::new();
        for &n in nodes {
            let (tx, rx) = oneshot::channel();
            let prev = self.tails[n]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .replace(rx);
            if let Some(p) = prev {
                wait.push(p);
            }
            hold.push(tx);
        }
        (wait, hold)
    }
}

/// The flows an engine runs, by id.
#[derive(Default)]
pub struct Flows(RwLock<FlowMap>);

/// Flows by id, looked up for every wave (foldhash: cheaper than SipHash for such keys).
type FlowMap = HashMap<String, Arc<FlowRt>, foldhash::fast::RandomState>;

impl Flows {
    pub fn new(flows: Vec<LoadedFlow>) -> Self {
        Flows(RwLock::new(
            flows
                .into_iter()
                .map(|f| (f.id.clone(), Arc::new(FlowRt::new(f))))
                .collect(),
        ))
    }

    /// Put `flows` in force (a reload): new and changed flows get a fresh runtime, waves
    /// already running keep the one they started with. Returns the ids no longer loaded.
    pub fn replace(&self, flows: Vec<LoadedFlow>) -> Vec<String> {
        let next: FlowMap = flows
            .into_iter()
            .map(|f| (f.id.clone(), Arc::new(FlowRt::new(f))))
            .collect();
        let mut g = self.0.write().unwrap_or_else(|p| p.into_inner());
        let mut gone: Vec<String> = g
            .keys()
            .filter(|k| !next.contains_key(*k))
            .cloned()
            .collect();
        gone.sort();
        *g = next;
        gone
    }

    /// How many flows are loaded.
    pub fn count(&self) -> usize {
        self.0.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn get(&self, id: &str) -> Option<Arc<FlowRt>> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// Every source node of the flows in force (a webhook, a cron schedule, an MQTT
    /// filter), for the triggers to run.
    pub fn sources(&self) -> Vec<weir_triggers::Source> {
        self.all()
            .iter()
            .flat_map(|f| {
                f.flow.triggers().map(|(node, t)| weir_triggers::Source {
                    flow: f.flow.id.clone(),
                    node: node.to_string(),
                    trigger: t.clone(),
                })
            })
            .collect()
    }

    pub fn all(&self) -> Vec<Arc<FlowRt>> {
        let mut v: Vec<_> = self
            .0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.flow.id.cmp(&b.flow.id));
        v
    }
}
