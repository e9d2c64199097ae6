//! `rate-limit`: a quota per node or per key that queues the excess instead of losing it.
//!
//! - Under the quota a message passes at once. Over it (or while its key already holds
//!   messages, so that none overtakes) it is **held in node state**, one row per message
//!   (`held/KEY/SEQ`), committed with its wave like any state, and a **flush item** is
//!   scheduled for when the quota next allows. The flush releases what it may, oldest first,
//!   and schedules the next; when the key is empty it cleans up after itself.
//! - One flush per key is live: each carries a guard (`flush/KEY`), and scheduling a new one
//!   writes a new value, so an older flush ends as superseded. A key whose flush is overdue
//!   (cancelled by hand, say) gets a new one with its next message, so it cannot stall.
//! - Past `max_queue` held messages the oldest is dropped as a **dead letter** with the
//!   reason: visible and replayable, never silent. `overflow: drop` drops over-quota messages
//!   instead of holding them and counts them (`dropped` in the node's memory).
//! - **Scope.** `scope: cluster` (the default) shares one quota among every engine on the
//!   backend: on Redis a GCRA script keeps it, by the server's clock, one round trip per
//!   message that arrives while nothing is held (a flush takes all it may in one). Where one
//!   engine holds the backend (SQLite, memory), and with `scope: engine`, the quota is
//!   governor's, in this engine's memory: N engines then pass N times the rate, and after a
//!   restart a key may pass one extra burst. What is held always survives, with the flush
//!   items.

use std::sync::Arc;
use std::time::Duration;

use rhai::AST;
use serde::Deserialize;
use serde_json::{json, Value};
use ulid::Ulid;
use weir_core::Message;
use weir_flow::{Spanned, Yaml};
use weir_limit::Limiter;

use crate::script;
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    /// `N/s`, `N/min` or `N/h`.
    rate: Spanned<String>,
    /// How many may pass at once after a quiet spell (default: N).
    burst: Option<Spanned<u32>>,
    /// A Rhai expression over `msg`: one quota per distinct value.
    per: Option<Spanned<String>>,
    #[serde(default)]
    overflow: Overflow,
    /// Whose quota: every engine's on a shared backend (`cluster`), or this engine's alone.
    #[serde(default)]
    scope: Scope,
    /// Held messages per key at most; past it the oldest becomes a dead letter.
    #[serde(default = "max_queue")]
    max_queue: Spanned<u64>,
    #[serde(default)]
    to: Wires,
}

