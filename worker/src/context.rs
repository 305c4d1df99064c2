//! What a worker's item handlers share: the job store, the broker, the model
//! runner and the gate that admits one item at a time to it (a hung runner
//! replaced, the worker restarted after too many), the message guard, the
//! worker's timing, and the jobs this worker leaves to others for a while
//! ([`Bench`]). The disk-full pause it holds is the consumer's
//! ([`crate::consumer::pause`]).

use crate::batch::Batch;
use crate::consumer::pause::Pause;
use crate::debug::{Clock, DebugHooks};
use crate::error::ItemError;
use crate::item::admission::Guard;
use crate::item::signals::Signals;
use crate::runner::{ModelRunner, Predictions};
use batchfleet_shared::broker::{Broker, BrokerError, Outgoing, PoolQueues};
use batchfleet_shared::message::WorkItem;
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::{Store, StoreError, Work};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Runners abandoned to hung `forward` calls before the worker asks to be restarted.
pub const MAX_ABANDONED_RUNNERS: usize = 2;

/// Why a worker stopped consuming on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// Too many runner threads are stuck in hung `forward` calls: exit 75 so
    /// the supervisor starts a fresh process.
    Restart(String),
}

/// Timing of leases, early acks, hand-backs and waits for Redis.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// How often a held item's lease is refreshed.
    pub heartbeat: Duration,
    /// A lease not refreshed for this long is presumed dead.
    pub lease_ttl: Duration,
    /// Acknowledge a delivery held this long (if it reached the model) and
    /// keep the item by its lease; hand it back if it never did.
    pub ack_after: Duration,
    /// How long an item waits for Redis to come back before it is retried later.
    pub store_patience: Duration,
    /// How long this worker leaves a job it cannot run to other workers.
    pub unable_for: Duration,
    /// Delay before an item handed back by a worker that cannot run it returns.
    pub hand_back_delay: Duration,
    /// How long an item of a job unknown to Redis is handed back (Redis
    /// may have lost its data and the coordinator not restored it yet)
    /// before it is rejected.
    pub unknown_job_grace: Duration,
    /// Longest pause between tries while the output disk is full.
    pub pause_max: Duration,
}

impl Tuning {
    /// The timing a worker's flags set.
    pub fn of(cfg: &crate::config::WorkerConfig) -> Self {
        Self {
            heartbeat: cfg.heartbeat,
            lease_ttl: cfg.lease_ttl.max(cfg.heartbeat * 2),
            ack_after: cfg.ack_after,
            store_patience: cfg.outage(),
            unable_for: cfg.unable_for,
            unknown_job_grace: cfg.unknown_job_grace,
            pause_max: cfg.disk_full_max_pause,
            ..Self::default()
        }
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_secs(2),
            lease_ttl: Duration::from_secs(15),
            ack_after: Duration::from_secs(600),
            store_patience: Duration::from_secs(60),
            unable_for: Duration::from_secs(60),
            hand_back_delay: Duration::from_secs(1),
            unknown_job_grace: Duration::from_secs(120),
            pause_max: Duration::from_secs(60),
        }
    }
}

/// Jobs this worker cannot run for now (no CUDA device here, model
/// unreadable here, out of memory on one row): their items are handed back
/// untouched until the time runs out, so workers that can take them.
#[derive(Debug, Default)]
pub struct Bench {
    jobs: Mutex<HashMap<String, (Instant, String)>>,
}

impl Bench {
    /// Leaves `job` to others for `how_long`; returns `how_long`.
    pub fn add(&self, job: &str, reason: &str, how_long: Duration) -> Duration {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.insert(
            job.to_owned(),
            (Instant::now() + how_long, reason.to_owned()),
        );
        Self::gauge(&mut jobs);
        how_long
    }

