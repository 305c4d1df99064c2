//! The batchfleet coordinator: from a manifest to a finished job.
//!
//! # Layout
//! - [`config`]: where RabbitMQ and Redis are (or the in-process stand-ins of
//!   `--local`), the signing key, and how `run` follows and supervises a job.
//! - [`error`]: why a command failed, a variant per cause.
//! - [`manifest`]: parse and fully validate a job manifest before anything is published:
//!   the TOML types (`schema`), one check per section (`input`, `preprocess`,
//!   `model`, `policy` for batching and failure, `output`, `on_complete`), the
//!   file probes (`probes`) and the validated job with its id (`spec`).
//! - [`job`]: a job's life — run, submit, resume, follow, cancel — and the
//!   reduce claim, by which one follower writes its summary and hooks.
//! - [`record`]: a job's record made from its spec and plan, and rebuilt
//!   from its output folder.
//! - [`planner`]: cut input files into evenly sized work items on record boundaries.
//! - [`dispatcher`]: register the job in Redis and publish its items with confirms.
//! - [`monitor`]: follow progress in Redis, draw the progress bar, detect completion.
//! - [`supervisor`]: publish copies of items whose worker died or straggles;
//!   rebuild Redis state lost in an outage from the output files.
//! - [`reducer`]: write `_summary.json` and `_SUCCESS` once every item is committed.
//! - [`hooks`]: `[on_complete]` command and webhook when the job ends.
//! - [`compare`]: prediction distributions of two jobs side by side, with drift.
//! - [`shadow`]: the summary's `shadow` section — a candidate model
//!   (`[model.shadow]`) against the job's over the rows both predicted.
//! - [`control`]: `plan` (a manifest's job without publishing) and `gc`
//!   (finished jobs' state removed before its retention is up).
//! - [`status`]: read a job's state for `batchfleet status`, and the
//!   pools' needs for `batchfleet scale-advice`.
//! - [`pace`]: a job's pace against its `[job] deadline` and its cost: the
//!   workers its pool needs, measured by the coordinator that supervises it.
//! - [`since`]: incremental jobs (`run --since`): the files new or changed
//!   since a finished job, and what it reused.
//! - [`dlq`]: list, replay and purge dead-lettered items.
//! - [`local`]: `run --local` — the coordinator and worker pipelines in one
//!   process over the in-process queues and store; `dlq … --local`.
//! - [`cli`]: the `batchfleet` command line: one function per command, the
//!   clap types, the exit codes and reports, the DLQ commands.
//!
//! [`run_job`] ties the parts together; `main.rs` only parses flags and
//! calls [`cli::main`]. Modules are public where the tests, the worker's
//! tests or the benchmarks use them.

pub mod cli;
mod compare;
pub mod config;
pub mod control;
mod dispatcher;
pub mod dlq;
pub mod error;
pub mod hooks;
mod job;
pub mod local;
pub mod manifest;
mod monitor;
pub mod pace;
pub mod planner;
mod record;
pub mod reducer;
pub mod shadow;
pub mod since;
pub mod status;
mod supervisor;

pub use config::{Connections, RunConfig};
pub use error::RunError;
pub use job::{
    cancel_job, follow_job, follow_job_as, follower_id, is_reduced, resume_job, run_job, run_spec,
    submit_job, Cancelled, RunOutcome,
};
pub use supervisor::MAX_COPIES;
