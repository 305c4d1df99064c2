//! The `batchfleet` command line.
//!
//! Exit codes: 0 success (or job already complete), 1 runtime failure (broker,
//! Redis, I/O), 2 invalid manifest or usage (nothing was published), 3 job
//! finished but some items failed for good (listed in `summary.json`, no
//! `_SUCCESS`), 4 job failed (error budget exceeded, remaining items skipped),
//! 5 job failed at once because nobody can run it (the model is not
//! TorchScript, changed or raises on load, or no worker could take its items
//! within `--unable-timeout`), 6 job cancelled (`batchfleet cancel`; its
//! committed items stay, and `run` continues it), 130 interrupted while
//! following a job (the workers carry on).

use crate::config::{Connections, RunConfig};
use crate::error::RunError;
use crate::{status, RunOutcome};
use batchfleet_shared::backend::Backend;
use batchfleet_shared::config::ServiceArgs;
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
/// Exit code: nobody can run the job (its model, or no able worker): it failed at once.
pub const EXIT_JOB_UNRUNNABLE: u8 = 5;
/// Exit code: the job was cancelled (`batchfleet cancel`).
pub const EXIT_CANCELLED: u8 = 6;
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
    #[command(flatten)]
    pub services: ServiceArgs,
    #[command(flatten)]
    pub metrics: batchfleet_shared::metrics::MetricsArgs,
    /// How long to wait for RabbitMQ or Redis to answer (e.g. 10s, 1m).
    #[arg(long, env = "BATCHFLEET_CONNECT_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    pub connect_timeout: Duration,
    /// How long a finished job's state stays in Redis (e.g. 7d, 12h); its
    /// summary.json stays in the output folder for good. A running job's
    /// state never expires.
    #[arg(long, env = "BATCHFLEET_RETENTION", default_value = "7d", value_parser = humantime::parse_duration, global = true)]
    pub retention: Duration,
    /// A variable of this environment an `[on_complete]` command may see
    /// (repeat, or separate with commas); it otherwise gets only the job's
    /// BATCHFLEET_* variables and PATH, HOME, USER, LANG, LC_ALL, TZ, TMPDIR.
    #[arg(
        long = "hook-env",
        env = "BATCHFLEET_HOOK_ENV",
        value_delimiter = ',',
        global = true
    )]
    pub hook_env: Vec<String>,
    /// A variable a manifest may name in `webhook_token_env` or
    /// `webhook_url_env` (repeat, or separate with commas); none by default,
    /// so no manifest can send this process's secrets to a URL it chooses.
    #[arg(
        long = "hook-token-env",
        env = "BATCHFLEET_HOOK_TOKEN_ENV",
        value_delimiter = ',',
        global = true
    )]
    pub hook_token_env: Vec<String>,
    /// Allow `http://` webhooks (https only by default).
    #[arg(long, env = "BATCHFLEET_HOOK_ALLOW_HTTP", value_parser = clap::builder::BoolishValueParser::new(), global = true)]
    pub hook_allow_http: bool,
    /// Allow webhooks to link-local and cloud metadata addresses (refused
    /// by default, also when a host name resolves to one).
    #[arg(long, env = "BATCHFLEET_HOOK_ALLOW_LINK_LOCAL", value_parser = clap::builder::BoolishValueParser::new(), global = true)]
    pub hook_allow_link_local: bool,
}

