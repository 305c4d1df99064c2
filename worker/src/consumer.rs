//! The consume loop's unit of work: what happens to one delivery.
//!
//! decode → lease (skip if done, or the job failed) → read → predict → publish
//! the rejects and part files → mark done in Redis → ack. The ack comes last,
//! so a worker that dies at any point leaves the item to be redelivered, and
//! the done set plus first-writer-wins files make the redelivery harmless.
//!
//! While it works on an item the worker holds a lease in Redis, refreshed by
//! a heartbeat: the coordinator sees what is in flight where, and publishes a
//! copy of an item whose worker went silent or straggles. An item held longer
//! than `ack_after` is acknowledged early and kept by its lease alone, so a
//! long item never trips RabbitMQ's `consumer_timeout`.
//!
//! An item of more than `checkpoint_rows` rows is predicted in segments of
//! that many rows; each finished segment is published under
//! `_partial/part-<seq>-<model>/`, and a redelivered item starts after the
//! last finished segment instead of from scratch. On shutdown such an item
//! stops at the next segment boundary and goes back to the queue.
//!
//! A failure is settled by its class: transient or timeout → re-published to
//! a retry tier with the next attempt number (a confirmed publish, then the
//! ack), until `max_attempts`; poison or out of attempts → published to the
//! dead queue with the reason in headers, recorded in Redis, then acked;
//! fatal → returned to the queue and the worker stops consuming.

use crate::error::{FailureClass, ItemError};
use crate::runner::ModelRunner;
use crate::{reader, writer};
use batchfleet_shared::broker::{headers, int_header, ConfirmedPublisher, Outgoing, PoolQueues};
use batchfleet_shared::fsutil::Publish;
use batchfleet_shared::message::OutputFormat;
use batchfleet_shared::message::{
    Envelope, WorkItem, ATTEMPT_HEADER, CLASS_HEADER, DEAD_AT_HEADER, ERROR_HEADER, ITEM_HEADER,
    JOB_HEADER, MESSAGE_TYPE_V1, PUBLISHED_HEADER, WORKER_HEADER,
};
use batchfleet_shared::metrics::names;
use batchfleet_shared::paths::DataRoots;
use batchfleet_shared::store::{
    ItemFailure, ItemGate, ItemStats, JobStatus, Lease, Store, StoreError,
};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Runners abandoned to hung `forward` calls before the worker asks to be restarted.
pub const MAX_ABANDONED_RUNNERS: usize = 2;

/// Why a worker stopped consuming on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// It cannot process items (model unusable): exit 1.
    Fatal(String),
    /// Too many runner threads are stuck in hung `forward` calls: exit 75 so
    /// the supervisor starts a fresh process.
    Restart(String),
}

/// Folder (inside the output folder) holding the checkpoint segments of items in progress.
pub const PARTIAL_DIR: &str = "_partial";

/// Timing of leases, early acks and waits for Redis.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// How often a held item's lease is refreshed.
    pub heartbeat: Duration,
    /// A lease not refreshed for this long is presumed dead.
    pub lease_ttl: Duration,
    /// Acknowledge a delivery held this long and keep the item by its lease.
    pub ack_after: Duration,
    /// How long an item waits for Redis to come back before it is retried later.
    pub store_patience: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_secs(2),
            lease_ttl: Duration::from_secs(15),
            ack_after: Duration::from_secs(600),
            store_patience: Duration::from_secs(60),
        }
    }
}

/// What a worker's item handlers share.
pub struct ItemContext {
    /// Redis.
    pub store: Store,
    /// Publishes retries and dead letters (confirm mode); replaced on reconnect.
    publisher: Mutex<Arc<ConfirmedPublisher>>,
    /// Lease and wait timing.
    pub tuning: Tuning,
    /// The pool's queue names.
    pub queues: PoolQueues,
    /// This worker's id.
    pub worker_id: String,
    /// Cancelled on shutdown: items not started yet go back to the queue.
    pub shutdown: CancellationToken,
    /// Cancelled when the worker must stop consuming on its own.
    pub stop: CancellationToken,
    /// Why it stopped.
    pub stop_reason: Mutex<Option<StopReason>>,
    runner: Mutex<RunnerSlot>,
    make_runner: Box<dyn Fn() -> std::io::Result<ModelRunner> + Send + Sync>,
    abandoned: AtomicUsize,
    /// Where an item's paths must stay (queue contents are not trusted).
    data_roots: DataRoots,
}

impl std::fmt::Debug for ItemContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ItemContext")
            .field("worker_id", &self.worker_id)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

impl ItemContext {
    /// A context whose model runners come from `make_runner`.
    pub fn new(
        store: Store,
        publisher: ConfirmedPublisher,
        queues: PoolQueues,
        worker_id: String,
        shutdown: CancellationToken,
        tuning: Tuning,
        make_runner: Box<dyn Fn() -> std::io::Result<ModelRunner> + Send + Sync>,
    ) -> std::io::Result<Self> {
        let runner = make_runner()?;
        Ok(Self {
            store,
            publisher: Mutex::new(Arc::new(publisher)),
            tuning,
            queues,
            worker_id,
            shutdown,
            stop: CancellationToken::new(),
            stop_reason: Mutex::new(None),
            runner: Mutex::new(RunnerSlot::new(runner)),
            make_runner,
            abandoned: AtomicUsize::new(0),
            data_roots: DataRoots::default(),
        })
    }

