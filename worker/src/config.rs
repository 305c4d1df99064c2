//! Worker settings: every flag also reads a `BATCHFLEET_*` environment variable.

use batchfleet_shared::config::ServiceArgs;
use clap::Parser;
use std::time::Duration;

/// batchfleet-worker: consumes work items from a pool and scores them with libtorch.
#[derive(Debug, Clone, Parser)]
#[command(name = "batchfleet-worker", version, about, long_about = None)]
pub struct WorkerConfig {
    #[command(flatten)]
    pub services: ServiceArgs,
    #[command(flatten)]
    pub metrics: batchfleet_shared::metrics::MetricsArgs,
    /// Pool (work queue) to consume.
    #[arg(long, env = "BATCHFLEET_POOL", default_value = "default")]
    pub pool: String,
    /// Unacknowledged items held at once, at least. Two keep the pipeline
    /// full (one parsing or writing while one runs the model) without
    /// hoarding work; short items raise it up to --prefetch-max.
    #[arg(long, env = "BATCHFLEET_PREFETCH", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,
    /// Unacknowledged items held at once, at most: every second the worker
    /// holds as many items as it settled in the last 100 ms (rounded up to a
    /// power of two), so short items overlap their fixed costs and long ones
    /// stay at --prefetch. Equal to --prefetch (or below) fixes the prefetch.
    #[arg(long, env = "BATCHFLEET_PREFETCH_MAX", default_value_t = 32)]
    pub prefetch_max: u16,
    /// Job queues consumed at once, at most: what a worker holds
    /// unacknowledged stays bounded by its prefetch however many jobs are
    /// active (at most the prefetch from the pool's queue and one more than
    /// it from each job queue). With more active jobs, each worker consumes
    /// those it draws by weight (`[job] priority`), draws again every 30 s,
    /// and moves on from a job whose queue it finds empty.
    #[arg(long, env = "BATCHFLEET_JOB_QUEUES", default_value_t = crate::consumer::DEFAULT_JOB_QUEUES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub job_queues: usize,
    /// libtorch intra-op threads; 0 lets libtorch pick (all cores). With N
    /// workers on a node, give each cores / N.
    #[arg(long, env = "BATCHFLEET_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Models kept loaded (on each device) for the jobs to come: past this
    /// many, the least recently used is dropped and its memory freed, so a
    /// long-lived worker that runs many models holds a bounded number.
    #[arg(long, env = "BATCHFLEET_MODELS_KEPT", default_value_t = crate::runner::DEFAULT_MODELS_KEPT, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub models_kept: usize,
    /// Bytes of models kept loaded on each device (`16GiB`, `512MiB`):
    /// before a model loads, the least recently used on its device are
    /// dropped until it fits (one larger than this is kept alone). A model
    /// counts its parameters in the precision it runs in, or its file when
    /// larger. On a GPU, leave room for activations. Unset: only
    /// `--models-kept` bounds the cache.
    #[arg(long, env = "BATCHFLEET_MODELS_MEMORY", value_parser = parse_size)]
    pub models_memory: Option<u64>,
    /// Recycling: after handling this many items, stop taking more, drain,
    /// and exit 75 for the supervisor (systemd, Kubernetes, compose, the
    /// Slurm task wrapper) to start a fresh process. 0 = never.
    #[arg(long, env = "BATCHFLEET_MAX_ITEMS", default_value_t = 0)]
    pub max_items: u64,
    /// Recycling: once the process's resident memory passes this (`8GiB`,
    /// `512MiB`, or bytes; looked at every 5 s), drain and exit 75 the same
    /// way. Unset = never.
    #[arg(long, env = "BATCHFLEET_MAX_RSS", value_parser = parse_size)]
    pub max_rss: Option<u64>,
    /// Fsync each part file on its own, instead of one filesystem sync
    /// (`syncfs`) for the part files written side by side: for a host whose
    /// disk other programs keep busy, where a `syncfs` would wait for their
    /// writes too. (Network and FUSE mounts always fsync each file.)
    #[arg(long, env = "BATCHFLEET_SYNC_EACH_FILE", value_parser = clap::builder::BoolishValueParser::new())]
    pub sync_each_file: bool,
    /// Worker id in logs and Redis; default `<hostname>-<pid>`.
    #[arg(long, env = "BATCHFLEET_WORKER_ID")]
    pub worker_id: Option<String>,
    /// On SIGTERM/SIGINT, how long in-flight items may take to finish before
    /// they are left unacknowledged (the broker then redelivers them). Keep
    /// it under the grace before SIGKILL (Kubernetes'
    /// terminationGracePeriodSeconds, systemd's TimeoutStopSec, Slurm's
    /// KillWait and GraceTime).
    #[arg(long, env = "BATCHFLEET_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// How long one try to reach RabbitMQ or Redis, and one Redis request,
    /// waits for an answer (at most 10 s; the same flag, variable and
    /// default as the `batchfleet` commands').
    #[arg(long, env = "BATCHFLEET_CONNECT_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub connect_timeout: Duration,
    /// How long to keep retrying RabbitMQ and Redis, at start-up and after
    /// losing either (a broker or Redis restart, a failover); then the
    /// worker exits 1. Never less than --connect-timeout.
    #[arg(long, env = "BATCHFLEET_OUTAGE_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub outage_timeout: Duration,
    /// How often the worker looks whether a beat in Redis is due (its
    /// leased items' jobs are beaten together, at least every third of
    /// --lease-ttl: one write per job keeps all their leases live), and how
    /// long an item runs before it is leased at all.
    #[arg(long, env = "BATCHFLEET_HEARTBEAT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub heartbeat: Duration,
    /// A lease neither written nor beaten for this long counts as dead: the
    /// coordinator may publish a copy of the item. Keep it several
    /// heartbeats long.
    #[arg(long, env = "BATCHFLEET_LEASE_TTL", default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// Acknowledge a delivery held this long and keep the item by its lease
    /// alone, so long items never trip RabbitMQ's consumer_timeout (30 min by
    /// default). Keep it well under that timeout.
    #[arg(long, env = "BATCHFLEET_ACK_AFTER", default_value = "10m", value_parser = humantime::parse_duration)]
    pub ack_after: Duration,
    /// Load this TorchScript model before consuming, and exit 1 if it cannot
    /// be loaded (readiness then means "this model runs here").
    #[arg(long, env = "BATCHFLEET_PRELOAD_MODEL")]
    pub preload_model: Option<std::path::PathBuf>,
    /// Device for --preload-model: cpu, cuda or cuda:N.
    #[arg(long, env = "BATCHFLEET_PRELOAD_DEVICE", default_value = "cpu")]
    pub preload_device: String,
    /// Create this file once the worker consumes (after --preload-model
    /// loaded) and remove it when it starts draining: a readiness probe.
    #[arg(long, env = "BATCHFLEET_READY_FILE")]
    pub ready_file: Option<std::path::PathBuf>,
    /// Folder of the cache of models and tokenizers read from s3:// (one
    /// download per machine, files named by their SHA-256; the workers of
    /// a machine may share it). Default: $XDG_CACHE_HOME/batchfleet, else
    /// ~/.cache/batchfleet.
    #[arg(long, env = "BATCHFLEET_CACHE_DIR")]
    pub cache_dir: Option<std::path::PathBuf>,
    /// Most the cache holds (e.g. 50GiB); the least recently used files go
    /// first. Default 20GiB.
    #[arg(long, env = "BATCHFLEET_CACHE_MAX", value_parser = parse_size)]
    pub cache_max: Option<u64>,
    /// Folder every path of an item (input file, model, output folder) must
    /// stay under, symlinks resolved, or an s3://bucket/prefix that every
    /// s3:// location must stay under; repeat for several, or separate them
    /// with ':' in the variable. Items naming other paths are dead-lettered.
    /// Required (queue contents are not trusted) unless --allow-any-path.
    #[arg(
        long = "data-root",
        env = "BATCHFLEET_DATA_ROOT",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<std::path::PathBuf>,
    /// Start without --data-root, accepting any absolute path free of `..`
    /// in items (testing, or a machine whose whole disk is the job's). A
    /// worker refuses to start without a data root otherwise.
    #[arg(long, env = "BATCHFLEET_ALLOW_ANY_PATH", value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_any_path: bool,
    /// How long this worker leaves a job it cannot run (no such CUDA device
    /// here, the model unreadable here, out of memory on one row) to other
    /// workers, handing its items back, before it tries again.
    #[arg(long, env = "BATCHFLEET_UNABLE_FOR", default_value = "1m", value_parser = humantime::parse_duration)]
    pub unable_for: Duration,
    /// An item of a job Redis does not know is handed back for this long
    /// (Redis may have restarted empty and the coordinator not restored the
    /// job yet), then dead-lettered as `rejected`.
    #[arg(long, env = "BATCHFLEET_UNKNOWN_JOB_GRACE", default_value = "2m", value_parser = humantime::parse_duration)]
    pub unknown_job_grace: Duration,
    /// Longest pause between tries while the output disk is full (the pause
    /// starts at 1 s and doubles).
    #[arg(long, env = "BATCHFLEET_DISK_FULL_MAX_PAUSE", default_value = "1m", value_parser = humantime::parse_duration)]
    pub disk_full_max_pause: Duration,
    /// Most input bytes one item may read; a message asking more is rejected.
    #[arg(long, env = "BATCHFLEET_MAX_ITEM_BYTES", default_value_t = 1 << 30)]
    pub max_item_bytes: u64,
    /// Most feature values (rows × values per row, 4 bytes each) one item
    /// may hold; a message asking more is rejected.
    #[arg(long, env = "BATCHFLEET_MAX_ITEM_VALUES", default_value_t = 1 << 28)]
    pub max_item_values: u64,
    /// Most pixels (height × width) of an item's preprocessed images.
    #[arg(long, env = "BATCHFLEET_MAX_IMAGE_PIXELS", default_value_t = 8192 * 8192)]
    pub max_image_pixels: u64,
    /// Testing aid: sleep this long before every forward call, to play a slow
    /// worker (stragglers). 0 = off.
    #[arg(long, env = "BATCHFLEET_DEBUG_BATCH_DELAY", default_value = "0s", value_parser = humantime::parse_duration, hide = true)]
    pub debug_batch_delay: Duration,
    /// Testing aid: panic while handling chosen items, `item:SEQ[@ATTEMPT]`
    /// (in item handling) or `runner:SEQ[@ATTEMPT]` (on the model runner
    /// thread), or kill the whole worker process (`abort:SEQ[@ATTEMPT]`,
    /// SIGABRT as the item reaches the model: an item that crashes its
    /// worker), comma-separated; without `@ATTEMPT`, on every attempt.
    #[arg(long, env = "BATCHFLEET_DEBUG_PANIC", value_delimiter = ',', value_parser = parse_panic_spec, hide = true)]
    pub debug_panic: Vec<(PanicSite, u32, u32)>,
    /// Testing aid: add this to the worker's clock (e.g. `60s`, `-60s`), to
    /// play a machine whose clock is wrong.
    #[arg(long, env = "BATCHFLEET_DEBUG_CLOCK_OFFSET", default_value = "0s", value_parser = parse_offset_ms, allow_hyphen_values = true, hide = true)]
    pub debug_clock_offset: i64,
    /// Testing aid: read the pool's active jobs this often whatever else
    /// (by default every 60 s while the pool's announcements are heard, every
    /// second when they are not); a long one leaves new jobs to the
    /// announcements alone.
    #[arg(long, env = "BATCHFLEET_DEBUG_JOBS_EVERY", value_parser = humantime::parse_duration, hide = true)]
    pub debug_jobs_every: Option<Duration>,
    /// Testing aid: sweep the queues of the pool's retired jobs once they
    /// are this old (by default 90 s; see `batchfleet_shared::retire`).
    #[arg(long, env = "BATCHFLEET_DEBUG_RETIRED_GRACE", value_parser = humantime::parse_duration, hide = true)]
    pub debug_retired_grace: Option<Duration>,
    /// Testing aid: while this file exists, writing output fails as on a full disk.
    #[arg(long, env = "BATCHFLEET_DEBUG_DISK_FULL_WHILE", hide = true)]
    pub debug_disk_full_while: Option<std::path::PathBuf>,
}

