//! The consume loop's unit of work: what happens to one delivery.
//!
//! decode → skip if done (or the job failed) → read → predict → publish the
//! rejects and part files → mark done in Redis → ack. The ack comes last, so a
//! worker that dies at any point leaves the item to be redelivered, and the
//! done set plus first-writer-wins files make the redelivery harmless.
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
use batchfleet_shared::message::{
    Envelope, WorkItem, ATTEMPT_HEADER, CLASS_HEADER, DEAD_AT_HEADER, ERROR_HEADER, ITEM_HEADER,
    JOB_HEADER, MESSAGE_TYPE_V1, WORKER_HEADER,
};
use batchfleet_shared::store::{ItemFailure, ItemStats, JobStatus, Store};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
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

/// What a worker's item handlers share.
pub struct ItemContext {
    /// Redis.
    pub store: Store,
    /// Publishes retries and dead letters (confirm mode).
    pub publisher: ConfirmedPublisher,
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
        make_runner: Box<dyn Fn() -> std::io::Result<ModelRunner> + Send + Sync>,
    ) -> std::io::Result<Self> {
        let runner = make_runner()?;
        Ok(Self {
            store,
            publisher,
            queues,
            worker_id,
            shutdown,
            stop: CancellationToken::new(),
            stop_reason: Mutex::new(None),
            runner: Mutex::new(RunnerSlot::new(runner)),
            make_runner,
            abandoned: AtomicUsize::new(0),
        })
    }

    fn slot(&self) -> RunnerSlot {
        self.runner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs the model on a batch within `timeout` of model time (waiting for
    /// a turn does not count). `None` on timeout; the runner is then replaced.
    async fn predict(
        &self,
        item: &WorkItem,
        batch: reader::Batch,
        timeout: Duration,
    ) -> Option<(reader::Batch, Result<crate::runner::Predictions, ItemError>)> {
        let mut batch = Some(batch);
        loop {
            let slot = self.slot();
            let Ok(_turn) = slot.gate.clone().acquire_owned().await else {
                continue; // that runner was replaced while we waited; take the new one
            };
            let call = slot.runner.predict(
                &item.task.model,
                batch.take().expect("batch is sent once"),
                item.task.batch_size as usize,
                &item.task.failure,
            );
            return match tokio::time::timeout(timeout, call).await {
                Ok(out) => Some(out),
                Err(_) => {
                    self.replace_runner(&slot);
                    None
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
    /// Already done (by an earlier delivery); acked without recompute.
    AlreadyDone,
    /// The job failed (error budget); acked without work.
    Skipped,
    /// Returned to the queue unprocessed (shutdown).
    Released,
    /// Re-published for a later attempt.
    Retried,
    /// Dead-lettered.
    DeadLettered,
    /// Returned to the queue, and the worker stops.
    Fatal,
}

/// Handles one delivery to the end (ack or nack).
pub async fn handle(delivery: Delivery, ctx: Arc<ItemContext>) -> Handled {
    let attempt = int_header(delivery.properties.headers().as_ref(), ATTEMPT_HEADER)
        .unwrap_or(1)
        .max(1) as u32;
    if ctx.shutdown.is_cancelled() || ctx.stop.is_cancelled() {
        requeue(&delivery, "stopping before start").await;
        return Handled::Released;
    }
    let item = match Envelope::decode(&delivery.data) {
        Ok(env) => env.into_item(),
        Err(e) => {
            tracing::error!(error = %e, "dead-lettering an undecodable message");
            return dead_letter(
                &delivery,
                None,
                &ItemError::poison(e.to_string()),
                attempt,
                &ctx,
            )
            .await;
        }
    };
    let span = tracing::info_span!("item", job = %item.job_id, item = item.seq, attempt);
    async {
        match process(&item, attempt, &ctx).await {
            Ok(outcome) => {
                ack(&delivery).await;
                outcome
            }
            Err(e) if e.class == FailureClass::Fatal => {
                tracing::error!(error = %e.message, "fatal: this worker cannot process items; returning the item and stopping");
                requeue(&delivery, "fatal").await;
                ctx.stop_with(StopReason::Fatal(e.message));
                Handled::Fatal
            }
            Err(e) if e.class.retryable() && attempt < item.task.failure.max_attempts => retry(&delivery, &item, attempt, &e, &ctx).await,
            Err(e) => dead_letter(&delivery, Some(&item), &e, attempt, &ctx).await,
        }
    }
    .instrument(span)
    .await
}

async fn process(item: &WorkItem, attempt: u32, ctx: &ItemContext) -> Result<Handled, ItemError> {
    let store_err = |e: batchfleet_shared::store::StoreError| ItemError::transient(e.to_string());
    let (done, status) = ctx
        .store
        .item_gate(&item.job_id, item.seq)
        .await
        .map_err(store_err)?;
    if done {
        tracing::info!("already committed; acknowledging without recompute");
        return Ok(Handled::AlreadyDone);
    }
    if status == Some(JobStatus::Failed) {
        tracing::info!("job failed (error budget exceeded); skipping the item");
        return Ok(Handled::Skipped);
    }
    let out = Path::new(&item.task.output.dir);
    let dest = out.join(item.task.output.part_name(item.seq));
    let rejects_dest = out
        .join(writer::REJECTS_DIR)
        .join(format!("part-{:06}.jsonl", item.seq));
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
    };
    if dest.exists() {
        // A previous delivery published the files and died before marking it done.
        let (d, r) = (dest.clone(), rejects_dest.clone());
        let (rows, rejected) = blocking(move || {
            Ok::<_, std::io::Error>((writer::count_rows(&d)?, writer::count_rejects(&r)?))
        })
        .await?
        .map_err(|e| ItemError::transient(format!("cannot read {}: {e}", dest.display())))?;
        if rows + rejected != item.input.rows() {
            return Err(ItemError::poison(format!(
                "{} holds {rows} rows and {rejected} rejects but the item has {}; remove them to recompute the item",
                dest.display(),
                item.input.rows()
            )));
        }
        (stats.rows, stats.rows_rejected, stats.recovered) = (rows, rejected, true);
    } else {
        let (slice, layout, on_bad_row) =
            (item.input.clone(), item.task.csv.clone(), policy.on_bad_row);
        let batch = blocking(move || reader::read(&slice, &layout, on_bad_row)).await??;
        let timeout = Duration::from_millis(policy.item_timeout_ms);
        let Some((mut batch, predictions)) = ctx.predict(item, batch, timeout).await else {
            return Err(ItemError::timeout(format!(
                "the model call did not finish within item_timeout ({}s)",
                timeout.as_secs_f64()
            )));
        };
        let predictions = predictions?;
        let mut rejects = std::mem::take(&mut batch.rejects);
        rejects.extend(
            predictions
                .failed
                .iter()
                .map(|(i, msg)| batch.model_reject(*i, msg)),
        );
        rejects.sort_by_key(|r| r.line);
        stats.rows = (batch.rows() - predictions.failed.len()) as u64;
        stats.rows_rejected = rejects.len() as u64;
        if !rejects.is_empty() {
            tracing::warn!(rejected = rejects.len(), first = %rejects[0].reason, "rows rejected");
        }
        let tag = format!("{}-{}", ctx.worker_id, attempt);
        let published = blocking(move || {
            // The part file is the commit point; the rejects file goes first
            // and reflects this attempt (a stale one from a crashed attempt
            // with another model is replaced or removed).
            writer::write_rejects(&rejects_dest, &tag, &rejects)?;
            writer::write_csv(&dest, &tag, &batch, &predictions)
        })
        .await??;
        stats.recovered = published == Publish::AlreadyExists;
    }
    stats.finished_ms = batchfleet_shared::now_ms();
    let won = ctx
        .store
        .commit_item(&item.job_id, &stats)
        .await
        .map_err(store_err)?;
    tracing::info!(
        rows = stats.rows,
        rejected = stats.rows_rejected,
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

/// Re-publishes the item to a retry tier for attempt `attempt + 1`, then acks.
async fn retry(
    delivery: &Delivery,
    item: &WorkItem,
    attempt: u32,
    e: &ItemError,
    ctx: &ItemContext,
) -> Handled {
    let next = attempt + 1;
    let delay = item.task.failure.retry_delay_ms(next, fastrand::f64());
    let queue = ctx.queues.retry_for(delay);
    tracing::warn!(error = %e.message, class = %e.class, next_attempt = next, delay_ms = delay, "retrying later");
    let msg = Outgoing {
        message_id: format!("{}/{}", item.job_id, item.seq),
        kind: MESSAGE_TYPE_V1,
        body: delivery.data.clone(),
        headers: headers(
            [
                (CLASS_HEADER, e.class.to_string()),
                (ERROR_HEADER, truncate(&e.message, 2000)),
            ],
            [(ATTEMPT_HEADER, i64::from(next))],
        ),
        expiration_ms: Some(delay),
    };
    match ctx.publisher.publish_all(&queue, [msg], 1, |_| {}).await {
        Ok(_) => {
            ack(delivery).await;
            Handled::Retried
        }
        Err(err) => {
            tracing::warn!(error = %err, "could not schedule the retry; returning the item to the queue");
            requeue(delivery, "retry publish failed").await;
            Handled::Released
        }
    }
}

/// Publishes the item to the dead queue with why, records the failure, then acks.
async fn dead_letter(
    delivery: &Delivery,
    item: Option<&WorkItem>,
    e: &ItemError,
    attempt: u32,
    ctx: &ItemContext,
) -> Handled {
    let class = e.class.to_string();
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
        body: delivery.data.clone(),
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
        .publisher
        .publish_all(&ctx.queues.dead(), [msg], 1, |_| {})
        .await
    {
        tracing::warn!(error = %err, "could not dead-letter the item; returning it to the queue");
        requeue(delivery, "dead-letter publish failed").await;
        return Handled::Released;
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
        if let Err(err) = ctx.store.fail_item(&item.job_id, &failure).await {
            // The dead queue holds it either way; the coordinator will not
            // see the job settle until the failure is recorded (by a replay).
            tracing::warn!(error = %err, "could not record the failure in Redis");
        }
    }
    ack(delivery).await;
    Handled::DeadLettered
}

/// Acks. A failure here is only logged: the broker redelivers an unsettled
/// message when the channel closes, and the done set makes that cheap.
async fn ack(delivery: &Delivery) {
    if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
        tracing::warn!(error = %e, "could not ack; the broker will redeliver the item");
    }
}

async fn requeue(delivery: &Delivery, why: &str) {
    let opts = BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    };
    if let Err(e) = delivery.acker.nack(opts).await {
        tracing::warn!(error = %e, why, "could not return the item; the broker will redeliver it");
    }
}
