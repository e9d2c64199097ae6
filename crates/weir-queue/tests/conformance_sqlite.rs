//! Every conformance case against the SQLite backend, each on a fresh file.
use weir_queue::{Queue, SqliteQueue};

weir_queue::conformance_tests!(|fp| async move {
    Queue::from(SqliteQueue::temporary(fp).expect("open a temporary queue"))
});
