//! What a worker knows of each job it works for: the fields of the job
//! record a message is checked against ([`JobFacts`]), read with one
//! `HMGET` at most once per [`FRESH`] per job and kept for its items.
//!
//! They let the first delivery of an item start with no Redis request at
//! all ([`super::start`]): checked against facts read moments ago, with no
//! lease until the item outlives a heartbeat. Everything else — a
//! redelivery, a later attempt, a job the facts say is not running or that
//! disagrees with the message, a job Redis does not know — goes through the
//! start script, which gives the exact answer. The items of a new job arrive
//! together; the first to ask reads the facts and the others wait for that
//! read (one request per job and worker, not one per item).
//!
//! A job that ends — finished, cancelled or failed — is announced on the
//! pool's notice exchange, and a worker that hears it forgets the job's
//! facts at once. A worker that was away from the broker forgets all its
//! facts when it is back ([`Facts::forget_all`]): ends announced meanwhile
//! were not heard. A notice lost otherwise (its publish failed) is made up
//! for within [`FRESH`]: an item started meanwhile is refused at its commit
//! (cancelled) or settles as any item in flight when its job failed.

use batchfleet_shared::store::{JobFacts, Store};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// How long facts read from Redis are used before they are read again: a
/// read per job and worker each time (in the 500-worker soak, 2 s made
/// them 0.04 Redis requests per item), and how late a worker that missed a
/// job's end notice while connected (the coordinator could not publish it)
/// may start an item of a job cancelled or failed meanwhile (computed,
/// then refused at its commit). 60 s was tried and measured no fewer
/// requests in the soak, within its run-to-run spread (docs/scaling.md,
/// run N).
pub const FRESH: Duration = Duration::from_secs(15);

/// Jobs whose facts are kept; the oldest read is dropped past this many.
const KEPT: usize = 64;

/// One read of a job's facts (`None`: unknown job, or Redis did not answer).
type Read = Arc<OnceCell<Option<Arc<JobFacts>>>>;

/// The facts of the jobs this worker works for.
#[derive(Debug, Default)]
pub struct Facts {
    reads: Mutex<HashMap<String, (Instant, Read)>>,
}

impl Facts {
    /// `job`'s facts as read within the last [`FRESH`], reading them now if
    /// older; `None` if Redis does not know the job or did not answer (the
    /// start script then decides, as for any item it sees).
    pub async fn get(&self, job: &str, store: &Store) -> Option<Arc<JobFacts>> {
        let read = {
            let mut reads = self.reads.lock().unwrap_or_else(|p| p.into_inner());
            match reads.get(job) {
                Some((at, read)) if at.elapsed() < FRESH => read.clone(),
                _ => {
                    let read = Read::default();
                    keep(&mut reads, job, read.clone());
                    read
                }
            }
        };
        read.get_or_init(|| async {
            match store.job_facts(job).await {
                Ok(facts) => facts.map(Arc::new),
                Err(e) => {
                    tracing::debug!(error = %e, "could not read the job's facts");
                    None
                }
            }
        })
        .await
        .clone()
    }

    /// Keeps `facts` of `job`, read just now beside its task
    /// ([`super::task`]), unless a read of this [`FRESH`] is kept already:
    /// the job's first items then start with no read of their own.
    pub fn seed(&self, job: &str, facts: JobFacts) {
        let mut reads = self.reads.lock().unwrap_or_else(|p| p.into_inner());
        if reads
            .get(job)
            .is_some_and(|(at, read)| at.elapsed() < FRESH && read.initialized())
        {
            return;
        }
        keep(
            &mut reads,
            job,
            Arc::new(OnceCell::new_with(Some(Some(Arc::new(facts))))),
        );
    }

    /// `job`'s facts as last read, whatever their age, with no read of
    /// its own (`None`: none read yet).
    pub fn known(&self, job: &str) -> Option<Arc<JobFacts>> {
        let reads = self.reads.lock().unwrap_or_else(|p| p.into_inner());
        reads
            .get(job)
            .and_then(|(_, read)| read.get().cloned().flatten())
    }

    /// Forgets every job's facts: the next item of each reads them again
    /// (ends announced while the worker was away were not heard).
    pub fn forget_all(&self) {
        self.reads.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Forgets `job`'s facts: the next item reads them again.
    pub fn forget(&self, job: &str) {
        self.reads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(job);
    }
}

/// Keeps `read` as `job`'s, made now; the oldest read is dropped to keep
/// at most [`KEPT`].
fn keep(reads: &mut HashMap<String, (Instant, Read)>, job: &str, read: Read) {
    if reads.len() >= KEPT && !reads.contains_key(job) {
        let oldest = reads
            .iter()
            .min_by_key(|(_, (at, _))| *at)
            .map(|(j, _)| j.clone());
        if let Some(oldest) = oldest {
            reads.remove(&oldest);
        }
    }
    reads.insert(job.to_owned(), (Instant::now(), read));
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_shared::store::JobStatus;

    fn record(id: &str) -> batchfleet_shared::store::JobRecord {
        batchfleet_shared::store::JobRecord::sample(id)
    }

    #[tokio::test]
    async fn facts_are_read_once_while_fresh_and_again_once_forgotten() {
        let store = Store::local();
        let facts = Facts::default();
        assert!(facts.get("a", &store).await.is_none(), "unknown job");
        facts.forget("a");
        store.put_job(&record("a")).await.unwrap();
        let read = facts.get("a", &store).await.expect("known");
        assert_eq!(read.status, JobStatus::Planning);
        store.fail_job("a", "cancelled", "by hand").await.unwrap();
        let kept = facts.get("a", &store).await.expect("kept");
        assert!(Arc::ptr_eq(&read, &kept), "read once while fresh");
        facts.forget("a");
        let again = facts.get("a", &store).await.expect("known");
        assert_eq!(again.status, JobStatus::Cancelled);
    }

    #[tokio::test]
    async fn facts_read_beside_the_task_are_used_without_a_read_of_their_own() {
        let store = Store::local();
        store.put_job(&record("s")).await.unwrap();
        let facts = Facts::default();
        let seeded = JobFacts {
            status: JobStatus::Running,
            ..JobFacts::of(&record("s"))
        };
        facts.seed("s", seeded.clone());
        let got = facts.get("s", &store).await.expect("seeded");
        assert_eq!(
            *got, seeded,
            "the seed, not a read (the store says planning)"
        );
        // A fresh read is not replaced by a later seed.
        facts.seed(
            "s",
            JobFacts {
                status: JobStatus::Cancelled,
                ..seeded
            },
        );
        let kept = facts.get("s", &store).await.expect("kept");
        assert!(Arc::ptr_eq(&got, &kept));
        assert!(Arc::ptr_eq(&facts.known("s").expect("known"), &kept));
        assert!(facts.known("never").is_none(), "no read of its own");
        facts.forget_all();
        assert!(facts.known("s").is_none(), "forgotten with all the others");
    }

    #[tokio::test]
    async fn concurrent_items_of_a_job_share_one_read() {
        let store = Store::local();
        store.put_job(&record("b")).await.unwrap();
        let facts = Facts::default();
        let (x, y) = tokio::join!(facts.get("b", &store), facts.get("b", &store));
        assert!(Arc::ptr_eq(&x.unwrap(), &y.unwrap()));
    }

    #[tokio::test]
    async fn only_so_many_jobs_are_kept() {
        let store = Store::local();
        let facts = Facts::default();
        for i in 0..KEPT + 5 {
            facts.get(&format!("j{i}"), &store).await;
        }
        assert_eq!(facts.reads.lock().unwrap().len(), KEPT);
    }
}