impl GlobalArgs {
    /// The connection settings; an unreadable secret or key file is an
    /// error naming it.
    fn connections(&self) -> Result<Connections, String> {
        Ok(Connections {
            backend: Backend::Fleet {
                amqp: self.services.amqp().map_err(|e| e.to_string())?,
                redis: self.services.redis().map_err(|e| e.to_string())?,
                redis_prefix: self.services.redis_prefix.clone(),
            },
            connect_timeout: self.connect_timeout,
            signing_key: self.services.signing_key().map_err(|e| e.to_string())?,
            retention: self.retention,
            hooks: crate::hooks::HookPolicy {
                command_env: self.hook_env.clone(),
                token_env: self.hook_token_env.clone(),
                allow_http: self.hook_allow_http,
                allow_link_local: self.hook_allow_link_local,
            },
        })
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
    /// Continue a job by its id (after the coordinator that ran it died):
    /// publish what was never published, then follow it like `run`.
    ///
    /// The same as `batchfleet run` on the job's manifest, which must still
    /// describe the same job.
    Resume(ResumeArgs),
    /// Follow a job (submitted with `run --detach`, or by another process)
    /// to its end, with the exit codes of `run`.
    Wait(WaitArgs),
    /// Cancel a running job: queued items are skipped, in-flight ones stop
    /// at their next checkpoint, committed part files stay; `run` of the
    /// same manifest afterwards continues it from them.
    Cancel(CancelArgs),
    /// Follow every unfinished job nobody follows (detached ones): supervise
    /// its items and write its summary, `_SUCCESS` and hooks when it ends.
    /// One per fleet, next to RabbitMQ and Redis.
    Supervise(SuperviseArgs),
    /// Validate and plan a manifest without publishing anything: its job
    /// id, items, rows and bytes, and whether the job is new, running or done.
    Plan(PlanArgs),
    /// Show a job's state: progress, rates, failures by class, items in
    /// flight (slowest first) and workers.
    Status(StatusArgs),
    /// List recent jobs, newest first (the ones whose state is retained).
    Jobs(JobsArgs),
    /// Remove finished jobs' state from Redis now, instead of when their
    /// retention (--retention) is up; their summaries stay in the output folders.
    Gc(GcArgs),
    /// Compare the prediction distributions of two jobs (e.g. a new model
    /// version against the current one on the same data): histograms side
    /// by side, population stability index and KS distance per output.
    Compare(CompareArgs),
    /// Dead-lettered items: list, replay, purge.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Print a shell completion script for `batchfleet`: e.g.
    /// `batchfleet completions bash > /etc/bash_completion.d/batchfleet`,
    /// `batchfleet completions zsh > "${fpath[1]}/_batchfleet"`,
    /// `batchfleet completions fish > ~/.config/fish/completions/batchfleet.fish`.
    Completions(CompletionsArgs),
}

/// `batchfleet completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `batchfleet dlq …`.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead items (nothing is removed).
    List {
        /// Read the dead items a `batchfleet run --local` wrote to this
        /// output folder (`_dead/`) instead of a pool's dead queue.
        #[arg(long, value_name = "OUTPUT")]
        local: Option<PathBuf>,
        /// Pool whose dead queue to read.
        #[arg(long, env = "BATCHFLEET_POOL", default_value = "default")]
        pool: String,
        /// Only this job.
        #[arg(long)]
        job: Option<String>,
        /// Only this failure class (poison, transient, timeout, panic, infra, rejected).
        #[arg(long)]
        class: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Publish dead items of a job to the work queue again (attempts reset),
    /// then follow the job and rewrite its summary. Rejected messages (class
    /// `rejected`: forged or impossible) are never replayed; purge them.
    Replay {
        /// The job whose dead items to replay.
        #[arg(long, required_unless_present = "local")]
        job: Option<String>,
        /// Run the dead items of the `batchfleet run --local` job whose
        /// output folder this is again, in this process (its manifest, named
        /// in summary.json, is run with the committed items taken as done).
        #[arg(long, value_name = "OUTPUT", conflicts_with_all = ["class", "item", "pool", "no_wait"])]
        local: Option<PathBuf>,
        /// With --local: worker pipelines (default: one per core).
        #[arg(long, requires = "local")]
        workers: Option<usize>,
        /// With --local: libtorch threads per pipeline (default: the cores shared out).
        #[arg(long, requires = "local")]
        threads: Option<usize>,
        /// Only this failure class.
        #[arg(long)]
        class: Option<String>,
        /// Only this item.
        #[arg(long)]
        item: Option<u32>,
        /// Pool (default: the job's pool).
        #[arg(long)]
        pool: Option<String>,
        /// Accept the model file as it is now: replace the digest in each
        /// replayed item by the file's current digest (after swapping in a fixed model).
        #[arg(long)]
        update_model: bool,
        /// Return after publishing instead of following the job.
        #[arg(long)]
        no_wait: bool,
    },
    /// Delete dead items for good.
    Purge {
        /// Pool whose dead queue to purge.
        #[arg(long, env = "BATCHFLEET_POOL", default_value = "default")]
        pool: String,
        /// Only this job's items.
        #[arg(long)]
        job: Option<String>,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
}

/// `batchfleet run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The job manifest (TOML); see docs/manifest.md.
    pub manifest: PathBuf,
    /// Run the job in this process — the coordinator and `--workers`
    /// pipelines over in-process queues and job state — with no RabbitMQ
    /// or Redis. Same outputs, summary and exit codes; dead items go to
    /// `<output>/_dead/`. Killed and run again, it resumes from the
    /// committed part files.
    #[arg(long, env = "BATCHFLEET_LOCAL", value_parser = clap::builder::BoolishValueParser::new())]
    pub local: bool,
    /// With --local: worker pipelines, each with its own model (default: one per core).
    #[arg(long, env = "BATCHFLEET_LOCAL_WORKERS", requires = "local")]
    pub workers: Option<usize>,
    /// With --local: libtorch intra-op threads per pipeline (default: the
    /// cores shared out between the pipelines). Its variable is not the
    /// workers' BATCHFLEET_THREADS, which deployments share with the coordinator.
    #[arg(long, env = "BATCHFLEET_LOCAL_THREADS", requires = "local")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub overrides: OverrideArgs,
    /// Return as soon as the items are published, printing the job id;
    /// `batchfleet wait <job>` follows it later (or `batchfleet supervise`
    /// finishes it).
    #[arg(long, conflicts_with = "local")]
    pub detach: bool,
    /// Print one JSON object (job id, status, exit code, summary) on
    /// stdout instead of the human report.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub follow: FollowArgs,
}

/// `batchfleet wait`.
#[derive(Debug, Args)]
pub struct WaitArgs {
    /// Job id, as printed by `batchfleet run` (`<name>-<hash>`).
    pub job: String,
    /// Print one JSON object on stdout instead of the human report.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub follow: FollowArgs,
}

/// `batchfleet cancel`.
#[derive(Debug, Args)]
pub struct CancelArgs {
    /// Job id.
    pub job: String,
    /// Why, recorded as the job's `failed_reason` and in its summary.
    #[arg(long, default_value = "cancelled with batchfleet cancel")]
    pub reason: String,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Folder the job's paths must stay under, to load its manifest for its
    /// hooks when this command writes its summary (as for `run`).
    #[arg(
        long = "data-root",
        env = "BATCHFLEET_DATA_ROOTS",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<std::path::PathBuf>,
}

/// `batchfleet supervise`.
#[derive(Debug, Args)]
pub struct SuperviseArgs {
    /// Only jobs of this pool (repeat for several; default: every pool).
    #[arg(
        long = "pool",
        env = "BATCHFLEET_SUPERVISE_POOLS",
        value_delimiter = ','
    )]
    pub pools: Vec<String>,
    /// How often to look for jobs nobody follows.
    #[arg(long, env = "BATCHFLEET_SUPERVISE_EVERY", default_value = "5s", value_parser = humantime::parse_duration)]
    pub every: Duration,
    #[command(flatten)]
    pub follow: FollowArgs,
}

