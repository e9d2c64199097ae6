//! The settings of `weir run`, layered: defaults < the config file < the environment < flags.
//! clap gives the environment and the flags (and says which a value came from); the file
//! fills in what is still at its default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

/// `weir run`'s flags, each also read from the environment where it names a variable.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Folder (or file) of flows.
    #[arg(default_value = "flows")]
    pub flows: PathBuf,
    /// Queue backend: `sqlite:PATH` (durable, no server), `redis://HOST:PORT[/DB]`
    /// (several engines share it; `?shards=N&ns=NAME&poll=25ms&dead_cap=100000`), or
    /// `memory` (lost on exit); each takes `?max_ready=N` (100000): past it webhooks
    /// answer 429.
    #[arg(long, env = "WEIR_QUEUE", default_value = weir::DEFAULT_QUEUE, hide_env_values = true)]
    pub queue: String,
    /// The MQTT broker for mqtt-in and mqtt-out: `mqtt://[USER:PASSWORD@]HOST:PORT`
    /// (credentials also from WEIR_MQTT_USERNAME / WEIR_MQTT_PASSWORD; the stem of the
    /// client ids from WEIR_MQTT_CLIENT_ID, default `weir`).
    #[arg(long, env = "WEIR_MQTT", default_value = weir::triggers::mqtt::DEFAULT_BROKER, hide_env_values = true)]
    pub mqtt: String,
    /// Another broker, which flows name with `broker: NAME` (repeatable): `NAME=URL`.
    #[arg(long = "mqtt-broker", value_name = "NAME=URL")]
    pub mqtt_brokers: Vec<String>,
    /// Address for webhooks and the admin API.
    #[arg(long, env = "WEIR_HTTP", default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    /// Serve the admin API (/api, /metrics, /healthz, /readyz) on its own address. With
    /// WEIR_ADMIN_TOKEN set, /api and /metrics need `Authorization: Bearer <token>`;
    /// without it, the admin address must be a loopback one.
    #[arg(long, env = "WEIR_ADMIN")]
    pub admin: Option<SocketAddr>,
    /// How long to finish waves in flight on SIGINT/SIGTERM (`30s`; a bare number is
    /// seconds, as for every duration here).
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub grace: Duration,
    /// This engine's name as a consumer of a shared (Redis) queue. A stable name lets a
    /// restarted engine take back at once what it left in flight; it must be unique among
    /// the engines sharing the queue. Default: HOST-PID-RANDOM, fresh each start.
    #[arg(long, env = "WEIR_CONSUMER")]
    pub consumer: Option<String>,
    /// How long an item may sit in flight at another (dead or stalled) engine before this
    /// one takes it over. Keep it above 60s, the longest a wave may run: a wave still
    /// running past it is taken back and run a second time (a warning at start says so).
    #[arg(long, default_value = "120s", value_parser = duration)]
    pub reclaim_after: Duration,
    /// First wait before a transient failure is retried at its node (nodes may set their
    /// own `retry:`); it doubles, with jitter, up to --retry-max.
    #[arg(long, default_value = "1s", value_parser = duration)]
    pub retry_initial: Duration,
    /// The longest wait between two retries.
    #[arg(long, default_value = "5m", value_parser = duration)]
    pub retry_max: Duration,
    /// Work still failing transiently this long after its event arrived is dead-lettered
    /// as expired.
    #[arg(long, default_value = "24h", value_parser = duration)]
    pub max_age: Duration,
    /// Items the executor claims and has not yet committed, across all flows, at most;
    /// the waves webhooks start where their events are journaled are bounded apart, by
    /// as many again (and by their flow's `concurrency`).
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// Items parked per paused flow at most; past it they are dead-lettered with the reason.
    #[arg(long, default_value_t = 100_000)]
    pub max_parked: usize,
    /// Outcomes, dead letters and run records are kept this long, then pruned (with a
    /// count in the metrics).
    #[arg(long, default_value = "7d", value_parser = duration)]
    pub retention: Duration,
    /// Open HTTP connections per listener at most; at the bound the longest-idle one is
    /// closed to make room.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// How long a client may take to send a request's line and headers.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub header_timeout: Duration,
    /// How long a kept-alive HTTP connection may sit between requests.
    #[arg(long, default_value = "60s", value_parser = duration)]
    pub idle_timeout: Duration,
    /// The largest input of a run started by hand (`weir runs start`, POST
    /// /api/flows/ID/runs), in bytes; past it, 413.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_run_input: usize,
    /// A TOML file with any of these settings (keys as the flags, with `_`; brokers in a
    /// `[brokers]` table). Precedence: defaults < file < environment < flags.
    #[arg(long, env = "WEIR_CONFIG")]
    pub config: Option<PathBuf>,
}

/// A duration as flows write them (`500ms`, `5s`, `2m`, `1h`, `1d`), or a bare number of
/// seconds.
pub fn duration(s: &str) -> Result<Duration, String> {
    weir_core::duration::parse_or_secs(s)
}

