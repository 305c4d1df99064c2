//! The lease on an item a worker works on, and the heartbeat that keeps it
//! fresh in Redis. The coordinator sees what is in flight where, and
//! publishes a copy of an item whose lease goes stale (its worker died).
//!
//! An item started by the start script has its lease from the start; an
//! item started without it ([`LeaseGuard::lazy`], a first delivery checked
//! against the job's facts) gets one only once it is a heartbeat past its
//! first turn at the model (at its next heartbeat), dated back to that
//! turn: an item that takes less than a heartbeat from its turn to its
//! commit — most items — costs no lease write and no lease drop, however
//! long it waited for its turn (a bundle's items behind each other, say).
//! Until then the broker holds the item for it (the delivery is
//! unacknowledged); while it waits for the model its worker's beat says it
//! holds work of the job waiting (the queued field, [`WaitHold`]); and the
//! coordinator takes an item for lost only after `orphan_grace`, several
//! heartbeats. A lease is what counts a crash against an item, so a worker
//! that dies counts one against the item at its model, not against those
//! waiting behind it.
//!
//! A lease is written once, not at every heartbeat: the worker's beat
//! ([`Beats`]) keeps all its leases on a job live with one write per
//! heartbeat, however many of the job's items it holds (a bundle's
//! members waiting for the model, say). A lease is written again only when
//! what it says changes (rows done while rows are left, acknowledged,
//! stopping) — which is also when a heartbeat learns that the item was
//! committed elsewhere or its job cancelled, in time for its next
//! checkpoint.
//!
//! Lease times are Redis's clock (the scripts set them), never this
//! machine's: a worker whose clock is off cannot make its live lease look
//! stale. A lease holder stops its heartbeat when dropped — on every path,
//! a panic included — so an abandoned item's lease goes stale and the item
//! is taken over instead of hanging its job.

use super::held::Held;
use super::signals::Signals;
use crate::context::ItemContext;
use batchfleet_shared::message::WorkItem;
use batchfleet_shared::store::{Lease, Store};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The jobs this worker holds leased items of, beaten together
/// ([`Store::beat_jobs`]: all in one request) at least every third of the
/// lease ttl while it holds any; and the jobs it holds deliveries or unleased items of that have
/// waited half a heartbeat or more to start or to reach the model, beaten
/// with its [`queued_field`](batchfleet_shared::store::queued_field) so
/// that the coordinator takes none of their items for lost.
#[derive(Debug)]
pub struct Beats {
    /// `<worker>/<boot>`: the holder its leases name.
    holder: String,
    /// Job → leased items held.
    jobs: Mutex<HashMap<String, usize>>,
    /// Job → when the oldest of its deliveries waiting to start came.
    queued: Mutex<BTreeMap<String, Instant>>,
    /// Job → its items started here that wait for their first turn at the
    /// model, each (by a number of its own) with when it started.
    waiting: Mutex<HashMap<String, BTreeMap<u64, Instant>>>,
    /// The number of the next waiting item.
    next_wait: std::sync::atomic::AtomicU64,
    /// Job → when its queued field was last said, while it stays due.
    said: Mutex<HashMap<String, Instant>>,
    /// Job → when the holder was last beaten for its leased items, kept
    /// for [`Beats::keep`].
    beaten: Mutex<HashMap<String, Instant>>,
    /// How long one beat keeps a job's leases live enough: a leased job is
    /// beaten again only once this has passed (a third of the lease ttl),
    /// unless a beat goes out anyway.
    keep: Duration,
}

