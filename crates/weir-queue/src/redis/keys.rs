//! Every Redis key weir uses, in one place. The Lua scripts (scripts/helpers.lua) build the same
//! names from the shard prefix; change both together.
//!
//! Keys are grouped in shards: `{NS:K}:…` with `K = fnv1a(flow) mod shards`. Everything a
//! wave touches lives in its flow's shard, so a commit is one script in one slot; views
//! across shards (stats, listings) fan out. One shard is one Redis Cluster slot.

/// The shard of a flow: FNV-1a over its id (stable across builds and machines).
pub fn shard_of(flow: &str, shards: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in flow.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(shards.max(1))) as u32
}

/// The prefix of every key in shard `k`: the part in braces is the cluster hash tag.
pub fn prefix(ns: &str, k: u32) -> String {
    format!("{{{ns}:{k}}}:")
}

/// Ready and in-flight items: a stream read through the consumer group `weir`. Its name
/// changed with the layout of 2026-12-04 (it was `stream`), so that an earlier weir started
/// on a namespace this one wrote finds nothing to claim, rather than taking the new entries
/// for stale ones and deleting them.
pub fn stream(p: &str) -> String {
    format!("{p}ready")
}

/// The record of a delayed, parked or dead item (a hash: body, flow, st, deliveries, …). A
/// waiting or in-flight item's record is its stream entry; a finished one's is in [`out`].
pub fn item(p: &str, id: &str) -> String {
    format!("{p}item:{id}")
}

/// Waiting and in-flight items by id: `- ENTRY` while waiting, `LEASE ENTRY SINCE
/// DELIVERIES CONSUMER` once claimed (a hash). One more field, `~hashtable`, keeps it a hash
/// table however few items are live (see scripts/helpers.lua).
pub fn live(p: &str) -> String {
    format!("{p}live")
}

/// Finished items' records by id: a line of JSON fields, a newline, the body (a hash; the
/// newest are kept).
pub fn out(p: &str) -> String {
    format!("{p}out")
}

/// A node's memory: values (JSON) by key.
pub fn state(p: &str, flow: &str, node: &str) -> String {
    // The flow's length keeps `a:b` + `c` apart from `a` + `b:c`.
    format!("{p}state:{}:{flow}:{node}", flow.len())
}

/// A node's memory: the version of each key (bumped by every write, kept after a delete).
pub fn versions(p: &str, flow: &str, node: &str) -> String {
    format!("{p}ver:{}:{flow}:{node}", flow.len())
}

/// Done markers of one item (a hash `node/position` → outputs), with a TTL.
pub fn done(p: &str, id: &str) -> String {
    format!("{p}done:{id}")
}

pub fn idempotency(p: &str, key: &str) -> String {
    format!("{p}idem:{key}")
}

pub fn paused(p: &str) -> String {
    format!("{p}paused")
}

pub fn parked(p: &str, flow: &str) -> String {
    format!("{p}parked:{flow}")
}

pub fn dead(p: &str) -> String {
    format!("{p}dead")
}

pub fn delayed(p: &str) -> String {
    format!("{p}delayed")
}

/// Every item id of the shard, for listings (a sorted set of equal scores: ULID order).
pub fn index(p: &str) -> String {
    format!("{p}index")
}

/// A rate limit's quota shared by every engine (GCRA: the theoretical arrival time, in µs
/// of the server's clock), in its flow's shard; it expires once the quota is full again.
pub fn quota(p: &str, flow: &str, node: &str, key: &str) -> String {
    format!("{p}quota:{}:{flow}:{}:{node}:{key}", flow.len(), node.len())
}

/// Settings every engine on the namespace must agree on (`shards`).
pub fn meta(ns: &str, what: &str) -> String {
    format!("{{{ns}:meta}}:{what}")
}

/// The reply to a `respond: wave` webhook, which any engine may post.
pub fn reply(ns: &str, id: &str) -> String {
    format!("{{{ns}:replies}}:{id}")
}

/// The channel on which an engine names each reply it posts (the item's id), so that the
/// engine whose request waits for that reply hears of it at once instead of at its next poll.
pub fn replies_posted(ns: &str) -> String {
    format!("{ns}:replies-posted")
}

/// The channel where an engine that made items ready with no claim of its own waiting names
/// itself, so that the waiting claims of the others start a round at once.
pub fn items_added(ns: &str) -> String {
    format!("{ns}:items-added")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_stable_and_in_range() {
        assert_eq!(shard_of("anything", 1), 0);
        let a = shard_of("orders", 8);
        assert!(a < 8);
        assert_eq!(a, shard_of("orders", 8));
        // FNV-1a of "a" is 0xaf63dc4c8601ec8c: fixed here so a change of hash is noticed.
        assert_eq!(
            shard_of("a", 1 << 31),
            (0xaf63_dc4c_8601_ec8c_u64 % (1 << 31)) as u32
        );
        assert_ne!(state("p:", "a:b", "c"), state("p:", "a", "b:c"));
    }
}
