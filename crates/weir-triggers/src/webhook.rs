//! Webhooks: `POST /hooks/<path>` journals a cascade item, then answers `202 {"id": ...}` —
//! or, with `respond: wave`, waits (bounded) for the wave's `http-response`.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::{Json, Router};
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use weir_queue::{Queue, QueueError, WorkItem};

use crate::spec::{Auth, Source, Trigger, WebhookSpec};
use crate::start::StartHere;
use crate::Intake;

struct Hook {
    flow: String,
    node: String,
    spec: WebhookSpec,
    /// `weir_events_total` for this flow, made at the first event (after the engine has
    /// installed its recorder) and kept: no look-up by labels per request.
    events: std::sync::OnceLock<metrics::Counter>,
}

/// Hooks by path, looked up for every request.
type Table = HashMap<String, Vec<Hook>, foldhash::fast::RandomState>;

/// Header names known at build time, so no request parses them again.
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const X_WEIR_ITEM: HeaderName = HeaderName::from_static("x-weir-item");

/// The webhook routes now in force; [`Routes::rebuild`] swaps in a new flow set's (reload).
#[derive(Clone, Default)]
pub struct Routes(Arc<std::sync::RwLock<Arc<Table>>>);

impl Routes {
    /// Take the routes from every webhook among `sources`.
    pub fn rebuild(&self, sources: &[Source]) {
        let mut routes: Table = HashMap::default();
        for s in sources {
            if let Trigger::Webhook(spec) = &s.trigger {
                routes.entry(spec.path.clone()).or_default().push(Hook {
                    flow: s.flow.clone(),
                    node: s.node.clone(),
                    spec: spec.clone(),
                    events: Default::default(),
                });
            }
        }
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(routes);
    }

