//! Settling a delivery: every way an item leaves a worker — acknowledged,
//! returned, handed back, retried later, dead-lettered or rejected — and
//! the failure classes that choose between them (see [`settle_error`]).
//!
//! Publishes that settle an item (retry, dead letter, hand-back) are
//! confirmed by the broker *before* the original is acknowledged, so an item
//! is never lost between two queues; a publish that fails returns the item
//! to the queue instead.

use super::held::Held;
use crate::context::ItemContext;
use crate::error::{FailureClass, ItemError};
use batchfleet_shared::broker::{Headers, Outgoing};
use batchfleet_shared::message::{
    Envelope, ItemRef, WorkItem, ATTEMPT_HEADER, CLASS_HEADER, DEAD_AT_HEADER, ERROR_HEADER,
    ITEM_HEADER, JOB_HEADER, MESSAGE_TYPE_V3, PUBLISHED_HEADER, WORKER_HEADER,
};
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::{ItemFailure, UnableNote};
use std::time::Duration;

pub use batchfleet_shared::message::UNKNOWN_SINCE_HEADER;

/// What settling a message needs to know of it: whose item it is, and how
/// to seal it anew once its delivery was acknowledged early. A whole item,
/// or — before its job's task is fetched — a version 3 reference.
pub trait Carried: Sync {
    /// The job.
    fn job_id(&self) -> &str;
    /// The item number.
    fn seq(&self) -> u32;
    /// The item sealed anew at `attempt`.
    fn seal(&self, attempt: u32, ctx: &ItemContext) -> Outgoing;
}

impl Carried for WorkItem {
    fn job_id(&self) -> &str {
        &self.job_id
    }
    fn seq(&self) -> u32 {
        self.seq
    }
    fn seal(&self, attempt: u32, ctx: &ItemContext) -> Outgoing {
        Outgoing::work_item(self, attempt, ctx.guard.key.as_ref())
    }
}