/// `--set key=value`, on `run` and `plan`.
#[derive(Debug, Args)]
pub struct OverrideArgs {
    /// Override a manifest value: `section.key=value`, the value in TOML
    /// (`--set batching.item_rows=5000`, `--set 'input.paths=["s3://b/2026-12/*.parquet"]'`)
    /// or, when it is not TOML, a string (`--set output.dir=out/2026-12`).
    /// Repeat for several. Overrides are part of the job: its id covers them.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// `batchfleet plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The job manifest (TOML); see docs/manifest.md.
    pub manifest: PathBuf,
    #[command(flatten)]
    pub overrides: OverrideArgs,
    /// Say whether the job is new or done from its output folder alone,
    /// with no Redis (a job for `run --local`).
    #[arg(long, env = "BATCHFLEET_LOCAL", value_parser = clap::builder::BoolishValueParser::new())]
    pub local: bool,
    /// Folder every path of the job must stay under (as for `run`).
    #[arg(
        long = "data-root",
        env = "BATCHFLEET_DATA_ROOTS",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<std::path::PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `batchfleet gc`.
#[derive(Debug, Args)]
pub struct GcArgs {
    /// Remove jobs that finished at least this long ago (e.g. 7d, 12h, 0s).
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
    pub older_than: Duration,
    /// Only list what would be removed.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `batchfleet resume`.
#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// Job id, as printed by `batchfleet run` (`<name>-<hash>`).
    pub job: String,
    #[command(flatten)]
    pub follow: FollowArgs,
}

/// How `run` and `resume` publish and follow a job.
#[derive(Debug, Args)]
pub struct FollowArgs {
    /// Do not draw a progress bar (it is drawn only on a terminal anyway).
    #[arg(long, env = "BATCHFLEET_NO_PROGRESS", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_progress: bool,
    /// How often progress is read from Redis, at most: sooner as the end
    /// nears (within half the time the remaining items should take, and
    /// every 20 ms for the last 8), so that the job's end is seen at once.
    #[arg(long, env = "BATCHFLEET_POLL_INTERVAL", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub poll_interval: Duration,
    /// Publishes allowed in flight before waiting for the broker's confirms.
    #[arg(long, env = "BATCHFLEET_PUBLISH_WINDOW", default_value_t = 512)]
    pub publish_window: usize,
    /// Once the queue is drained, publish a speculative copy of an item held
    /// this many times longer than the median item (the first commit wins).
    /// 0 turns speculation off.
    #[arg(long, env = "BATCHFLEET_SPECULATE_AFTER", default_value_t = 3.0)]
    pub speculate_after: f64,
    /// Publish again an item that is neither queued, held by a live worker
    /// nor settled for this long (a lost message).
    #[arg(long, env = "BATCHFLEET_ORPHAN_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub orphan_grace: Duration,
    /// Fail the job when workers said they cannot run it (no CUDA device,
    /// model unreadable there, out of memory on one row) and no item was
    /// committed for this long: no able worker is taking its items.
    #[arg(long, env = "BATCHFLEET_UNABLE_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub unable_timeout: Duration,
    /// Folder every path of the job (input files, model, output folder)
    /// must stay under, symlinks resolved, or an s3://bucket/prefix that
    /// every s3:// location must stay under; repeat for several, or separate
    /// them with ':' in the variable. Default: the manifest's folder.
    #[arg(
        long = "data-root",
        env = "BATCHFLEET_DATA_ROOTS",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<std::path::PathBuf>,
}

impl FollowArgs {
    /// Following a job with the default settings (`dlq replay`).
    fn default_config(connections: Connections) -> RunConfig {
        RunConfig {
            connections,
            progress: true,
            poll_interval: Duration::from_millis(250),
            publish_window: 512,
            supervise: Default::default(),
            data_roots: Vec::new(),
            overrides: Vec::new(),
        }
    }

