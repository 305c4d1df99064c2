//! Why a coordinator command failed; [`crate::cli`] maps each variant to an exit code.

use crate::{manifest, planner};
use batchfleet_shared::broker::BrokerError;
use batchfleet_shared::store::StoreError;

/// Why a `run` failed. Each variant maps to an exit code in [`cli`].
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
    /// Output could not be written or is inconsistent.
    #[error("{0}")]
    Output(String),
    /// The worker pipelines of a `--local` run could not start or all stopped.
    #[error("{0}")]
    LocalWorkers(String),
}