impl Beats {
    /// Beats for `worker` in this process, looking every `every`, while
    /// the returned handle lives; a job's leases, which go stale `ttl`
    /// after their last beat, are beaten at least every third of it.
    pub fn start(
        worker: &str,
        store: Store,
        every: Duration,
        ttl: Duration,
        facts: Arc<super::facts::Facts>,
    ) -> Arc<Self> {
        let beats = Arc::new(Self {
            holder: batchfleet_shared::store::holder(worker, &batchfleet_shared::store::boot_id()),
            jobs: Mutex::default(),
            queued: Mutex::default(),
            waiting: Mutex::default(),
            next_wait: std::sync::atomic::AtomicU64::new(0),
            said: Mutex::default(),
            beaten: Mutex::default(),
            keep: (ttl / 3).max(every),
        });
        tokio::spawn(beat_loop(Arc::downgrade(&beats), store, every, facts));
        beats
    }

    /// Counts a leased item of `job` until the hold is dropped.
    pub fn hold(self: &Arc<Self>, job: &str) -> BeatHold {
        *self
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(job.to_owned())
            .or_default() += 1;
        BeatHold {
            beats: self.clone(),
            job: job.to_owned(),
        }
    }

    /// Counts an item of `job` started without a lease as waiting for the
    /// model until the hold is dropped: the worker's beat names the job
    /// with its queued field once the item has waited half a heartbeat.
    pub fn wait(self: &Arc<Self>, job: &str) -> WaitHold {
        let n = self.next_wait.fetch_add(1, Ordering::Relaxed);
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(job.to_owned())
            .or_default()
            .insert(n, Instant::now());
        WaitHold {
            beats: self.clone(),
            job: job.to_owned(),
            n,
        }
    }

    /// The jobs the worker holds deliveries of that wait to start, each
    /// with when the oldest came (replacing what was said before).
    pub fn set_queued(&self, queued: BTreeMap<String, Instant>) {
        *self.queued.lock().unwrap_or_else(|p| p.into_inner()) = queued;
    }

    /// The beat fields to set now, by job: the holder for jobs with leased
    /// items (their leases' ttl counts from it), and the queued field for
    /// jobs whose deliveries have waited `waited` or more to start.
    ///
    /// Nothing (no request) unless a beat is due: a leased job not beaten
    /// within [`Beats::keep`], or a queued field not said within its job's
    /// `refresh` (the coordinator trusts it for its `orphan_grace`). A beat
    /// that goes out carries every leased job and every queued field
    /// (fields of one request cost no more requests), so a worker holding
    /// work of many jobs sends one beat per period, not one per job and
    /// reason.
    fn due(
        &self,
        waited: Duration,
        refresh: impl Fn(&str) -> Duration,
    ) -> BTreeMap<String, Vec<String>> {
        let mut due: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let now = Instant::now();
        let mut beaten = self.beaten.lock().unwrap_or_else(|p| p.into_inner());
        beaten.retain(|_, at| now.duration_since(*at) < self.keep);
        let mut needed = false;
        for job in self.jobs.lock().unwrap_or_else(|p| p.into_inner()).keys() {
            needed |= !beaten.contains_key(job);
            due.entry(job.clone())
                .or_default()
                .push(self.holder.clone());
        }
        let mut oldest: BTreeMap<&str, Instant> = BTreeMap::new();
        let queued = self.queued.lock().unwrap_or_else(|p| p.into_inner());
        for (job, since) in queued.iter() {
            oldest.insert(job, *since);
        }
        let waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        for (job, items) in waiting.iter() {
            if let Some(since) = items.values().min() {
                let at = oldest.entry(job).or_insert(*since);
                *at = (*at).min(*since);
            }
        }
        oldest.retain(|_, since| since.elapsed() >= waited);
        let mut said = self.said.lock().unwrap_or_else(|p| p.into_inner());
        // A job no longer waiting is named at once when it waits again.
        said.retain(|job, _| oldest.contains_key(job.as_str()));
        for job in oldest.keys() {
            let stale = said
                .get(*job)
                .is_none_or(|at| now.duration_since(*at) >= refresh(job));
            needed |= stale;
        }
        if !needed {
            return BTreeMap::new();
        }
        for job in due.keys() {
            beaten.insert(job.clone(), now);
        }
        for job in oldest.into_keys() {
            due.entry(job.to_owned())
                .or_default()
                .push(batchfleet_shared::store::queued_field(&self.holder));
            said.insert(job.to_owned(), now);
        }
        due
    }

