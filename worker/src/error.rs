//! Why an item failed, classified by who is at fault and so what to do.
//!
//! Every failure has one owner, and only its owner pays (docs/failures.md):
//!
//! | owner | classes | what happens |
//! | --- | --- | --- |
//! | the item | transient, timeout, panic, poison | retried later (up to `max_attempts`), or dead-lettered at once (poison) |
//! | the job | unrunnable | nobody can run it (the model is not TorchScript, changed, or raises on load): the job fails at once, its other items are skipped |
//! | the worker | unable, disk_full | this machine cannot (no CUDA device, model not readable here, out of memory on one row; no space left): the item is handed back untouched, the worker leaves the job (or all work, when its disk is full) to others for a while |
//! | the message | rejected | forged or impossible (bad signature, unknown job, digest, folder or item that disagree with the job record, sizes past the caps): dead-lettered as `rejected`, no item state touched, no file read |
//!
//! A bad *row* is not an item failure at all: it is rejected into the
//! item's rejects file (see `reader`).

use batchfleet_shared::metrics::names;
use std::fmt;

/// Who a failure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// This item (its input, or the model on this input).
    Item,
    /// The whole job: no worker can run it.
    Job,
    /// This worker: another one may succeed.
    Worker,
    /// The message itself: not a real work item of a running job.
    Message,
}

/// What a failure calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Might succeed later (I/O hiccup, Redis unavailable): retry later.
    Transient,
    /// The item ran past `item_timeout`; retried like a transient failure.
    Timeout,
    /// The worker panicked handling the item (a batchfleet bug this input
    /// reaches): retried, then dead-lettered; the worker carries on.
    Panic,
    /// Will fail again wherever it runs (malformed input, the model raises
    /// on this input, a planted link in the output folder): dead-letter it.
    Poison,
    /// No worker can run the job: the model file is not TorchScript, does
    /// not match the job's digest, or raises on load. The job fails at once.
    Unrunnable,
    /// This worker cannot run the job's items: no such CUDA device, the model
    /// file unreadable here, out of memory on a single row. Hand the item
    /// back and leave the job to other workers for a while.
    Unable,
    /// No space left on the output's filesystem: hand the item back and
    /// pause consuming, backing off, until space is freed. Never spends an
    /// attempt or the error budget.
    DiskFull,
    /// A forged or impossible message: dead-letter it as `rejected` without
    /// touching any item's state.
    Rejected,
    /// `max_crashes` workers died holding the item (killed, out of memory,
    /// a fault inside libtorch): it kills whoever runs it. Dead-lettered
    /// when the next worker takes it, before it runs; the job goes on.
    Crash,
}

impl FailureClass {
    /// Whether another attempt on this item may succeed (counted against `max_attempts`).
    pub fn retryable(self) -> bool {
        matches!(
            self,
            FailureClass::Transient | FailureClass::Timeout | FailureClass::Panic
        )
    }

    /// Who is at fault.
    pub fn owner(self) -> Owner {
        match self {
            FailureClass::Transient
            | FailureClass::Timeout
            | FailureClass::Panic
            | FailureClass::Poison
            | FailureClass::Crash => Owner::Item,
            FailureClass::Unrunnable => Owner::Job,
            FailureClass::Unable | FailureClass::DiskFull => Owner::Worker,
            FailureClass::Rejected => Owner::Message,
        }
    }

    /// The name in dead letters, Redis, metrics and `status`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Transient => "transient",
            FailureClass::Timeout => "timeout",
            FailureClass::Panic => "panic",
            FailureClass::Poison => "poison",
            FailureClass::Unrunnable => "unrunnable",
            FailureClass::Unable => "unable",
            FailureClass::DiskFull => "disk_full",
            FailureClass::Rejected => "rejected",
            FailureClass::Crash => "crash",
        }
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed item: its class and a message naming the file, row or model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct ItemError {
    /// What to do.
    pub class: FailureClass,
    /// What happened.
    pub message: String,
}

