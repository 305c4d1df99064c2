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
    /// Unacknowledged items held at once. Two keep the pipeline full (one
    /// parsing or writing while one runs the model) without hoarding work.
    #[arg(long, env = "BATCHFLEET_PREFETCH", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,
    /// libtorch intra-op threads; 0 lets libtorch pick (all cores). With N
    /// workers on a node, give each cores / N.
    #[arg(long, env = "BATCHFLEET_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Worker id in logs and Redis; default `<hostname>-<pid>`.
    #[arg(long, env = "BATCHFLEET_WORKER_ID")]
    pub worker_id: Option<String>,
    /// On SIGTERM/SIGINT, how long in-flight items may take to finish before
    /// they are left unacknowledged (the broker then redelivers them).
    #[arg(long, env = "BATCHFLEET_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// How long to keep retrying RabbitMQ and Redis, at start-up and after
    /// losing either (a broker or Redis restart); then the worker exits 1.
    #[arg(long, env = "BATCHFLEET_CONNECT_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub connect_timeout: Duration,
    /// How often the lease of an item in progress is refreshed in Redis.
    #[arg(long, env = "BATCHFLEET_HEARTBEAT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub heartbeat: Duration,
    /// A lease not refreshed for this long counts as dead: the coordinator
    /// may publish a copy of the item. Keep it several heartbeats long.
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
    /// Folder every path of an item (input file, model, output folder) must
    /// stay under, symlinks resolved, or an s3://bucket/prefix that every
    /// s3:// location must stay under; repeat for several, or separate them
    /// with ':' in the variable. Items naming other paths are dead-lettered.
    /// Unset: paths need only be absolute and free of `..` — set it in
    /// production, queue contents are not trusted.
    #[arg(
        long = "data-root",
        env = "BATCHFLEET_DATA_ROOTS",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<std::path::PathBuf>,
    /// Testing aid: sleep this long before every forward call, to play a slow
    /// worker (stragglers). 0 = off.
    #[arg(long, env = "BATCHFLEET_DEBUG_BATCH_DELAY", default_value = "0s", value_parser = humantime::parse_duration, hide_short_help = true)]
    pub debug_batch_delay: Duration,
}

impl WorkerConfig {
    /// The configured id, or `<hostname>-<pid>`.
    pub fn worker_id(&self) -> String {
        self.worker_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "worker".into());
            format!("{host}-{}", std::process::id())
        })
    }
}
