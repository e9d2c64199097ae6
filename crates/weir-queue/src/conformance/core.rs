//! The core contract's cases: journaling, order, delivery, commit, delayed items, done
//! markers, idempotency, replies.

use std::time::Duration;

use serde_json::json;

use super::{item, payload, unusual_item, Q};
use crate::{
    now_ms, Committed, DoneKey, End, Failpoints, ItemState, Reply, StateKey, StateWrite,
    WaveEffects, WorkItem,
};

pub async fn add_claim_commit(q: Q, _fp: Failpoints) {
    let it = item("f", 1);
    let id = it.id;
    q.add(vec![it]).await.unwrap();
    let before = now_ms();
    // A consumer name as an operator may give one (`--consumer`), spaces and all.
    let c = q.claim("engine a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].item.id, id);
    assert_eq!(c[0].item.deliveries, 1, "deliveries bumped at claim");
    assert!(!c[0].stepped);
    // What `weir queue show` prints of it: who holds it, since when, how many deliveries.
    let v = q.admin().get(id).await.unwrap().unwrap();
    match v.state {
        ItemState::InFlight { consumer, since } => {
            assert_eq!(consumer, "engine a");
            assert!((before..=now_ms()).contains(&since), "since {since}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(v.item.deliveries, 1);
    assert_eq!(
        q.commit(&c[0], WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Done
    );
    assert!(matches!(
        q.admin().get(id).await.unwrap().unwrap().state,
        ItemState::Finished { .. }
    ));
    assert!(q.claim("a", 10, Duration::ZERO).await.unwrap().is_empty());
    // A second commit of an ended item is refused.
    assert_eq!(
        q.commit(&c[0], WaveEffects::ending(End::Ack))
            .await
            .unwrap(),
        Committed::Conflict
    );
}

/// An item in flight is taken back from an engine that stalled however it was claimed: by
/// a claim, journaled claimed (`add_claimed`), or handed to a claim that was waiting for
/// work. None is taken back before its time. (The waiting claim is given 50 ms to wait
/// first; a backend that has not registered it by then hands it the item as a plain claim,
/// and the case still holds. The SQLite backend's own test
/// `an_item_handed_to_a_waiting_claim_is_taken_back_from_a_stalled_engine` waits for it.)
pub async fn items_claimed_every_way_are_taken_back_from_a_stalled_engine(q: Q, _fp: Failpoints) {
    let mut ids = Vec::new();
    // Journaled claimed where the backend can (ready otherwise: claimed below).
    let first = item("f", 1);
    ids.push(first.id);
    let journaled = match q.claim_on_add() {
        Some(adder) => adder.add_claimed("stalled", first).await.unwrap(),
        None => {
            q.add(vec![first]).await.unwrap();
            None
        }
    };
    // Taken by a claim.
    let second = item("f", 2);
    ids.push(second.id);
    q.add(vec![second]).await.unwrap();
    let mut claimed = q.claim("stalled", 10, Duration::ZERO).await.unwrap();
    // Handed to a claim that waited for it.
    let waiting = {
        let q = q.clone();
        tokio::spawn(async move { q.claim("stalled", 1, Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let third = item("f", 3);
    ids.push(third.id);
    q.add(vec![third]).await.unwrap();
    claimed.extend(waiting.await.unwrap().unwrap());
    claimed.extend(journaled);
    let mut got: Vec<_> = claimed.iter().map(|c| c.item.id).collect();
    got.sort();
    ids.sort();
    assert_eq!(got, ids, "all three in flight for the stalled engine");
    assert_eq!(q.reclaim_stale(Duration::from_secs(3600)).await.unwrap(), 0);
    assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 3);
    let again = q.claim("other", 10, Duration::ZERO).await.unwrap();
    let mut back: Vec<_> = again.iter().map(|c| c.item.id).collect();
    back.sort();
    assert_eq!(back, ids, "every one of them back, for another engine");
    for c in &claimed {
        assert_eq!(
            q.commit(c, WaveEffects::ending(End::Ack)).await.unwrap(),
            Committed::Conflict,
            "the stalled engine's late commit is refused"
        );
    }
}

pub async fn claims_in_journal_order(q: Q, _fp: Failpoints) {
    for n in 0..5 {
        q.add(vec![item("f", n)]).await.unwrap();
    }
    q.add(vec![item("f", 5), item("f", 6)]).await.unwrap();
    let mut seen = Vec::new();
    loop {
        let c = q.claim("a", 2, Duration::ZERO).await.unwrap();
        if c.is_empty() {
            break;
        }
        assert!(c.len() <= 2);
        for x in c {
            seen.push(payload(&x.item));
        }
    }
    assert_eq!(seen, (0..7).collect::<Vec<_>>());
}

pub async fn reclaim_bumps_deliveries_and_fences_old_owner(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1)]).await.unwrap();
    let a = q
        .claim("engine-a", 1, Duration::ZERO)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(q.reclaim_stale(Duration::from_secs(3600)).await.unwrap(), 0);
    assert_eq!(q.reclaim_stale(Duration::ZERO).await.unwrap(), 1);
    let b = q
        .claim("engine-b", 1, Duration::ZERO)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(b.item.id, a.item.id);
    assert_eq!(b.item.deliveries, 2);
    let fx = WaveEffects {
        follow_ups: vec![item("f", 99)],
        ..WaveEffects::ending(End::Ack)
    };
    assert_eq!(q.commit(&a, fx).await.unwrap(), Committed::Conflict);
    assert!(
        q.claim("x", 10, Duration::ZERO).await.unwrap().is_empty(),
        "the refused commit left no follow-up"
    );
    assert_eq!(
        q.commit(&b, WaveEffects::ending(End::Ack)).await.unwrap(),
        Committed::Done
    );
}

pub async fn commit_is_all_or_nothing_on_version_conflict(q: Q, _fp: Failpoints) {
    let key = StateKey::new("f", "n", "k");
    q.add(vec![item("f", 1)]).await.unwrap();
    let c = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    let stale_write = StateWrite {
        key: key.clone(),
        value: Some(json!("x")),
        read_version: 5,
    };
    let fx = WaveEffects {
        follow_ups: vec![item("f", 2)],
        state: vec![stale_write],
        ..WaveEffects::ending(End::Ack)
    };
    assert_eq!(q.commit(&c, fx).await.unwrap(), Committed::Conflict);
    assert_eq!(q.read(&key).await.unwrap().version, 0, "no state change");
    assert_eq!(q.admin().stats().await.unwrap().ready, 0, "no follow-up");
    // The same wave with the version it really read commits, and the version moves.
    let fx = WaveEffects {
        follow_ups: vec![item("f", 2)],
        state: vec![StateWrite {
            key: key.clone(),
            value: Some(json!("x")),
            read_version: 0,
        }],
        ..WaveEffects::ending(End::Ack)
    };
    assert_eq!(q.commit(&c, fx).await.unwrap(), Committed::Done);
    let v = q.read(&key).await.unwrap();
    assert_eq!(v.value, Some(json!("x")));
    assert_eq!(v.version, 1);
    assert_eq!(q.admin().stats().await.unwrap().ready, 1);
    assert_eq!(q.read_node("f", "n").await.unwrap().len(), 1);
}

pub async fn guards_are_checked_in_commit(q: Q, _fp: Failpoints) {
    let key = StateKey::new("f", "d", "timer");
    q.add(vec![item("f", 1), item("f", 2)]).await.unwrap();
    let c = q.claim("a", 2, Duration::ZERO).await.unwrap();
    let set = WaveEffects {
        state: vec![StateWrite {
            key: key.clone(),
            value: Some(json!("g2")),
            read_version: 0,
        }],
        ..WaveEffects::ending(End::Ack)
    };
    assert_eq!(q.commit(&c[0], set).await.unwrap(), Committed::Done);
    let fx = WaveEffects {
        guards: vec![(key.clone(), json!("g1"))],
        follow_ups: vec![item("f", 3)],
        ..WaveEffects::ending(End::Ack)
    };
    assert_eq!(q.commit(&c[1], fx).await.unwrap(), Committed::Conflict);
    let fx = WaveEffects {
        guards: vec![(key, json!("g2"))],
        ..WaveEffects::ending(End::Superseded)
    };
    assert_eq!(q.commit(&c[1], fx).await.unwrap(), Committed::Done);
    assert_eq!(q.admin().stats().await.unwrap().ready, 0);
}

pub async fn failed_commit_leaves_nothing_and_item_is_redelivered(q: Q, fp: Failpoints) {
    let key = StateKey::new("f", "n", "k");
    let it = item("f", 1);
    let id = it.id;
    q.add(vec![it]).await.unwrap();
    let c = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    fp.arm("commit", 1);
    let fx = WaveEffects {
        follow_ups: vec![item("f", 2)],
        delayed: vec![WorkItem {
            not_before: Some(now_ms() + 60_000),
            ..item("f", 3)
        }],
        state: vec![StateWrite {
            key: key.clone(),
            value: Some(json!(1)),
            read_version: 0,
        }],
        ..WaveEffects::ending(End::Ack)
    };
    assert!(
        q.commit(&c, fx).await.is_err(),
        "the failpoint fails the commit"
    );
    let s = q.admin().stats().await.unwrap();
    assert_eq!((s.ready, s.delayed), (0, 0), "no follow-up or delayed item");
    assert_eq!(
        q.read(&key).await.unwrap(),
        Default::default(),
        "no state change"
    );
    q.reclaim_stale(Duration::ZERO).await.unwrap();
    let again = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    assert_eq!(again.item.id, id);
    assert_eq!(again.item.deliveries, 2);
}

pub async fn delayed_items_wait_until_due(q: Q, _fp: Failpoints) {
    let due = now_ms() + 3_600_000;
    let later = WorkItem {
        not_before: Some(due),
        ..item("f", 1)
    };
    q.add(vec![later, item("f", 2)]).await.unwrap();
    assert_eq!(q.admin().stats().await.unwrap().delayed, 1);
    assert_eq!(q.next_due().await.unwrap(), Some(due));
    let c = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        c.iter().map(|c| payload(&c.item)).collect::<Vec<_>>(),
        vec![2]
    );
    assert_eq!(q.move_due(now_ms()).await.unwrap(), 0);
    assert_eq!(q.move_due(due).await.unwrap(), 1);
    assert_eq!(q.move_due(due).await.unwrap(), 0, "promoted once");
    let c = q.claim("a", 10, Duration::ZERO).await.unwrap();
    assert_eq!(
        c.iter().map(|c| payload(&c.item)).collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(q.next_due().await.unwrap(), None);
}

pub async fn done_markers_live_until_commit(q: Q, _fp: Failpoints) {
    q.add(vec![item("f", 1)]).await.unwrap();
    let c = q.claim("a", 1, Duration::ZERO).await.unwrap().remove(0);
    let key = DoneKey {
        flow: "f".into(),
        item: c.item.id,
        node: "send".into(),
        position: 2,
    };
    assert_eq!(q.was_done(&key).await.unwrap(), None);
    q.mark_done(key.clone(), vec![vec![json!({"payload": "sent"})]])
        .await
        .unwrap();
    assert_eq!(
        q.was_done(&key).await.unwrap(),
        Some(vec![vec![json!({"payload": "sent"})]])
    );
    let other = DoneKey {
        position: 3,
        ..key.clone()
    };
    assert_eq!(q.was_done(&other).await.unwrap(), None);
    q.commit(&c, WaveEffects::ending(End::Ack)).await.unwrap();
    assert_eq!(q.was_done(&key).await.unwrap(), None);
}

pub async fn idempotency_key_returns_first_id(q: Q, _fp: Failpoints) {
    let first = item("f", 1);
    let (id, new) = q.add_idempotent("order-7", first.clone()).await.unwrap();
    assert!(new);
    assert_eq!(id, first.id);
    let (id2, new2) = q.add_idempotent("order-7", item("f", 2)).await.unwrap();
    assert!(!new2);
    assert_eq!(id2, first.id);
    assert_eq!(q.admin().stats().await.unwrap().ready, 1);
}

pub async fn ticks_are_journaled_once(q: Q, _fp: Failpoints) {
    let key = StateKey::new("f", "cron", "last_tick");
    assert!(q.add_tick(&key, 1000, item("f", 1)).await.unwrap());
    assert!(!q.add_tick(&key, 1000, item("f", 2)).await.unwrap());
    assert!(!q.add_tick(&key, 999, item("f", 3)).await.unwrap());
    assert!(q.add_tick(&key, 2000, item("f", 4)).await.unwrap());
    assert_eq!(q.admin().stats().await.unwrap().ready, 2);
    assert_eq!(q.read(&key).await.unwrap().value, Some(json!(2000)));
}

pub async fn replies_travel_through_the_queue(q: Q, _fp: Failpoints) {
    let id = ulid::Ulid::new();
    let waiter = {
        let q = q.clone();
        tokio::spawn(async move { q.wait_reply(id, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let reply = Reply {
        status: 201,
        headers: vec![("x-a".into(), "b".into())],
        body: json!({"ok": true}).into(),
    };
    q.post_reply(id, reply.clone()).await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), Some(reply.clone()));
    assert_eq!(
        q.wait_reply(ulid::Ulid::new(), Duration::from_millis(20))
            .await
            .unwrap(),
        None
    );
    // A reply posted before its request waits (the wave was quicker) is kept for it.
    let id = ulid::Ulid::new();
    q.post_reply(id, reply.clone()).await.unwrap();
    assert_eq!(
        q.wait_reply(id, Duration::from_secs(5)).await.unwrap(),
        Some(reply)
    );
}

pub async fn claim_waits_for_work(q: Q, _fp: Failpoints) {
    let adder = {
        let q = q.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            q.add(vec![item("f", 1)]).await.unwrap();
        })
    };
    let c = q.claim("a", 1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(c.len(), 1);
    adder.await.unwrap();
    let empty = q.claim("a", 1, Duration::from_millis(30)).await.unwrap();
    assert!(empty.is_empty());
}

pub async fn items_come_back_as_they_were_added(q: Q, _fp: Failpoints) {
    let it = unusual_item("f");
    q.add(vec![it.clone()]).await.unwrap();
    let c = q.claim("a", 10, Duration::ZERO).await.unwrap();
    let want = WorkItem {
        deliveries: 1,
        ..it.clone()
    };
    assert_eq!(c[0].item, want, "claimed as added, one delivery counted");
    assert_eq!(q.admin().get(it.id).await.unwrap().unwrap().item, want);
    // Finished, it is still shown as it was.
    let r = q
        .commit(&c[0], WaveEffects::ending(End::Ack))
        .await
        .unwrap();
    assert_eq!(r, Committed::Done);
    let done = q.admin().get(it.id).await.unwrap().unwrap();
    assert!(matches!(done.state, ItemState::Finished { .. }), "{done:?}");
    assert_eq!(done.item, want, "a finished item keeps what it carried");
    // A delayed one shows when it is due.
    let mut later = unusual_item("f");
    later.not_before = Some(now_ms() + 60_000);
    q.add(vec![later.clone()]).await.unwrap();
    assert_eq!(q.admin().get(later.id).await.unwrap().unwrap().item, later);
}

/// An add whose answer was lost is retried with the same items: each is journaled once,
/// whether the first is still waiting, already claimed, finished, or twice in one batch.
pub async fn an_item_added_again_is_journaled_once(q: Q, _fp: Failpoints) {
    let first = item("f", 1);
    q.add(vec![first.clone()]).await.unwrap();
    let mut changed = first.clone();
    changed.outputs = vec![vec![json!({ "payload": 2 })]];
    q.add(vec![changed, first.clone()]).await.unwrap();
    let twice = item("f", 3);
    q.add(vec![twice.clone(), twice.clone()]).await.unwrap();
    let c = q.claim("a", 10, Duration::ZERO).await.unwrap();
    let got: Vec<_> = c.iter().map(|c| (c.item.id, payload(&c.item))).collect();
    assert_eq!(
        got,
        vec![(first.id, 1), (twice.id, 3)],
        "one of each, as first added"
    );
    // Added again while in flight, and again once finished: nothing new to claim.
    q.add(vec![first.clone()]).await.unwrap();
    assert_eq!(
        q.admin().get(first.id).await.unwrap().unwrap().state.name(),
        "in_flight"
    );
    for c in &c {
        let r = q.commit(c, WaveEffects::ending(End::Ack)).await.unwrap();
        assert_eq!(r, Committed::Done);
    }
    q.add(vec![first.clone(), twice.clone()]).await.unwrap();
    assert!(q.claim("a", 10, Duration::ZERO).await.unwrap().is_empty());
    assert!(matches!(
        q.admin().get(first.id).await.unwrap().unwrap().state,
        ItemState::Finished { .. }
    ));
    assert_eq!(q.admin().stats().await.unwrap().ready, 0);
}
