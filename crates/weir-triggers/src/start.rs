//! Starting a wave where its event is journaled: the webhook fast path, an operation of the
//! executor that triggers reach through the [`StartHere`] handle, so that they never depend on
//! the executor (and never run a node themselves).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use weir_queue::{QueueError, WorkItem};

/// Journal an event and, where its wave can start at once, start it here: the executor's
/// side of the webhook fast path.
#[async_trait::async_trait]
pub trait StartHere: Send + Sync {
    /// Journal `item` (an event of its flow's source node `item.node`). When the queue can
    /// claim an item as it journals it, the flow has a place free now and the wave reaches
    /// no stateful node, the item is journaled claimed for this engine and its wave started
    /// for the caller to run; otherwise it is journaled ready, for the executor to claim in
    /// order (`Ok(None)`). Either way it is journaled when this answers `Ok`.
    async fn journal_and_start(&self, item: WorkItem) -> Result<Option<StartedWave>, QueueError>;
}

/// A wave started where its item was journaled ([`StartHere::journal_and_start`]): its caller
/// polls it (it is a future that ends with the wave) as long as it waits for what the wave
/// gives it, in its own task, with no hand-off between. Dropped before the wave ends, the
/// rest of it runs as a task of its own: a caller gone (a client that hung up) never
/// strands a wave. Shutdown waits for it like any other.
pub struct StartedWave(Option<Pin<Box<dyn Future<Output = ()> + Send>>>);

impl StartedWave {
    /// The wave `wave` runs, started by its caller.
    pub fn new(wave: impl Future<Output = ()> + Send + 'static) -> Self {
        StartedWave(Some(Box::pin(wave)))
    }

    /// Run the wave in the caller's task while waiting for `until` (its reply, say), and
    /// give what `until` gives. The wave may end before; whatever is left of it after runs
    /// on its own once this is dropped.
    pub async fn run_until<T>(&mut self, until: impl Future<Output = T>) -> T {
        tokio::pin!(until);
        let mut ended = false;
        loop {
            tokio::select! {
                biased;
                _ = &mut *self, if !ended => ended = true,
                got = &mut until => return got,
            }
        }
    }
}

impl Future for StartedWave {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(wave) = self.0.as_mut() else {
            return Poll::Ready(());
        };
        // A node that panics (a bug; in a node type an embedder added, say) fails its wave
        // alone, as it would in a task of its own, not the request whose task runs it: the
        // item stays in flight and comes back after the reclaim delay.
        let polled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wave.as_mut().poll(cx)));
        let ended = polled.unwrap_or_else(|_| {
            tracing::error!("a wave panicked; its item is redelivered after the reclaim delay");
            Poll::Ready(())
        });
        if ended.is_ready() {
            self.0 = None;
        }
        ended
    }
}

impl Drop for StartedWave {
    fn drop(&mut self) {
        if let Some(wave) = self.0.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn(wave)),
                // No runtime to run it on (the process is ending): its item is in flight
                // under this engine's name, and the next start takes it back.
                Err(_) => tracing::warn!("a wave was left unfinished with no runtime to finish it; its item is redelivered at the next start"),
            }
        }
    }
}