/// A duration in the config file: a string with its unit, or a number of seconds.
#[derive(serde::Deserialize, Debug, Clone)]
#[serde(untagged)]
enum FileDuration {
    Secs(u64),
    Text(String),
}

impl FileDuration {
    fn get(&self) -> Result<Duration, String> {
        match self {
            FileDuration::Secs(n) => duration(&n.to_string()),
            FileDuration::Text(s) => duration(s),
        }
    }
}

/// `weir.toml`: the settings of `weir run`, below the environment and the flags.
#[derive(serde::Deserialize, Default, Debug)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    flows: Option<PathBuf>,
    queue: Option<String>,
    mqtt: Option<String>,
    http: Option<SocketAddr>,
    admin: Option<SocketAddr>,
    grace: Option<FileDuration>,
    consumer: Option<String>,
    reclaim_after: Option<FileDuration>,
    retry_initial: Option<FileDuration>,
    retry_max: Option<FileDuration>,
    max_age: Option<FileDuration>,
    retention: Option<FileDuration>,
    max_in_flight: Option<usize>,
    max_parked: Option<usize>,
    max_connections: Option<usize>,
    header_timeout: Option<FileDuration>,
    idle_timeout: Option<FileDuration>,
    max_run_input: Option<usize>,
    /// Named brokers: `cloud = "mqtts://…"`.
    #[serde(default)]
    brokers: std::collections::BTreeMap<String, String>,
}

impl FileConfig {
    fn read(path: &Path) -> anyhow::Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    fn parse(text: &str) -> Result<FileConfig, toml::de::Error> {
        toml::from_str(text)
    }
}

/// What `weir run` runs with, every layer applied.
#[derive(Debug)]
pub struct Settings {
    pub flows: PathBuf,
    pub queue: String,
    pub mqtt: String,
    /// `NAME=URL` each; a flag naming a broker wins over the file's.
    pub mqtt_brokers: Vec<String>,
    pub http: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub grace: Duration,
    pub consumer: Option<String>,
    pub reclaim_after: Duration,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    pub max_age: Duration,
    pub retention: Duration,
    pub max_in_flight: usize,
    pub max_parked: usize,
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_run_input: usize,
}

impl Settings {
    /// Layer `args` (the flags and the environment, as clap read them into `matches`) over
    /// the config file they name, over the defaults.
    pub fn layer(args: RunArgs, matches: Option<&clap::ArgMatches>) -> anyhow::Result<Settings> {
        let file = match &args.config {
            Some(p) => FileConfig::read(p)?,
            None => FileConfig::default(),
        };
        Self::over(args, matches, file)
    }

