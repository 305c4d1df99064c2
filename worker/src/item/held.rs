//! A delivery held by its handler: acknowledged or returned at most once,
//! whichever path settles it first (the handler, the lease's early ack, or
//! the drop backstop after a panic).

use batchfleet_shared::broker::{Delivery, Headers};
use batchfleet_shared::message::ATTEMPT_HEADER;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// A delivery and whether it has been settled (acked or nacked) yet: an item
/// acknowledged early is held by its lease alone and must not be settled twice.
pub struct Held {
    /// The delivery.
    pub delivery: Delivery,
    settled: AtomicBool,
    /// When it arrived.
    pub received: Instant,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("delivery", &self.delivery)
            .field("settled", &self.is_settled())
            .finish()
    }
}

impl Held {
    /// Holds a new delivery.
    pub fn new(delivery: Delivery) -> Self {
        Self {
            delivery,
            settled: AtomicBool::new(false),
            received: Instant::now(),
        }
    }

    /// Whether it was acked or returned already.
    pub fn is_settled(&self) -> bool {
        self.settled.load(Ordering::SeqCst)
    }

    /// The delivery's headers.
    pub fn headers(&self) -> &Headers {
        &self.delivery.headers
    }

    /// The 1-based attempt in the header (1 if absent).
    pub fn attempt(&self) -> u32 {
        self.headers()
            .int(ATTEMPT_HEADER)
            .unwrap_or(1)
            .clamp(1, i64::from(u32::MAX)) as u32
    }

    /// Acks unless already settled. A failure is only logged: the broker
    /// redelivers an unsettled message when the channel closes, and the done
    /// set makes that cheap.
    pub async fn ack(&self) {
        if self.settled.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Err(e) = self.delivery.ack().await {
            tracing::warn!(error = %e, "could not ack; the broker will redeliver the item");
        }
    }

    /// Returns the delivery to the queue. `false` if it was acknowledged
    /// early and must be published again instead.
    pub async fn requeue(&self, why: &str) -> bool {
        if self.settled.swap(true, Ordering::SeqCst) {
            return false;
        }
        if let Err(e) = self.delivery.requeue().await {
            tracing::warn!(error = %e, why, "could not return the item; the broker will redeliver it");
        }
        true
    }
}

impl Drop for Held {
    /// The backstop for a path that never settled the delivery (a panic
    /// outside the contained parts): it goes back to the queue now rather
    /// than sit unacknowledged until the channel closes.
    fn drop(&mut self) {
        if self.settled.swap(true, Ordering::SeqCst) {
            return;
        }
        let acker = self.delivery.acker();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = acker.requeue().await;
            });
        }
    }
}
