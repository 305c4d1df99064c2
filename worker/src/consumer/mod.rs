//! Where a worker's deliveries come from, and how many it takes at once:
//! the consume loop.
//!
//! # Layout
//! - this file: [`run`] — consume until shutdown, re-open the session when
//!   the broker is lost, then drain; one task per delivery, each holding an
//!   in-flight permit until its item is settled.
//! - [`session`]: one broker handle consuming the work and infra queues.
//! - [`sources`]: the pool's work queue and each active job's queue, and the
//!   weighted fair choice among them.
//! - [`prefetch`]: the prefetch sized from the measured per-item time, and
//!   the subscriptions re-made at a new size.
//! - [`pause`]: the disk-full pause.
//! - [`infra`]: items the broker dead-lettered itself, recorded as failed.

mod infra;
pub(crate) mod pause;
mod prefetch;
pub(crate) mod session;
mod sources;

use crate::config::WorkerConfig;
use crate::connect;
use crate::context::ItemContext;
use crate::item::{self, Handled};
use batchfleet_shared::backend::Backend;
use batchfleet_shared::broker::{Delivery, Notice};
use batchfleet_shared::metrics::names;
use prefetch::{resize, Prefetch, Sizing, PERIOD};
use session::Session;
pub use sources::DEFAULT_JOB_QUEUES;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Consumes until shutdown (or the worker stops on its own), re-opening
/// the session when the broker connection is lost, then drains. `Some(why)`
/// when the broker was lost and could not be reached again within
/// `--outage-timeout`.
pub(crate) async fn run(
    cfg: &WorkerConfig,
    backend: &Backend,
    mut session: Session,
    ctx: &Arc<ItemContext>,
    shutdown: &CancellationToken,
) -> Option<String> {
    // One permit per item in flight, held until the item is settled: an item
    // acknowledged early (a long one) still counts, so a worker never holds
    // more items than the prefetch in force, whatever the broker would send.
    let permits = Arc::new(Semaphore::new(usize::from(cfg.prefetch)));
    let tracker = TaskTracker::new();
    let mut sizing = Sizing {
        prefetch: Prefetch::new(cfg.prefetch, cfg.prefetch_max),
        next_review: Instant::now() + PERIOD,
        next_jobs: Instant::now(),
        next_follow: Instant::now(),
        jobs_every: cfg.debug_jobs_every,
        backlog: VecDeque::new(),
    };
    metrics::gauge!(names::WORKER_PREFETCH).set(f64::from(sizing.prefetch.current()));
    let lost = loop {
        tracing::info!(worker = %ctx.worker_id, broker = %session.broker.describe(), queue = %ctx.queues.work(), prefetch = session.prefetch, prefetch_max = cfg.prefetch_max.max(cfg.prefetch), threads = cfg.threads, "worker consuming");
        let lost = consume(&mut session, ctx, &permits, &tracker, shutdown, &mut sizing).await;
        let Some(why) = lost else { break None };
        if shutdown.is_cancelled() || ctx.stop.is_cancelled() {
            break None;
        }
        let why = backend.scrub(&why);
        tracing::warn!(error = %why, in_flight = tracker.len(), "lost the broker; reconnecting");
        // Deliveries of the lost connection can no longer be acknowledged.
        sizing.backlog.clear();
        let prefetch = session.prefetch;
        let reopen = connect::session(backend, cfg, &ctx.worker_id, &ctx.queues, prefetch);
        let reopened = tokio::select! {
            s = reopen => s,
            _ = shutdown.cancelled() => break None,
        };
        match reopened {
            Ok(fresh) => {
                metrics::counter!(names::WORKER_BROKER_RECONNECTS).increment(1);
                ctx.set_broker(fresh.broker.clone());
                session.broker.close("replaced").await;
                session = fresh;
                // Announcements made while it was away were not heard:
                // the pool's jobs are read now, and the jobs' facts again
                // at their next item (one may have ended meanwhile).
                sizing.next_jobs = Instant::now();
                ctx.facts.forget_all();
                tracing::info!("reconnected to the broker");
            }
            Err(e) => break Some(format!("{why}; reconnecting failed: {e:#}")),
        }
    };

    drain(cfg, session, sizing.backlog, tracker).await;
    lost
}

