//! A version 3 message's task: fetched from the job's `:tasks` hash once per
//! job and digest, checked against the digest the signed message names, and
//! kept for the job's other items.
//!
//! The items of a new job arrive together; the first to ask fetches the
//! task and the others wait for it (one Redis request per job and worker,
//! not one per item). The job's facts come with it in that request
//! ([`super::facts::Facts::seed`]), so its first items start with no other. What is not found is not kept: a job Redis lost is
//! restored by the coordinator, and its task with it.

use super::held::Held;
use super::settle::{hand_back, reject, Handled};
use crate::context::ItemContext;
use batchfleet_shared::message::{ItemRef, StoredTask, TaskSpec, WorkItem};
use batchfleet_shared::store::TaskLookup;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::OnceCell;

/// Tasks kept per worker; the oldest is dropped past this many (a worker
/// sees a few jobs at a time, and a dropped task is fetched again).
const KEPT: usize = 64;

/// One task, fetched once.
type Slot = Arc<OnceCell<Arc<TaskSpec>>>;

/// A job and a task digest.
type Key = (String, String);

/// The tasks kept, and the order they came in.
#[derive(Debug, Default)]
struct Kept {
    slots: HashMap<Key, Slot>,
    order: VecDeque<Key>,
}

/// The tasks this worker has fetched, by job and digest.
#[derive(Debug, Default)]
pub struct Tasks {
    kept: Mutex<Kept>,
}

/// Why a task was not had.
pub enum Missing {
    /// Redis does not know the job (yet).
    UnknownJob,
    /// The job stores no such task, or its bytes are not it.
    Refused(String),
    /// Redis did not answer in time.
    Store(String),
}

impl Tasks {
    /// The slot of `(job, sha256)`, made (and the oldest dropped) if new.
    fn slot(&self, job: &str, sha256: &str) -> Slot {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let key = (job.to_owned(), sha256.to_owned());
        if let Some(slot) = kept.slots.get(&key) {
            return slot.clone();
        }
        if kept.slots.len() >= KEPT {
            if let Some(oldest) = kept.order.pop_front() {
                kept.slots.remove(&oldest);
            }
        }
        kept.order.push_back(key.clone());
        kept.slots.entry(key).or_default().clone()
    }

    /// How many tasks are kept (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.kept.lock().unwrap().slots.len()
    }
}

/// The task `r` names, from this worker's cache or from Redis.
pub async fn fetch(r: &ItemRef, ctx: &ItemContext) -> Result<Arc<TaskSpec>, Missing> {
    let slot = ctx.tasks.slot(&r.job_id, &r.task_sha256);
    slot.get_or_try_init(|| async {
        let (found, facts) = ctx
            .patient("task", || {
                ctx.store.task_and_facts(&r.job_id, &r.task_sha256)
            })
            .await
            .map_err(|e| Missing::Store(e.message))?;
        if let Some(facts) = facts {
            ctx.facts.seed(&r.job_id, facts);
        }
        match found {
            TaskLookup::Found(bytes) => StoredTask::open(&bytes, &r.task_sha256)
                .map(Arc::new)
                .map_err(|e| Missing::Refused(format!("job {}: {e}", r.job_id))),
            TaskLookup::NotOfJob => Err(Missing::Refused(format!(
                "job {} stores no task {}: the message is not a work item of this job",
                r.job_id, r.task_sha256
            ))),
            TaskLookup::UnknownJob => Err(Missing::UnknownJob),
        }
    })
    .await
    .cloned()
}

/// The whole item `r` names, or how its delivery was settled instead: a
/// task the job does not store is a bad message (rejected); an unknown job
/// is waited for like any item's ([`super::unknown_job`]); Redis out of
/// reach hands the item back for later.
pub async fn resolve(
    held: &Held,
    r: ItemRef,
    attempt: u32,
    ctx: &ItemContext,
) -> Result<WorkItem, Handled> {
    match fetch(&r, ctx).await {
        Ok(task) => Ok(r.with_task(TaskSpec::clone(&task))),
        Err(Missing::UnknownJob) => Err(super::unknown_job(held, &r, attempt, ctx).await),
        Err(Missing::Refused(why)) => Err(reject(held, Some(&r), &why, "task", ctx).await),
        Err(Missing::Store(why)) => {
            tracing::warn!(error = %why, "cannot read the job's task from Redis; handing the item back for later");
            let delay = Some(ctx.tuning.hand_back_delay);
            Err(hand_back(held, &r, attempt, delay, &[], "store", ctx)
                .await
                .0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_slot_per_job_and_digest_and_the_oldest_goes_first() {
        let tasks = Tasks::default();
        let a = tasks.slot("j", "a");
        assert!(Arc::ptr_eq(&a, &tasks.slot("j", "a")));
        assert!(!Arc::ptr_eq(&a, &tasks.slot("k", "a")));
        for i in 0..KEPT {
            tasks.slot("many", &i.to_string());
        }
        assert_eq!(tasks.len(), KEPT);
        assert!(
            !Arc::ptr_eq(&a, &tasks.slot("j", "a")),
            "the oldest slot was dropped for the newest"
        );
    }
}
