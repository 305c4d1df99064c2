//! One broker handle consuming a worker's queues: the work queues (its
//! pool's and its active jobs', [`Sources`]), the infra queue, and the
//! pool's announcements of new jobs. Replaced whole when the connection is
//! lost.

use super::sources::{LetGo, Sources};
use batchfleet_shared::broker::{
    Broker, BrokerError, Delivery, Notice, Notices, PoolQueues, Subscription,
};
use batchfleet_shared::retire::{self, RETIRED_GRACE};
use batchfleet_shared::store::Store;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Added to the grace a worker waits before it sweeps, for clocks that run
/// at slightly different rates.
const SWEEP_MARGIN: Duration = Duration::from_secs(1);

/// How long past its sweep's due time a worker in a busy pool sweeps
/// anyway (no retire in the pool swept meanwhile): the longest a retired
/// job's emptied queue stays in a pool that never goes idle.
const BUSY_SWEEP_AFTER: Duration = Duration::from_secs(600);

/// One broker handle consuming the work queues (the pool's and its active
/// jobs', [`Sources`]) and the infra queue, and listening to the pool's
/// announcements.
pub(crate) struct Session {
    /// The broker handle.
    pub(crate) broker: Arc<dyn Broker>,
    /// The work queues.
    pub(crate) work: Sources,
    /// The queue of items the broker dead-lettered itself.
    pub(crate) infra: Box<dyn Subscription>,
    /// The pool's announcements of new jobs; `None` when this handle
    /// cannot hear them (the pool's active jobs are then only looked at on
    /// the timer).
    pub(crate) notices: Option<Box<dyn Notices>>,
    /// The prefetch in force.
    pub(crate) prefetch: u16,
    queues: PoolQueues,
    /// When to sweep the queues of the pool's retired jobs (see
    /// [`batchfleet_shared::retire`]), should the pool have no active job
    /// then: a grace after this worker last saw a job leave the list.
    sweep_at: Option<Instant>,
    /// How long a retired job's queue stays ([`RETIRED_GRACE`]; shorter
    /// in tests).
    retired_grace: Duration,
}

impl Session {
    /// Declares the pool's topology and starts consuming.
    /// `worker` consumes at most `job_queues` job queues at once.
    pub(crate) async fn open(
        broker: Arc<dyn Broker>,
        queues: &PoolQueues,
        prefetch: u16,
        worker: &str,
        job_queues: usize,
    ) -> Result<Self, BrokerError> {
        broker.declare(queues).await?;
        let infra = broker.consume(&queues.infra(), prefetch).await?;
        let work = Sources::open(&broker, &queues.work(), prefetch, worker, job_queues).await?;
        let notices = match broker.notices(queues).await {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen to the pool's announcements; new jobs are found by looking at the pool's active jobs every second");
                None
            }
        };
        Ok(Self {
            broker,
            work,
            infra,
            notices,
            prefetch,
            queues: queues.clone(),
            sweep_at: None,
            retired_grace: RETIRED_GRACE,
        })
    }

    /// Cancels the work subscriptions; the deliveries the broker had sent
    /// already, which come out of the streams before their ends.
    pub(crate) async fn stop_work(&mut self) -> Result<Vec<Delivery>, String> {
        Ok(self.work.stop().await)
    }

    /// Consumes the work queues again with the prefetch in force.
    pub(crate) async fn resume_work(&mut self) -> Result<(), String> {
        self.work.resume(&self.broker, self.prefetch).await
    }

    /// Follows the pool's active jobs: the queues this worker should
    /// consume now consumed, the others let go. What the queues of ended
    /// jobs had sent goes back to its queue; what queues let go while their
    /// jobs run on had sent is returned, to be handled like any delivery.
    pub(crate) async fn refresh_jobs(&mut self, store: &Store) -> Vec<Delivery> {
        let active = match store.active_jobs(&self.queues.pool).await {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the pool's active jobs");
                return Vec::new();
            }
        };
        let now = Instant::now();
        if self.work.leaving(&active) {
            // By then the note is due by the store's clock too.
            self.sweep_at = Some(now + self.retired_grace + SWEEP_MARGIN);
        }
        let idle = active.is_empty();
        // A pool with no active job has no retire coming that would sweep
        // its last retired jobs' queues: its workers do; in a busy pool
        // they leave it to the retires, unless none came for a long while.
        let due = self
            .sweep_at
            .is_some_and(|at| at <= now && (idle || now.duration_since(at) >= BUSY_SWEEP_AFTER));
        let queues = self.queues.clone();
        let let_go = self
            .work
            .refresh(&self.broker, active, |job| queues.job(job), self.prefetch)
            .await;
        if due {
            let swept =
                retire::sweep(store, &*self.broker, &self.queues.pool, self.retired_grace).await;
            // Notes left (a queue still consumed, a claim past the limit)
            // come due again a grace later.
            self.sweep_at = swept
                .left_some()
                .then(|| now + self.retired_grace + SWEEP_MARGIN);
        }
        settle(let_go).await
    }

    /// Job `job` ended (its end notice heard): off the active jobs as last
    /// read, so the next follow lets go of its queue; its retired queue is
    /// swept as after a read that found it gone. When the pool then looks
    /// idle (no active job left as last read), when to read the list for
    /// that sweep: the last job of a busy spell has no retire after it to
    /// sweep its queue, and the list is otherwise read only every minute.
    pub(crate) fn ended(&mut self, job: &str) -> Option<Instant> {
        if !self.work.ended(job) {
            return None;
        }
        self.sweep_at = Some(Instant::now() + self.retired_grace + SWEEP_MARGIN);
        self.idle_sweep_at()
    }

    /// When a sweep of the pool's retired queues comes due while the pool
    /// looks idle: the list is to be read then (see [`Session::ended`]).
    pub(crate) fn idle_sweep_at(&self) -> Option<Instant> {
        self.sweep_at.filter(|_| self.work.idle())
    }

    /// Sets how long a retired job's queue stays (a testing aid).
    pub(crate) fn set_retired_grace(&mut self, grace: Duration) {
        self.retired_grace = grace;
    }

    /// With more active jobs than queues consumed, replaces an emptied
    /// queue with another job's (the active jobs as last read); what a
    /// queue let go had sent, to be handled.
    pub(crate) async fn follow_jobs(&mut self) -> Vec<Delivery> {
        let queues = self.queues.clone();
        let let_go = self
            .work
            .follow(&self.broker, |job| queues.job(job), self.prefetch)
            .await;
        settle(let_go).await
    }

    /// Stops the consumers (draining).
    pub(crate) async fn cancel_consumers(&mut self) {
        self.work.cancel().await;
        self.infra.cancel().await;
    }
}

/// Returns what the queues of ended jobs had sent to its queue; what the
/// others let go had sent, to be handled.
async fn settle(let_go: LetGo) -> Vec<Delivery> {
    for d in let_go.returned {
        let _ = d.requeue().await;
    }
    let_go.kept
}

/// The next announcement of a job of the pool. Pending for ever when
/// this handle hears none, or no longer does (the broker ended the
/// subscription: the timer is then the only way new jobs are found).
pub(crate) async fn announced(listening: &mut Option<Box<dyn Notices>>) -> Result<Notice, String> {
    let Some(notices) = listening.as_mut() else {
        return std::future::pending().await;
    };
    match notices.next().await {
        Some(Ok(notice)) => Ok(notice),
        Some(Err(e)) => Err(e.to_string()),
        None => {
            tracing::warn!("the broker ended the subscription to the pool's announcements; new jobs are found by looking at the pool's active jobs every second");
            *listening = None;
            std::future::pending().await
        }
    }
}
