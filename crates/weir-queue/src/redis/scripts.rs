//! The Lua scripts, each in its own file under `scripts/`, wrapped with the helpers they
//! share (`scripts/helpers.lua`) and loaded once.

use redis::Script;

pub(super) const HELPERS: &str = include_str!("scripts/helpers.lua");
/// How a script body is wrapped with the helpers.
const WRAP: &str = include_str!("scripts/wrap.lua");
/// How the keys hold items (see scripts/helpers.lua). 1: a hash per item in every state; 2: a
/// waiting or in-flight item is its stream entry and a line of `live`, a finished one a
/// field of `out`; 3: as 2, with entries of three fields (the flow and when it was
/// enqueued read from the body) and `live` lines of `ENTRY` and `LEASE ENTRY BEFORE`.
pub(super) const LAYOUT: u32 = 3;
/// Finished item records kept per shard for `get`.
pub(super) const FINISHED_KEPT: usize = 10_000;
/// Dead letters kept per shard, by default, before the oldest is evicted (counted, recorded).
pub const DEAD_CAP: usize = 100_000;
/// Done markers outlive a crashed engine's redelivery by far, then expire.
pub(super) const DONE_TTL_SECS: i64 = 7 * 24 * 3600;
pub(super) const IDEMPOTENCY_TTL_SECS: i64 = 24 * 3600;
pub(super) const REPLY_TTL_SECS: i64 = 120;
/// Delayed items promoted per script run (the rest in the next).
pub(super) const PROMOTE_BATCH: usize = 1000;
/// Entries one reclaim call looks at per shard, and rounds of that per call.
pub(super) const RECLAIM_BATCH: usize = 100;
pub(super) const RECLAIM_ROUNDS: usize = 10;

/// Every script, made once: each is the helpers, then its body as `main`, then `flush()`.
pub(super) struct Scripts {
    pub(super) add: Script,
    pub(super) add_idempotent: Script,
    pub(super) add_tick: Script,
    pub(super) claim: Script,
    pub(super) commit: Script,
    pub(super) reclaim: Script,
    pub(super) release: Script,
    pub(super) quota: Script,
    pub(super) bury: Script,
    pub(super) prune: Script,
    pub(super) recover: Script,
    pub(super) move_due: Script,
    pub(super) resume: Script,
    pub(super) unpark_one: Script,
    pub(super) clear_flow: Script,
    pub(super) cancel: Script,
    pub(super) discard: Script,
    pub(super) replay: Script,
    pub(super) get: Script,
    pub(super) stats: Script,
}

impl Scripts {
    pub(super) fn new(dead_cap: usize) -> Self {
        let helpers = HELPERS
            .replace("__FINISHED_KEPT__", &FINISHED_KEPT.to_string())
            .replace("__DEAD_CAP__", &dead_cap.max(1).to_string());
        let s = |body: &str| {
            Script::new(
                &WRAP
                    .replace("__HELPERS__", &helpers)
                    .replace("__BODY__", body),
            )
        };
        Scripts {
            add: s(include_str!("scripts/add.lua")),
            add_idempotent: s(include_str!("scripts/add_idempotent.lua")),
            add_tick: s(include_str!("scripts/add_tick.lua")),
            claim: s(include_str!("scripts/claim.lua")),
            commit: s(include_str!("scripts/commit.lua")),
            reclaim: s(include_str!("scripts/reclaim.lua")),
            release: s(include_str!("scripts/release.lua")),
            quota: Script::new(include_str!("scripts/quota.lua")),
            bury: s(include_str!("scripts/bury.lua")),
            prune: s(include_str!("scripts/prune.lua")),
            recover: s(include_str!("scripts/recover.lua")),
            move_due: s(include_str!("scripts/move_due.lua")),
            resume: s(include_str!("scripts/resume.lua")),
            unpark_one: s(include_str!("scripts/unpark_one.lua")),
            clear_flow: s(include_str!("scripts/clear_flow.lua")),
            cancel: s(include_str!("scripts/cancel.lua")),
            discard: s(include_str!("scripts/discard.lua")),
            replay: s(include_str!("scripts/replay.lua")),
            get: s(include_str!("scripts/get.lua")),
            stats: s(include_str!("scripts/stats.lua")),
        }
    }
}
