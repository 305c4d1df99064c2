//! The `batchfleet` command line as clap types: every command, its flags,
//! their `BATCHFLEET_*` variables and help text, and the settings they make.

use crate::config::{Connections, RunConfig};
use batchfleet_shared::backend::Backend;
use batchfleet_shared::config::ServiceArgs;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

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
    /// _summary.json stays in the output folder for good. A running job's
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
    /// Which `[on_complete]` hooks this coordinator runs: `all`, `webhook`
    /// (no commands) or `none`. A manifest asking for one it does not run
    /// is refused when submitted here; a job submitted elsewhere that this
    /// coordinator reduces (`supervise`, `wait`, `cancel`) has such hooks
    /// skipped, and its summary says why.
    #[arg(long, env = "BATCHFLEET_HOOKS", value_enum, default_value_t = crate::hooks::HookRun::All, global = true)]
    pub hooks: crate::hooks::HookRun,
    /// Run `[on_complete]` commands as this user (a name or a uid): its
    /// own uid and group, no supplementary groups, its own HOME, so a
    /// command cannot read this coordinator's secret files or signal it.
    /// Needs the coordinator to run as root; commands run as the
    /// coordinator's user without it.
    #[arg(long, env = "BATCHFLEET_HOOK_USER", value_name = "USER", global = true)]
    pub hook_user: Option<String>,
    /// Publish work messages whole, the job's task in every message
    /// (version 2), instead of naming the task stored once per job
    /// (version 3), and create new jobs with a done set of seqs rather than
    /// a bitmap: set it while workers older than version 3 still run,
    /// which reject version 3 messages and read only the set.
    #[arg(long, env = "BATCHFLEET_WHOLE_MESSAGES", value_parser = clap::builder::BoolishValueParser::new(), global = true)]
    pub whole_messages: bool,
    /// Most items in one work message. A job of many short items is
    /// published as bundles of consecutive items (version 4 of the work
    /// message: fewer broker messages and commits per item), fewer per
    /// bundle where items are long or the job has few; each item is still
    /// retried, committed and dead-lettered alone. 1 publishes one item per
    /// message (version 3), for workers older than version 4.
    #[arg(long, env = "BATCHFLEET_BUNDLE", default_value_t = batchfleet_shared::message::DEFAULT_BUNDLE as u16, value_parser = clap::value_parser!(u16).range(1..=batchfleet_shared::message::MAX_BUNDLE as i64), global = true)]
    pub bundle: u16,
}

impl GlobalArgs {
    /// The connection settings; an unreadable secret or key file is an
    /// error naming it.
    pub(super) fn connections(&self) -> Result<Connections, String> {
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
                run: self.hooks,
                user: self
                    .hook_user
                    .as_deref()
                    .map(crate::hooks::HookUser::resolve)
                    .transpose()?,
            },
            whole_messages: self.whole_messages,
            bundle: usize::from(self.bundle),
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
    /// How many workers each pool needs to finish its jobs with a
    /// `[job] deadline` on time, beside how many consume it now (as the
    /// gauge `batchfleet_pool_workers_needed`): for compose, VM and Slurm
    /// scripts, e.g. `docker compose up -d --scale worker=$(batchfleet
    /// scale-advice --pool default --json | jq '.pools[0].workers_needed')`.
    ScaleAdvice(ScaleAdviceArgs),
    /// Remove finished jobs' state from Redis now, instead of when their
    /// retention (--retention) is up; their summaries stay in the output folders.
    Gc(GcArgs),
    /// Compare the prediction distributions of two jobs, or of one job's
    /// model and its shadow model (e.g. a new model
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
    /// Print the JSON Schema of a job manifest, for editors that check and
    /// complete `job.toml` (Taplo, Even Better TOML, JetBrains IDEs): e.g.
    /// `batchfleet schema > batchfleet.schema.json` and a first line
    /// `#:schema ./batchfleet.schema.json` in the manifest.
    Schema,
    /// Write the manual pages (`batchfleet.1`, one `batchfleet-<command>.1`
    /// per command, and `batchfleet-worker.1` where this binary runs jobs
    /// `--local`) into a folder: e.g. `batchfleet man /usr/local/share/man/man1`.
    Man(ManArgs),
    /// Validation's trial of a model call, in a process of its own: a task
    /// spec (JSON) on stdin, the outcome (JSON) on stdout. Not for people.
    #[command(hide = true)]
    TryModel,
}

impl Command {
    /// The `--data-root` list this command takes, if it takes one.
    pub fn data_roots_mut(&mut self) -> Option<&mut Vec<PathBuf>> {
        match self {
            Command::Run(a) => Some(&mut a.follow.data_roots),
            Command::Resume(a) => Some(&mut a.follow.data_roots),
            Command::Wait(a) => Some(&mut a.follow.data_roots),
            Command::Supervise(a) => Some(&mut a.follow.data_roots),
            Command::Cancel(a) => Some(&mut a.data_roots),
            Command::Plan(a) => Some(&mut a.data_roots),
            _ => None,
        }
    }
}

