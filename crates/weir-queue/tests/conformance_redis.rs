//! Every conformance case against the Redis backend, each on its own redis-server.
use weir_queue::testing::RedisServer;
use weir_queue::{Queue, RedisOptions, RedisQueue};

weir_queue::conformance_tests!(|fp| async move {
    let server = RedisServer::start();
    let q = RedisQueue::connect(&server.url(), RedisOptions::default(), fp)
        .await
        .expect("connect to the test's redis-server");
    Queue::from(q.keeping(server))
});

/// The same cases with the keys spread over three shards.
mod sharded {
    use super::*;
    weir_queue::conformance_tests!(|fp| async move {
        let server = RedisServer::start();
        let opts = RedisOptions {
            shards: 3,
            ..RedisOptions::default()
        };
        let q = RedisQueue::connect(&server.url(), opts, fp)
            .await
            .expect("connect to the test's redis-server");
        Queue::from(q.keeping(server))
    });
}

/// The same cases on a three-node Redis Cluster, the keys in eight shards (slots spread over
/// the nodes), through the cluster client.
mod cluster {
    use super::*;
    use weir_queue::testing::RedisCluster;
    weir_queue::conformance_tests!(|fp| async move {
        let cluster = RedisCluster::start();
        let opts = RedisOptions {
            shards: 8,
            ..RedisOptions::default()
        };
        let q = RedisQueue::connect(&cluster.url(), opts, fp)
            .await
            .expect("connect to the test's Redis Cluster");
        Queue::from(q.keeping(cluster))
    });
}