    /// Forgets when the queued fields were said (a beat that failed): the
    /// next beat says them all.
    fn unsay(&self) {
        self.said.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.beaten
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

/// An item's share of its worker's waiting beat, while it waits for its
/// first turn at the model with no lease ([`Beats::wait`]).
pub struct WaitHold {
    beats: Arc<Beats>,
    job: String,
    n: u64,
}

impl std::fmt::Debug for WaitHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitHold").field("job", &self.job).finish()
    }
}

impl Drop for WaitHold {
    fn drop(&mut self) {
        let mut waiting = self.beats.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(items) = waiting.get_mut(&self.job) {
            items.remove(&self.n);
            if items.is_empty() {
                waiting.remove(&self.job);
            }
        }
    }
}

/// A leased item's share of its job's beat.
#[derive(Debug)]
pub struct BeatHold {
    beats: Arc<Beats>,
    job: String,
}

impl Drop for BeatHold {
    fn drop(&mut self) {
        let mut jobs = self.beats.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = jobs.get_mut(&self.job) {
            *n -= 1;
            if *n == 0 {
                jobs.remove(&self.job);
            }
        }
    }
}

/// How often a worker that beats every `every` says again that it holds
/// deliveries of a job waiting to start, when the job's coordinator trusts
/// that for `grace` (`None`: not said, a job from before the record named
/// it): every half of the grace, and never more often than every heartbeat
/// and a half. A beat is sent at the first heartbeat past it, so the word
/// is at most a heartbeat older than this when it is said again — in the
/// default (grace 10 s, heartbeat 2 s) every 6 s, 4 s within the grace.
pub fn refresh(every: Duration, grace: Option<Duration>) -> Duration {
    let floor = every * 3 / 2;
    grace.map_or(floor, |g| (g / 2).max(floor))
}

/// Beats every job with leased items held, and every job with deliveries
/// that have waited half of `every` or more to start, looking once per
/// `every` and sending a beat only when one is due ([`Beats::due`]), until
/// the worker's [`Beats`] is gone. A lease is written with a fresh time,
/// so a job's first beat may wait a whole period.
async fn beat_loop(
    beats: Weak<Beats>,
    store: Store,
    every: Duration,
    facts: Arc<super::facts::Facts>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(b) = beats.upgrade() else { return };
        // Deliveries waiting half a heartbeat are named within one and a
        // half, and again every half grace of their job.
        let due: Vec<(String, Vec<String>)> = b
            .due(every / 2, |job| {
                refresh(every, facts.known(job).and_then(|f| f.orphan_grace))
            })
            .into_iter()
            .collect();
        // Every job in one request (one script call on one Redis server);
        // none when nothing is due.
        if let Err(e) = store.beat_jobs(&due).await {
            b.unsay();
            tracing::warn!(jobs = due.len(), error = %e, "beat failed; the leases of this worker's items age");
        }
        drop(b);
    }
}

/// What becomes of an item's lease when its handling ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEnd {
    /// Dropped: the item is settled or back in its queue.
    Drop,
    /// Dropped already, by the commit that carried it.
    Dropped,
    /// Left to go stale: the item could not be handed back, and the stale
    /// lease is what makes the coordinator publish it again.
    LeftToGoStale,
}

/// The lease on an item and the heartbeat task that keeps it fresh.
pub struct LeaseGuard {
    lease: Lease,
    job: String,
    /// Shared with the heartbeat.
    pub signals: Arc<Signals>,
    task: Option<tokio::task::JoinHandle<()>>,
    ctx: Arc<ItemContext>,
    released: bool,
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("job", &self.job)
            .field("seq", &self.lease.seq)
            .finish_non_exhaustive()
    }
}

