//! Triggers turn outside events into journaled cascade items and return; they never run a
//! node themselves. [`webhook`] serves `/hooks/<path>`; [`cron`] fires schedules.

pub mod cron;
pub mod webhook;
