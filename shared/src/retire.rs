//! Retiring a job: off its pool's active jobs at once, its queue deleted a
//! grace later.
//!
//! Workers consume the queues of the jobs they last read listed active
//! (read every few seconds, and at once when a job is announced). A queue
//! deleted the moment its job leaves the list can meet a `basic.consume`
//! that a worker decided on the read just before — and RabbitMQ answers a
//! consume that meets a quorum queue in the middle of its deletion by
//! crashing the channel, which closes the worker's whole connection (its
//! session lost, its deliveries back in their queues). Or the broker's
//! cancel of a subscription crosses the worker's own cancel on the wire.
//! So a retired job's queue stays for [`RETIRED_GRACE`] — longer than any
//! worker's read of the list is old, and than a worker takes to let go of a
//! retired job's subscription — and is then deleted by whoever sweeps
//! first: the next retire in the pool ([`retire`]), or a worker whose pool
//! has no active job left (`batchfleet-worker`). Its messages go at once
//! (purged: items a cancel or a failed job skips, copies of settled ones);
//! until it is deleted it takes only what workers letting go of it hand
//! back.
//!
//! The retired jobs are noted in the store (`P:pool:<pool>:retired`, by
//! the store's clock, so that no machine's clock decides), and a sweep
//! takes each note in one step: one sweeper deletes each queue.

use crate::broker::{Broker, PoolQueues};
use crate::store::{JobStatus, Store};
use std::time::Duration;

/// How long a retired job's queue stays before a sweep deletes it.
pub const RETIRED_GRACE: Duration = Duration::from_secs(30);

/// Retired jobs' queues deleted at most per sweep.
const SWEEP_LIMIT: usize = 64;

/// Retires `job` of `pool` (it ended, or was cancelled): takes it off the
/// pool's active jobs — workers then let go of its queue —, purges the
/// queue and notes the job retired, its queue to be deleted once
/// [`RETIRED_GRACE`] has passed;
/// then sweeps the pool's earlier retired jobs. A job that cannot be taken
/// off the list keeps its queue and is not noted: workers consume the
/// queues of the jobs listed active, and a listed job without its queue
/// would only send them looking for it (the next retire, of the job run
/// again, takes both). Errors are logged: workers skip a finished job's
/// items anyway.
pub async fn retire(store: &Store, broker: &dyn Broker, pool: &str, job: &str) {
    if let Err(e) = store.deactivate_job(pool, job).await {
        tracing::warn!(job, error = %e, "could not take the job off the pool's active jobs; keeping its queue");
        return;
    }
    // What it holds goes now (items a cancel or a failure skips, copies of
    // settled ones); the queue itself a grace later.
    if let Err(e) = broker.purge(&PoolQueues::new(pool).job(job)).await {
        tracing::debug!(job, error = %e, "could not purge the job's queue; workers skip its items as they come");
    }
    if let Err(e) = store.note_retired(pool, job).await {
        // With no note, no sweep would ever delete it: deleted now, at
        // the risk the grace is there to avoid.
        tracing::warn!(job, error = %e, "could not note the job retired; deleting its queue at once");
        delete(broker, pool, job).await;
    }
    unlist_ghosts(store, pool).await;
    sweep(store, broker, pool, RETIRED_GRACE).await;
}

/// How long after a job finished it may stay listed active before a
/// retire in its pool takes it for a ghost: its own retire comes moments
/// after its summary, so one still listed this long after lost it (its
/// reducer died in between).
pub const GHOST_AFTER: Duration = Duration::from_secs(300);

/// Retires the ghosts among the pool's active jobs: a job listed whose
/// record is gone (expired, or deleted by `batchfleet gc`), or that
/// finished more than [`GHOST_AFTER`] ago. Workers would otherwise keep
/// looking at a queue no one fills, and the pool would never look idle to
/// them (when they sweep its retired queues). How many.
pub async fn unlist_ghosts(store: &Store, pool: &str) -> usize {
    let Ok(active) = store.active_jobs(pool).await else {
        return 0;
    };
    let now = crate::host::now_ms();
    let mut unlisted = 0;
    for job in active.keys() {
        let ghost = match store.job(job).await {
            Ok(None) => true,
            Ok(Some(r)) => {
                r.finished_ms > 0
                    && now.saturating_sub(r.finished_ms) > GHOST_AFTER.as_millis() as u64
                    && !matches!(r.status, JobStatus::Planning | JobStatus::Running)
            }
            Err(_) => false,
        };
        if ghost
            && store.deactivate_job(pool, job).await.is_ok()
            && store.note_retired(pool, job).await.is_ok()
        {
            tracing::warn!(pool, job, "a job listed active had ended long ago or is gone: taken off the list, its queue to be deleted");
            unlisted += 1;
        }
    }
    unlisted
}

/// Retires `job` of `pool` without a broker at hand: off the active jobs
/// and noted retired (its queue neither purged nor swept now: a later
/// retire in the pool deletes it). Errors are logged.
pub async fn unlist(store: &Store, pool: &str, job: &str) {
    if let Err(e) = store.deactivate_job(pool, job).await {
        tracing::warn!(job, error = %e, "could not take the job off the pool's active jobs");
        return;
    }
    if let Err(e) = store.note_retired(pool, job).await {
        tracing::warn!(job, error = %e, "could not note the job retired: its queue stays until it is deleted by hand");
    }
}

/// Deletes the queues of the jobs of `pool` retired at least `grace` ago
/// (at most [`SWEEP_LIMIT`] of them), unless a job is listed active again
/// (run again under its id: its queue is its new run's); how many were
/// deleted. A queue that cannot be deleted is noted retired again, for a
/// later sweep.
pub async fn sweep(store: &Store, broker: &dyn Broker, pool: &str, grace: Duration) -> usize {
    let taken = match store.take_retired(pool, grace, SWEEP_LIMIT).await {
        Ok(taken) if taken.is_empty() => return 0,
        Ok(taken) => taken,
        Err(e) => {
            tracing::debug!(pool, error = %e, "cannot read the pool's retired jobs");
            return 0;
        }
    };
    let active = match store.active_jobs(pool).await {
        Ok(active) => active,
        Err(e) => {
            tracing::debug!(pool, error = %e, "cannot read the pool's active jobs; sweeping later");
            renote(store, pool, &taken).await;
            return 0;
        }
    };
    let mut deleted = 0;
    for job in taken.iter().filter(|job| !active.contains_key(*job)) {
        if delete(broker, pool, job).await {
            deleted += 1;
        } else {
            renote(store, pool, std::slice::from_ref(job)).await;
        }
    }
    if deleted > 0 {
        tracing::debug!(pool, deleted, "deleted the queues of retired jobs");
    }
    deleted
}

/// Deletes the queue of `job`; whether it is gone.
async fn delete(broker: &dyn Broker, pool: &str, job: &str) -> bool {
    match broker.delete(&PoolQueues::new(pool).job(job)).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(job, error = %e, "could not delete the retired job's queue");
            false
        }
    }
}

/// Notes `jobs` retired again (now), for a later sweep.
async fn renote(store: &Store, pool: &str, jobs: &[String]) {
    for job in jobs {
        if let Err(e) = store.note_retired(pool, job).await {
            tracing::warn!(job, error = %e, "could not note the retired job again: its queue stays until it is deleted by hand");
        }
    }
}
