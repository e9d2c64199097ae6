//! Whether triggers still take new events: closed at shutdown, when webhooks answer 503 and
//! MQTT acknowledgements stop, so nothing is accepted that the engine will not journal.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Clone, Default)]
pub struct Intake(Arc<AtomicBool>);

impl Intake {
    pub fn open() -> Self {
        Intake(Arc::new(AtomicBool::new(true)))
    }
    pub fn close(&self) {
        self.0.store(false, Ordering::SeqCst);
    }
    pub fn is_open(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}
