//! A delivery held by its handler: acknowledged or returned at most once,
//! whichever path settles it first (the handler, the lease's early ack, or
//! the drop backstop after a panic).

use batchfleet_shared::broker::{Delivery, Headers};
use batchfleet_shared::message::{ATTEMPT_HEADER, UNKNOWN_SINCE_HEADER};
use batchfleet_shared::signing::SigningKey;
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
    /// Whether its settling headers (attempt, unknown-job grace) may be
    /// believed: no signing key, or their seal verifies.
    settling_trusted: bool,
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
    /// Holds a new delivery; with a signing `key`, its settling headers
    /// count only when their seal verifies.
    pub fn new(delivery: Delivery, key: Option<&SigningKey>) -> Self {
        let settling_trusted = delivery.headers.settling_trusted(key);
        if !settling_trusted {
            tracing::warn!(message = %delivery.message_id, "the message's attempt and grace headers are not sealed with the signing key; ignoring them");
        }
        Self {
            delivery,
            settled: AtomicBool::new(false),
            received: Instant::now(),
            settling_trusted,
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

    /// The 1-based attempt in the header (1 if absent, or not sealed when
    /// signing is on).
    pub fn attempt(&self) -> u32 {
        if !self.settling_trusted {
            return 1;
        }
        self.headers()
            .int(ATTEMPT_HEADER)
            .unwrap_or(1)
            .clamp(1, i64::from(u32::MAX)) as u32
    }

    /// The delivery's own headers to carry on (see `Headers::own`), with
    /// the settling headers as this worker believes them: the attempt it
    /// counts, and the unknown-job grace only when trusted. So a worker
    /// never seals, by republishing, a value it ignored.
    pub fn own_headers(&self) -> Headers {
        let mut h = self.headers().own();
        h.set([], [(ATTEMPT_HEADER, i64::from(self.attempt()))]);
        match self.unknown_since() {
            Some(since) => h.set([], [(UNKNOWN_SINCE_HEADER, since)]),
            None => {
                h.remove(UNKNOWN_SINCE_HEADER);
            }
        }
        h
    }

    /// When a worker first found the item's job unknown (the header), if
    /// it may be believed.
    pub fn unknown_since(&self) -> Option<i64> {
        if !self.settling_trusted {
            return None;
        }
        self.headers().int(UNKNOWN_SINCE_HEADER)
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
