//! Retiring a job: off its pool's active jobs at once, its queue deleted a
//! grace later.
//!
//! Workers consume the queues of the jobs they last read listed active
//! (read every minute, and followed at once when a job's start or end is
//! announced). A queue
//! deleted the moment its job leaves the list can meet a `basic.consume`
//! that a worker decided on the read just before — and RabbitMQ answers a
//! consume that meets a quorum queue in the middle of its deletion by
//! crashing the channel, which closes the worker's whole connection (its
//! session lost, its deliveries back in their queues). Or the broker's
//! cancel of a subscription crosses the worker's own cancel on the wire.
//! So a retired job's queue stays for [`RETIRED_GRACE`] — longer than a
//! worker's read of the list is old, and than a worker takes to let go of
//! a retired job's subscription — and is then deleted by whoever sweeps
//! first: the next retire in the pool ([`retire`]), or a worker that saw
//! the job leave (`batchfleet-worker`). A queue that still has a consumer
//! then (a worker that has not let go yet) is left for another grace. Its
//! messages go at once (purged: items a cancel or a failed job skips,
//! copies of settled ones); until it is deleted it takes only what workers
//! letting go of it hand back.
//!
//! The retired jobs are noted in the store (`P:pool:<pool>:retired`, by the
//! store's clock). A sweep claims the due notes in one step (their time
//! moved on, so no other sweep takes them within a grace, and a sweeper
//! that dies leaves them to come due again), marks each job's queue as
//! being swept, reads the active jobs, deletes the queues of the jobs not
//! listed, and drops their notes. A job run again under its id takes its
//! note back before it declares its queue, and once it is listed waits for
//! any sweep of its queue to finish and declares the queue again
//! ([`after_sweeps`]): a sweep that read the list before the job was
//! listed may have deleted it.

use crate::broker::{Broker, PoolQueues};
use crate::store::{JobStatus, Store, StoreError};
use std::time::Duration;

/// How long a retired job's queue stays before a sweep deletes it.
pub const RETIRED_GRACE: Duration = Duration::from_secs(90);

/// Retired jobs' queues deleted at most per sweep.
pub const SWEEP_LIMIT: usize = 64;

/// How long a sweep may hold a job's queue ([`crate::store::JobStore::fence_sweep`]).
const FENCE_TTL: Duration = Duration::from_secs(20);

/// How long after a job finished it may stay listed active before a retire
/// in its pool takes it for a ghost: its own retire comes moments before
/// it is recorded finished, so one still listed this long after is left
/// over (its retire could not take it off the list).
pub const GHOST_AFTER: Duration = Duration::from_secs(300);

/// Retires `job` of `pool` (it ended, or was cancelled): takes it off the
/// pool's active jobs — workers then let go of its queue —, notes it
/// retired, its queue to be deleted once [`RETIRED_GRACE`] has passed, and
/// purges the queue; then retires the pool's ghosts ([`unlist_ghosts`])
/// and sweeps its earlier retired jobs. A job that cannot be taken off the
/// list keeps its queue and is not noted: workers consume the queues of
/// the jobs listed active, and a listed job without its queue would only
/// send them looking for it (the next retire, of the job run again, takes
/// both). Errors are logged: workers skip a finished job's items anyway.
pub async fn retire(store: &Store, broker: &dyn Broker, pool: &str, job: &str) {
    if let Err(e) = store.deactivate_job(pool, job).await {
        tracing::warn!(job, error = %e, "could not take the job off the pool's active jobs; keeping its queue");
        return;
    }
    // Noted first, so that a worker that saw the job leave finds the note
    // due a grace later.
    if let Err(e) = store.note_retired(pool, job).await {
        // With no note, no sweep would ever delete it: deleted now, at
        // the risk the grace is there to avoid.
        tracing::warn!(job, error = %e, "could not note the job retired; deleting its queue at once");
        delete(broker, pool, job).await;
    } else if let Err(e) = broker.purge(&PoolQueues::new(pool).job(job)).await {
        // What it holds goes now (items a cancel or a failure skips,
        // copies of settled ones); the queue itself a grace later.
        tracing::debug!(job, error = %e, "could not purge the job's queue; workers skip its items as they come");
    }
    unlist_ghosts(store, pool).await;
    sweep(store, broker, pool, RETIRED_GRACE).await;
}

/// Retires `job` of `pool` without a broker at hand: off the active jobs
/// and noted retired (its queue neither purged nor swept now: a later
/// sweep deletes it). Errors are logged.
pub async fn unlist(store: &Store, pool: &str, job: &str) {
    if let Err(e) = store.deactivate_job(pool, job).await {
        tracing::warn!(job, error = %e, "could not take the job off the pool's active jobs");
        return;
    }
    if let Err(e) = store.note_retired(pool, job).await {
        tracing::warn!(job, error = %e, "could not note the job retired: its queue stays until it is deleted by hand");
    }
}

