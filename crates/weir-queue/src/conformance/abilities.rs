//! The cases of the abilities a backend has besides the core: claim on add, pausing, the
//! operator's view and hand, consumers, shared quotas. A case whose ability the backend
//! lacks checks what holds without it, or nothing.

use std::time::Duration;

use ulid::Ulid;

use super::{item, payload, Q};
use crate::{
    now_ms, Claimed, Committed, End, Failpoints, ItemState, ListFilter, StateKey, WaveEffects,
    WorkItem,
};

/// `add_claimed` (a `respond: wave` webhook starting its own wave): with nothing ready, the
/// item comes back claimed for the caller, its delivery counted, and nobody else gets it;
/// behind a ready item it is journaled ready, and claims take both in journal order.
pub async fn an_item_added_claimed_starts_at_once_only_when_nothing_is_ready_before_it(
    q: Q,
    _fp: Failpoints,
) {
    let Some(adder) = q.claim_on_add() else {
        return; // a backend without the ability: the executor journals with `add`.
    };
    let first = item("f", 1);
    let id = first.id;
    let c = adder
        .add_claimed("web", first)
        .await
        .unwrap()
        .expect("nothing ready before it: claimed");
    assert_eq!(c.item.id, id);
    assert_eq!(payload(&c.item), 1);
    assert_eq!((c.consumer.as_str(), c.item.deliveries), ("web", 1));
    match q.admin().get(id).await.unwrap().unwrap().state {
        ItemState::InFlight { consumer, .. } => assert_eq!(consumer, "web"),
        other => panic!("{other:?}"),
    }
    assert!(
        q.claim("a", 10, Duration::ZERO).await.unwrap().is_empty(),
        "nobody else gets it"
    );
    // Behind a ready item: journaled ready, after it.
    q.add(vec![item("f", 2)]).await.unwrap();
    assert!(adder
        .add_claimed("web", item("f", 3))
        .await
        .unwrap()
        .is_none());
    let rest = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        rest.iter().map(|x| payload(&x.item)).collect::<Vec<_>>(),
        [2, 3]
    );
    for x in rest.iter().chain([&c]) {
        assert_eq!(
            q.commit(x, WaveEffects::ending(End::Ack)).await.unwrap(),
            Committed::Done
        );
    }
    // Nothing ready again: claimed again.
    assert!(adder
        .add_claimed("web", item("f", 4))
        .await
        .unwrap()
        .is_some());
}

pub async fn park_unpark_and_step(q: Q, _fp: Failpoints) {
    q.pausing().set_paused("f", true).await.unwrap();
    assert!(q.pausing().is_paused("f").await.unwrap());
    assert!(!q.pausing().is_paused("g").await.unwrap());
    q.add((0..4).map(|n| item("f", n)).collect()).await.unwrap();
    for c in q.claim("a", 10, Duration::ZERO).await.unwrap() {
        assert_eq!(
            q.commit(&c, WaveEffects::ending(End::Park)).await.unwrap(),
            Committed::Done
        );
    }
    assert_eq!(q.admin().stats().await.unwrap().parked, 4);
    assert_eq!(q.parked_count("f").await.unwrap(), 4);
    assert_eq!(q.parked_count("g").await.unwrap(), 0);
    let stepped = q.pausing().unpark_one("f").await.unwrap().unwrap();
    let c = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(c.len(), 1, "step releases exactly one");
    assert_eq!(c[0].item.id, stepped);
    assert_eq!(payload(&c[0].item), 0, "step releases the oldest");
    assert!(c[0].stepped);
    q.commit(&c[0], WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    assert_eq!(q.pausing().resume("f").await.unwrap(), 3);
    let c = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        c.iter().map(|c| payload(&c.item)).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(c.iter().all(|c| !c.stepped));
    assert_eq!(q.pausing().unpark_one("f").await.unwrap(), None);
}

pub async fn park_is_refused_when_flow_not_paused(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1)]).await.unwrap();
    let c = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    assert_eq!(
        q.commit(&c, WaveEffects::ending(End::Park)).await.unwrap(),
        Committed::Conflict
    );
    assert_eq!(q.admin().stats().await.unwrap().parked, 0);
}

