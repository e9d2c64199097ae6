//! The operator's HTTP surface: stats, items, dead letters, flow control.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use ulid::Ulid;
use weir_exec::Flows;
use weir_queue::{ListFilter, Queue, QueueError};

use crate::dashboard::{self, Sessions};

/// Reading the flows again, for `POST /api/reload`.
#[async_trait::async_trait]
pub trait Reload: Send + Sync {
    /// What changed, or every problem of the refused flow set.
    async fn reload(&self) -> Result<serde_json::Value, Vec<String>>;
}

#[derive(Clone)]
struct Admin {
    queue: Queue,
    flows: Arc<Flows>,
    reload: Arc<dyn Reload>,
    token: Option<Arc<String>>,
    sessions: Arc<Sessions>,
    /// What each flow's nodes hold, counted at most every few seconds.
    held: Arc<dashboard::Held>,
    /// The last readiness probe of the queue: when, and whether it answered.
    ready: Arc<std::sync::Mutex<Option<(std::time::Instant, bool)>>>,
}

/// The admin API and the dashboard. With `token`, every `/api` call and `/metrics` needs
/// `Authorization: Bearer <token>`, or the dashboard's session cookie (and, for a change,
/// its CSRF token); 401 otherwise. `/healthz`, `/readyz`, the dashboard's login form and
/// its script and style stay open.
pub fn router(
    queue: Queue,
    flows: Arc<Flows>,
    token: Option<String>,
    reload: Arc<dyn Reload>,
    guard: crate::guard::Guard,
) -> Router {
    let run_input = axum::extract::DefaultBodyLimit::max(guard.max_run_input);
    let body = axum::extract::DefaultBodyLimit::max(guard.max_body);
    let token = token.map(Arc::new);
    let sessions = Arc::new(Sessions::default());
    let auth = (token.clone(), sessions.clone());
    Router::new()
        .route("/", get(dashboard_page))
        .route("/ui/login", post(dashboard_login))
        .route("/ui/logout", post(dashboard_logout))
        .route(
            "/ui/app.js",
            get(|| async { dashboard::asset(dashboard::SCRIPT, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/ui/style.css",
            get(|| async { dashboard::asset(dashboard::STYLE, "text/css; charset=utf-8") }),
        )
        .route("/api/flows/{id}/graph.svg", get(flow_graph))
        .route("/api/flows/{id}/nodes", get(flow_nodes))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(prometheus))
        .route("/api/stats", get(stats))
        .route("/api/items/{id}", get(item))
        .route("/api/queue", get(list))
        .route("/api/queue/{id}", delete(cancel))
        .route("/api/dead-letters", get(dead).delete(discard_many))
        .route("/api/dead-letters/replay", post(replay_many))
        .route("/api/outcomes", get(outcomes))
        .route("/api/dead-letters/{id}", delete(discard))
        .route("/api/dead-letters/{id}/replay", post(replay))
        .route("/api/flows", get(flows_ls))
        .route("/api/flows/{id}/{action}", post(flow_action))
        .route("/api/flows/{id}/runs", post(start_run).layer(run_input))
        .route("/api/runs/{id}", get(run_status))
        .route("/api/reload", post(reload_flows))
        .layer(axum::middleware::from_fn(move |req, next| {
            let (token, sessions) = auth.clone();
            async move {
                authorize(token.as_deref().map(String::as_str), &sessions, req, next).await
            }
        }))
        // Outermost: a request from a web page is refused before it is authorized.
        .layer(axum::middleware::from_fn(move |req, next| {
            guard.clone().check(req, next)
        }))
        .layer(body)
        .with_state(Admin {
            queue,
            flows,
            reload,
            token,
            sessions,
            ready: Default::default(),
            held: Default::default(),
        })
}

/// Let a request through when no token is set, when it asks for an open path, when it
/// carries the token (compared in constant time), or when it comes from a dashboard session
/// (with the session's CSRF token if it changes something).
async fn authorize(
    token: Option<&str>,
    sessions: &Sessions,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path();
    let guarded = path.starts_with("/api/") || path == "/api" || path == "/metrics";
    if let (Some(want), true) = (token, guarded) {
        use subtle::ConstantTimeEq;
        let given = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        let bearer = bool::from(given.as_bytes().ct_eq(want.as_bytes()));
        if !bearer && sessions.csrf_of(req.headers()).is_some() {
            if dashboard::session_allows(sessions, req.method(), req.headers()) {
                return next.run(req).await;
            }
            return (
                StatusCode::FORBIDDEN,
                Json(json!({ "error": "missing or wrong CSRF token (X-CSRF-Token): reload the dashboard" })),
            )
                .into_response();
        }
        if !bearer {
            return (
                StatusCode::UNAUTHORIZED,
                [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
                Json(json!({ "error": "missing or wrong admin token (Authorization: Bearer …)" })),
            )
                .into_response();
        }
    }
    next.run(req).await
}

/// The Prometheus text, with the queue's depth by state read now.
async fn prometheus(State(a): State<Admin>) -> Response {
    let handle = match crate::metrics::handle() {
        Ok(h) => h,
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    };
    if let Ok(s) = a.queue.admin().stats().await {
        for (state, n) in [
            ("ready", s.ready),
            ("in_flight", s.in_flight),
            ("delayed", s.delayed),
            ("parked", s.parked),
            ("dead", s.dead),
        ] {
            metrics::gauge!("weir_queue_items", "state" => state).set(n as f64);
        }
        metrics::gauge!("weir_dead_letters_evicted").set(s.dead_evicted as f64);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        handle.render(),
    )
        .into_response()
}

/// Start a run (DESIGN §8): the body enters the flow at its `manual` node as `msg.payload`.
async fn start_run(
    State(a): State<Admin>,
    Path(id): Path<String>,
    body: Option<Json<serde_json::Value>>,
) -> Response {
    let Some(f) = a.flows.get(&id) else {
        return no_flow(&id);
    };
    let Some((node, _)) = f
        .flow
        .triggers()
        .find(|(_, t)| matches!(t, weir_triggers::Trigger::Manual))
    else {
        return bad(format!(
            "flow `{id}` has no `manual` node to start a run at"
        ));
    };
    let input = body.map(|Json(v)| v).unwrap_or(serde_json::Value::Null);
    let mut item =
        weir_queue::WorkItem::cascade(&id, node, "run", vec![json!({ "payload": input })]);
    item.kind = weir_queue::ItemKind::Run;
    let run_id = item.id.to_string();
    item.cause = format!("run:{run_id}");
    item.run_id = Some(run_id.clone());
    match a.queue.add(vec![item]).await {
        Ok(()) => (StatusCode::ACCEPTED, Json(json!({ "run_id": run_id }))).into_response(),
        Err(e) => err(e),
    }
}

/// A run's status: its record once its first wave committed, before that its item's state.
async fn run_status(State(a): State<Admin>, Path(id): Path<String>) -> Response {
    let ulid = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let item = match a.queue.admin().get(ulid).await {
        Ok(v) => v,
        Err(e) => return err(e),
    };
    // The run's flow: its first item's, or (once that is pruned) whichever flow has the record.
    let flows: Vec<String> = match &item {
        Some(v) => vec![v.item.flow.clone()],
        None => a.flows.all().iter().map(|f| f.flow.id.clone()).collect(),
    };
    for flow in flows {
        let key = weir_queue::StateKey::new(&flow, weir_exec::RUNS, &id);
        match a.queue.read(&key).await {
            Ok(v) => {
                if let Some(rec) = v.value {
                    let mut rec = rec;
                    rec["run_id"] = id.clone().into();
                    rec["flow"] = flow.into();
                    return Json(rec).into_response();
                }
            }
            Err(e) => return err(QueueError::Unavailable(e.0)),
        }
    }
    match item {
        Some(v) => {
            // A first item ended by hand (cancelled, say) ended the run without its wave:
            // the run failed, for that reason.
            let status = match &v.state {
                weir_queue::ItemState::InFlight { .. } => "running",
                weir_queue::ItemState::Dead { .. } => "failed",
                weir_queue::ItemState::Finished { outcome, .. } if outcome.starts_with("done") => {
                    "done"
                }
                weir_queue::ItemState::Finished { .. } => "failed",
                _ => "queued",
            };
            let error = match &v.state {
                weir_queue::ItemState::Dead { reason, .. } => Some(reason.clone()),
                weir_queue::ItemState::Finished { outcome, .. } if !outcome.starts_with("done") => {
                    Some(outcome.clone())
                }
                _ => None,
            };
            Json(json!({ "run_id": id, "flow": v.item.flow, "status": status, "outputs": [], "error": error }))
                .into_response()
        }
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": format!("no run {id}") })),
        )
            .into_response(),
    }
}

async fn reload_flows(State(a): State<Admin>) -> Response {
    // A task of its own: a reload half done (flows swapped, a removed flow's backlog half
    // set aside) is never cut off by the request's timeout or a client that hangs up.
    let reload = a.reload.clone();
    let done = match tokio::spawn(async move { reload.reload().await }).await {
        Ok(r) => r,
        Err(e) => Err(vec![format!("the reload stopped: {e}")]),
    };
    match done {
        Ok(report) => Json(report).into_response(),
        Err(errors) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({ "error": "the flows were not reloaded; the running ones stay", "errors": errors })),
        )
            .into_response(),
    }
}

