//! Opening the queue a URL names, with weir's settings taken out of its query.

use std::time::Duration;

use weir_core::{duration, redact};

use crate::{Failpoints, MemoryQueue, Queue, QueueError, RedisOptions, RedisQueue, SqliteQueue};

/// The queue a URL names: `memory`, `sqlite:PATH` (or a path ending in `.db`),
/// `redis://HOST:PORT[/DB]` (`rediss://` for TLS, verified against the system's roots or the
/// CA of `?ca=PATH`), or a Redis Cluster by some of its nodes,
/// `redis-cluster://HOST:PORT[,HOST:PORT…]`; a Redis URL optionally with `?ns=NAME&shards=N`
/// and `poll=DURATION` and `dead_cap=N` ([`RedisOptions`]).
/// Every backend takes `?max_ready=N`: past that many ready items, `add` answers `Full`
/// (webhooks 429, MQTT acks withheld). Default 100,000.
pub async fn open(url: &str, failpoints: Failpoints) -> Result<Queue, QueueError> {
    let url = url.trim();
    let (url, max_ready) = take_max_ready(url)?;
    if url == "memory" {
        return Ok(MemoryQueue::with_limits(max_ready, failpoints).into());
    }
    if let Some(path) = url
        .strip_prefix("sqlite:")
        .or_else(|| url.ends_with(".db").then_some(url.as_str()))
    {
        let path = path.strip_prefix("//").unwrap_or(path);
        if path.is_empty() {
            return Err(QueueError::Open(
                "`sqlite:` needs a path, as in sqlite:weir-data/queue.db".into(),
            ));
        }
        return Ok(SqliteQueue::open_with_limit(path, max_ready, failpoints)?.into());
    }
    let url = url.as_str();
    if [
        "redis://",
        "rediss://",
        "redis-cluster://",
        "rediss-cluster://",
    ]
    .iter()
    .any(|s| url.starts_with(s))
    {
        let (url, opts) = redis_options(url, max_ready)?;
        return Ok(RedisQueue::connect(&url, opts, failpoints).await?.into());
    }
    Err(QueueError::Open(format!(
        "`{}` names no queue backend: use memory, sqlite:PATH, redis://HOST:PORT or redis-cluster://HOST:PORT,…",
        redact::url(url)
    )))
}

/// weir's own settings in a Redis URL's query (`ns`, `shards`, `poll`, `dead_cap`) as
/// options; the URL without them (what is left of the query is the Redis client's own).
fn redis_options(url: &str, max_ready: usize) -> Result<(String, RedisOptions), QueueError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut opts = RedisOptions {
        max_ready,
        ..RedisOptions::default()
    };
    let bad = |what: &str, v: &str, want: &str| {
        QueueError::Open(format!("`{what}={v}` in {}: {want}", redact::url(base)))
    };
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("ns", v)) if !v.is_empty() => opts.namespace = v.to_string(),
            Some(("shards", v)) => {
                opts.shards = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=1024).contains(n))
                    .ok_or_else(|| bad("shards", v, "a number from 1 to 1024"))?
            }
            Some(("poll", v)) => {
                let d = duration::parse(v).map_err(|e| bad("poll", v, &e))?;
                if !(Duration::from_millis(1)..=Duration::from_secs(60)).contains(&d) {
                    return Err(bad("poll", v, "a duration from 1ms to 60s"));
                }
                opts.poll = d;
            }
            Some(("ca", v)) if !v.is_empty() => {
                if !base.starts_with("rediss") {
                    return Err(bad("ca", v, "a CA is for TLS: write rediss://"));
                }
                opts.ca = Some(v.into())
            }
            Some(("dead_cap", v)) => {
                opts.dead_cap = v
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| bad("dead_cap", v, "a number above 0"))?
            }
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((url, opts))
}