    /// Confines every item's paths to `roots` (by default they need only be
    /// absolute and free of `..`).
    pub fn with_data_roots(mut self, roots: DataRoots) -> Self {
        self.data_roots = roots;
        self
    }

    /// Refuses an item whose input, model or output path is not allowed.
    fn check_paths(&self, item: &WorkItem) -> Result<(), ItemError> {
        check_paths(&self.data_roots, item)
    }

    /// The current publisher.
    pub fn publisher(&self) -> Arc<ConfirmedPublisher> {
        self.publisher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Loads a model on the current runner before any item needs it.
    pub async fn preload(
        &self,
        model: &batchfleet_shared::message::ModelRef,
    ) -> Result<(), ItemError> {
        self.slot().runner.load(model).await
    }

    /// Swaps in the publisher of a new broker connection.
    pub fn set_publisher(&self, publisher: ConfirmedPublisher) {
        *self.publisher.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(publisher);
    }

    /// Runs a Redis operation, retrying with capped exponential backoff while
    /// Redis is unreachable, up to `store_patience` (or shutdown).
    async fn patient<T, F, Fut>(&self, what: &str, op: F) -> Result<T, ItemError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        use backon::{ExponentialBuilder, Retryable};
        let deadline = Instant::now() + self.tuning.store_patience;
        op.retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(Duration::from_secs(3))
                .with_jitter()
                .without_max_times(),
        )
        .when(|e: &StoreError| !e.is_permanent() && Instant::now() < deadline && !self.shutdown.is_cancelled())
        .notify(|e, wait| tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "Redis {what} failed; waiting for Redis"))
        .await
        .map_err(|e| ItemError::transient(e.to_string()))
    }

    fn slot(&self) -> RunnerSlot {
        self.runner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs the model on rows `rows` of a batch within what is left of the
    /// item's model-time `budget`, and takes the time the call took from it
    /// (waiting for a turn, or between segments, does not count).
    async fn predict(
        &self,
        item: &WorkItem,
        batch: reader::Batch,
        rows: std::ops::Range<usize>,
        budget: &mut Duration,
    ) -> Predicted {
        if budget.is_zero() {
            // Spent on earlier segments: the runner is fine, the item is too slow.
            return Predicted::TimedOut;
        }
        let mut batch = Some(batch);
        loop {
            let slot = self.slot();
            // A shutdown while waiting for a turn gives the item back untouched.
            let turn = tokio::select! {
                turn = slot.gate.clone().acquire_owned() => turn,
                _ = self.shutdown.cancelled() => return Predicted::Shutdown,
            };
            let Ok(_turn) = turn else {
                continue; // that runner was replaced while we waited; take the new one
            };
            // Counted as it goes in (rows a crash or timeout throws away count
            // too), alongside the call so that the model never waits for Redis.
            let counted = count_work(self, &item.job_id, 0, rows.len() as u64);
            let call = slot.runner.predict_rows(
                &item.task.model,
                batch.take().expect("batch is sent once"),
                rows,
                item.task.batch_size as usize,
                &item.task.failure,
            );
            let started = Instant::now();
            let (timed, ()) = tokio::join!(tokio::time::timeout(*budget, call), counted);
            return match timed {
                Ok((batch, result)) => {
                    *budget = budget.saturating_sub(started.elapsed());
                    Predicted::Done(Box::new(batch), result)
                }
                Err(_) => {
                    self.replace_runner(&slot);
                    Predicted::TimedOut
                }
            };
        }
    }

    fn stop_with(&self, reason: StopReason) {
        self.stop_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(reason);
        self.stop.cancel();
    }

    /// Abandons `stuck` (a runner in a hung `forward`) for a fresh one.
    fn replace_runner(&self, stuck: &RunnerSlot) {
        {
            let mut current = self.runner.lock().unwrap_or_else(|p| p.into_inner());
            if !Arc::ptr_eq(&current.gate, &stuck.gate) {
                return; // already replaced
            }
            match (self.make_runner)() {
                Ok(fresh) => *current = RunnerSlot::new(fresh),
                Err(e) => self.stop_with(StopReason::Restart(format!(
                    "cannot start a new model runner: {e}"
                ))),
            }
        }
        stuck.gate.close();
        let n = self.abandoned.fetch_add(1, Ordering::SeqCst) + 1;
        if n > MAX_ABANDONED_RUNNERS {
            self.stop_with(StopReason::Restart(format!(
                "{n} model runner threads are stuck in hung forward calls"
            )));
        } else {
            tracing::warn!(
                abandoned = n,
                "model runner abandoned to a hung forward call; a fresh one takes over"
            );
        }
    }
}

/// Refuses an item whose input files (every one, for `files` items), model
/// or output folder is not under `roots`: queue contents are not trusted.
fn check_paths(roots: &DataRoots, item: &WorkItem) -> Result<(), ItemError> {
    let inputs = item.input.input_files();
    let paths = inputs.iter().map(|p| ("input file", p.as_path())).chain([
        ("model", Path::new(&item.task.model.path)),
        ("output folder", Path::new(&item.task.output.dir)),
    ]);
    for (what, p) in paths {
        if let Err(e) = roots.check(p) {
            return Err(ItemError::poison(format!(
                "refusing the item's {what} {e} (this worker's data roots: {})",
                if roots.is_confined() {
                    roots.describe()
                } else {
                    "none set".into()
                }
            )));
        }
    }
    Ok(())
}