/// `batchfleet man`.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// The folder to write the pages into (created if missing).
    pub dir: PathBuf,
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
        /// in _summary.json, is run with the committed items taken as done).
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
        /// Also replay dead messages that carry no signature. Every dead
        /// message is checked as a worker checks it before it is signed and
        /// published again: one whose signature does not verify with the
        /// coordinator's key stays dead. Without a signing key nothing can
        /// be checked, and replay needs this flag.
        #[arg(long, env = "BATCHFLEET_TRUST_UNSIGNED", value_parser = clap::builder::BoolishValueParser::new())]
        trust_unsigned: bool,
        /// Return after publishing instead of following the job.
        #[arg(long)]
        no_wait: bool,
        /// Print one JSON object: `replayed` (items), `refused` (why each
        /// dead message stayed dead) and, once the job ends, what `run
        /// --json` prints.
        #[arg(long)]
        json: bool,
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
        /// Print `{"purged": N}`.
        #[arg(long)]
        json: bool,
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
    /// Score only the input files that are new or changed (by size and
    /// modification time, or ETag) since this finished job — its id, its
    /// output folder or its _summary.json —, into the manifest's output
    /// folder (not that job's: one per run, e.g. `--set
    /// output.dir=out/$(date +%F)`); the summary lists what was reused
    /// and from where. Nothing new or changed: nothing is published.
    #[arg(long, value_name = "JOB")]
    pub since: Option<String>,
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
        env = "BATCHFLEET_DATA_ROOT",
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

/// `--set key=value` and how the model is tried, on `run` and `plan`.
#[derive(Debug, Args)]
pub struct OverrideArgs {
    /// Override a manifest value: `section.key=value`, the value in TOML
    /// (`--set batching.item_rows=5000`, `--set 'input.paths=["s3://b/2026-12/*.parquet"]'`)
    /// or, when it is not TOML, a string (`--set output.dir=out/2026-12`).
    /// Repeat for several. Overrides are part of the job: its id covers them.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Run this model beside the manifest's on every mini-batch, as
    /// `[model.shadow] path` (a file, relative to this folder, or an
    /// `s3://` object): the output stays the manifest model's, and the
    /// summary's `shadow` section compares the two (see docs/rollout.md).
    #[arg(long, value_name = "MODEL")]
    pub shadow: Option<PathBuf>,
    /// Most memory the model may take when validation tries it on two
    /// sample rows, in a process of its own (`8GiB`, `512MiB`); a model
    /// that takes more, or crashes that process, refuses the job.
    /// Default: 2 GiB plus four times the model file.
    #[arg(long, env = "BATCHFLEET_VALIDATE_MEMORY", value_name = "SIZE", value_parser = batchfleet_shared::config::parse_size)]
    pub validate_memory: Option<u64>,
}

impl OverrideArgs {
    /// The `--set` overrides, with `--shadow` as the one it stands for.
    pub(super) fn all(&self) -> Vec<String> {
        let mut all = self.set.clone();
        if let Some(model) = &self.shadow {
            let path = if batchfleet_shared::source::is_url(model) {
                model.clone()
            } else {
                std::path::absolute(model).unwrap_or_else(|_| model.clone())
            };
            let quoted = toml::Value::String(path.to_string_lossy().into_owned());
            all.push(format!("model.shadow.path={quoted}"));
        }
        all
    }

    /// How the model call is tried at validation.
    pub(super) fn trial(&self) -> crate::manifest::ModelTrial {
        crate::manifest::ModelTrial::Child {
            memory: self.validate_memory,
        }
    }
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
    /// As `run --since`: plan only the files new or changed since this
    /// finished job, and list the ones reused.
    #[arg(long, value_name = "JOB")]
    pub since: Option<String>,
    /// Folder every path of the job must stay under (as for `run`).
    #[arg(
        long = "data-root",
        env = "BATCHFLEET_DATA_ROOT",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<std::path::PathBuf>,
    /// Also predict N rows, sampled across the input, in this process (one
    /// CPU core, the job's model) and print them as the job would write
    /// them, with the rows/s one core reaches and the time the job would
    /// take on --workers workers.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub sample: Option<u32>,
    /// With --sample: the workers (one core each) to give the time for.
    #[arg(long, default_value_t = 1, requires = "sample", value_parser = clap::value_parser!(u32).range(1..))]
    pub workers: u32,
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
    /// Print one JSON object when the job ends, as `run --json` does.
    #[arg(long)]
    pub json: bool,
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
    /// nor settled for this long, once its job has committed nothing for as
    /// long too (a lost message; deliveries waiting in a busy worker's
    /// prefetch buffer are not lost: the worker says so every half of this
    /// grace, which the job's record carries).
    #[arg(long, env = "BATCHFLEET_ORPHAN_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub orphan_grace: Duration,
    /// Fail the job when workers said they cannot run it (no CUDA device,
    /// model unreadable there, out of memory on one row) and no item was
    /// committed for this long: no able worker is taking its items.
    #[arg(long, env = "BATCHFLEET_UNABLE_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub unable_timeout: Duration,
    /// How often a job with a `[job] deadline` or `worker_hour_cost` has its
    /// pace measured (rate, projected finish, workers needed, cost); its
    /// rate is taken over at least twelve of these.
    #[arg(long, env = "BATCHFLEET_PACE_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub pace_interval: Duration,
    /// Folder every path of the job (input files, model, output folder)
    /// must stay under, symlinks resolved, or an s3://bucket/prefix that
    /// every s3:// location must stay under; repeat for several, or separate
    /// them with ':' in the variable. Default: the manifest's folder.
    #[arg(
        long = "data-root",
        env = "BATCHFLEET_DATA_ROOT",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<std::path::PathBuf>,
}