fn max_queue() -> Spanned<u64> {
    Spanned {
        pos: Default::default(),
        value: 10_000,
    }
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Overflow {
    #[default]
    Queue,
    Drop,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Scope {
    #[default]
    Cluster,
    Engine,
}

/// Messages one flush releases at most (the rest wait for the next flush, at once).
const RELEASE_MAX: usize = 1000;
/// A flush this late is taken for lost, and replaced.
const OVERDUE_MS: i64 = 10_000;
pub const DROPPED: &str = "dropped";

pub struct Factory;

impl NodeFactory for Factory {
    fn kind(&self) -> &str {
        "rate-limit"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: Config = config(y)?;
        let mut errors = Vec::new();
        let rate = weir_limit::parse_rate(&c.rate)
            .map_err(|e| errors.push(ConfigError::at(c.rate.pos, e)))
            .ok();
        let engine = script::shared();
        let per = c.per.as_ref().and_then(|p| {
            script::compile(engine, p, p.pos, weir_flow::Style::Plain, true)
                .map_err(|e| errors.push(e))
                .ok()
        });
        if c.max_queue.value == 0 {
            errors.push(ConfigError::at(
                c.max_queue.pos,
                "`max_queue` is at least 1",
            ));
        }
        let limiter = rate.and_then(|(n, period)| {
            Limiter::new(n, period, c.burst.as_ref().map(|b| b.value))
                .map_err(|e| {
                    let pos = c.burst.as_ref().map(|b| b.pos).unwrap_or(c.rate.pos);
                    errors.push(ConfigError::at(pos, e))
                })
                .ok()
        });
        match (limiter, rate) {
            (Some(limiter), Some((n, period))) if errors.is_empty() => Ok(Built {
                node: Arc::new(RateLimit {
                    limiter,
                    every: period / n,
                    burst: c.burst.as_ref().map(|b| b.value).unwrap_or(n),
                    scope: c.scope,
                    per,
                    overflow: c.overflow,
                    max_queue: c.max_queue.value,
                }),
                ports: vec![c.to.0],
            }),
            _ => Err(errors),
        }
    }
}

struct RateLimit {
    limiter: Limiter,
    /// One pass every this long, bursts of `burst`: the quota as the shared GCRA takes it.
    every: Duration,
    burst: u32,
    scope: Scope,
    per: Option<AST>,
    overflow: Overflow,
    max_queue: u64,
}

fn int(v: Option<Value>) -> u64 {
    v.and_then(|v| v.as_u64()).unwrap_or(0)
}

fn held_key(key: &str, seq: u64) -> String {
    format!("held/{key}/{seq:016}")
}

impl RateLimit {
    fn key_of(&self, msg: &Message) -> Result<String, NodeError> {
        let Some(ast) = &self.per else {
            return Ok(String::new());
        };
        let v = script::from_dynamic(&script::eval(ast, msg)?)?;
        Ok(match v {
            Value::String(s) => s,
            other => other.to_string(),
        })
    }

    /// Take up to `want` passes of `key`'s quota: how many, and when the next is there.
    async fn take(
        &self,
        cx: &NodeCx<'_>,
        key: &str,
        want: u32,
    ) -> Result<(u32, Duration), NodeError> {
        if want == 0 {
            return Ok((0, Duration::ZERO));
        }
        if self.scope == Scope::Cluster && cx.shares_quotas() {
            let q = cx
                .take_quota(&format!("quota/{key}"), self.every, self.burst, want)
                .await?;
            return Ok((q.granted, q.next_in));
        }
        let mut granted = 0;
        while granted < want {
            match self.limiter.check(key) {
                Ok(()) => granted += 1,
                Err(wait) => return Ok((granted, wait)),
            }
        }
        Ok((granted, Duration::ZERO))
    }

    /// Schedule the key's next flush (voiding any other) for `after` from now.
    async fn schedule(
        &self,
        cx: &mut NodeCx<'_>,
        key: &str,
        after: Duration,
    ) -> Result<(), NodeError> {
        let guard = Value::String(Ulid::new().to_string());
        let gk = format!("flush/{key}");
        cx.set(&gk, Some(guard.clone())).await?;
        let due = cx.now_ms() + after.as_millis() as i64;
        cx.set(&format!("due/{key}"), Some(due.into())).await?;
        cx.schedule_flush(after, json!({ "key": key }), (gk, guard));
        Ok(())
    }

    async fn arrive(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let key = script::running(cx, || self.key_of(&msg))?;
        let (hk, tk) = (format!("head/{key}"), format!("tail/{key}"));
        let mut head = int(cx.get(&hk).await?);
        let tail = int(cx.get(&tk).await?);
        let wait = if head >= tail {
            match self.take(cx, &key, 1).await? {
                (1, _) => return Ok(Emit::one(msg)),
                (_, wait) => Some(wait),
            }
        } else {
            None
        };
        if self.overflow == Overflow::Drop {
            let n = int(cx.get(DROPPED).await?) + 1;
            cx.set(DROPPED, Some(n.into())).await?;
            metrics::counter!("weir_rate_limit_dropped_total", "flow" => cx.flow.to_string(), "node" => cx.node.to_string()).increment(1);
            tracing::debug!(
                flow = cx.flow,
                node = cx.node,
                key,
                dropped = n,
                "over the rate limit: dropped"
            );
            return Ok(Emit::none());
        }
        if tail.saturating_sub(head) >= self.max_queue {
            let oldest = held_key(&key, head);
            metrics::counter!("weir_bounds_hit_total", "bound" => "rate_limit_max_queue")
                .increment(1);
            if let Some(m) = cx.get(&oldest).await? {
                cx.dead_letter(
                    m,
                    format!(
                        "rate-limit `{}`: more than {} messages held for key `{key}`; the oldest was dropped",
                        cx.node, self.max_queue
                    ),
                );
            }
            cx.set(&oldest, None).await?;
            head += 1;
            cx.set(&hk, Some(head.into())).await?;
        }
        cx.set(&held_key(&key, tail), Some(msg)).await?;
        metrics::counter!("weir_rate_limit_held_total", "flow" => cx.flow.to_string(), "node" => cx.node.to_string()).increment(1);
        cx.set(&tk, Some((tail + 1).into())).await?;
        match wait {
            // The first held message of its key: the flush comes when the quota allows.
            Some(w) => self.schedule(cx, &key, w).await?,
            None => {
                let due = cx
                    .get(&format!("due/{key}"))
                    .await?
                    .and_then(|v| v.as_i64());
                if due.is_none_or(|d| d + OVERDUE_MS < cx.now_ms()) {
                    tracing::warn!(
                        flow = cx.flow,
                        node = cx.node,
                        key,
                        "rate-limit flush overdue or missing; scheduling a new one"
                    );
                    self.schedule(cx, &key, Duration::ZERO).await?;
                }
            }
        }
        Ok(Emit::none())
    }

    async fn flush(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let key = msg["key"].as_str().unwrap_or_default().to_string();
        let (hk, tk) = (format!("head/{key}"), format!("tail/{key}"));
        let mut head = int(cx.get(&hk).await?);
        let tail = int(cx.get(&tk).await?);
        let mut out = Vec::new();
        let want = tail.saturating_sub(head).min(RELEASE_MAX as u64) as u32;
        let (granted, mut next) = self.take(cx, &key, want).await?;
        for _ in 0..granted {
            let k = held_key(&key, head);
            if let Some(m) = cx.get(&k).await? {
                out.push(m);
            }
            cx.set(&k, None).await?;
            head += 1;
        }
        if granted == want && head < tail {
            // RELEASE_MAX reached: the rest at once, in the next flush.
            next = Duration::ZERO;
        }
        if head < tail {
            cx.set(&hk, Some(head.into())).await?;
            self.schedule(cx, &key, next).await?;
        } else {
            // Empty: nothing of this key is left in the node's memory.
            for k in [hk, tk, format!("flush/{key}"), format!("due/{key}")] {
                cx.set(&k, None).await?;
            }
        }
        Ok(Emit(vec![out]))
    }
}

#[async_trait::async_trait]
impl Node for RateLimit {
    fn stateful(&self) -> bool {
        true
    }

    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        if cx.is_flush() {
            self.flush(msg, cx).await
        } else {
            self.arrive(msg, cx).await
        }
    }
}