    /// Why `job` is left to others now, and for how much longer, if it is.
    pub fn reason(&self, job: &str) -> Option<(String, Duration)> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if jobs.is_empty() {
            return None; // every item asks: no map walk, no gauge on the common path
        }
        Self::gauge(&mut jobs);
        jobs.get(job)
            .map(|(until, why)| (why.clone(), until.saturating_duration_since(Instant::now())))
    }

    /// Drops expired entries and sets the gauge to what is left.
    fn gauge(jobs: &mut HashMap<String, (Instant, String)>) {
        let now = Instant::now();
        jobs.retain(|_, (until, _)| *until > now);
        metrics::gauge!(names::WORKER_JOBS_BENCHED).set(jobs.len() as f64);
    }
}

/// Runs a Redis operation, retried with backoff while Redis is unreachable
/// (at most `patience`, and not past shutdown); then an error the item
/// settles as transient.
pub async fn patiently<T, F, Fut>(
    patience: Duration,
    shutdown: &CancellationToken,
    what: &str,
    op: F,
) -> Result<T, ItemError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    use backon::{ExponentialBuilder, Retryable};
    let deadline = Instant::now() + patience;
    op.retry(
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(3))
            .with_jitter()
            .without_max_times(),
    )
    .when(|e: &StoreError| !e.is_permanent() && Instant::now() < deadline && !shutdown.is_cancelled())
    .notify(|e, wait| tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "Redis {what} failed; waiting for Redis"))
    .await
    .map_err(|e| ItemError::transient(e.to_string()))
}

/// Work this worker did for each job and has not counted in Redis yet: rows
/// it ran through the model (tallied at the model gate) and items it
/// started without the start script (which counts its own), sent with the
/// job's next commit (or [`ItemContext::flush_work`]).
#[derive(Debug, Default)]
pub struct WorkTally {
    work: Mutex<HashMap<String, Work>>,
}

impl WorkTally {
    /// Adds `work` to `job`'s tally.
    pub fn add(&self, job: &str, work: Work) {
        let mut tally = self.work.lock().unwrap_or_else(|p| p.into_inner());
        match tally.get_mut(job) {
            Some(w) => {
                w.rows += work.rows;
                w.deliveries += work.deliveries;
            }
            None => {
                tally.insert(job.to_owned(), work);
            }
        }
    }

    /// Adds `rows` model rows to `job`'s tally.
    pub fn add_rows(&self, job: &str, rows: u64) {
        self.add(
            job,
            Work {
                deliveries: 0,
                rows,
            },
        );
    }

    /// Counts an item of `job` started without the start script.
    pub fn add_delivery(&self, job: &str) {
        self.add(
            job,
            Work {
                deliveries: 1,
                rows: 0,
            },
        );
    }

    /// Takes `job`'s tally (nothing if none), leaving none.
    pub fn take(&self, job: &str) -> Work {
        let mut tally = self.work.lock().unwrap_or_else(|p| p.into_inner());
        tally.remove(job).unwrap_or_default()
    }
}

/// What a worker's item handlers share.
pub struct ItemContext {
    /// The job store.
    pub store: Store,
    /// Publishes retries, hand-backs and dead letters (confirmed); replaced
    /// on reconnect.
    broker: Mutex<Arc<dyn Broker>>,
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
    /// What every message must pass.
    pub guard: Guard,
    /// Jobs left to other workers for now.
    pub bench: Bench,
    /// The jobs' tasks fetched so far (version 3 messages name them).
    pub tasks: crate::item::task::Tasks,
    /// The jobs' facts read so far (a first delivery is checked against them).
    pub facts: Arc<crate::item::facts::Facts>,
    /// Model rows per job not yet counted in Redis.
    pub work: Arc<WorkTally>,
    /// The jobs this worker holds leased items of, beaten while it holds them.
    pub beats: Arc<crate::item::lease::Beats>,
    /// Commits finished items, together when they finish together.
    pub committer: crate::item::group::Committer,
    /// Makes the part files written side by side durable with one sync.
    pub data_sync: Arc<batchfleet_shared::shared_sync::SharedSync>,
    /// The disk-full pause.
    pub pause: Pause,
    /// This worker's wall clock.
    pub clock: Clock,
    /// Testing aids.
    pub debug: DebugHooks,
    /// Items handled to the end; at `max_items` (above 0) the worker
    /// recycles itself (`--max-items`).
    served: std::sync::atomic::AtomicU64,
    max_items: u64,
    /// Items run under its read side; an item workers died holding before
    /// (a suspect) under its write side, alone: should it kill this worker
    /// too, no other item's crash count goes up with it.
    pub alone: tokio::sync::RwLock<()>,
    runner: Mutex<RunnerSlot>,
    make_runner: MakeRunner,
    abandoned: AtomicUsize,
    /// The (job, model digest) pairs whose model was loaded ahead, newest last.
    ahead: Mutex<std::collections::VecDeque<(String, String)>>,
}