impl Carried for ItemRef {
    fn job_id(&self) -> &str {
        &self.job_id
    }
    fn seq(&self) -> u32 {
        self.seq
    }
    fn seal(&self, attempt: u32, ctx: &ItemContext) -> Outgoing {
        Outgoing::item_ref(self, attempt, ctx.guard.key.as_ref())
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
    /// The job failed (error budget, or nobody can run it) or the item failed
    /// for good already; acked without work.
    Skipped,
    /// Returned to the queue (shutdown), with its checkpoints kept.
    Released,
    /// Handed back untouched for another worker (this one cannot run the
    /// job now, its disk is full, or it waited too long for the model).
    HandedBack,
    /// Re-published for a later attempt.
    Retried,
    /// Dead-lettered as a failed item.
    DeadLettered,
    /// A bad message, dead-lettered as `rejected` without touching any item.
    Rejected,
}

/// The delivery's own headers with `strings` and `ints` set: a re-published
/// copy keeps everything it came with (the signature among them).
fn headers_from<'a>(
    held: &Held,
    strings: impl IntoIterator<Item = (&'a str, String)>,
    ints: impl IntoIterator<Item = (&'a str, i64)>,
) -> Headers {
    let mut t = held.own_headers();
    t.set(strings, ints);
    t
}

/// The AMQP `type` of a body carried on as it came: its version's (a body
/// that does not decode — a rejected one — is labelled as what is published).
fn kind_of(body: &[u8]) -> &'static str {
    Envelope::decode(body).map_or(MESSAGE_TYPE_V3, |e| e.kind())
}

/// The message that carries `item` on: the delivery itself (body and
/// headers), or — once it was acknowledged early and is gone — the item
/// encoded anew at `attempt`.
fn carried(held: &Held, item: &dyn Carried, attempt: u32, ctx: &ItemContext) -> Outgoing {
    if held.is_settled() {
        return item.seal(attempt, ctx);
    }
    Outgoing {
        message_id: format!("{}/{}", item.job_id(), item.seq()),
        kind: kind_of(&held.delivery.body),
        body: held.delivery.body.clone(),
        headers: held.own_headers(),
        expiration_ms: None,
    }
}

/// Publishes `msg` to `queue` (confirmed) and only then acks the delivery.
/// If the publish fails the item goes back to the queue instead: `Err` with
/// that outcome and whether the lease must be kept.
async fn publish_then_ack(
    held: &Held,
    item: &WorkItem,
    attempt: u32,
    queue: &str,
    msg: Outgoing,
    ctx: &ItemContext,
) -> Result<(), (Handled, bool)> {
    match ctx.publish(queue, msg).await {
        Ok(()) => {
            held.ack().await;
            Ok(())
        }
        Err(err) => {
            tracing::warn!(error = %err, "could not publish the item on; returning it to the queue");
            let returned = give_back(held, item, attempt, ctx).await;
            Err((Handled::Released, !returned))
        }
    }
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

/// Settles a failed item by its class (who is at fault). Returns the
/// outcome and whether the lease must be kept (the item could not be handed on).
pub async fn settle_error(
    held: &Held,
    item: &WorkItem,
    attempt: u32,
    e: ItemError,
    ctx: &ItemContext,
) -> (Handled, bool) {
    let labels = [
        (batchfleet_shared::metrics::JOB_LABEL, item.job_id.clone()),
        ("class", e.class.to_string()),
    ];
    metrics::counter!(names::WORKER_ITEMS_FAILED, &labels).increment(1);
    match e.class {
        FailureClass::Unrunnable => fail_job(held, item, attempt, &e, ctx).await,
        FailureClass::Unable => {
            let until = ctx
                .bench
                .add(&item.job_id, &e.message, ctx.tuning.unable_for);
            tracing::warn!(error = %e.message, for_s = ctx.tuning.unable_for.as_secs(), "this worker cannot run the job; handing the item back and leaving the job to other workers");
            note_unable(ctx, item, "unable", &e.message, until).await;
            hand_back(
                held,
                item,
                attempt,
                Some(ctx.tuning.hand_back_delay),
                &[],
                "unable",
                ctx,
            )
            .await
        }
        FailureClass::DiskFull => {
            let pause = ctx.pause.trigger(&e.message);
            tracing::warn!(error = %e.message, pause_s = pause.as_secs_f64(), "output disk full: handing the item back and pausing");
            note_unable(ctx, item, "disk_full", &e.message, pause).await;
            hand_back(held, item, attempt, None, &[], "disk_full", ctx).await
        }
        FailureClass::Rejected => (
            reject(held, Some(item), &e.message, "invalid", ctx).await,
            false,
        ),
        c if c.retryable() && attempt < item.task.failure.max_attempts => {
            retry(held, item, attempt, &e, ctx).await
        }
        _ => dead_letter(held, item, &e, attempt, ctx).await,
    }
}

/// Shows in Redis (for `batchfleet status` and the coordinator) that this
/// worker leaves the job's items to others until `for_how_long` from now.
async fn note_unable(
    ctx: &ItemContext,
    item: &WorkItem,
    class: &str,
    reason: &str,
    for_how_long: Duration,
) {
    let now = match ctx.store.now_ms().await {
        Ok(now) => now,
        Err(e) => {
            tracing::warn!(error = %e, "could not note in Redis that this worker cannot take the job now");
            return;
        }
    };
    let since = ctx
        .store
        .unable(&item.job_id)
        .await
        .ok()
        .and_then(|m| m.get(&ctx.worker_id).map(|n| n.since_ms))
        .unwrap_or(now);
    let note = UnableNote {
        class: class.to_owned(),
        reason: truncate(reason, 2000),
        since_ms: since,
        until_ms: now + for_how_long.as_millis() as u64,
    };
    if let Err(e) = ctx
        .store
        .note_unable(&item.job_id, &ctx.worker_id, &note)
        .await
    {
        tracing::warn!(error = %e, "could not note in Redis that this worker cannot take the job now");
    }
}

/// Nobody can run the job: fail it at once with the reason (the first
/// worker to find out says why), then skip the item.
async fn fail_job(
    held: &Held,
    item: &WorkItem,
    attempt: u32,
    e: &ItemError,
    ctx: &ItemContext,
) -> (Handled, bool) {
    let reason = truncate(&e.message, 4000);
    match ctx
        .patient("fail job", || {
            ctx.store.fail_job(&item.job_id, "unrunnable", &reason)
        })
        .await
    {
        Ok(true) => {
            tracing::error!(error = %e.message, "nobody can run this job: failed it; its items are skipped")
        }
        Ok(false) => tracing::info!("the job is failed or finished already; skipping the item"),
        Err(err) => {
            tracing::warn!(error = %err.message, "could not fail the job in Redis; returning the item");
            let returned = give_back(held, item, attempt, ctx).await;
            return (Handled::Released, !returned);
        }
    }
    held.ack().await;
    (Handled::Skipped, false)
}

/// Returns an item to the work queue: a nack, or — once acknowledged early —
/// a confirmed publish of a copy. `false` if neither worked.
pub async fn give_back(held: &Held, item: &dyn Carried, attempt: u32, ctx: &ItemContext) -> bool {
    if held.requeue("released").await {
        return true;
    }
    let msg = item.seal(attempt, ctx);
    match ctx.publish_item(item.job_id(), msg).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not hand the item back; its lease will go stale and the coordinator will publish it again");
            false
        }
    }
}

