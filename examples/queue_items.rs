//! Items through a Redis queue as the queue bench's pipelined case drives them (a producer
//! adding batches of 256, two consumers claiming, each item committed on its own), for
//! counting what an item costs the client and the server under callgrind:
//! `cargo run --release --example queue_items -- redis://127.0.0.1:PORT BATCHES`.
//! `WEIR_INSTR_REDIS=1 bash benches/instructions` runs it.

use std::sync::Arc;

use weir_queue::{Failpoints, RedisOptions, RedisQueue, WorkQueue};
use weir_testkit::ceilings::{drive_pipelined, QueuePipe};

/// As the bench and the `weir` binary allocate.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BATCH: usize = 256;
const AHEAD: usize = 4;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = args
        .first()
        .expect("usage: queue_items redis://HOST:PORT BATCHES");
    let batches: u64 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(40);
    let q = RedisQueue::connect(url, RedisOptions::default(), Failpoints::new())
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let q: Arc<dyn WorkQueue> = Arc::new(q);
    let took = drive_pipelined(QueuePipe::new(q, BATCH), batches, BATCH, AHEAD).await;
    println!(
        "{} items in {:.2} s",
        batches * BATCH as u64,
        took.as_secs_f64()
    );
}