/// Ready when the queue backend answers a one-key read, asked at most once a second
/// whatever the rate of probes; the answer says nothing more than ready or not.
async fn ready(State(a): State<Admin>) -> Response {
    let cached = *a.ready.lock().unwrap_or_else(|p| p.into_inner());
    let ok = match cached {
        Some((at, ok)) if at.elapsed() < std::time::Duration::from_secs(1) => ok,
        _ => {
            let ok = a.queue.pausing().is_paused("").await.is_ok();
            *a.ready.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((std::time::Instant::now(), ok));
            ok
        }
    };
    match ok {
        true => (StatusCode::OK, "ready").into_response(),
        false => (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response(),
    }
}

fn err(e: QueueError) -> Response {
    let status = match e {
        QueueError::NotFound(_) => StatusCode::NOT_FOUND,
        QueueError::Conflict(_) => StatusCode::CONFLICT,
        QueueError::Full(_) => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, Json(json!({ "error": e.to_string() }))).into_response()
}

fn bad(msg: String) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": msg }))).into_response()
}

#[allow(clippy::result_large_err)] // the error is the answer itself
fn parse_id(id: &str) -> Result<Ulid, Response> {
    Ulid::from_string(id).map_err(|_| bad(format!("`{id}` is not an item id")))
}

