//! The consume loop and what happens to one delivery.
//!
//! For each delivery: decode → skip if already done → read → predict →
//! publish the part file → mark done in Redis → ack. The ack comes last, so a
//! worker that dies at any point leaves the item to be redelivered, and the
//! done set plus the first-writer-wins part file make the redelivery harmless.

use crate::error::{FailureClass, ItemError};
use crate::runner::ModelRunner;
use crate::{reader, writer};
use batchfleet_shared::broker::int_header;
use batchfleet_shared::fsutil::Publish;
use batchfleet_shared::message::{Envelope, WorkItem, ATTEMPT_HEADER};
use batchfleet_shared::store::{ItemFailure, ItemStats, Store};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use std::path::Path;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// What a worker's item handlers share.
#[derive(Debug)]
pub struct ItemContext {
    /// Redis.
    pub store: Store,
    /// The model thread.
    pub runner: ModelRunner,
    /// This worker's id.
    pub worker_id: String,
    /// Cancelled on shutdown: items not started yet go back to the queue.
    pub shutdown: CancellationToken,
    /// Cancelled when this worker hit a fatal error and must stop consuming.
    pub fatal: CancellationToken,
    /// The fatal error, for the exit message.
    pub fatal_reason: std::sync::Mutex<Option<String>>,
}

/// How an item ended on this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Predicted, written and committed here.
    Committed,
    /// Already done (by an earlier delivery); acked without recompute.
    AlreadyDone,
    /// Returned to the queue unprocessed (shutdown).
    Released,
    /// Failed; see the class.
    Failed(FailureClass),
}

/// Handles one delivery to the end (ack, nack or reject).
pub async fn handle(delivery: Delivery, ctx: Arc<ItemContext>) -> Handled {
    let attempt = int_header(delivery.properties.headers().as_ref(), ATTEMPT_HEADER)
        .unwrap_or(1)
        .max(1) as u32;
    if ctx.shutdown.is_cancelled() {
        settle(&delivery, Settle::Requeue, "shutdown before start").await;
        return Handled::Released;
    }
    let item = match Envelope::decode(&delivery.data) {
        Ok(env) => env.into_item(),
        Err(e) => {
            tracing::error!(error = %e, "dead-lettering an undecodable message");
            settle(&delivery, Settle::DeadLetter, "undecodable").await;
            return Handled::Failed(FailureClass::Poison);
        }
    };
    let span = tracing::info_span!("item", job = %item.job_id, item = item.seq, attempt);
    match process(&item, attempt, &ctx).instrument(span).await {
        Ok(outcome) => {
            settle(&delivery, Settle::Ack, "done").await;
            outcome
        }
        Err(e) => {
            match e.class {
                FailureClass::Transient => {
                    tracing::warn!(error = %e.message, "transient failure; returning the item to the queue");
                    settle(&delivery, Settle::Requeue, "transient").await;
                }
                FailureClass::Poison => {
                    tracing::error!(error = %e.message, "poison item; dead-lettering it");
                    // Recorded before the reject, so the coordinator can settle the
                    // job; if Redis is down the dead queue still holds the item.
                    let failure = ItemFailure {
                        seq: item.seq,
                        class: e.class.to_string(),
                        reason: e.message.clone(),
                        worker: ctx.worker_id.clone(),
                        attempt,
                        at_ms: batchfleet_shared::now_ms(),
                    };
                    if let Err(err) = ctx.store.fail_item(&item.job_id, &failure).await {
                        tracing::warn!(error = %err, "could not record the failure in Redis");
                    }
                    settle(&delivery, Settle::DeadLetter, "poison").await;
                }
                FailureClass::Fatal => {
                    tracing::error!(error = %e.message, "fatal: this worker cannot process items; returning the item and stopping");
                    settle(&delivery, Settle::Requeue, "fatal").await;
                    if let Ok(mut reason) = ctx.fatal_reason.lock() {
                        reason.get_or_insert(e.message.clone());
                    }
                    ctx.fatal.cancel();
                }
            }
            Handled::Failed(e.class)
        }
    }
}

async fn process(item: &WorkItem, attempt: u32, ctx: &ItemContext) -> Result<Handled, ItemError> {
    let store_err = |e: batchfleet_shared::store::StoreError| ItemError::transient(e.to_string());
    if ctx
        .store
        .is_done(&item.job_id, item.seq)
        .await
        .map_err(store_err)?
    {
        tracing::info!("already committed; acknowledging without recompute");
        return Ok(Handled::AlreadyDone);
    }
    let started_ms = batchfleet_shared::now_ms();
    let dest = Path::new(&item.task.output.dir).join(item.task.output.part_name(item.seq));
    let mut stats = ItemStats {
        seq: item.seq,
        rows: item.input.rows(),
        worker: ctx.worker_id.clone(),
        started_ms,
        finished_ms: 0,
        attempt,
        recovered: false,
    };
    if dest.exists() {
        // A previous delivery published the file and died before marking it done.
        let rows = count_part_rows(&dest).await?;
        if rows != item.input.rows() {
            return Err(ItemError::poison(format!(
                "{} holds {rows} rows but the item has {}; remove the file to recompute the item",
                dest.display(),
                item.input.rows()
            )));
        }
        stats.recovered = true;
    } else {
        let (slice, layout) = (item.input.clone(), item.task.csv.clone());
        let batch = tokio::task::spawn_blocking(move || reader::read(&slice, &layout))
            .await
            .map_err(|e| ItemError::transient(format!("reader task failed: {e}")))??;
        let (batch, predictions) = ctx
            .runner
            .predict(&item.task.model, batch, item.task.batch_size as usize)
            .await;
        let predictions = predictions?;
        let tag = format!("{}-{}", ctx.worker_id, attempt);
        let dest2 = dest.clone();
        let published = tokio::task::spawn_blocking(move || {
            writer::write_csv(&dest2, &tag, &batch, &predictions)
        })
        .await
        .map_err(|e| ItemError::transient(format!("writer task failed: {e}")))??;
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

async fn count_part_rows(path: &Path) -> Result<u64, ItemError> {
    let p = path.to_owned();
    tokio::task::spawn_blocking(move || writer::count_rows(&p))
        .await
        .map_err(|e| ItemError::transient(format!("reader task failed: {e}")))?
        .map_err(|e| ItemError::transient(format!("cannot read {}: {e}", path.display())))
}

enum Settle {
    Ack,
    Requeue,
    DeadLetter,
}

/// Acks, requeues or dead-letters a delivery. A failure here is only logged:
/// the broker redelivers an unsettled message when the channel closes, and the
/// done set makes that redelivery cheap.
async fn settle(delivery: &Delivery, how: Settle, why: &str) {
    let result = match how {
        Settle::Ack => delivery.acker.ack(BasicAckOptions::default()).await,
        Settle::Requeue => {
            delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await
        }
        // The work queue's dead-letter exchange routes it to the pool's dead queue.
        Settle::DeadLetter => {
            delivery
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await
        }
    };
    if let Err(e) = result {
        tracing::warn!(error = %e, why, "could not settle the delivery; the broker will redeliver it");
    }
}
