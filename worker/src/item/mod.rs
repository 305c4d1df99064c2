//! What happens to one delivery, from admission to commit: the consume
//! loop's unit of work.
//!
//! admit (signature, decode, the job's task, caps, paths) → start (job record checks, lease;
//! for a first delivery, against the job's facts read moments ago, the lease only at the first heartbeat)
//! → read → predict → publish the part file → write the rejects file →
//! mark done in Redis → ack. The ack comes last, so a worker that dies at any
//! point leaves the item to be redelivered, and the done set plus
//! first-writer-wins files make the redelivery harmless. Only the copy whose
//! part file won writes the rejects file and commits its stats; a copy that
//! lost acknowledges without either.
//!
//! Item handling runs under `catch_unwind`: a panic settles the item (class
//! `panic`: retried, then dead-lettered) and releases its lease, and the
//! worker carries on. A failure is settled by its owner ([`crate::error`]):
//! see [`settle::settle_error`].
//!
//! # Layout
//! - this file: handle, start, process (look for a part, read, compute,
//!   publish) and commit.
//! - [`held`]: the delivery, acknowledged or returned once.
//! - [`admission`]: what a message must pass before anything is done for it.
//! - [`lease`]: the item's lease in Redis and its heartbeat.
//! - [`signals`]: what the handler, the heartbeat and the model calls share.
//! - [`call`]: one model call as the item sees it, and the item's tallies.
//! - [`checkpoint`]: a long item in segments, each published as it finishes.
//! - [`settle`]: every way a delivery is settled, chosen by who is at fault.
//! - [`group`]: group commit — the items that finish together, committed
//!   in one Redis call.
//! - [`task`]: a version 3 message's task, fetched once per job and kept.
//! - [`bundle`]: a bundle's members, each handled as a message of its own,
//!   the bundle acknowledged once all are settled.
//! - [`facts`]: the job record's fields a message is checked against,
//!   read once in a while per job: a first delivery starts without a
//!   Redis request.

pub(crate) mod admission;
mod bundle;
mod call;
mod checkpoint;
pub(crate) mod facts;
pub(crate) mod group;
mod held;
pub(crate) mod lease;
pub(crate) mod settle;
pub(crate) mod signals;
pub(crate) mod task;

pub(crate) use settle::Handled;

use crate::context::ItemContext;
use crate::error::{blocking, blocking_within, FailureClass, ItemError};
use crate::{reader, writer};
use batchfleet_shared::broker::Delivery;
use batchfleet_shared::fsutil::{NameSync, Publish};
use batchfleet_shared::message::{Opened, WorkItem, COPY_HEADER, PUBLISHED_HEADER};
use batchfleet_shared::metrics::names;
use batchfleet_shared::shadow::ShadowStats;
use batchfleet_shared::shared_sync::{Coming, SharedSync};
use batchfleet_shared::store::{Claim, ItemStats, Start, VectorStats};
use futures_lite::FutureExt;
use held::Held;
use lease::{lease_for, LeaseEnd, LeaseGuard};
use settle::{give_back, hand_back, reject, settle_error, Carried, UNKNOWN_SINCE_HEADER};
use signals::Signals;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

/// Handles one delivery to the end (ack, nack or re-publish). `permit` is
/// the worker's in-flight slot, held until the item is settled.
pub async fn handle(
    delivery: Delivery,
    ctx: Arc<ItemContext>,
    permit: OwnedSemaphorePermit,
) -> Handled {
    metrics::counter!(names::WORKER_MESSAGES).increment(1);
    let held = Arc::new(Held::new(delivery, ctx.guard.key.as_ref()));
    match open(&held, &ctx).await {
        Ok(Opened::Bundle(b)) => {
            let _permit = permit;
            bundle::handle(held, b, ctx).await
        }
        Ok(opened) => one(held, opened, ctx, permit).await,
        Err(settled) => settled,
    }
}

tokio::task_local! {
    /// The part file write of the bundle item this task handles, on its way
    /// to the sync it shares with the bundle's other items.
    static COMING: std::cell::Cell<Option<Coming>>;
}