/// What [`ItemContext::predict`] came back with.
enum Predicted {
    /// The batch and the model's answer.
    Done(
        Box<reader::Batch>,
        Result<crate::runner::Predictions, ItemError>,
    ),
    /// The call ran past its time; the runner was replaced.
    TimedOut,
    /// Shutdown came before the item's turn.
    Shutdown,
}

/// The current model runner and the gate that admits one item at a time to
/// it. Items wait at the gate, not in the runner's queue, so an item timeout
/// counts only the item's own model time, and when a hung runner is replaced
/// its gate closes and the waiting items move on to the new one.
#[derive(Clone)]
struct RunnerSlot {
    runner: ModelRunner,
    gate: Arc<Semaphore>,
}

impl RunnerSlot {
    fn new(runner: ModelRunner) -> Self {
        Self {
            runner,
            gate: Arc::new(Semaphore::new(1)),
        }
    }
}

/// How an item ended on this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Predicted, written and committed here.
    Committed,
    /// Already done (by an earlier delivery or a faster copy); acked without
    /// recompute, or with this copy's work discarded.
    AlreadyDone,
    /// The job failed (error budget); acked without work.
    Skipped,
    /// Returned to the queue (shutdown), with its checkpoints kept.
    Released,
    /// Re-published for a later attempt.
    Retried,
    /// Dead-lettered.
    DeadLettered,
    /// Returned to the queue, and the worker stops.
    Fatal,
}

/// A delivery and whether it has been settled (acked or nacked) yet: an item
/// acknowledged early is held by its lease alone and must not be settled twice.
struct Held {
    delivery: Delivery,
    settled: AtomicBool,
    received: Instant,
}

impl Held {
    fn new(delivery: Delivery) -> Self {
        Self {
            delivery,
            settled: AtomicBool::new(false),
            received: Instant::now(),
        }
    }

    fn is_settled(&self) -> bool {
        self.settled.load(Ordering::SeqCst)
    }

    /// Acks unless already settled. A failure is only logged: the broker
    /// redelivers an unsettled message when the channel closes, and the done
    /// set makes that cheap.
    async fn ack(&self) {
        if self.settled.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Err(e) = self.delivery.acker.ack(BasicAckOptions::default()).await {
            tracing::warn!(error = %e, "could not ack; the broker will redeliver the item");
        }
    }

    /// Returns the delivery to the queue. `false` if it was acknowledged
    /// early and must be published again instead.
    async fn requeue(&self, why: &str) -> bool {
        if self.settled.swap(true, Ordering::SeqCst) {
            return false;
        }
        let opts = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        if let Err(e) = self.delivery.acker.nack(opts).await {
            tracing::warn!(error = %e, why, "could not return the item; the broker will redeliver it");
        }
        true
    }
}