    fn run_config(&self, connections: Connections) -> RunConfig {
        RunConfig {
            connections,
            progress: !self.no_progress,
            poll_interval: self.poll_interval,
            publish_window: self.publish_window,
            supervise: crate::supervisor::SuperviseConfig {
                speculate_after: self.speculate_after,
                orphan_grace: self.orphan_grace,
                unable_timeout: self.unable_timeout,
                ..Default::default()
            },
            data_roots: self.data_roots.clone(),
            overrides: Vec::new(),
        }
    }
}

/// `batchfleet jobs`.
#[derive(Debug, Args)]
pub struct JobsArgs {
    /// How many jobs to list.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `batchfleet compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Job A (the reference): a job id, or the path of its summary.json.
    pub a: String,
    /// Job B (the candidate): a job id, or the path of its summary.json.
    pub b: String,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 if the PSI of any output exceeds this (a gate for pipelines).
    #[arg(long)]
    pub max_psi: Option<f64>,
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
    if let Command::Completions(args) = &cli.command {
        use clap::CommandFactory;
        use std::io::Write;
        // Into memory first: the generator panics on a write error, and a
        // closed pipe (`| head`) is not one worth a panic.
        let mut script = Vec::new();
        clap_complete::generate(args.shell, &mut Cli::command(), "batchfleet", &mut script);
        return match std::io::stdout().write_all(&script) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: cannot write the completion script: {e}");
                ExitCode::from(EXIT_FAILURE)
            }
        };
    }
    cli.global.services.init_logging();
    // Before any libtorch call (`run --local` and validation use it).
    batchfleet_shared::cuda::log(&batchfleet_shared::cuda::load(option_env!(
        "BATCHFLEET_LIBTORCH_LIB"
    )));
    let connections = match cli.global.connections() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_INVALID);
        }
    };
    // Commands that follow a job serve metrics while they do.
    if matches!(
        cli.command,
        Command::Run(_) | Command::Resume(_) | Command::Wait(_) | Command::Supervise(_)
    ) {
        // A local run's worker pipelines set the worker's own gauges here.
        let keep = match &cli.command {
            Command::Run(args) if args.local => {
                batchfleet_shared::metrics::names::WORKER_OWN_GAUGES
            }
            _ => &[],
        };
        if let Err(e) =
            batchfleet_shared::metrics::install(&cli.global.metrics, "coordinator", &[], keep)
        {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    }
    match cli.command {
        Command::Run(args) => {
            let mut cfg = args.follow.run_config(connections);
            cfg.overrides = args.overrides.set.clone();
            let shutdown = batchfleet_shared::shutdown::on_signals();
            let run = if args.detach {
                crate::submit_job(&cfg, &args.manifest).await
            } else if args.local {
                let opts = crate::local::LocalOptions::resolve(args.workers, args.threads);
                crate::local::run_job(&cfg, &args.manifest, opts, shutdown).await
            } else {
                crate::run_job(&cfg, &args.manifest, shutdown).await
            };
            match run {
                Ok(outcome) if args.json => print_json(&outcome),
                Err(e) if args.json => print_json_error(&e),
                Ok(RunOutcome::Interrupted { job_id }) if args.local => {
                    eprintln!("interrupted; the local run of job {job_id} stopped. Its committed items are kept: run the same command again to resume it.");
                    ExitCode::from(EXIT_INTERRUPTED)
                }
                Ok(outcome) => report_outcome_of(&outcome, args.local),
                Err(e) => report_error(&e),
            }
        }
        Command::Wait(args) => {
            let cfg = args.follow.run_config(connections);
            let shutdown = batchfleet_shared::shutdown::on_signals();
            let waited = async {
                let store = cfg.connections.store().await?;
                if store.job(&args.job).await?.is_none() {
                    return Err(RunError::Output(format!(
                        "no job \"{}\" in {}; job ids look like <name>-<hash>, as `batchfleet run` prints them. A job that finished more than --retention ago has left Redis: its summary.json is in its output folder",
                        args.job,
                        store.describe()
                    )));
                }
                crate::follow_job(&cfg, &store, &args.job, shutdown).await
            };
            match waited.await {
                Ok(outcome) if args.json => print_json(&outcome),
                Err(e) if args.json => print_json_error(&e),
                Ok(outcome) => report_outcome(&outcome),
                Err(e) => report_error(&e),
            }
        }
        Command::Cancel(args) => {
            let mut cfg = FollowArgs::default_config(connections.clone());
            cfg.data_roots = args.data_roots.clone();
            let cancelled = async {
                let store = connections.store().await?;
                crate::cancel_job(&cfg, &store, &args.job, &args.reason).await
            };
            match cancelled.await {
                Ok(c) if args.json => {
                    println!("{}", serde_json::to_string(&c).expect("json"));
                    ExitCode::SUCCESS
                }
                Ok(c) if c.cancelled => {
                    println!("job {} cancelled: its queued items are skipped and in-flight ones stop at their next checkpoint; its committed part files stay. Run the same manifest again to continue it from them.", c.job_id);
                    if let Some(s) = &c.summary {
                        println!("summary: {}", s.display());
                    }
                    ExitCode::SUCCESS
                }
                Ok(c) => {
                    println!(
                        "job {} is {}, not running: nothing to cancel",
                        c.job_id, c.status
                    );
                    ExitCode::SUCCESS
                }
                Err(e) if args.json => print_json_error(&e),
                Err(e) => report_error(&e),
            }
        }
        Command::Supervise(args) => {
            let cfg = args.follow.run_config(connections);
            let shutdown = batchfleet_shared::shutdown::on_signals();
            match crate::control::supervise(&cfg, &args.pools, args.every, shutdown).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => report_error(&e),
            }
        }
        Command::Resume(args) => {
            let cfg = args.follow.run_config(connections);
            let shutdown = batchfleet_shared::shutdown::on_signals();
            match crate::resume_job(&cfg, &args.job, shutdown).await {
                Ok(outcome) => report_outcome(&outcome),
                Err(e) => report_error(&e),
            }
        }
        Command::Dlq(cmd) => dlq_main(cmd, &connections).await,
        // Answered before anything else, above.
        Command::Completions(_) => ExitCode::SUCCESS,
        Command::Status(args) => {
            let store = match connections.store().await {
                Ok(s) => s,
                Err(e) => return report_error(&RunError::Store(e)),
            };
            let report = match status::report(&store, &args.job).await {
                Ok(Some(mut r)) => {
                    r.consumers = pool_consumers(&connections, &r.job.pool).await;
                    Ok(Some(r))
                }
                other => other,
            };
            match report {
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
                    eprintln!("error: no job \"{}\" in {}; job ids look like <name>-<hash>, as printed by `batchfleet run`", args.job, store.describe());
                    ExitCode::from(EXIT_FAILURE)
                }
                Err(e) => report_error(&RunError::Store(e)),
            }
        }
        Command::Jobs(args) => {
            let store = match connections.store().await {
                Ok(s) => s,
                Err(e) => return report_error(&RunError::Store(e)),
            };
            match status::jobs(&store, args.limit).await {
                Ok(jobs) if args.json => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&jobs).expect("jobs serialize")
                    );
                    ExitCode::SUCCESS
                }
                Ok(jobs) => {
                    println!("{}", status::render_jobs(&jobs));
                    ExitCode::SUCCESS
                }
                Err(e) => report_error(&RunError::Store(e)),
            }
        }
        Command::Compare(args) => compare_main(&args, &connections).await,
        Command::Plan(args) => plan_main(args, connections).await,
        Command::Gc(args) => {
            let store = match connections.store().await {
                Ok(s) => s,
                Err(e) => return report_error(&RunError::Store(e)),
            };
            match crate::control::gc(&store, args.older_than, args.dry_run).await {
                Ok(collected) if args.json => {
                    let out = serde_json::json!({ "dry_run": args.dry_run, "jobs": collected });
                    println!("{}", serde_json::to_string_pretty(&out).expect("json"));
                    ExitCode::SUCCESS
                }
                Ok(collected) => {
                    println!("{}", crate::control::render_gc(&collected, args.dry_run));
                    ExitCode::SUCCESS
                }
                Err(e) => report_error(&RunError::Store(e)),
            }
        }
    }
}

