//! weir: a flow engine that never loses an event.
//!
//! Flows written in YAML wire nodes into graphs; webhooks and cron ticks drive them. Every
//! event is journaled as a work item before anything runs, and acknowledged only when the
//! whole wave of work it started has committed. Embed it:
//!
//! ```no_run
//! # async fn demo() -> Result<(), weir::EngineError> {
//! let engine = weir::Engine::builder()
//!     .flows_dir("flows")
//!     .http("127.0.0.1:8080".parse().unwrap())
//!     .build()?;
//! engine.run(async { tokio::signal::ctrl_c().await.ok(); }).await?;
//! # Ok(()) }
//! ```
//!
//! Add node types through [`Node`] and [`NodeFactory`] with [`EngineBuilder::node`].

mod admin;
mod dashboard;
mod guard;
mod metrics;
mod serve;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use weir_exec::{ExecConfig, Executor, Flows};
use weir_triggers::Intake;

pub use weir_core::{now_ms, Failpoints, Message};
pub use weir_exec as exec;
pub use weir_flow as flow;
pub use weir_flow::{Diagnostic, Diagnostics};
pub use weir_nodes as nodes;
pub use weir_nodes::{
    config, Built, ConfigError, Emit, Library, LoadedFlow, Node, NodeCx, NodeError, NodeFactory,
    Wires,
};
pub use weir_queue as queue;
pub use weir_queue::{MemoryQueue, Queue, WorkQueue};
pub use weir_state as state;
pub use weir_triggers as triggers;

pub use serve::HttpLimits;

