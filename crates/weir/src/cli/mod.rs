//! The `weir` binary's subcommands, one module each, and the settings `weir run` layers.

pub mod admin;
pub mod offline;
pub mod run;
pub mod settings;
pub mod show;
