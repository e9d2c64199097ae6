//! The `weir` binary: a thin CLI over the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use weir::{Engine, Library};

mod show;

#[derive(Parser)]
#[command(
    name = "weir",
    version,
    about = "A flow engine that never loses an event"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the engine on a folder of flows.
    Run {
        /// Folder (or file) of flows.
        #[arg(default_value = "flows")]
        flows: PathBuf,
        /// Queue backend: `sqlite:PATH` (durable, no server), `redis://HOST:PORT[/DB]`
        /// (several engines share it; `?shards=N&ns=NAME&poll=25ms&dead_cap=100000`), or
        /// `memory` (lost on exit); each takes `?max_ready=N` (100000): past it webhooks
        /// answer 429.
        #[arg(long, env = "WEIR_QUEUE", default_value = weir::DEFAULT_QUEUE)]
        queue: String,
        /// The MQTT broker for mqtt-in and mqtt-out: `mqtt://[USER:PASSWORD@]HOST:PORT`
        /// (credentials also from WEIR_MQTT_USERNAME / WEIR_MQTT_PASSWORD; the stem of the
        /// client ids from WEIR_MQTT_CLIENT_ID, default `weir`).
        #[arg(long, env = "WEIR_MQTT", default_value = weir::triggers::mqtt::DEFAULT_BROKER)]
        mqtt: String,
        /// Another broker, which flows name with `broker: NAME` (repeatable): `NAME=URL`.
        #[arg(long = "mqtt-broker", value_name = "NAME=URL")]
        mqtt_brokers: Vec<String>,
        /// Address for webhooks and the admin API.
        #[arg(long, env = "WEIR_HTTP", default_value = "127.0.0.1:8080")]
        http: SocketAddr,
        /// Serve the admin API (/api, /metrics, /healthz, /readyz) on its own address. With
        /// WEIR_ADMIN_TOKEN set, /api and /metrics need `Authorization: Bearer <token>`;
        /// without it, the admin address must be a loopback one.
        #[arg(long, env = "WEIR_ADMIN")]
        admin: Option<SocketAddr>,
        /// Seconds to finish waves in flight on SIGINT/SIGTERM.
        #[arg(long, default_value_t = 30)]
        grace: u64,
        /// This engine's name as a consumer of a shared (Redis) queue. A stable name lets a
        /// restarted engine take back at once what it left in flight; it must be unique among
        /// the engines sharing the queue. Default: HOST-PID-RANDOM, fresh each start.
        #[arg(long, env = "WEIR_CONSUMER")]
        consumer: Option<String>,
        /// Seconds an item may sit in flight at another (dead or stalled) engine before this
        /// one takes it over. Keep it above 60, the longest a wave may run: a wave still
        /// running past it is taken back and run a second time (a warning at start says so).
        #[arg(long, default_value_t = 120)]
        reclaim_after: u64,
        /// First wait before a transient failure is retried at its node (nodes may set their
        /// own `retry:`); it doubles, with jitter, up to --retry-max.
        #[arg(long, default_value = "1s", value_parser = duration)]
        retry_initial: std::time::Duration,
        /// The longest wait between two retries.
        #[arg(long, default_value = "5m", value_parser = duration)]
        retry_max: std::time::Duration,
        /// Work still failing transiently this long after its event arrived is dead-lettered
        /// as expired.
        #[arg(long, default_value = "24h", value_parser = duration)]
        max_age: std::time::Duration,
        /// Items the executor claims and has not yet committed, across all flows, at most;
        /// the waves webhooks start where their events are journaled are bounded apart, by
        /// as many again (and by their flow's `concurrency`).
        #[arg(long, default_value_t = 256)]
        max_in_flight: usize,
        /// Items parked per paused flow at most; past it they are dead-lettered with the reason.
        #[arg(long, default_value_t = 100_000)]
        max_parked: usize,
        /// Outcomes, dead letters and run records are kept this long, then pruned (with a
        /// count in the metrics).
        #[arg(long, default_value = "7d", value_parser = duration)]
        retention: std::time::Duration,
        /// A TOML file with any of these settings (keys as the flags, with `_`; brokers in a
        /// `[brokers]` table). Precedence: defaults < file < environment < flags.
        #[arg(long, env = "WEIR_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Check flows; exit 1 with `file:line:column: message` for every problem.
    Validate {
        /// Flow files or folders.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Print a flow as a picture (Graphviz DOT or Mermaid).
    Graph {
        file: PathBuf,
        #[arg(long, value_enum, default_value_t = Format::Dot)]
        format: Format,
    },
    /// Start a run of a flow (at its `manual` node) on a running engine.
    RunFlow {
        flow: String,
        /// The run's input, as JSON: it becomes `msg.payload`.
        #[arg(long, default_value = "null")]
        input: String,
        /// Wait until the run is done or failed, and print its outputs.
        #[arg(long)]
        wait: bool,
        /// How long `--wait` waits.
        #[arg(long, default_value = "60s", value_parser = duration)]
        timeout: std::time::Duration,
        #[command(flatten)]
        api: Api,
    },
    /// Copy the SQLite queue to a new file, consistently, while the engine runs.
    Backup {
        /// Where the copy goes (must not exist).
        to: PathBuf,
        /// The queue to copy.
        #[arg(long, env = "WEIR_QUEUE", default_value = weir::DEFAULT_QUEUE)]
        queue: String,
    },
    /// Look at and change the queue of a running engine.
    Queue {
        #[command(subcommand)]
        cmd: QueueCmd,
        #[command(flatten)]
        api: Api,
    },
    /// Pause, resume or step the flows of a running engine.
    Flow {
        #[command(subcommand)]
        cmd: FlowCmd,
        #[command(flatten)]
        api: Api,
    },
}

/// How the CLI reaches a running engine's admin API (token from WEIR_ADMIN_TOKEN).
#[derive(clap::Args)]
struct Api {
    /// The engine's admin address.
    #[arg(
        long,
        visible_alias = "api",
        env = "WEIR_URL",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    url: String,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Dot,
    Mermaid,
}

#[derive(Subcommand)]
enum QueueCmd {
    /// Ready, in flight, delayed, parked, dead, oldest pending age, durable.
    Stats,
    /// Every item with its state.
    Ls {
        #[arg(long)]
        flow: Option<String>,
        #[arg(long)]
        state: Option<String>,
    },
    /// One item by id.
    Show { id: String },
    /// Dead letters, newest first.
    Dead,
    /// Put a dead letter back: one by id, or in bulk with --flow / --reason / --all.
    Replay {
        id: Option<String>,
        #[command(flatten)]
        bulk: BulkArgs,
    },
    /// Drop a dead letter (a record is kept): one by id, or in bulk.
    Discard {
        id: Option<String>,
        #[command(flatten)]
        bulk: BulkArgs,
    },
    /// What became of the items that ended (done, cancelled or discarded by hand, …).
    Outcomes {
        #[arg(long)]
        flow: Option<String>,
    },
    /// Cancel a waiting, delayed or parked item.
    Cancel { id: String },
}

/// Which dead letters a bulk replay or discard takes.
#[derive(clap::Args)]
struct BulkArgs {
    /// Those of this flow.
    #[arg(long)]
    flow: Option<String>,
    /// Those whose reason contains this text.
    #[arg(long)]
    reason: Option<String>,
    /// Every one.
    #[arg(long)]
    all: bool,
}

impl BulkArgs {
    /// The query of a bulk call, or `None` when nothing was chosen.
    fn query(&self) -> Option<String> {
        let enc = |s: &str| -> String {
            s.bytes()
                .map(|b| match b {
                    b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                        (b as char).to_string()
                    }
                    _ => format!("%{b:02X}"),
                })
                .collect()
        };
        let mut q = Vec::new();
        if let Some(f) = &self.flow {
            q.push(format!("flow={}", enc(f)));
        }
        if let Some(r) = &self.reason {
            q.push(format!("reason={}", enc(r)));
        }
        if self.all {
            q.push("all=true".into());
        }
        (!q.is_empty()).then(|| q.join("&"))
    }
}