/// Where `--debug-panic` panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanicSite {
    /// In item handling (async code on the tokio runtime).
    Item,
    /// On the model runner thread.
    Runner,
    /// The process aborts as the item reaches the model.
    Abort,
}

fn parse_panic_spec(s: &str) -> Result<(PanicSite, u32, u32), String> {
    let bad = || {
        format!("{s:?}: expected item:SEQ[@ATTEMPT], runner:SEQ[@ATTEMPT] or abort:SEQ[@ATTEMPT]")
    };
    let (site, rest) = s.split_once(':').ok_or_else(bad)?;
    let site = match site {
        "item" => PanicSite::Item,
        "runner" => PanicSite::Runner,
        "abort" => PanicSite::Abort,
        _ => return Err(bad()),
    };
    let (seq, attempt) = rest.split_once('@').unwrap_or((rest, "0"));
    Ok((
        site,
        seq.parse().map_err(|_| bad())?,
        attempt.parse().map_err(|_| bad())?,
    ))
}

pub use batchfleet_shared::config::parse_size;

fn parse_offset_ms(s: &str) -> Result<i64, String> {
    let (sign, d) = match s.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, s.strip_prefix('+').unwrap_or(s)),
    };
    let d = humantime::parse_duration(d).map_err(|e| e.to_string())?;
    Ok(sign * d.as_millis() as i64)
}

