//! The node library and the [`Node`] trait through which applications add node types.
//!
//! A node type is a [`NodeFactory`]: it deserializes its YAML fields into a plain config
//! struct (positions kept, so every mistake is reported at its `file:line:column`), checks
//! them, and builds a [`Node`]. [`Library::load_paths`] reads every flow of some files and
//! folders, builds every node, wires the graph, and reports every problem of every file at
//! once.

mod delay;
pub mod duration;
mod function;
mod http;
mod library;
mod log;
pub mod mqtt;
pub mod rate_limit;
pub mod script;
mod set;
mod switch;
pub mod triggers;

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use weir_core::{now_ms, Message};
use weir_flow::{Pos, Spanned, Yaml};
use weir_queue::{Reply, WorkItem};
use weir_state::{Overlay, SharedQuotas, StateKey, StateRead};

pub use library::{Library, LoadedFlow, LoadedNode, Retry};
pub use triggers::Trigger;

/// What a node emitted: messages per output port (an empty port sends nothing on).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Emit(pub Vec<Vec<Message>>);

impl Emit {
    pub fn none() -> Self {
        Emit(Vec::new())
    }
    pub fn one(msg: Message) -> Self {
        Emit(vec![vec![msg]])
    }
    pub fn many(msgs: Vec<Message>) -> Self {
        Emit(vec![msgs])
    }
    /// `msg` on output `port`.
    pub fn port(port: usize, msg: Message) -> Self {
        let mut ports = vec![Vec::new(); port + 1];
        ports[port].push(msg);
        Emit(ports)
    }
}

/// How a node failed, which decides the item's fate.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NodeError {
    /// Broker, network, timeout, 5xx: retried with backoff until the item's maximum age.
    #[error("{reason}")]
    Transient {
        reason: String,
        retry_after: Option<Duration>,
    },
    /// 4xx, bad input, a script error on this message: dead-lettered at once.
    #[error("{0}")]
    Permanent(String),
    /// Anything else: retried up to the delivery ceiling, then dead-lettered.
    #[error("{0}")]
    Unclassified(String),
}

impl NodeError {
    pub fn permanent(reason: impl Into<String>) -> Self {
        NodeError::Permanent(reason.into())
    }

    pub fn transient(reason: impl Into<String>) -> Self {
        NodeError::Transient {
            reason: reason.into(),
            retry_after: None,
        }
    }
}

/// A running node. The built-in nodes implement it too.
#[async_trait::async_trait]
pub trait Node: Send + Sync {
    /// `true`: the node acts on the world (HTTP, MQTT). The executor keeps a done marker for
    /// it, so a redelivered item replays its recorded outputs instead of acting twice.
    fn side_effect(&self) -> bool {
        false
    }

    /// `true`: the node reads or writes its memory. Calls into one stateful node are
    /// serialised within an engine, in journal order.
    fn stateful(&self) -> bool {
        false
    }

    /// For source nodes: what drives them (webhook, cron, manual runs).
    fn trigger(&self) -> Option<&Trigger> {
        None
    }

    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError>;

    /// What the executor calls: `call` with the input borrowed. The executor keeps every
    /// input until the call has succeeded (a failed call's input is what its retry or its
    /// dead letter carries), so by default the node is given a copy. A node that only reads
    /// its input (a script that builds its own messages), or passes it on only where it has
    /// wires out ([`NodeCx::has_wires_out`]), implements this too, to spare messages that
    /// copy.
    async fn call_borrowed(&self, msg: &Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        self.call(msg.clone(), cx).await
    }
}

/// What a node may do besides emitting: read and write its memory through the wave's
/// overlay, schedule a delayed item at itself, answer a waiting webhook.
pub struct NodeCx<'a> {
    pub flow: &'a str,
    pub node: &'a str,
    /// The item whose wave this is.
    pub item: &'a WorkItem,
    store: &'a dyn StateRead,
    /// Quotas every engine on the backend shares, where it keeps them.
    quotas: Option<&'a dyn SharedQuotas>,
    overlay: &'a mut Overlay,
    scheduled: &'a mut Vec<WorkItem>,
    replies: &'a mut Vec<Reply>,
    dead: &'a mut Vec<(WorkItem, String)>,
    wires_out: bool,
    timeout: Option<std::time::Duration>,
}

