//! The batchfleet worker: pulls work items from RabbitMQ and scores them.
//!
//! # Layout
//! - [`config`]: flags and `BATCHFLEET_*` environment variables.
//! - [`consumer`]: what happens to one delivery, from decode to ack, retry or dead letter.
//! - [`reader`]: a CSV or JSON Lines byte range parsed into one contiguous `f32`
//!   buffer; bad rows rejected. Dispatches to [`columnar`] (Parquet row groups,
//!   projected columns) and [`images`] (image files, decoded and normalised).
//! - [`runner`]: libtorch on its own thread behind the [`runner::Backend`] trait;
//!   mini-batching, out-of-memory halving and poison-row isolation.
//! - [`writer`]: part and rejects files staged, fsynced and linked into place.
//! - [`error`]: failure classes that say what to do with an item.
//!
//! [`run`] connects, consumes until shutdown, then drains; `main.rs` only parses flags.

pub mod columnar;
pub mod config;
pub mod consumer;
pub mod error;
pub mod images;
pub mod reader;
pub mod runner;
pub mod writer;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use batchfleet_shared::broker::{self, BrokerError, ConfirmedPublisher, PoolQueues};
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::{Store, StoreError};
pub use config::WorkerConfig;
use consumer::StopReason;
use futures_lite::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Exit code asking the supervisor for a fresh process (EX_TEMPFAIL).
pub const EXIT_RESTART: u8 = 75;

/// How a worker ended without an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// Shutdown requested and drained: exit 0.
    Clean,
    /// The process should be replaced (hung model calls): exit [`EXIT_RESTART`].
    Restart(String),
}

/// Errors that make waiting pointless (wrong credentials).
trait Permanent {
    fn is_permanent(&self) -> bool;
}
impl Permanent for BrokerError {
    fn is_permanent(&self) -> bool {
        BrokerError::is_permanent(self)
    }
}
impl Permanent for StoreError {
    fn is_permanent(&self) -> bool {
        StoreError::is_permanent(self)
    }
}

/// Retries `connect` with capped exponential backoff until `budget` is spent,
/// failing at once on a permanent error.
async fn with_retry<T, E, F, Fut>(what: &str, budget: Duration, connect: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display + Permanent,
{
    let deadline = Instant::now() + budget;
    connect
        .retry(ExponentialBuilder::default().with_min_delay(Duration::from_millis(200)).with_max_delay(Duration::from_secs(5)).with_jitter().without_max_times())
        .when(|e: &E| !e.is_permanent() && Instant::now() < deadline)
        .notify(|e, wait| tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "{what} not reachable yet"))
        .await
}

