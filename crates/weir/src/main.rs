//! The `weir` binary: a thin CLI over the library. It parses the command line and hands each
//! subcommand to its module under `cli/`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

use cli::admin::{Api, FlowCmd, QueueCmd, RunFlow};
use cli::offline::Format;
use cli::settings::{RunArgs, Settings};

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
    Run(Box<RunArgs>),
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
    RunFlow(RunFlow),
    /// Copy the SQLite queue to a new file, consistently, while the engine runs.
    Backup {
        /// Where the copy goes (must not exist).
        to: PathBuf,
        /// The queue to copy.
        #[arg(long, env = "WEIR_QUEUE", default_value = weir::DEFAULT_QUEUE, hide_env_values = true)]
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
    match rt.block_on(dispatch(cli.cmd, matches.subcommand_matches("run"))) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cmd: Cmd, run_matches: Option<&clap::ArgMatches>) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Run(args) => cli::run::run(Settings::layer(*args, run_matches)?).await,
        Cmd::Validate { paths } => Ok(cli::offline::validate(&paths)),
        Cmd::Graph { file, format } => cli::offline::graph(&file, format),
        Cmd::Backup { to, queue } => cli::offline::backup(&queue, &to),
        Cmd::RunFlow(r) => cli::admin::run_flow(r).await,
        Cmd::Queue { cmd, api } => cli::admin::queue(cmd, api).await,
        Cmd::Flow { cmd, api } => cli::admin::flow(cmd, api).await,
    }
}
