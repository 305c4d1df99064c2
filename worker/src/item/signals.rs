//! What an item's handler, its heartbeat and its model calls share: rows
//! finished so far for the lease, and the events that end the item early
//! (done elsewhere, job cancelled, a first turn at the model that took too
//! long).

use std::sync::atomic::{AtomicBool, AtomicU64};
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
    /// Set once the item's lease is in Redis: written by the start script,
    /// or by the first heartbeat of an item started without one. An item
    /// settled before that has no lease to drop.
    pub leased: AtomicBool,
    /// Set when the item's commit carried its lease (the commit script
    /// dropped it); a lease written after that is dropped at the end.
    pub lease_committed: AtomicBool,
    /// Cancelled to stop the heartbeat.
    pub(crate) stop: CancellationToken,
}
