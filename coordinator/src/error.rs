//! Why a coordinator command failed: a variant per cause, each saying what
//! went wrong and, where there is one, what to do. [`crate::cli`] maps each
//! to an exit code (an invalid manifest 2, anything else 1).

use crate::{manifest, planner};
use batchfleet_shared::broker::BrokerError;
use batchfleet_shared::store::StoreError;
use std::path::PathBuf;

/// Why a `run` (or another coordinator command) failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The manifest is invalid; nothing was published.
    #[error("{0}")]
    Manifest(#[from] manifest::ManifestError),
    /// RabbitMQ failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// Redis failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Planning failed (unreadable or malformed input).
    #[error(transparent)]
    Plan(#[from] planner::PlanError),
    /// A file or folder could not be read, listed or written.
    #[error("cannot {action}: {source}")]
    Io {
        /// What was being done, naming the path (`read /out/_summary.json`).
        action: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A file is not what it should be (a summary, a dead item).
    #[error("{} is not {what}: {reason}", path.display())]
    NotA {
        /// The file.
        path: PathBuf,
        /// What it should be (`a batchfleet summary`).
        what: &'static str,
        /// Why it is not.
        reason: String,
    },
    /// The output folder was changed under the job: a committed item
    /// without its part file, a part file whose rows do not add up.
    #[error("{0}; the output folder was changed during the job")]
    OutputChanged(String),
    /// The input gives other items than the running job was planned with.
    #[error("job {job} was planned with {planned_items} items / {planned_rows} rows but the input now gives {items} / {rows}; the input changed under a running job — restore it, or change the manifest to start a new job")]
    InputChanged {
        /// The job.
        job: String,
        /// Items when planned.
        planned_items: u64,
        /// Rows when planned.
        planned_rows: u64,
        /// Items now.
        items: u64,
        /// Rows now.
        rows: u64,
    },
    /// A manifest that now describes another job than the one to continue.
    #[error("{manifest} now describes job {now} instead of {was} ({changed}); {fix}")]
    ManifestMoved {
        /// The manifest file.
        manifest: String,
        /// The job it describes now.
        now: String,
        /// The job it described.
        was: String,
        /// What may have changed.
        changed: &'static str,
        /// What to do.
        fix: String,
    },
    /// No such job in the store (or it left it), with what to do.
    #[error("{0}")]
    UnknownJob(String),
    /// The job's record holds what this coordinator cannot use.
    #[error("job {job}: {problem}")]
    BadRecord {
        /// The job.
        job: String,
        /// What is wrong.
        problem: String,
    },
    /// Work on a thread of its own (planning, scanning the output folder)
    /// ended without an answer.
    #[error("{what} failed: {reason}")]
    Task {
        /// The work.
        what: &'static str,
        /// Why (its panic, or cancellation).
        reason: String,
    },
    /// The worker pipelines of a `--local` run could not start, or all
    /// stopped before the job ended.
    #[error("{0}")]
    LocalWorkers(String),
    /// This build has no local mode (the coordinator image leaves libtorch out).
    #[error("this batchfleet was built without local mode (the coordinator image leaves libtorch out); run --local with a full build (`cargo build --release`, default features) or the worker image")]
    NoLocalMode,
}

impl RunError {
    /// Whether RabbitMQ or Redis could not be reached (a restart or a
    /// failover, which `--connect-timeout` rides out).
    pub fn is_outage(&self) -> bool {
        match self {
            RunError::Store(e) => e.is_unavailable(),
            RunError::Broker(e) => e.is_unavailable(),
            _ => false,
        }
    }

    /// An I/O failure while doing `action` (which names the path).
    pub fn io(action: impl Into<String>, source: std::io::Error) -> Self {
        RunError::Io {
            action: action.into(),
            source,
        }
    }

    /// A closure for `map_err`: an I/O failure while doing `action`.
    pub fn io_while(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let action = action.into();
        move |source| RunError::Io { action, source }
    }
}