impl WorkerConfig {
    /// How long an outage of RabbitMQ or Redis is ridden out.
    pub fn outage(&self) -> Duration {
        self.outage_timeout.max(self.connect_timeout)
    }

    /// The caps on what one work item may ask of this worker.
    pub fn limits(&self) -> batchfleet_shared::message::ItemLimits {
        batchfleet_shared::message::ItemLimits {
            max_item_bytes: self.max_item_bytes,
            max_item_values: self.max_item_values,
            max_image_pixels: self.max_image_pixels,
            ..Default::default()
        }
    }

    /// The testing aids configured (all off by default).
    pub fn debug_hooks(&self) -> crate::debug::DebugHooks {
        let pick = |site| {
            self.debug_panic
                .iter()
                .filter(|(s, ..)| *s == site)
                .map(|(_, seq, attempt)| (*seq, *attempt))
                .collect()
        };
        crate::debug::DebugHooks {
            panic_in_item: pick(PanicSite::Item),
            panic_on_runner: pick(PanicSite::Runner),
            abort_at_model: pick(PanicSite::Abort),
            disk_full_while: self.debug_disk_full_while.clone(),
        }
    }

    /// A worker's defaults with its `BATCHFLEET_*` environment variables
    /// applied: what `batchfleet-worker` with no flags would run with.
    pub fn from_env() -> Result<Self, clap::Error> {
        Self::try_parse_from(["batchfleet-worker"])
    }