/// What a wave collects from its nodes besides state: items to schedule, replies to post,
/// messages set aside as dead letters. Committed with the wave.
#[derive(Default)]
pub struct WaveOut {
    pub scheduled: Vec<WorkItem>,
    pub replies: Vec<Reply>,
    pub dead: Vec<(WorkItem, String)>,
}

impl<'a> NodeCx<'a> {
    pub fn new(
        flow: &'a str,
        node: &'a str,
        item: &'a WorkItem,
        store: &'a dyn StateRead,
        overlay: &'a mut Overlay,
        out: &'a mut WaveOut,
    ) -> Self {
        NodeCx {
            flow,
            node,
            item,
            store,
            quotas: None,
            overlay,
            scheduled: &mut out.scheduled,
            replies: &mut out.replies,
            dead: &mut out.dead,
            wires_out: true,
            timeout: None,
        }
    }

    /// How long this call may take: a script the node runs is stopped once it has run that
    /// long (it cannot be interrupted from outside, as an awaiting node is).
    pub fn with_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// How long this call may take, if the executor said.
    pub fn timeout(&self) -> Option<std::time::Duration> {
        self.timeout
    }

    /// Say whether any of the node's output ports is wired to another node (by default,
    /// yes). The executor says so for every call.
    pub fn with_wires_out(mut self, wired: bool) -> Self {
        self.wires_out = wired;
        self
    }

    /// Whether anything the node emits reaches another node. A node that passes its input
    /// on can skip copying it where it would be dropped unread.
    pub fn has_wires_out(&self) -> bool {
        self.wires_out
    }

    /// A borrowed input passed on unchanged on port 0: copied where the node has wires out,
    /// nothing where it would be dropped unread.
    pub fn pass_on(&self, msg: &Message) -> Emit {
        match self.wires_out {
            true => Emit::one(msg.clone()),
            false => Emit::none(),
        }
    }

    /// Whether this call is a `flush` item's (a node releasing what it held back), rather
    /// than a message arriving.
    pub fn is_flush(&self) -> bool {
        self.item.kind == weir_queue::ItemKind::Flush && self.item.node == self.node
    }

    /// Journal a `flush` item at this node for `after` from now, guarded like
    /// [`schedule`](Self::schedule): it calls this node again with `msg`.
    pub fn schedule_flush(&mut self, after: Duration, msg: Message, guard: (String, Value)) {
        let mut item =
            self.item
                .follow_up(self.node, format!("flush:{}", self.node), vec![vec![msg]]);
        item.kind = weir_queue::ItemKind::Flush;
        item.not_before = Some(now_ms() + after.as_millis() as i64);
        item.guard_key = Some(guard.0);
        item.guard_value = Some(guard.1);
        self.scheduled.push(item);
    }

    /// Set `msg` aside as a dead letter with `reason`, committed with the wave: visible, and
    /// replayable (a replay delivers it downstream of this node).
    pub fn dead_letter(&mut self, msg: Message, reason: impl Into<String>) {
        let item =
            self.item
                .follow_up(self.node, format!("dropped:{}", self.node), vec![vec![msg]]);
        self.dead.push((item, reason.into()));
    }

    fn key(&self, key: &str) -> StateKey {
        StateKey::new(self.flow, self.node, key)
    }

    pub fn now_ms(&self) -> i64 {
        now_ms()
    }

    /// A value of this node's memory, as this wave sees it.
    pub async fn get(&mut self, key: &str) -> Result<Option<Value>, NodeError> {
        let k = self.key(key);
        self.overlay
            .get(self.store, &k)
            .await
            .map_err(|e| NodeError::transient(e.to_string()))
    }

    /// Write (`None`: delete) a value of this node's memory; committed with the wave.
    pub async fn set(&mut self, key: &str, value: Option<Value>) -> Result<(), NodeError> {
        let k = self.key(key);
        self.overlay
            .set(self.store, k, value)
            .await
            .map_err(|e| NodeError::transient(e.to_string()))
    }

    /// The quotas every engine on the backend shares, for the calls of this context.
    pub fn with_quotas(mut self, quotas: Option<&'a dyn SharedQuotas>) -> Self {
        self.quotas = quotas;
        self
    }

