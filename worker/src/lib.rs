//! The batchfleet worker: pulls work items from a queue and scores them — as
//! a `batchfleet-worker` process over RabbitMQ and Redis, or as one of the
//! pipelines of `batchfleet run --local` over in-process queues and state
//! (the same code; see [`Backend`]).
//!
//! # Layout
//! The rooms follow an item's way through the worker:
//! - [`consumer`]: the consume loop — the session with the broker, the
//!   queues it takes deliveries from and the fair choice among them, the
//!   prefetch and its sizing, the disk-full pause, reconnecting and draining;
//!   items the broker dead-lettered itself.
//! - [`item`]: what happens to one delivery, from admission to commit — the
//!   held delivery, admission, the lease and its heartbeat, model calls,
//!   checkpoints, and settlement by whoever is at fault.
//! - [`reader`]: an item's input read into a [`batch::Batch`] — CSV and JSON
//!   Lines byte ranges, Parquet row groups, image files, text tokenized;
//!   bad rows rejected.
//! - [`runner`]: libtorch on its own thread behind the [`runner::Backend`]
//!   trait; the prediction algorithms (mini-batching, out-of-memory halving,
//!   poison-row isolation); the libtorch backend; AOTInductor packages.
//! - [`writer`]: part and rejects files staged, fsynced and linked into place.
//!
//! Beside them:
//! - [`context`]: what item handlers share — the store, the publisher, the
//!   model runner and the gate that admits one item at a time, jobs left to
//!   other workers.
//! - [`batch`]: an item's rows as the model takes them, and rejected rows.
//! - [`error`]: failure classes by owner (item, job, worker, message) that
//!   say what to do with an item.
//! - [`config`]: flags and `BATCHFLEET_*` environment variables.
//! - [`connect`]: the broker and the store, retried up to `--outage-timeout`.
//! - [`debug`]: the worker's clock and its testing aids.
//! - [`probe`]: a job's model call tried at validation (the coordinator's dry run).
//! - [`gpu`]: GPU memory and utilisation metrics from NVML.
//!
//! [`run`] (the fleet) and [`run_on`] (either backend) start a worker and
//! hand it to the consume loop until shutdown; `main.rs` only parses flags.

pub mod batch;
mod config;
mod connect;
mod consumer;
mod context;
mod debug;
pub mod error;
mod gpu;
mod item;
pub mod probe;
pub mod reader;
pub mod runner;
pub mod sample;
pub mod writer;

use anyhow::Context;
pub use batchfleet_shared::backend::Backend;
use batchfleet_shared::broker::{BrokerError, PoolQueues};
use batchfleet_shared::metrics::names;
use batchfleet_shared::paths::DataRoots;
use batchfleet_shared::signing::SigningKey;
use batchfleet_shared::store::StoreError;
pub use config::WorkerConfig;
use context::{ItemContext, StopReason};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Exit code asking the supervisor for a fresh process (EX_TEMPFAIL).
pub const EXIT_RESTART: u8 = 75;

/// Exit code when the worker cannot run as configured and restarting it
/// cannot help (sysexits' `EX_CONFIG`): no data root, an unreadable secret
/// or TLS file, credentials or a server certificate refused, an evicting
/// Redis. systemd's `RestartPreventExitStatus` and a Kubernetes
/// `podFailurePolicy` take it as final.
pub const EXIT_CONFIG: u8 = 78;

/// A failure that retrying or restarting cannot mend; the worker exits
/// with [`EXIT_CONFIG`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Whether an error ending the worker is a [`ConfigError`] or a refusal
/// that no retry can mend (wrong credentials, untrusted certificate).
pub fn is_permanent(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<ConfigError>()
            || c.downcast_ref::<BrokerError>()
                .is_some_and(BrokerError::is_permanent)
            || c.downcast_ref::<StoreError>()
                .is_some_and(StoreError::is_permanent)
    })
}

/// How a worker ended without an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// Shutdown requested and drained: exit 0.
    Clean,
    /// The process should be replaced (hung model calls): exit [`EXIT_RESTART`].
    Restart(String),
}

