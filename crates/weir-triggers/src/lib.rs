//! Sources: triggers turn outside events into journaled work items, and never run a node
//! themselves. [`webhook`] serves `/hooks/<path>`; [`cron`] fires schedules; [`mqtt`]
//! subscribes for `mqtt-in` nodes and holds the MQTT transport that `mqtt-out` publishes
//! through. [`spec`] says what drives each source node, [`Intake`] whether events are still
//! taken, and [`StartHere`] is how a webhook hands the executor a wave to start at once.
//!
//! The node library reads the specs from flows; the engine hands the triggers the
//! [`Source`]s of the flows in force. Nothing here depends on the executor or the nodes.

pub mod cron;
mod intake;
pub mod mqtt;
pub mod spec;
mod start;
pub mod webhook;

pub use intake::Intake;
pub use spec::{Source, Trigger};
pub use start::{StartHere, StartedWave};
