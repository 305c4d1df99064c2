//! Why an item failed, classified by what to do about it.

use std::fmt;

/// What a failure calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Might succeed later (I/O hiccup, Redis unavailable, out of memory):
    /// return the item to the queue.
    Transient,
    /// The item ran past `item_timeout`; retried like a transient failure.
    Timeout,
    /// Will fail again wherever it runs (undecodable message, malformed input,
    /// the model raises on this input): dead-letter it with the reason.
    Poison,
    /// This worker cannot do any work (model will not load or does not match
    /// its digest): return the item and stop consuming.
    Fatal,
}

impl FailureClass {
    /// Whether another attempt may succeed.
    pub fn retryable(self) -> bool {
        matches!(self, FailureClass::Transient | FailureClass::Timeout)
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailureClass::Transient => "transient",
            FailureClass::Timeout => "timeout",
            FailureClass::Poison => "poison",
            FailureClass::Fatal => "fatal",
        })
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
    /// A transient failure.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Transient,
            message: message.into(),
        }
    }
    /// A timeout.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Timeout,
            message: message.into(),
        }
    }
    /// A poison failure.
    pub fn poison(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Poison,
            message: message.into(),
        }
    }
    /// A fatal failure.
    pub fn fatal(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Fatal,
            message: message.into(),
        }
    }
}