    fn now(&self) -> Arc<Table> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[derive(Clone)]
struct Hooks {
    queue: Queue,
    routes: Routes,
    intake: Intake,
    /// The engine's executor, when requests may start their own waves.
    start: Option<Arc<dyn StartHere>>,
    /// How long a request's body may take to arrive.
    body_timeout: std::time::Duration,
}

/// The `/hooks/*` routes for every webhook among `sources`, and the handle that changes
/// them. With `start`, a request whose wave can start at once starts it as soon as it is
/// journaled ([`StartHere`]), not after a claim: a `respond: wave` request runs it in its own
/// task as far as the reply, an accepted one hands it to a task of its own. A body that has
/// not arrived whole within `body_timeout` is answered 408.
pub fn router(
    queue: Queue,
    sources: &[Source],
    intake: Intake,
    start: Option<Arc<dyn StartHere>>,
    body_timeout: std::time::Duration,
) -> (Router, Routes) {
    let routes = Routes::default();
    routes.rebuild(sources);
    let state = Hooks {
        queue,
        routes: routes.clone(),
        intake,
        start,
        body_timeout,
    };
    let r = Router::new()
        .route("/hooks/{*path}", any(handle))
        .with_state(state);
    (r, routes)
}

/// A response of JSON text made already, built directly: through axum's tuple parts the
/// text first got a text/plain content type that the JSON one then replaced.
fn json_text(status: StatusCode, text: String) -> Response {
    let mut r = Response::new(Body::from(text));
    *r.status_mut() = status;
    r.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

/// Every webhook answer; a refused one is counted by its status (413 too large, 429 queue
/// full, 401 unauthorized, 503 not journaled…), so a bound being hit shows in the metrics.
/// A flow's answer is served from the engine's own origin, beside the dashboard: it is
/// never sniffed into another type and, should it be HTML, runs in a sandbox with no
/// access to that origin.
async fn handle(
    state: State<Hooks>,
    path: Path<String>,
    method: Method,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut r = accept(state, path, method, headers, body).await;
    let status = r.status();
    if status.is_client_error() || status.is_server_error() {
        metrics::counter!("weir_webhook_refused_total", "status" => status.as_u16().to_string())
            .increment(1);
    }
    let h = r.headers_mut();
    h.insert(
        axum::http::header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        axum::http::header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("sandbox"),
    );
    r
}

async fn accept(
    State(s): State<Hooks>,
    Path(path): Path<String>,
    method: Method,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path = path.trim_matches('/').to_string();
    let table = s.routes.now();
    let Some(hooks) = table.get(&path) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no webhook at /hooks/{path}"),
        );
    };
    let Some(hook) = hooks.iter().find(|h| h.spec.method == method.as_str()) else {
        let allowed: Vec<&str> = hooks.iter().map(|h| h.spec.method.as_str()).collect();
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("/hooks/{path} takes {}", allowed.join(", ")),
        );
    };
    if !s.intake.is_open() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting down; try again shortly",
        );
    }
    // A bearer token is checked before the body is read: a client without it costs no
    // more than its headers. A signature covers the body, so it is checked after.
    if let Some(auth @ Auth::Bearer { .. }) = &hook.spec.auth {
        if !authorized(auth, &headers, &[]) {
            return error(StatusCode::UNAUTHORIZED, "missing or wrong credentials");
        }
    }
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > hook.spec.max_body as u64) {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body larger than {} bytes", hook.spec.max_body),
        );
    }
    let bytes = match tokio::time::timeout(s.body_timeout, to_bytes(body, hook.spec.max_body)).await
    {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body larger than {} bytes", hook.spec.max_body),
            )
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {:?}", s.body_timeout),
            )
        }
    };
    if let Some(auth @ Auth::Hmac { .. }) = &hook.spec.auth {
        if !authorized(auth, &headers, &bytes) {
            return error(StatusCode::UNAUTHORIZED, "missing or wrong credentials");
        }
    }
    let payload = match decode(&headers, &bytes) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let cause = ["webhook:", &path].concat();
    // Built by hand: `json!` would copy the payload through its serializer (`to_value`).
    let mut msg = serde_json::Map::new();
    msg.insert("payload".into(), payload);
    msg.insert("topic".into(), Value::String(path.clone()));
    let msg = Value::Object(msg);
    let item = WorkItem::cascade(&hook.flow, &hook.node, cause, vec![msg]);
    let id = item.id;
    // A wave started here: run below, in this task, until its reply; what is left of it (all
    // of it, for a 202) goes on as a task of its own when it is dropped.
    let mut wave = None;
    let key = match headers.get(IDEMPOTENCY_KEY).map(|v| v.as_bytes()) {
        None => None,
        Some([]) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the Idempotency-Key header is empty",
            )
        }
        Some(k) if k.len() > MAX_IDEMPOTENCY_KEY => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "the Idempotency-Key is {} bytes; at most {MAX_IDEMPOTENCY_KEY}",
                    k.len()
                ),
            )
        }
        Some(k) => Some(idempotency_key(&hook.flow, &hook.node, k)),
    };
    let added = match key {
        Some(key) => s.queue.add_idempotent(&key, item).await.map(|(id, _)| id),
        None => match &s.start {
            // Journaled claimed where it can be, the wave starts here: it does not wait for
            // the executor to be handed the item and to start it.
            Some(start) => start.journal_and_start(item).await.map(|started| {
                wave = started;
                id
            }),
            None => s.queue.add(vec![item]).await.map(|_| id),
        },
    };
    let id = match added {
        Ok(id) => {
            hook.events
                .get_or_init(|| {
                    metrics::counter!("weir_events_total", "trigger" => "webhook", "flow" => hook.flow.clone())
                })
                .increment(1);
            id
        }
        Err(QueueError::Full(n)) => {
            let mut r = error(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the queue is full ({n} items waiting); try again later"),
            );
            r.headers_mut()
                .insert("retry-after", HeaderValue::from_static("1"));
            return r;
        }
        Err(e) => {
            tracing::warn!(error = %e, path, "webhook not journaled");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not accepted, nothing journaled: {e}"),
            );
        }
    };
    if !hook.spec.respond_wave {
        // `{"id":"…"}` written out: an id needs no escaping, and a JSON value built, then
        // serialized and dropped, is work for nothing.
        let mut text = [0; ulid::ULID_LEN];
        let body = [r#"{"id":""#, id.array_to_str(&mut text), r#""}"#].concat();
        // A wave started here runs as a task of its own from here (`StartedWave`'s drop).
        drop(wave);
        return json_text(StatusCode::ACCEPTED, body);
    }
    let reply = s.queue.wait_reply(id, hook.spec.timeout);
    let reply = match wave.as_mut() {
        None => reply.await,
        // The wave runs in this task until its reply is posted, with no hand-off to another
        // task and back; what is left of it (its commit) goes on as a task of its own when
        // `wave` is dropped, as it is if the client hangs up first.
        Some(w) => w.run_until(reply).await,
    };
    drop(wave);
    match reply {
        Ok(Some(reply)) => {
            // A string is answered as text; any other body as the JSON text it already is.
            let mut r = match reply.body.text() {
                Some(s) => s.into_response(),
                None => json_text(StatusCode::OK, reply.body.into_json()),
            };
            *r.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
            for (k, v) in reply.headers {
                if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
                    r.headers_mut().insert(k, v);
                }
            }
            let mut text = [0; ulid::ULID_LEN];
            r.headers_mut().insert(
                X_WEIR_ITEM,
                HeaderValue::from_str(id.array_to_str(&mut text))
                    .unwrap_or(HeaderValue::from_static("")),
            );
            r
        }
        Ok(None) => (
            StatusCode::GATEWAY_TIMEOUT,
            Json(json!({
                "id": id.to_string(),
                "error": format!("no http-response within {:?}; the event was accepted and its wave goes on", hook.spec.timeout),
            })),
        )
            .into_response(),
        Err(e) => (
            StatusCode::GATEWAY_TIMEOUT,
            Json(json!({ "id": id.to_string(), "error": e.to_string() })),
        )
            .into_response(),
    }
}