/// The queue by state, and when the next delayed item is due (ms; null when none is).
async fn stats(State(a): State<Admin>) -> Response {
    let s = match a.queue.admin().stats().await {
        Ok(s) => s,
        Err(e) => return err(e),
    };
    let next_due = match a.queue.next_due().await {
        Ok(d) => d,
        Err(e) => return err(e),
    };
    let mut v = serde_json::to_value(s).unwrap_or_default();
    v["next_due"] = next_due.into();
    Json(v).into_response()
}

async fn item(State(a): State<Admin>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return r,
    };
    match a.queue.admin().get(id).await {
        Ok(Some(v)) => Json(v).into_response(),
        Ok(None) => err(QueueError::NotFound(id)),
        Err(e) => err(e),
    }
}

#[derive(Deserialize)]
struct ListQuery {
    flow: Option<String>,
    state: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
}

async fn list(State(a): State<Admin>, Query(q): Query<ListQuery>) -> Response {
    let after = match q.after.as_deref().map(parse_id).transpose() {
        Ok(a) => a,
        Err(r) => return r,
    };
    let filter = ListFilter {
        flow: q.flow,
        state: q.state,
        after,
        limit: q.limit.unwrap_or(100).min(1000),
    };
    match a.queue.admin().list(filter).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => err(e),
    }
}