/// Runs `handling` (one bundle item's) with its part file write expected
/// by the shared sync: taken by the write, or dropped when it ends.
async fn writing<F: std::future::Future>(coming: Coming, handling: F) -> F::Output {
    COMING
        .scope(std::cell::Cell::new(Some(coming)), handling)
        .await
}

/// Handles one member of a bundle, delivered as a version 3 message of its
/// own (see [`bundle`]).
async fn member(
    delivery: Delivery,
    ctx: Arc<ItemContext>,
    permit: OwnedSemaphorePermit,
) -> Handled {
    let held = Arc::new(Held::new(delivery, ctx.guard.key.as_ref()));
    match open(&held, &ctx).await {
        Ok(Opened::Bundle(_)) => {
            reject(&held, None, "a bundle inside a bundle", "bundle", &ctx).await
        }
        Ok(opened) => one(held, opened, ctx, permit).await,
        Err(settled) => settled,
    }
}

/// Opens a delivery (signature, decoding), or settles it: returned when
/// the worker is stopping, rejected when it is not a message to trust.
async fn open(held: &Arc<Held>, ctx: &Arc<ItemContext>) -> Result<Opened, Handled> {
    if ctx.shutdown.is_cancelled() || ctx.stop.is_cancelled() {
        held.requeue("stopping before start").await;
        return Err(Handled::Released);
    }
    match admission::open(&held.delivery.body, held.headers(), &ctx.guard) {
        Ok(opened) => Ok(opened),
        Err(refusal) => Err(reject(held, None, &refusal.reason, refusal.label, ctx).await),
    }
}

/// Handles one item's message (versions 1 to 3) to the end.
async fn one(
    held: Arc<Held>,
    opened: Opened,
    ctx: Arc<ItemContext>,
    permit: OwnedSemaphorePermit,
) -> Handled {
    let _permit = permit;
    let opened = match opened {
        Opened::Whole(item) => Ok(item),
        Opened::Ref(r) => Err(r),
        Opened::Bundle(_) => {
            return reject(
                &held,
                None,
                "a bundle where one item was expected",
                "bundle",
                &ctx,
            )
            .await
        }
    };
    metrics::gauge!(names::WORKER_ITEMS_IN_FLIGHT).increment(1.0);
    let _in_flight = scopeguard(|| metrics::gauge!(names::WORKER_ITEMS_IN_FLIGHT).decrement(1.0));
    if let Some(published) = held.headers().int(PUBLISHED_HEADER) {
        let waited = ctx.clock.now_ms().saturating_sub(published.max(0) as u64);
        metrics::histogram!(names::WORKER_QUEUE_WAIT).record(waited as f64 / 1000.0);
    }
    let attempt = held.attempt();
    let whole = match opened {
        Ok(item) => item,
        // Version 3: the task is fetched (once per job) and checked.
        Err(r) => match task::resolve(&held, r, attempt, &ctx).await {
            Ok(item) => item,
            Err(settled) => return settled,
        },
    };
    let item = match admission::check(whole, &ctx.guard) {
        Ok(item) => item,
        Err(refusal) => {
            let claimed = refusal.claimed.as_deref().map(|i| i as &dyn Carried);
            return reject(&held, claimed, &refusal.reason, refusal.label, &ctx).await;
        }
    };
    // The first item of a job here: its model loads while the item is read.
    ctx.load_ahead(&item);
    let span = tracing::info_span!("item", job = %item.job_id, item = item.seq, attempt);
    let work = async {
        if let Some((_, why)) = ctx.pause.until() {
            // Sent before the worker stopped consuming for a full disk.
            tracing::debug!(reason = %why, "paused (output disk full); handing the item back");
            return hand_back(&held, &item, attempt, None, &[], "disk_full", &ctx)
                .await
                .0;
        }
        if let Some((why, left)) = ctx.bench.reason(&item.job_id) {
            // Back when this worker tries the job again: an able worker
            // takes it from the queue meanwhile, and a fleet of unable ones
            // does not spin it.
            tracing::debug!(reason = %why, "this worker leaves the job to others for now; handing the item back");
            let delay = Some(left.max(ctx.tuning.hand_back_delay));
            return hand_back(&held, &item, attempt, delay, &[], "unable", &ctx)
                .await
                .0;
        }
        let (guard, crashes) = match start(&held, &item, attempt, &ctx).await {
            Ok(started) => started,
            Err(settled) => return settled,
        };
        // A suspect runs alone: should it kill this worker too, its crash
        // is the only one counted.
        let turn = if crashes > 0 {
            tracing::warn!(
                crashes,
                "workers died holding this item before; running it alone"
            );
            Turn::Alone(ctx.alone.write().await)
        } else {
            Turn::Shared(ctx.alone.read().await)
        };
        // A panic anywhere in the item's handling settles the item like a
        // failure of its own; the worker goes on with the others.
        let result = AssertUnwindSafe(process(&item, attempt, &guard.signals, &ctx))
            .catch_unwind()
            .await
            .unwrap_or_else(|payload| {
                metrics::counter!(names::WORKER_PANICS, "where" => "item").increment(1);
                Err(ItemError::panic(format!(
                    "the worker panicked handling the item: {}",
                    crate::error::panic_message(payload.as_ref())
                )))
            });
        let (outcome, keep_lease) = match result {
            Ok(Handled::Released) => {
                let returned = give_back(&held, &item, attempt, &ctx).await;
                (Handled::Released, !returned)
            }
            Ok(Handled::HandedBack) => {
                hand_back(&held, &item, attempt, None, &[], "waiting", &ctx).await
            }
            Ok(outcome) => {
                held.ack().await;
                (outcome, false)
            }
            Err(e) => settle_error(&held, &item, attempt, e, &ctx).await,
        };
        drop(turn);
        if outcome == Handled::Committed {
            ctx.pause.reset();
        } else {
            // Model rows no commit carried (a failure, a faster copy).
            ctx.flush_work(&item.job_id).await;
        }
        // A commit dropped the lease itself, if it was written by then.
        let committed =
            outcome == Handled::Committed && guard.signals.lease_committed.load(Ordering::SeqCst);
        guard
            .finish(if keep_lease {
                LeaseEnd::LeftToGoStale
            } else if committed {
                LeaseEnd::Dropped
            } else {
                LeaseEnd::Drop
            })
            .await;
        outcome
    };
    let outcome = work.instrument(span).await;
    if !matches!(outcome, Handled::Released | Handled::HandedBack) {
        ctx.served();
    }
    outcome
}