/// Runs a worker until `shutdown` is cancelled (then drains), a fatal error,
/// or a restart request. A lost RabbitMQ connection (broker restart) is
/// re-established with capped exponential backoff for up to
/// `--connect-timeout`; items in flight meanwhile finish, and their acks,
/// which the broker can no longer take, are redone by the redelivery that
/// finds them done.
pub async fn run(cfg: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<Exit> {
    let worker_id = cfg.worker_id();
    let queues = PoolQueues::new(&cfg.pool);
    let data_roots =
        batchfleet_shared::paths::DataRoots::new(&cfg.data_roots).context("--data-root")?;
    if data_roots.is_confined() {
        tracing::info!(roots = %data_roots.describe(), "item paths confined to the data roots");
    } else {
        tracing::warn!(
            "no --data-root: item paths are not confined to any folder; set it in production"
        );
    }
    batchfleet_shared::metrics::install(&cfg.metrics, "worker", &[("pool", cfg.pool.clone())])
        .map_err(anyhow::Error::msg)?;
    metrics::gauge!(names::WORKER_UP).set(1.0);
    metrics::gauge!(names::WORKER_DRAINING).set(0.0);
    tokio::spawn(gpu_memory(Duration::from_secs(15)));
    let per_try = cfg.connect_timeout.min(Duration::from_secs(10));
    let store = with_retry("Redis", cfg.connect_timeout, || {
        Store::connect(&cfg.services.redis_url, &cfg.services.redis_prefix, per_try)
    })
    .await?;
    let mut session = Session::open(&cfg, &worker_id, &queues).await?;

    let threads = cfg.threads;
    let delay = cfg.debug_batch_delay;
    let make_runner = Box::new(move || {
        runner::ModelRunner::spawn(move || {
            let torch = runner::TorchBackend::new(threads);
            runner::Delayed {
                inner: torch,
                delay,
            }
        })
    });
    let tuning = consumer::Tuning {
        heartbeat: cfg.heartbeat,
        lease_ttl: cfg.lease_ttl.max(cfg.heartbeat * 2),
        ack_after: cfg.ack_after,
        store_patience: cfg.connect_timeout,
    };
    let ctx = Arc::new(
        consumer::ItemContext::new(
            store,
            session
                .publisher
                .take()
                .expect("a new session has a publisher"),
            queues.clone(),
            worker_id.clone(),
            shutdown.clone(),
            tuning,
            make_runner,
        )
        .context("starting the model runner thread")?
        .with_data_roots(data_roots),
    );

    if let Some(path) = &cfg.preload_model {
        let sha256 = batchfleet_shared::fsutil::sha256_file(path).with_context(|| {
            format!("--preload-model {}: cannot read the model", path.display())
        })?;
        let model = batchfleet_shared::message::ModelRef {
            path: path.to_string_lossy().into_owned(),
            sha256,
            device: cfg.preload_device.clone(),
        };
        ctx.preload(&model)
            .await
            .map_err(|e| anyhow::anyhow!("--preload-model {}: {}", path.display(), e.message))?;
        tracing::info!(model = %path.display(), device = %cfg.preload_device, "model preloaded");
    }
    if let Some(ready) = &cfg.ready_file {
        std::fs::write(ready, b"ready\n")
            .with_context(|| format!("writing --ready-file {}", ready.display()))?;
    }

    let tracker = TaskTracker::new();
    let lost = loop {
        tracing::info!(worker = %worker_id, queue = %queues.work(), prefetch = cfg.prefetch, threads = cfg.threads, "worker consuming");
        let mut lost = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = ctx.stop.cancelled() => break,
                next = session.consumer.next() => match next {
                    Some(Ok(delivery)) => { tracker.spawn(consumer::handle(delivery, ctx.clone())); }
                    Some(Err(e)) => { lost = Some(e.to_string()); break; }
                    None => { lost = Some("the broker closed the consumer".into()); break; }
                },
            }
        }
        let Some(why) = lost else { break None };
        if shutdown.is_cancelled() || ctx.stop.is_cancelled() {
            break None;
        }
        let why = batchfleet_shared::secret::scrub(&why, &cfg.services.amqp_url);
        tracing::warn!(error = %why, in_flight = tracker.len(), "lost RabbitMQ; reconnecting");
        let reopened = tokio::select! {
            s = Session::open(&cfg, &worker_id, &queues) => s,
            _ = shutdown.cancelled() => break None,
        };
        match reopened {
            Ok(mut fresh) => {
                ctx.set_publisher(
                    fresh
                        .publisher
                        .take()
                        .expect("a new session has a publisher"),
                );
                let _ = session.conn.close(200, "replaced".into()).await;
                session = fresh;
                tracing::info!("reconnected to RabbitMQ");
            }
            Err(e) => break Some(format!("{why}; reconnecting failed: {e:#}")),
        }
    };

    // Drain: no new deliveries; items already started finish (or stop at a
    // checkpoint) within the deadline.
    let _ = session
        .channel
        .basic_cancel(session.tag.as_str().into(), BasicCancelOptions::default())
        .await;
    tracker.close();
    metrics::gauge!(names::WORKER_DRAINING).set(1.0);
    if let Some(ready) = &cfg.ready_file {
        let _ = std::fs::remove_file(ready);
    }
    tracing::info!(
        in_flight = tracker.len(),
        timeout_s = cfg.drain_timeout.as_secs(),
        "draining"
    );
    if tokio::time::timeout(cfg.drain_timeout, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            in_flight = tracker.len(),
            "drain timeout; unfinished items stay unacknowledged and return to the queue"
        );
    }
    // Closing the channel returns every unacknowledged delivery to the queue at once.
    let _ = session.channel.close(200, "worker stopping".into()).await;
    let _ = session.conn.close(200, "worker stopping".into()).await;
    metrics::gauge!(names::WORKER_UP).set(0.0);

    if let Some(why) = lost {
        anyhow::bail!("lost RabbitMQ: {why}");
    }
    let reason = ctx
        .stop_reason
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    match reason {
        Some(StopReason::Fatal(reason)) => {
            anyhow::bail!("stopped consuming after a fatal error: {reason}")
        }
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

/// GPU memory in use per device, from `nvidia-smi`, on machines that have it.
async fn gpu_memory(every: Duration) {
    loop {
        let out = tokio::process::Command::new("nvidia-smi")
            .args([
                "--query-gpu=index,memory.used",
                "--format=csv,noheader,nounits",
            ])
            .output()
            .await;
        let Ok(out) = out else { return }; // no NVIDIA driver here: nothing to report
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some((gpu, mib)) = line.split_once(',') {
                if let Ok(mib) = mib.trim().parse::<f64>() {
                    metrics::gauge!(names::WORKER_GPU_MEMORY, "gpu" => gpu.trim().to_owned())
                        .set(mib * 1024.0 * 1024.0);
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// One RabbitMQ connection: the consuming channel and a confirm-mode publisher.
struct Session {
    conn: lapin::Connection,
    channel: lapin::Channel,
    consumer: lapin::Consumer,
    publisher: Option<ConfirmedPublisher>,
    tag: String,
}

impl Session {
    /// Connects (retrying with backoff up to `--connect-timeout`), declares
    /// the pool's topology and starts consuming.
    async fn open(
        cfg: &WorkerConfig,
        worker_id: &str,
        queues: &PoolQueues,
    ) -> anyhow::Result<Self> {
        let per_try = cfg.connect_timeout.min(Duration::from_secs(10));
        let conn_name = format!("batchfleet-worker {worker_id}");
        let conn = with_retry("RabbitMQ", cfg.connect_timeout, || {
            broker::connect(&cfg.services.amqp_url, &conn_name, per_try)
        })
        .await?;
        let channel = conn
            .create_channel()
            .await
            .context("opening a RabbitMQ channel")?;
        broker::declare_topology(&channel, queues).await?;
        channel
            .basic_qos(cfg.prefetch, BasicQosOptions::default())
            .await
            .context("setting prefetch")?;
        let publisher = ConfirmedPublisher::open(&conn).await?;
        let tag = format!("{worker_id}-{}", batchfleet_shared::now_ms());
        let consumer = channel
            .basic_consume(
                queues.work().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("consuming {}", queues.work()))?;
        Ok(Self {
            conn,
            channel,
            consumer,
            publisher: Some(publisher),
            tag,
        })
    }
}
