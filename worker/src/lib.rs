//! The batchfleet worker: pulls work items from a queue and scores them — as
//! a `batchfleet-worker` process over RabbitMQ and Redis, or as one of the
//! pipelines of `batchfleet run --local` over in-process queues and state
//! (the same code; see [`Backend`]).
//!
//! # Layout
//! - [`config`]: flags and `BATCHFLEET_*` environment variables.
//! - [`admission`]: what a message must pass before anything is done for it
//!   (signature, decoding, caps, data roots).
//! - [`sources`]: the queues a worker consumes — its pool's work queue and
//!   each active job's queue — and the weighted fair choice among them.
//! - [`consumer`]: what happens to one delivery, from admission to commit.
//! - [`context`]: what item handlers share — Redis, the publisher, the model
//!   runner and its gate, jobs left to others, the disk-full pause.
//! - [`lease`]: an item's lease in Redis and its heartbeat.
//! - [`settle`]: every way a delivery is settled (ack, hand back, retry,
//!   dead letter, reject), chosen by who is at fault.
//! - [`checkpoint`]: finished segments of a long item, for resuming it.
//! - [`infra`]: items the broker dead-lettered itself, recorded as failed.
//! - [`batch`]: an item's rows as the model takes them (one contiguous `f32`
//!   buffer, ids beside it) and the rejected rows, with why.
//! - [`reader`]: a CSV or JSON Lines byte range parsed into a [`batch::Batch`];
//!   bad rows rejected. Dispatches to [`columnar`] (Parquet row groups,
//!   projected columns) and [`images`] (image files, decoded and normalised).
//! - [`runner`]: libtorch on its own thread behind the [`runner::Backend`] trait;
//!   mini-batching, out-of-memory halving and poison-row isolation.
//! - [`text`]: text input tokenized into [`batch::Tokens`] (tokenizers loaded
//!   once per worker, their digests checked).
//! - [`writer`]: part and rejects files staged, fsynced and linked into place.
//! - [`error`]: failure classes by owner (item, job, worker, message) that say
//!   what to do with an item.
//! - [`gpu`]: GPU memory and utilisation metrics from NVML.
//!
//! [`run`] (the fleet) and [`run_on`] (either backend) connect, consume until
//! shutdown, then drain; `main.rs` only parses flags.

pub mod admission;
pub mod aoti;
pub mod batch;
pub mod checkpoint;
pub mod columnar;
pub mod config;
pub mod consumer;
pub mod context;
pub mod error;
pub mod gpu;
pub mod images;
pub mod infra;
pub mod lease;
pub mod prefetch;
pub mod probe;
pub mod reader;
pub mod runner;
pub mod settle;
pub mod sources;
pub mod text;
pub mod writer;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use batchfleet_shared::broker::{self, Broker, BrokerError, PoolQueues, Subscription};
use batchfleet_shared::endpoint::Endpoint;
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::{Store, StoreError};
pub use config::WorkerConfig;
use context::StopReason;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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

/// Runs a worker until `shutdown` is cancelled (then drains) or a restart
/// request. A lost RabbitMQ connection (broker restart) is re-established
/// with capped exponential backoff for up to `--connect-timeout`; items in
/// flight meanwhile finish, and their acks, which the broker can no longer
/// take, are redone by the redelivery that finds them done. No work item can
/// stop a worker: every failure is settled by its owner (see [`error`]).
pub async fn run(cfg: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<Exit> {
    let settings = |e: batchfleet_shared::secret::SecretFileError| ConfigError(e.to_string());
    let backend = Backend::Fleet {
        amqp: cfg.services.amqp().map_err(settings)?,
        redis: cfg.services.redis().map_err(settings)?,
    };
    run_on(cfg, backend, shutdown).await
}

/// Where a worker's queues and job state live.
// One per worker process, made once: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Backend {
    /// RabbitMQ and Redis.
    Fleet {
        /// RabbitMQ's URL and TLS files.
        amqp: Endpoint,
        /// Redis's URL and TLS files.
        redis: Endpoint,
    },
    /// The in-process queues and store of `batchfleet run --local`; the
    /// process-wide parts (metrics exporter, GPU sampler) are the caller's.
    Local {
        /// The queues.
        queues: broker::local::LocalQueues,
        /// The job store.
        store: Store,
    },
}

