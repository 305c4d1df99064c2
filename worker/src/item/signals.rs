//! What an item's handler, its heartbeat and its model calls share: rows
//! finished so far for the lease, and the events that end the item early
//! (done elsewhere, job cancelled, a first turn at the model that took too
//! long).

use super::lease::WaitHold;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// What an item's handler and its heartbeat share.
#[derive(Debug, Default)]
pub struct Signals {
    /// Rows of the item finished so far (checkpointed segments), for the heartbeat.
    pub rows_done: AtomicU64,
    /// Rows skipped thanks to a checkpoint, for the heartbeat.
    pub rows_resumed: AtomicU64,
    /// Cancelled when the heartbeat finds the item done elsewhere.
    pub done_elsewhere: CancellationToken,
    /// Cancelled when the heartbeat finds the job cancelled: the item stops
    /// at its next checkpoint, keeping the segments it finished.
    pub job_stopped: CancellationToken,
    /// Cancelled when the item waited longer than `ack_after` without
    /// reaching the model: it goes back to the queue for another worker.
    pub waited_too_long: CancellationToken,
    /// Set once the item had its first turn at the model. Only such an item
    /// is acknowledged early, so unacknowledged items never exceed the prefetch in force.
    pub at_model: AtomicBool,
    /// When the item had its first turn at the model: a lease written
    /// lazily is dated from it.
    pub turn: OnceLock<Instant>,
    /// While an item started without a lease waits for its first turn at
    /// the model, its worker's beat says it holds work of the job waiting
    /// ([`WaitHold`]); dropped at the turn.
    pub waiting: Mutex<Option<WaitHold>>,
    /// Set once the item's lease is in Redis: written by the start script,
    /// or by the first heartbeat of an item started without one. An item
    /// settled before that has no lease to drop.
    pub leased: AtomicBool,
    /// Set when the item's commit carried its lease (the commit script
    /// dropped it); a lease written after that is dropped at the end.
    pub lease_committed: AtomicBool,
    /// Set once the item's commit has begun (its part file is published and
    /// the commit handed to its group): the heartbeat writes nothing more.
    /// A lease written now would be refused once the commit lands (and cost
    /// a done check), or outlive the commit and cost a drop; until the
    /// commit lands the item is held as before it (its delivery or its
    /// lease), for at most the group's linger and one Redis call.
    pub committing: AtomicBool,
    /// Cancelled to stop the heartbeat.
    pub(crate) stop: CancellationToken,
}

impl Signals {
    /// The item's first turn at the model (and any later one): it no
    /// longer waits, and from now on a heartbeat may lease it.
    pub fn reached_model(&self) {
        if !self.at_model.swap(true, Ordering::SeqCst) {
            let _ = self.turn.set(Instant::now());
            self.stop_waiting();
        }
    }

    /// Ends the item's share of its worker's waiting beat.
    pub fn stop_waiting(&self) {
        drop(
            self.waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
    }
}