/// Jobs remembered as loaded ahead ([`ItemContext::load_ahead`]).
const AHEAD_KEPT: usize = 64;

impl std::fmt::Debug for ItemContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ItemContext")
            .field("worker_id", &self.worker_id)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

/// Makes a model runner (again after a hung one is abandoned).
pub type MakeRunner = Box<dyn Fn() -> std::io::Result<ModelRunner> + Send + Sync>;

/// What [`ItemContext::predict`] came back with.
#[derive(Debug)]
pub enum Predicted {
    /// The batch and the model's answer.
    Done(Box<Batch>, Result<Predictions, ItemError>),
    /// The call ran past its time; the runner was replaced.
    TimedOut,
    /// Shutdown came before the item's turn.
    Shutdown,
    /// The item waited too long for its first turn: hand it to another worker.
    WaitedTooLong,
    /// The item was committed elsewhere (a faster copy) while it waited
    /// for its first turn.
    DoneElsewhere,
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

/// Everything [`ItemContext::new`] needs.
pub struct Parts {
    /// The job store.
    pub store: Store,
    /// The current broker handle.
    pub broker: Arc<dyn Broker>,
    /// The pool's queues.
    pub queues: PoolQueues,
    /// This worker's id.
    pub worker_id: String,
    /// Cancelled on shutdown.
    pub shutdown: CancellationToken,
    /// Timing.
    pub tuning: Tuning,
    /// Makes a model runner (again after a hung one is abandoned).
    pub make_runner: MakeRunner,
    /// Signing key, caps and data roots.
    pub guard: Guard,
    /// The worker's wall clock.
    pub clock: Clock,
    /// Testing aids.
    pub debug: DebugHooks,
    /// `--max-items` (0 = never recycle for items handled).
    pub max_items: u64,
    /// `--sync-each-file`: no filesystem sync shared by part files.
    pub sync_each_file: bool,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts")
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

impl ItemContext {
    /// A context; starts the first model runner.
    pub fn new(parts: Parts) -> std::io::Result<Self> {
        let runner = (parts.make_runner)()?;
        let pause = Pause::new(parts.tuning.pause_max);
        let work = Arc::new(WorkTally::default());
        // Commits and syncs wait this long at most for a bundle's items.
        let linger = crate::item::group::linger(parts.tuning.heartbeat);
        let committer = crate::item::group::Committer::start(crate::item::group::Setup {
            store: parts.store.clone(),
            work: work.clone(),
            patience: parts.tuning.store_patience,
            shutdown: parts.shutdown.clone(),
            linger,
        });
        // A bundle's items reach their part files moments apart: the first
        // waits for the others (as their commits do), and one sync makes
        // all their bytes durable.
        let data_sync = Arc::new(if parts.sync_each_file {
            batchfleet_shared::shared_sync::SharedSync::each_file()
        } else {
            batchfleet_shared::shared_sync::SharedSync::new(linger)
        });
        let facts = Arc::<crate::item::facts::Facts>::default();
        let beats = crate::item::lease::Beats::start(
            &parts.worker_id,
            parts.store.clone(),
            parts.tuning.heartbeat,
            parts.tuning.lease_ttl,
            facts.clone(),
        );
        Ok(Self {
            store: parts.store,
            broker: Mutex::new(parts.broker),
            tuning: parts.tuning,
            queues: parts.queues,
            worker_id: parts.worker_id,
            shutdown: parts.shutdown,
            stop: CancellationToken::new(),
            stop_reason: Mutex::new(None),
            guard: parts.guard,
            bench: Bench::default(),
            tasks: Default::default(),
            facts,
            work,
            beats,
            committer,
            data_sync,
            pause,
            clock: parts.clock,
            debug: parts.debug,
            served: std::sync::atomic::AtomicU64::new(0),
            max_items: parts.max_items,
            alone: tokio::sync::RwLock::new(()),
            runner: Mutex::new(RunnerSlot::new(runner)),
            make_runner: parts.make_runner,
            abandoned: AtomicUsize::new(0),
            ahead: Mutex::default(),
        })
    }