impl Backend {
    /// A broker handle: a new RabbitMQ connection (retried with backoff up
    /// to `--connect-timeout`), or a new client of the in-process queues.
    async fn broker(&self, cfg: &WorkerConfig, worker_id: &str) -> anyhow::Result<Arc<dyn Broker>> {
        match self {
            Backend::Fleet { amqp, .. } => {
                let per_try = cfg.connect_timeout.min(Duration::from_secs(10));
                let conn_name = format!("batchfleet-worker {worker_id}");
                Ok(with_retry("RabbitMQ", cfg.connect_timeout, || {
                    broker::connect(amqp, &conn_name, per_try)
                })
                .await?)
            }
            Backend::Local { queues, .. } => Ok(queues.handle()),
        }
    }

    async fn store(&self, cfg: &WorkerConfig) -> anyhow::Result<Store> {
        match self {
            Backend::Fleet { redis, .. } => {
                let per_try = cfg.connect_timeout.min(Duration::from_secs(10));
                Ok(with_retry("Redis", cfg.connect_timeout, || {
                    Store::connect(redis, &cfg.services.redis_prefix, per_try)
                })
                .await?)
            }
            Backend::Local { store, .. } => Ok(store.clone()),
        }
    }
}

/// [`run`] on either backend.
pub async fn run_on(
    cfg: WorkerConfig,
    backend: Backend,
    shutdown: CancellationToken,
) -> anyhow::Result<Exit> {
    let worker_id = cfg.worker_id();
    let fleet = matches!(backend, Backend::Fleet { .. });
    let queues = PoolQueues::new(&cfg.pool);
    let data_roots = batchfleet_shared::paths::DataRoots::new(&cfg.data_roots)
        .map_err(|e| ConfigError(format!("--data-root: {e}")))?;
    if data_roots.is_confined() {
        tracing::info!(roots = %data_roots.describe(), "item paths confined to the data roots");
    } else if fleet && !cfg.allow_any_path {
        // Queue contents are not trusted: a worker reads and writes only
        // where it is told it may.
        return Err(ConfigError(
            "no --data-root (BATCHFLEET_DATA_ROOTS): a worker reads inputs and models and writes outputs only under its data roots; give the folder (or s3://bucket/prefix) its jobs use, or pass --allow-any-path (BATCHFLEET_ALLOW_ANY_PATH=1) to accept any absolute path".into(),
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
    if fleet {
        batchfleet_shared::metrics::install(
            &cfg.metrics,
            "worker",
            &[("pool", cfg.pool.clone())],
            names::WORKER_OWN_GAUGES,
        )
        .map_err(anyhow::Error::msg)?;
        gpu::start_sampler(Duration::from_secs(15));
    }
    metrics::gauge!(names::WORKER_UP).set(1.0);
    metrics::gauge!(names::WORKER_DRAINING).set(0.0);
    metrics::gauge!(names::WORKER_PAUSED).set(0.0);
    metrics::gauge!(names::WORKER_JOBS_BENCHED).set(0.0);
    let store = backend.store(&cfg).await?;
    let mut session = Session::open(
        backend.broker(&cfg, &worker_id).await?,
        &queues,
        cfg.prefetch,
    )
    .await?;

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
    let tuning = context::Tuning {
        heartbeat: cfg.heartbeat,
        lease_ttl: cfg.lease_ttl.max(cfg.heartbeat * 2),
        ack_after: cfg.ack_after,
        store_patience: cfg.connect_timeout,
        unable_for: cfg.unable_for,
        unknown_job_grace: cfg.unknown_job_grace,
        pause_max: cfg.disk_full_max_pause,
        ..context::Tuning::default()
    };
    let ctx = Arc::new(
        context::ItemContext::new(context::Parts {
            store,
            broker: session.broker.clone(),
            queues: queues.clone(),
            worker_id: worker_id.clone(),
            shutdown: shutdown.clone(),
            tuning,
            make_runner,
            guard: context::Guard {
                key,
                limits: cfg.limits(),
                roots: data_roots,
            },
            clock: context::Clock {
                offset_ms: cfg.debug_clock_offset,
            },
            debug: cfg.debug_hooks(),
        })
        .context("starting the model runner thread")?,
    );

    if let Some(path) = &cfg.preload_model {
        let sha256 = batchfleet_shared::fsutil::sha256_file(path).with_context(|| {
            format!("--preload-model {}: cannot read the model", path.display())
        })?;
        let model = batchfleet_shared::message::ModelRef::plain(
            path.to_string_lossy(),
            sha256,
            cfg.preload_device.clone(),
        );
        ctx.preload(&model)
            .await
            .map_err(|e| anyhow::anyhow!("--preload-model {}: {}", path.display(), e.message))?;
        tracing::info!(model = %path.display(), device = %cfg.preload_device, "model preloaded");
    }
    if let Some(ready) = &cfg.ready_file {
        std::fs::write(ready, b"ready\n")
            .with_context(|| format!("writing --ready-file {}", ready.display()))?;
    }

    // One permit per item in flight, held until the item is settled: an item
    // acknowledged early (a long one) still counts, so a worker never holds
    // more items than the prefetch in force, whatever the broker would send.
    let permits = Arc::new(Semaphore::new(usize::from(cfg.prefetch)));
    let tracker = TaskTracker::new();
    let mut sizing = Sizing {
        prefetch: prefetch::Prefetch::new(cfg.prefetch, cfg.prefetch_max),
        next_review: Instant::now() + prefetch::PERIOD,
        next_jobs: Instant::now(),
        backlog: std::collections::VecDeque::new(),
    };
    metrics::gauge!(names::WORKER_PREFETCH).set(f64::from(sizing.prefetch.current()));
    let lost = loop {
        tracing::info!(worker = %worker_id, broker = %session.broker.describe(), queue = %queues.work(), prefetch = session.prefetch, prefetch_max = cfg.prefetch_max.max(cfg.prefetch), threads = cfg.threads, "worker consuming");
        let lost = consume(
            &mut session,
            &ctx,
            &permits,
            &tracker,
            &shutdown,
            &mut sizing,
        )
        .await;
        let Some(why) = lost else { break None };
        if shutdown.is_cancelled() || ctx.stop.is_cancelled() {
            break None;
        }
        let why = match &backend {
            Backend::Fleet { amqp, .. } => batchfleet_shared::secret::scrub(&why, &amqp.url),
            Backend::Local { .. } => why,
        };
        tracing::warn!(error = %why, in_flight = tracker.len(), "lost the broker; reconnecting");
        // Deliveries of the lost connection can no longer be acknowledged.
        sizing.backlog.clear();
        let prefetch = session.prefetch;
        let reopen = async {
            let broker = backend.broker(&cfg, &worker_id).await?;
            anyhow::Ok(Session::open(broker, &queues, prefetch).await?)
        };
        let reopened = tokio::select! {
            s = reopen => s,
            _ = shutdown.cancelled() => break None,
        };
        match reopened {
            Ok(fresh) => {
                ctx.set_broker(fresh.broker.clone());
                session.broker.close("replaced").await;
                session = fresh;
                tracing::info!("reconnected to the broker");
            }
            Err(e) => break Some(format!("{why}; reconnecting failed: {e:#}")),
        }
    };

    // Drain: no new deliveries; items already started finish (or stop at a
    // checkpoint) within the deadline.
    session.cancel_consumers().await;
    // Never started: back to the queue for another worker.
    sizing.backlog.extend(session.work.waiting());
    for delivery in sizing.backlog.drain(..) {
        let _ = delivery.requeue().await;
    }
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
    // Closing the handle returns every unacknowledged delivery to the queue at once.
    session.broker.close("worker stopping").await;
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

/// Consumes the session's queues until shutdown, a stop, or a lost
/// connection (`Some(why)`). A work delivery is taken only with an
/// in-flight permit in hand; while the output disk is full the worker
/// stops consuming (see [`pause`]).
async fn consume(
    session: &mut Session,
    ctx: &Arc<context::ItemContext>,
    permits: &Arc<Semaphore>,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
    sizing: &mut Sizing,
) -> Option<String> {
    loop {
        let now = Instant::now();
        if now >= sizing.next_jobs {
            sizing.next_jobs = now + JOBS_EVERY;
            session.refresh_jobs(&ctx.store).await;
            metrics::gauge!(names::WORKER_JOB_QUEUES).set(session.work.jobs() as f64);
        }
        if sizing.prefetch.adapts() && now >= sizing.next_review {
            sizing.next_review = now + prefetch::PERIOD;
            if let Some(size) = sizing.prefetch.review(now) {
                if let Err(e) = resize(session, permits, sizing, size).await {
                    return Some(e);
                }
            }
        }
        // Registered before the pause is checked: a pause that starts while
        // this loop waits for a permit (its handlers hold them all) is seen.
        let paused = ctx.pause.started.notified();
        if let Some((until, why)) = ctx.pause.until() {
            if let Err(e) = pause(session, ctx, until, &why, tracker, shutdown).await {
                return Some(e);
            }
            if shutdown.is_cancelled() {
                return None;
            }
            continue;
        }
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the permits are never closed"),
            _ = shutdown.cancelled() => return None,
            _ = ctx.stop.cancelled() => return None,
            next = session.infra.next() => match next {
                Some(Ok(d)) => { tracker.spawn(infra::record(d, ctx.clone())); continue; }
                Some(Err(e)) => return Some(e.to_string()),
                None => return Some("the broker closed the consumer".into()),
            },
        };
        // What the last subscription had sent goes first.
        if let Some(delivery) = sizing.backlog.pop_front() {
            spawn_item(tracker, delivery, ctx, permit, sizing);
            continue;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = ctx.stop.cancelled() => return None,
            _ = paused => {}
            // Time to look for new jobs' queues (the permit goes back).
            _ = tokio::time::sleep_until(sizing.next_jobs.into()) => {}
            next = session.infra.next() => match next {
                Some(Ok(d)) => { tracker.spawn(infra::record(d, ctx.clone())); }
                Some(Err(e)) => return Some(e.to_string()),
                None => return Some("the broker closed the consumer".into()),
            },
            next = session.work.next() => match next {
                Some(Ok(delivery)) => spawn_item(tracker, delivery, ctx, permit, sizing),
                Some(Err(e)) => return Some(e.to_string()),
                None => return Some("the broker closed the consumer".into()),
            },
        }
    }
}

/// How often a worker reads its pool's active jobs (a job's queue is
/// consumed within this of its publication).
const JOBS_EVERY: Duration = Duration::from_secs(1);

/// The prefetch in force, how it is sized, and the deliveries of a
/// subscription it replaced that are still to be handled.
struct Sizing {
    prefetch: prefetch::Prefetch,
    next_review: Instant,
    /// When to read the pool's active jobs again.
    next_jobs: Instant,
    backlog: std::collections::VecDeque<batchfleet_shared::broker::Delivery>,
}

/// Handles a work delivery on its own task; an item settled with its work
/// done counts towards the prefetch's sizing.
fn spawn_item(
    tracker: &TaskTracker,
    delivery: batchfleet_shared::broker::Delivery,
    ctx: &Arc<context::ItemContext>,
    permit: tokio::sync::OwnedSemaphorePermit,
    sizing: &Sizing,
) {
    let settled = sizing.prefetch.settled();
    let handled = consumer::handle(delivery, ctx.clone(), permit);
    tracker.spawn(async move {
        let outcome = handled.await;
        if matches!(
            outcome,
            settle::Handled::Committed | settle::Handled::AlreadyDone
        ) {
            settled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
}

/// Consumes the work queue again with `size` deliveries (quorum queues take
/// a consumer's prefetch when it subscribes): the old subscription is
/// cancelled and what it had sent already is kept, to be handled first with
/// the in-flight permits like any other delivery — none is returned to the
/// queue, which would count as a delivery against the item's limit.
async fn resize(
    session: &mut Session,
    permits: &Arc<Semaphore>,
    sizing: &mut Sizing,
    size: u16,
) -> Result<(), String> {
    let old = session.prefetch;
    sizing.backlog.extend(session.stop_work().await?);
    session.prefetch = size;
    session.resume_work().await?;
    if size > old {
        permits.add_permits(usize::from(size - old));
    } else {
        // Taken as the items in flight finish, and never given back.
        let (permits, fewer) = (permits.clone(), u32::from(old - size));
        tokio::spawn(async move {
            if let Ok(taken) = permits.acquire_many_owned(fewer).await {
                taken.forget();
            }
        });
    }
    metrics::gauge!(names::WORKER_PREFETCH).set(f64::from(size));
    tracing::info!(
        from = old,
        to = size,
        held = sizing.backlog.len(),
        "prefetch sized from the items settled in the last second"
    );
    Ok(())
}

/// The output disk is full: stop consuming (the deliveries already sent
/// are handed back by their handlers, which see the pause), wait until
/// `until`, then consume again. Shown by `batchfleet_worker_paused`.
async fn pause(
    session: &mut Session,
    ctx: &Arc<context::ItemContext>,
    until: Instant,
    why: &str,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    tracing::warn!(
        reason = why,
        pause_s = until
            .saturating_duration_since(Instant::now())
            .as_secs_f64(),
        "output disk full: not consuming until space is freed"
    );
    for delivery in session.stop_work().await? {
        let (ctx, permits) = (ctx.clone(), Arc::new(Semaphore::new(1)));
        let permit = permits.try_acquire_owned().expect("a fresh permit");
        tracker.spawn(consumer::handle(delivery, ctx, permit));
    }
    // The pause may grow meanwhile (a handed-back item found the disk full
    // again): wait until it has run out.
    let mut until = until;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(until.into()) => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
        match ctx.pause.until() {
            Some((later, _)) => until = later,
            None => break,
        }
    }
    ctx.pause.ended();
    session
        .resume_work()
        .await
        .map_err(|e| format!("consuming again after the pause: {e}"))?;
    tracing::info!("resuming consumption after the pause; trying the disk again");
    Ok(())
}

/// One broker handle consuming the work queues (the pool's and its active
/// jobs', [`sources::Sources`]) and the infra queue.
struct Session {
    broker: Arc<dyn Broker>,
    work: sources::Sources,
    infra: Box<dyn Subscription>,
    prefetch: u16,
    queues: PoolQueues,
}

impl Session {
    /// Declares the pool's topology and starts consuming.
    async fn open(
        broker: Arc<dyn Broker>,
        queues: &PoolQueues,
        prefetch: u16,
    ) -> Result<Self, BrokerError> {
        broker.declare(queues).await?;
        let infra = broker.consume(&queues.infra(), prefetch).await?;
        let work = sources::Sources::open(&broker, &queues.work(), prefetch).await?;
        Ok(Self {
            broker,
            work,
            infra,
            prefetch,
            queues: queues.clone(),
        })
    }

    /// Cancels the work subscriptions; the deliveries the broker had sent
    /// already, which come out of the streams before their ends.
    async fn stop_work(&mut self) -> Result<Vec<batchfleet_shared::broker::Delivery>, String> {
        Ok(self.work.stop().await)
    }

    /// Consumes the work queues again with the prefetch in force.
    async fn resume_work(&mut self) -> Result<(), String> {
        self.work.resume(&self.broker, self.prefetch).await
    }

    /// Follows the pool's active jobs: their queues consumed, the ended
    /// ones' let go (what they had sent goes back to its queue).
    async fn refresh_jobs(&mut self, store: &batchfleet_shared::store::Store) {
        let active = match store.active_jobs(&self.queues.pool).await {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the pool's active jobs");
                return;
            }
        };
        let queues = self.queues.clone();
        let returned = self
            .work
            .refresh(&self.broker, &active, |job| queues.job(job), self.prefetch)
            .await;
        for d in returned {
            let _ = d.requeue().await;
        }
    }

    /// Stops the consumers (draining).
    async fn cancel_consumers(&mut self) {
        self.work.cancel().await;
        self.infra.cancel().await;
    }
}