/// Drains: no new deliveries; items already started finish (or stop at a
/// checkpoint) within `--drain-timeout`; then the broker handle is closed,
/// which returns every unacknowledged delivery to its queue at once.
async fn drain(
    cfg: &WorkerConfig,
    mut session: Session,
    mut backlog: VecDeque<(Delivery, Instant)>,
    tracker: TaskTracker,
) {
    session.cancel_consumers().await;
    // Never started: back to the queue for another worker.
    let now = Instant::now();
    backlog.extend(session.work.waiting().into_iter().map(|d| (d, now)));
    for (delivery, _) in backlog.drain(..) {
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
}

/// Consumes the session's queues until shutdown, a stop, or a lost
/// connection (`Some(why)`). A work delivery is taken only with an
/// in-flight permit in hand; while the output disk is full the worker
/// stops consuming (see [`pause`]).
async fn consume(
    session: &mut Session,
    ctx: &Arc<ItemContext>,
    permits: &Arc<Semaphore>,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
    sizing: &mut Sizing,
) -> Option<String> {
    loop {
        let now = Instant::now();
        let kept = if now >= sizing.next_jobs {
            sizing.next_jobs = now + sizing.jobs_every(session.notices.is_some());
            let kept = session.refresh_jobs(&ctx.store).await;
            // An idle pool's retired queues are swept when due, not at the
            // next look a minute later.
            if let Some(at) = session.idle_sweep_at() {
                sizing.next_jobs = sizing.next_jobs.min(at.max(now + SWEEP_RETRY));
            }
            Some(kept)
        } else if now >= sizing.next_follow && session.work.crowded() {
            // More active jobs than queues consumed: a queue gone dormant
            // gives its place to another job's; an ended job's is let go.
            Some(session.follow_jobs().await)
        } else {
            None
        };
        if let Some(kept) = kept {
            sizing.next_follow = now + sources::IDLE;
            sizing.backlog.extend(kept.into_iter().map(|d| (d, now)));
            metrics::gauge!(names::WORKER_JOB_QUEUES).set(session.work.sending() as f64);
        }
        ctx.beats.set_queued(queued(session, sizing));
        if sizing.prefetch.adapts() && now >= sizing.next_review {
            sizing.next_review = now + PERIOD;
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
            // The pool's active jobs are read on time even while every
            // permit is held by long items: a job that left the list is
            // let go within the grace before its queue is deleted.
            _ = tokio::time::sleep_until(sizing.next_jobs.into()) => continue,
            announced = session::announced(&mut session.notices) => {
                if let Some(why) = look_now(announced, session, sizing, ctx) {
                    return Some(why);
                }
                continue;
            }
            next = session.infra.next() => match next {
                Some(Ok(d)) => { tracker.spawn(infra::record(d, ctx.clone())); continue; }
                Some(Err(e)) => return Some(e.to_string()),
                None => return Some("the broker closed the consumer".into()),
            },
            // What the broker sends meanwhile is taken at once, so the
            // worker's beat can name the jobs it holds deliveries of.
            filled = session.work.fill() => match filled {
                Ok(()) => continue,
                Err(e) => return Some(e.to_string()),
            },
        };
        // What the last subscription had sent goes first.
        if let Some((delivery, _)) = sizing.backlog.pop_front() {
            spawn_item(tracker, delivery, ctx, permit, sizing);
            continue;
        }
        let crowded = session.work.crowded();
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = ctx.stop.cancelled() => return None,
            _ = paused => {}
            // Time to look for new jobs' queues (the permit goes back).
            _ = tokio::time::sleep_until(sizing.next_jobs.into()) => {}
            // Time to replace an emptied queue (the permit goes back).
            _ = tokio::time::sleep_until(sizing.next_follow.into()), if crowded => {}
            announced = session::announced(&mut session.notices) => {
                if let Some(why) = look_now(announced, session, sizing, ctx) {
                    return Some(why);
                }
            }
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

/// The jobs the worker holds deliveries of that wait to start (taken from
/// their subscriptions, or left by one replaced), each with when the oldest
/// came.
fn queued(session: &Session, sizing: &Sizing) -> BTreeMap<String, Instant> {
    let mut out = BTreeMap::new();
    session.work.queued(&mut out);
    for (d, at) in &sizing.backlog {
        if let Some(job) = session.work.active_job_of(d) {
            sources::note(&mut out, job, *at);
        }
    }
    out
}

/// The soonest a sweep that left a queue (still consumed) is tried again.
const SWEEP_RETRY: Duration = Duration::from_secs(1);

/// A job announced: its queue is consumed now. A notice that carries the
/// job's weight adds the job to the active jobs as last read (the next
/// read confirms it), and the worker follows them at once, with no Redis
/// request — a job's start does not cost a read per worker. One without
/// (from a coordinator of an earlier version) makes the worker read the
/// pool's active jobs now. A job's end, trusted (fresh, and signed where
/// the pool's messages are), takes it off the active jobs as last read:
/// its queue is let go and its facts forgotten at once, with no Redis
/// request either. `Some(why)` when the announcements' connection was
/// lost.
fn look_now(
    announced: Result<Notice, String>,
    session: &mut Session,
    sizing: &mut Sizing,
    ctx: &ItemContext,
) -> Option<String> {
    let notice = match announced {
        Ok(notice) => notice,
        Err(why) => return Some(why),
    };
    let valid = batchfleet_shared::message::valid_job_id(&notice.job);
    match (&notice.ended, notice.weight) {
        (Some(_), _) if !valid => {}
        (Some(_), _) => {
            if !notice.trusted(ctx.clock.now_ms(), ctx.guard.key.as_ref()) {
                tracing::debug!(job = %notice.job, "an end notice that is stale, unsigned or forged; ignored");
                metrics::counter!(names::WORKER_NOTICES, "kind" => "refused").increment(1);
                return None;
            }
            tracing::debug!(job = %notice.job, "job ended; letting go of its queue");
            metrics::counter!(names::WORKER_NOTICES, "kind" => "end").increment(1);
            if let Some(sweep) = session.ended(&notice.job) {
                sizing.next_jobs = sizing.next_jobs.min(sweep);
            }
            ctx.facts.forget(&notice.job);
            sizing.next_follow = Instant::now();
        }
        (None, Some(weight)) if valid => {
            tracing::debug!(job = %notice.job, weight, "job announced; consuming its queue");
            metrics::counter!(names::WORKER_NOTICES, "kind" => "start").increment(1);
            session.work.announced_with(&notice.job, weight);
            sizing.next_follow = Instant::now();
        }
        (None, _) => {
            tracing::debug!(job = %notice.job, "job announced; looking at the pool's active jobs");
            metrics::counter!(names::WORKER_NOTICES, "kind" => "start").increment(1);
            session.work.announced(&notice.job);
            sizing.next_jobs = Instant::now();
        }
    }
    None
}

/// Handles a work delivery on its own task; an item settled with its work
/// done counts towards the prefetch's sizing.
fn spawn_item(
    tracker: &TaskTracker,
    delivery: Delivery,
    ctx: &Arc<ItemContext>,
    permit: tokio::sync::OwnedSemaphorePermit,
    sizing: &Sizing,
) {
    let settled = sizing.prefetch.settled();
    let handled = item::handle(delivery, ctx.clone(), permit);
    tracker.spawn(async move {
        let outcome = handled.await;
        if matches!(outcome, Handled::Committed | Handled::AlreadyDone) {
            settled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
}

/// The output disk is full: stop consuming (the deliveries already sent
/// are handed back by their handlers, which see the pause), wait out the
/// pause ([`Pause::wait_out`](pause::Pause::wait_out)), then consume again.
async fn pause(
    session: &mut Session,
    ctx: &Arc<ItemContext>,
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
        tracker.spawn(item::handle(delivery, ctx, permit));
    }
    if !ctx.pause.wait_out(until, shutdown).await {
        return Ok(());
    }
    session
        .resume_work()
        .await
        .map_err(|e| format!("consuming again after the pause: {e}"))?;
    tracing::info!("resuming consumption after the pause; trying the disk again");
    Ok(())
}
