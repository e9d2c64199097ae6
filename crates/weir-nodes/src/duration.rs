//! Durations as people write them in flows: `200ms`, `5s`, `1.5m`, `2h`, `1d` (parsed as
//! the queue's URLs and the flags are: [`parse`]).

use std::time::Duration;

use serde::Deserialize;
use weir_flow::Spanned;

use crate::ConfigError;

pub use weir_core::duration::parse;

/// A duration field in a config, checked with its position.
#[derive(Debug, Clone, PartialEq)]
pub struct Dur(pub Spanned<String>);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Dur(Spanned::deserialize(d)?))
    }
}

impl Dur {
    pub fn get(&self) -> Result<Duration, ConfigError> {
        parse(&self.0.value).map_err(|m| ConfigError::at(self.0.pos, m))
    }
}
