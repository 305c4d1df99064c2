//! Items the broker dead-lettered itself. A message that comes back more
//! than `x-delivery-limit` times without being settled (its workers keep
//! dying on it: an abort, an OOM kill) is dead-lettered by RabbitMQ, and a
//! copy reaches `bf.<pool>.infra` (see `batchfleet_shared::broker`; the
//! in-process queues of `--local` do the same). Workers
//! consume that queue and record each such item as failed for good, class
//! `infra`, so it counts against the error budget and the job settles
//! instead of waiting for an item that will never come back.
//!
//! The copy is checked like any message (signature, decoding, the job record)
//! before anything is recorded: a forged one fails no real item.

use crate::context::ItemContext;
use crate::item::admission;
use crate::item::task::{self, Missing};
use batchfleet_shared::broker::Delivery;
use batchfleet_shared::message::{Opened, TaskSpec};
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::ItemFailure;
use std::sync::Arc;

/// Returns the copy for a later try (Redis is down), after a pause so that
/// an outage does not spin.
async fn later(delivery: &Delivery) {
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let _ = delivery.requeue().await;
}

/// Records the item of a broker dead letter as failed (class `infra`) —
/// each of its items, for a bundle — then acks.
pub async fn record(delivery: Delivery, ctx: Arc<ItemContext>) {
    let opened = match admission::open(&delivery.body, &delivery.headers, &ctx.guard) {
        Ok(opened) => opened,
        Err(refusal) => {
            ignore(&refusal.reason);
            let _ = delivery.ack().await;
            return;
        }
    };
    let items = match opened {
        Opened::Bundle(b) => match b.check() {
            Ok(()) => b.members().map(Opened::Ref).collect(),
            Err(why) => {
                ignore(&why);
                let _ = delivery.ack().await;
                return;
            }
        },
        one => vec![one],
    };
    for opened in items {
        if record_one(opened, &delivery, &ctx).await == Recorded::Later {
            // What was recorded already is recorded again, to the same effect.
            later(&delivery).await;
            return;
        }
    }
    let _ = delivery.ack().await;
}

fn ignore(reason: &str) {
    tracing::warn!(
        reason,
        "ignoring a broker dead letter that is not a valid work item (it stays in the dead queue)"
    );
}

/// Whether an item of a broker dead letter was dealt with.
#[derive(Debug, PartialEq, Eq)]
enum Recorded {
    /// Recorded failed, or nothing to record.
    Done,
    /// Redis could not be read or written: the dead letter is tried later.
    Later,
}

/// Records one item of a broker dead letter as failed, when it is an item
/// of a running job that agrees with its record.
async fn record_one(opened: Opened, delivery: &Delivery, ctx: &ItemContext) -> Recorded {
    let headers = &delivery.headers;
    let whole = match opened {
        Opened::Whole(item) => item,
        Opened::Ref(r) => match task::fetch(&r, ctx).await {
            Ok(t) => r.with_task(TaskSpec::clone(&t)),
            Err(Missing::Store(e)) => {
                tracing::warn!(error = %e, "cannot read the task of a broker dead letter; trying again later");
                return Recorded::Later;
            }
            Err(Missing::Refused(why)) => {
                ignore(&why);
                return Recorded::Done;
            }
            Err(Missing::UnknownJob) => {
                tracing::warn!(job = %r.job_id, item = r.seq, "a broker dead letter of no running job; nothing recorded");
                return Recorded::Done;
            }
        },
        Opened::Bundle(_) => {
            ignore("a bundle inside a bundle");
            return Recorded::Done;
        }
    };
    let item = match admission::check(whole, &ctx.guard) {
        Ok(item) => item,
        Err(refusal) => {
            ignore(&refusal.reason);
            return Recorded::Done;
        }
    };
    let job = match ctx.store.job(&item.job_id).await {
        Ok(job) => job,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the job of a broker dead letter; trying again later");
            return Recorded::Later;
        }
    };
    let belongs = job.as_ref().is_some_and(|j| {
        j.pool == ctx.queues.pool
            && j.model == item.task.model.path
            && j.model_sha256 == item.task.model.sha256
            && j.output_dir == item.task.output.dir
            && u64::from(item.seq) < j.items_total
    });
    if !belongs {
        tracing::warn!(job = %item.job_id, item = item.seq, "a broker dead letter of no running job (or disagreeing with its record); nothing recorded");
        return Recorded::Done;
    }
    let deliveries = delivery.delivery_count();
    let failure = ItemFailure {
        seq: item.seq,
        class: "infra".into(),
        reason: format!(
            "dead-lettered by the broker after {deliveries} deliveries without a result: workers crashed or were killed while processing it"
        ),
        worker: String::new(),
        attempt: headers
            .int(batchfleet_shared::message::ATTEMPT_HEADER)
            .unwrap_or(1)
            .clamp(1, i64::from(u32::MAX)) as u32,
        at_ms: ctx.clock.now_ms(),
    };
    match ctx.store.fail_item(&item.job_id, &failure).await {
        Ok(recorded) => {
            if recorded {
                tracing::error!(job = %item.job_id, item = item.seq, deliveries, "the broker dead-lettered the item (its workers kept dying on it); recorded it failed");
                metrics::counter!(names::WORKER_BROKER_DEAD_LETTERS, batchfleet_shared::metrics::JOB_LABEL => item.job_id.clone())
                    .increment(1);
            }
            Recorded::Done
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot record a broker dead letter; trying again later");
            Recorded::Later
        }
    }
}