/// The lease on an item and the heartbeat task that keeps it fresh.
struct LeaseGuard {
    lease: Lease,
    rows_done: Arc<AtomicU64>,
    rows_resumed: Arc<AtomicU64>,
    /// Cancelled when the heartbeat finds the item done elsewhere.
    done_elsewhere: CancellationToken,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseGuard {
    /// Writes the lease, counts the delivery and starts the heartbeat (one
    /// Redis round trip); with it, what the item's gate says. `None` if the
    /// item is done already.
    async fn start(
        item: &WorkItem,
        attempt: u32,
        held: Arc<Held>,
        ctx: Arc<ItemContext>,
    ) -> Result<Option<(Self, ItemGate)>, ItemError> {
        let now = batchfleet_shared::now_ms();
        let lease = Lease {
            seq: item.seq,
            worker: ctx.worker_id.clone(),
            attempt,
            started_ms: now,
            heartbeat_ms: now,
            ttl_ms: ctx.tuning.lease_ttl.as_millis() as u64,
            rows_done: 0,
            rows: item.input.rows(),
            rows_resumed: 0,
            acked: false,
        };
        let job = item.job_id.clone();
        let Some(gate) = ctx
            .patient("lease", || ctx.store.start_item(&job, &lease))
            .await?
        else {
            return Ok(None);
        };
        let rows_done = Arc::new(AtomicU64::new(0));
        let rows_resumed = Arc::new(AtomicU64::new(0));
        let done_elsewhere = CancellationToken::new();
        let stop = CancellationToken::new();
        let task = tokio::spawn(heartbeat_loop(
            job,
            lease.clone(),
            held,
            ctx,
            rows_done.clone(),
            rows_resumed.clone(),
            done_elsewhere.clone(),
            stop.clone(),
        ));
        Ok(Some((
            Self {
                lease,
                rows_done,
                rows_resumed,
                done_elsewhere,
                stop,
                task,
            },
            gate,
        )))
    }

    /// Stops the heartbeat; drops the lease if `drop` (not when the item
    /// could not be handed back, so the stale lease is what makes the
    /// coordinator publish it again, and not after a commit, which dropped it).
    async fn finish(self, job: &str, drop: bool, ctx: &ItemContext) {
        self.stop.cancel();
        let _ = self.task.await;
        if drop {
            if let Err(e) = ctx.store.release(job, &self.lease).await {
                tracing::warn!(error = %e, "could not drop the lease; the coordinator will ignore it once the item is settled");
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn heartbeat_loop(
    job: String,
    mut lease: Lease,
    held: Arc<Held>,
    ctx: Arc<ItemContext>,
    rows_done: Arc<AtomicU64>,
    rows_resumed: Arc<AtomicU64>,
    done_elsewhere: CancellationToken,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(ctx.tuning.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate; the lease was just written
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !held.is_settled() && held.received.elapsed() >= ctx.tuning.ack_after {
            // From here the lease alone holds the item: if this worker dies,
            // the coordinator sees the lease go stale and publishes a copy
            // (at once when the lease says `acked`, else once the queues are
            // drained — so acking before the lease says so is safe).
            held.ack().await;
            lease.acked = true;
            tracing::info!(
                held_s = held.received.elapsed().as_secs(),
                "long item: acknowledged early, held by its lease"
            );
        }
        lease.heartbeat_ms = batchfleet_shared::now_ms();
        lease.rows_done = rows_done.load(Ordering::Relaxed);
        lease.rows_resumed = rows_resumed.load(Ordering::Relaxed);
        match ctx.store.heartbeat(&job, &lease).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!("item committed elsewhere (a faster copy); stopping this one");
                done_elsewhere.cancel();
            }
            Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
        }
    }
}

/// Handles one delivery to the end (ack, nack or re-publish).
pub async fn handle(delivery: Delivery, ctx: Arc<ItemContext>) -> Handled {
    let held = Arc::new(Held::new(delivery));
    metrics::gauge!(names::WORKER_ITEMS_IN_FLIGHT).increment(1.0);
    let _in_flight = scopeguard(|| metrics::gauge!(names::WORKER_ITEMS_IN_FLIGHT).decrement(1.0));
    if let Some(published) = int_header(
        held.delivery.properties.headers().as_ref(),
        PUBLISHED_HEADER,
    ) {
        let waited = batchfleet_shared::now_ms().saturating_sub(published.max(0) as u64);
        metrics::histogram!(names::WORKER_QUEUE_WAIT).record(waited as f64 / 1000.0);
    }
    let attempt = int_header(held.delivery.properties.headers().as_ref(), ATTEMPT_HEADER)
        .unwrap_or(1)
        .max(1) as u32;
    if ctx.shutdown.is_cancelled() || ctx.stop.is_cancelled() {
        held.requeue("stopping before start").await;
        return Handled::Released;
    }
    let item = match Envelope::decode(&held.delivery.data) {
        Ok(env) => env.into_item(),
        Err(e) => {
            tracing::error!(error = %e, "dead-lettering an undecodable message");
            return dead_letter(
                &held,
                None,
                &ItemError::poison(e.to_string()),
                attempt,
                &ctx,
            )
            .await
            .0;
        }
    };
    let span = tracing::info_span!("item", job = %item.job_id, item = item.seq, attempt);
    async {
        let (guard, gate) = match LeaseGuard::start(&item, attempt, held.clone(), ctx.clone()).await
        {
            Ok(Some(started)) => started,
            Ok(None) => {
                tracing::info!("already committed; acknowledging without recompute");
                held.ack().await;
                return Handled::AlreadyDone;
            }
            Err(e) => return settle_error(&held, &item, attempt, e, &ctx).await.0,
        };
        let result = process(&item, attempt, gate, &guard, &ctx).await;
        let (outcome, keep_lease) = match result {
            Ok(Handled::Released) => {
                let returned = give_back(&held, &item, attempt, &ctx).await;
                (Handled::Released, !returned)
            }
            Ok(outcome) => {
                held.ack().await;
                (outcome, false)
            }
            Err(e) => settle_error(&held, &item, attempt, e, &ctx).await,
        };
        let committed = outcome == Handled::Committed;
        guard
            .finish(&item.job_id, !keep_lease && !committed, &ctx)
            .await;
        outcome
    }
    .instrument(span)
    .await
}

/// Settles a failed item by its class. Returns the outcome and whether the
/// lease must be kept (the item could not be handed on).
async fn settle_error(
    held: &Held,
    item: &WorkItem,
    attempt: u32,
    e: ItemError,
    ctx: &ItemContext,
) -> (Handled, bool) {
    let labels = [("job", item.job_id.clone()), ("class", e.class.to_string())];
    metrics::counter!(names::WORKER_ITEMS_FAILED, &labels).increment(1);
    match e.class {
        FailureClass::Fatal => {
            tracing::error!(error = %e.message, "fatal: this worker cannot process items; returning the item and stopping");
            let returned = give_back(held, item, attempt, ctx).await;
            ctx.stop_with(StopReason::Fatal(e.message));
            (Handled::Fatal, !returned)
        }
        c if c.retryable() && attempt < item.task.failure.max_attempts => {
            retry(held, item, attempt, &e, ctx).await
        }
        _ => dead_letter(held, Some(item), &e, attempt, ctx).await,
    }
}

/// Returns an item to the work queue: a nack, or — once acknowledged early —
/// a confirmed publish of a copy. `false` if neither worked.
async fn give_back(held: &Held, item: &WorkItem, attempt: u32, ctx: &ItemContext) -> bool {
    if held.requeue("released").await {
        return true;
    }
    let msg = Outgoing::work_item(item, attempt);
    match ctx
        .publisher()
        .publish_all(&ctx.queues.work(), [msg], 1, |_| {})
        .await
    {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not hand the item back; its lease will go stale and the coordinator will publish it again");
            false
        }
    }
}

async fn process(
    item: &WorkItem,
    attempt: u32,
    gate: ItemGate,
    lease: &LeaseGuard,
    ctx: &ItemContext,
) -> Result<Handled, ItemError> {
    ctx.check_paths(item)?;
    if gate.failed {
        tracing::info!("already dead-lettered (this is a stale copy); acknowledging without work");
        return Ok(Handled::Skipped);
    }
    if gate.status == Some(JobStatus::Failed) {
        tracing::info!("job failed (error budget exceeded); skipping the item");
        return Ok(Handled::Skipped);
    }
    let out = Path::new(&item.task.output.dir);
    let dest = out.join(item.task.output.part_name(item.seq));
    let rejects_dest = batchfleet_shared::output::rejects_path(out, item.seq);
    let policy = &item.task.failure;
    let mut stats = ItemStats {
        seq: item.seq,
        rows: 0,
        rows_rejected: 0,
        worker: ctx.worker_id.clone(),
        started_ms: batchfleet_shared::now_ms(),
        finished_ms: 0,
        attempt,
        recovered: false,
        rows_resumed: 0,
    };
    let mut partial = None;
    let hspec = item.task.output.histogram;
    let format = item.task.output.format;
    let mut hist: Vec<Vec<u64>> = Vec::new();
    let d = dest.clone();
    if blocking(move || batchfleet_shared::source::fs::exists(&d))
        .await?
        .map_err(|e| ItemError::transient(format!("cannot look for {}: {e}", dest.display())))?
    {
        // A previous delivery published the files and died before marking it done.
        let (d, r, spec) = (dest.clone(), rejects_dest.clone(), item.task.output.clone());
        let (rows, rejected, h) = blocking(move || {
            let (rows, h) = batchfleet_shared::output::histogram_of_part(&d, &spec)?;
            Ok::<_, std::io::Error>((rows, writer::count_rejects(&r)?, h))
        })
        .await?
        .map_err(|e| ItemError::transient(format!("cannot read {}: {e}", dest.display())))?;
        hist = h;
        if rows + rejected != item.input.rows() {
            return Err(ItemError::poison(format!(
                "{} holds {rows} rows and {rejected} rejects but the item has {}; remove them to recompute the item",
                dest.display(),
                item.input.rows()
            )));
        }
        (stats.rows, stats.rows_rejected, stats.recovered) = (rows, rejected, true);
    } else {
        let (slice, layout, on_bad_row) = (
            item.input.clone(),
            reader::Layout::of(&item.task),
            policy.on_bad_row,
        );
        let read_started = Instant::now();
        let mut batch = blocking(move || reader::read(&slice, &layout, on_bad_row)).await??;
        metrics::histogram!(names::WORKER_READ).record(read_started.elapsed().as_secs_f64());
        let mut budget = Duration::from_millis(policy.item_timeout_ms);
        let seg = item.task.checkpoint_rows as usize;
        let tag = format!("{}-{}", ctx.worker_id, attempt);
        let mut rejects = std::mem::take(&mut batch.rejects);
        let rows = batch.rows();
        let published = if seg == 0 || rows <= seg {
            let preds = match ctx.predict(item, batch, 0..rows, &mut budget).await {
                Predicted::Done(b, p) => {
                    batch = *b;
                    p?
                }
                Predicted::TimedOut => return Err(timed_out(policy)),
                Predicted::Shutdown => return Ok(Handled::Released),
            };
            rejects.extend(
                preds
                    .failed
                    .iter()
                    .map(|(i, msg)| batch.model_reject(*i, msg)),
            );
            stats.rows = (rows - preds.failed.len()) as u64;
            stats.rows_rejected = rejects.len() as u64;
            rejects.sort_by_key(|r| r.line);
            log_rejects(&rejects);
            // Failed rows are NaN, which no bin counts.
            hspec.add(&mut hist, &preds.values, preds.width);
            let write_started = Instant::now();
            let spec = item.task.output.clone();
            let published = blocking(move || {
                // The part file is the commit point; the rejects file goes first
                // and reflects this attempt (a stale one from a crashed attempt
                // with another model is replaced or removed).
                writer::write_rejects(&rejects_dest, &tag, &rejects)?;
                writer::write_part(&dest, &tag, &spec, &batch, &preds)
            })
            .await??;
            metrics::histogram!(names::WORKER_WRITE).record(write_started.elapsed().as_secs_f64());
            published
        } else {
            let dir = out.join(PARTIAL_DIR).join(format!(
                "part-{:06}-{}",
                item.seq,
                &item.task.model.sha256[..item.task.model.sha256.len().min(12)]
            ));
            let d = dir.clone();
            let (segments, mut model_rejects) =
                blocking(move || finished_segments(&d, seg, rows, format)).await??;
            let resumed_files: Vec<PathBuf> = segments
                .iter()
                .map(|s| segment_path(&dir, *s, format))
                .collect();
            let spec = item.task.output.clone();
            hist = blocking(move || {
                let mut h = Vec::new();
                for f in &resumed_files {
                    let (_, part) = batchfleet_shared::output::histogram_of_part(f, &spec)?;
                    merge_histogram(&mut h, &part);
                }
                Ok::<_, std::io::Error>(h)
            })
            .await?
            .map_err(|e| {
                ItemError::transient(format!("cannot read the checkpoint {}: {e}", dir.display()))
            })?;
            let mut next = segments.last().map_or(0, |s| s.1);
            let resumed = next;
            if resumed > 0 {
                tracing::info!(
                    rows_resumed = resumed,
                    rows,
                    "resuming the item from its checkpoint"
                );
            }
            lease.rows_resumed.store(resumed as u64, Ordering::Relaxed);
            lease.rows_done.store(resumed as u64, Ordering::Relaxed);
            let mut files: Vec<PathBuf> = segments
                .iter()
                .map(|s| segment_path(&dir, *s, format))
                .collect();
            let mut predicted = 0usize;
            let mut failed = model_rejects.len();
            while next < rows {
                if lease.done_elsewhere.is_cancelled() {
                    // A faster copy committed: this copy's segments are not
                    // needed (and the job's summary may already be written).
                    let d = dir.clone();
                    let _ =
                        blocking(move || batchfleet_shared::source::fs::remove_dir_all(&d)).await;
                    return Ok(Handled::AlreadyDone);
                }
                if ctx.shutdown.is_cancelled() {
                    tracing::info!(
                        rows_done = next,
                        rows,
                        "shutdown: the item goes back to the queue with its checkpoint"
                    );
                    return Ok(Handled::Released);
                }
                let end = (next + seg).min(rows);
                let preds = match ctx.predict(item, batch, next..end, &mut budget).await {
                    Predicted::Done(b, p) => {
                        batch = *b;
                        p?
                    }
                    Predicted::TimedOut => return Err(timed_out(policy)),
                    Predicted::Shutdown => return Ok(Handled::Released),
                };
                let seg_rejects: Vec<_> = preds
                    .failed
                    .iter()
                    .map(|(i, msg)| batch.model_reject(next + i, msg))
                    .collect();
                failed += seg_rejects.len();
                hspec.add(&mut hist, &preds.values, preds.width);
                let path = segment_path(&dir, (next, end), format);
                let (p, t, b, spec) = (path.clone(), tag.clone(), batch, item.task.output.clone());
                let sr = seg_rejects.clone();
                let write_started = Instant::now();
                batch = blocking(move || {
                    // The segment's rejects first: its part file is what marks it finished.
                    if !sr.is_empty() {
                        writer::write_rejects(&p.with_extension("rejects.jsonl"), &t, &sr)?;
                    }
                    writer::write_part_rows(&p, &t, &spec, &b, next..end, &preds)?;
                    Ok::<_, ItemError>(b)
                })
                .await??;
                metrics::histogram!(names::WORKER_WRITE)
                    .record(write_started.elapsed().as_secs_f64());
                model_rejects.extend(seg_rejects);
                files.push(path);
                predicted += end - next;
                next = end;
                lease.rows_done.store(next as u64, Ordering::Relaxed);
            }
            stats.rows_resumed = resumed as u64;
            rejects.extend(model_rejects);
            rejects.sort_by_key(|r| r.line);
            stats.rows = (rows - failed) as u64;
            stats.rows_rejected = rejects.len() as u64;
            log_rejects(&rejects);
            tracing::debug!(predicted, resumed, "segments finished");
            partial = Some(dir);
            blocking(move || {
                writer::write_rejects(&rejects_dest, &tag, &rejects)?;
                writer::concat_parts(&dest, &tag, format, &files)
            })
            .await??
        };
        stats.recovered = published == Publish::AlreadyExists;
    }
    stats.finished_ms = batchfleet_shared::now_ms();
    let won = ctx
        .patient("commit", || {
            ctx.store.commit_item(&item.job_id, &stats, &hist)
        })
        .await?;
    if let Some(dir) = partial {
        // The segments are in the part file now (or a faster copy's is there).
        let _ = blocking(move || batchfleet_shared::source::fs::remove_dir_all(&dir)).await;
    }
    if won {
        let labels = [
            ("job", item.job_id.clone()),
            ("model", model_label(&item.task.model)),
        ];
        metrics::counter!(names::WORKER_ROWS_PROCESSED, &labels).increment(stats.rows);
        metrics::counter!(names::WORKER_ROWS_REJECTED, &labels).increment(stats.rows_rejected);
        metrics::counter!(names::WORKER_ITEMS_COMPLETED, &labels).increment(1);
    }
    tracing::info!(
        rows = stats.rows,
        rejected = stats.rows_rejected,
        resumed = stats.rows_resumed,
        ms = stats.latency_ms(),
        won,
        recovered = stats.recovered,
        "item committed"
    );
    Ok(if won {
        Handled::Committed
    } else {
        Handled::AlreadyDone
    })
}

/// Runs a closure when dropped (keeps a gauge balanced on every return path).
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

fn scopeguard<F: FnMut()>(f: F) -> OnDrop<F> {
    OnDrop(f)
}

/// Adds `part` into `into`, column by column.
fn merge_histogram(into: &mut Vec<Vec<u64>>, part: &[Vec<u64>]) {
    for (c, col) in part.iter().enumerate() {
        if into.len() <= c {
            into.push(vec![0; col.len()]);
        }
        for (b, n) in col.iter().enumerate() {
            if let Some(slot) = into[c].get_mut(b) {
                *slot += n;
            }
        }
    }
}

/// The `model` label: the model file's name (bounded: one per job).
fn model_label(model: &batchfleet_shared::message::ModelRef) -> String {
    Path::new(&model.path)
        .file_name()
        .map_or_else(|| model.path.clone(), |n| n.to_string_lossy().into_owned())
}

/// Best effort: the counters measure wasted work, they decide nothing.
async fn count_work(ctx: &ItemContext, job: &str, deliveries: u64, rows: u64) {
    if let Err(e) = ctx.store.count_work(job, deliveries, rows).await {
        tracing::debug!(error = %e, "could not count work");
    }
}

fn timed_out(policy: &batchfleet_shared::message::FailurePolicy) -> ItemError {
    ItemError::timeout(format!(
        "the model call did not finish within item_timeout ({}s)",
        Duration::from_millis(policy.item_timeout_ms).as_secs_f64()
    ))
}

fn log_rejects(rejects: &[reader::Reject]) {
    if let Some(first) = rejects.first() {
        tracing::warn!(rejected = rejects.len(), first = %first.reason, "rows rejected");
    }
}

/// `seg-<start>-<end>.csv` in an item's checkpoint folder.
fn segment_path(dir: &Path, (start, end): (usize, usize), format: OutputFormat) -> PathBuf {
    dir.join(format!("seg-{start:09}-{end:09}.{}", format.extension()))
}

/// Finished segments (row spans) and the model rejects recorded for them.
type Checkpoint = (Vec<(usize, usize)>, Vec<reader::Reject>);

/// The finished segments of an item's checkpoint folder that follow each
/// other from row 0 on the expected boundaries (anything else is ignored and
/// recomputed), with the model rejects recorded for them.
fn finished_segments(
    dir: &Path,
    seg: usize,
    rows: usize,
    format: OutputFormat,
) -> Result<Checkpoint, ItemError> {
    let mut found = Vec::new();
    let mut rejects = Vec::new();
    let mut start = 0;
    while start < rows {
        let span = (start, (start + seg).min(rows));
        let path = segment_path(dir, span, format);
        let there = batchfleet_shared::source::fs::exists(&path).map_err(|e| {
            ItemError::transient(format!("cannot read the checkpoint {}: {e}", dir.display()))
        })?;
        if !there {
            break;
        }
        let r = writer::read_rejects(&path.with_extension("rejects.jsonl")).map_err(|e| {
            ItemError::transient(format!("cannot read the checkpoint {}: {e}", dir.display()))
        })?;
        rejects.extend(r);
        found.push(span);
        start = span.1;
    }
    Ok((found, rejects))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ItemError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ItemError::transient(format!("worker task failed: {e}")))
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Re-publishes the item to a retry tier for attempt `attempt + 1`, then
/// acks. Returns the outcome and whether the lease must be kept.
async fn retry(
    held: &Held,
    item: &WorkItem,
    attempt: u32,
    e: &ItemError,
    ctx: &ItemContext,
) -> (Handled, bool) {
    let next = attempt + 1;
    let delay = item.task.failure.retry_delay_ms(next, fastrand::f64());
    let queue = ctx.queues.retry_for(delay);
    tracing::warn!(error = %e.message, class = %e.class, next_attempt = next, delay_ms = delay, "retrying later");
    let msg = Outgoing {
        message_id: format!("{}/{}", item.job_id, item.seq),
        kind: MESSAGE_TYPE_V1,
        body: held.delivery.data.clone(),
        headers: headers(
            [
                (CLASS_HEADER, e.class.to_string()),
                (ERROR_HEADER, truncate(&e.message, 2000)),
            ],
            [
                (ATTEMPT_HEADER, i64::from(next)),
                // The retry delay is not queue wait: it counts from when the item is due.
                (
                    PUBLISHED_HEADER,
                    (batchfleet_shared::now_ms() + delay) as i64,
                ),
            ],
        ),
        expiration_ms: Some(delay),
    };
    match ctx.publisher().publish_all(&queue, [msg], 1, |_| {}).await {
        Ok(_) => {
            held.ack().await;
            metrics::counter!(names::WORKER_ITEMS_RETRIED, "job" => item.job_id.clone(), "class" => e.class.to_string()).increment(1);
            (Handled::Retried, false)
        }
        Err(err) => {
            tracing::warn!(error = %err, "could not schedule the retry; returning the item to the queue");
            let returned = give_back(held, item, attempt, ctx).await;
            (Handled::Released, !returned)
        }
    }
}

/// Publishes the item to the dead queue with why, records the failure, then
/// acks. Returns the outcome and whether the lease must be kept.
async fn dead_letter(
    held: &Held,
    item: Option<&WorkItem>,
    e: &ItemError,
    attempt: u32,
    ctx: &ItemContext,
) -> (Handled, bool) {
    let class = e.class.to_string();
    let class_label = class.clone();
    tracing::error!(error = %e.message, class = %class, attempt, "dead-lettering the item");
    let now = batchfleet_shared::now_ms();
    let (job, seq) = item.map_or((String::new(), -1), |i| {
        (i.job_id.clone(), i64::from(i.seq))
    });
    let msg = Outgoing {
        message_id: item.map_or_else(
            || "undecodable".to_owned(),
            |i| format!("{}/{}", i.job_id, i.seq),
        ),
        kind: MESSAGE_TYPE_V1,
        body: held.delivery.data.clone(),
        headers: headers(
            [
                (JOB_HEADER, job.clone()),
                (CLASS_HEADER, class.clone()),
                (ERROR_HEADER, truncate(&e.message, 8000)),
                (WORKER_HEADER, ctx.worker_id.clone()),
            ],
            [
                (ATTEMPT_HEADER, i64::from(attempt)),
                (ITEM_HEADER, seq),
                (DEAD_AT_HEADER, now as i64),
            ],
        ),
        expiration_ms: None,
    };
    if let Err(err) = ctx
        .publisher()
        .publish_all(&ctx.queues.dead(), [msg], 1, |_| {})
        .await
    {
        tracing::warn!(error = %err, "could not dead-letter the item; returning it to the queue");
        let returned = match item {
            Some(item) => give_back(held, item, attempt, ctx).await,
            None => held.requeue("dead-letter publish failed").await,
        };
        return (Handled::Released, !returned);
    }
    if let Some(item) = item {
        let failure = ItemFailure {
            seq: item.seq,
            class,
            reason: e.message.clone(),
            worker: ctx.worker_id.clone(),
            attempt,
            at_ms: now,
        };
        if let Err(err) = ctx
            .patient("record failure", || {
                ctx.store.fail_item(&item.job_id, &failure)
            })
            .await
        {
            // The dead queue holds it either way; the coordinator will not
            // see the job settle until the failure is recorded (by a replay).
            tracing::warn!(error = %err, "could not record the failure in Redis");
        }
    }
    held.ack().await;
    metrics::counter!(names::WORKER_ITEMS_DEAD_LETTERED, "job" => job, "class" => class_label)
        .increment(1);
    (Handled::DeadLettered, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_of_a_files_item_is_checked_against_the_roots() {
        let data = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(data.path()).unwrap();
        std::fs::write(root.join("ok.png"), b"x").unwrap();
        std::fs::write(elsewhere.path().join("secret.png"), b"x").unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("secret.png"), root.join("link.png"))
            .unwrap();
        let roots = DataRoots::new(std::slice::from_ref(&root)).unwrap();
        let item = |files: &[&str]| {
            let mut item = batchfleet_coordinator::planner::sample_item("j-00000000", 0);
            item.task.model.path = root.join("ok.png").to_string_lossy().into_owned();
            item.task.output.dir = root.to_string_lossy().into_owned();
            item.input = batchfleet_shared::message::InputSlice::Files {
                root: root.to_string_lossy().into_owned(),
                files: files.iter().map(|f| (*f).to_owned()).collect(),
                sizes: vec![1; files.len()],
                first_index: 0,
            };
            item
        };
        assert!(check_paths(&roots, &item(&["ok.png"])).is_ok());
        for (files, why) in [
            (&["ok.png", "../x.png"][..], "contains `..`"),
            (&["ok.png", "link.png"][..], "is outside the data roots"),
        ] {
            let e = check_paths(&roots, &item(files)).unwrap_err();
            assert_eq!(e.class, crate::error::FailureClass::Poison);
            assert!(
                e.message.contains("refusing the item's input file") && e.message.contains(why),
                "{}",
                e.message
            );
        }
        // An S3 output needs an s3:// root too: queue contents are not trusted.
        let mut to_s3 = item(&["ok.png"]);
        to_s3.task.output.dir = "s3://elsewhere/out".into();
        let e = check_paths(&roots, &to_s3).unwrap_err();
        assert!(
            e.message
                .contains("refusing the item's output folder s3://elsewhere/out"),
            "{}",
            e.message
        );
        let with_s3 = DataRoots::new(&[root.clone(), "s3://elsewhere/out".into()]).unwrap();
        assert!(check_paths(&with_s3, &to_s3).is_ok());
    }

    fn reject(line: u64) -> reader::Reject {
        reader::Reject {
            file: "in.csv".into(),
            line,
            raw: "x".into(),
            reason: "model raised".into(),
            stage: "model".into(),
        }
    }

    #[test]
    fn a_checkpoint_is_the_run_of_finished_segments_from_row_0() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert_eq!(
            finished_segments(d, 200, 1000, OutputFormat::Csv)
                .unwrap()
                .0,
            vec![]
        );
        for span in [(0, 200), (200, 400), (600, 800)] {
            std::fs::write(segment_path(d, span, OutputFormat::Csv), "id,score\n").unwrap();
        }
        writer::write_rejects(
            &segment_path(d, (200, 400), OutputFormat::Csv).with_extension("rejects.jsonl"),
            "t",
            &[reject(250)],
        )
        .unwrap();
        // 600..800 does not follow 400: it is not part of the checkpoint.
        let (spans, rejects) = finished_segments(d, 200, 1000, OutputFormat::Csv).unwrap();
        assert_eq!(spans, vec![(0, 200), (200, 400)]);
        assert_eq!(rejects, vec![reject(250)]);
        // Boundaries of another segment size do not count.
        assert_eq!(
            finished_segments(d, 300, 1000, OutputFormat::Csv)
                .unwrap()
                .0,
            vec![]
        );
    }
}