impl ItemError {
    /// A failure of `class`.
    pub fn new(class: FailureClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
        }
    }
    /// A transient failure.
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Transient, message)
    }
    /// A timeout.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Timeout, message)
    }
    /// A poison failure.
    pub fn poison(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Poison, message)
    }
    /// A panic while handling the item.
    pub fn panic(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Panic, message)
    }
    /// Nobody can run the job.
    pub fn unrunnable(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Unrunnable, message)
    }
    /// This worker cannot run the job.
    pub fn unable(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Unable, message)
    }
    /// A bad message.
    pub fn rejected(message: impl Into<String>) -> Self {
        Self::new(FailureClass::Rejected, message)
    }

    /// An I/O error on the output folder while `doing` (e.g. "cannot write
    /// out/part-000001.csv"): a full disk pauses the worker, a planted link
    /// poisons the item, anything else is transient.
    pub fn output_io(doing: impl fmt::Display, e: &std::io::Error) -> Self {
        let message = format!("{doing}: {e}");
        if batchfleet_shared::fsutil::is_disk_full(e) {
            Self::new(FailureClass::DiskFull, message)
        } else if batchfleet_shared::fsutil::is_symlink_refusal(e) {
            Self::poison(message)
        } else {
            Self::transient(message)
        }
    }
}

/// The message of a panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-text payload".into())
}

/// Runs `f` on the blocking pool; a panic in it fails the item (class `panic`).
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ItemError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        if e.is_panic() {
            metrics::counter!(names::WORKER_PANICS, "where" => "item").increment(1);
            ItemError::panic(format!(
                "the worker panicked handling the item: {}",
                panic_message(e.into_panic().as_ref())
            ))
        } else {
            ItemError::transient(format!("worker task failed: {e}"))
        }
    })
}

/// [`blocking`] bounded by the item's `item_timeout`: a read or write
/// (`step`: `read` of the item's input, `write` of its output) that has
/// not returned by then fails the item with class `timeout` (retried like
/// a transient failure). The blocking call itself cannot be interrupted (a
/// read stuck in the kernel on a hung mount) and keeps its thread until it
/// returns, its result discarded; a write that completes late publishes a
/// part file as a speculative copy would, which the retry then commits or
/// finds there (first commit wins).
pub async fn blocking_within<T: Send + 'static>(
    item_timeout: std::time::Duration,
    step: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ItemError> {
    match tokio::time::timeout(item_timeout, blocking(f)).await {
        Ok(done) => done,
        Err(_) => {
            metrics::counter!(names::WORKER_STALLED_IO, "step" => step).increment(1);
            let what = if step == "read" {
                "reading the item's input"
            } else {
                "writing the item's output"
            };
            Err(ItemError::timeout(format!(
                "{what} did not finish within item_timeout ({}s): a read or write that stalls (a hung network mount?) — the item is retried; this worker's thread stays blocked until the call returns",
                item_timeout.as_secs_f64()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_class_has_one_owner_and_only_item_failures_spend_attempts() {
        use FailureClass::*;
        for c in [
            Transient, Timeout, Panic, Poison, Unrunnable, Unable, DiskFull, Rejected,
        ] {
            assert_eq!(
                c.retryable(),
                matches!(c, Transient | Timeout | Panic),
                "{c}"
            );
            if c.retryable() {
                assert_eq!(c.owner(), Owner::Item);
            }
        }
        assert_eq!(Unrunnable.owner(), Owner::Job);
        assert_eq!(DiskFull.owner(), Owner::Worker);
        assert_eq!(Rejected.owner(), Owner::Message);
    }

    #[test]
    fn output_errors_are_classified_by_cause() {
        let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
        assert_eq!(
            ItemError::output_io("cannot write x", &full).class,
            FailureClass::DiskFull
        );
        let other = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert_eq!(
            ItemError::output_io("cannot write x", &other).class,
            FailureClass::Transient
        );
    }
}
