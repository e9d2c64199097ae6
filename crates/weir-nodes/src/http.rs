//! `http-request` (a side effect: status classifies failures) and `http-response` (the answer
//! to a `respond: wave` webhook).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use weir_core::redact;
use weir_core::Message;
use weir_flow::{Spanned, Yaml};
use weir_queue::{Reply, ReplyBody};

use crate::duration::Dur;
use crate::script::{self, Template};
use crate::{config, Built, ConfigError, Emit, Node, NodeCx, NodeError, NodeFactory, Wires};

/// The client of nodes without headers of their own: redirects followed (up to 10).
fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .unwrap_or_default()
    })
}

/// The client of nodes that send headers of their own, which may hold secrets (`X-Api-Key:
/// ${KEY}`): a redirect is followed only within the origin the node named, so the headers
/// never reach another server. (reqwest drops only `Authorization` and cookies.)
fn same_origin_client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let policy = reqwest::redirect::Policy::custom(|a| {
            let first = a.previous().first().map(|u| u.origin());
            if a.previous().len() > 10 {
                a.error("more than 10 redirects")
            } else if first.is_some_and(|o| o != a.url().origin()) {
                a.stop()
            } else {
                a.follow()
            }
        });
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .redirect(policy)
            .build()
            .unwrap_or_default()
    })
}

/// The largest answer a request reads by default (`max_response`).
const MAX_RESPONSE: usize = 10 << 20;

/// How much of an answer's body a failure's reason quotes.
const REASON_BODY: usize = 512;

/// `text`, cut to at most `n` bytes at a character boundary, with a mark where it was cut.
fn clip(text: &str, n: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= n {
        return text.into();
    }
    let mut end = n;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len()).into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestConfig {
    /// The URL; `{{ expr }}` parts are evaluated per message.
    url: Spanned<String>,
    #[serde(default = "post")]
    method: Spanned<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    timeout: Option<Dur>,
    /// The largest answer read, in bytes; a larger one fails the message.
    #[serde(default = "max_response")]
    max_response: usize,
    #[serde(default)]
    to: Wires,
}

fn max_response() -> usize {
    MAX_RESPONSE
}

fn post() -> Spanned<String> {
    Spanned {
        pos: Default::default(),
        value: "POST".into(),
    }
}

pub struct RequestFactory;

impl NodeFactory for RequestFactory {
    fn kind(&self) -> &str {
        "http-request"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: RequestConfig = config(y)?;
        let mut errors = Vec::new();
        let url = Template::compile(&c.url, c.url.pos)
            .map_err(|e| errors.push(e))
            .ok();
        if let Some(u) = &url {
            if u.is_literal() && reqwest::Url::parse(&c.url).is_err() {
                errors.push(ConfigError::at(
                    c.url.pos,
                    format!("`{}` is not a URL", c.url.value),
                ));
            }
        }
        let method = reqwest::Method::from_bytes(c.method.to_uppercase().as_bytes())
            .map_err(|_| {
                errors.push(ConfigError::at(
                    c.method.pos,
                    format!("`{}` is not an HTTP method", c.method.value),
                ))
            })
            .ok();
        let timeout = match &c.timeout {
            Some(d) => d.get().map_err(|e| errors.push(e)).ok(),
            None => Some(Duration::from_secs(30)),
        };
        match (url, method, timeout) {
            (Some(url), Some(method), Some(timeout)) if errors.is_empty() => Ok(Built {
                node: Arc::new(Request {
                    url,
                    method,
                    headers: c.headers,
                    timeout,
                    max_response: c.max_response,
                }),
                ports: vec![c.to.0],
            }),
            _ => Err(errors),
        }
    }
}

struct Request {
    url: Template,
    method: reqwest::Method,
    headers: BTreeMap<String, String>,
    timeout: Duration,
    max_response: usize,
}

#[async_trait::async_trait]
impl Node for Request {
    fn side_effect(&self) -> bool {
        true
    }

