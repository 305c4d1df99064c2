//! Keeps a running job moving when parts of the fleet fail: the coordinator's
//! side of leases, stragglers and lost state.
//!
//! Every tick (about once a second) while a job runs:
//! - **Lost Redis state**: if the job record is gone (Redis restarted empty
//!   or was flushed), it is restored from the manifest, and the done set and
//!   counters are rebuilt from the committed part files — the files are the
//!   truth — through the same first-commit-wins step the workers use, so a
//!   worker committing at the same moment is never counted twice. Items that
//!   failed for good are recovered from the dead queue, and the job is put
//!   back on its pool's active jobs and announced, so the workers consume
//!   what of it is still queued.
//! - **Dead workers**: a stale lease (no heartbeat for the lease's ttl) of
//!   an unsettled item is a crash of the item, counted in Redis and dropped
//!   (once: a worker's start counts the same way). The broker returns the
//!   delivery of a dead worker itself; only an item whose worker had
//!   acknowledged the delivery early (holding it by the lease alone) is
//!   published again here — or, once `max_crashes` workers died holding
//!   it, recorded failed, class `crash`.
//! - **Stragglers**: once the queues are drained, an item on its first
//!   attempt that no worker died holding, held far longer than the typical item (`speculate_after` × the
//!   median item time), gets one speculative copy — unless a worker of the
//!   pool other than its holder says (its beat's queued field) that it
//!   holds deliveries waiting to start: a fleet with a backlog has no spare
//!   hands, and a copy would only wait its turn too; the first commit wins and
//!   the slower copy stops at its next checkpoint, its output discarded.
//! - **Lost messages**: an item that is neither done, failed, leased nor
//!   queued for `orphan_grace`, in a job that has committed nothing for
//!   `orphan_grace` either and of which no worker has said (its beat's
//!   queued field) within `orphan_grace` that it holds deliveries waiting
//!   to start, is published again — unless its part file is
//!   complete in the output folder: then Redis lost its commit (a failover
//!   to a replica that missed the last writes) and it is committed again
//!   from the file, through the same first-commit-wins step.
//! - **Bounded copies**: a copy after a stale lease carries the next attempt
//!   number, and an item published again [`MAX_COPIES`] times without a
//!   result (its workers keep dying on it, or its message keeps being
//!   refused) is recorded failed, class `infra`, instead of being published
//!   without end.
//! - **No able worker**: when workers said they cannot run the job (no CUDA
//!   device, model unreadable there, out of memory on one row) and no item
//!   was committed for `unable_timeout`, the job fails with their reasons.
//!
//! Lease times are Redis's clock, and so is `now` here: no machine's clock
//! decides whether a lease is stale.

use crate::config::{Connections, SuperviseConfig};
use crate::error::RunError;
use crate::manifest::JobSpec;
use crate::planner::Plan;
use batchfleet_shared::broker::{Broker, PoolQueues};
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::{
    ItemFailure, ItemStats, JobRecord, JobStatus, Lease, Progress, Store,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The holders (`<worker>/<boot>`) whose queued field among a job's
/// `beats` is live: written within `window` ms of `now`.
fn queued_holders(
    beats: &BTreeMap<String, u64>,
    now: u64,
    window: u64,
) -> impl Iterator<Item = &str> {
    beats.iter().filter_map(move |(field, at)| {
        field
            .strip_suffix(batchfleet_shared::store::QUEUED_SUFFIX)
            .filter(|_| now.saturating_sub(*at) <= window)
    })
}

/// How long the supervisor trusts what it read of the pool's backlog.
const BACKLOG_EVERY: Duration = Duration::from_secs(5);

/// How often a check reads the job's whole record; between, the counters
/// and status ([`Store::progress`]) say all a check needs.
const RECORD_EVERY: Duration = Duration::from_secs(30);

/// Copies of one item (after stale leases or as a lost message) the
/// coordinator publishes before it gives the item up as failed (class `infra`).
pub const MAX_COPIES: u64 = 5;

/// Why the supervisor published a copy of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redispatch {
    /// Its worker's lease went stale.
    StaleLease,
    /// It ran far longer than the typical item.
    Straggler,
    /// It was nowhere: not queued, not leased, not settled.
    Orphan,
}