/// An item's turn to run: beside others, or alone (a suspect).
enum Turn<'a> {
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'a, ()>),
    Alone(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'a, ()>),
}

/// Checks the message against the job record and starts the lease: the
/// lease to go on with and the item's crashes so far, or how the delivery
/// was settled here instead.
///
/// A broker redelivery while another worker's lease on the item is live
/// waits until that lease is settled or stale ([`Start::Held`], at most
/// four lease ttls): if that
/// worker died on the item, its crash is counted before the item runs
/// again, and once `max_crashes` workers died holding it the item is
/// dead-lettered, class `crash` ([`Start::Crashed`]), without running.
///
/// A first delivery (no earlier attempt, never returned by the broker, not
/// a coordinator's copy) of an item of a job whose facts, read moments ago,
/// say it runs and agree with the message starts at once: no Redis
/// request, no lease until it outlives a heartbeat, its delivery counted
/// with its commit. Such an item is neither done nor failed yet — every
/// other delivery (a redelivery after a worker died, a retry, a copy, a job
/// the facts do not admit) goes through the start script, one round trip
/// that checks the job record, the done and failed sets, and writes the
/// lease. (Should a first delivery be done after all — a copy stripped of
/// its header — its commit simply loses: first commit wins.)
async fn start(
    held: &Arc<Held>,
    item: &WorkItem,
    attempt: u32,
    ctx: &Arc<ItemContext>,
) -> Result<(LeaseGuard, u32), Handled> {
    let mut claim = Claim {
        pool: &ctx.queues.pool,
        model: &item.task.model.path,
        model_sha256: &item.task.model.sha256,
        output_dir: &item.task.output.dir,
        returned: held.delivery.is_redelivery(),
    };
    let first =
        attempt == 1 && !held.delivery.is_redelivery() && held.headers().int(COPY_HEADER).is_none();
    if first {
        if let Some(facts) = ctx.facts.get(&item.job_id, &ctx.store).await {
            if facts.admit(item.seq, &claim) {
                metrics::counter!(names::WORKER_ITEM_STARTS, "how" => "quick").increment(1);
                ctx.work.add_delivery(&item.job_id);
                return Ok((
                    LeaseGuard::lazy(item, attempt, held.clone(), ctx.clone()),
                    0,
                ));
            }
        }
    }
    metrics::counter!(names::WORKER_ITEM_STARTS, "how" => "checked").increment(1);
    let lease = lease_for(item, attempt, ctx, 0);
    let mut started = ctx
        .patient("start", || {
            ctx.store.start_item(&item.job_id, &lease, &claim)
        })
        .await;
    // Looking again every heartbeat: a dead holder's lease goes stale within
    // one lease ttl (and a copy started meanwhile, another's within the
    // next). A live holder settles the item (the start then finds it done)
    // or, past four lease ttls, the item runs here as well (the first
    // commit wins).
    let patience = Instant::now() + (ctx.tuning.lease_ttl + ctx.tuning.heartbeat) * 4;
    while let Ok(Start::Held { wait_ms }) = started {
        let left = patience.saturating_duration_since(Instant::now());
        let wait = Duration::from_millis(wait_ms)
            .min(ctx.tuning.heartbeat)
            .min(left);
        tracing::debug!(wait_ms = wait.as_millis() as u64, "returned by the broker while another worker's lease on it is live; waiting for that lease to settle or go stale");
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = ctx.shutdown.cancelled() => {
                held.requeue("shutdown while waiting on another worker's lease").await;
                return Err(Handled::Released);
            }
        }
        claim.returned = Instant::now() < patience;
        started = ctx
            .patient("start", || {
                ctx.store.start_item(&item.job_id, &lease, &claim)
            })
            .await;
    }
    let settled = Err;
    match started {
        Ok(Start::Started { at_ms, crashes }) => Ok((
            LeaseGuard::new(item, attempt, at_ms, held.clone(), ctx.clone()),
            crashes,
        )),
        Ok(Start::Held { .. }) => unreachable!("a start that was not returned never waits"),
        Ok(Start::Crashed { crashes, workers }) => {
            let e = ItemError::new(
                FailureClass::Crash,
                format!(
                    "{crashes} workers died holding the item ([failure] max_crashes; the last: {}): it kills the process that runs it — out of memory, a fault in the model or its libraries; dead-lettered so the job goes on",
                    if workers.is_empty() { "counted by the coordinator".to_owned() } else { workers.join(", ") }
                ),
            );
            settled(settle_error(held, item, attempt, e, ctx).await.0)
        }
        Ok(Start::Done) => {
            tracing::info!("already committed; acknowledging without recompute");
            held.ack().await;
            settled(Handled::AlreadyDone)
        }
        Ok(Start::FailedForGood) => {
            tracing::info!(
                "already dead-lettered (this is a stale copy); acknowledging without work"
            );
            held.ack().await;
            settled(Handled::Skipped)
        }
        Ok(Start::JobFailed) => {
            tracing::info!("the job failed; skipping the item");
            held.ack().await;
            settled(Handled::Skipped)
        }
        Ok(Start::UnknownJob) => settled(unknown_job(held, item, attempt, ctx).await),
        Ok(Start::NotRunning(status)) => settled(
            reject(
                held,
                Some(item),
                &format!(
                    "job {} is {status}: none of its items can be outstanding",
                    item.job_id
                ),
                "not_running",
                ctx,
            )
            .await,
        ),
        Ok(Start::Mismatch { field, recorded }) => settled(
            reject(
                held,
                Some(item),
                &mismatch_reason(item, &ctx.queues.pool, &field, &recorded),
                "mismatch",
                ctx,
            )
            .await,
        ),
        Err(e) => settled(settle_error(held, item, attempt, e, ctx).await.0),
    }
}

