//! The settings of a Redis queue beyond the server's address.

use std::time::Duration;

use super::scripts::*;

/// Settings beyond the server's address.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// The namespace in every key (`{NS:K}:…`), so several deployments can share a server.
    pub namespace: String,
    /// Shards by flow (one Redis Cluster slot each).
    pub shards: u32,
    /// Past this many ready items (per shard) `add` answers `Full`.
    pub max_ready: usize,
    /// Dead letters kept per shard (100,000, or the URL's `dead_cap=`); past it the oldest
    /// is evicted, counted in `Stats::dead_evicted`, and its record says so.
    pub dead_cap: usize,
    /// The longest pause between two polls of a waiting claim or `respond: wave` request
    /// (25 ms, or the URL's `poll=`; the first pauses are shorter, from 2 ms doubling). The
    /// channels of added items and posted replies wake them sooner, so a longer pause costs
    /// an idle engine's Redis less, at the price of that much latency while the channels are
    /// not heard.
    pub poll: Duration,
    /// With `rediss://`: the CA certificate (PEM) that signs the server's, in place of the
    /// system's roots (the URL's `ca=PATH`).
    pub ca: Option<std::path::PathBuf>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            namespace: "weir".into(),
            shards: 1,
            max_ready: 100_000,
            dead_cap: DEAD_CAP,
            poll: POLL,
            ca: None,
        }
    }
}

/// The longest pause between two polls of a waiting claim or reply, by default.
pub(super) const POLL: Duration = Duration::from_millis(25);