    /// Whether the backend keeps quotas every engine shares (see [`take_quota`](Self::take_quota)).
    pub fn shares_quotas(&self) -> bool {
        self.quotas.is_some()
    }

    /// Take up to `want` passes from this node's quota `key`, shared by every engine on the
    /// backend. Spent at once, not with the wave's commit.
    pub async fn take_quota(
        &self,
        key: &str,
        every: Duration,
        burst: u32,
        want: u32,
    ) -> Result<weir_state::Quota, NodeError> {
        let quotas = self
            .quotas
            .ok_or_else(|| NodeError::transient("this backend keeps no shared quotas"))?;
        quotas
            .take_quota(&self.key(key), every, burst, want)
            .await
            .map_err(|e| NodeError::transient(format!("shared quota: {e}")))
    }

    /// This node's whole memory.
    pub async fn get_all(&mut self) -> Result<BTreeMap<String, Value>, NodeError> {
        self.overlay
            .get_node(self.store, self.flow, self.node)
            .await
            .map_err(|e| NodeError::transient(e.to_string()))
    }

    /// Journal `msg` to leave this node on output 0 after `after`, with the wave's commit.
    /// With a guard `(key, value)`, the item runs only if this node still holds `value` under
    /// `key` then (a newer timer voids it).
    pub fn schedule(&mut self, after: Duration, msg: Message, guard: Option<(String, Value)>) {
        let mut item =
            self.item
                .follow_up(self.node, format!("delay:{}", self.node), vec![vec![msg]]);
        item.not_before = Some(now_ms() + after.as_millis() as i64);
        if let Some((k, v)) = guard {
            item.guard_key = Some(k);
            item.guard_value = Some(v);
        }
        self.scheduled.push(item);
    }

    /// Answer the webhook that started this chain (`respond: wave`), after the commit.
    pub fn reply(&mut self, reply: Reply) {
        self.replies.push(reply);
    }
}

/// A problem in a node's configuration, at a position.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub pos: Pos,
    pub message: String,
}

impl ConfigError {
    pub fn at(pos: Pos, message: impl Into<String>) -> Self {
        ConfigError {
            pos,
            message: message.into(),
        }
    }
}

/// A built node and its output ports: for each port, the wires leaving it.
pub struct Built {
    pub node: std::sync::Arc<dyn Node>,
    pub ports: Vec<Vec<Spanned<String>>>,
}

/// Makes nodes of one type from their YAML fields.
pub trait NodeFactory: Send + Sync {
    /// The `type:` this factory builds.
    fn kind(&self) -> &str;
    /// Build from the node's fields (`type` removed). Report every problem found.
    fn build(&self, config: &Yaml) -> Result<Built, Vec<ConfigError>>;
}

/// Deserialize a config struct, turning the error into a positioned [`ConfigError`].
pub fn config<'a, T: serde::Deserialize<'a>>(y: &'a Yaml) -> Result<T, Vec<ConfigError>> {
    weir_flow::from_yaml(y).map_err(|e| vec![ConfigError::at(e.pos.unwrap_or(y.pos), e.message)])
}

/// A field given as one string or a list: `to: a` or `to: [a, b]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Wires(pub Vec<Spanned<String>>);

impl<'de> serde::Deserialize<'de> for Wires {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s: Spanned<OneOrList> = Spanned::deserialize(d)?;
        Ok(match s.value {
            OneOrList::One(v) => Wires(vec![Spanned {
                pos: s.pos,
                value: v,
            }]),
            OneOrList::Many(v) => Wires(v),
        })
    }
}

enum OneOrList {
    One(String),
    Many(Vec<Spanned<String>>),
}

impl<'de> serde::Deserialize<'de> for OneOrList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OneOrList;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a node id or a list of node ids")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OneOrList, E> {
                Ok(OneOrList::One(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut s: A,
            ) -> Result<OneOrList, A::Error> {
                let mut out = Vec::new();
                while let Some(w) = s.next_element::<Spanned<String>>()? {
                    out.push(w);
                }
                Ok(OneOrList::Many(out))
            }
        }
        d.deserialize_any(V)
    }
}
