//! Named failpoints, for tests that break things on purpose.
//!
//! A failpoint is armed with a count: the next `count` times code passes it, it fires. Tests
//! arm them through the engine builder or the `WEIR_FAILPOINTS` variable (`name=count,…`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Default)]
pub struct Failpoints(Arc<Armed>);

#[derive(Debug, Default)]
struct Armed {
    /// Whether any failpoint was ever armed: the points code passes on every item ask this
    /// first, and nothing more while none is.
    any: AtomicBool,
    counts: Mutex<HashMap<String, u32>>,
}

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
        let mut m = self.0.counts.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(name.to_string(), count);
        if count > 0 {
            self.0.any.store(true, Ordering::Release);
        }
    }

    /// Whether any failpoint was ever armed: a caller that builds a failpoint's name asks
    /// this first.
    pub fn any(&self) -> bool {
        self.0.any.load(Ordering::Acquire)
    }

    /// Whether the failpoint fires now (and uses up one of its count).
    pub fn hit(&self, name: &str) -> bool {
        if !self.any() {
            return false;
        }
        let mut m = self.0.counts.lock().unwrap_or_else(|p| p.into_inner());
        match m.get_mut(name) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_failpoint_fires_as_often_as_it_was_armed() {
        let fp = super::Failpoints::new();
        assert!(!fp.any() && !fp.hit("x"));
        fp.arm("x", 2);
        assert!(fp.any());
        assert!(fp.hit("x") && fp.hit("x") && !fp.hit("x"));
        assert!(!fp.hit("y"), "another name is not armed");
    }
}