/// Why a message that disagrees with its job record is refused.
fn mismatch_reason(item: &WorkItem, pool: &str, field: &str, recorded: &str) -> String {
    let claimed = match field {
        "pool" => format!("was consumed from pool {pool}"),
        "model" => format!("names model {}", item.task.model.path),
        "model_sha256" => format!("names model digest {}", item.task.model.sha256),
        "output_dir" => format!("names output folder {}", item.task.output.dir),
        "items_total" => format!("is item {}", item.seq),
        other => format!("disagrees on {other}"),
    };
    let recorded = if field == "items_total" {
        format!("the job has {recorded} items")
    } else {
        format!("the job record says {field} = {recorded}")
    };
    format!(
        "the message for job {} {claimed} but {recorded}; it is not a work item of this job",
        item.job_id
    )
}

/// An item of a job Redis does not know. Redis may have lost its data (a
/// restart without persistence) and the coordinator not restored the job
/// yet, so the item is handed back for a while; past the grace it is rejected.
async fn unknown_job(held: &Held, item: &dyn Carried, attempt: u32, ctx: &ItemContext) -> Handled {
    let now = ctx.clock.now_ms();
    let since = held.unknown_since().map_or(now, |s| s.max(0) as u64);
    let waited = Duration::from_millis(now.saturating_sub(since));
    if waited >= ctx.tuning.unknown_job_grace {
        let reason = format!(
            "no job {} in Redis for {}s (unknown, deleted, or its state was lost and not restored; run its manifest again to restore it)",
            item.job_id(),
            waited.as_secs()
        );
        return reject(held, Some(item), &reason, "unknown_job", ctx).await;
    }
    tracing::warn!(
        waited_s = waited.as_secs(),
        "no such job in Redis (yet?); handing the item back for now"
    );
    let delay = (ctx.tuning.unknown_job_grace - waited).min(Duration::from_secs(5));
    hand_back(
        held,
        item,
        attempt,
        Some(delay),
        &[(UNKNOWN_SINCE_HEADER, since as i64)],
        "unknown_job",
        ctx,
    )
    .await
    .0
}