    /// These settings for in-process pipeline `index` of a `batchfleet run
    /// --local` job in `pool`: the id `local-<index>`, `threads` libtorch
    /// threads, and the run's data roots.
    pub fn for_pipeline(
        mut self,
        pool: &str,
        index: usize,
        threads: usize,
        data_roots: &[std::path::PathBuf],
    ) -> Self {
        self.pool = pool.to_owned();
        self.worker_id = Some(format!("local-{index}"));
        self.threads = threads;
        self.data_roots = data_roots.to_vec();
        self
    }

    /// The configured id, or `<hostname>-<pid>`.
    pub fn worker_id(&self) -> String {
        self.worker_id.clone().unwrap_or_else(|| {
            let host = batchfleet_shared::host_name().unwrap_or_else(|| "worker".into());
            format!("{host}-{}", std::process::id())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn every_flag_has_an_environment_variable() {
        let missing: Vec<String> = WorkerConfig::command()
            .get_arguments()
            // -v and -q: RUST_LOG is their variable.
            .filter(|a| {
                !matches!(
                    a.get_id().as_str(),
                    "help" | "version" | "verbose" | "quiet"
                )
            })
            .filter(|a| a.get_env().is_none())
            .map(|a| a.get_id().to_string())
            .collect();
        assert!(
            missing.is_empty(),
            "flags without a BATCHFLEET_* variable: {missing:?}"
        );
    }
}