/// Hands an item back untouched for another worker, without spending an
/// attempt or the broker's delivery count: a confirmed publish of the same
/// message (after `delay`, through a retry tier, or at once to the job's
/// queue), then the ack. Returns the outcome and whether the lease must be kept.
pub async fn hand_back(
    held: &Held,
    item: &dyn Carried,
    attempt: u32,
    delay: Option<Duration>,
    extra: &[(&str, i64)],
    class: &'static str,
    ctx: &ItemContext,
) -> (Handled, bool) {
    let mut msg = carried(held, item, attempt, ctx);
    msg.headers.set([], extra.iter().copied());
    let published = match delay {
        Some(d) => {
            let ms = d.as_millis().max(1) as u64;
            msg.expiration_ms = Some(ms);
            ctx.publish(&ctx.queues.retry_for(ms), msg).await
        }
        None => ctx.publish_item(item.job_id(), msg).await,
    };
    if let Err(err) = published {
        tracing::warn!(error = %err, "could not publish the item on; returning it to the queue");
        let returned = give_back(held, item, attempt, ctx).await;
        return (Handled::Released, !returned);
    }
    held.ack().await;
    metrics::counter!(names::WORKER_ITEMS_HANDED_BACK, "class" => class).increment(1);
    (Handled::HandedBack, false)
}

/// Re-publishes the item to a retry tier for attempt `attempt + 1`, then
/// acks. Returns the outcome and whether the lease must be kept.
pub async fn retry(
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
    let mut msg = carried(held, item, next, ctx);
    msg.headers.set(
        [
            (CLASS_HEADER, e.class.to_string()),
            (ERROR_HEADER, truncate(&e.message, 2000)),
        ],
        [
            (ATTEMPT_HEADER, i64::from(next)),
            // The retry delay is not queue wait: it counts from when the item is due.
            (PUBLISHED_HEADER, (ctx.clock.now_ms() + delay) as i64),
        ],
    );
    msg.expiration_ms = Some(delay);
    if let Err(returned) = publish_then_ack(held, item, attempt, &queue, msg, ctx).await {
        return returned;
    }
    metrics::counter!(names::WORKER_ITEMS_RETRIED, batchfleet_shared::metrics::JOB_LABEL => item.job_id.clone(), "class" => e.class.to_string()).increment(1);
    (Handled::Retried, false)
}

