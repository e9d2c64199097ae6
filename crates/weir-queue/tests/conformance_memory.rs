//! Every conformance case against the memory backend.
use weir_queue::{MemoryQueue, Queue};

weir_queue::conformance_tests!(|fp| async move { Queue::from(MemoryQueue::with_limits(1000, fp)) });