    fn over(
        args: RunArgs,
        matches: Option<&clap::ArgMatches>,
        file: FileConfig,
    ) -> anyhow::Result<Settings> {
        // A value the file may set: one still at its default (neither a flag nor the
        // environment gave it).
        let pick = |id: &str| {
            matches
                .and_then(|m| m.value_source(id))
                .is_none_or(|s| s == clap::parser::ValueSource::DefaultValue)
        };
        let from_file =
            |v: Option<FileDuration>, id: &str, flag: Duration| -> anyhow::Result<Duration> {
                match v.filter(|_| pick(id)) {
                    Some(d) => d
                        .get()
                        .map_err(|e| anyhow::anyhow!("{id} in the config file: {e}")),
                    None => Ok(flag),
                }
            };
        let mut mqtt_brokers = args.mqtt_brokers;
        for (name, url) in &file.brokers {
            if !mqtt_brokers
                .iter()
                .any(|b| b.split_once('=').is_some_and(|(n, _)| n == name))
            {
                mqtt_brokers.push(format!("{name}={url}"));
            }
        }
        let s = Settings {
            flows: file.flows.filter(|_| pick("flows")).unwrap_or(args.flows),
            queue: file.queue.filter(|_| pick("queue")).unwrap_or(args.queue),
            mqtt: file.mqtt.filter(|_| pick("mqtt")).unwrap_or(args.mqtt),
            mqtt_brokers,
            http: file.http.filter(|_| pick("http")).unwrap_or(args.http),
            admin: args.admin.or(file.admin),
            grace: from_file(file.grace, "grace", args.grace)?,
            consumer: args.consumer.or(file.consumer),
            reclaim_after: from_file(file.reclaim_after, "reclaim_after", args.reclaim_after)?
                .max(Duration::from_secs(1)),
            retry_initial: from_file(file.retry_initial, "retry_initial", args.retry_initial)?,
            retry_max: from_file(file.retry_max, "retry_max", args.retry_max)?,
            max_age: from_file(file.max_age, "max_age", args.max_age)?,
            retention: from_file(file.retention, "retention", args.retention)?,
            max_in_flight: file
                .max_in_flight
                .filter(|_| pick("max_in_flight"))
                .unwrap_or(args.max_in_flight)
                .max(1),
            max_parked: file
                .max_parked
                .filter(|_| pick("max_parked"))
                .unwrap_or(args.max_parked)
                .max(1),
            max_connections: file
                .max_connections
                .filter(|_| pick("max_connections"))
                .unwrap_or(args.max_connections)
                .max(1),
            header_timeout: from_file(file.header_timeout, "header_timeout", args.header_timeout)?,
            idle_timeout: from_file(file.idle_timeout, "idle_timeout", args.idle_timeout)?,
            max_run_input: file
                .max_run_input
                .filter(|_| pick("max_run_input"))
                .unwrap_or(args.max_run_input),
        };
        if s.header_timeout.is_zero() || s.header_timeout > Duration::from_secs(30) {
            anyhow::bail!("--header-timeout must be above 0 and at most 30s");
        }
        if s.idle_timeout.is_zero() {
            anyhow::bail!("--idle-timeout must be above 0");
        }
        if s.retry_initial.is_zero() || s.retry_max < s.retry_initial {
            anyhow::bail!("--retry-initial must be above 0 and at most --retry-max");
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    /// The settings `weir run ARGS` gets with `file` as its config file. The variables are
    /// not read, so that the machine's own `WEIR_*` cannot change what these tests see
    /// (tests/cli.rs runs the binary with them).
    fn layered(args: &[&str], file: &str) -> anyhow::Result<Settings> {
        let m = Cli::command()
            .mut_args(|a| a.env(None::<&str>))
            .try_get_matches_from(std::iter::once("weir").chain(args.iter().copied()))?;
        let cli = Cli::from_arg_matches(&m)?;
        Settings::over(cli.run, Some(&m), FileConfig::parse(file)?)
    }

    #[test]
    fn the_defaults_stand_where_nothing_else_is_given() {
        let s = layered(&[], "").unwrap();
        assert_eq!(s.flows, PathBuf::from("flows"));
        assert_eq!(s.queue, weir::DEFAULT_QUEUE);
        assert_eq!(s.http, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(s.grace, Duration::from_secs(30));
        assert_eq!(s.retention, Duration::from_secs(7 * 24 * 3600));
        assert_eq!((s.max_in_flight, s.max_parked), (256, 100_000));
    }

    #[test]
    fn every_duration_takes_units_and_a_bare_number_is_seconds() {
        let s = layered(&["--grace", "10s", "--reclaim-after", "90"], "").unwrap();
        assert_eq!(s.grace, Duration::from_secs(10));
        assert_eq!(s.reclaim_after, Duration::from_secs(90));
        let s = layered(
            &[],
            "reclaim_after = \"3m\"\ngrace = 15\nmax_age = 3600\nretention = \"2d\"\n",
        )
        .unwrap();
        assert_eq!(s.reclaim_after, Duration::from_secs(180));
        assert_eq!(s.grace, Duration::from_secs(15));
        assert_eq!(s.max_age, Duration::from_secs(3600));
        assert_eq!(s.retention, Duration::from_secs(2 * 86400));
        let e = layered(&[], "grace = \"soon\"\n").unwrap_err().to_string();
        assert!(e.contains("grace in the config file"), "{e}");
    }

    #[test]
    fn the_file_sets_what_the_flags_left_at_their_default() {
        let s = layered(
            &["--grace", "5"],
            r#"
            queue = "memory"
            grace = 60
            max_age = "2h"
            max_in_flight = 0
            [brokers]
            cloud = "mqtt://cloud:1883"
            "#,
        )
        .unwrap();
        assert_eq!(s.queue, "memory", "from the file");
        assert_eq!(s.grace, Duration::from_secs(5), "the flag wins");
        assert_eq!(s.max_age, Duration::from_secs(7200));
        assert_eq!(s.max_in_flight, 1, "at least one");
        assert_eq!(s.mqtt_brokers, ["cloud=mqtt://cloud:1883"]);
    }

    #[test]
    fn a_broker_the_flags_name_wins_over_the_files() {
        let s = layered(
            &["--mqtt-broker", "cloud=mqtt://flag:1"],
            "[brokers]\ncloud = \"mqtt://file:1\"\nlab = \"mqtt://lab:1\"\n",
        )
        .unwrap();
        assert_eq!(s.mqtt_brokers, ["cloud=mqtt://flag:1", "lab=mqtt://lab:1"]);
    }

    #[test]
    fn a_bad_value_says_where_it_came_from() {
        let e = layered(&[], "retention = \"forever\"")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("retention in the config file:"), "{e}");
        let e = layered(&["--retry-initial", "10m", "--retry-max", "1m"], "").unwrap_err();
        assert!(
            e.to_string().contains("--retry-initial must be above 0"),
            "{e}"
        );
        assert!(
            FileConfig::parse("colour = \"blue\"").is_err(),
            "an unknown key"
        );
    }
}
