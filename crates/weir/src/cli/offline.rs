//! The commands that need no running engine: `weir validate`, `weir graph`, `weir backup`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use weir::Library;

/// The picture `weir graph` prints.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Format {
    Dot,
    Mermaid,
}

/// Check flows; every problem at its `file:line:column`, exit 1 if there is any.
pub fn validate(paths: &[PathBuf]) -> ExitCode {
    match Library::builtin().load_paths(paths) {
        Ok(flows) => {
            for f in flows {
                println!("{}: ok (flow `{}`, {} nodes)", f.file, f.id, f.nodes.len());
            }
            ExitCode::SUCCESS
        }
        Err(d) => {
            eprintln!("{d}");
            eprintln!("{} problem(s) found", d.0.len());
            ExitCode::from(1)
        }
    }
}

/// Print a flow as Graphviz DOT or Mermaid.
pub fn graph(file: &Path, format: Format) -> anyhow::Result<ExitCode> {
    let src =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
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

/// Copy the SQLite queue `queue` names to `to`, consistently, while an engine may run on it.
pub fn backup(queue: &str, to: &Path) -> anyhow::Result<ExitCode> {
    let Some(from) = queue.strip_prefix("sqlite:") else {
        anyhow::bail!("`weir backup` copies an SQLite queue; `{queue}` is not one (Redis has its own BGSAVE / AOF copies)");
    };
    weir::queue::sqlite::backup(Path::new(from), to)?;
    println!("{from} copied to {}", to.display());
    Ok(ExitCode::SUCCESS)
}
