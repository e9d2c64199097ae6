//! The SQLite backend against a model that fits in a page: random sequences of operations,
//! with crashes (the file closed while items are in flight, then opened again). After every
//! step the backend and the model must agree on what is where, in what order, delivered how
//! many times.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::json;
use ulid::Ulid;
use weir_queue::{
    Admin, Claimed, Committed, End, Failpoints, Pausing, SqliteQueue, WaveEffects, WorkItem,
    WorkQueue,
};

#[derive(Debug, Clone)]
enum Op {
    Add(u8),
    Claim(u8),
    Ack,
    DeadLetter,
    Park,
    Reclaim,
    Crash,
    Pause(bool),
    Resume,
    Replay,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u8..4).prop_map(Op::Add),
        3 => (1u8..4).prop_map(Op::Claim),
        2 => Just(Op::Ack),
        1 => Just(Op::DeadLetter),
        1 => Just(Op::Park),
        1 => Just(Op::Reclaim),
        1 => Just(Op::Crash),
        1 => any::<bool>().prop_map(Op::Pause),
        1 => Just(Op::Resume),
        1 => Just(Op::Replay),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum St {
    Waiting,
    InFlight,
    Parked,
    Dead,
    Finished,
}

#[derive(Default)]
struct Model {
    ord: u64,
    /// id → (state, place in the ready order, deliveries)
    items: BTreeMap<Ulid, (St, u64, u32)>,
    paused: bool,
}

impl Model {
    fn add(&mut self, id: Ulid) {
        self.ord += 1;
        self.items.insert(id, (St::Waiting, self.ord, 0));
    }
    fn waiting_in_order(&self) -> Vec<Ulid> {
        let mut w: Vec<_> = self
            .items
            .iter()
            .filter(|(_, v)| v.0 == St::Waiting)
            .map(|(id, v)| (v.1, *id))
            .collect();
        w.sort();
        w.into_iter().map(|(_, id)| id).collect()
    }
    fn count(&self, st: St) -> usize {
        self.items.values().filter(|v| v.0 == st).count()
    }
}

async fn run(ops: Vec<Op>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue.db");
    let mut q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
    let mut m = Model::default();
    // Claims the test holds, oldest first; `false` once a crash or reclaim made them stale.
    let mut held: Vec<(Claimed, bool)> = Vec::new();
    for op in ops {
        match op {
            Op::Add(n) => {
                let items: Vec<_> = (0..n)
                    .map(|i| WorkItem::cascade("f", "in", "t", vec![json!(i)]))
                    .collect();
                for i in &items {
                    m.add(i.id);
                }
                q.add(items).await.unwrap();
            }
            Op::Claim(n) => {
                let want: Vec<_> = m.waiting_in_order().into_iter().take(n as usize).collect();
                let got = q.claim("c", n as usize, Duration::ZERO).await.unwrap();
                assert_eq!(got.iter().map(|c| c.item.id).collect::<Vec<_>>(), want);
                for c in got {
                    let e = m.items.get_mut(&c.item.id).unwrap();
                    e.0 = St::InFlight;
                    e.2 += 1;
                    assert_eq!(c.item.deliveries, e.2, "deliveries of {}", c.item.id);
                    held.push((c, true));
                }
            }
            Op::Ack | Op::DeadLetter | Op::Park => {
                if held.is_empty() {
                    continue;
                }
                let (c, live) = held.remove(0);
                let (end, st) = match op {
                    Op::Ack => (End::Ack, St::Finished),
                    Op::DeadLetter => (End::DeadLetter("model".into()), St::Dead),
                    _ => (End::Park, St::Parked),
                };
                let parks_refused = matches!(end, End::Park) && !m.paused;
                let r = q.commit(&c, WaveEffects::ending(end)).await.unwrap();
                if live && !parks_refused {
                    assert_eq!(r, Committed::Done);
                    m.items.get_mut(&c.item.id).unwrap().0 = st;
                } else {
                    assert_eq!(r, Committed::Conflict, "stale or refused commit");
                    if live {
                        held.insert(0, (c, true));
                    }
                }
            }
            Op::Reclaim => {
                let n = q.reclaim_stale(Duration::ZERO).await.unwrap();
                assert_eq!(n, m.count(St::InFlight));
                for v in m.items.values_mut().filter(|v| v.0 == St::InFlight) {
                    v.0 = St::Waiting;
                }
                held.iter_mut().for_each(|h| h.1 = false);
            }
            Op::Crash => {
                drop(q);
                q = SqliteQueue::open(&path, Failpoints::new()).unwrap();
                for v in m.items.values_mut().filter(|v| v.0 == St::InFlight) {
                    v.0 = St::Waiting;
                }
                held.iter_mut().for_each(|h| h.1 = false);
            }
            Op::Pause(p) => {
                q.set_paused("f", p).await.unwrap();
                m.paused = p;
            }
            Op::Resume => {
                // One step: no longer paused, and the parked items waiting again at their
                // places in the ready order.
                let n = q.resume("f").await.unwrap();
                assert_eq!(n, m.count(St::Parked));
                m.paused = false;
                for v in m.items.values_mut().filter(|v| v.0 == St::Parked) {
                    v.0 = St::Waiting;
                }
            }
            Op::Replay => {
                let dead = q.dead_letters(1).await.unwrap();
                assert_eq!(dead.is_empty(), m.count(St::Dead) == 0);
                if let Some(d) = dead.first() {
                    let new = q.replay(d.item.id).await.unwrap();
                    m.items.get_mut(&d.item.id).unwrap().0 = St::Finished;
                    m.add(new);
                }
            }
        }
        let s = q.stats().await.unwrap();
        assert_eq!(
            (s.ready, s.in_flight, s.parked, s.dead),
            (
                m.count(St::Waiting),
                m.count(St::InFlight),
                m.count(St::Parked),
                m.count(St::Dead)
            ),
            "stats after {op:?}"
        );
    }
    // Nothing accepted is ever lost: every item the model knows, the file knows, in its state.
    for (id, (st, _, deliveries)) in &m.items {
        let v = q
            .get(*id)
            .await
            .unwrap()
            .expect("every accepted item is in the file");
        assert_eq!(v.item.deliveries, *deliveries);
        let name = match st {
            St::Waiting => "waiting",
            St::InFlight => "in_flight",
            St::Parked => "parked",
            St::Dead => "dead",
            St::Finished => "finished",
        };
        assert_eq!(v.state.name(), name, "{id}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn sqlite_matches_the_model(ops in prop::collection::vec(op(), 1..60)) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(run(ops));
    }
}
