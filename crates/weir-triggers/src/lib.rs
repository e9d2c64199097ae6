//! Triggers turn outside events into journaled cascade items and return; they never run a
//! node themselves. [`webhook`] serves `/hooks/<path>`; [`cron`] fires schedules;
//! [`mqtt`] subscribes for `mqtt-in` nodes.

pub mod cron;
pub mod mqtt;
pub mod webhook;
