//! `weir run`: the engine on its settings, until SIGINT or SIGTERM; SIGHUP reloads the flows.

use std::process::ExitCode;

use weir::Engine;

use super::settings::Settings;

pub async fn run(s: Settings) -> anyhow::Result<ExitCode> {
    let mut cfg = weir::exec::ExecConfig {
        shutdown_grace: s.grace,
        reclaim_after: s.reclaim_after,
        retry_base: s.retry_initial,
        retry_cap: s.retry_max,
        max_age: s.max_age,
        retention: s.retention,
        max_in_flight: s.max_in_flight,
        max_parked: s.max_parked,
        ..Default::default()
    };
    if let Some(c) = s.consumer {
        cfg.consumer = c;
    }
    let mut builder = Engine::builder();
    for b in &s.mqtt_brokers {
        let Some((name, url)) = b.split_once('=').filter(|(n, _)| !n.is_empty()) else {
            anyhow::bail!(
                "--mqtt-broker `{}`: give NAME=URL",
                weir_core::redact::url(b)
            );
        };
        builder = builder.mqtt_broker(name, url);
    }
    if let Some(a) = s.admin {
        builder = builder.admin(a);
    }
    let engine = builder
        .admin_token(std::env::var("WEIR_ADMIN_TOKEN").ok())
        .flows_dir(&s.flows)
        .queue_url(s.queue)
        .mqtt(s.mqtt)
        .http(s.http)
        .http_limits(weir::HttpLimits {
            max_connections: s.max_connections,
            header_timeout: s.header_timeout,
            idle_timeout: s.idle_timeout,
            max_run_input: s.max_run_input,
            ..Default::default()
        })
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