/// Why an engine could not be built or started. Each message is whole on its own: the
/// wrapped errors are shown through (`transparent`), not again as a cause, so a chain
/// printer (`anyhow`'s `{:#}`) says each thing once.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Flows(#[from] Diagnostics),
    #[error("cannot listen on {addr}: {error}")]
    Bind {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Queue(#[from] weir_queue::QueueError),
}

/// The queue the engine runs on: one given by the embedder, or one a URL names.
enum QueueChoice {
    Given(Queue),
    Url(String),
}

/// Where `weir run` and an engine built without a queue keep their work: durable, no server.
pub const DEFAULT_QUEUE: &str = "sqlite:weir-data/queue.db";

/// Builds an [`Engine`]: flows, queue, HTTP address, node types, executor settings.
pub struct EngineBuilder {
    library: Library,
    paths: Vec<PathBuf>,
    sources: Vec<(String, String)>,
    queue: QueueChoice,
    mqtt: Option<String>,
    brokers: Vec<(String, String)>,
    http: SocketAddr,
    admin: Option<SocketAddr>,
    admin_token: Option<String>,
    limits: HttpLimits,
    exec: ExecConfig,
    failpoints: Failpoints,
}

impl EngineBuilder {
    /// How the HTTP listeners bound their clients: connections, timeouts, body sizes.
    pub fn http_limits(mut self, limits: HttpLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Serve the admin API (`/api`, `/metrics`, `/healthz`, `/readyz`) on its own address
    /// instead of beside the webhooks.
    pub fn admin(mut self, addr: SocketAddr) -> Self {
        self.admin = Some(addr);
        self
    }

    /// Require `Authorization: Bearer <token>` on `/api` and `/metrics`. Without a token the
    /// admin API must listen on a loopback address, or the engine refuses to start.
    pub fn admin_token(mut self, token: Option<String>) -> Self {
        self.admin_token = token.filter(|t| !t.is_empty());
        self
    }

    /// Load every flow file of a folder (or one file).
    pub fn flows_dir(mut self, path: impl Into<PathBuf>) -> Self {
        self.paths.push(path.into());
        self
    }

    /// Add a flow from text; `name` stands for its file in messages (its stem is the id).
    pub fn flow_str(mut self, name: impl Into<String>, yaml: impl Into<String>) -> Self {
        self.sources.push((name.into(), yaml.into()));
        self
    }

    /// Run on this queue. It stays the caller's: a shutdown leaves it open.
    pub fn queue(mut self, q: impl Into<Queue>) -> Self {
        self.queue = QueueChoice::Given(q.into());
        self
    }

    /// Run on the queue `url` names (`memory`, `sqlite:PATH`, `redis://HOST:PORT`), opened
    /// when the engine starts. The default is [`DEFAULT_QUEUE`].
    pub fn queue_url(mut self, url: impl Into<String>) -> Self {
        self.queue = QueueChoice::Url(url.into());
        self
    }

    /// The MQTT broker (`mqtt://[USER:PASSWORD@]HOST:PORT`) for `mqtt-in` and `mqtt-out`;
    /// default `WEIR_MQTT` or mqtt://127.0.0.1:1883, connected only when a flow needs it.
    pub fn mqtt(mut self, url: impl Into<String>) -> Self {
        self.mqtt = Some(url.into());
        self
    }

    /// A broker that flows name with `broker: NAME` on their mqtt-in and mqtt-out nodes.
    pub fn mqtt_broker(mut self, name: impl Into<String>, url: impl Into<String>) -> Self {
        self.brokers.push((name.into(), url.into()));
        self
    }

    /// Where webhooks and the admin API listen (port 0: any free port).
    pub fn http(mut self, addr: SocketAddr) -> Self {
        self.http = addr;
        self
    }

    /// Register an application's own node type.
    pub fn node(mut self, factory: impl NodeFactory + 'static) -> Self {
        self.library.register(factory);
        self
    }

    pub fn exec_config(mut self, cfg: ExecConfig) -> Self {
        self.exec = cfg;
        self
    }

    /// Failpoints for tests that break things on purpose.
    pub fn failpoints(mut self, fp: Failpoints) -> Self {
        self.failpoints = fp;
        self
    }

    /// Load and validate every flow; every problem of every file is reported at once.
    pub fn build(self) -> Result<Engine, EngineError> {
        let mqtt = self.library.mqtt();
        if let Some(url) = &self.mqtt {
            mqtt.set_broker(weir_triggers::mqtt::Broker::parse(url).map_err(EngineError::Config)?);
        }
        for (name, url) in &self.brokers {
            let b = weir_triggers::mqtt::Broker::parse(url)
                .map_err(|e| EngineError::Config(format!("broker `{name}`: {e}")))?;
            mqtt.add_broker(name, b);
        }
        let source = FlowSource {
            library: self.library,
            paths: self.paths,
            sources: self.sources,
        };
        let flows = source.load()?;
        Ok(Engine {
            queue: self.queue,
            mqtt,
            source,
            flows: Arc::new(Flows::new(flows)),
            http: self.http,
            admin: self.admin,
            admin_token: self.admin_token,
            limits: self.limits,
            exec: self.exec,
            failpoints: self.failpoints,
        })
    }
}

/// Where an engine's flows come from, kept so that a reload reads them again.
struct FlowSource {
    library: Library,
    paths: Vec<PathBuf>,
    sources: Vec<(String, String)>,
}

impl FlowSource {
    /// Load and validate every flow; every problem of every file is reported at once.
    fn load(&self) -> Result<Vec<LoadedFlow>, EngineError> {
        let mut flows = self.library.load_paths(&self.paths)?;
        flows.extend(self.library.load_strs(&self.sources)?);
        let mut seen = std::collections::HashSet::new();
        for f in &flows {
            if !seen.insert(f.id.clone()) {
                return Err(EngineError::Config(format!("duplicate flow id `{}`", f.id)));
            }
        }
        Ok(flows)
    }
}

/// What changed in a reload.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadReport {
    /// The flows now loaded.
    pub flows: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Waiting, delayed and parked items of removed flows, set aside as dead letters (with
    /// the reason, replayable once the flow is back).
    pub cleared: usize,
}

/// The running parts a reload swaps: the flows, the webhook routes, the trigger tasks.
struct Reloader {
    source: FlowSource,
    flows: Arc<Flows>,
    queue: Queue,
    routes: weir_triggers::webhook::Routes,
    mqtt: Arc<weir_triggers::mqtt::MqttHub>,
    intake: Intake,
    tracker: TaskTracker,
    stop: CancellationToken,
    /// The token of the trigger tasks now running; held while reloading, so reloads take
    /// turns.
    triggers: tokio::sync::Mutex<CancellationToken>,
}

impl Reloader {
    /// Start cron and MQTT for `sources` (those of the flows in force), under `token`.
    fn spawn_triggers(
        &self,
        sources: &[weir_triggers::Source],
        token: &CancellationToken,
    ) -> Result<(), EngineError> {
        let needs_mqtt = sources
            .iter()
            .any(|s| matches!(s.trigger, weir_triggers::Trigger::Mqtt(_)));
        if needs_mqtt {
            // Every broker is resolved before anything starts: a bad one starts nothing.
            weir_triggers::mqtt::spawn_all(
                self.queue.clone(),
                sources,
                &self.mqtt,
                self.intake.clone(),
                &self.tracker,
                token.clone(),
            )
            .map_err(EngineError::Config)?;
        }
        weir_triggers::cron::spawn_all(self.queue.clone(), sources, &self.tracker, token.clone());
        Ok(())
    }

    async fn reload(&self) -> Result<ReloadReport, EngineError> {
        // An invalid flow set is refused whole, before anything changes.
        let next = self.source.load()?;
        let mut running = self.triggers.lock().await;
        let before: Vec<String> = self.flows.all().iter().map(|f| f.flow.id.clone()).collect();
        let removed = self.flows.replace(next);
        let sources = self.flows.sources();
        self.routes.rebuild(&sources);
        running.cancel();
        let token = self.stop.child_token();
        self.spawn_triggers(&sources, &token)?;
        *running = token;
        let flows: Vec<String> = self.flows.all().iter().map(|f| f.flow.id.clone()).collect();
        let added = flows
            .iter()
            .filter(|f| !before.contains(f))
            .cloned()
            .collect();
        let mut cleared = 0;
        for f in &removed {
            let n = self.queue.admin().clear_flow(f).await?;
            if n > 0 {
                tracing::warn!(flow = %f, items = n, "flow removed: its waiting, delayed and parked items were set aside as dead letters");
            }
            cleared += n;
        }
        let report = ReloadReport {
            flows,
            added,
            removed,
            cleared,
        };
        tracing::info!(?report, "flows reloaded");
        Ok(report)
    }
}

#[async_trait::async_trait]
impl admin::Reload for Reloader {
    async fn reload(&self) -> Result<serde_json::Value, Vec<String>> {
        match Reloader::reload(self).await {
            Ok(r) => Ok(serde_json::to_value(r).unwrap_or_default()),
            Err(EngineError::Flows(d)) => Err(d.0.iter().map(|d| d.to_string()).collect()),
            Err(e) => Err(vec![e.to_string()]),
        }
    }
}

/// A configured engine, ready to start.
pub struct Engine {
    queue: QueueChoice,
    mqtt: Arc<weir_triggers::mqtt::MqttHub>,
    source: FlowSource,
    flows: Arc<Flows>,
    http: SocketAddr,
    admin: Option<SocketAddr>,
    admin_token: Option<String>,
    limits: HttpLimits,
    exec: ExecConfig,
    failpoints: Failpoints,
}

/// A started engine: its address, its queue, and how to stop it.
pub struct RunningEngine {
    /// Where webhooks listen.
    pub addr: SocketAddr,
    /// Where the admin API listens (the same as `addr` unless it was given its own).
    pub admin_addr: SocketAddr,
    pub queue: Queue,
    /// The engine opened its queue from a URL, so its shutdown closes it.
    owns_queue: bool,
    reloader: Arc<Reloader>,
    stop: CancellationToken,
    intake: Intake,
    tracker: TaskTracker,
    http: TaskTracker,
    http_done: CancellationToken,
}

impl Engine {
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            library: Library::builtin(),
            paths: Vec::new(),
            sources: Vec::new(),
            queue: QueueChoice::Url(DEFAULT_QUEUE.into()),
            mqtt: None,
            brokers: Vec::new(),
            http: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: None,
            admin_token: None,
            limits: HttpLimits::default(),
            exec: ExecConfig::default(),
            failpoints: Failpoints::from_env(),
        }
    }

    /// Open the queue, bind the HTTP address(es), start the triggers and the executor.
    pub async fn start(self) -> Result<RunningEngine, EngineError> {
        let admin_at = self.admin.unwrap_or(self.http);
        if !admin_at.ip().is_loopback() && self.admin_token.is_none() {
            return Err(EngineError::Config(format!(
                "the admin API would listen on {admin_at}, which is not a loopback address, \
                 without a token: set WEIR_ADMIN_TOKEN, or put it on 127.0.0.1 with --admin"
            )));
        }
        // The recorder first: a queue reports from the moment it opens (the Redis reply
        // channel's listener may subscribe before the engine has finished starting).
        let recorder = metrics::handle();
        let (queue, owns_queue) = match self.queue {
            QueueChoice::Given(q) => (q, false),
            QueueChoice::Url(url) => (weir_queue::open(&url, self.failpoints.clone()).await?, true),
        };
        let bind = |at: SocketAddr| async move {
            let l = tokio::net::TcpListener::bind(at)
                .await
                .map_err(|error| EngineError::Bind { addr: at, error })?;
            let addr = l
                .local_addr()
                .map_err(|error| EngineError::Bind { addr: at, error })?;
            Ok::<_, EngineError>((l, addr))
        };
        let (listener, addr) = bind(self.http).await?;
        let admin_listener = match self.admin {
            Some(at) => Some(bind(at).await?),
            None => None,
        };
        let admin_addr = admin_listener.as_ref().map(|(_, a)| *a).unwrap_or(addr);
        if !queue.durable() {
            tracing::warn!("the queue is in memory: accepted events are lost if the process stops");
        }
        if self.exec.reclaim_after <= self.exec.wave_deadline {
            // Its item looks stalled to every engine, this one too, and is delivered again.
            tracing::warn!(
                reclaim_after = ?self.exec.reclaim_after,
                wave_deadline = ?self.exec.wave_deadline,
                "--reclaim-after is not longer than a wave may run: a wave still running past it is taken back and run a second time"
            );
        }
        let stop = CancellationToken::new();
        let intake = Intake::open();
        let tracker = TaskTracker::new();
        match recorder {
            Ok(handle) => {
                metrics::describe();
                tracker.spawn(metrics::upkeep(handle, stop.clone()));
            }
            Err(e) => tracing::warn!(error = e, "/metrics will not serve weir's metrics"),
        }
        let executor = Executor::new(
            queue.clone(),
            self.flows.clone(),
            self.exec.clone(),
            self.failpoints.clone(),
        );
        let sources = self.flows.sources();
        let (hooks, routes) = weir_triggers::webhook::router(
            queue.clone(),
            &sources,
            intake.clone(),
            Some(executor.starter()),
            self.limits.request_timeout,
        );
        let triggers = stop.child_token();
        let reloader = Arc::new(Reloader {
            source: self.source,
            flows: self.flows.clone(),
            queue: queue.clone(),
            routes,
            mqtt: self.mqtt.clone(),
            intake: intake.clone(),
            tracker: tracker.clone(),
            stop: stop.clone(),
            triggers: tokio::sync::Mutex::new(triggers.clone()),
        });
        reloader.spawn_triggers(&sources, &triggers)?;
        let ex_stop = stop.clone();
        tracker.spawn(async move { executor.run(ex_stop).await });
        let admin = admin::router(
            queue.clone(),
            self.flows.clone(),
            self.admin_token.clone(),
            reloader.clone(),
            guard::Guard::new(admin_addr, &self.limits, self.admin_token.is_some()),
        );
        let http_done = CancellationToken::new();
        let http = TaskTracker::new();
        let limits = self
            .limits
            .clone()
            .fitted(1 + usize::from(admin_listener.is_some()));
        match admin_listener {
            Some((l, _)) => {
                serve::spawn(
                    &http,
                    listener,
                    hooks,
                    limits.clone(),
                    http_done.clone(),
                    "webhooks",
                );
                serve::spawn(&http, l, admin, limits, http_done.clone(), "admin");
            }
            None => serve::spawn(
                &http,
                listener,
                hooks.merge(admin),
                limits,
                http_done.clone(),
                "webhooks and admin",
            ),
        }
        let flows: Vec<String> = self.flows.all().iter().map(|f| f.flow.id.clone()).collect();
        tracing::info!(%addr, %admin_addr, dashboard = %format!("http://{admin_addr}/"), ?flows, durable = queue.durable(), "weir engine started");
        Ok(RunningEngine {
            addr,
            admin_addr,
            queue,
            owns_queue,
            reloader,
            stop,
            intake,
            tracker,
            http,
            http_done,
        })
    }

    /// Start, run until `shutdown` completes, then stop gracefully.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), EngineError> {
        let running = self.start().await?;
        shutdown.await;
        running.shutdown().await;
        Ok(())
    }
}

impl RunningEngine {
    /// Read the flows again (`POST /api/reload`, SIGHUP): an invalid set is refused with its
    /// errors and the running one kept; a removed flow's waiting, delayed and parked items
    /// are set aside as dead letters with the reason, to replay once the flow is back.
    pub async fn reload(&self) -> Result<ReloadReport, EngineError> {
        self.reloader.reload().await
    }

    /// Stop intake (webhooks answer 503), finish the waves in flight up to the grace period,
    /// stop the HTTP server, and close the queue the engine opened: on return its file is
    /// free for the next engine.
    pub async fn shutdown(self) {
        tracing::info!("shutting down: intake closed, finishing waves in flight");
        self.intake.close();
        self.stop.cancel();
        self.tracker.close();
        // The HTTP server keeps answering (503 for new events, replies for waiting webhooks)
        // until the waves are done; then it stops.
        self.tracker.wait().await;
        self.http_done.cancel();
        self.http.close();
        self.http.wait().await;
        // A connection's task may still hold the queue for a moment after the server is
        // done with it: closing it does not wait for that.
        if self.owns_queue {
            self.queue.close().await;
        }
        tracing::info!("weir engine stopped");
    }
}