/// Publishes the message to the dead queue with `headers`, then acks.
/// `false` (and the message returned or kept) if the publish failed.
async fn publish_dead(
    held: &Held,
    message_id: String,
    headers: Headers,
    ctx: &ItemContext,
) -> bool {
    let msg = Outgoing {
        message_id,
        kind: kind_of(&held.delivery.body),
        body: held.delivery.body.clone(),
        headers,
        expiration_ms: None,
    };
    match ctx.publish(&ctx.queues.dead(), msg).await {
        Ok(()) => true,
        Err(err) => {
            tracing::warn!(error = %err, "could not dead-letter the message; returning it to the queue");
            false
        }
    }
}

/// Publishes the item to the dead queue with why, records the failure, then
/// acks. Returns the outcome and whether the lease must be kept.
pub async fn dead_letter(
    held: &Held,
    item: &WorkItem,
    e: &ItemError,
    attempt: u32,
    ctx: &ItemContext,
) -> (Handled, bool) {
    let class = e.class.to_string();
    tracing::error!(error = %e.message, class = %class, attempt, "dead-lettering the item");
    let now = ctx.clock.now_ms();
    let headers = headers_from(
        held,
        [
            (JOB_HEADER, item.job_id.clone()),
            (CLASS_HEADER, class.clone()),
            (ERROR_HEADER, truncate(&e.message, 8000)),
            (WORKER_HEADER, ctx.worker_id.clone()),
        ],
        [
            (ATTEMPT_HEADER, i64::from(attempt)),
            (ITEM_HEADER, i64::from(item.seq)),
            (DEAD_AT_HEADER, now as i64),
        ],
    );
    if !publish_dead(held, format!("{}/{}", item.job_id, item.seq), headers, ctx).await {
        let returned = give_back(held, item, attempt, ctx).await;
        return (Handled::Released, !returned);
    }
    let failure = ItemFailure {
        seq: item.seq,
        class: class.clone(),
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
    held.ack().await;
    metrics::counter!(names::WORKER_ITEMS_DEAD_LETTERED, batchfleet_shared::metrics::JOB_LABEL => item.job_id.clone(), "class" => class)
        .increment(1);
    (Handled::DeadLettered, false)
}

/// Dead-letters a bad message as `rejected` with `reason`, touching no item
/// state in Redis and reading no file: a forged copy of a real item must not
/// fail the real one. `claimed` is what it decoded to, if anything (its job
/// and item go in the headers, for `dlq list`). `label` names the kind of
/// refusal in metrics (bounded: `signature`, `undecodable`, `limits`, …).
pub async fn reject(
    held: &Held,
    claimed: Option<&dyn Carried>,
    reason: &str,
    label: &'static str,
    ctx: &ItemContext,
) -> Handled {
    tracing::warn!(
        reason,
        "rejecting a bad message: dead-lettered, nothing read or recorded"
    );
    metrics::counter!(names::WORKER_MESSAGES_REJECTED, "reason" => label).increment(1);
    let (job, seq) = claimed.map_or((String::new(), -1), |i| {
        (i.job_id().to_owned(), i64::from(i.seq()))
    });
    let headers = headers_from(
        held,
        [
            (JOB_HEADER, job.clone()),
            (CLASS_HEADER, FailureClass::Rejected.to_string()),
            (ERROR_HEADER, truncate(reason, 8000)),
            (WORKER_HEADER, ctx.worker_id.clone()),
        ],
        [
            (ATTEMPT_HEADER, i64::from(held.attempt())),
            (ITEM_HEADER, seq),
            (DEAD_AT_HEADER, ctx.clock.now_ms() as i64),
        ],
    );
    let id = claimed.map_or_else(
        || "rejected".to_owned(),
        |i| format!("{}/{}", i.job_id(), i.seq()),
    );
    if publish_dead(held, id, headers, ctx).await {
        held.ack().await;
        Handled::Rejected
    } else {
        held.requeue("dead-letter publish failed").await;
        Handled::Released
    }
}
