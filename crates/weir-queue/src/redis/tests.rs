//! What the scripts do with input they cannot read.

use super::*;
use crate::{StateKey, WorkItem, WorkQueue};

#[tokio::test]
async fn a_tick_whose_item_cannot_be_read_writes_nothing() {
    let server = crate::testing::RedisServer::start();
    let q = RedisQueue::connect(&server.url(), RedisOptions::default(), Failpoints::new())
        .await
        .unwrap();
    let p = q.prefix_of("f");
    let r: Result<i64, QueueError> = q
        .run(
            &q.scripts.add_tick,
            p,
            &[
                &keys::state(p, "f", "cron"),
                &keys::versions(p, "f", "cron"),
                &"tick",
                &"5",
                &"{not json",
            ],
        )
        .await;
    assert!(r.is_err(), "{r:?}");
    // The tick was not recorded: journaled with its item, it is taken once.
    let key = StateKey::new("f", "cron", "tick");
    let item = || WorkItem::cascade("f", "cron", "tick", vec![serde_json::json!({})]);
    assert!(q.add_tick(&key, 5, item()).await.unwrap());
    assert!(!q.add_tick(&key, 5, item()).await.unwrap());
    assert_eq!(crate::Admin::stats(&q).await.unwrap().ready, 1);
}