async fn plan_main(args: PlanArgs, connections: Connections) -> ExitCode {
    let store = if args.local {
        None
    } else {
        match connections.store().await {
            Ok(s) => Some(s),
            Err(e) => return report_error(&RunError::Store(e)),
        }
    };
    let mut cfg = FollowArgs::default_config(connections);
    cfg.data_roots = args.data_roots;
    cfg.overrides = args.overrides.set;
    match crate::control::plan(&cfg, &args.manifest, store.as_ref()).await {
        Ok(r) if args.json => {
            println!("{}", serde_json::to_string(&r).expect("plan serializes"));
            ExitCode::SUCCESS
        }
        Ok(r) => {
            println!("{}", crate::control::render_plan(&r));
            ExitCode::SUCCESS
        }
        Err(RunError::Manifest(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_INVALID)
        }
        Err(e) => report_error(&e),
    }
}

/// How many workers consume a pool's work queue now (`None` when the
/// broker cannot say: unreachable, or the queue not declared yet).
async fn pool_consumers(connections: &Connections, pool: &str) -> Option<u32> {
    let broker = connections.broker("batchfleet status").await.ok()?;
    let queue = batchfleet_shared::broker::PoolQueues::new(pool).work();
    let n = broker.consumer_count(&queue).await.ok().flatten();
    broker.close("bye").await;
    n
}

/// Reads a summary from a path, or from the output folder of a job in Redis.
async fn load_summary(
    which: &str,
    connections: &Connections,
) -> Result<crate::reducer::Summary, String> {
    let path = if std::path::Path::new(which).is_file() {
        PathBuf::from(which)
    } else {
        let store = connections.store().await.map_err(|e| e.to_string())?;
        let job = store
            .job(which)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| {
                format!("\"{which}\" is neither a summary.json file nor a job in Redis; a finished job's state expires after its retention (--retention), its summary stays: pass the path of its summary.json in the output folder")
            })?;
        PathBuf::from(job.output_dir).join(crate::dispatcher::SUMMARY_FILE)
    };
    let bytes = std::fs::read(&path).map_err(|e| {
        format!(
            "cannot read {}: {e} (has the job finished?)",
            path.display()
        )
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("{} is not a batchfleet summary: {e}", path.display()))
}

