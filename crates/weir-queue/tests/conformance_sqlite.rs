//! Every conformance case against the SQLite backend, each on a fresh file.
use std::sync::Arc;
use weir_queue::{SqliteQueue, WorkQueue};

weir_queue::conformance_tests!(|fp| async move {
    Arc::new(SqliteQueue::temporary(fp).expect("open a temporary queue")) as Arc<dyn WorkQueue>
});
