//! The dashboard at `/`: the flows drawn as graphs (SVG rendered here), the queue as it
//! stands, runs, and the buttons of the admin API. No build step and no CDN: the page, its
//! script and its style are compiled into the binary, and it works with no internet.
//!
//! With an admin token set, the page asks for it once and keeps a session: a cookie
//! (`HttpOnly`, `SameSite=Strict`) that the admin API accepts in place of the bearer token,
//! and a CSRF token the page sends with every request that changes something
//! (`X-CSRF-Token`). Sessions live in this engine's memory for 12 hours.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use serde_json::{json, Value};
use weir_exec::FlowRt;
use weir_queue::Queue;

const PAGE: &str = include_str!("page.html");
const LOGIN: &str = include_str!("login.html");
pub(crate) const SCRIPT: &str = include_str!("app.js");
pub(crate) const STYLE: &str = include_str!("style.css");

pub(crate) const COOKIE: &str = "weir_session";
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most; past it the oldest is dropped (its browser logs in again).
const SESSIONS_KEPT: usize = 1000;

struct Session {
    csrf: String,
    until: Instant,
}

/// The dashboard's login sessions, by cookie.
#[derive(Default)]
pub(crate) struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

/// 32 random bytes from the operating system's generator, as hex.
fn secret() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

impl Sessions {
    /// A new session: its id (the cookie) and its CSRF token. Expired sessions go first;
    /// past the bound, the one that expires soonest (the oldest) makes room.
    pub(crate) fn open(&self) -> (String, String) {
        let (id, csrf) = (secret(), secret());
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        m.retain(|_, s| s.until > now);
        if m.len() >= SESSIONS_KEPT {
            if let Some(oldest) = m
                .iter()
                .min_by_key(|(_, s)| s.until)
                .map(|(k, _)| k.clone())
            {
                m.remove(&oldest);
            }
        }
        m.insert(
            id.clone(),
            Session {
                csrf: csrf.clone(),
                until: now + SESSION_TTL,
            },
        );
        (id, csrf)
    }

    /// The CSRF token of the live session the request's cookie names.
    pub(crate) fn csrf_of(&self, headers: &HeaderMap) -> Option<String> {
        let id = cookie(headers, COOKIE)?;
        let m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&id)
            .filter(|s| s.until > Instant::now())
            .map(|s| s.csrf.clone())
    }

    pub(crate) fn close(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers, COOKIE) {
            self.map
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
    }
}

fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// Whether a request that authenticates by its session cookie may go on: reads always, a
/// change only with the session's CSRF token in `X-CSRF-Token`.
pub(crate) fn session_allows(sessions: &Sessions, method: &Method, headers: &HeaderMap) -> bool {
    use subtle::ConstantTimeEq;
    let Some(csrf) = sessions.csrf_of(headers) else {
        return false;
    };
    if matches!(*method, Method::GET | Method::HEAD) {
        return true;
    }
    let given = headers
        .get("x-csrf-token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    bool::from(given.as_bytes().ct_eq(csrf.as_bytes()))
}

/// `GET /`: the dashboard, or the login form when a token is set and there is no session.
pub(crate) fn page(token_set: bool, sessions: &Sessions, headers: &HeaderMap) -> Response {
    let csrf = match (token_set, sessions.csrf_of(headers)) {
        (false, _) => String::new(),
        (true, Some(c)) => c,
        (true, None) => return login_page(None, StatusCode::OK),
    };
    let html = PAGE.replace("__CSRF__", &csrf);
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'",
            ),
        ],
        Html(html),
    )
        .into_response()
}

pub(crate) fn login_page(error: Option<&str>, status: StatusCode) -> Response {
    let msg = error
        .map(|e| format!("<p class=\"error\" role=\"alert\">{}</p>", escape(e)))
        .unwrap_or_default();
    (
        status,
        [(header::CACHE_CONTROL, "no-store")],
        Html(LOGIN.replace("__ERROR__", &msg)),
    )
        .into_response()
}

/// `POST /ui/login` with the admin token: a session cookie, and back to the dashboard.
pub(crate) fn login(token: Option<&str>, sessions: &Sessions, given: &str) -> Response {
    use subtle::ConstantTimeEq;
    let Some(want) = token else {
        return redirect_home(None);
    };
    if !bool::from(given.trim().as_bytes().ct_eq(want.as_bytes())) {
        return login_page(
            Some("That is not the admin token (WEIR_ADMIN_TOKEN)."),
            StatusCode::UNAUTHORIZED,
        );
    }
    let (id, _) = sessions.open();
    redirect_home(Some(format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
        SESSION_TTL.as_secs()
    )))
}

pub(crate) fn logout(sessions: &Sessions, headers: &HeaderMap) -> Response {
    sessions.close(headers);
    redirect_home(Some(format!(
        "{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"
    )))
}