async fn compare_main(args: &CompareArgs, connections: &Connections) -> ExitCode {
    let loaded = async {
        let a = load_summary(&args.a, connections).await?;
        let b = load_summary(&args.b, connections).await?;
        let da = a
            .predictions
            .clone()
            .ok_or_else(|| format!("job {} recorded no prediction histogram", a.job_id))?;
        let db = b
            .predictions
            .clone()
            .ok_or_else(|| format!("job {} recorded no prediction histogram", b.job_id))?;
        let drift = crate::compare::drift(&da, &db)?;
        Ok::<_, String>((a, b, da, db, drift))
    };
    let (a, b, da, db, drift) = match loaded.await {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    if args.json {
        let out = serde_json::json!({ "a": a.job_id, "b": b.job_id, "a_distribution": da, "b_distribution": db, "drift": drift });
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    } else {
        println!("{}", crate::compare::render(&a, &b, &da, &db, &drift));
    }
    if let Some(limit) = args.max_psi {
        if let Some(d) = drift.iter().find(|d| d.psi > limit) {
            eprintln!("drift: {} has PSI {:.4} > --max-psi {limit}", d.name, d.psi);
            return ExitCode::from(EXIT_FAILURE);
        }
    }
    ExitCode::SUCCESS
}

/// The exit code of a run's outcome (see the module docs).
pub fn exit_code(outcome: &RunOutcome) -> u8 {
    match outcome {
        RunOutcome::Completed { report, .. } => match report.status.as_str() {
            "completed" => 0,
            "failed" if report.failed_class.as_deref().unwrap_or("budget") == "budget" => {
                EXIT_JOB_FAILED
            }
            "failed" => EXIT_JOB_UNRUNNABLE,
            "cancelled" => EXIT_CANCELLED,
            _ => EXIT_COMPLETED_WITH_FAILURES,
        },
        RunOutcome::AlreadyCompleted { .. } | RunOutcome::Detached { .. } => 0,
        RunOutcome::Interrupted { .. } => EXIT_INTERRUPTED,
    }
}

/// A run's outcome as the one JSON object `--json` prints: `job_id`,
/// `status`, `exit_code`, and, once the job ended, `summary` (its path)
/// and `report` (the summary itself).
pub fn outcome_json(outcome: &RunOutcome) -> serde_json::Value {
    let code = exit_code(outcome);
    match outcome {
        RunOutcome::Completed {
            job_id,
            summary,
            report,
        } => serde_json::json!({
            "job_id": job_id, "status": report.status, "exit_code": code,
            "summary": summary, "report": report,
        }),
        RunOutcome::AlreadyCompleted { job_id, summary } => serde_json::json!({
            "job_id": job_id, "status": "completed", "already_complete": true,
            "exit_code": code, "summary": summary,
        }),
        RunOutcome::Interrupted { job_id } => serde_json::json!({
            "job_id": job_id, "status": "interrupted", "exit_code": code,
        }),
        RunOutcome::Detached { job_id, items } => serde_json::json!({
            "job_id": job_id, "status": "running", "detached": true, "items": items,
            "exit_code": code,
        }),
    }
}

fn print_json(outcome: &RunOutcome) -> ExitCode {
    println!("{}", outcome_json(outcome));
    ExitCode::from(exit_code(outcome))
}

fn print_json_error(e: &RunError) -> ExitCode {
    let code = match e {
        RunError::Manifest(_) => EXIT_INVALID,
        _ => EXIT_FAILURE,
    };
    println!(
        "{}",
        serde_json::json!({ "job_id": null, "status": "error", "exit_code": code, "error": e.to_string() })
    );
    ExitCode::from(code)
}

fn report_outcome(outcome: &RunOutcome) -> ExitCode {
    report_outcome_of(outcome, false)
}

/// [`report_outcome`]; `local` for a `--local` run (whose dead items are
/// replayed from its output folder).
fn report_outcome_of(outcome: &RunOutcome, local: bool) -> ExitCode {
    let code = exit_code(outcome);
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
            if report.rows_rejected > 0 {
                eprintln!(
                    "{} row(s) rejected; see rejects/ in the output folder",
                    report.rows_rejected
                );
            }
            if report.items_failed > 0 {
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
            }
            match code {
                EXIT_JOB_UNRUNNABLE => eprintln!(
                    "the job failed at once: {}\nno worker process stopped; {} item(s) were skipped. Fix the cause and run the manifest again",
                    report.failed_reason.as_deref().unwrap_or("nobody can run it"),
                    report.items_skipped
                ),
                EXIT_JOB_FAILED if local => eprintln!(
                    "the error budget was exceeded: the job failed and {} item(s) were skipped. `batchfleet dlq list --local {out}` shows the dead items; fix the cause, then `batchfleet dlq replay --local {out}` or run the manifest again",
                    report.items_skipped, out = report.output_dir
                ),
                EXIT_JOB_FAILED => eprintln!(
                    "the error budget was exceeded: the job failed and {} item(s) were skipped. `batchfleet dlq list --pool {}` shows the dead items; fix the cause, then `batchfleet dlq replay --job {job_id}` or run the manifest again",
                    report.items_skipped, report.pool
                ),
                EXIT_CANCELLED => eprintln!(
                    "the job was cancelled{}: {} item(s) were skipped; its {} committed item(s) stay in {}. Run the same manifest again to continue it from them",
                    report.failed_reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default(),
                    report.items_skipped, report.items_completed, report.output_dir
                ),
                EXIT_COMPLETED_WITH_FAILURES if local => eprintln!("fix the cause, then `batchfleet dlq replay --local {}` (or run the same command again) to retry them", report.output_dir),
                EXIT_COMPLETED_WITH_FAILURES => eprintln!("fix the cause, then `batchfleet dlq replay --job {job_id}` (or run the same manifest again) to retry them"),
                _ => {}
            }
        }
        RunOutcome::AlreadyCompleted { job_id, summary } => {
            println!("job {job_id} is already complete; nothing was published");
            println!("summary: {}", summary.display());
        }
        RunOutcome::Interrupted { job_id } => {
            eprintln!("interrupted; job {job_id} keeps running on the workers. Run the same manifest again to follow it, or `batchfleet status {job_id}`.");
        }
        RunOutcome::Detached { job_id, items } => {
            println!("{job_id}");
            eprintln!("job {job_id}: {items} items published; follow it with `batchfleet wait {job_id}` (same exit codes as run), or let `batchfleet supervise` finish it");
        }
    }
    ExitCode::from(code)
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