/// Runs a worker until `shutdown` is cancelled (then drains) or a restart
/// request. A lost RabbitMQ connection (broker restart) is re-established
/// with capped exponential backoff for up to `--outage-timeout`; items in
/// flight meanwhile finish, and their acks, which the broker can no longer
/// take, are redone by the redelivery that finds them done. No work item can
/// stop a worker: every failure is settled by its owner (see [`error`]).
pub async fn run(cfg: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<Exit> {
    let settings = |e: batchfleet_shared::secret::SecretFileError| ConfigError(e.to_string());
    let backend = Backend::Fleet {
        amqp: cfg.services.amqp().map_err(settings)?,
        redis: cfg.services.redis().map_err(settings)?,
        redis_prefix: cfg.services.redis_prefix.clone(),
    };
    run_on(cfg, backend, shutdown).await
}

/// [`run`] on either backend. With [`Backend::Local`], the process-wide
/// parts (metrics exporter, GPU sampler) are the caller's.
pub async fn run_on(
    cfg: WorkerConfig,
    backend: Backend,
    shutdown: CancellationToken,
) -> anyhow::Result<Exit> {
    let worker_id = cfg.worker_id();
    let queues = PoolQueues::new(&cfg.pool);
    let (roots, key) = trust(&cfg, backend.is_fleet())?;
    batchfleet_shared::pinned::configure(cfg.cache_dir.clone(), cfg.cache_max);
    if backend.is_fleet() {
        install_metrics(&cfg)?;
        gpu::start_sampler(Duration::from_secs(15));
    }
    metrics::gauge!(names::WORKER_UP).set(1.0);
    metrics::gauge!(names::WORKER_DRAINING).set(0.0);
    metrics::gauge!(names::WORKER_PAUSED).set(0.0);
    metrics::gauge!(names::WORKER_JOBS_BENCHED).set(0.0);
    metrics::gauge!(names::WORKER_MODELS_LOADED).set(0.0);
    let store = connect::store(&backend, &cfg).await?;
    let session = connect::session(&backend, &cfg, &worker_id, &queues, cfg.prefetch).await?;
    let ctx = Arc::new(
        ItemContext::new(context::Parts {
            store,
            broker: session.broker.clone(),
            queues,
            worker_id,
            shutdown: shutdown.clone(),
            tuning: context::Tuning::of(&cfg),
            make_runner: runner_factory(&cfg),
            guard: item::admission::Guard {
                key,
                limits: cfg.limits(),
                roots,
            },
            clock: debug::Clock {
                offset_ms: cfg.debug_clock_offset,
            },
            debug: cfg.debug_hooks(),
            max_items: cfg.max_items,
            sync_each_file: cfg.sync_each_file,
        })
        .context("starting the model runner thread")?,
    );
    if let Some(limit) = cfg.max_rss {
        tokio::spawn(watch_rss(ctx.clone(), limit));
    }
    preload(&cfg, &ctx).await?;
    if let Some(ready) = &cfg.ready_file {
        std::fs::write(ready, b"ready\n")
            .with_context(|| format!("writing --ready-file {}", ready.display()))?;
    }

    let lost = consumer::run(&cfg, &backend, session, &ctx, &shutdown).await;
    metrics::gauge!(names::WORKER_UP).set(0.0);
    if let Some(why) = lost {
        anyhow::bail!("lost the broker: {why}");
    }
    let reason = ctx
        .stop_reason
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    match reason {
        Some(StopReason::Restart(reason)) => {
            tracing::warn!(%reason, "stopping so that a fresh process takes over");
            Ok(Exit::Restart(reason))
        }
        None => {
            tracing::info!("worker stopped cleanly");
            Ok(Exit::Clean)
        }
    }
}

/// Serves the process's metrics on `--metrics-port` (none when 0), every
/// series labelled with the worker's pool; from within a tokio runtime.
pub fn install_metrics(cfg: &WorkerConfig) -> anyhow::Result<()> {
    batchfleet_shared::metrics::install(
        &cfg.metrics,
        "worker",
        &[("pool", cfg.pool.clone())],
        names::WORKER_OWN_GAUGES,
    )
    .map_err(anyhow::Error::msg)?;
    Ok(())
}

/// What this worker trusts a message with: the data roots its paths must
/// stay under, and the key its signature must verify with. A fleet worker
/// refuses to start without data roots unless `--allow-any-path`: queue
/// contents are not trusted.
fn trust(cfg: &WorkerConfig, fleet: bool) -> anyhow::Result<(DataRoots, Option<SigningKey>)> {
    let roots =
        DataRoots::new(&cfg.data_roots).map_err(|e| ConfigError(format!("--data-root: {e}")))?;
    if roots.is_confined() {
        tracing::info!(roots = %roots.describe(), "item paths confined to the data roots");
    } else if fleet && !cfg.allow_any_path {
        return Err(ConfigError(
            "no --data-root (BATCHFLEET_DATA_ROOT): a worker reads inputs and models and writes outputs only under its data roots; give the folder (or s3://bucket/prefix) its jobs use, or pass --allow-any-path (BATCHFLEET_ALLOW_ANY_PATH=1) to accept any absolute path".into(),
        )
        .into());
    } else {
        tracing::warn!(
            "no --data-root: item paths are not confined to any folder; set it in production"
        );
    }
    let key = cfg
        .services
        .signing_key()
        .map_err(|e| ConfigError(format!("--signing-key-file / BATCHFLEET_SIGNING_KEY: {e}")))?;
    if key.is_some() {
        tracing::info!("work messages must be signed with the configured key");
    } else {
        tracing::warn!("no signing key: work messages are not authenticated; set BATCHFLEET_SIGNING_KEY (or --signing-key-file) in production");
    }
    Ok((roots, key))
}

/// Makes a model runner (again after a hung one is abandoned): libtorch
/// with `--threads`, slowed by `--debug-batch-delay` when set.
fn runner_factory(cfg: &WorkerConfig) -> context::MakeRunner {
    let (threads, delay, kept) = (cfg.threads, cfg.debug_batch_delay, cfg.models_kept);
    let memory = cfg.models_memory;
    Box::new(move || {
        runner::ModelRunner::spawn(move || runner::Delayed {
            inner: runner::TorchBackend::new(threads, kept).with_memory(memory),
            delay,
        })
    })
}

/// Recycling by memory (`--max-rss`): once the process's resident set
/// passes `limit`, the worker stops consuming, drains and exits
/// [`EXIT_RESTART`] for a fresh process (memory a long run fragmented or a
/// library leaked goes back with it).
async fn watch_rss(ctx: Arc<ItemContext>, limit: u64) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = ctx.stop.cancelled() => return,
            () = ctx.shutdown.cancelled() => return,
        }
        let Some(rss) = resident_bytes() else {
            tracing::warn!("cannot read this process's resident memory (/proc/self/status); --max-rss is not enforced");
            return;
        };
        if rss > limit {
            let (mib, limit_mib) = (rss >> 20, limit >> 20);
            tracing::warn!(
                rss_mib = mib,
                limit_mib,
                "resident memory past --max-rss; draining for a fresh process to take over"
            );
            ctx.stop_with(StopReason::Restart(format!(
                "recycling at {mib} MiB resident (--max-rss {limit_mib} MiB)"
            )));
            return;
        }
    }
}

/// This process's resident memory in bytes (`VmRSS`).
pub fn resident_bytes() -> Option<u64> {
    batchfleet_shared::process_memory(None, "VmRSS")
}

/// Loads `--preload-model` before consuming; a model that does not load
/// ends the worker.
async fn preload(cfg: &WorkerConfig, ctx: &ItemContext) -> anyhow::Result<()> {
    let Some(path) = &cfg.preload_model else {
        return Ok(());
    };
    let sha256 = batchfleet_shared::fsutil::sha256_file(path)
        .with_context(|| format!("--preload-model {}: cannot read the model", path.display()))?;
    let model = batchfleet_shared::message::ModelRef::plain(
        path.to_string_lossy(),
        sha256,
        cfg.preload_device.clone(),
    );
    ctx.preload(&model)
        .await
        .map_err(|e| anyhow::anyhow!("--preload-model {}: {}", path.display(), e.message))?;
    tracing::info!(model = %path.display(), device = %cfg.preload_device, "model preloaded");
    Ok(())
}