/// What the supervisor did during a job, for the summary and the logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SuperviseReport {
    /// Copies published because a worker died holding the item.
    pub stale_redispatched: u64,
    /// Speculative copies of stragglers.
    pub speculated: u64,
    /// Items published again because they were lost.
    pub orphans_redispatched: u64,
    /// Times the job's Redis state was rebuilt from the output files.
    pub rebuilds: u64,
    /// Items found committed in the output folder during rebuilds.
    pub rebuilt_items: u64,
    /// Items Redis had no trace of whose part files were in the output
    /// folder (writes lost in a failover), recorded as committed again.
    pub lost_commits_recovered: u64,
    /// Items given up after [`MAX_COPIES`] copies (recorded failed, `infra`).
    pub copies_exhausted: u64,
    /// Items given up after `max_crashes` workers died holding them
    /// (recorded failed, `crash`) by the supervisor; a worker's start gives
    /// up the others, dead-lettering their deliveries.
    pub crashes_given_up: u64,
}

/// The supervisor of one job.
pub struct Supervisor {
    job_id: String,
    cfg: SuperviseConfig,
    connections: Connections,
    spec: Option<Arc<JobSpec>>,
    plan: Option<Arc<Plan>>,
    broker: Option<Arc<dyn Broker>>,
    record: Option<JobRecord>,
    /// When the record was last read whole (it holds the manifest; the
    /// checks between read only the counters and status).
    record_read: Option<Instant>,
    last_tick: Option<Instant>,
    unseen_since: HashMap<u32, Instant>,
    median_cache: Option<(Instant, u64)>,
    /// The workers of the pool holding deliveries waiting to start
    /// (`<worker>/<boot>`), and when that was read.
    backlog_cache: Option<(Instant, HashSet<String>)>,
    /// Items committed at the last check, and since when that count holds.
    progress_mark: Option<(u64, Instant)>,
    /// Where the job's paths must stay, for re-reading its manifest.
    data_roots: Vec<std::path::PathBuf>,
    /// What it did.
    pub report: SuperviseReport,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("job_id", &self.job_id)
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

impl Supervisor {
    /// A supervisor for `job_id`. `spec` and `plan` are loaded from the job's
    /// manifest when first needed if not given.
    pub fn new(
        job_id: &str,
        run: &crate::config::RunConfig,
        spec: Option<Arc<JobSpec>>,
        plan: Option<Arc<Plan>>,
    ) -> Self {
        Self {
            job_id: job_id.to_owned(),
            cfg: run.supervise.clone(),
            connections: run.connections.clone(),
            data_roots: run.data_roots.clone(),
            spec,
            plan,
            broker: None,
            record: None,
            record_read: None,
            last_tick: None,
            unseen_since: HashMap::new(),
            median_cache: None,
            backlog_cache: None,
            progress_mark: None,
            report: SuperviseReport::default(),
        }
    }

    /// Remembers the job record (the copy to restore if Redis loses it).
    pub fn remember(&mut self, record: &JobRecord) {
        self.record = Some(record.clone());
    }

    /// Runs one check if one is due, on the job's counters as `known`
    /// (read moments ago by the caller) or as it reads them. Errors of
    /// RabbitMQ or Redis are logged and the check is tried again next
    /// time: the fleet may be mid-outage.
    pub async fn tick(&mut self, store: &Store, known: Option<&Progress>) {
        if self.last_tick.is_some_and(|t| t.elapsed() < self.cfg.every) {
            return;
        }
        self.last_tick = Some(Instant::now());
        if let Err(e) = self.check(store, known).await {
            tracing::warn!(job = %self.job_id, error = %e, "fleet check failed; trying again");
            if matches!(e, RunError::Broker(_)) {
                self.broker = None;
            }
        }
    }

