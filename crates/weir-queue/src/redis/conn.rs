//! One connection type for a single server and a Redis Cluster.

use redis::aio::{ConnectionLike, ConnectionManager};

/// A connection to one server (reconnecting by itself), or to a Redis Cluster (each command
/// routed to the node that serves its key; a script by its one declared key, the shard's
/// stream, whose hash tag every other key of the shard shares).
#[derive(Clone)]
pub(super) enum Conn {
    One(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::One(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::One(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::One(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The seed nodes of `redis-cluster://HOST:PORT[,HOST:PORT…][/]` (or `rediss-cluster://`
/// for TLS), as URLs the cluster client takes; `None` for any other URL.
pub(super) fn cluster_seeds(url: &str) -> Option<Vec<String>> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = scheme.strip_suffix("-cluster")?;
    let rest = rest.trim_end_matches('/');
    Some(
        rest.split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("{scheme}://{h}"))
            .collect(),
    )
}