/// `dlq list`'s output: JSON, or a table for people.
fn print_dead(items: &[crate::dlq::DeadItem], json: bool) -> ExitCode {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(items).expect("dead items serialize")
        );
    } else {
        println!("{}", crate::dlq::render(items));
    }
    ExitCode::SUCCESS
}

async fn dlq_main(cmd: DlqCommand, connections: &Connections) -> ExitCode {
    match cmd {
        DlqCommand::List {
            local: Some(output),
            job,
            class,
            json,
            ..
        } => {
            let filter = crate::dlq::Filter {
                job,
                class,
                item: None,
            };
            match crate::local::list_dead(&output) {
                Ok(items) => {
                    let items: Vec<_> = items.into_iter().filter(|d| filter.matches(d)).collect();
                    print_dead(&items, json)
                }
                Err(e) => report_error(&e),
            }
        }
        DlqCommand::Replay {
            local: Some(output),
            update_model,
            workers,
            threads,
            ..
        } => {
            let cfg = FollowArgs::default_config(connections.clone());
            let opts = crate::local::LocalOptions::resolve(workers, threads);
            let shutdown = batchfleet_shared::shutdown::on_signals();
            match crate::local::replay(&cfg, &output, opts, update_model, shutdown).await {
                Ok(outcome) => report_outcome_of(&outcome, true),
                Err(e) => report_error(&e),
            }
        }
        cmd => dlq_fleet(cmd, connections).await,
    }
}

async fn dlq_fleet(cmd: DlqCommand, connections: &Connections) -> ExitCode {
    let broker = match connections.broker("batchfleet dlq").await {
        Ok(c) => c,
        Err(e) => return report_error(&RunError::Broker(e)),
    };
    let code = match cmd {
        DlqCommand::List {
            pool,
            job,
            class,
            json,
            ..
        } => {
            let filter = crate::dlq::Filter {
                job,
                class,
                item: None,
            };
            match crate::dlq::list(&*broker, &pool, &filter).await {
                Ok(items) => print_dead(&items, json),
                Err(e) => report_error(&RunError::Broker(e)),
            }
        }
        DlqCommand::Replay {
            job,
            class,
            item,
            pool,
            update_model,
            no_wait,
            ..
        } => {
            let Some(job) = job else {
                eprintln!("error: --job (or --local OUTPUT) is required");
                return ExitCode::from(EXIT_INVALID);
            };
            let store = match connections.store().await {
                Ok(s) => s,
                Err(e) => return report_error(&RunError::Store(e)),
            };
            let pool = match (pool, store.job(&job).await) {
                (Some(p), _) => p,
                (None, Ok(Some(record))) => record.pool,
                (None, Ok(None)) => {
                    eprintln!("error: no job \"{job}\" in Redis; pass --pool to replay its dead items anyway");
                    return ExitCode::from(EXIT_FAILURE);
                }
                (None, Err(e)) => return report_error(&RunError::Store(e)),
            };
            let filter = crate::dlq::Filter {
                job: Some(job.clone()),
                class,
                item,
            };
            let replayed = match crate::dlq::replay(
                &*broker,
                &store,
                &pool,
                &filter,
                update_model,
                connections.signing_key.as_ref(),
            )
            .await
            {
                Ok(r) => r,
                Err(e) => return report_error(&e),
            };
            println!(
                "replayed {} item(s) of job {job} to bf.{pool}.job.{job}",
                replayed.items.len()
            );
            if no_wait || store.job(&job).await.ok().flatten().is_none() {
                ExitCode::SUCCESS
            } else {
                let cfg = FollowArgs::default_config(connections.clone());
                match crate::follow_job(
                    &cfg,
                    &store,
                    &job,
                    batchfleet_shared::shutdown::on_signals(),
                )
                .await
                {
                    Ok(outcome) => report_outcome(&outcome),
                    Err(e) => report_error(&e),
                }
            }
        }
        DlqCommand::Purge { pool, job, yes } => {
            if !yes
                && !confirm(&format!(
                    "delete {} dead items of pool {pool} for good?",
                    job.as_deref()
                        .map_or("all".to_owned(), |j| format!("job {j}'s"))
                ))
            {
                eprintln!("not purged (pass --yes to skip this question)");
                return ExitCode::from(EXIT_FAILURE);
            }
            match crate::dlq::purge(&*broker, &pool, job.as_deref()).await {
                Ok(n) => {
                    println!("purged {n} dead item(s)");
                    ExitCode::SUCCESS
                }
                Err(e) => report_error(&RunError::Broker(e)),
            }
        }
    };
    broker.close("bye").await;
    code
}

