//! Connecting, and the checks at start: the keys' layout, the shard count, persistence.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;
use redis::AsyncCommands;
use ulid::Ulid;

use super::conn::*;
use super::keys;
use super::listener::*;
use super::options::*;
use super::scripts::*;
use super::RedisQueue;
use crate::{Failpoints, QueueError};

impl RedisQueue {
    /// Connect to `url` (`redis://HOST:PORT[/DB]`), check the server's persistence and warn
    /// when acknowledged writes can be lost.
    pub async fn connect(
        url: &str,
        opts: RedisOptions,
        failpoints: Failpoints,
    ) -> Result<Self, QueueError> {
        // No call waits on the server (claims poll), so a short response timeout only ever
        // cuts a dead connection. Reconnects are quick and few: while the server is down a
        // caller should hear so at once (a webhook answers 503), and the executor's loop does
        // the backing off.
        // In errors: the URL with its password hidden.
        let shown = weir_core::redact::url(url);
        // A private CA for `rediss://`, read once for every client made here.
        let certs = match &opts.ca {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                QueueError::Open(format!("cannot read the CA {}: {e}", path.display()))
            })?),
            None => None,
        };
        let tls = |root: &Vec<u8>| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root.clone()),
        };
        let client_of = |url: &str| match &certs {
            Some(root) => redis::Client::build_with_tls(url, tls(root)),
            None => redis::Client::open(url),
        };
        let conn = match cluster_seeds(url) {
            Some(seeds) => {
                if seeds.is_empty() {
                    return Err(QueueError::Open(format!(
                        "`{shown}` names no node: write redis-cluster://HOST:PORT[,HOST:PORT…]"
                    )));
                }
                let mut builder = redis::cluster::ClusterClientBuilder::new(seeds);
                if let Some(root) = &certs {
                    builder = builder.certs(tls(root));
                }
                let client = builder
                    .connection_timeout(Duration::from_secs(2))
                    .response_timeout(Duration::from_secs(5))
                    .retries(2)
                    .build()
                    .map_err(|e| QueueError::Open(format!("`{shown}`: {e}")))?;
                Conn::Cluster(client.get_async_connection().await.map_err(|e| {
                    QueueError::Open(format!("cannot reach the Redis Cluster at {shown}: {e}"))
                })?)
            }
            None => {
                let client = client_of(url)
                    .map_err(|e| QueueError::Open(format!("`{shown}` is not a Redis URL: {e}")))?;
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(5)))
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(10))
                    .set_max_delay(Duration::from_millis(50));
                Conn::One(
                    client
                        .get_connection_manager_with_config(cfg)
                        .await
                        .map_err(|e| {
                            QueueError::Open(format!("cannot reach Redis at {shown}: {e}"))
                        })?,
                )
            }
        };
        let scripts = Scripts::new(opts.dead_cap);
        // Published replies reach every node of a cluster, so one node is enough to listen on.
        let listen_on = cluster_seeds(url)
            .and_then(|seeds| seeds.into_iter().next())
            .unwrap_or_else(|| url.to_string());
        let listen_on = client_of(listen_on.as_str())
            .map_err(|e| QueueError::Open(format!("`{shown}` is not a Redis URL: {e}")))?;
        let reply_waiters: Arc<ReplyWaiters> = Default::default();
        let heard: Arc<Heard> = Default::default();
        let wakes = Arc::new(ClaimWakes {
            ready: tokio::sync::Notify::new(),
            waiting: AtomicUsize::new(0),
            me: Ulid::new().to_string(),
            named_at: AtomicI64::new(0),
            heard: AtomicU64::new(0),
        });
        let listener = tokio::spawn(hear_other_engines(
            listen_on,
            [
                keys::replies_posted(&opts.namespace),
                keys::items_added(&opts.namespace),
            ],
            Arc::downgrade(&reply_waiters),
            Arc::downgrade(&heard),
            wakes.clone(),
            opts.poll,
        ));
        let q = RedisQueue {
            idempotency_ttl: std::sync::atomic::AtomicI64::new(
                super::scripts::IDEMPOTENCY_TTL_SECS,
            ),
            conn,
            shard_prefixes: (0..opts.shards.max(1))
                .map(|k| keys::prefix(&opts.namespace, k))
                .collect(),
            opts,
            scripts,
            failpoints,
            recovered: Default::default(),
            wakes,
            reply_waiters,
            heard,
            _listener: Listener(listener.abort_handle()),
            commits: Default::default(),
            next_shard: Default::default(),
            _keep: None,
        };
        q.check_layout().await?;
        q.check_shards().await?;
        q.check_persistence(url).await;
        Ok(q)
    }

    /// The first engine on a namespace records the layout of its keys; a namespace that an
    /// engine of another layout wrote (an earlier weir) is refused, since this one would
    /// not find its items.
    pub(super) async fn check_layout(&self) -> Result<(), QueueError> {
        let ns = &self.opts.namespace;
        let k = keys::meta(ns, "layout");
        let mut c = self.conn.clone();
        let io = |e: redis::RedisError| QueueError::Open(format!("cannot use Redis ({k}): {e}"));
        let have: Option<u32> = c.get(&k).await.map_err(io)?;
        let have = match have {
            Some(v) => v,
            // No layout recorded, but shards are: written before layouts were recorded.
            None if c.exists(keys::meta(ns, "shards")).await.map_err(io)? => 1,
            None => {
                let _: bool = c.set_nx(&k, LAYOUT).await.map_err(io)?;
                c.get(&k).await.map_err(io)?
            }
        };
        if have != LAYOUT {
            return Err(QueueError::Open(format!(
                "the queue in namespace `{ns}` was written by a weir that keeps its items \
                 another way (layout {have}; this one uses layout {LAYOUT}): drain it with \
                 that weir (nothing waiting, in flight, delayed, parked or dead), or start \
                 this one with another namespace (ns=…)"
            )));
        }
        Ok(())
    }

    /// The first engine on a namespace records its number of shards; an engine configured
    /// with another number is refused, since it would look for items where they are not.
    pub(super) async fn check_shards(&self) -> Result<(), QueueError> {
        let k = keys::meta(&self.opts.namespace, "shards");
        let mut c = self.conn.clone();
        let want = self.opts.shards.max(1);
        let _: bool = c
            .set_nx(&k, want)
            .await
            .map_err(|e| QueueError::Open(format!("cannot write to Redis ({k}): {e}")))?;
        let have: u32 = c
            .get(&k)
            .await
            .map_err(|e| QueueError::Open(format!("cannot read {k}: {e}")))?;
        if have != want {
            return Err(QueueError::Open(format!(
                "the queue in namespace `{ns}` has {have} shards and this engine was started \
                 with shards={want}: every engine on a namespace must use the same number. To \
                 change it, drain the queue (nothing waiting, in flight, delayed, parked or \
                 dead), delete the key {k}, and start with the new number; or use another \
                 namespace (ns=…)",
                ns = self.opts.namespace
            )));
        }
        Ok(())
    }

    /// Warn when the server can lose a write it acknowledged; returns the warnings.
    pub async fn check_persistence(&self, url: &str) -> Vec<String> {
        let mut c = self.conn.clone();
        let get = |name: &'static str| {
            let mut c = c.clone();
            async move {
                let v: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(name)
                    .query_async(&mut c)
                    .await;
                v.ok().and_then(|v| v.get(1).cloned())
            }
        };
        let aof = get("appendonly").await;
        let fsync = get("appendfsync").await;
        // The URL may hold the server's password: shown with it hidden.
        let url = weir_core::redact::url(url);
        let _ = &mut c;
        let mut warnings = Vec::new();
        match (aof.as_deref(), fsync.as_deref()) {
            (None, _) => warnings.push(format!(
                "cannot read the persistence settings of {url} (CONFIG GET refused); \
                 make sure it runs with appendonly yes and appendfsync always"
            )),
            (Some("yes"), Some("always")) => {}
            (Some("yes"), f) => warnings.push(format!(
                "{url} runs with appendfsync {}: a crash of the server can lose up to a second \
                 of events weir already acknowledged; set appendfsync always",
                f.unwrap_or("?")
            )),
            (Some(_), _) => warnings.push(format!(
                "{url} runs without the append-only file: a restart of the server loses events \
                 weir already acknowledged; set appendonly yes and appendfsync always"
            )),
        }
        for w in &warnings {
            tracing::warn!("{w}");
        }
        warnings
    }
}