/// How the item's output is to be published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publishing {
    /// No part file yet: ours may win.
    Fresh,
    /// A part file was there when the item started but its rejects did not
    /// add up (its writer died between the two): recompute, and if the part
    /// holds our rows, finish that commit with our rejects.
    Completing,
}

async fn process(
    item: &WorkItem,
    attempt: u32,
    signals: &Signals,
    ctx: &ItemContext,
) -> Result<Handled, ItemError> {
    if ctx.debug.panic_in_item(item.seq, attempt) {
        panic!("injected panic in item handling (--debug-panic)");
    }
    let out = PathBuf::from(&item.task.output.dir);
    let part = PathBuf::from(item.task.output.part_name(item.seq));
    let rejects_rel = batchfleet_shared::output::rejects_rel(item.seq);
    let mut stats = ItemStats {
        seq: item.seq,
        rows: 0,
        rows_rejected: 0,
        worker: ctx.worker_id.clone(),
        started_ms: ctx.clock.now_ms(),
        finished_ms: 0,
        attempt,
        recovered: false,
        rows_resumed: 0,
        vector: None,
        shadow: None,
    };
    // item_timeout bounds the item's read, its model time (not its waits
    // for a turn at the model) and its write, each.
    let item_timeout = Duration::from_millis(item.task.failure.item_timeout_ms);
    // One trip to the blocking pool: look for the part file and, unless a
    // previous delivery's part can be committed as it is, read the item.
    let looked = {
        let (o, p, spec, seq) = (
            out.clone(),
            part.clone(),
            item.task.output.clone(),
            item.seq,
        );
        let item_rows = batchfleet_shared::split::ItemRows::of(item);
        let (slice, versions, layout, text, on_bad_row, type_ids) = (
            item.input.clone(),
            item.versions.clone(),
            item.task.layout.clone(),
            item.task.text.clone(),
            item.task.failure.on_bad_row,
            item.task.model.wants_type_ids(),
        );
        let span = tracing::Span::current();
        blocking_within(item_timeout, "read", move || {
            let _in_item = span.enter();
            look_and_read(&o, &p, &spec, seq, &item_rows, || {
                let started = Instant::now();
                let batch =
                    reader::read_unchanged(&slice, &versions, &layout, text.as_ref(), on_bad_row)
                        .and_then(|mut b| {
                            if let Some(t) = &text {
                                crate::reader::text::tokenize(&mut b, t, type_ids)?;
                            }
                            Ok(b)
                        });
                metrics::histogram!(names::WORKER_READ).record(started.elapsed().as_secs_f64());
                batch
            })
        })
        .await??
    };
    let (batch, publishing, existing_rows) = match looked {
        Looked::Recovered {
            rows,
            rejected,
            hist,
            vector,
        } => {
            (stats.rows, stats.rows_rejected, stats.recovered) = (rows, rejected, true);
            stats.vector = vector;
            stats.shadow = call::shadow_missed(item, rows);
            return commit(item, stats, &hist, None, signals, ctx).await;
        }
        Looked::Read {
            batch,
            existing_rows: None,
        } => (*batch, Publishing::Fresh, 0),
        Looked::Read {
            batch,
            existing_rows: Some(rows),
        } => (*batch, Publishing::Completing, rows),
    };
    let computed = compute(item, attempt, batch, signals, ctx, &out).await?;
    let Computed {
        rows,
        rejects,
        hist,
        vector,
        shadow,
        resumed,
        source,
        partial,
    } = match computed {
        Ok(c) => c,
        Err(early) => return Ok(early),
    };
    stats.rows = rows;
    stats.vector = vector;
    stats.shadow = shadow;
    stats.rows_rejected = rejects.len() as u64;
    stats.rows_resumed = resumed;
    ctx.debug.check_disk(&out.join(&part))?;
    let write_started = Instant::now();
    let (o, p, r, rows_now) = (out.clone(), part.clone(), rejects_rel.clone(), stats.rows);
    let data_sync = ctx.data_sync.clone();
    // A bundle item's write, expected by the shared sync: given up once
    // this write has asked for its sync (or failed before).
    let coming = COMING.try_with(std::cell::Cell::take).ok().flatten();
    let (won_part, completed) = blocking_within(item_timeout, "write", move || {
        if !rejects.is_empty() {
            writer::rejects_folder_usable(&o)?;
        }
        let publish = || source.publish(&o, &p, &data_sync);
        let published = match &coming {
            Some(c) => c.during(publish),
            None => publish(),
        };
        drop(coming);
        let published = published?;
        let won = match (published, publishing) {
            (Publish::Committed, _) => true,
            (Publish::AlreadyExists, Publishing::Completing) => {
                if existing_rows != rows_now {
                    return Err(ItemError::poison(format!(
                        "{} holds {existing_rows} rows but the item predicts {rows_now}; the output folder was changed — remove the part file to recompute the item",
                        o.join(&p).display()
                    )));
                }
                true
            }
            (Publish::AlreadyExists, Publishing::Fresh) => false,
        };
        // Only the copy whose part counts writes the item's rejects.
        if won {
            writer::write_rejects(&o, &r, &rejects)?;
        }
        Ok((won, published == Publish::AlreadyExists))
    })
    .await??;
    metrics::histogram!(names::WORKER_WRITE).record(write_started.elapsed().as_secs_f64());
    // Completing the commit of a part another delivery published.
    stats.recovered = completed && won_part;
    if !won_part {
        // Another copy's part won while this one computed: its rejects and
        // stats are the ones that count (it commits them, or its redelivery does).
        tracing::info!("another copy published the item first; discarding this one");
        if let Some(dir) = partial {
            let _ = blocking(move || checkpoint::remove(&out, &dir)).await;
        }
        return Ok(Handled::AlreadyDone);
    }
    let partial = partial.map(|dir| (out, dir));
    commit(item, stats, &hist, partial, signals, ctx).await
}