async fn cancel(State(a): State<Admin>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let before = a.queue.admin().get(id).await.ok().flatten();
    match a.queue.admin().cancel(id).await {
        Ok(()) => {
            if let Some(v) = before {
                answer_waiter(&a, &v.item, "cancelled by hand").await;
            }
            Json(json!({ "cancelled": id.to_string() })).into_response()
        }
        Err(e) => err(e),
    }
}

/// A `respond: wave` request may be waiting for the item just ended by hand: it hears so
/// now (409, with the reason), not at its timeout.
async fn answer_waiter(a: &Admin, item: &weir_queue::WorkItem, why: &str) {
    let waited = item.awaited
        || (item.origin_id.is_none()
            && a.flows
                .get(&item.flow)
                .is_some_and(|f| f.answers_at(&item.node)));
    if !waited {
        return;
    }
    let reply = weir_queue::Reply {
        status: 409,
        headers: Vec::new(),
        body: json!({ "id": item.root_id().to_string(), "error": format!("the event was {why}") })
            .into(),
    };
    if let Err(e) = a.queue.post_reply(item.root_id(), reply).await {
        tracing::warn!(item = %item.id, error = %e, "could not answer the request waiting for an item ended by hand");
    }
}

#[derive(Deserialize)]
struct DeadQuery {
    limit: Option<usize>,
}

async fn dead(State(a): State<Admin>, Query(q): Query<DeadQuery>) -> Response {
    match a
        .queue
        .admin()
        .dead_letters(q.limit.unwrap_or(100).min(1000))
        .await
    {
        Ok(v) => Json(v).into_response(),
        Err(e) => err(e),
    }
}

/// Which dead letters a bulk action takes: of one flow, whose reason contains a text, or
/// (`all=true`) every one. Without any of them the action refuses, so that a bare call
/// cannot empty the list by accident.
#[derive(Deserialize)]
struct Bulk {
    flow: Option<String>,
    reason: Option<String>,
    #[serde(default)]
    all: bool,
}

/// Dead letters a bulk action takes (at most 10,000 a call), chosen by id: their bodies
/// are not read.
async fn chosen(a: &Admin, b: &Bulk) -> Result<Vec<ulid::Ulid>, Response> {
    if b.flow.is_none() && b.reason.is_none() && !b.all {
        return Err(bad(
            "say which dead letters: flow=…, reason=… or all=true".into()
        ));
    }
    a.queue
        .admin()
        .dead_ids(b.flow.as_deref(), b.reason.as_deref(), 10_000)
        .await
        .map_err(err)
}

async fn replay_many(State(a): State<Admin>, Query(b): Query<Bulk>) -> Response {
    let ids = match chosen(&a, &b).await {
        Ok(ids) => ids,
        Err(r) => return r,
    };
    let mut replayed = Vec::new();
    for id in ids {
        match a.queue.admin().replay(id).await {
            Ok(new_id) => {
                replayed.push(json!({ "id": new_id.to_string(), "replayed": id.to_string() }))
            }
            Err(QueueError::NotFound(_)) | Err(QueueError::Conflict(_)) => {}
            Err(e) => return err(e),
        }
    }
    Json(json!({ "replayed": replayed.len(), "items": replayed })).into_response()
}

async fn discard_many(State(a): State<Admin>, Query(b): Query<Bulk>) -> Response {
    let ids = match chosen(&a, &b).await {
        Ok(ids) => ids,
        Err(r) => return r,
    };
    let mut n = 0;
    for id in ids {
        match a.queue.admin().discard(id).await {
            Ok(()) => n += 1,
            Err(QueueError::NotFound(_)) | Err(QueueError::Conflict(_)) => {}
            Err(e) => return err(e),
        }
    }
    Json(json!({ "discarded": n })).into_response()
}

/// What became of the items that ended: done, cancelled or discarded by hand, replayed,
/// superseded… (ULID order, paged with `after`).
async fn outcomes(State(a): State<Admin>, Query(q): Query<ListQuery>) -> Response {
    let after = match q.after.as_deref().map(parse_id).transpose() {
        Ok(a) => a,
        Err(r) => return r,
    };
    let filter = ListFilter {
        flow: q.flow,
        state: Some("finished".into()),
        after,
        limit: q.limit.unwrap_or(100).min(1000),
    };
    match a.queue.admin().list(filter).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => err(e),
    }
}

