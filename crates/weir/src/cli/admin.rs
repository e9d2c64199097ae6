//! The commands that talk to a running engine through its admin API: `weir queue …`,
//! `weir flow …`, `weir run-flow`. Tables for people, `--json` for scripts.

use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;

use super::settings::duration;
use super::show;

/// How the CLI reaches a running engine's admin API (token from WEIR_ADMIN_TOKEN).
#[derive(clap::Args)]
pub struct Api {
    /// The engine's admin address.
    #[arg(
        long,
        visible_alias = "api",
        env = "WEIR_URL",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub url: String,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum QueueCmd {
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
pub struct BulkArgs {
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
pub enum FlowCmd {
    Ls,
    Pause { flow: String },
    Resume { flow: String },
    Step { flow: String },
}

/// `weir run-flow FLOW`: a run started at the flow's `manual` node, waited for with `--wait`.
#[derive(clap::Args)]
pub struct RunFlow {
    pub flow: String,
    /// The run's input, as JSON: it becomes `msg.payload`.
    #[arg(long, default_value = "null")]
    pub input: String,
    /// Wait until the run is done or failed, and print its outputs.
    #[arg(long)]
    pub wait: bool,
    /// How long `--wait` waits.
    #[arg(long, default_value = "60s", value_parser = duration)]
    pub timeout: std::time::Duration,
    #[command(flatten)]
    pub api: Api,
}

pub async fn run_flow(r: RunFlow) -> anyhow::Result<ExitCode> {
    let RunFlow {
        flow,
        input,
        wait,
        timeout,
        api,
    } = r;
    let input: serde_json::Value =
        serde_json::from_str(&input).with_context(|| format!("--input `{input}` is not JSON"))?;
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

pub async fn queue(cmd: QueueCmd, api: Api) -> anyhow::Result<ExitCode> {
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
        QueueCmd::Replay { id: Some(id), .. } => ("POST", format!("/api/dead-letters/{id}/replay")),
        QueueCmd::Discard { id: Some(id), .. } => ("DELETE", format!("/api/dead-letters/{id}")),
        QueueCmd::Replay { id: None, bulk } | QueueCmd::Discard { id: None, bulk } => {
            let Some(q) = bulk.query() else {
                anyhow::bail!(
                    "give an item id, or choose dead letters with --flow, --reason or --all"
                );
            };
            match &cmd {
                QueueCmd::Replay { .. } => ("POST", format!("/api/dead-letters/replay?{q}")),
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
        QueueCmd::Ls { .. } | QueueCmd::Dead | QueueCmd::Outcomes { .. } => show::View::Items,
        QueueCmd::Show { .. } => show::View::Item,
        _ => show::View::Done,
    };
    call(&api, method, &path, view).await
}

pub async fn flow(cmd: FlowCmd, api: Api) -> anyhow::Result<ExitCode> {
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
    // Without an admin token, the engine takes a change only from a client that says so
    // (a web page cannot send this header).
    req = req.header("x-weir-client", "cli");
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