/// What [`look_and_read`] found.
enum Looked {
    /// A previous delivery's part file and rejects are complete: commit them.
    Recovered {
        rows: u64,
        rejected: u64,
        hist: Vec<Vec<u64>>,
        vector: Option<VectorStats>,
    },
    /// The item's rows, to compute; `existing_rows`: a previous delivery's
    /// part file is there with this many rows but its rejects do not add up.
    Read {
        batch: Box<crate::batch::Batch>,
        existing_rows: Option<u64>,
    },
}

/// Looks for the item's part file `part` under `out` and, unless a previous
/// delivery's part and rejects add up to the item's rows (then they are
/// committed as they are), reads the item with `read`. Blocking.
fn look_and_read(
    out: &Path,
    part: &Path,
    spec: &batchfleet_shared::message::OutputSpec,
    seq: u32,
    item_rows: &batchfleet_shared::split::ItemRows,
    read: impl FnOnce() -> Result<crate::batch::Batch, ItemError>,
) -> Result<Looked, ItemError> {
    let shown = || out.join(part).display().to_string();
    let exists = batchfleet_shared::fsutil::exists_under(out, part)
        .map_err(|e| ItemError::output_io(format!("cannot look for {}", shown()), &e))?;
    if !exists {
        return Ok(Looked::Read {
            batch: Box::new(read()?),
            existing_rows: None,
        });
    }
    // A previous delivery published the part and died before marking it done.
    let found = (|| {
        let tally = batchfleet_shared::output::histogram_under(out, part, spec)?;
        let rejected = batchfleet_shared::output::count_rejects_under(out, seq)?;
        Ok::<_, std::io::Error>((tally, rejected))
    })();
    let (tally, rejected) =
        found.map_err(|e| ItemError::output_io(format!("cannot read {}", shown()), &e))?;
    let (rows, hist, vector) = (tally.rows, tally.counts, tally.vector);
    // A range cut blind is read to count its rows; if it cannot be, the item
    // is computed again.
    let expected = item_rows.get().ok();
    if Some(rows + rejected) == expected {
        return Ok(Looked::Recovered {
            rows,
            rejected,
            hist,
            vector,
        });
    }
    tracing::warn!(rows, rejected, item_rows = ?expected, "the part file is there but its rejects do not add up (its writer died between the two); recomputing the item to complete it");
    Ok(Looked::Read {
        batch: Box::new(read()?),
        existing_rows: Some(rows),
    })
}