/// How far a signed `X-Weir-Timestamp` may be from the engine's clock, either way.
const TIMESTAMP_SKEW_SECS: i64 = 300;

/// The longest `Idempotency-Key` taken (as Stripe's API takes).
const MAX_IDEMPOTENCY_KEY: usize = 255;

/// What the queue keeps of a request's idempotency key: its flow and node, and a hash of its
/// bytes, whatever they are. A key of any length or alphabet costs the same to keep, and a
/// client's own identifiers are not stored in the clear.
pub fn idempotency_key(flow: &str, node: &str, key: &[u8]) -> String {
    use sha2::Digest;
    let hash = Sha256::digest(key);
    let mut out = String::with_capacity(flow.len() + node.len() + 2 + 64);
    out.push_str(flow);
    out.push(':');
    out.push_str(node);
    out.push(':');
    for b in hash {
        use std::fmt::Write;
        let _ = write!(out, "{b:02x}");
    }
    out
}

fn authorized(auth: &Auth, headers: &HeaderMap, body: &[u8]) -> bool {
    match auth {
        Auth::Bearer { secret } => headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| bool::from(t.as_bytes().ct_eq(secret.as_bytes()))),
        Auth::Hmac { secret, timestamp } => {
            let Some(sig) = headers
                .get("x-weir-signature")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("sha256="))
            else {
                return false;
            };
            let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
                return false;
            };
            if *timestamp {
                let Some(at) = headers
                    .get("x-weir-timestamp")
                    .and_then(|v| v.to_str().ok())
                    .filter(|v| v.bytes().all(|b| b.is_ascii_digit()))
                else {
                    return false;
                };
                let now = weir_core::now_ms() / 1000;
                if !at
                    .parse::<i64>()
                    .is_ok_and(|t| (now - t).abs() <= TIMESTAMP_SKEW_SECS)
                {
                    return false;
                }
                mac.update(at.as_bytes());
                mac.update(b".");
            }
            mac.update(body);
            let want: String = mac
                .finalize()
                .into_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            bool::from(want.as_bytes().ct_eq(sig.to_ascii_lowercase().as_bytes()))
        }
    }
}

/// A JSON body becomes the payload; other UTF-8 text becomes a string; anything else is 415.
#[allow(clippy::result_large_err)]
pub fn decode(headers: &HeaderMap, bytes: &[u8]) -> Result<Value, Response> {
    if bytes.is_empty() {
        return Ok(Value::Null);
    }
    let ct = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let is_json = ct.starts_with("application/json") || ct.contains("+json");
    if is_json {
        return serde_json::from_slice(bytes)
            .map_err(|e| error(StatusCode::BAD_REQUEST, format!("malformed JSON body: {e}")));
    }
    match std::str::from_utf8(bytes) {
        Ok(s) => Ok(Value::String(s.to_string())),
        Err(_) => Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the body is neither JSON nor UTF-8 text",
        )),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_idempotency_key_is_kept_as_a_hash_of_any_bytes() {
        let k = super::idempotency_key("orders", "hook", "заказ-7".as_bytes());
        assert!(k.starts_with("orders:hook:"));
        assert_eq!(k.len(), "orders:hook:".len() + 64);
        assert!(!k.contains("заказ"));
        assert_eq!(
            k,
            super::idempotency_key("orders", "hook", "заказ-7".as_bytes())
        );
        assert_ne!(k, super::idempotency_key("orders", "hook", b"order-7"));
        assert_ne!(
            k,
            super::idempotency_key("orders", "other", "заказ-7".as_bytes())
        );
    }
}