/// Retires the ghosts among the pool's active jobs: a job listed whose
/// record is gone (expired, or deleted by `batchfleet gc`), or that was
/// recorded finished more than [`GHOST_AFTER`] ago (by this machine's
/// clock against the reducer's: minutes dwarf their skew). Workers would
/// otherwise keep looking at a queue no one fills. A job found running
/// again once taken off (run again meanwhile) is listed again. How many.
pub async fn unlist_ghosts(store: &Store, pool: &str) -> usize {
    let Ok(active) = store.active_jobs(pool).await else {
        return 0;
    };
    let mut unlisted = 0;
    for (job, weight) in &active {
        if !is_ghost(store, job).await.unwrap_or(false) {
            continue;
        }
        if store.deactivate_job(pool, job).await.is_err() {
            continue;
        }
        // Read again: a run of the job that started between the look and
        // the unlisting is listed again (and its note, if any, dropped).
        if !is_ghost(store, job).await.unwrap_or(true) {
            let _ = store.activate_job(pool, job, *weight).await;
            continue;
        }
        if store.note_retired(pool, job).await.is_ok() {
            tracing::warn!(pool, job, "a job listed active is gone or ended long ago: taken off the list, its queue to be deleted");
            unlisted += 1;
        }
    }
    unlisted
}

/// Whether listed job `job` is a ghost (see [`unlist_ghosts`]).
async fn is_ghost(store: &Store, job: &str) -> Result<bool, StoreError> {
    Ok(match store.job(job).await? {
        None => true,
        Some(r) => {
            !matches!(r.status, JobStatus::Planning | JobStatus::Running)
                && r.finished_ms > 0
                && crate::host::now_ms().saturating_sub(r.finished_ms)
                    > GHOST_AFTER.as_millis() as u64
        }
    })
}

/// What a sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// Due notes it claimed.
    pub claimed: usize,
    /// Queues it deleted (or found gone).
    pub deleted: usize,
}

impl Swept {
    /// Whether notes may be left for a later sweep: some it claimed were
    /// not deleted (the queue had a consumer, or could not be deleted: due
    /// again a grace later), or it claimed as many as one sweep takes.
    pub fn left_some(&self) -> bool {
        self.deleted < self.claimed || self.claimed >= SWEEP_LIMIT
    }
}

/// Deletes the queues of the jobs of `pool` retired at least `grace` ago
/// (at most [`SWEEP_LIMIT`] of them), except a job listed active again (run
/// again under its id: its queue is its new run's) and a queue that still
/// has a consumer (a worker that has not let go of it yet: left for
/// another grace).
pub async fn sweep(store: &Store, broker: &dyn Broker, pool: &str, grace: Duration) -> Swept {
    let claimed = match store.take_retired(pool, grace, SWEEP_LIMIT).await {
        Ok(claimed) => claimed,
        Err(e) => {
            tracing::debug!(pool, error = %e, "cannot read the pool's retired jobs");
            return Swept::default();
        }
    };
    let mut swept = Swept {
        claimed: claimed.len(),
        deleted: 0,
    };
    if claimed.is_empty() {
        return swept;
    }
    // Marked before the list is read: a run listed after the read waits
    // for the mark to go, and declares its queue again.
    let mut fenced = Vec::with_capacity(claimed.len());
    for (job, claim) in claimed {
        if store.fence_sweep(&job, FENCE_TTL).await.unwrap_or(false) {
            fenced.push((job, claim));
        }
    }
    let active = store.active_jobs(pool).await;
    for (job, claim) in &fenced {
        match &active {
            // Listed again: its note was dropped when it was.
            Ok(active) if active.contains_key(job) => {}
            Ok(_) => {
                if delete_unused(broker, pool, job).await {
                    swept.deleted += 1;
                    if let Err(e) = store.drop_retired(pool, job, *claim).await {
                        tracing::debug!(job, error = %e, "could not drop the note of a deleted queue; a later sweep finds it gone");
                    }
                }
            }
            // Its note comes due again a grace later.
            Err(e) => {
                tracing::debug!(pool, error = %e, "cannot read the pool's active jobs; sweeping later")
            }
        }
        let _ = store.unfence_sweep(job).await;
    }
    if swept.deleted > 0 {
        tracing::debug!(
            pool,
            deleted = swept.deleted,
            "deleted the queues of retired jobs"
        );
    }
    swept
}

/// Waits until no sweep holds `job`'s queue (at most the mark's time to
/// live): called by a run of the job once it is listed active, which then
/// declares its queue again — a sweep that read the active jobs before
/// the job was listed may have deleted it.
pub async fn after_sweeps(store: &Store, job: &str) -> Result<(), StoreError> {
    let deadline = tokio::time::Instant::now() + FENCE_TTL;
    while store.is_swept(job).await? && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Deletes the queue of `job` unless a worker still consumes it; whether
/// it is gone.
async fn delete_unused(broker: &dyn Broker, pool: &str, job: &str) -> bool {
    let queue = PoolQueues::new(pool).job(job);
    match broker.consumer_count(&queue).await {
        Ok(None) => return true,
        Ok(Some(0)) => {}
        Ok(Some(n)) => {
            tracing::debug!(
                job,
                consumers = n,
                "a retired job's queue still has consumers; deleting it later"
            );
            return false;
        }
        Err(e) => {
            tracing::debug!(job, error = %e, "cannot read the retired job's queue; deleting it later");
            return false;
        }
    }
    delete(broker, pool, job).await
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