/// Makes the part file's name durable and marks the item done in Redis
/// (first commit wins), both with the group it finishes with; then removes
/// its checkpoint folder, if any.
async fn commit(
    item: &WorkItem,
    mut stats: ItemStats,
    hist: &[Vec<u64>],
    partial: Option<(PathBuf, PathBuf)>,
    signals: &Signals,
    ctx: &ItemContext,
) -> Result<Handled, ItemError> {
    stats.finished_ms = ctx.clock.now_ms();
    // From here the heartbeat writes no lease; one it was writing as this
    // began is dropped when the item is finished (`LeaseGuard::finish`),
    // unless the item is done by then: the lease script writes none for a
    // done item.
    signals.committing.store(true, Ordering::SeqCst);
    let leased = signals.leased.load(Ordering::SeqCst);
    signals.lease_committed.store(leased, Ordering::SeqCst);
    // With the others that finish meanwhile, and the job's model rows
    // tallied since this worker last counted them. The part file's name
    // was published unsynced: its folder is fsynced once for the group,
    // before the commit.
    let part = Path::new(&item.task.output.dir).join(item.task.output.part_name(item.seq));
    let folder = part.parent().map(Path::to_path_buf);
    let won = ctx
        .committer
        .commit(&item.job_id, stats.clone(), hist.to_vec(), folder, leased)
        .await
        .inspect_err(|_| signals.committing.store(false, Ordering::SeqCst))?;
    if let Some((out, dir)) = partial {
        // The segments are in the part file now.
        let _ = blocking(move || checkpoint::remove(&out, &dir)).await;
    }
    if won {
        let labels = [
            (batchfleet_shared::metrics::JOB_LABEL, item.job_id.clone()),
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

/// What an item's computation left to publish.
struct Computed {
    /// Rows predicted.
    rows: u64,
    /// Rows rejected (parse and model), in line order.
    rejects: Vec<crate::batch::Reject>,
    /// Histogram of the predictions.
    hist: Vec<Vec<u64>>,
    /// Norms of the vectors written (`[output] vector`).
    vector: Option<VectorStats>,
    /// What the shadow model did beside the job's (`[model.shadow]`).
    shadow: Option<ShadowStats>,
    /// Rows a checkpoint held.
    resumed: u64,
    /// How the part file is made.
    source: PartSource,
    /// The checkpoint folder to remove after the commit (relative).
    partial: Option<PathBuf>,
}

/// The part file to publish: predictions in memory, or checkpoint segments to join.
enum PartSource {
    Rows(
        Box<(
            crate::batch::Batch,
            crate::runner::Predictions,
            batchfleet_shared::message::OutputSpec,
        )>,
    ),
    Segments(batchfleet_shared::message::OutputFormat, Vec<PathBuf>),
}

impl PartSource {
    /// Publishes the part file, its bytes made durable by a sync shared
    /// with the part files written beside it, its name by the group commit.
    fn publish(self, out: &Path, part: &Path, shared: &SharedSync) -> Result<Publish, ItemError> {
        let sync = NameSync::Shared(shared);
        match self {
            PartSource::Rows(b) => {
                let (batch, preds, spec) = *b;
                let rows = 0..batch.rows();
                writer::write_part_rows(out, part, &spec, &batch, rows, &preds, sync)
            }
            PartSource::Segments(format, files) => {
                writer::concat_parts(out, part, format, &files, sync)
            }
        }
    }
}

/// Predicts the item's rows: one model call, or segments with
/// checkpoints when the item is longer than `checkpoint_rows`.
/// `Ok(Err(outcome))` when it ended early (shutdown, a faster copy, a wait
/// for the model that took too long).
async fn compute(
    item: &WorkItem,
    attempt: u32,
    mut batch: crate::batch::Batch,
    signals: &Signals,
    ctx: &ItemContext,
    out: &Path,
) -> Result<Result<Computed, Handled>, ItemError> {
    // The item's model time, spent by its calls.
    let mut budget = Duration::from_millis(item.task.failure.item_timeout_ms);
    let seg = item.task.checkpoint_rows as usize;
    let mut rejects = std::mem::take(&mut batch.rejects);
    let rows = batch.rows();
    let mut computed = if seg == 0 || rows <= seg {
        let called = call::model(ctx, item, attempt, batch, 0..rows, &mut budget, signals).await?;
        let (batch, preds) = match called {
            Ok(done) => done,
            Err(early) => return Ok(Err(early)),
        };
        rejects.extend(
            preds
                .failed
                .iter()
                .map(|(i, msg)| batch.model_reject(*i, msg)),
        );
        let mut hist = Vec::new();
        // Failed rows are NaN, which no bin counts.
        let vector = call::tally(&mut hist, item, &preds);
        let shadow = call::shadow(item, &preds);
        Computed {
            rows: (rows - preds.failed.len()) as u64,
            rejects,
            hist,
            vector,
            shadow,
            resumed: 0,
            source: PartSource::Rows(Box::new((batch, preds, item.task.output.clone()))),
            partial: None,
        }
    } else {
        let segmented =
            checkpoint::segments(item, attempt, batch, signals, ctx, out, &mut budget).await?;
        let done = match segmented {
            Ok(done) => done,
            Err(early) => return Ok(Err(early)),
        };
        rejects.extend(done.rejects);
        Computed {
            rows: (rows - done.failed) as u64,
            rejects,
            hist: done.hist,
            vector: done.vector,
            shadow: done.shadow,
            resumed: done.resumed,
            source: PartSource::Segments(item.task.output.format, done.files),
            partial: Some(done.dir),
        }
    };
    computed.rejects.sort_by_key(|r| r.line);
    call::log_rejects(&computed.rejects);
    Ok(Ok(computed))
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

/// The `model` label: the model file's name (bounded: one per job).
fn model_label(model: &batchfleet_shared::message::ModelRef) -> String {
    Path::new(&model.path)
        .file_name()
        .map_or_else(|| model.path.clone(), |n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_names_what_the_message_and_the_record_say() {
        let item = batchfleet_coordinator::planner::sample_item("j-00000000", 7);
        let r = mismatch_reason(&item, "gpu", "model_sha256", &"ab".repeat(32));
        assert!(
            r.contains(&"00".repeat(32)) && r.contains(&"ab".repeat(32)),
            "{r}"
        );
        let r = mismatch_reason(&item, "gpu", "items_total", "5");
        assert!(
            r.contains("is item 7") && r.contains("the job has 5 items"),
            "{r}"
        );
    }
}