async fn discard(State(a): State<Admin>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return r,
    };
    match a.queue.admin().discard(id).await {
        Ok(()) => Json(json!({ "discarded": id.to_string() })).into_response(),
        Err(e) => err(e),
    }
}

async fn replay(State(a): State<Admin>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return r,
    };
    match a.queue.admin().replay(id).await {
        Ok(new_id) => {
            Json(json!({ "id": new_id.to_string(), "replayed": id.to_string() })).into_response()
        }
        Err(e) => err(e),
    }
}

async fn flows_ls(State(a): State<Admin>) -> Response {
    let mut out = Vec::new();
    for f in a.flows.all() {
        let paused = match a.queue.pausing().is_paused(&f.flow.id).await {
            Ok(p) => p,
            Err(e) => return err(e),
        };
        let parked = match a.queue.parked_count(&f.flow.id).await {
            Ok(n) => n,
            Err(e) => return err(e),
        };
        out.push(json!({
            "id": f.flow.id,
            "file": f.flow.file,
            "description": f.flow.description,
            "concurrency": f.flow.concurrency,
            "paused": paused,
            "parked": parked,
            "nodes": f.flow.nodes.iter().map(|n| json!({"id": n.id, "type": n.kind})).collect::<Vec<_>>(),
        }));
    }
    Json(out).into_response()
}

async fn flow_action(
    State(a): State<Admin>,
    Path((id, action)): Path<(String, String)>,
) -> Response {
    if a.flows.get(&id).is_none() {
        return no_flow(&id);
    }
    let r = match action.as_str() {
        "pause" => a
            .queue
            .pausing()
            .set_paused(&id, true)
            .await
            .map(|_| json!({ "flow": id, "paused": true })),
        "resume" => a
            .queue
            .pausing()
            .resume(&id)
            .await
            .map(|n| json!({ "flow": id, "paused": false, "released": n })),
        "step" => a
            .queue
            .pausing()
            .unpark_one(&id)
            .await
            .map(|stepped| json!({ "flow": id, "stepped": stepped.map(|s| s.to_string()) })),
        other => {
            return bad(format!(
                "unknown flow action `{other}` (pause, resume, step)"
            ))
        }
    };
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => err(e),
    }
}

async fn dashboard_page(State(a): State<Admin>, headers: axum::http::HeaderMap) -> Response {
    dashboard::page(a.token.is_some(), &a.sessions, &headers)
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

async fn dashboard_login(State(a): State<Admin>, axum::Form(f): axum::Form<LoginForm>) -> Response {
    dashboard::login(
        a.token.as_deref().map(String::as_str),
        &a.sessions,
        &f.token,
    )
}

async fn dashboard_logout(State(a): State<Admin>, headers: axum::http::HeaderMap) -> Response {
    dashboard::logout(&a.sessions, &headers)
}

/// `GET /api/flows/{id}/nodes`: each node's calls and failures in this engine, and what it
/// holds.
async fn flow_nodes(State(a): State<Admin>, Path(id): Path<String>) -> Response {
    let Some(f) = a.flows.get(&id) else {
        return no_flow(&id);
    };
    Json(dashboard::node_figures(&a.queue, &a.held, &f).await).into_response()
}

/// `GET /api/flows/{id}/graph.svg`: the flow drawn, with each node's figures.
async fn flow_graph(State(a): State<Admin>, Path(id): Path<String>) -> Response {
    let Some(f) = a.flows.get(&id) else {
        return no_flow(&id);
    };
    let figures = dashboard::node_figures(&a.queue, &a.held, &f).await;
    (
        [
            (axum::http::header::CONTENT_TYPE, "image/svg+xml"),
            (axum::http::header::CACHE_CONTROL, "no-store"),
        ],
        dashboard::graph_svg(&f, &figures),
    )
        .into_response()
}

fn no_flow(id: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({ "error": format!("no flow `{id}`") })),
    )
        .into_response()
}
