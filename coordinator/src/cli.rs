//! The `batchfleet` command line.
//!
//! Exit codes: 0 success (or job already complete), 1 runtime failure (broker,
//! Redis, I/O), 2 invalid manifest or usage (nothing was published), 3 job
//! finished but some items failed for good (listed in `summary.json`, no
//! `_SUCCESS`), 4 job failed (error budget exceeded, remaining items skipped),
//! 130 interrupted while following a job (the workers carry on).

use crate::{status, Connections, RunConfig, RunError, RunOutcome};
use batchfleet_shared::secret::SecretUrl;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Exit code: invalid manifest or usage; nothing was published.
pub const EXIT_INVALID: u8 = 2;
/// Exit code: runtime failure (broker, Redis, I/O).
pub const EXIT_FAILURE: u8 = 1;
/// Exit code: every item settled but some failed for good (no `_SUCCESS`).
pub const EXIT_COMPLETED_WITH_FAILURES: u8 = 3;
/// Exit code: the error budget was exceeded; the job failed and its remaining items were skipped.
pub const EXIT_JOB_FAILED: u8 = 4;
/// Exit code: interrupted by a signal while following a job.
pub const EXIT_INTERRUPTED: u8 = 130;

/// batchfleet: batch inference over RabbitMQ, Redis and libtorch workers.
#[derive(Debug, Parser)]
#[command(name = "batchfleet", version, about, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags every command takes.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// RabbitMQ URL. Credentials in it are never logged.
    #[arg(
        long,
        env = "BATCHFLEET_AMQP_URL",
        default_value = "amqp://127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true
    )]
    pub amqp_url: SecretUrl,
    /// Redis URL. Credentials in it are never logged.
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/",
        global = true,
        hide_env_values = true
    )]
    pub redis_url: SecretUrl,
    /// Prefix of every Redis key batchfleet writes.
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_PREFIX",
        default_value = "bf",
        global = true
    )]
    pub redis_prefix: String,
    /// How long to wait for RabbitMQ or Redis to answer (e.g. 10s, 1m).
    #[arg(long, env = "BATCHFLEET_CONNECT_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    pub connect_timeout: Duration,
    /// Log format: text or json.
    #[arg(long, env = "BATCHFLEET_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"], global = true)]
    pub log_format: String,
}

impl GlobalArgs {
    fn connections(&self) -> Connections {
        Connections {
            amqp_url: self.amqp_url.clone(),
            redis_url: self.redis_url.clone(),
            redis_prefix: self.redis_prefix.clone(),
            connect_timeout: self.connect_timeout,
        }
    }
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validate a manifest, publish its work items and follow the job to completion.
    ///
    /// Running the same manifest again resumes an unfinished job and reports a
    /// finished one without publishing anything.
    Run(RunArgs),
    /// Show a job's state.
    Status(StatusArgs),
}

/// `batchfleet run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The job manifest (TOML); see docs/manifest.md.
    pub manifest: PathBuf,
    /// Do not draw a progress bar (it is drawn only on a terminal anyway).
    #[arg(long, env = "BATCHFLEET_NO_PROGRESS")]
    pub no_progress: bool,
    /// How often progress is read from Redis.
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    pub poll_interval: Duration,
    /// Publishes allowed in flight before waiting for the broker's confirms.
    #[arg(long, default_value_t = 512)]
    pub publish_window: usize,
}

/// `batchfleet status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Job id, as printed by `batchfleet run` (`<name>-<hash>`).
    pub job: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs a parsed command line and returns the process exit code.
pub async fn main(cli: Cli) -> ExitCode {
    batchfleet_shared::telemetry::init("info", cli.global.log_format == "json");
    let connections = cli.global.connections();
    match cli.command {
        Command::Run(args) => {
            let cfg = RunConfig {
                connections,
                progress: !args.no_progress,
                poll_interval: args.poll_interval,
                publish_window: args.publish_window,
            };
            let shutdown = batchfleet_shared::shutdown::on_signals();
            match crate::run_job(&cfg, &args.manifest, shutdown).await {
                Ok(outcome) => report_outcome(&outcome),
                Err(e) => report_error(&e),
            }
        }
        Command::Status(args) => {
            let store = match connections.store().await {
                Ok(s) => s,
                Err(e) => return report_error(&RunError::Store(e)),
            };
            match status::report(&store, &args.job).await {
                Ok(Some(r)) if args.json => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&r).expect("report serializes")
                    );
                    ExitCode::SUCCESS
                }
                Ok(Some(r)) => {
                    println!("{}", status::render(&r));
                    ExitCode::SUCCESS
                }
                Ok(None) => {
                    eprintln!("error: no job \"{}\" in Redis (prefix {}); job ids look like <name>-<hash>, as printed by `batchfleet run`", args.job, store.prefix());
                    ExitCode::from(EXIT_FAILURE)
                }
                Err(e) => report_error(&RunError::Store(e)),
            }
        }
    }
}

fn report_outcome(outcome: &RunOutcome) -> ExitCode {
    match outcome {
        RunOutcome::Completed {
            job_id,
            summary,
            report,
        } => {
            println!(
                "job {job_id} {}: {} rows in {} items, {:.1}s, {} rows/s (item p50 {} ms, p95 {} ms, {} workers)",
                report.status, report.rows_predicted, report.items_completed, report.duration_s, report.rows_per_s,
                report.item_latency_ms.p50, report.item_latency_ms.p95, report.workers
            );
            println!("summary: {}", summary.display());
            if report.failed_items.is_empty() {
                return ExitCode::SUCCESS;
            }
            eprintln!(
                "{} item(s) failed for good and were dead-lettered (no _SUCCESS written):",
                report.items_failed
            );
            for f in report.failed_items.iter().take(20) {
                eprintln!(
                    "  item {} [{}] on {}: {}",
                    f.seq, f.class, f.worker, f.reason
                );
            }
            if report.failed_items.len() > 20 {
                eprintln!(
                    "  … and {} more in summary.json",
                    report.failed_items.len() - 20
                );
            }
            if report.status == "failed" {
                eprintln!("the error budget was exceeded: job failed, {} item(s) skipped. `batchfleet dlq list --pool {}` shows the dead items; fix the cause, then `batchfleet dlq replay --job {job_id}` or run the manifest again", report.items_skipped, report.pool);
                return ExitCode::from(EXIT_JOB_FAILED);
            }
            eprintln!("fix the cause, then `batchfleet dlq replay --job {job_id}` (or run the same manifest again) to retry them");
            ExitCode::from(EXIT_COMPLETED_WITH_FAILURES)
        }
        RunOutcome::AlreadyCompleted { job_id, summary } => {
            println!("job {job_id} is already complete; nothing was published");
            println!("summary: {}", summary.display());
            ExitCode::SUCCESS
        }
        RunOutcome::Interrupted { job_id } => {
            eprintln!("interrupted; job {job_id} keeps running on the workers. Run the same manifest again to follow it, or `batchfleet status {job_id}`.");
            ExitCode::from(EXIT_INTERRUPTED)
        }
    }
}

fn report_error(e: &RunError) -> ExitCode {
    eprintln!("error: {e}");
    match e {
        RunError::Manifest(_) => {
            eprintln!("nothing was published; fix the manifest and run again");
            ExitCode::from(EXIT_INVALID)
        }
        _ => ExitCode::from(EXIT_FAILURE),
    }
}