    async fn call(&self, mut msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        let url = script::running(cx, || self.url.render(&msg))?;
        let client = match self.headers.is_empty() {
            true => client(),
            false => same_origin_client(),
        };
        let mut req = client
            .request(self.method.clone(), &url)
            .timeout(self.timeout)
            .header("x-weir-item", cx.item.root_id().to_string());
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        if self.method != reqwest::Method::GET {
            req = req.json(msg.get("payload").unwrap_or(&Value::Null));
        }
        let resp = req.send().await.map_err(|e| {
            let (url, e) = (redact::url(&url), e.without_url());
            NodeError::transient(format!("{} {url}: {e}", self.method))
        })?;
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse::<u64>().ok())
            .map(Duration::from_secs);
        if status.is_redirection() {
            return Err(NodeError::Permanent(format!(
                "{} {} answered {status}, a redirect not followed (to another origin, which \
                 the node's headers may not reach, or without a Location)",
                self.method,
                redact::url(&url)
            )));
        }
        let too_large = || {
            NodeError::Permanent(format!(
                "{} {}: the answer is larger than max_response ({} bytes)",
                self.method,
                redact::url(&url),
                self.max_response
            ))
        };
        if resp
            .content_length()
            .is_some_and(|n| n > self.max_response as u64)
        {
            return Err(too_large());
        }
        // Read as it comes, never past the bound: a declared length may be absent or wrong.
        let mut bytes = Vec::new();
        let mut resp = resp;
        loop {
            let chunk = resp.chunk().await.map_err(|e| {
                let (url, e) = (redact::url(&url), e.without_url());
                NodeError::transient(format!("{url}: reading the answer: {e}"))
            })?;
            let Some(chunk) = chunk else { break };
            if bytes.len() + chunk.len() > self.max_response {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        let body = serde_json::from_slice::<Value>(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        if status.is_server_error()
            || status == reqwest::StatusCode::TOO_MANY_REQUESTS
            || status == reqwest::StatusCode::REQUEST_TIMEOUT
        {
            return Err(NodeError::Transient {
                reason: format!("{} {} answered {status}", self.method, redact::url(&url)),
                retry_after,
            });
        }
        if status.is_client_error() {
            return Err(NodeError::Permanent(format!(
                "{} {} answered {status}: {}",
                self.method,
                redact::url(&url),
                clip(&body.to_string(), REASON_BODY)
            )));
        }
        if let Some(o) = msg.as_object_mut() {
            o.insert("payload".into(), body);
            o.insert("status".into(), status.as_u16().into());
        }
        Ok(Emit::one(msg))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_reason_quotes_at_most_its_share_of_a_body() {
        assert_eq!(super::clip("short", 10), "short");
        let long = "é".repeat(400);
        let c = super::clip(&long, 15);
        assert_eq!(c, format!("{}… (800 bytes)", "é".repeat(7)));
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponseConfig {
    #[serde(default = "ok")]
    status: u16,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    to: Wires,
}

fn ok() -> u16 {
    200
}

pub struct ResponseFactory;

impl NodeFactory for ResponseFactory {
    fn kind(&self) -> &str {
        "http-response"
    }

    fn build(&self, y: &Yaml) -> Result<Built, Vec<ConfigError>> {
        let c: ResponseConfig = config(y)?;
        if !(100..=599).contains(&c.status) {
            let pos = y.get("status").map(|(_, v)| v.pos).unwrap_or(y.pos);
            return Err(vec![ConfigError::at(
                pos,
                "`status` is an HTTP status, 100 to 599",
            )]);
        }
        Ok(Built {
            node: Arc::new(Response {
                status: c.status,
                headers: c.headers.into_iter().collect(),
            }),
            ports: vec![c.to.0],
        })
    }
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
}

#[async_trait::async_trait]
impl Node for Response {
    async fn call(&self, msg: Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        self.answer(&msg, cx);
        Ok(Emit::one(msg))
    }

    /// The answer is the payload's JSON text, written from the message as it is lent; the
    /// message goes on only where it is wired.
    async fn call_borrowed(&self, msg: &Message, cx: &mut NodeCx<'_>) -> Result<Emit, NodeError> {
        self.answer(msg, cx);
        Ok(cx.pass_on(msg))
    }
}

impl Response {
    fn answer(&self, msg: &Message, cx: &mut NodeCx<'_>) {
        cx.reply(Reply {
            status: self.status,
            headers: self.headers.clone(),
            body: ReplyBody::of(msg.get("payload").unwrap_or(&Value::Null)),
        });
    }
}
