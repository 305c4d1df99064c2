//! The batchfleet coordinator: from a manifest to a finished job.
//!
//! # Layout
//! - [`config`]: where RabbitMQ and Redis are (or the in-process stand-ins of
//!   `--local`), the signing key, and how `run` follows a job.
//! - [`error`]: why a run failed, one variant per exit code.
//! - [`manifest`]: parse and fully validate a job manifest before anything is published:
//!   the TOML types (`schema`), one check per section (`input`, `preprocess`,
//!   `model`, `policy` for batching and failure, `output`, `on_complete`), the
//!   file probes (`probes`) and the validated job with its id (`spec`).
//! - [`planner`]: cut input files into evenly sized work items on record boundaries.
//! - [`dispatcher`]: register the job in Redis and publish its items with confirms.
//! - [`monitor`]: follow progress in Redis, draw the progress bar, detect completion.
//! - [`supervisor`]: publish copies of items whose worker died or straggles;
//!   rebuild Redis state lost in an outage from the output files.
//! - [`reducer`]: write `summary.json` and `_SUCCESS` once every item is committed.
//! - [`hooks`]: `[on_complete]` command and webhook when the job ends.
//! - [`compare`]: prediction distributions of two jobs side by side, with drift.
//! - [`status`]: read a job's state for `batchfleet status`.
//! - [`dlq`]: list, replay and purge dead-lettered items.
//! - [`local`]: `run --local` — the coordinator and worker pipelines in one
//!   process over the in-process queues and store; `dlq … --local`.
//! - [`cli`]: the `batchfleet` command line and its exit codes.
//!
//! [`run_job`] ties the parts together; `main.rs` only parses flags and calls [`cli::main`].

pub mod cli;
pub mod compare;
pub mod config;
pub mod dispatcher;
pub mod dlq;
pub mod error;
pub mod hooks;
pub mod local;
pub mod manifest;
pub mod monitor;
pub mod planner;
pub mod reducer;
pub mod status;
pub mod supervisor;

use batchfleet_shared::store::Store;
pub use config::{Connections, RunConfig};
pub use error::RunError;
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

/// How a `run` ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RunOutcome {
    /// Every item committed; the summary is written.
    Completed {
        /// Job id.
        job_id: String,
        /// Path of `summary.json`.
        summary: PathBuf,
        /// The summary.
        report: Box<reducer::Summary>,
    },
    /// The job had completed before; nothing was published.
    AlreadyCompleted {
        /// Job id.
        job_id: String,
        /// Path of `summary.json`.
        summary: PathBuf,
    },
    /// Stopped by a signal while waiting; the fleet keeps working and
    /// running the same manifest again re-attaches.
    Interrupted {
        /// Job id.
        job_id: String,
    },
}

/// Runs the job of a manifest to completion: validate, connect, plan,
/// publish, follow, summarize. Safe to run again: a completed job publishes
/// nothing, an unfinished one is resumed.
pub async fn run_job(
    cfg: &RunConfig,
    manifest_path: &Path,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let submitted_ms = batchfleet_shared::now_ms();
    let spec = manifest::load(manifest_path, &cfg.data_roots)?;
    tracing::info!(job = %spec.job_id, files = spec.files.len(), "manifest valid");
    run_spec(cfg, &spec, submitted_ms, shutdown).await
}

/// [`run_job`] for a manifest validated already; `submitted_ms` is when the
/// run started.
pub async fn run_spec(
    cfg: &RunConfig,
    spec: &manifest::JobSpec,
    submitted_ms: u64,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let store = cfg.connections.store().await?;
    let broker = cfg
        .connections
        .broker(&format!("batchfleet coordinator {}", spec.job_id))
        .await?;
    let outcome = dispatcher::dispatch(cfg, spec, &store, &*broker, submitted_ms).await;
    let outcome = match outcome {
        Ok(dispatcher::Dispatched::AlreadyCompleted { summary }) => {
            Ok(RunOutcome::AlreadyCompleted {
                job_id: spec.job_id.clone(),
                summary,
            })
        }
        Ok(dispatcher::Dispatched::Running { plan }) => {
            let mut supervisor = supervisor::Supervisor::new(
                &spec.job_id,
                cfg,
                Some(std::sync::Arc::new(spec.clone())),
                Some(plan),
            );
            follow_with(cfg, &store, &spec.job_id, shutdown, &mut supervisor).await
        }
        Err(e) => Err(e),
    };
    broker.close("bye").await;
    outcome
}

/// Resumes a job by id: runs its manifest (recorded in Redis) again, which
/// must still describe the same job.
pub async fn resume_job(
    cfg: &RunConfig,
    job_id: &str,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let store = cfg.connections.store().await?;
    let job = store.job(job_id).await?.ok_or_else(|| {
        RunError::Output(format!(
            "no job \"{job_id}\" in Redis; run its manifest with `batchfleet run <manifest>` (that also resumes it, rebuilding its progress from the output folder)"
        ))
    })?;
    let manifest = PathBuf::from(&job.manifest);
    let spec = manifest::load(&manifest, &cfg.data_roots)?;
    if spec.job_id != job_id {
        return Err(RunError::Output(format!(
            "{} now describes job {} instead of {job_id} (the manifest, its input or its model changed); restore them to resume {job_id}",
            manifest.display(),
            spec.job_id
        )));
    }
    run_job(cfg, &manifest, shutdown).await
}

/// Follows a published job until it settles (or `shutdown`), then writes its summary.
pub async fn follow_job(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let mut supervisor = supervisor::Supervisor::new(job_id, cfg, None, None);
    follow_with(cfg, store, job_id, shutdown, &mut supervisor).await
}

async fn follow_with(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    shutdown: CancellationToken,
    supervisor: &mut supervisor::Supervisor,
) -> Result<RunOutcome, RunError> {
    match monitor::follow(store, job_id, cfg, shutdown, supervisor).await? {
        monitor::Followed::Interrupted => Ok(RunOutcome::Interrupted {
            job_id: job_id.to_owned(),
        }),
        monitor::Followed::AllDone
        | monitor::Followed::BudgetExceeded
        | monitor::Followed::JobFailed => {
            let spec = supervisor.spec().await.ok();
            let output = spec
                .as_ref()
                .map(|s| s.task.output.clone())
                .unwrap_or_default();
            let (summary, mut report) = reducer::finish(store, job_id, &output).await?;
            if let Some(spec) = spec.filter(|s| s.on_complete != manifest::OnComplete::default()) {
                let body = batchfleet_shared::source::fs::read(&summary).unwrap_or_default();
                let cwd = spec
                    .manifest_path
                    .parent()
                    .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
                report.on_complete = Some(
                    hooks::run(
                        &spec.on_complete,
                        job_id,
                        &report.status,
                        &summary,
                        &body,
                        &cwd,
                    )
                    .await,
                );
                reducer::rewrite(&summary, &report)?;
            }
            Ok(RunOutcome::Completed {
                job_id: job_id.to_owned(),
                summary,
                report: Box::new(report),
            })
        }
    }
}