    /// The current broker handle.
    pub fn broker(&self) -> Arc<dyn Broker> {
        self.broker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Publishes one message to `queue` and waits for the broker's confirm.
    /// With a signing key, the message's settling headers (attempt,
    /// unknown-job grace) are sealed as they are now.
    pub async fn publish(&self, queue: &str, mut msg: Outgoing) -> Result<(), BrokerError> {
        msg.headers.seal_settling(self.guard.key.as_ref());
        self.broker().publish(queue, vec![msg], 1).await.map(|_| ())
    }

    /// Publishes an item of `job` back to be worked: to the job's own queue,
    /// or — when it has none (a job published before job queues, or one
    /// that ended meanwhile) — to the pool's work queue.
    pub async fn publish_item(&self, job: &str, msg: Outgoing) -> Result<(), BrokerError> {
        match self.publish(&self.queues.job(job), msg.clone()).await {
            Err(BrokerError::NotConfirmed { .. }) => self.publish(&self.queues.work(), msg).await,
            other => other,
        }
    }

    /// Swaps in the handle of a new broker connection.
    pub fn set_broker(&self, broker: Arc<dyn Broker>) {
        *self.broker.lock().unwrap_or_else(|p| p.into_inner()) = broker;
    }

    /// Starts loading `item`'s model in the background the first time this
    /// worker sees its job (and model), so the load overlaps the item's
    /// read instead of following it. A load that fails here is left to
    /// the item's own model call, which loads again and reports it.
    pub fn load_ahead(self: &Arc<Self>, item: &WorkItem) {
        let (job, sha) = (&item.job_id, &item.task.model.sha256);
        {
            let mut ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
            if ahead.iter().any(|(j, s)| j == job && s == sha) {
                return;
            }
            if ahead.len() >= AHEAD_KEPT {
                ahead.pop_front();
            }
            ahead.push_back((job.clone(), sha.clone()));
        }
        let (ctx, model) = (self.clone(), item.task.model.clone());
        tokio::spawn(async move {
            if let Err(e) = ctx.preload(&model).await {
                tracing::debug!(error = %e, "loading the model ahead failed; the item's own call will load it");
            }
        });
    }

    /// Loads a model on the current runner before any item needs it.
    pub async fn preload(
        &self,
        model: &batchfleet_shared::message::ModelRef,
    ) -> Result<(), ItemError> {
        self.slot().runner.load(model).await
    }

    /// Runs a Redis operation, retrying with capped exponential backoff while
    /// Redis is unreachable, up to `store_patience` (or shutdown).
    pub async fn patient<T, F, Fut>(&self, what: &str, op: F) -> Result<T, ItemError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        patiently(self.tuning.store_patience, &self.shutdown, what, op).await
    }

