//! The ground floor of weir: the words every other crate speaks, and nothing else.
//!
//! - [`Message`]: what travels along a flow's wires.
//! - [`now_ms`]: the clock every item and record is stamped with.
//! - [`duration::parse`]: durations as people write them (`200ms`, `5s`, `1.5m`, `2h`).
//! - [`redact::url`]: a server's URL as weir shows it, its secrets hidden.
//! - [`Failpoints`]: named points where tests break things on purpose.

pub mod duration;
pub mod failpoint;
pub mod redact;

pub use failpoint::Failpoints;

/// A message travelling along wires: a JSON object, `{"payload": ..., "topic": ...}`.
pub type Message = serde_json::Value;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