/// Take `max_ready=N` out of a queue URL's query; the rest of the URL, and N.
fn take_max_ready(url: &str) -> Result<(String, usize), QueueError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), 100_000));
    };
    let mut max = 100_000;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("max_ready", v)) => {
                max = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    QueueError::Open(format!(
                        "`max_ready={v}` in {}: a number above 0",
                        redact::url(base)
                    ))
                })?
            }
            _ => rest.push(pair),
        }
    }
    Ok(if rest.is_empty() {
        (base.to_string(), max)
    } else {
        (format!("{base}?{}", rest.join("&")), max)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    fn opts(url: &str) -> Result<(String, RedisOptions), String> {
        let (url, max_ready) = take_max_ready(url).map_err(|e| e.to_string())?;
        redis_options(&url, max_ready).map_err(|e| e.to_string())
    }

    #[test]
    fn a_redis_url_carries_weirs_settings_and_hands_the_rest_to_the_client() {
        let (url, o) = opts(
            "redis://127.0.0.1:6379/2?ns=shop&shards=4&poll=100ms&dead_cap=500&max_ready=7&protocol=resp3",
        )
        .unwrap();
        assert_eq!(url, "redis://127.0.0.1:6379/2?protocol=resp3");
        assert_eq!(o.namespace, "shop");
        assert_eq!(o.shards, 4);
        assert_eq!(o.poll, Duration::from_millis(100));
        assert_eq!(o.dead_cap, 500);
        assert_eq!(o.max_ready, 7);

        let (url, o) = opts("redis://127.0.0.1:6379").unwrap();
        let d = RedisOptions::default();
        assert_eq!(url, "redis://127.0.0.1:6379");
        assert_eq!(
            (o.poll, o.dead_cap, o.shards),
            (d.poll, d.dead_cap, d.shards)
        );
    }

    /// An engine that cannot open its Redis says which server, and not its password.
    #[tokio::test]
    async fn a_redis_url_is_named_in_an_error_without_its_password() {
        let port = testing::free_port();
        for (url, says) in [
            (
                format!("redis://:hunter2@127.0.0.1:{port}"),
                format!("cannot reach Redis at redis://:***@127.0.0.1:{port}"),
            ),
            (
                format!("redis://weir:hunter2@127.0.0.1:{port}?shards=x"),
                format!("`shards=x` in redis://weir:***@127.0.0.1:{port}"),
            ),
            (
                format!("redis://:hunter2@127.0.0.1:{port}?max_ready=0"),
                format!("`max_ready=0` in redis://:***@127.0.0.1:{port}"),
            ),
            (
                format!("redis-cluster://:hunter2@127.0.0.1:{port}"),
                format!("the Redis Cluster at redis-cluster://:***@127.0.0.1:{port}"),
            ),
            (
                "postgres://weir:hunter2@db/weir".to_string(),
                "`postgres://weir:***@db/weir` names no queue backend".to_string(),
            ),
        ] {
            let Err(e) = open(&url, Failpoints::new()).await else {
                panic!("{url} opened");
            };
            let e = e.to_string();
            assert!(e.contains(&says) && !e.contains("hunter2"), "{url}: {e}");
        }
    }

    #[test]
    fn a_bad_setting_in_a_redis_url_says_which_and_what_it_takes() {
        for (query, says) in [
            (
                "poll=5",
                "`poll=5` in redis://h:1: duration `5` needs a unit",
            ),
            (
                "poll=0ms",
                "`poll=0ms` in redis://h:1: a duration from 1ms to 60s",
            ),
            (
                "poll=2m",
                "`poll=2m` in redis://h:1: a duration from 1ms to 60s",
            ),
            (
                "dead_cap=0",
                "`dead_cap=0` in redis://h:1: a number above 0",
            ),
            (
                "dead_cap=many",
                "`dead_cap=many` in redis://h:1: a number above 0",
            ),
            (
                "shards=0",
                "`shards=0` in redis://h:1: a number from 1 to 1024",
            ),
        ] {
            let e = opts(&format!("redis://h:1?{query}")).unwrap_err();
            assert!(e.contains(says), "{query}: {e}");
        }
    }
}