fn redirect_home(cookie: Option<String>) -> Response {
    let mut r = (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
    if let Some(c) = cookie.and_then(|c| c.parse().ok()) {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    r
}

pub(crate) fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// What each flow's nodes hold, as last counted: the dashboard asks every second or two per
/// viewer, the queue is asked at most every [`HELD_FOR`] per flow.
#[derive(Default)]
pub(crate) struct Held(Mutex<HashMap<String, Counted>>);

/// When a flow's holdings were counted, and what each node held.
type Counted = (Instant, BTreeMap<String, u64>);

/// How long a count of what nodes hold is shown before it is asked again.
const HELD_FOR: Duration = Duration::from_secs(3);

impl Held {
    /// What `f`'s nodes hold: messages a rate limit holds back, timers of a delay waiting
    /// in the queue. Counted by the queue, never listed.
    async fn of(&self, queue: &Queue, f: &FlowRt) -> BTreeMap<String, u64> {
        let flow = &f.flow;
        if let Some((at, held)) = self.lock().get(&flow.id) {
            if at.elapsed() < HELD_FOR {
                return held.clone();
            }
        }
        let mut held = queue
            .admin()
            .delayed_by_node(&flow.id)
            .await
            .unwrap_or_default();
        for n in &flow.nodes {
            if n.kind == "rate-limit" {
                if let Ok(k) = queue.count_node_keys(&flow.id, &n.id, "held/").await {
                    *held.entry(n.id.clone()).or_default() += k as u64;
                }
            }
        }
        // One entry per flow asked about (only loaded flows are); flows removed by reloads
        // would add up, so past a bound the counts start over.
        let mut all = self.lock();
        if all.len() >= 10_000 {
            all.clear();
        }
        all.insert(flow.id.clone(), (Instant::now(), held.clone()));
        held
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Counted>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the dashboard shows of each node: its calls and failures in this engine, and what
/// it holds (messages a rate limit holds back, timers of a delay waiting in the queue).
pub(crate) async fn node_figures(queue: &Queue, held: &Held, f: &FlowRt) -> Vec<Value> {
    let flow = &f.flow;
    let held = held.of(queue, f).await;
    let triggers: std::collections::HashSet<&str> = flow.triggers().map(|(n, _)| n).collect();
    flow.nodes
        .iter()
        .zip(&f.counts)
        .map(|(n, c)| {
            json!({
                "id": n.id,
                "type": n.kind,
                "trigger": triggers.contains(n.id.as_str()),
                "calls": c.calls.load(Ordering::Relaxed),
                "failures": c.failures.load(Ordering::Relaxed),
                "held": held.get(&n.id).copied().unwrap_or(0),
            })
        })
        .collect()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

const BOX_W: f64 = 168.0;
const BOX_H: f64 = 58.0;
const GAP_X: f64 = 64.0;
const GAP_Y: f64 = 22.0;
const PAD: f64 = 12.0;

/// The flow as an SVG picture: triggers in the leftmost column, every other node one column
/// right of the nearest node wired to it, wires as curves from output to input (a wire back
/// to an earlier column loops under the boxes). Each node shows its id, type and figures,
/// and is coloured by what it is: a trigger, a timer (delay, rate limit), a side effect
/// (a call, a publish, an answer, a log line), or a step of logic.
pub(crate) fn graph_svg(f: &FlowRt, figures: &[Value]) -> String {
    use petgraph::visit::EdgeRef;
    let flow = &f.flow;
    let g = &flow.graph.graph;
    let n = flow.nodes.len();
    // Columns: breadth-first from the triggers (and from nodes nothing is wired to).
    let triggers: std::collections::HashSet<&str> = flow.triggers().map(|(n, _)| n).collect();
    let mut col: Vec<Option<usize>> = vec![None; n];
    let mut queue = VecDeque::new();
    for (i, node) in flow.nodes.iter().enumerate() {
        let fed = g
            .edges_directed(
                petgraph::graph::NodeIndex::new(i),
                petgraph::Direction::Incoming,
            )
            .next()
            .is_some();
        if triggers.contains(node.id.as_str()) || !fed {
            col[i] = Some(0);
            queue.push_back(i);
        }
    }
    while let Some(i) = queue.pop_front() {
        let c = col[i].unwrap_or(0);
        for e in g.edges(petgraph::graph::NodeIndex::new(i)) {
            let t = e.target().index();
            if col[t].is_none() {
                col[t] = Some(c + 1);
                queue.push_back(t);
            }
        }
    }
    // Nodes only reachable through a loop: after everything else.
    let last = col.iter().flatten().max().copied().unwrap_or(0);
    let col: Vec<usize> = col.into_iter().map(|c| c.unwrap_or(last + 1)).collect();
    let mut rows: BTreeMap<usize, usize> = BTreeMap::new();
    let mut pos = Vec::with_capacity(n);
    for &c in &col {
        let r = rows.entry(c).or_insert(0);
        pos.push((
            PAD + c as f64 * (BOX_W + GAP_X),
            PAD + *r as f64 * (BOX_H + GAP_Y),
        ));
        *r += 1;
    }
    let cols = rows.keys().max().map(|c| c + 1).unwrap_or(1);
    let most = rows.values().max().copied().unwrap_or(1);
    let width = 2.0 * PAD + cols as f64 * BOX_W + (cols - 1) as f64 * GAP_X;
    let height = 2.0 * PAD + most as f64 * BOX_H + (most - 1) as f64 * GAP_Y + 24.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="graph" data-flow="{}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" aria-label="flow {}">"#,
        escape(&flow.id),
        escape(&flow.id)
    );
    s.push_str(r#"<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" class="arrowhead"/></marker></defs>"#);
    for e in g.edge_references() {
        let (a, b) = (e.source().index(), e.target().index());
        let ports = flow
            .graph
            .graph
            .edges(e.source())
            .map(|e| *e.weight())
            .max()
            .unwrap_or(0)
            + 1;
        let port = *e.weight();
        let (ax, ay) = (
            pos[a].0 + BOX_W,
            pos[a].1 + BOX_H * (port as f64 + 1.0) / (ports as f64 + 1.0),
        );
        let (bx, by) = (pos[b].0, pos[b].1 + BOX_H / 2.0);
        let d = if col[b] > col[a] {
            let mid = (ax + bx) / 2.0;
            format!("M{ax},{ay} C{mid},{ay} {mid},{by} {bx},{by}")
        } else {
            // Back to an earlier column (a loop): under the boxes.
            let low = height - 8.0;
            format!(
                "M{ax},{ay} C{},{low} {},{low} {bx},{by}",
                ax + GAP_X,
                bx - GAP_X
            )
        };
        let _ = write!(
            s,
            r#"<path class="wire" d="{d}" marker-end="url(#arrow)" data-from="{}" data-to="{}"/>"#,
            escape(&flow.nodes[a].id),
            escape(&flow.nodes[b].id)
        );
    }
    for (i, node) in flow.nodes.iter().enumerate() {
        let (x, y) = pos[i];
        let fig = figures.get(i).cloned().unwrap_or(Value::Null);
        let num = |k: &str| fig[k].as_u64().unwrap_or(0);
        let class = if triggers.contains(node.id.as_str()) {
            "node trigger"
        } else {
            match node.kind.as_str() {
                "delay" | "rate-limit" => "node timing",
                "http-request" | "http-response" | "mqtt-out" | "log" => "node effect",
                _ => "node",
            }
        };
        let failed = if num("failures") > 0 { " failed" } else { "" };
        let held = num("held");
        let _ = write!(
            s,
            r#"<g class="{class}{failed}" data-node="{id}" data-type="{kind}" transform="translate({x},{y})"><title>{id} ({kind}): {calls} calls, {fails} failures, {held} held</title><rect width="{BOX_W}" height="{BOX_H}" rx="7"/><text class="id" x="10" y="20">{id}</text><text class="kind" x="10" y="35">{kind}</text><text class="figures" x="10" y="50">{calls} runs · {fails} failed{held_text}</text></g>"#,
            id = escape(&node.id),
            kind = escape(&node.kind),
            calls = num("calls"),
            fails = num("failures"),
            held_text = if held > 0 {
                format!(" · {held} held")
            } else {
                String::new()
            },
        );
    }
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn cookies_are_read_by_name() {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            axum::http::header::COOKIE,
            "a=1; weir_session=abc; b=2".parse().unwrap(),
        );
        assert_eq!(super::cookie(&h, "weir_session").as_deref(), Some("abc"));
        assert_eq!(super::cookie(&h, "c"), None);
    }

    #[test]
    fn a_session_reads_freely_and_changes_only_with_its_csrf_token() {
        use axum::http::{HeaderMap, Method};
        let s = super::Sessions::default();
        let (id, csrf) = s.open();
        let mut h = HeaderMap::new();
        h.insert(
            axum::http::header::COOKIE,
            format!("weir_session={id}").parse().unwrap(),
        );
        assert!(super::session_allows(&s, &Method::GET, &h));
        assert!(!super::session_allows(&s, &Method::POST, &h));
        h.insert("x-csrf-token", "wrong".parse().unwrap());
        assert!(!super::session_allows(&s, &Method::POST, &h));
        h.insert("x-csrf-token", csrf.parse().unwrap());
        assert!(super::session_allows(&s, &Method::POST, &h));
        s.close(&h);
        assert!(!super::session_allows(&s, &Method::GET, &h), "closed");
        assert_ne!(super::secret(), super::secret());
    }

    #[test]
    fn past_the_bound_the_oldest_session_makes_room() {
        use axum::http::{HeaderMap, Method};
        let s = super::Sessions::default();
        let cookie = |id: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                axum::http::header::COOKIE,
                format!("weir_session={id}").parse().unwrap(),
            );
            h
        };
        let (first, _) = s.open();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let (second, _) = s.open();
        for _ in 2..super::SESSIONS_KEPT + 1 {
            s.open();
        }
        assert_eq!(s.map.lock().unwrap().len(), super::SESSIONS_KEPT);
        assert!(!super::session_allows(&s, &Method::GET, &cookie(&first)));
        assert!(super::session_allows(&s, &Method::GET, &cookie(&second)));
    }
}
