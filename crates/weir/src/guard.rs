//! What the admin listener refuses before any handler runs: a request whose body is too
//! large or that takes too long, and, without an admin token, what a web page could send.
//!
//! Without a token the admin API trusts whoever can reach its loopback address, and a
//! browser on the same machine can reach it too. So: a `Host` that is not a loopback name
//! or the listener's own address is refused (a DNS-rebinding page names its own host), and
//! a change must come from no other site (`Origin`, `Sec-Fetch-Site`) and carry a header
//! that a page cannot send without the engine's consent (`X-Weir-Client`, or a JSON body).

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::HttpLimits;

/// The header the CLI and the dashboard send with every change.
pub const CLIENT_HEADER: &str = "x-weir-client";

/// The admin listener's checks.
#[derive(Clone, Debug)]
pub struct Guard {
    /// The listener's own address, a `Host` always allowed.
    addr: SocketAddr,
    /// The checks against web pages apply when no admin token is set.
    open: bool,
    pub request_timeout: Duration,
    pub max_body: usize,
    pub max_run_input: usize,
}

impl Guard {
    pub fn new(addr: SocketAddr, limits: &HttpLimits, token: bool) -> Guard {
        Guard {
            addr,
            open: !token,
            request_timeout: limits.request_timeout,
            max_body: limits.max_admin_body,
            max_run_input: limits.max_run_input,
        }
    }

    /// The middleware: refuse what a web page could send, then bound the request's time.
    pub async fn check(self, req: Request, next: Next) -> Response {
        if self.open {
            let path = req.uri().path();
            // Probes often name the pod or host; these two say nothing but ok / ready.
            let probe = path == "/healthz" || path == "/readyz";
            if !probe && !self.host_allowed(req.headers()) {
                return refuse(
                    StatusCode::MISDIRECTED_REQUEST,
                    "this engine answers only to a loopback name (localhost, 127.0.0.1, [::1]) \
                     or its own address in the Host header; set WEIR_ADMIN_TOKEN to reach it \
                     under another name",
                );
            }
            if changes(req.method()) {
                if let Err(why) = same_site(req.headers()) {
                    return refuse(StatusCode::FORBIDDEN, why);
                }
            }
        }
        // A body declared too large is refused at its headers, on every route, whether or
        // not the route reads a body; one that grows too large as it comes is refused by
        // the extractor that reads it (`DefaultBodyLimit`), at the limit.
        let limit = if is_run(req.uri().path()) {
            self.max_run_input
        } else {
            self.max_body
        };
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body larger than {limit} bytes"),
            );
        }
        match tokio::time::timeout(self.request_timeout, next.run(req)).await {
            Ok(r) => r,
            Err(_) => refuse(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request did not complete within {:?}",
                    self.request_timeout
                ),
            ),
        }
    }

    fn host_allowed(&self, headers: &HeaderMap) -> bool {
        let Some(host) = headers.get(header::HOST) else {
            // HTTP/1.0 without a Host: not a browser's request.
            return true;
        };
        let Ok(host) = host.to_str() else {
            return false;
        };
        let host = host.trim().to_ascii_lowercase();
        if host == self.addr.to_string() {
            return true;
        }
        let name = match host.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(""),
            None => host.rsplit_once(':').map_or(host.as_str(), |(n, _)| n),
        };
        let name = name.trim_end_matches('.');
        name == "localhost"
            || name.ends_with(".localhost")
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback() || ip == self.addr.ip())
    }
}

/// `POST /api/flows/{id}/runs`, whose body is a run's input.
fn is_run(path: &str) -> bool {
    path.strip_prefix("/api/flows/")
        .and_then(|p| p.strip_suffix("/runs"))
        .is_some_and(|id| !id.is_empty() && !id.contains('/'))
}

fn changes(m: &Method) -> bool {
    !matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// A change comes from this engine's own pages or from a program, never from another site.
fn same_site(headers: &HeaderMap) -> Result<(), String> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = get("sec-fetch-site") {
        if site != "same-origin" && site != "none" {
            return Err(format!(
                "a change sent by a page of another site (Sec-Fetch-Site: {site}) is refused"
            ));
        }
    }
    if let Some(origin) = get("origin") {
        let host = get("host").unwrap_or("");
        let own = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|o| o.eq_ignore_ascii_case(host));
        if !own {
            return Err(format!(
                "a change sent by a page of another origin ({origin}) is refused"
            ));
        }
    }
    let json = get("content-type").is_some_and(|c| {
        c.trim()
            .to_ascii_lowercase()
            .starts_with("application/json")
    });
    if headers.contains_key(CLIENT_HEADER) || json {
        return Ok(());
    }
    Err(
        "a change needs the header `X-Weir-Client: <who>` or a JSON body \
         (`Content-Type: application/json`), which a web page cannot send here; \
         the weir CLI and the dashboard send it"
            .into(),
    )
}

fn refuse(status: StatusCode, msg: impl Into<String>) -> Response {
    metrics::counter!("weir_admin_refused_total", "status" => status.as_u16().to_string())
        .increment(1);
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(addr: &str) -> Guard {
        Guard::new(addr.parse().unwrap(), &HttpLimits::default(), false)
    }

    fn with(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn loopback_names_and_the_own_address_are_the_hosts_allowed() {
        let g = guard("127.0.0.1:8080");
        for ok in [
            "localhost:8080",
            "127.0.0.1:8080",
            "127.0.0.2",
            "[::1]:8080",
            "LOCALHOST",
            "app.localhost:8080",
        ] {
            assert!(g.host_allowed(&with(&[("host", ok)])), "{ok}");
        }
        for no in [
            "evil.example:8080",
            "localhost.evil.example",
            "10.0.0.1:8080",
            "",
        ] {
            assert!(!g.host_allowed(&with(&[("host", no)])), "{no}");
        }
    }

    #[test]
    fn a_change_needs_the_client_header_and_no_other_site() {
        assert!(same_site(&with(&[("x-weir-client", "cli")])).is_ok());
        assert!(same_site(&with(&[("content-type", "application/json")])).is_ok());
        // What a cross-site form or `fetch` without preflight can send.
        assert!(same_site(&with(&[("content-type", "text/plain")])).is_err());
        assert!(same_site(&with(&[
            ("x-weir-client", "x"),
            ("sec-fetch-site", "cross-site")
        ]))
        .is_err());
        assert!(same_site(&with(&[
            ("x-weir-client", "x"),
            ("host", "127.0.0.1:8080"),
            ("origin", "http://evil.example")
        ]))
        .is_err());
        assert!(same_site(&with(&[
            ("x-weir-client", "dashboard"),
            ("host", "127.0.0.1:8080"),
            ("origin", "http://127.0.0.1:8080"),
            ("sec-fetch-site", "same-origin")
        ]))
        .is_ok());
    }
}