impl FollowArgs {
    /// Following a job with the default settings (`dlq replay`).
    pub(super) fn default_config(connections: Connections) -> RunConfig {
        RunConfig {
            connections,
            progress: true,
            poll_interval: Duration::from_millis(250),
            publish_window: 512,
            supervise: Default::default(),
            data_roots: Vec::new(),
            overrides: Vec::new(),
            trial: Default::default(),
            since: None,
        }
    }

    pub(super) fn run_config(&self, connections: Connections) -> RunConfig {
        RunConfig {
            connections,
            progress: !self.no_progress,
            poll_interval: self.poll_interval,
            publish_window: self.publish_window,
            supervise: crate::config::SuperviseConfig {
                speculate_after: self.speculate_after,
                orphan_grace: self.orphan_grace,
                unable_timeout: self.unable_timeout,
                pace_every: self.pace_interval.max(Duration::from_millis(100)),
                ..Default::default()
            },
            data_roots: self.data_roots.clone(),
            overrides: Vec::new(),
            trial: Default::default(),
            since: None,
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

/// `batchfleet scale-advice`.
#[derive(Debug, Args)]
pub struct ScaleAdviceArgs {
    /// The pool to advise on (repeatable); default: every pool with an
    /// unfinished job among the last --limit jobs.
    #[arg(long = "pool")]
    pub pools: Vec<String>,
    /// How many recent jobs to look through for pools.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `batchfleet compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Job A (the reference): a job id, or the path of its _summary.json.
    pub a: String,
    /// Job B (the candidate): a job id, or the path of its _summary.json.
    /// Without it: job A's model against its shadow model
    /// (`[model.shadow]`), from the summary's `shadow` section.
    pub b: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Exit 7 if the PSI of any output exceeds this (a gate for pipelines;
    /// errors reading the summaries stay exit 1).
    #[arg(long)]
    pub max_psi: Option<f64>,
}

/// `batchfleet status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Job id, as printed by `batchfleet run` (`<name>-<hash>`); without
    /// one, the job registered last (`batchfleet jobs` lists them).
    pub job: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Flags that choose what one invocation acts on or how it prints,
    /// rather than how batchfleet runs: no environment variable, on purpose
    /// (a `BATCHFLEET_YES` or `BATCHFLEET_JOB` in a deployment's environment
    /// would act on every command). `dlq replay`'s settings are only
    /// meaningful beside its per-invocation `--local <OUTPUT>`.
    const PER_INVOCATION: &[&str] = &[
        "run --set",
        "run --shadow",
        "plan --shadow",
        "run --detach",
        "run --json",
        "wait --json",
        "cancel --reason",
        "cancel --json",
        "plan --set",
        "plan --json",
        "plan --sample",
        "plan --since",
        "run --since",
        "plan --workers",
        "status --json",
        "jobs --limit",
        "jobs --json",
        "scale-advice --pool",
        "scale-advice --limit",
        "scale-advice --json",
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
        "dlq replay --json",
        "dlq purge --json",
        "resume --json",
        "dlq purge --job",
        "dlq purge --yes",
    ];

    fn without_env(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            // -v and -q: RUST_LOG is their variable.
            let logs = matches!(a.get_id().as_str(), "verbose" | "quiet");
            if a.is_positional() || logs || matches!(a.get_id().as_str(), "help" | "version") {
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
    fn v_and_q_set_the_log_level() {
        let level = |args: &[&str]| {
            Cli::try_parse_from(args)
                .map(|c| c.global.services.log_level())
                .map_err(|e| e.kind())
        };
        assert_eq!(level(&["batchfleet", "jobs"]), Ok("info"));
        assert_eq!(level(&["batchfleet", "-v", "jobs"]), Ok("debug"));
        assert_eq!(level(&["batchfleet", "jobs", "-vv"]), Ok("trace"));
        assert_eq!(level(&["batchfleet", "-q", "jobs"]), Ok("warn"));
        assert_eq!(level(&["batchfleet", "jobs", "-qq"]), Ok("error"));
        assert_eq!(level(&["batchfleet", "-vv", "jobs", "-q"]), Ok("debug"));
        assert_eq!(level(&["batchfleet", "jobs", "-qqq"]), Ok("error"));
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