pub async fn dead_letters_are_listed_replayed_and_discarded(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1), item("f", 2)]).await.unwrap();
    let c = q.claim("a", 2, Duration::ZERO).await.unwrap();
    let child = item("f", 3);
    let child_id = child.id;
    let fx = WaveEffects {
        dead: vec![(child, "node `x` failed: boom".into())],
        ..WaveEffects::ending(End::DeadLetter("bad input".into()))
    };
    q.commit(&c[0], fx).await.unwrap();
    q.commit(&c[1], WaveEffects::ending(End::DeadLetter("second".into())))
        .await
        .unwrap();
    let dead = q.admin().dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 3);
    let reasons: Vec<String> = dead
        .iter()
        .map(|d| match &d.state {
            ItemState::Dead { reason, .. } => reason.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(reasons.contains(&"bad input".to_string()));
    assert!(reasons.contains(&"node `x` failed: boom".to_string()));
    assert_eq!(q.admin().stats().await.unwrap().dead, 3);
    let new_id = q.admin().replay(c[0].item.id).await.unwrap();
    assert_ne!(new_id, c[0].item.id);
    let again = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].item.id, new_id);
    assert_eq!(again[0].item.cause, format!("replay:{}", c[0].item.id));
    assert_eq!(again[0].item.deliveries, 1);
    q.admin().discard(child_id).await.unwrap();
    assert!(matches!(
        q.admin().get(child_id).await.unwrap().unwrap().state,
        ItemState::Finished { ref outcome, .. } if outcome == "discarded by hand"
    ));
    assert_eq!(q.admin().stats().await.unwrap().dead, 1);
    assert!(
        q.admin().discard(new_id).await.is_err(),
        "only dead letters are discarded"
    );
    assert!(q.admin().replay(ulid::Ulid::new()).await.is_err());
}

pub async fn cancel_by_hand(q: Q, _fp: Failpoints) {
    let a = item("f", 1);
    let b = WorkItem {
        not_before: Some(now_ms() + 60_000),
        ..item("f", 2)
    };
    let c = item("f", 3);
    let (ia, ib, ic) = (a.id, b.id, c.id);
    q.add(vec![a, b]).await.unwrap();
    q.admin().cancel(ia).await.unwrap();
    q.admin().cancel(ib).await.unwrap();
    for (id, n) in [(ia, 1), (ib, 2)] {
        let v = q.admin().get(id).await.unwrap().unwrap();
        assert!(matches!(
            v.state,
            ItemState::Finished { ref outcome, .. } if outcome == "cancelled by hand"
        ));
        assert_eq!(
            payload(&v.item),
            n,
            "a cancelled item still shows what it carried"
        );
    }
    let s = q.admin().stats().await.unwrap();
    assert_eq!((s.ready, s.delayed), (0, 0));
    q.add(vec![c]).await.unwrap();
    let claimed = q.claim("a", 1, Duration::ZERO).await.unwrap();
    assert_eq!(claimed[0].item.id, ic);
    assert!(
        q.admin().cancel(ic).await.is_err(),
        "in-flight items end with their wave"
    );
    assert!(q.admin().cancel(ulid::Ulid::new()).await.is_err());
}

