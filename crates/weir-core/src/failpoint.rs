//! Named failpoints, for tests that break things on purpose.
//!
//! A failpoint is armed with a count: the next `count` times code passes it, it fires. Tests
//! arm them through the engine builder or the `WEIR_FAILPOINTS` variable (`name=count,…`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Default)]
pub struct Failpoints(Arc<Mutex<HashMap<String, u32>>>);

impl Failpoints {
    pub fn new() -> Self {
        Self::default()
    }

    /// Read `name=count,name=count` (count defaults to 1).
    pub fn from_env() -> Self {
        let fp = Failpoints::new();
        if let Ok(spec) = std::env::var("WEIR_FAILPOINTS") {
            for part in spec.split(',').filter(|p| !p.is_empty()) {
                let (name, n) = part.split_once('=').unwrap_or((part, "1"));
                fp.arm(name.trim(), n.trim().parse().unwrap_or(1));
            }
        }
        fp
    }

    pub fn arm(&self, name: &str, count: u32) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), count);
    }

    /// Whether the failpoint fires now (and uses up one of its count).
    pub fn hit(&self, name: &str) -> bool {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match m.get_mut(name) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }
}