    async fn check(&mut self, store: &Store, known: Option<&Progress>) -> Result<(), RunError> {
        // The counters and status each time; the whole record (for its
        // pool and limits, and the copy a rebuild restores) when missing,
        // or every RECORD_EVERY: none of what the check uses changes
        // while the job runs.
        let progress = match known {
            Some(p) => *p,
            None => store.progress(&self.job_id).await?,
        };
        let stale = self
            .record_read
            .is_none_or(|at| at.elapsed() >= RECORD_EVERY);
        if progress.items_total == 0 || progress.status.is_none() || stale {
            match store.job(&self.job_id).await {
                Ok(Some(r)) if r.items_total > 0 => {
                    self.record = Some(r);
                    self.record_read = Some(Instant::now());
                }
                Ok(_) | Err(batchfleet_shared::store::StoreError::Corrupt { .. }) => {
                    self.rebuild(store).await?;
                    // Its counters are the rebuilt ones next time.
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            }
        }
        let Some(record) = self.record.clone() else {
            return Ok(());
        };
        let status = progress.status.unwrap_or(record.status);
        if status.is_final() || matches!(status, JobStatus::Failed | JobStatus::Cancelled) {
            return Ok(());
        }
        if progress.settled() {
            return Ok(());
        }
        let now = store.now_ms().await?;
        if self.no_able_worker(store, &progress, now).await? {
            return Ok(());
        }
        let queues = PoolQueues::new(&record.pool);
        let drained = self.queues_drained(&queues).await?;
        let leases = store.leases(&self.job_id).await?;
        let mut by_seq: BTreeMap<u32, Vec<Lease>> = BTreeMap::new();
        for l in leases {
            by_seq.entry(l.seq).or_default().push(l);
        }
        let leased: Vec<u32> = by_seq.keys().copied().collect();
        let mut done = store.done_among(&self.job_id, &leased).await?;
        // Each read only when it can say something: the counters tell
        // whether any item failed, and copies matter only for items
        // leased or unaccounted for.
        let failed: HashSet<u32> = if progress.items_failed == 0 {
            HashSet::new()
        } else {
            store
                .failures(&self.job_id)
                .await?
                .iter()
                .map(|f| f.seq)
                .collect()
        };
        let unaccounted = progress.items_done + progress.items_failed + (leased.len() as u64)
            < progress.items_total;
        let redispatched = if leased.is_empty() && !(drained && unaccounted) {
            BTreeMap::new()
        } else {
            store.redispatched(&self.job_id).await?
        };
        // Items workers died holding: never speculated on (the holder may
        // be dead, its lease not stale yet, and a copy would kill another).
        // Read only when an item is a candidate.
        let mut suspects: Option<BTreeMap<u32, u32>> = None;
        let mut to_send: Vec<(u32, u32, Redispatch)> = Vec::new();
        let mut dead_leases = Vec::new();
        // Stale leases of unsettled items: each is a worker that died
        // holding the item, a crash of it.
        let mut crashed = Vec::new();
        // Items held by acknowledged deliveries whose workers died: nothing
        // of them is left in the broker, so a copy is published (or the item
        // given up after `max_crashes`). (seq, next attempt)
        let mut orphaned_by_crash = Vec::new();
        for (seq, leases) in &by_seq {
            let settled = done.contains(seq) || failed.contains(seq);
            let (live, stale): (Vec<&Lease>, Vec<&Lease>) =
                leases.iter().partition(|l| !l.is_stale(now));
            let fields = stale.iter().map(|l| format!("{}@{}", l.seq, l.worker));
            if settled {
                dead_leases.extend(fields);
                continue;
            }
            crashed.extend(fields);
            let last_copy = redispatched.get(seq).copied().unwrap_or(0);
            if live.is_empty() {
                // Its worker died. Unless it acked early, the broker returns
                // the delivery (the next worker's start waits until this
                // lease is stale, and counts the crash first).
                let acked = stale.iter().any(|l| l.acked);
                let newest_beat = stale.iter().map(|l| l.heartbeat_ms).max().unwrap_or(0);
                if acked && last_copy < newest_beat {
                    // The worker died on this attempt: the copy is the next one.
                    let attempt = stale.iter().map(|l| l.attempt).max().unwrap_or(1) + 1;
                    orphaned_by_crash.push((*seq, attempt));
                }
            } else if drained
                && live.len() == 1
                && live[0].attempt == 1
                && last_copy == 0
                // Its holder has renewed the lease since it started: alive
                // then, not a worker that died on the item a moment ago.
                && live[0].heartbeat_ms > live[0].started_ms
                && self.cfg.speculate_after > 0.0
            {
                if suspects.is_none() {
                    suspects = Some(store.crashes(&self.job_id).await?);
                }
                if suspects.as_ref().is_some_and(|s| s.contains_key(seq)) {
                    continue;
                }
                // Only first attempts: an item that failed or timed out before
                // is suspect (a hanging input), and a copy would only hang too.
                let Some(median) = self.median(store).await? else {
                    continue;
                };
                let limit = (median as f64 * self.cfg.speculate_after)
                    .max(self.cfg.speculate_min.as_millis() as f64);
                let age = live[0].age_ms(now);
                // A fleet with work waiting in other workers than its
                // holder has no spare hands: a copy would be one more item
                // waiting its turn.
                if age as f64 > limit
                    && !self
                        .backlogged(store, &record.pool, now)
                        .await?
                        .iter()
                        .any(|h| *h != live[0].holder())
                {
                    tracing::warn!(job = %self.job_id, item = seq, worker = %live[0].worker, age_ms = age, median_ms = median, "straggler: publishing a speculative copy");
                    to_send.push((*seq, live[0].attempt, Redispatch::Straggler));
                }
            }
        }
        // Orphans: nowhere to be found for a while. Only when the counts say
        // some item is unaccounted for is the whole done set read.
        let unsettled_leased = by_seq
            .keys()
            .filter(|s| !done.contains(s) && !failed.contains(s))
            .count() as u64;
        let jl = [
            (batchfleet_shared::metrics::JOB_LABEL, self.job_id.clone()),
            ("pool", record.pool.clone()),
        ];
        metrics::gauge!(names::JOB_IN_FLIGHT, &jl).set(unsettled_leased as f64);
        metrics::gauge!(names::JOB_REDISPATCHED, &jl).set(redispatched.len() as f64);
        let accounted = progress.items_done + progress.items_failed + unsettled_leased;
        if drained && accounted < progress.items_total {
            done = store.done_items(&self.job_id).await?;
            let unseen: Vec<u32> = (0..progress.items_total as u32)
                .filter(|s| {
                    !done.contains(s)
                        && !failed.contains(s)
                        && !by_seq.contains_key(s)
                        && to_send.iter().all(|(t, _, _)| t != s)
                })
                .collect();
            self.unseen_since.retain(|s, _| unseen.contains(s));
            // A delivery a worker has received and not started yet (its
            // prefetch buffer) is in neither the queue nor a lease: while
            // the job still commits items, such deliveries are being worked
            // through, so an item counts as lost only once the job has gone
            // quiet too. A lost message is then found at most one grace
            // after the job's other work, and a busy fleet's buffers are
            // never copied.
            let quiet = self
                .progress_mark
                .map_or(Duration::ZERO, |(_, at)| at.elapsed());
            let mut due = Vec::new();
            for s in unseen {
                let since = *self.unseen_since.entry(s).or_insert_with(Instant::now);
                let last_copy = redispatched.get(&s).copied().unwrap_or(0);
                if since.elapsed() >= self.cfg.orphan_grace
                    && quiet >= self.cfg.orphan_grace
                    && now.saturating_sub(last_copy) >= self.cfg.orphan_grace.as_millis() as u64
                {
                    due.push(s);
                    self.unseen_since.remove(&s);
                }
            }
            // A worker that holds deliveries of the job waiting to start
            // says so in its beat: while such a beat is live, none of the
            // job's items is taken for lost.
            if !due.is_empty() && self.deliveries_held(store, now).await? {
                for s in &due {
                    self.unseen_since.insert(*s, Instant::now());
                }
                due.clear();
            }
            // Committed, then forgotten by Redis (a failover to a replica
            // that missed the last writes): the part file says so.
            let recovered = if due.is_empty() {
                HashSet::new()
            } else {
                self.recover_committed(store, &due).await?
            };
            for s in due.into_iter().filter(|s| !recovered.contains(s)) {
                tracing::warn!(job = %self.job_id, item = s, "item is neither queued, held nor settled; publishing it again");
                to_send.push((s, 1, Redispatch::Orphan));
            }
        } else {
            self.unseen_since.clear();
        }
        if !dead_leases.is_empty() {
            store.drop_leases(&self.job_id, &dead_leases).await?;
        }
        let crashes = store.count_crashes(&self.job_id, &crashed).await?;
        for (seq, attempt) in orphaned_by_crash {
            let n = crashes.get(&seq).copied().unwrap_or(0);
            if record.max_crashes > 0 && n >= record.max_crashes {
                self.give_up_crashed(store, seq, attempt - 1, n, record.max_crashes, now)
                    .await?;
            } else {
                to_send.push((seq, attempt, Redispatch::StaleLease));
            }
        }
        if to_send.is_empty() {
            return Ok(());
        }
        // An item that keeps coming back without a result is given up, not
        // published without end.
        let copies = store.copies(&self.job_id).await?;
        let (exhausted, to_send): (Vec<_>, Vec<_>) =
            to_send.into_iter().partition(|(seq, _, why)| {
                *why != Redispatch::Straggler && copies.get(seq).copied().unwrap_or(0) >= MAX_COPIES
            });
        for (seq, attempt, why) in exhausted {
            let reason = format!(
                "published again {MAX_COPIES} times without a result ({}); giving it up — its workers kept dying on it or its message kept being refused",
                match why {
                    Redispatch::StaleLease => "the last time its worker went silent",
                    _ => "the last time it was nowhere to be found",
                }
            );
            tracing::error!(job = %self.job_id, item = seq, "{reason}");
            let failure = ItemFailure {
                seq,
                class: "infra".into(),
                reason,
                worker: String::new(),
                attempt,
                at_ms: now,
            };
            if store.fail_item(&self.job_id, &failure).await? {
                self.report.copies_exhausted += 1;
            }
        }
        if to_send.is_empty() {
            return Ok(());
        }
        let plan = self.plan().await?;
        // The copies name the job's task by digest: make sure it is there
        // (Redis may have lost it, or a newer coordinator encode it anew).
        store.put_task(&self.job_id, &plan.task).await?;
        let mut messages = Vec::new();
        for (seq, attempt, why) in &to_send {
            let Some(item) = plan.items.get(*seq as usize) else {
                continue;
            };
            if *why == Redispatch::StaleLease {
                tracing::warn!(job = %self.job_id, item = seq, "worker holding the item went silent; publishing it again");
            }
            let mut message = self.connections.work_message(item, *attempt);
            message.headers.insert(
                batchfleet_shared::message::COPY_HEADER,
                batchfleet_shared::broker::HeaderValue::Int(1),
            );
            messages.push(message);
        }
        // To the job's own queue (declared again: a job run or replayed
        // after it ended has had its queue deleted).
        let broker = self.broker().await?;
        broker.declare_job(&queues, &self.job_id).await?;
        broker
            .publish(&queues.job(&self.job_id), messages, 64)
            .await?;
        for (seq, _, why) in to_send {
            store.mark_redispatched(&self.job_id, seq, now).await?;
            match why {
                Redispatch::StaleLease => self.report.stale_redispatched += 1,
                Redispatch::Straggler => self.report.speculated += 1,
                Redispatch::Orphan => self.report.orphans_redispatched += 1,
            }
        }
        Ok(())
    }

    /// Whether a worker said, within `orphan_grace` of `now` (Redis's
    /// clock), that it holds deliveries of the job that wait to start (its
    /// beat's [`queued_field`](batchfleet_shared::store::queued_field)).
    async fn deliveries_held(&self, store: &Store, now: u64) -> Result<bool, RunError> {
        let beats = store.beats(&self.job_id).await?;
        // Workers say it every half of the grace the job's record names:
        // trusted for that grace at least, when it is longer than this
        // coordinator's (a `supervise` with a shorter `--orphan-grace`
        // than the `run` that started the job).
        let told = self.record.as_ref().map_or(0, |r| r.orphan_grace_ms);
        let window = (self.cfg.orphan_grace.as_millis() as u64).max(told);
        let held = queued_holders(&beats, now, window).next().is_some();
        Ok(held)
    }

    /// The workers of pool `pool` (`<worker>/<boot>`) that said, within
    /// `orphan_grace` of `now`, that they hold deliveries of any of the
    /// pool's active jobs waiting to start (read at most every
    /// [`BACKLOG_EVERY`]).
    async fn backlogged(
        &mut self,
        store: &Store,
        pool: &str,
        now: u64,
    ) -> Result<HashSet<String>, RunError> {
        if let Some((at, holders)) = &self.backlog_cache {
            if at.elapsed() < BACKLOG_EVERY {
                return Ok(holders.clone());
            }
        }
        let window = self.cfg.orphan_grace.as_millis() as u64;
        let mut holders = HashSet::new();
        for job in store.active_jobs(pool).await?.keys() {
            let beats = store.beats(job).await?;
            holders.extend(queued_holders(&beats, now, window).map(str::to_owned));
        }
        self.backlog_cache = Some((Instant::now(), holders.clone()));
        Ok(holders)
    }

    /// Records item `seq` failed, class `crash`: `crashes` workers died
    /// holding it, the job's `max_crashes`. (Its last delivery was
    /// acknowledged early, so the broker holds nothing of it to dead-letter.)
    async fn give_up_crashed(
        &mut self,
        store: &Store,
        seq: u32,
        attempt: u32,
        crashes: u32,
        max: u32,
        now: u64,
    ) -> Result<(), RunError> {
        let reason = format!(
            "{crashes} workers died holding the item ([failure] max_crashes = {max}): it kills the process that runs it (out of memory, a fault in the model or its libraries); given up so the job goes on"
        );
        tracing::error!(job = %self.job_id, item = seq, "{reason}");
        let failure = ItemFailure {
            seq,
            class: "crash".into(),
            reason,
            worker: String::new(),
            attempt: attempt.max(1),
            at_ms: now,
        };
        if store.fail_item(&self.job_id, &failure).await? {
            self.report.crashes_given_up += 1;
        }
        Ok(())
    }

    /// Fails the job when workers said they cannot run it and nothing was
    /// committed for `unable_timeout`: no able worker takes its items.
    /// `true` if it failed the job now.
    async fn no_able_worker(
        &mut self,
        store: &Store,
        progress: &Progress,
        now: u64,
    ) -> Result<bool, RunError> {
        let moved = self
            .progress_mark
            .is_none_or(|(done, _)| done != progress.items_done);
        if moved {
            self.progress_mark = Some((progress.items_done, Instant::now()));
            return Ok(false);
        }
        let stalled = self
            .progress_mark
            .map_or(Duration::ZERO, |(_, at)| at.elapsed());
        if stalled < self.cfg.unable_timeout {
            return Ok(false);
        }
        let notes = store.unable(&self.job_id).await?;
        let unable: Vec<_> = notes
            .iter()
            .filter(|(_, n)| n.class == "unable" && n.until_ms > now)
            .collect();
        let oldest = unable.iter().map(|(_, n)| n.since_ms).min();
        let Some(oldest) = oldest else {
            return Ok(false);
        };
        let timeout_ms = self.cfg.unable_timeout.as_millis() as u64;
        if now.saturating_sub(oldest) < timeout_ms {
            return Ok(false);
        }
        let who: Vec<String> = unable
            .iter()
            .map(|(w, n)| format!("{w}: {}", n.reason))
            .collect();
        let reason = format!(
            "no worker could run the job's items for {}s, and none was committed meanwhile — {}",
            self.cfg.unable_timeout.as_secs(),
            who.join("; ")
        );
        if store.fail_job(&self.job_id, "unable", &reason).await? {
            tracing::error!(job = %self.job_id, %reason, "failing the job: no able worker");
        }
        Ok(true)
    }

    /// The median item time, estimated from the stats of up to
    /// [`MEDIAN_SAMPLE`] committed items picked at random (a read that does
    /// not grow with the job), read at most every 30 s once known.
    async fn median(&mut self, store: &Store) -> Result<Option<u64>, RunError> {
        if let Some((at, m)) = self.median_cache {
            if at.elapsed() < Duration::from_secs(30) {
                return Ok(Some(m));
            }
        }
        let sample = store.sample_item_stats(&self.job_id, MEDIAN_SAMPLE).await?;
        let m = median_latency(&sample);
        self.median_cache = m.map(|m| (Instant::now(), m));
        Ok(m)
    }

    /// Whether the job's queue, the pool's work queue and its retry tiers
    /// hold no ready message.
    async fn queues_drained(&mut self, queues: &PoolQueues) -> Result<bool, RunError> {
        let broker = self.broker().await?;
        let job = queues.job(&self.job_id);
        for q in queues.all().into_iter().chain([job.clone()]) {
            if (q == queues.work() || q == job || q.contains(".retry."))
                && broker.ready_count(&q).await?.unwrap_or(0) > 0
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The supervisor's broker handle, (re)connected when needed.
    async fn broker(&mut self) -> Result<Arc<dyn Broker>, RunError> {
        match &self.broker {
            Some(b) if b.is_open() => Ok(b.clone()),
            _ => {
                let broker = self
                    .connections
                    .broker(&format!("batchfleet supervisor {}", self.job_id))
                    .await?;
                self.broker = Some(broker.clone());
                Ok(broker)
            }
        }
    }

    /// The job's output folder, from its record or its manifest (`None`
    /// when neither is known yet).
    pub fn output_dir(&self) -> Option<PathBuf> {
        self.record
            .as_ref()
            .map(|r| PathBuf::from(&r.output_dir))
            .or_else(|| self.spec.as_ref().map(|s| s.output_dir().to_owned()))
    }

    /// The job's manifest, validated (loaded from the recorded path if not given).
    pub async fn spec(&mut self) -> Result<Arc<JobSpec>, RunError> {
        if let Some(s) = &self.spec {
            return Ok(s.clone());
        }
        let (manifest, overrides) = self
            .record
            .as_ref()
            .map(|r| (r.manifest.clone(), r.overrides.clone()))
            .ok_or_else(|| {
                RunError::UnknownJob(format!(
                    "job {} is not in Redis and its manifest is unknown; run the manifest again",
                    self.job_id
                ))
            })?;
        // Validated when it was run: the model is not tried again here, so
        // a model that kills the process trying it cannot stop supervision.
        let spec = Arc::new(crate::manifest::load_trying(
            Path::new(&manifest),
            &self.data_roots,
            &overrides,
            crate::manifest::ModelTrial::Skip,
        )?);
        if spec.job_id != self.job_id {
            return Err(RunError::ManifestMoved {
                manifest,
                now: spec.job_id.clone(),
                was: self.job_id.clone(),
                changed: "the manifest, its input or its model changed",
                fix: "restore them to continue the job".into(),
            });
        }
        self.spec = Some(spec.clone());
        Ok(spec)
    }

    async fn plan(&mut self) -> Result<Arc<Plan>, RunError> {
        if let Some(p) = &self.plan {
            return Ok(p.clone());
        }
        let spec = self.spec().await?;
        let plan = Arc::new(tokio::task::block_in_place(|| crate::planner::plan(&spec))?);
        self.plan = Some(plan.clone());
        Ok(plan)
    }

    /// Of items Redis has no trace of (not done, failed, leased or queued),
    /// those whose part file is complete in the output folder: their commit
    /// reached the files but not Redis — a failover to a replica that missed
    /// the last writes. They are committed again from their files, through
    /// the same first-commit-wins step, instead of being computed again.
    async fn recover_committed(
        &mut self,
        store: &Store,
        seqs: &[u32],
    ) -> Result<HashSet<u32>, RunError> {
        let spec = self.spec().await?;
        let plan = self.plan().await?;
        // Not strict: a part whose rejects file is missing is computed again.
        let wanted: HashSet<u32> = seqs.iter().copied().collect();
        let found =
            crate::record::scan_job_outputs(&spec, &plan, |s| wanted.contains(&s), false).await?;
        crate::record::commit_found(store, &self.job_id, &found).await?;
        let recovered: HashSet<u32> = found.iter().map(|(stats, _)| stats.seq).collect();
        if !recovered.is_empty() {
            let mut seqs: Vec<u32> = recovered.iter().copied().collect();
            seqs.sort_unstable();
            tracing::warn!(job = %self.job_id, items = ?seqs, "items committed in the output folder but unknown to Redis (it lost its last writes, as after a failover to a replica that missed them); recorded from their part files");
            self.report.lost_commits_recovered += recovered.len() as u64;
        }
        Ok(recovered)
    }

    /// Restores a job record lost from Redis and rebuilds its done set and
    /// counters from the output folder, and its failures from the dead queue.
    async fn rebuild(&mut self, store: &Store) -> Result<(), RunError> {
        let spec = self.spec().await?;
        let plan = self.plan().await?;
        tracing::warn!(job = %self.job_id, "the job's state is missing from Redis (restarted empty or flushed); rebuilding it from the output files");
        let mut record = self.record.clone().unwrap_or_else(|| {
            let mut record = crate::record::job_record(&spec, &plan, batchfleet_shared::now_ms());
            record.done_bits = !self.connections.whole_messages;
            record.orphan_grace_ms = batchfleet_shared::store::grace_ms(self.cfg.orphan_grace);
            record
        });
        // The dead queue first: if RabbitMQ is down too, nothing is restored
        // and the whole rebuild is tried again on the next tick.
        let broker = self.broker().await?;
        let filter = crate::dlq::Filter {
            job: Some(self.job_id.clone()),
            ..Default::default()
        };
        let dead = crate::dlq::list(&*broker, &record.pool, &filter).await?;
        let found = crate::record::scan_job_outputs(&spec, &plan, |_| true, true).await?;

        record.status = JobStatus::Running;
        record.items_total = plan.items.len() as u64;
        record.rows_total = plan.rows_total;
        record.items_published = record.items_total;
        store.restore_job(&record).await?;
        store
            .put_inputs(&self.job_id, &crate::record::input_fields(&spec, &plan))
            .await?;
        store.put_task(&self.job_id, &plan.task).await?;
        let restored = crate::record::commit_found(store, &self.job_id, &found).await?;
        let mut failures = 0;
        for d in dead {
            let Some(seq) = d.item else { continue };
            if d.class == "rejected" {
                continue; // a refused message says nothing about the real item
            }
            let failure = ItemFailure {
                seq,
                class: d.class,
                reason: d.error,
                worker: d.worker,
                attempt: d.attempts,
                at_ms: d.dead_at_ms,
            };
            if store.fail_item(&self.job_id, &failure).await? {
                failures += 1;
            }
        }
        // Back on its pool's active jobs (Redis lost that list too), and
        // announced: the workers consume its queue again, whatever of the job
        // still sits there.
        let queues = PoolQueues::new(&record.pool);
        let was_retired = store.forget_retired(&record.pool, &self.job_id).await?;
        let weight = spec.priority.weight();
        crate::dispatcher::list_and_announce(
            store,
            &*broker,
            &queues,
            &self.job_id,
            weight,
            was_retired,
        )
        .await?;
        self.record = Some(record);
        self.report.rebuilds += 1;
        self.report.rebuilt_items += restored;
        tracing::warn!(job = %self.job_id, items_found = found.len(), items_restored = restored, failures_restored = failures, "job state rebuilt from the output files");
        Ok(())
    }
}

/// Median wall time of committed items; `None` with fewer than 3.
/// Committed items a running job's median item time is estimated from.
pub const MEDIAN_SAMPLE: usize = 255;

fn median_latency(stats: &[ItemStats]) -> Option<u64> {
    if stats.len() < 3 {
        return None;
    }
    let mut ms: Vec<u64> = stats.iter().map(ItemStats::latency_ms).collect();
    ms.sort_unstable();
    Some(ms[ms.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(seq: u32, ms: u64) -> ItemStats {
        ItemStats {
            seq,
            rows: 1,
            rows_rejected: 0,
            worker: "w".into(),
            started_ms: 0,
            finished_ms: ms,
            attempt: 1,
            recovered: false,
            rows_resumed: 0,
            vector: None,
            shadow: None,
        }
    }

    #[test]
    fn median_needs_three_items() {
        assert_eq!(median_latency(&[stat(0, 5), stat(1, 7)]), None);
        assert_eq!(
            median_latency(&[stat(0, 50), stat(1, 7), stat(2, 9)]),
            Some(9)
        );
    }
}