impl LeaseGuard {
    /// The lease `Store::start_item` wrote for `item` at `at_ms` (Redis
    /// time), with its heartbeat started.
    pub fn new(
        item: &WorkItem,
        attempt: u32,
        at_ms: u64,
        held: Arc<Held>,
        ctx: Arc<ItemContext>,
    ) -> Self {
        let lease = lease_for(item, attempt, &ctx, at_ms);
        let signals = Arc::new(Signals::default());
        signals.leased.store(true, Ordering::SeqCst);
        Self::with(item, lease, signals, held, ctx)
    }

    /// An item started without a lease: the first heartbeat a heartbeat
    /// or more past its first turn at the model writes it (unless the item
    /// is settled by then, as most are); until that turn it counts as
    /// waiting in its worker's beat.
    pub fn lazy(item: &WorkItem, attempt: u32, held: Arc<Held>, ctx: Arc<ItemContext>) -> Self {
        let lease = lease_for(item, attempt, &ctx, 0);
        let signals = Arc::new(Signals::default());
        *signals.waiting.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(ctx.beats.wait(&item.job_id));
        Self::with(item, lease, signals, held, ctx)
    }

    fn with(
        item: &WorkItem,
        lease: Lease,
        signals: Arc<Signals>,
        held: Arc<Held>,
        ctx: Arc<ItemContext>,
    ) -> Self {
        let task = tokio::spawn(heartbeat_loop(
            item.job_id.clone(),
            lease.clone(),
            held,
            ctx.clone(),
            signals.clone(),
        ));
        Self {
            lease,
            job: item.job_id.clone(),
            signals,
            task: Some(task),
            ctx,
            released: false,
        }
    }

    /// Stops the heartbeat, and ends the lease as `end` says.
    pub async fn finish(mut self, end: LeaseEnd) {
        self.signals.stop.cancel();
        self.signals.stop_waiting();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.released = true;
        if !self.signals.leased.load(Ordering::SeqCst) {
            return;
        }
        match end {
            LeaseEnd::Drop => {
                if let Err(e) = self.ctx.store.release(&self.job, &self.lease).await {
                    tracing::warn!(error = %e, "could not drop the lease; the coordinator will ignore it once the item is settled");
                }
            }
            LeaseEnd::Dropped => {}
            LeaseEnd::LeftToGoStale => {
                // Written once more under a holder no beat names, so this
                // worker's beats on the job do not keep it live.
                let mut left = self.lease.clone();
                left.boot = format!("{}-left", left.boot);
                let _ = self.ctx.store.heartbeat(&self.job, &left, 0).await;
            }
        }
    }
}

impl Drop for LeaseGuard {
    /// The backstop when `finish` was never reached (a panic): the heartbeat
    /// stops and the lease is dropped, so the item is not held by nobody.
    fn drop(&mut self) {
        self.signals.stop.cancel();
        self.signals.stop_waiting();
        if self.released || !self.signals.leased.load(Ordering::SeqCst) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (store, job, lease) =
                (self.ctx.store.clone(), self.job.clone(), self.lease.clone());
            rt.spawn(async move {
                let _ = store.release(&job, &lease).await;
            });
        }
    }
}

/// The lease a worker writes for `item` (times are set by Redis; `at_ms`
/// 0 for a lease first written by a heartbeat, which dates it).
pub fn lease_for(item: &WorkItem, attempt: u32, ctx: &ItemContext, at_ms: u64) -> Lease {
    Lease {
        seq: item.seq,
        worker: ctx.worker_id.clone(),
        attempt,
        started_ms: at_ms,
        heartbeat_ms: at_ms,
        ttl_ms: ctx.tuning.lease_ttl.as_millis() as u64,
        rows_done: 0,
        rows: item.input.rows(),
        rows_resumed: 0,
        acked: false,
        boot: batchfleet_shared::store::boot_id(),
        stopping: false,
    }
}