pub async fn stats_count_every_state(q: Q, _fp: Failpoints) {
    q.pausing().set_paused("p", true).await.unwrap();
    q.add(vec![
        item("f", 1),
        item("f", 2),
        item("p", 3),
        WorkItem {
            not_before: Some(now_ms() + 60_000),
            ..item("f", 4)
        },
    ])
    .await
    .unwrap();
    // All three ready items (across flows, a sharded backend may hand them out in another
    // order than added); one of f's is dead-lettered, p's is parked, one stays in flight.
    let c = q.claim("a", 3, Duration::ZERO).await.unwrap();
    assert_eq!(c.len(), 3);
    let (p, f): (Vec<&Claimed>, Vec<&Claimed>) = c.iter().partition(|c| c.item.flow == "p");
    q.commit(f[1], WaveEffects::ending(End::DeadLetter("x".into())))
        .await
        .unwrap();
    q.commit(p[0], WaveEffects::ending(End::Park))
        .await
        .unwrap();
    let s = q.admin().stats().await.unwrap();
    assert_eq!(
        (s.ready, s.in_flight, s.delayed, s.parked, s.dead),
        (0, 1, 1, 1, 1)
    );
    assert!(s.oldest_pending_age_ms.is_some());
    assert_eq!(s.durable, q.durable());
    let listed = q
        .admin()
        .list(ListFilter {
            state: Some("delayed".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(payload(&listed[0].item), 4);
    let parked = q
        .admin()
        .list(ListFilter {
            flow: Some("p".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].state, ItemState::Parked);
}

/// A restarted engine takes back at once what its earlier run left in flight, and only
/// that. A backend without [`Consumers`](crate::Consumers) does so when it opens (one
/// engine holds it): there, nothing in flight moves until its time is out.
pub async fn recover_frees_only_this_consumers_items(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1), item("f", 2)]).await.unwrap();
    let mine = q.claim("me", 1, Duration::ZERO).await.unwrap().remove(0);
    let theirs = q.claim("other", 1, Duration::ZERO).await.unwrap().remove(0);
    let Some(consumers) = q.consumers() else {
        for (c, who) in [(&mine, "me"), (&theirs, "other")] {
            match q.admin().get(c.item.id).await.unwrap().unwrap().state {
                ItemState::InFlight { consumer, .. } => assert_eq!(consumer, who),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(q.reclaim_stale(Duration::from_secs(3600)).await.unwrap(), 0);
        return;
    };
    assert_eq!(
        consumers.recover("me").await.unwrap(),
        1,
        "only the items of `me`"
    );
    let again = q.claim("me", 10, Duration::ZERO).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].item.id, mine.item.id);
    assert_eq!(again[0].item.deliveries, 2);
    assert_eq!(
        q.commit(&mine, WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Conflict,
        "the dead run's lease is void"
    );
    assert_eq!(
        q.commit(&theirs, WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Done,
        "another engine's item was left alone"
    );
}

/// An engine stopped cleanly hands back what it holds at once: another engine claims it
/// with its delivery counted, and the stopped engine's late commit is refused.
pub async fn release_hands_back_a_stopped_engines_items(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1), item("f", 2)]).await.unwrap();
    let mine = q.claim("me", 1, Duration::ZERO).await.unwrap().remove(0);
    let theirs = q.claim("other", 1, Duration::ZERO).await.unwrap().remove(0);
    let Some(consumers) = q.consumers() else {
        // Without the ability, a stopped engine's items wait for the reclaim (or the
        // next open): nothing is handed out early.
        assert!(q
            .claim("next", 10, Duration::ZERO)
            .await
            .unwrap()
            .is_empty());
        return;
    };
    assert_eq!(consumers.release("me").await.unwrap(), 1);
    let next = q.claim("next", 10, Duration::ZERO).await.unwrap();
    assert_eq!(next.len(), 1, "only the stopped engine's item");
    assert_eq!(next[0].item.id, mine.item.id);
    assert_eq!(next[0].item.deliveries, 2);
    assert_eq!(
        q.commit(&mine, WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Conflict,
        "the released claim's commit is refused"
    );
    for c in [&next[0], &theirs] {
        assert_eq!(
            q.commit(c, WaveEffects::ending(End::Ack)).await.unwrap(),
            Committed::Done
        );
    }
}

/// Clearing a flow drops its waiting, delayed and parked items, counts them, and leaves
/// what is in flight and every other flow alone.
pub async fn clear_flow_drops_only_that_flows_pending_items(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1), item("f", 2)]).await.unwrap();
    let mut later = item("f", 4);
    later.not_before = Some(now_ms() + 3_600_000);
    q.add(vec![later]).await.unwrap();
    let running = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    assert_eq!(payload(&running.item), 1);
    q.pausing().set_paused("f", true).await.unwrap();
    let parked = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    assert_eq!(payload(&parked.item), 2);
    assert_eq!(
        q.commit(&parked, WaveEffects::ending(End::Park))
            .await
            .unwrap(),
        Committed::Done
    );
    q.add(vec![item("g", 3)]).await.unwrap();
    assert_eq!(
        q.admin().clear_flow("f").await.unwrap(),
        2,
        "the parked and the delayed"
    );
    assert_eq!(q.pausing().resume("f").await.unwrap(), 0);
    let left = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        left.iter().map(|c| payload(&c.item)).collect::<Vec<_>>(),
        [3]
    );
    assert_eq!(q.next_due().await.unwrap(), None, "no delayed item left");
    // Set aside, not ended: dead letters that say why, to replay once the flow is back.
    let dead = q.admin().dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 2);
    for d in &dead {
        match &d.state {
            ItemState::Dead { reason, .. } => {
                assert_eq!(*reason, crate::removed_flow_reason("f"))
            }
            other => panic!("{other:?}"),
        }
    }
    let back = q.admin().replay(dead[0].item.id).await.unwrap();
    let again = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(again.iter().map(|c| c.item.id).collect::<Vec<_>>(), [back]);
    q.commit(&again[0], WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    assert_eq!(
        q.commit(&running, WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Done,
        "the item in flight was left alone"
    );
}

/// A shared quota grants its burst, then refuses until a pass is due, and tells how long;
/// another key has its own. Backends without the ability keep quotas in each engine.
pub async fn shared_quotas_grant_their_burst_then_refuse(q: Q, _fp: Failpoints) {
    let Some(quotas) = q.quotas() else {
        return;
    };
    let key = StateKey::new("f", "limit", "quota/a");
    let minute = Duration::from_secs(60);
    let first = quotas.take_quota(&key, minute, 3, 2).await.unwrap();
    assert_eq!(first.granted, 2);
    let rest = quotas.take_quota(&key, minute, 3, 5).await.unwrap();
    assert_eq!(rest.granted, 1, "the burst is 3 in all");
    assert!(rest.next_in > Duration::ZERO && rest.next_in <= minute);
    assert_eq!(
        quotas.take_quota(&key, minute, 3, 1).await.unwrap().granted,
        0
    );
    let other = StateKey::new("f", "limit", "quota/b");
    assert_eq!(
        quotas
            .take_quota(&other, minute, 3, 3)
            .await
            .unwrap()
            .granted,
        3
    );
}

pub async fn prune_removes_only_what_ended_long_ago(q: Q, _fp: Failpoints) {
    let items: Vec<WorkItem> = (0..5).map(|n| item("f", n)).collect();
    let ids: Vec<_> = items.iter().map(|i| i.id).collect();
    q.add(items).await.unwrap();
    let c = q.claim("a", 3, Duration::ZERO).await.unwrap();
    q.commit(&c[0], WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    q.commit(&c[1], WaveEffects::ending(End::DeadLetter("x".into())))
        .await
        .unwrap();
    // c[2] stays in flight, ids[3] and ids[4] stay waiting.
    assert_eq!(
        q.admin().prune(now_ms() - 60_000).await.unwrap(),
        Default::default(),
        "nothing that old"
    );
    let p = q.admin().prune(now_ms() + 1).await.unwrap();
    assert_eq!((p.outcomes, p.dead), (1, 1), "{p:?}");
    assert!(
        q.admin().get(ids[0]).await.unwrap().is_none(),
        "the outcome is gone"
    );
    assert!(
        q.admin().get(ids[1]).await.unwrap().is_none(),
        "the dead letter is gone"
    );
    assert_eq!(q.admin().stats().await.unwrap().dead, 0);
    assert_eq!(
        q.admin().get(ids[2]).await.unwrap().unwrap().state.name(),
        "in_flight"
    );
    assert_eq!(
        q.admin().get(ids[3]).await.unwrap().unwrap().state.name(),
        "waiting"
    );
    assert_eq!(
        q.claim("a", 10, Duration::ZERO).await.unwrap().len(),
        2,
        "live items untouched"
    );
}

/// `list` pages through every item once, in the order of their ids, `after` the last id of
/// the page before: items whose ids share a millisecond, and items journaled in another
/// order than their ids were made, included; a filter by state pages the same way.
pub async fn list_pages_through_every_item_in_id_order(q: Q, _fp: Failpoints) {
    // Made first, journaled last: ids of an earlier millisecond after later ones.
    let early: Vec<WorkItem> = (0..5).map(|n| item("f", n)).collect();
    tokio::time::sleep(Duration::from_millis(3)).await;
    let mut all = early.clone();
    for round in 0..4 {
        let batch: Vec<WorkItem> = (0..40).map(|n| item("f", 100 * round + n)).collect();
        all.extend(batch.iter().cloned());
        q.add(batch).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    q.add(early).await.unwrap();
    let claimed = q.claim("a", 9, Duration::ZERO).await.unwrap();
    let mut want: Vec<Ulid> = all.iter().map(|i| i.id).collect();
    want.sort();
    let page_through = |state: Option<&'static str>| {
        let q = q.clone();
        async move {
            let mut got = Vec::new();
            let mut after = None;
            for _ in 0..100 {
                let page = q
                    .admin()
                    .list(ListFilter {
                        state: state.map(String::from),
                        after,
                        limit: 7,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                assert!(page.len() <= 7);
                let Some(last) = page.last() else {
                    return got;
                };
                after = Some(last.item.id);
                got.extend(page.iter().map(|v| v.item.id));
            }
            panic!("more pages than items");
        }
    };
    assert_eq!(page_through(None).await, want, "every item once, by id");
    let mut flying: Vec<Ulid> = claimed.iter().map(|c| c.item.id).collect();
    flying.sort();
    assert_eq!(page_through(Some("in_flight")).await, flying);
    let waiting: Vec<Ulid> = want.into_iter().filter(|id| !flying.contains(id)).collect();
    assert_eq!(page_through(Some("waiting")).await, waiting);
}

/// An idempotency key lives no longer than retention keeps what ended (a day at most).
pub async fn idempotency_keys_last_no_longer_than_retention(q: Q, _fp: Failpoints) {
    // A retention of one second, as the engine's prune states it.
    let retention = 1_000;
    q.admin().prune(crate::now_ms() - retention).await.unwrap();
    let (first, new) = q.add_idempotent("order-9", item("f", 1)).await.unwrap();
    assert!(new);
    let (again, new) = q.add_idempotent("order-9", item("f", 2)).await.unwrap();
    assert_eq!((again, new), (first, false), "a retry within retention");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        q.admin().prune(crate::now_ms() - retention).await.unwrap();
        let (id, new) = q.add_idempotent("order-9", item("f", 3)).await.unwrap();
        if new {
            assert_ne!(id, first);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the key outlived retention"
        );
    }
}

/// The dashboard's count of delayed items by node (flush timers apart), and the bulk
/// actions' selection of dead letters by flow and reason, by id.
pub async fn delayed_are_counted_and_dead_letters_chosen_by_id(q: Q, _fp: Failpoints) {
    let later = |flow: &str, node: &str, kind| {
        let mut it = item(flow, 1);
        it.node = node.into();
        it.kind = kind;
        it.not_before = Some(crate::now_ms() + 3_600_000);
        it
    };
    q.add(vec![
        later("f", "wait", crate::ItemKind::Cascade),
        later("f", "wait", crate::ItemKind::Cascade),
        later("f", "limit", crate::ItemKind::Cascade),
        later("f", "limit", crate::ItemKind::Flush),
        later("g", "wait", crate::ItemKind::Cascade),
        item("f", 2),
        item("g", 3),
    ])
    .await
    .unwrap();
    let held = q.admin().delayed_by_node("f").await.unwrap();
    assert_eq!(
        held.into_iter().collect::<Vec<_>>(),
        vec![("limit".to_string(), 1), ("wait".to_string(), 2)]
    );
    let c = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(c.len(), 2);
    for (claimed, why) in c.iter().zip(["timed out at node `send`", "bad input"]) {
        q.commit(claimed, WaveEffects::ending(End::DeadLetter(why.into())))
            .await
            .unwrap();
    }
    let of = |v: Vec<Ulid>| {
        let mut v = v;
        v.sort();
        v
    };
    let f_id = c.iter().find(|c| c.item.flow == "f").unwrap().item.id;
    let g_id = c.iter().find(|c| c.item.flow == "g").unwrap().item.id;
    let admin = q.admin();
    assert_eq!(
        of(admin.dead_ids(None, None, 100).await.unwrap()),
        of(vec![f_id, g_id])
    );
    assert_eq!(
        admin.dead_ids(Some("f"), None, 100).await.unwrap(),
        vec![f_id]
    );
    let timed_out = admin.dead_ids(None, Some("timed out"), 100).await.unwrap();
    let bad = admin.dead_ids(None, Some("bad"), 100).await.unwrap();
    let (want_timed_out, want_bad) = match c[0].item.id == f_id {
        true => (f_id, g_id),
        false => (g_id, f_id),
    };
    assert_eq!((timed_out, bad), (vec![want_timed_out], vec![want_bad]));
    assert!(admin
        .dead_ids(Some("g"), Some("nothing like it"), 100)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(admin.dead_ids(None, None, 1).await.unwrap().len(), 1);
}

/// An item whose wave ends `Later` is the same item when it comes back: its id, its
/// deliveries counted on, its done markers kept until it ends.
pub async fn an_item_ended_later_comes_back_as_itself_with_its_markers(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1)]).await.unwrap();
    let first = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    let id = first.item.id;
    let key = crate::DoneKey {
        flow: "f".into(),
        item: id,
        node: "send".into(),
        position: 1,
    };
    q.mark_done(
        key.clone(),
        vec![vec![serde_json::json!({ "payload": "sent" })]],
    )
    .await
    .unwrap();
    let due = crate::now_ms() + 300;
    let r = q
        .commit(&first, WaveEffects::ending(End::Later(due)))
        .await
        .unwrap();
    assert_eq!(r, Committed::Done);
    let s = q.admin().stats().await.unwrap();
    assert_eq!((s.ready, s.in_flight, s.delayed), (0, 0, 1), "{s:?}");
    assert!(q.was_done(&key).await.unwrap().is_some(), "markers kept");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let again = loop {
        q.move_due(crate::now_ms()).await.unwrap();
        let mut got = q.claim("a", 1, Duration::from_millis(50)).await.unwrap();
        if let Some(c) = got.pop() {
            break c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never delivered again"
        );
    };
    assert_eq!(again.item.id, id, "the same item");
    assert_eq!(again.item.deliveries, 2, "its deliveries go on");
    assert!(q.was_done(&key).await.unwrap().is_some(), "its markers too");
    q.commit(&again, WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    assert!(
        q.was_done(&key).await.unwrap().is_none(),
        "gone once it ends"
    );
}

/// Resume is one step: the flow is no longer paused and its parked items are ready, in the
/// order they were journaled, before anything added after the resume.
pub async fn resume_unpauses_and_readies_the_parked_in_one_step(q: Q, _fp: Failpoints) {
    q.pausing().set_paused("f", true).await.unwrap();
    q.add((1..=3).map(|n| item("f", n)).collect())
        .await
        .unwrap();
    for c in q.claim("a", 3, Duration::ZERO).await.unwrap() {
        q.commit(&c, WaveEffects::ending(End::Park)).await.unwrap();
    }
    assert_eq!(q.parked_count("f").await.unwrap(), 3);
    assert_eq!(q.pausing().resume("f").await.unwrap(), 3);
    assert!(!q.pausing().is_paused("f").await.unwrap());
    assert_eq!(q.parked_count("f").await.unwrap(), 0);
    q.add(vec![item("f", 4)]).await.unwrap();
    let got = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        got.iter().map(|c| payload(&c.item)).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
}

/// A claim that passes over some flows takes the others' items in journal order, and the
/// items passed over keep their places for the next claim. Backends without the ability
/// claim in journal order alone.
pub async fn a_claim_passes_over_the_flows_it_is_told_to(q: Q, _fp: Failpoints) {
    let Some(s) = q.skips_flows().cloned() else {
        return;
    };
    q.add(vec![
        item("a", 1),
        item("a", 2),
        item("b", 3),
        item("a", 4),
        item("c", 5),
    ])
    .await
    .unwrap();
    let skip: std::sync::Arc<[String]> = vec!["a".to_string()].into();
    let got = s
        .claim_skipping("x", 10, Duration::ZERO, skip.clone())
        .await
        .unwrap();
    assert_eq!(
        got.iter().map(|c| payload(&c.item)).collect::<Vec<_>>(),
        [3, 5]
    );
    // Only `a`'s are ready now: a claim passing over `a` waits, then finds none.
    let none = s
        .claim_skipping("x", 10, Duration::from_millis(50), skip)
        .await
        .unwrap();
    assert!(none.is_empty());
    let rest = q.claim("x", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        rest.iter().map(|c| payload(&c.item)).collect::<Vec<_>>(),
        [1, 2, 4]
    );
}