#[derive(Subcommand)]
enum FlowCmd {
    Ls,
    Pause { flow: String },
    Resume { flow: String },
    Step { flow: String },
}

// The default (`--no-default-features` leaves the C library's malloc): less CPU per event
// for a little more resident memory (docs/performance.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal: a log file, a pipe or the journal gets
        // plain text, not escape codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli, matches.subcommand_matches("run"))) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `weir.toml`: the settings of `weir run`, below the environment and the flags.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    flows: Option<PathBuf>,
    queue: Option<String>,
    mqtt: Option<String>,
    http: Option<SocketAddr>,
    admin: Option<SocketAddr>,
    grace: Option<u64>,
    consumer: Option<String>,
    reclaim_after: Option<u64>,
    retry_initial: Option<String>,
    retry_max: Option<String>,
    max_age: Option<String>,
    retention: Option<String>,
    max_in_flight: Option<usize>,
    max_parked: Option<usize>,
    /// Named brokers: `cloud = "mqtts://…"`.
    #[serde(default)]
    brokers: std::collections::BTreeMap<String, String>,
}

impl FileConfig {
    fn read(path: &std::path::Path) -> anyhow::Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }
}

/// Whether a `weir run` setting came from its default (so that the file may set it).
fn defaulted(m: Option<&clap::ArgMatches>, id: &str) -> bool {
    m.and_then(|m| m.value_source(id))
        .is_none_or(|s| s == clap::parser::ValueSource::DefaultValue)
}