/// Asks on the terminal; anything but "yes" (or no terminal) is a no.
fn confirm(question: &str) -> bool {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        eprintln!("{question} — refusing without a terminal to confirm on");
        return false;
    }
    eprint!("{question} type yes to confirm: ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer).is_ok() && answer.trim() == "yes"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reducer::Summary;

    fn completed(status: &str) -> RunOutcome {
        let report: Summary = serde_json::from_value(serde_json::json!({
            "job_id": "j-1", "name": "j", "pool": "p", "status": status, "manifest": "m", "model": "m.pt",
            "model_sha256": "00", "output_dir": "/o", "rows_total": 1, "rows_predicted": 1, "rows_rejected": 0,
            "items_total": 1, "items_completed": 1, "parts": 1, "started_at_ms": 0, "finished_at_ms": 1,
            "duration_s": 0.001, "rows_per_s": 1000.0, "item_latency_ms": {"p50": 1, "p95": 1, "max": 1},
            "workers": 1, "items_recovered": 0, "items_failed": 0, "items_skipped": 0, "failed_items": []
        }))
        .unwrap();
        RunOutcome::Completed {
            job_id: "j-1".into(),
            summary: "/o/summary.json".into(),
            report: Box::new(report),
        }
    }

    #[test]
    fn exit_codes_follow_the_job_status() {
        assert_eq!(exit_code(&completed("completed")), 0);
        assert_eq!(exit_code(&completed("completed_with_failures")), 3);
        assert_eq!(exit_code(&completed("failed")), 4);
        assert_eq!(exit_code(&completed("cancelled")), EXIT_CANCELLED);
        for (class, code) in [("budget", 4), ("unrunnable", 5), ("unable", 5)] {
            let RunOutcome::Completed { mut report, .. } = completed("failed") else {
                unreachable!()
            };
            report.failed_class = Some(class.into());
            let outcome = RunOutcome::Completed {
                job_id: "j-1".into(),
                summary: "s".into(),
                report,
            };
            assert_eq!(exit_code(&outcome), code, "{class}");
        }
        assert_eq!(
            exit_code(&RunOutcome::AlreadyCompleted {
                job_id: "j".into(),
                summary: "s".into()
            }),
            0
        );
        assert_eq!(
            exit_code(&RunOutcome::Interrupted { job_id: "j".into() }),
            130
        );
    }
}

#[cfg(test)]
mod env_tests {
    use super::*;
    use clap::CommandFactory;

    /// Flags that choose what one invocation acts on or how it prints,
    /// rather than how batchfleet runs: no environment variable, on purpose
    /// (a `BATCHFLEET_YES` or `BATCHFLEET_JOB` in a deployment's environment
    /// would act on every command). `dlq replay`'s settings are only
    /// meaningful beside its per-invocation `--local <OUTPUT>`.
    const PER_INVOCATION: &[&str] = &[
        "run --set",
        "run --detach",
        "run --json",
        "wait --json",
        "cancel --reason",
        "cancel --json",
        "plan --set",
        "plan --json",
        "status --json",
        "jobs --limit",
        "jobs --json",
        "gc --older-than",
        "gc --dry-run",
        "gc --json",
        "compare --json",
        "compare --max-psi",
        "dlq list --local",
        "dlq list --job",
        "dlq list --class",
        "dlq list --json",
        "dlq replay --job",
        "dlq replay --local",
        "dlq replay --workers",
        "dlq replay --threads",
        "dlq replay --class",
        "dlq replay --item",
        "dlq replay --pool",
        "dlq replay --update-model",
        "dlq replay --no-wait",
        "dlq purge --job",
        "dlq purge --yes",
    ];

    fn without_env(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            if a.is_positional() || matches!(a.get_id().as_str(), "help" | "version") {
                continue;
            }
            if a.get_env().is_none() {
                let long = a.get_long().unwrap_or(a.get_id().as_str());
                out.push(format!("{path}--{long}").trim_start().to_owned());
            }
        }
        for sub in cmd.get_subcommands() {
            without_env(sub, &format!("{path}{} ", sub.get_name()), out);
        }
    }

    #[test]
    fn every_setting_has_an_environment_variable() {
        let mut missing = Vec::new();
        without_env(&Cli::command(), "", &mut missing);
        missing.retain(|f| !PER_INVOCATION.contains(&f.as_str()));
        assert!(
            missing.is_empty(),
            "flags without a BATCHFLEET_* variable: {missing:?}"
        );
    }
}
