//! Every conformance case against the memory backend.
use std::sync::Arc;
use weir_queue::{MemoryQueue, WorkQueue};

weir_queue::conformance_tests!(|fp| async move {
    Arc::new(MemoryQueue::with_limits(1000, fp)) as Arc<dyn WorkQueue>
});