async fn run(cli: Cli, run_matches: Option<&clap::ArgMatches>) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Run {
            flows,
            queue,
            mqtt,
            mqtt_brokers,
            http,
            admin,
            grace,
            consumer,
            reclaim_after,
            retry_initial,
            retry_max,
            max_age,
            retention,
            max_in_flight,
            max_parked,
            config,
        } => {
            let file = match &config {
                Some(p) => FileConfig::read(p)?,
                None => FileConfig::default(),
            };
            let m = run_matches;
            let pick = |id: &str| defaulted(m, id);
            let flows = file.flows.filter(|_| pick("flows")).unwrap_or(flows);
            let queue = file.queue.filter(|_| pick("queue")).unwrap_or(queue);
            let mqtt = file.mqtt.filter(|_| pick("mqtt")).unwrap_or(mqtt);
            let http = file.http.filter(|_| pick("http")).unwrap_or(http);
            let admin = admin.or(file.admin);
            let grace = file.grace.filter(|_| pick("grace")).unwrap_or(grace);
            let consumer = consumer.or(file.consumer);
            let reclaim_after = file
                .reclaim_after
                .filter(|_| pick("reclaim_after"))
                .unwrap_or(reclaim_after);
            let from_file = |v: Option<String>,
                             id: &str,
                             flag: std::time::Duration|
             -> anyhow::Result<std::time::Duration> {
                match v.filter(|_| pick(id)) {
                    Some(s) => {
                        duration(&s).map_err(|e| anyhow::anyhow!("{id} in the config file: {e}"))
                    }
                    None => Ok(flag),
                }
            };
            let retry_initial = from_file(file.retry_initial, "retry_initial", retry_initial)?;
            let retry_max = from_file(file.retry_max, "retry_max", retry_max)?;
            let max_age = from_file(file.max_age, "max_age", max_age)?;
            let retention = from_file(file.retention, "retention", retention)?;
            let max_in_flight = file
                .max_in_flight
                .filter(|_| pick("max_in_flight"))
                .unwrap_or(max_in_flight)
                .max(1);
            let max_parked = file
                .max_parked
                .filter(|_| pick("max_parked"))
                .unwrap_or(max_parked)
                .max(1);
            let mut mqtt_brokers = mqtt_brokers;
            for (name, url) in &file.brokers {
                // A flag naming the same broker wins.
                if !mqtt_brokers
                    .iter()
                    .any(|b| b.split_once('=').is_some_and(|(n, _)| n == name))
                {
                    mqtt_brokers.push(format!("{name}={url}"));
                }
            }
            if retry_initial.is_zero() || retry_max < retry_initial {
                anyhow::bail!("--retry-initial must be above 0 and at most --retry-max");
            }
            let mut cfg = weir::exec::ExecConfig {
                shutdown_grace: std::time::Duration::from_secs(grace),
                reclaim_after: std::time::Duration::from_secs(reclaim_after.max(1)),
                retry_base: retry_initial,
                retry_cap: retry_max,
                max_age,
                retention,
                max_in_flight,
                max_parked,
                ..Default::default()
            };
            if let Some(c) = consumer {
                cfg.consumer = c;
            }
            let mut builder = Engine::builder();
            for b in &mqtt_brokers {
                let Some((name, url)) = b.split_once('=').filter(|(n, _)| !n.is_empty()) else {
                    anyhow::bail!(
                        "--mqtt-broker `{}`: give NAME=URL",
                        weir_core::redact::url(b)
                    );
                };
                builder = builder.mqtt_broker(name, url);
            }
            if let Some(a) = admin {
                builder = builder.admin(a);
            }
            let engine = builder
                .admin_token(std::env::var("WEIR_ADMIN_TOKEN").ok())
                .flows_dir(&flows)
                .queue_url(queue)
                .mqtt(mqtt)
                .http(http)
                .exec_config(cfg)
                .build()?;
            let running = engine.start().await?;
            let shutdown = shutdown_signal();
            tokio::pin!(shutdown);
            #[cfg(unix)]
            let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
            loop {
                #[cfg(unix)]
                let reload = hup.recv();
                #[cfg(not(unix))]
                let reload = std::future::pending::<Option<()>>();
                tokio::select! {
                    _ = &mut shutdown => break,
                    _ = reload => match running.reload().await {
                        Ok(r) => tracing::info!(flows = ?r.flows, added = ?r.added, removed = ?r.removed, cleared = r.cleared, "SIGHUP: flows reloaded"),
                        Err(e) => tracing::error!("SIGHUP: the flows were not reloaded; the running ones stay:\n{e}"),
                    },
                }
            }
            running.shutdown().await;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::RunFlow {
            flow,
            input,
            wait,
            timeout,
            api,
        } => {
            let input: serde_json::Value = serde_json::from_str(&input)
                .with_context(|| format!("--input `{input}` is not JSON"))?;
            let (status, body) = request(
                &api,
                "POST",
                &format!("/api/flows/{flow}/runs"),
                Some(input),
            )
            .await?;
            if !status.is_success() {
                eprintln!(
                    "error: {}",
                    body["error"]
                        .as_str()
                        .unwrap_or("the engine refused the run")
                );
                return Ok(ExitCode::from(1));
            }
            let run = body["run_id"].as_str().unwrap_or_default().to_string();
            if !wait {
                println!(
                    "{}",
                    if api.json {
                        body.to_string()
                    } else {
                        format!("run {run} queued")
                    }
                );
                return Ok(ExitCode::SUCCESS);
            }
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let (_, rec) = request(&api, "GET", &format!("/api/runs/{run}"), None).await?;
                let state = rec["status"].as_str().unwrap_or_default().to_string();
                if state == "done" || state == "failed" {
                    if api.json {
                        println!("{}", serde_json::to_string_pretty(&rec)?);
                    } else {
                        println!("run {run} {state}");
                        if let Some(e) = rec["error"].as_str() {
                            println!("error: {e}");
                        }
                        for o in rec["outputs"].as_array().into_iter().flatten() {
                            println!("{o}");
                        }
                    }
                    return Ok(if state == "done" {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    });
                }
                if tokio::time::Instant::now() >= deadline {
                    eprintln!("run {run} is still {state} after {timeout:?}");
                    return Ok(ExitCode::from(2));
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
        Cmd::Backup { to, queue } => {
            let Some(from) = queue.strip_prefix("sqlite:") else {
                anyhow::bail!("`weir backup` copies an SQLite queue; `{queue}` is not one (Redis has its own BGSAVE / AOF copies)");
            };
            weir::queue::sqlite::backup(std::path::Path::new(from), &to)?;
            println!("{from} copied to {}", to.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Validate { paths } => match Library::builtin().load_paths(&paths) {
            Ok(flows) => {
                for f in flows {
                    println!("{}: ok (flow `{}`, {} nodes)", f.file, f.id, f.nodes.len());
                }
                Ok(ExitCode::SUCCESS)
            }
            Err(d) => {
                eprintln!("{d}");
                eprintln!("{} problem(s) found", d.0.len());
                Ok(ExitCode::from(1))
            }
        },
        Cmd::Graph { file, format } => {
            let src = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let flow = match Library::builtin().load_str(&file.display().to_string(), &src) {
                Ok(f) => f,
                Err(d) => {
                    eprintln!("{d}");
                    return Ok(ExitCode::from(1));
                }
            };
            let kinds = flow.kinds();
            match format {
                Format::Dot => print!("{}", flow.graph.to_dot(&flow.id, &kinds)),
                Format::Mermaid => print!("{}", flow.graph.to_mermaid(&kinds)),
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Queue { cmd, api } => {
            let (method, path) = match &cmd {
                QueueCmd::Stats => ("GET", "/api/stats".to_string()),
                QueueCmd::Ls { flow, state } => {
                    let mut q = Vec::new();
                    if let Some(f) = flow {
                        q.push(format!("flow={f}"));
                    }
                    if let Some(s) = state {
                        q.push(format!("state={s}"));
                    }
                    ("GET", format!("/api/queue?{}", q.join("&")))
                }
                QueueCmd::Show { id } => ("GET", format!("/api/items/{id}")),
                QueueCmd::Dead => ("GET", "/api/dead-letters".into()),
                QueueCmd::Replay { id: Some(id), .. } => {
                    ("POST", format!("/api/dead-letters/{id}/replay"))
                }
                QueueCmd::Discard { id: Some(id), .. } => {
                    ("DELETE", format!("/api/dead-letters/{id}"))
                }
                QueueCmd::Replay { id: None, bulk } | QueueCmd::Discard { id: None, bulk } => {
                    let Some(q) = bulk.query() else {
                        anyhow::bail!("give an item id, or choose dead letters with --flow, --reason or --all");
                    };
                    match &cmd {
                        QueueCmd::Replay { .. } => {
                            ("POST", format!("/api/dead-letters/replay?{q}"))
                        }
                        _ => ("DELETE", format!("/api/dead-letters?{q}")),
                    }
                }
                QueueCmd::Outcomes { flow } => (
                    "GET",
                    match flow {
                        Some(f) => format!("/api/outcomes?flow={f}"),
                        None => "/api/outcomes".into(),
                    },
                ),
                QueueCmd::Cancel { id } => ("DELETE", format!("/api/queue/{id}")),
            };
            let view = match cmd {
                QueueCmd::Stats => show::View::Stats,
                QueueCmd::Ls { .. } | QueueCmd::Dead | QueueCmd::Outcomes { .. } => {
                    show::View::Items
                }
                QueueCmd::Show { .. } => show::View::Item,
                _ => show::View::Done,
            };
            call(&api, method, &path, view).await
        }
        Cmd::Flow { cmd, api } => {
            let (method, path) = match &cmd {
                FlowCmd::Ls => ("GET", "/api/flows".to_string()),
                FlowCmd::Pause { flow } => ("POST", format!("/api/flows/{flow}/pause")),
                FlowCmd::Resume { flow } => ("POST", format!("/api/flows/{flow}/resume")),
                FlowCmd::Step { flow } => ("POST", format!("/api/flows/{flow}/step")),
            };
            let view = match cmd {
                FlowCmd::Ls => show::View::Flows,
                _ => show::View::Done,
            };
            call(&api, method, &path, view).await
        }
    }
}

/// One call to the admin API: its status and JSON answer.
async fn request(
    api: &Api,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> anyhow::Result<(reqwest::StatusCode, serde_json::Value)> {
    let base = &api.url;
    let url = format!("{}{path}", base.trim_end_matches('/'));
    let client = reqwest::Client::new();
    let mut req = match method {
        "POST" => client.post(&url),
        "DELETE" => client.delete(&url),
        _ => client.get(&url),
    };
    if let Ok(token) = std::env::var("WEIR_ADMIN_TOKEN") {
        if !token.is_empty() {
            req = req.bearer_auth(token);
        }
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("cannot reach the engine at {base} (is `weir run` running?)"))?;
    let status = resp.status();
    Ok((status, resp.json().await.unwrap_or(serde_json::Value::Null)))
}

async fn call(api: &Api, method: &str, path: &str, view: show::View) -> anyhow::Result<ExitCode> {
    let (status, body) = request(api, method, path, None).await?;
    if api.json {
        println!("{}", serde_json::to_string_pretty(&body)?);
    } else if !status.is_success() {
        eprintln!(
            "error: {} ({status})",
            body["error"].as_str().unwrap_or("the engine refused")
        );
    } else {
        print!("{}", show::render(view, &body));
    }
    Ok(if status.is_success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A duration as flows write them: `500ms`, `5s`, `2m`, `1h`, `1d`.
fn duration(s: &str) -> Result<std::time::Duration, String> {
    weir::nodes::duration::parse(s)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
