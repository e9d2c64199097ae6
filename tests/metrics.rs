//! What `/metrics` costs an engine that nobody scrapes: the recorder keeps each histogram
//! sample until it folds them into buckets, and the engine has it do so every second, so the
//! samples of a long load are not kept.
//!
//! Its own test binary: it counts the bytes allocated and not freed in the whole process,
//! which other tests in the same process would move.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cap::Cap;
use weir::Engine;

#[global_allocator]
static ALLOCATOR: Cap<std::alloc::System> = Cap::new(std::alloc::System, usize::MAX);

/// Bytes allocated and not yet freed, in the whole process.
fn heap_in_use() -> usize {
    ALLOCATOR.allocated()
}

const MIB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histogram_samples_are_not_kept_when_nobody_scrapes_metrics() {
    let engine = Engine::builder()
        .queue_url("memory")
        .http(SocketAddr::from(([127, 0, 0, 1], 0)))
        .flow_str(
            "f.yaml",
            "nodes:\n  h: { type: webhook, path: in, to: [l] }\n  l: { type: log }\n",
        )
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    // The histogram a wave records into, as an engine under load does many times a second.
    let waves = metrics::histogram!("weir_wave_seconds", "flow" => "f");
    waves.record(0.001);
    let before = heap_in_use();

    // Two million samples, as fast as they come: the recorder holds them (8 bytes and a bit
    // each) until its next upkeep, at most a second away.
    let mut most = 0;
    for i in 0..2_000_000 {
        waves.record(0.001);
        if i % 50_000 == 0 {
            most = most.max(heap_in_use().saturating_sub(before));
        }
    }
    assert!(
        most >= 4 * MIB,
        "recording two million samples held only {most} bytes at most: this test no longer sees what it checks"
    );

    // With recording going on (each record also lets freed blocks be reclaimed), the held
    // samples are given back within a few upkeeps.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut held;
    loop {
        for _ in 0..1_000 {
            waves.record(0.001);
        }
        held = heap_in_use().saturating_sub(before);
        if held < 2 * MIB || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        held < 2 * MIB,
        "15 s after {} MiB of histogram samples, {} MiB are still held: nothing folds them into buckets unless /metrics is scraped",
        most / MIB,
        held / MIB
    );
    engine.shutdown().await;
}
