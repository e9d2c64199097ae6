//! The conformance suite: every case is written once, against a [`Queue`], and
//! [`conformance_tests!`](crate::conformance_tests) expands all of them into tests for a
//! backend, so adding a backend is one line and no backend can skip a case.
//!
//! ```ignore
//! weir_queue::conformance_tests!(|fp| async move {
//!     weir_queue::Queue::from(weir_queue::MemoryQueue::with_limits(1000, fp))
//! });
//! ```

mod abilities;
mod core;

pub use abilities::*;
pub use core::*;

use serde_json::json;

use crate::{Queue, WorkItem};

/// Expand every conformance case into a `#[tokio::test]` for the backend that `$make` builds
/// (a closure from [`Failpoints`](crate::Failpoints) to a future of a [`Queue`](crate::Queue)).
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@cases $make;
            add_claim_commit, claims_in_journal_order, reclaim_bumps_deliveries_and_fences_old_owner,
            commit_is_all_or_nothing_on_version_conflict, guards_are_checked_in_commit,
            failed_commit_leaves_nothing_and_item_is_redelivered, delayed_items_wait_until_due,
            park_unpark_and_step, park_is_refused_when_flow_not_paused,
            dead_letters_are_listed_replayed_and_discarded, done_markers_live_until_commit,
            idempotency_key_returns_first_id, ticks_are_journaled_once, cancel_by_hand,
            replies_travel_through_the_queue, stats_count_every_state, claim_waits_for_work,
            recover_frees_only_this_consumers_items, prune_removes_only_what_ended_long_ago,
            release_hands_back_a_stopped_engines_items,
            clear_flow_drops_only_that_flows_pending_items,
            shared_quotas_grant_their_burst_then_refuse,
            items_come_back_as_they_were_added, an_item_added_again_is_journaled_once,
            an_item_added_claimed_starts_at_once_only_when_nothing_is_ready_before_it,
            items_claimed_every_way_are_taken_back_from_a_stalled_engine,
            list_pages_through_every_item_in_id_order,
            idempotency_keys_last_no_longer_than_retention,
            delayed_are_counted_and_dead_letters_chosen_by_id,
            an_item_ended_later_comes_back_as_itself_with_its_markers,
            resume_unpauses_and_readies_the_parked_in_one_step,
            a_claim_passes_over_the_flows_it_is_told_to
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                let fp = $crate::Failpoints::new();
                let q = ($make)(fp.clone()).await;
                $crate::conformance::$case(q, fp).await;
            }
        )*
    };
}

pub(crate) type Q = Queue;

pub(crate) fn item(flow: &str, n: i64) -> WorkItem {
    WorkItem::cascade(flow, "in", "test", vec![json!({ "payload": n })])
}

pub(crate) fn payload(i: &WorkItem) -> i64 {
    i.outputs[0][0]["payload"].as_i64().unwrap()
}

/// An item with every field away from its usual value, as a retry of a delayed, guarded
/// batch-run item would be.
pub fn unusual_item(flow: &str) -> WorkItem {
    let mut it = item(flow, 7);
    it.kind = crate::ItemKind::Flush;
    it.node = "limit".into();
    it.outputs = vec![vec![], vec![json!({ "payload": [1, "two"], "topic": "t" })]];
    it.cause = "retry:limit".into();
    it.guard_key = Some("timer".into());
    it.guard_value = Some(json!({ "n": 3 }));
    it.attempt = 2;
    it.origin_id = Some(ulid::Ulid::new());
    it.first_enqueued_at = it.enqueued_at - 5_000;
    it.run_id = Some("run-1".into());
    it.awaited = true;
    it
}