    fn slot(&self) -> RunnerSlot {
        self.runner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs the model on rows `rows` of a batch within what is left of the
    /// item's model-time `budget`, and takes the time the call took from it
    /// (waiting for a turn, or between segments, does not count). The
    /// lease learns when the item reached the model, and ends a wait for a
    /// first turn that took too long.
    pub async fn predict(
        &self,
        item: &WorkItem,
        attempt: u32,
        batch: Batch,
        rows: std::ops::Range<usize>,
        budget: &mut Duration,
        signals: &Signals,
    ) -> Predicted {
        let (at_model, give_up) = (&signals.at_model, &signals.waited_too_long);
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
                _ = give_up.cancelled(), if !at_model.load(Ordering::SeqCst) => return Predicted::WaitedTooLong,
                // Committed elsewhere while it waited for its first turn
                // (with no segments of its own to clear): not computed at all.
                _ = signals.done_elsewhere.cancelled(), if !at_model.load(Ordering::SeqCst) && signals.rows_resumed.load(Ordering::Relaxed) == 0 => return Predicted::DoneElsewhere,
            };
            let Ok(_turn) = turn else {
                continue; // that runner was replaced while we waited; take the new one
            };
            signals.reached_model();
            // Tallied as it goes in (rows a timeout throws away count too) and
            // sent with this worker's next commit of the job, or when an item
            // ends otherwise: never a Redis round trip under the gate.
            self.work.add_rows(&item.job_id, rows.len() as u64);
            self.debug.abort_at_model(item.seq, attempt);
            let call = slot.runner.predict_rows(
                &item.task.model,
                item.task.shadow.as_ref().map(|s| &s.model),
                batch.take().expect("batch is sent once"),
                rows,
                crate::runner::BatchSize::of(&item.task),
                &item.task.failure,
                self.debug.panic_on_runner(item.seq, attempt),
            );
            let started = Instant::now();
            return match tokio::time::timeout(*budget, call).await {
                Ok((batch, result)) => {
                    *budget = budget.saturating_sub(started.elapsed());
                    if slot.runner.is_closed() {
                        // The runner thread is gone (it never should be: it
                        // contains its panics); start another for the next items.
                        self.replace_runner(&slot, false);
                    }
                    Predicted::Done(Box::new(batch), result)
                }
                Err(_) => {
                    self.replace_runner(&slot, true);
                    Predicted::TimedOut
                }
            };
        }
    }

    /// Sends the job's tallied work that no commit took (an item that
    /// failed, lost to a faster copy or was handed back). Best effort: the
    /// counters measure work done, wasted work included; they decide nothing.
    pub async fn flush_work(&self, job: &str) {
        let work = self.work.take(job);
        if work.is_empty() {
            return;
        }
        if let Err(e) = self.store.count_work(job, work.deliveries, work.rows).await {
            tracing::debug!(error = %e, "could not count work");
        }
    }

    /// Counts an item handled to the end; past `--max-items`, stops
    /// consuming for a fresh process to take over (recycling).
    pub fn served(&self) {
        let n = self.served.fetch_add(1, Ordering::SeqCst) + 1;
        if self.max_items > 0 && n == self.max_items {
            tracing::info!(
                items = n,
                "handled --max-items items; draining for a fresh process to take over"
            );
            self.stop_with(StopReason::Restart(format!(
                "recycling after {n} items (--max-items)"
            )));
        }
    }

    /// Stops consuming on its own, for `reason`.
    pub fn stop_with(&self, reason: StopReason) {
        self.stop_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(reason);
        self.stop.cancel();
    }

    /// Replaces `old` (a runner in a hung `forward` when `hung`, or a dead
    /// one) with a fresh runner.
    fn replace_runner(&self, old: &RunnerSlot, hung: bool) {
        {
            let mut current = self.runner.lock().unwrap_or_else(|p| p.into_inner());
            if !Arc::ptr_eq(&current.gate, &old.gate) {
                return; // already replaced
            }
            match (self.make_runner)() {
                Ok(fresh) => *current = RunnerSlot::new(fresh),
                Err(e) => self.stop_with(StopReason::Restart(format!(
                    "cannot start a new model runner: {e}"
                ))),
            }
        }
        old.gate.close();
        if !hung {
            tracing::warn!("the model runner thread stopped; a fresh one takes over");
            return;
        }
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