async fn heartbeat_loop(
    job: String,
    mut lease: Lease,
    held: Arc<Held>,
    ctx: Arc<ItemContext>,
    signals: Arc<Signals>,
) {
    let started = std::time::Instant::now();
    // While the lease is in Redis, the worker's beat on the job keeps it live.
    let mut hold = signals
        .leased
        .load(Ordering::SeqCst)
        .then(|| ctx.beats.hold(&job));
    // What the lease in Redis says (rows done, rows resumed, acked, stopping).
    let mut written = (0, 0, false, false);
    let mut tick = tokio::time::interval(ctx.tuning.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate: the lease was just written, or the item
    // goes without one until it outlives a heartbeat.
    tick.tick().await;
    loop {
        tokio::select! {
            _ = signals.stop.cancelled() => return,
            // Told to stop (SIGTERM): the lease says so at once, so that if
            // the worker is killed before it drains (a preemption's short
            // grace), its death is not counted against the item.
            _ = ctx.shutdown.cancelled(), if !lease.stopping => {
                lease.stopping = true;
            }
            _ = tick.tick() => {}
        }
        // Its commit has begun: the commit settles the lease (drops it, or
        // finds none), and the item is held as it was until it lands.
        if signals.committing.load(Ordering::SeqCst) {
            continue;
        }
        if !held.is_settled() && held.received.elapsed() >= ctx.tuning.ack_after {
            if signals.at_model.load(Ordering::SeqCst) {
                // From here the lease alone holds the item: if this worker dies,
                // the coordinator sees the lease go stale and publishes a copy
                // (at once when the lease says `acked`, else once the queues are
                // drained — so acking before the lease says so is safe).
                held.ack().await;
                lease.acked = true;
                tracing::info!(
                    held_s = held.received.elapsed().as_secs(),
                    "long item: acknowledged early, held by its lease"
                );
            } else if !signals.waited_too_long.is_cancelled() {
                // Never at the model yet (another item holds it): give it to
                // a worker that is free rather than hold it unacknowledged.
                signals.waited_too_long.cancel();
            }
        }
        // Started without a lease, and not a heartbeat past its first turn
        // at the model: still waiting for it (the worker's beat names its
        // job as holding work waiting), or through it and on its way to
        // its commit; a lease now would only be written and dropped again.
        // (One acknowledged early is held by its lease alone: written now.)
        let unleased = hold.is_none() && !lease.acked;
        if unleased
            && signals
                .turn
                .get()
                .is_none_or(|t| t.elapsed() < ctx.tuning.heartbeat)
        {
            continue;
        }
        lease.rows_done = signals.rows_done.load(Ordering::Relaxed);
        lease.rows_resumed = signals.rows_resumed.load(Ordering::Relaxed);
        let says = (
            lease.rows_done,
            lease.rows_resumed,
            lease.acked,
            lease.stopping,
        );
        // All rows through the model: what is left is the commit, which
        // drops the lease; progress written now would tell no one anything.
        let finished = lease.rows > 0 && lease.rows_done >= lease.rows;
        let flags_same = (says.2, says.3) == (written.2, written.3);
        if hold.is_some() && (says == written || (finished && flags_same)) {
            // Nothing new to say (waiting for the model, or in a forward
            // call longer than a heartbeat): the beat keeps the lease live.
            // In the model, its rows are counted now all the same, so a
            // worker killed mid-call leaves its wasted work counted.
            if signals.at_model.load(Ordering::SeqCst) && !finished {
                ctx.flush_work(&job).await;
            }
            continue;
        }
        // A lease written now for the first time is dated from the item's
        // first turn at the model (for one written by the start script,
        // this is ignored).
        let held_ms = signals
            .turn
            .get()
            .map_or_else(|| started.elapsed(), Instant::elapsed)
            .as_millis() as u64;
        match ctx.store.heartbeat(&job, &lease, held_ms).await {
            // A long item's model rows are counted a heartbeat late at
            // most, not at its commit: a worker killed mid-item leaves its
            // wasted work counted.
            Ok(true) => {
                signals.leased.store(true, Ordering::SeqCst);
                written = says;
                if hold.is_none() {
                    hold = Some(ctx.beats.hold(&job));
                }
                ctx.flush_work(&job).await;
            }
            Ok(false) => match ctx.store.is_done(&job, lease.seq).await {
                Ok(false) => {
                    tracing::info!(
                        "the job was cancelled; stopping the item at its next checkpoint"
                    );
                    // Its next items go through the start script, which skips them.
                    ctx.facts.forget(&job);
                    signals.job_stopped.cancel();
                    return;
                }
                Ok(true) => {
                    tracing::info!("item committed elsewhere (a faster copy); stopping this one");
                    // Nothing more to write: the item ends without its
                    // commit, at its first turn at the model or next checkpoint.
                    signals.done_elsewhere.cancel();
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "heartbeat refused, and the done check failed")
                }
            },
            Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_shared::store::queued_field;

    /// The same refresh for every job.
    fn at(refresh: Duration) -> impl Fn(&str) -> Duration {
        move |_| refresh
    }

    fn beats() -> Arc<Beats> {
        Arc::new(Beats {
            holder: "w1/boot".into(),
            jobs: Mutex::default(),
            queued: Mutex::default(),
            waiting: Mutex::default(),
            next_wait: std::sync::atomic::AtomicU64::new(0),
            said: Mutex::default(),
            beaten: Mutex::default(),
            keep: Duration::ZERO,
        })
    }

    #[test]
    fn an_item_waiting_for_the_model_beats_its_job_as_queued_until_its_turn() {
        let beats = beats();
        let signals = Signals::default();
        *signals.waiting.lock().unwrap() = Some(beats.wait("j1"));
        let other = beats.wait("j2");
        let due = beats.due(Duration::ZERO, at(Duration::ZERO));
        assert_eq!(due["j1"], vec![queued_field("w1/boot")]);
        assert_eq!(due["j2"], vec![queued_field("w1/boot")]);
        assert!(
            beats
                .due(Duration::from_secs(60), at(Duration::ZERO))
                .is_empty(),
            "not named before it has waited long enough"
        );
        signals.reached_model();
        assert!(signals.turn.get().is_some());
        let due = beats.due(Duration::ZERO, at(Duration::ZERO));
        assert!(!due.contains_key("j1"), "at the model: no longer waiting");
        drop(other);
        assert!(beats.due(Duration::ZERO, at(Duration::ZERO)).is_empty());
    }

    #[test]
    fn a_job_with_deliveries_queued_and_items_waiting_is_named_once() {
        let beats = beats();
        let long_ago = Instant::now() - Duration::from_secs(10);
        beats.set_queued(BTreeMap::from([("j1".to_owned(), Instant::now())]));
        let _first = beats.wait("j1");
        // The oldest of the two counts.
        beats
            .waiting
            .lock()
            .unwrap()
            .get_mut("j1")
            .unwrap()
            .insert(99, long_ago);
        let due = beats.due(Duration::from_secs(5), at(Duration::ZERO));
        assert_eq!(due["j1"], vec![queued_field("w1/boot")]);
        let _lease = beats.hold("j1");
        let due = beats.due(Duration::from_secs(5), at(Duration::ZERO));
        assert_eq!(
            due["j1"],
            vec!["w1/boot".to_owned(), queued_field("w1/boot")]
        );
    }

    #[test]
    fn a_leased_job_is_beaten_again_only_past_the_keep_unless_a_beat_goes_out_anyway() {
        let beats = Arc::new(Beats {
            keep: Duration::from_secs(3600),
            ..Arc::try_unwrap(beats()).unwrap()
        });
        let _a = beats.hold("j1");
        assert_eq!(
            beats.due(Duration::ZERO, at(Duration::ZERO))["j1"],
            vec!["w1/boot".to_owned()]
        );
        assert!(
            beats.due(Duration::ZERO, at(Duration::ZERO)).is_empty(),
            "beaten within the keep: no request"
        );
        // A job not beaten yet goes out at once, the other beside it.
        let _b = beats.hold("j2");
        let due = beats.due(Duration::ZERO, at(Duration::ZERO));
        assert_eq!(due.keys().collect::<Vec<_>>(), ["j1", "j2"]);
        assert!(beats.due(Duration::ZERO, at(Duration::ZERO)).is_empty());
        // A queued field to say sends the beat, with the leased jobs.
        beats.set_queued(BTreeMap::from([("j3".to_owned(), Instant::now())]));
        let due = beats.due(Duration::ZERO, at(Duration::from_secs(3600)));
        assert_eq!(due.keys().collect::<Vec<_>>(), ["j1", "j2", "j3"]);
        assert!(beats
            .due(Duration::ZERO, at(Duration::from_secs(3600)))
            .is_empty());
        // A failed beat: everything beaten again.
        beats.unsay();
        assert_eq!(
            beats
                .due(Duration::ZERO, at(Duration::from_secs(3600)))
                .len(),
            3
        );
    }

    #[test]
    fn a_queued_field_is_said_again_only_after_its_refresh_and_rides_along_any_beat() {
        let beats = Arc::new(Beats {
            keep: Duration::from_secs(3600),
            ..Arc::try_unwrap(beats()).unwrap()
        });
        let refresh = Duration::from_secs(3600);
        beats.set_queued(BTreeMap::from([
            ("j1".to_owned(), Instant::now()),
            ("j2".to_owned(), Instant::now()),
        ]));
        let first = beats.due(Duration::ZERO, at(refresh));
        assert_eq!(first.len(), 2, "both named at once: {first:?}");
        assert!(
            beats.due(Duration::ZERO, at(refresh)).is_empty(),
            "said within the refresh: no beat at all"
        );
        // A job with a leased item is beaten: every queued field rides
        // along, its own and the other job's.
        let _lease = beats.hold("j2");
        let due = beats.due(Duration::ZERO, at(refresh));
        assert_eq!(
            due["j2"],
            vec!["w1/boot".to_owned(), queued_field("w1/boot")]
        );
        assert_eq!(due["j1"], vec![queued_field("w1/boot")]);
        // Each job's own refresh: one past it sends the beat, with the other.
        let by_job = |job: &str| {
            if job == "j1" {
                Duration::ZERO
            } else {
                refresh
            }
        };
        let due = beats.due(Duration::ZERO, by_job);
        assert_eq!(due.keys().collect::<Vec<_>>(), ["j1", "j2"]);
        let only_j2 = |job: &str| {
            if job == "j2" {
                Duration::ZERO
            } else {
                refresh
            }
        };
        beats.set_queued(BTreeMap::from([("j1".to_owned(), Instant::now())]));
        assert!(
            beats.due(Duration::ZERO, only_j2).is_empty(),
            "j2 leased and beaten, not queued; j1 within its refresh"
        );
        // A job that stops waiting and waits again is named at once.
        beats.set_queued(BTreeMap::from([("j2".to_owned(), Instant::now())]));
        beats.due(Duration::ZERO, at(refresh));
        beats.set_queued(BTreeMap::from([("j1".to_owned(), Instant::now())]));
        assert_eq!(
            beats.due(Duration::ZERO, at(refresh))["j1"],
            vec![queued_field("w1/boot")]
        );
        // A failed beat: everything said again.
        beats.unsay();
        assert!(beats.due(Duration::ZERO, at(refresh)).contains_key("j1"));
        // Past the refresh, said again.
        assert!(beats
            .due(Duration::ZERO, at(Duration::ZERO))
            .contains_key("j1"));
    }

    #[test]
    fn a_queued_field_is_said_every_half_grace_and_never_more_often_than_a_heartbeat_and_a_half() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(refresh(s(2), Some(s(10))), s(5));
        assert_eq!(refresh(s(2), None), s(3), "not said: as before");
        assert_eq!(refresh(s(2), Some(s(4))), s(3));
        assert_eq!(refresh(ms(200), Some(s(1))), ms(500));
    }
}
