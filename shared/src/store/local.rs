//! The in-process implementation of [`JobStore`] (`batchfleet run --local`):
//! the same job state as the Redis keys listed in [`super`], held in this
//! process's memory under one [`Mutex`].
//!
//! Every method takes the lock once, does what the Redis implementation
//! does in one script or `MULTI` pipeline, and lets go before returning (the
//! lock is never held across an `.await`), so each step is atomic exactly
//! like its Redis counterpart. The methods mirror
//! [`COMMIT_SCRIPT`](super::redis::COMMIT_SCRIPT),
//! [`fail_script`](super::redis::fail_script),
//! [`lease_script`](super::redis::lease_script),
//! [`start_script`](super::redis::start_script),
//! [`PUBLISHED_SCRIPT`](super::redis::PUBLISHED_SCRIPT),
//! [`FAIL_JOB_SCRIPT`](super::redis::FAIL_JOB_SCRIPT) and the plain commands
//! step by step; keep them in step when a script changes. Both
//! implementations pass the same tests (`shared/tests/it/store.rs`).
//!
//! The job record is kept as its hash fields (strings, as Redis holds them),
//! so that [`JobStore::update_job`], [`JobStore::restore_job`] and
//! [`JobStore::put_job`] behave like `HSET` and a record is read back through
//! the same [`JobRecord::from_fields`]. Everything else is kept typed: in
//! memory nothing can hold undecodable JSON.
//!
//! The clock is this process's wall clock ([`crate::host::now_ms`]): with one
//! process there is one clock, which [`JobStore::now_ms`] returns and the
//! lease times are written with.

use super::{
    Claim, Commit, ItemFailure, ItemStats, JobRecord, JobStatus, JobStore, Lease, Progress,
    RecordUpdate, Start, StoreError, TaskLookup, UnableNote, Work,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

/// Everything stored about one job: what the Redis keys `P:job:{<id>}*` hold.
#[derive(Debug, Default)]
struct JobState {
    /// `P:job:{<id>}`: the record's hash fields.
    fields: BTreeMap<String, String>,
    /// `P:job:{<id>}:done`: seqs of committed items.
    done: BTreeSet<u32>,
    /// `P:job:{<id>}:stats`: the winning commit's stats by seq.
    stats: BTreeMap<u32, ItemStats>,
    /// `P:job:{<id>}:failed`: items that failed for good, by seq.
    failed: BTreeMap<u32, ItemFailure>,
    /// `P:job:{<id>}:leases`: leases by their `<seq>@<worker>` field.
    leases: BTreeMap<String, Lease>,
    /// `P:job:{<id>}:beats`: `<worker>/<boot>` → its last beat on the job (ms).
    beats: BTreeMap<String, u64>,
    /// `P:job:{<id>}:redispatched`: seq → ms of the last copy published.
    redispatched: BTreeMap<u32, u64>,
    /// `P:job:{<id>}:copies`: seq → copies published.
    copies: BTreeMap<u32, u64>,
    /// `P:job:{<id>}:crashes`: seq → workers that died holding the item.
    crashes: BTreeMap<u32, u32>,
    /// `P:job:{<id>}:hist`: `(column, bin)` → rows (only counts above 0 are ever added).
    hist: BTreeMap<(usize, usize), u64>,
    /// `P:job:{<id>}:work` `deliveries`.
    deliveries: u64,
    /// `P:job:{<id>}:work` `rows_computed`.
    rows_computed: u64,
    /// `P:job:{<id>}:unable`: notes by worker.
    unable: BTreeMap<String, UnableNote>,
    /// `P:job:{<id>}:inputs`: path → JSON fingerprint.
    inputs: BTreeMap<String, String>,
    /// `P:job:{<id>}:tasks`: digest → the encoded task.
    tasks: BTreeMap<String, Vec<u8>>,
    /// `P:job:{<id>}:follower`: who holds the follower lease, until when (ms).
    follower: Option<(String, u64)>,
}

/// All jobs: the per-job state and the `P:jobs` sorted set.
#[derive(Debug, Default)]
struct State {
    /// Per-job state by job id.
    jobs: HashMap<String, JobState>,
    /// `P:jobs`: job id → created_ms (the sorted set's score).
    listed: HashMap<String, u64>,
    /// `P:pool:{pool}:jobs`: the active jobs of each pool, with their weights.
    active: HashMap<String, BTreeMap<String, u32>>,
    /// `P:pool:{pool}:retired`: the retired jobs of each pool, with when (ms).
    retired: HashMap<String, BTreeMap<String, u64>>,
    /// `P:job:{<id>}:sweeping`: jobs whose queue a sweep holds, until when (ms).
    sweeping: HashMap<String, u64>,
}

/// Job state in this process's memory; see the [module docs](self).
#[derive(Debug, Default)]
pub struct LocalStore {
    state: Mutex<State>,
}

/// The name a job's record goes by in errors (the Redis key, with `local` as prefix).
fn job_key(id: &str) -> String {
    format!("local:job:{id}")
}

/// Reads an integer hash field as `HINCRBY`/`HMGET` into a `u64` would: missing is 0.
fn field_u64(fields: &BTreeMap<String, String>, id: &str, field: &str) -> Result<u64, StoreError> {
    fields.get(field).map_or(Ok(0), |v| {
        v.parse().map_err(|_| StoreError::Corrupt {
            key: job_key(id),
            reason: format!("field {field} is not a number: {v}"),
        })
    })
}

/// Like Lua's `tonumber` on a hash field: `None` for a missing field or one
/// that is not a (finite) number.
fn lua_number(value: Option<&String>) -> Option<f64> {
    value
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|n| n.is_finite())
}

impl LocalStore {
    /// The state, locked. A panic while the lock was held (which no method
    /// does between checks and writes) does not make the store unusable.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// A job's state, created empty (as Redis creates a key on first write).
    fn entry(&mut self, id: &str) -> &mut JobState {
        self.jobs.entry(id.to_owned()).or_default()
    }

    /// HSET of the job record's fields plus ZADD to `P:jobs`.
    fn write_record<'a>(
        &mut self,
        id: &str,
        created_ms: u64,
        fields: impl IntoIterator<Item = (&'a str, String)>,
    ) {
        let job = self.entry(id);
        for (k, v) in fields {
            job.fields.insert(k.to_owned(), v);
        }
        self.listed.insert(id.to_owned(), created_ms);
    }
}

#[async_trait::async_trait]
impl JobStore for LocalStore {
    fn describe(&self) -> String {
        "memory (this process)".to_owned()
    }

    async fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        let state = self.lock();
        match state.jobs.get(id) {
            Some(job) if !job.fields.is_empty() => {
                JobRecord::from_fields(&job_key(id), &job.fields).map(Some)
            }
            _ => Ok(None),
        }
    }

    async fn put_job(&self, job: &JobRecord) -> Result<(), StoreError> {
        self.lock()
            .write_record(&job.id, job.created_ms, job.to_fields());
        Ok(())
    }

    async fn update_job(&self, id: &str, update: &RecordUpdate) -> Result<(), StoreError> {
        let mut state = self.lock();
        let job = state.entry(id);
        for (k, v) in update.fields() {
            job.fields.insert(k.to_owned(), v);
        }
        Ok(())
    }

    async fn progress(&self, id: &str) -> Result<Progress, StoreError> {
        let state = self.lock();
        let Some(job) = state.jobs.get(id) else {
            return Ok(Progress::default());
        };
        let v = |f: &str| field_u64(&job.fields, id, f);
        Ok(Progress {
            items_done: v("items_done")?,
            rows_done: v("rows_done")?,
            items_total: v("items_total")?,
            rows_total: v("rows_total")?,
            items_failed: job.failed.len() as u64,
            rows_rejected: v("rows_rejected")?,
            status: job
                .fields
                .get("status")
                .and_then(|s| JobStatus::from_name(s)),
        })
    }

    /// [`COMMIT_SCRIPT`](super::redis::COMMIT_SCRIPT).
    async fn commit_group(
        &self,
        job: &str,
        commits: &[Commit<'_>],
        work: Work,
    ) -> Result<Vec<bool>, StoreError> {
        let mut state = self.lock();
        let id = job;
        let job = state.entry(id);
        job.rows_computed = job.rows_computed.saturating_add(work.rows);
        job.deliveries = job.deliveries.saturating_add(work.deliveries);
        for c in commits.iter().filter(|c| c.leased) {
            job.leases
                .remove(&format!("{}@{}", c.stats.seq, c.stats.worker));
        }
        if matches!(
            job.fields.get("status").map(String::as_str),
            None | Some("cancelled")
        ) {
            return Ok(vec![false; commits.len()]);
        }
        // The counters are read (and checked) before anything else changes,
        // so a corrupt field leaves the items uncommitted.
        // Which win is decided once: a seq not done yet, its first commit
        // in the group.
        let mut seen = BTreeSet::new();
        let won: Vec<bool> = commits
            .iter()
            .map(|c| !job.done.contains(&c.stats.seq) && seen.insert(c.stats.seq))
            .collect();
        let winners = || {
            commits
                .iter()
                .zip(&won)
                .filter(|(_, w)| **w)
                .map(|(c, _)| c)
        };
        let add = |field: &str, by: u64| -> Result<(String, String), StoreError> {
            let now = field_u64(&job.fields, id, field)?;
            let sum = now.checked_add(by).ok_or_else(|| StoreError::Corrupt {
                key: job_key(id),
                reason: format!("field {field} would overflow: {now} + {by}"),
            })?;
            Ok((field.to_owned(), sum.to_string()))
        };
        let sum = |f: fn(&ItemStats) -> u64| winners().map(|c| f(c.stats)).sum::<u64>();
        let counters = [
            add("items_done", winners().count() as u64)?,
            add("rows_done", sum(|s| s.rows + s.rows_rejected))?,
            add("rows_rejected", sum(|s| s.rows_rejected))?,
        ];
        job.fields.extend(counters);
        for c in winners() {
            job.done.insert(c.stats.seq);
            job.stats.insert(c.stats.seq, c.stats.clone());
            if c.leased {
                job.failed.remove(&c.stats.seq);
            }
            for (col, column) in c.histogram.iter().enumerate() {
                for (b, &n) in column.iter().enumerate() {
                    if n > 0 {
                        let count = job.hist.entry((col, b)).or_default();
                        *count = count.saturating_add(n);
                    }
                }
            }
        }
        Ok(won)
    }

    /// [`fail_script`](super::redis::fail_script).
    async fn fail_item(&self, job: &str, failure: &ItemFailure) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        if job.done.contains(&failure.seq) {
            return Ok(false);
        }
        job.failed.insert(failure.seq, failure.clone());
        Ok(true)
    }

    async fn failures(&self, job: &str) -> Result<Vec<ItemFailure>, StoreError> {
        let state = self.lock();
        Ok(state
            .jobs
            .get(job)
            .map(|j| j.failed.values().cloned().collect())
            .unwrap_or_default())
    }

    async fn clear_failures(&self, job: &str) -> Result<(), StoreError> {
        if let Some(job) = self.lock().jobs.get_mut(job) {
            job.failed.clear();
            job.crashes.clear();
        }
        Ok(())
    }

    async fn clear_failure(&self, job: &str, seq: u32) -> Result<(), StoreError> {
        if let Some(job) = self.lock().jobs.get_mut(job) {
            job.failed.remove(&seq);
            job.crashes.remove(&seq);
        }
        Ok(())
    }

    async fn is_done(&self, job: &str, seq: u32) -> Result<bool, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .is_some_and(|j| j.done.contains(&seq)))
    }

    async fn done_among(&self, job: &str, seqs: &[u32]) -> Result<HashSet<u32>, StoreError> {
        let state = self.lock();
        let Some(job) = state.jobs.get(job) else {
            return Ok(HashSet::new());
        };
        Ok(seqs
            .iter()
            .copied()
            .filter(|s| job.done.contains(s))
            .collect())
    }

    async fn done_items(&self, job: &str) -> Result<HashSet<u32>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.done.iter().copied().collect())
            .unwrap_or_default())
    }

    async fn item_stats(&self, job: &str) -> Result<Vec<ItemStats>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.stats.values().cloned().collect())
            .unwrap_or_default())
    }

    /// Up to `n` items, spread evenly over the committed ones.
    async fn sample_item_stats(&self, job: &str, n: usize) -> Result<Vec<ItemStats>, StoreError> {
        let state = self.lock();
        let Some(j) = state.jobs.get(job) else {
            return Ok(Vec::new());
        };
        let step = j.stats.len().div_ceil(n.max(1)).max(1);
        Ok(j.stats.values().step_by(step).cloned().collect())
    }

    /// [`start_script`](super::redis::start_script), checks in the same order.
    async fn start_item(
        &self,
        job: &str,
        lease: &Lease,
        claim: &Claim<'_>,
    ) -> Result<Start, StoreError> {
        let mut state = self.lock();
        let id = job;
        let Some(job) = state.jobs.get_mut(id) else {
            return Ok(Start::UnknownJob);
        };
        let Some(status) = job.fields.get("status").cloned() else {
            return Ok(Start::UnknownJob);
        };
        let recorded = |f: &str| job.fields.get(f).cloned().unwrap_or_default();
        for (field, claimed) in [
            ("pool", claim.pool),
            ("model", claim.model),
            ("model_sha256", claim.model_sha256),
            ("output_dir", claim.output_dir),
        ] {
            if job.fields.get(field).map(String::as_str) != Some(claimed) {
                return Ok(Start::Mismatch {
                    field: field.to_owned(),
                    recorded: recorded(field),
                });
            }
        }
        let total = lua_number(job.fields.get("items_total")).unwrap_or(0.0);
        if f64::from(lease.seq) >= total {
            return Ok(Start::Mismatch {
                field: "items_total".to_owned(),
                recorded: recorded("items_total"),
            });
        }
        if job.done.contains(&lease.seq) {
            return Ok(Start::Done);
        }
        if status == "failed" || status == "cancelled" {
            return Ok(Start::JobFailed);
        }
        if job.failed.contains_key(&lease.seq) {
            return Ok(Start::FailedForGood);
        }
        if status != "planning" && status != "running" {
            return match JobStatus::from_name(&status) {
                Some(s) => Ok(Start::NotRunning(s)),
                None => Err(StoreError::Corrupt {
                    key: job_key(id),
                    reason: format!("unknown status {status}"),
                }),
            };
        }
        let now = crate::host::now_ms();
        let max = lua_number(job.fields.get("max_crashes")).map_or(2, |n| n as u32);
        let own = lease.field();
        let prefix = format!("{}@", lease.seq);
        let (mut workers, mut wait) = (Vec::new(), 0);
        let others: Vec<Lease> = job
            .leases
            .iter()
            .filter(|(f, l)| f.starts_with(&prefix) && (**f != own || l.boot != lease.boot))
            .map(|(_, l)| l.clone())
            .collect();
        for mut other in others {
            if let Some(beat) = job.beats.get(&other.holder()) {
                other.heartbeat_ms = other.heartbeat_ms.max(*beat);
            }
            if other.is_stale(now) {
                job.leases.remove(&other.field());
                // A worker stopped from outside while it drained is no crash.
                if !other.stopping {
                    *job.crashes.entry(lease.seq).or_default() += 1;
                    workers.push(other.worker);
                }
            } else if claim.returned {
                let left = (other.heartbeat_ms + other.ttl_ms).saturating_sub(now);
                wait = wait.max(left + 1);
            }
        }
        let crashes = job.crashes.get(&lease.seq).copied().unwrap_or(0);
        if max > 0 && crashes >= max {
            return Ok(Start::Crashed { crashes, workers });
        }
        if wait > 0 {
            return Ok(Start::Held { wait_ms: wait });
        }
        let mut held = lease.clone();
        held.started_ms = now;
        held.heartbeat_ms = now;
        job.leases.insert(own, held);
        job.deliveries = job.deliveries.saturating_add(1);
        Ok(Start::Started {
            at_ms: now,
            crashes,
        })
    }

    /// [`lease_script`](super::redis::lease_script).
    async fn heartbeat(&self, job: &str, lease: &Lease, held_ms: u64) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        if job.done.contains(&lease.seq)
            || job.fields.get("status").map(String::as_str) == Some("cancelled")
        {
            return Ok(false);
        }
        let mut held = lease.clone();
        held.heartbeat_ms = crate::host::now_ms();
        if held.started_ms == 0 {
            held.started_ms = held.heartbeat_ms.saturating_sub(held_ms).max(1);
        }
        job.leases.insert(lease.field(), held);
        Ok(true)
    }

    /// [`beat_script`](super::redis::beat_script).
    async fn beat(&self, job: &str, fields: &[String]) -> Result<(), StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        let now = crate::host::now_ms();
        for field in fields {
            job.beats.insert(field.clone(), now);
        }
        Ok(())
    }

    async fn beats(&self, job: &str) -> Result<BTreeMap<String, u64>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.beats.clone())
            .unwrap_or_default())
    }

    async fn now_ms(&self) -> Result<u64, StoreError> {
        Ok(crate::host::now_ms())
    }

    /// [`FAIL_JOB_SCRIPT`](super::redis::FAIL_JOB_SCRIPT).
    async fn fail_job(&self, job: &str, class: &str, reason: &str) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let Some(job) = state.jobs.get_mut(job) else {
            return Ok(false);
        };
        if !matches!(
            job.fields.get("status").map(String::as_str),
            Some("planning" | "running")
        ) {
            return Ok(false);
        }
        let to = if class == "cancelled" {
            JobStatus::Cancelled
        } else {
            JobStatus::Failed
        };
        for (k, v) in [
            ("status", to.as_str()),
            ("failed_class", class),
            ("failed_reason", reason),
        ] {
            job.fields.insert(k.to_owned(), v.to_owned());
        }
        Ok(true)
    }

    /// [`PUBLISHED_SCRIPT`](super::redis::PUBLISHED_SCRIPT).
    async fn mark_published(&self, job: &str, at_ms: u64, items: u64) -> Result<(), StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        job.fields
            .insert("published_ms".to_owned(), at_ms.to_string());
        job.fields
            .insert("items_published".to_owned(), items.to_string());
        if job.fields.get("status").map(String::as_str) == Some("planning") {
            job.fields
                .insert("status".to_owned(), JobStatus::Running.as_str().to_owned());
        }
        Ok(())
    }

    async fn note_unable(
        &self,
        job: &str,
        worker: &str,
        note: &UnableNote,
    ) -> Result<(), StoreError> {
        self.lock()
            .entry(job)
            .unable
            .insert(worker.to_owned(), note.clone());
        Ok(())
    }

    async fn clear_unable(&self, job: &str, worker: &str) -> Result<(), StoreError> {
        if let Some(job) = self.lock().jobs.get_mut(job) {
            job.unable.remove(worker);
        }
        Ok(())
    }

    async fn clear_unable_notes(&self, job: &str) -> Result<(), StoreError> {
        if let Some(job) = self.lock().jobs.get_mut(job) {
            job.unable.clear();
        }
        Ok(())
    }

    async fn unable(&self, job: &str) -> Result<BTreeMap<String, UnableNote>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.unable.clone())
            .unwrap_or_default())
    }

    async fn drop_leases(&self, job: &str, fields: &[String]) -> Result<(), StoreError> {
        if let Some(job) = self.lock().jobs.get_mut(job) {
            for f in fields {
                job.leases.remove(f);
            }
        }
        Ok(())
    }

    async fn crashes(&self, job: &str) -> Result<BTreeMap<u32, u32>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.crashes.clone())
            .unwrap_or_default())
    }

    /// [`CRASH_SCRIPT`](super::redis::CRASH_SCRIPT).
    async fn count_crashes(
        &self,
        job: &str,
        fields: &[String],
    ) -> Result<BTreeMap<u32, u32>, StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        let mut counts = BTreeMap::new();
        for f in fields {
            let Some(seq) = f.split_once('@').and_then(|(s, _)| s.parse::<u32>().ok()) else {
                continue;
            };
            if job.leases.remove(f).is_some_and(|l| !l.stopping) {
                *job.crashes.entry(seq).or_default() += 1;
            }
            counts.insert(seq, job.crashes.get(&seq).copied().unwrap_or(0));
        }
        Ok(counts)
    }

    async fn leases(&self, job: &str) -> Result<Vec<Lease>, StoreError> {
        let mut leases: Vec<Lease> = self
            .lock()
            .jobs
            .get(job)
            .map(|j| {
                j.leases
                    .values()
                    .map(|l| {
                        let mut l = l.clone();
                        if let Some(beat) = j.beats.get(&l.holder()) {
                            l.heartbeat_ms = l.heartbeat_ms.max(*beat);
                        }
                        l
                    })
                    .collect()
            })
            .unwrap_or_default();
        leases.sort_by(|a, b| (a.seq, &a.worker).cmp(&(b.seq, &b.worker)));
        Ok(leases)
    }

    async fn histogram(&self, job: &str, bins: usize) -> Result<Vec<Vec<u64>>, StoreError> {
        let state = self.lock();
        let mut counts: Vec<Vec<u64>> = Vec::new();
        let Some(state) = state.jobs.get(job) else {
            return Ok(counts);
        };
        for (&(col, bin), &n) in &state.hist {
            // Only a `bins` other than the commits' can put a bin out of
            // range; Redis answers that with this error too.
            if bin >= bins {
                return Err(StoreError::Corrupt {
                    key: format!("{}:hist", job_key(job)),
                    reason: format!("unexpected field {col}:{bin}"),
                });
            }
            if counts.len() <= col {
                counts.resize(col + 1, vec![0; bins]);
            }
            counts[col][bin] = n;
        }
        Ok(counts)
    }

    async fn count_work(&self, job: &str, deliveries: u64, rows: u64) -> Result<(), StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        job.deliveries = job.deliveries.saturating_add(deliveries);
        job.rows_computed = job.rows_computed.saturating_add(rows);
        Ok(())
    }

    async fn work(&self, job: &str) -> Result<(u64, u64), StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map_or((0, 0), |j| (j.deliveries, j.rows_computed)))
    }

    async fn redispatched(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.redispatched.clone())
            .unwrap_or_default())
    }

    async fn mark_redispatched(&self, job: &str, seq: u32, at_ms: u64) -> Result<u64, StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        job.redispatched.insert(seq, at_ms);
        let copies = job.copies.entry(seq).or_default();
        *copies = copies.saturating_add(1);
        Ok(*copies)
    }

    async fn copies(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.copies.clone())
            .unwrap_or_default())
    }

    async fn restore_job(&self, job: &JobRecord) -> Result<(), StoreError> {
        let fields = job
            .to_fields()
            .into_iter()
            .filter(|(k, _)| !matches!(*k, "items_done" | "rows_done" | "rows_rejected"));
        self.lock().write_record(&job.id, job.created_ms, fields);
        Ok(())
    }

    /// Newest first as `ZREVRANGE P:jobs 0 (limit - 1)`: by created_ms, ties
    /// by id, descending; like Redis's, a `limit` of 0 still lists one job.
    async fn recent_jobs(&self, limit: usize) -> Result<Vec<String>, StoreError> {
        let state = self.lock();
        let mut jobs: Vec<(u64, &String)> = state.listed.iter().map(|(id, &ms)| (ms, id)).collect();
        jobs.sort_unstable_by(|a, b| b.cmp(a));
        Ok(jobs
            .into_iter()
            .take(limit.max(1))
            .map(|(_, id)| id.clone())
            .collect())
    }

    async fn delete_job(&self, id: &str) -> Result<(), StoreError> {
        let mut state = self.lock();
        state.jobs.remove(id);
        state.listed.remove(id);
        Ok(())
    }

    async fn put_inputs(&self, job: &str, inputs: &[(String, String)]) -> Result<(), StoreError> {
        let mut state = self.lock();
        let job = state.entry(job);
        for (path, fingerprint) in inputs {
            job.inputs.insert(path.clone(), fingerprint.clone());
        }
        Ok(())
    }

    async fn inputs(&self, job: &str) -> Result<BTreeMap<String, String>, StoreError> {
        Ok(self
            .lock()
            .jobs
            .get(job)
            .map(|j| j.inputs.clone())
            .unwrap_or_default())
    }

    async fn put_task(
        &self,
        job: &str,
        task: &crate::message::StoredTask,
    ) -> Result<(), StoreError> {
        let mut state = self.lock();
        state
            .entry(job)
            .tasks
            .insert(task.sha256.clone(), task.bytes.clone());
        Ok(())
    }

    async fn task(&self, job: &str, sha256: &str) -> Result<TaskLookup, StoreError> {
        let state = self.lock();
        let Some(job) = state
            .jobs
            .get(job)
            .filter(|j| j.fields.contains_key("status"))
        else {
            return Ok(TaskLookup::UnknownJob);
        };
        Ok(match job.tasks.get(sha256) {
            Some(bytes) => TaskLookup::Found(bytes.clone()),
            None => TaskLookup::NotOfJob,
        })
    }

    /// Local state lives as long as the process: nothing to expire.
    async fn expire_job(&self, _job: &str, _ttl: std::time::Duration) -> Result<(), StoreError> {
        Ok(())
    }

    async fn persist_job(&self, _job: &str) -> Result<(), StoreError> {
        Ok(())
    }

    async fn eviction_policy(&self) -> Result<Option<String>, StoreError> {
        Ok(None)
    }

    /// [`FOLLOW_SCRIPT`](super::redis::FOLLOW_SCRIPT).
    async fn follow_lease(
        &self,
        job: &str,
        who: &str,
        ttl: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let now = crate::host::now_ms();
        let mut state = self.lock();
        let job = state.entry(job);
        if let Some((holder, until)) = &job.follower {
            if holder != who && *until > now {
                return Ok(false);
            }
        }
        job.follower = Some((who.to_owned(), now + ttl.as_millis() as u64));
        Ok(true)
    }

    async fn release_follow(&self, job: &str, who: &str) -> Result<(), StoreError> {
        let mut state = self.lock();
        if let Some(job) = state.jobs.get_mut(job) {
            if job.follower.as_ref().is_some_and(|(h, _)| h == who) {
                job.follower = None;
            }
        }
        Ok(())
    }

    async fn activate_job(&self, pool: &str, job: &str, weight: u32) -> Result<(), StoreError> {
        self.lock()
            .active
            .entry(pool.to_owned())
            .or_default()
            .insert(job.to_owned(), weight);
        Ok(())
    }

    async fn forget_retired(&self, pool: &str, job: &str) -> Result<bool, StoreError> {
        Ok(self
            .lock()
            .retired
            .get_mut(pool)
            .is_some_and(|retired| retired.remove(job).is_some()))
    }

    async fn note_retired(&self, pool: &str, job: &str) -> Result<(), StoreError> {
        self.lock()
            .retired
            .entry(pool.to_owned())
            .or_default()
            .insert(job.to_owned(), crate::host::now_ms());
        Ok(())
    }

    async fn take_retired(
        &self,
        pool: &str,
        grace: std::time::Duration,
        limit: usize,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let mut state = self.lock();
        let Some(retired) = state.retired.get_mut(pool) else {
            return Ok(Vec::new());
        };
        let now = crate::host::now_ms();
        let before = now.saturating_sub(grace.as_millis() as u64);
        let mut due: Vec<(u64, String)> = retired
            .iter()
            .filter(|(_, at)| **at <= before)
            .map(|(job, at)| (*at, job.clone()))
            .collect();
        due.sort();
        due.truncate(limit.max(1));
        for (_, job) in &due {
            retired.insert(job.clone(), now);
        }
        Ok(due.into_iter().map(|(_, job)| (job, now)).collect())
    }

    async fn drop_retired(&self, pool: &str, job: &str, claim: u64) -> Result<(), StoreError> {
        if let Some(retired) = self.lock().retired.get_mut(pool) {
            if retired.get(job) == Some(&claim) {
                retired.remove(job);
            }
        }
        Ok(())
    }

    async fn fence_sweep(&self, job: &str, ttl: std::time::Duration) -> Result<bool, StoreError> {
        let now = crate::host::now_ms();
        let mut state = self.lock();
        if state.sweeping.get(job).is_some_and(|until| *until > now) {
            return Ok(false);
        }
        state
            .sweeping
            .insert(job.to_owned(), now + ttl.as_millis() as u64);
        Ok(true)
    }

    async fn unfence_sweep(&self, job: &str) -> Result<(), StoreError> {
        self.lock().sweeping.remove(job);
        Ok(())
    }

    async fn is_swept(&self, job: &str) -> Result<bool, StoreError> {
        let now = crate::host::now_ms();
        Ok(self
            .lock()
            .sweeping
            .get(job)
            .is_some_and(|until| *until > now))
    }

    async fn deactivate_job(&self, pool: &str, job: &str) -> Result<(), StoreError> {
        if let Some(jobs) = self.lock().active.get_mut(pool) {
            jobs.remove(job);
        }
        Ok(())
    }

    async fn active_jobs(&self, pool: &str) -> Result<BTreeMap<String, u32>, StoreError> {
        Ok(self.lock().active.get(pool).cloned().unwrap_or_default())
    }

    /// [`reduce_script`](super::redis::reduce_script).
    async fn claim_reduce(
        &self,
        job: &str,
        who: &str,
        stale: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let now = crate::host::now_ms();
        let mut state = self.lock();
        let Some(job) = state.jobs.get_mut(job) else {
            return Ok(false);
        };
        let field = |k: &str| job.fields.get(k).cloned().unwrap_or_default();
        let status = field("status");
        let finished = field("finished_ms").parse::<u64>().unwrap_or(0);
        if status != "planning" && status != "running" && finished > 0 {
            return Ok(false);
        }
        let (reducer, since) = (
            field("reducer"),
            field("reducer_ms").parse::<u64>().unwrap_or(0),
        );
        if !reducer.is_empty()
            && reducer != who
            && now.saturating_sub(since) < stale.as_millis() as u64
        {
            return Ok(false);
        }
        job.fields.insert("reducer".into(), who.to_owned());
        job.fields.insert("reducer_ms".into(), now.to_string());
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    //! What `shared/tests/it/store.rs` (run against both implementations)
    //! does not cover.
    use super::*;
    use crate::store::Store;

    fn record(id: &str, created_ms: u64) -> JobRecord {
        JobRecord {
            max_failed_items: Some(1),
            max_failed_percent: Some(2.5),
            created_ms,
            merge: true,
            ..JobRecord::sample(id)
        }
    }

    fn stats(seq: u32, worker: &str, rows: u64, rejected: u64) -> ItemStats {
        ItemStats {
            seq,
            rows,
            rows_rejected: rejected,
            worker: worker.into(),
            started_ms: 1,
            finished_ms: 2,
            attempt: 1,
            recovered: false,
            rows_resumed: 0,
            vector: None,
            shadow: None,
        }
    }

    /// Writes a raw field of a job's record, as `HSET` would: what no
    /// update of a job writes (a corrupt or hand-edited record).
    fn poke(store: &LocalStore, id: &str, field: &str, value: &str) {
        let mut state = store.lock();
        state
            .entry(id)
            .fields
            .insert(field.to_owned(), value.to_owned());
    }

    fn lease(seq: u32, worker: &str) -> Lease {
        Lease {
            seq,
            worker: worker.into(),
            attempt: 1,
            started_ms: 1,
            heartbeat_ms: 1,
            ttl_ms: 15_000,
            rows_done: 0,
            rows: 100,
            rows_resumed: 0,
            acked: false,
            boot: String::new(),
            stopping: false,
        }
    }

    fn claim() -> Claim<'static> {
        Claim {
            pool: "p",
            model: "/m.pt",
            model_sha256: "ab",
            output_dir: "/o",
            returned: false,
        }
    }

    #[tokio::test]
    async fn a_job_round_trips_and_unknown_jobs_read_empty() {
        let store = Store::local();
        assert_eq!(store.describe(), "memory (this process)");
        assert_eq!(store.job("j").await.unwrap(), None);
        assert_eq!(store.progress("j").await.unwrap(), Progress::default());
        assert_eq!(store.work("j").await.unwrap(), (0, 0));
        assert!(store.histogram("j", 3).await.unwrap().is_empty());
        assert!(store.done_among("j", &[0, 1]).await.unwrap().is_empty());
        let r = record("j", 5);
        store.put_job(&r).await.unwrap();
        assert_eq!(store.job("j").await.unwrap(), Some(r));
        let p = store.progress("j").await.unwrap();
        assert_eq!(
            (p.items_total, p.rows_total, p.status),
            (3, 300, Some(JobStatus::Planning))
        );
    }

    #[tokio::test]
    async fn fields_set_on_an_unknown_job_make_a_corrupt_record() {
        let local = std::sync::Arc::new(LocalStore::default());
        let store = Store::from_backend(local.clone());
        store
            .update_job("j", &RecordUpdate::Replayed { model_sha256: None })
            .await
            .unwrap();
        let err = store.job("j").await.unwrap_err().to_string();
        assert!(err.contains("local:job:j") && err.contains("id"), "{err}");
        // Fields without a status (a commit of an unknown job) are no job to start.
        store
            .commit_item("k", &stats(0, "w", 1, 0), &[])
            .await
            .unwrap();
        assert_eq!(
            store
                .start_item("k", &lease(0, "w"), &claim())
                .await
                .unwrap(),
            Start::UnknownJob
        );
        // update_job writes like HSET: other fields stay.
        store.put_job(&record("r", 1)).await.unwrap();
        let finished = RecordUpdate::Finished {
            status: JobStatus::Completed,
            at_ms: 9,
        };
        store.update_job("r", &finished).await.unwrap();
        let job = store.job("r").await.unwrap().unwrap();
        assert_eq!(
            (job.finished_ms, job.status, job.rows_total),
            (9, JobStatus::Completed, 300)
        );
        poke(&local, "r", "status", "paused");
        assert_eq!(store.progress("r").await.unwrap().status, None);
        assert!(matches!(
            store.start_item("r", &lease(0, "w"), &claim()).await,
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[tokio::test]
    async fn commits_count_rows_and_rejects_and_merge_histograms() {
        let store = Store::local();
        store.put_job(&record("j", 1)).await.unwrap();
        assert!(store
            .commit_item("j", &stats(0, "w", 90, 10), &[vec![1, 0, 2], vec![0, 0, 0]])
            .await
            .unwrap());
        assert!(store
            .commit_item("j", &stats(1, "w", 50, 0), &[vec![0, 3, 1]])
            .await
            .unwrap());
        // A losing commit adds nothing, and its stats do not replace the winner's.
        assert!(!store
            .commit_item("j", &stats(1, "w2", 7, 7), &[vec![100, 100, 100]])
            .await
            .unwrap());
        let job = store.job("j").await.unwrap().unwrap();
        assert_eq!(
            (job.items_done, job.rows_done, job.rows_rejected),
            (2, 150, 10)
        );
        assert_eq!(store.histogram("j", 3).await.unwrap(), vec![vec![1, 3, 3]]);
        let stats = store.item_stats("j").await.unwrap();
        assert_eq!(
            stats
                .iter()
                .map(|s| (s.seq, s.worker.as_str()))
                .collect::<Vec<_>>(),
            vec![(0, "w"), (1, "w")]
        );
        // A column after an empty one: the empty one is there, all zeros.
        store
            .commit_item("j", &stats_of(2), &[vec![0, 0, 0], vec![0, 0, 4]])
            .await
            .unwrap();
        assert_eq!(
            store.histogram("j", 3).await.unwrap(),
            vec![vec![1, 3, 3], vec![0, 0, 4]]
        );
        // Fewer bins than the commits used: the field is out of range, as in Redis.
        let err = store.histogram("j", 2).await.unwrap_err().to_string();
        assert!(err.contains("local:job:j:hist"), "{err}");
        assert_eq!(
            store.done_among("j", &[0, 2, 5]).await.unwrap(),
            HashSet::from([0, 2])
        );
        assert_eq!(
            store.done_items("j").await.unwrap(),
            HashSet::from([0, 1, 2])
        );
    }

    fn stats_of(seq: u32) -> ItemStats {
        stats(seq, "w", 1, 0)
    }

    #[tokio::test]
    async fn any_commit_drops_its_committers_lease_and_heartbeats_stop_at_done() {
        let store = Store::local();
        store.put_job(&record("j", 1)).await.unwrap();
        for w in ["a", "b"] {
            assert!(matches!(
                store.start_item("j", &lease(0, w), &claim()).await.unwrap(),
                Start::Started { .. }
            ));
        }
        // Planning counts as running for a start.
        assert_eq!(store.work("j").await.unwrap(), (2, 0));
        store.commit_item("j", &stats_of(0), &[]).await.unwrap();
        let left: Vec<_> = store.leases("j").await.unwrap();
        assert_eq!(
            left.iter().map(|l| l.worker.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert!(!store
            .commit_item("j", &stats(0, "a", 1, 0), &[])
            .await
            .unwrap());
        let left = store.leases("j").await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].worker, "b");
        // b's heartbeat writes nothing now that the item is done.
        let mut beat = left[0].clone();
        beat.rows_done = 50;
        assert!(!store.heartbeat("j", &beat, 0).await.unwrap());
        assert_eq!(store.leases("j").await.unwrap()[0].rows_done, 0);
        store.release("j", &beat).await.unwrap();
        assert!(store.leases("j").await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn leases_are_in_seq_order_and_a_heartbeat_keeps_the_start() {
        let local = std::sync::Arc::new(LocalStore::default());
        let store = Store::from_backend(local.clone());
        store.put_job(&record("j", 1)).await.unwrap();
        poke(&local, "j", "items_total", "20");
        for (seq, w) in [(10, "a"), (2, "b"), (2, "a")] {
            store
                .start_item("j", &lease(seq, w), &claim())
                .await
                .unwrap();
        }
        let order: Vec<_> = store
            .leases("j")
            .await
            .unwrap()
            .into_iter()
            .map(|l| (l.seq, l.worker))
            .collect();
        assert_eq!(order, [(2, "a".into()), (2, "b".into()), (10, "a".into())]);
        // A heartbeat writes the lease it is given, with the heartbeat on the clock.
        let before = store.now_ms().await.unwrap();
        let mut beat = lease(10, "a");
        beat.started_ms = 3;
        beat.rows_done = 40;
        assert!(store.heartbeat("j", &beat, 0).await.unwrap());
        let l = store.leases("j").await.unwrap().pop().unwrap();
        assert_eq!((l.started_ms, l.rows_done), (3, 40));
        assert!(l.heartbeat_ms >= before);
        store
            .drop_leases("j", &["2@a".into(), "2@b".into(), "9@x".into()])
            .await
            .unwrap();
        assert_eq!(store.leases("j").await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn publishing_runs_a_planning_job_but_never_revives_a_failed_one() {
        let store = Store::local();
        store.put_job(&record("j", 1)).await.unwrap();
        store.mark_published("j", 7, 3).await.unwrap();
        let job = store.job("j").await.unwrap().unwrap();
        assert_eq!(
            (job.status, job.published_ms, job.items_published),
            (JobStatus::Running, 7, 3)
        );
        store.put_job(&record("f", 1)).await.unwrap();
        assert!(store.fail_job("f", "unable", "no worker").await.unwrap());
        store.mark_published("f", 8, 3).await.unwrap();
        let job = store.job("f").await.unwrap().unwrap();
        assert_eq!((job.status, job.published_ms), (JobStatus::Failed, 8));
        // Only a planning or running job fails; an unknown one is not created.
        let completed = RecordUpdate::Finished {
            status: JobStatus::Completed,
            at_ms: 9,
        };
        store.update_job("j", &completed).await.unwrap();
        assert!(!store.fail_job("j", "budget", "x").await.unwrap());
        assert!(!store.fail_job("nope", "budget", "x").await.unwrap());
        assert_eq!(store.job("nope").await.unwrap(), None);
        assert!(store
            .recent_jobs(10)
            .await
            .unwrap()
            .iter()
            .all(|j| j != "nope"));
    }

    #[tokio::test]
    async fn restoring_a_job_keeps_the_counters_the_commits_made() {
        let store = Store::local();
        store.put_job(&record("j", 1)).await.unwrap();
        store
            .commit_item("j", &stats(0, "w", 90, 10), &[])
            .await
            .unwrap();
        let mut lost = record("j", 1);
        lost.status = JobStatus::Running;
        lost.items_done = 0;
        lost.rows_done = 0;
        lost.rows_rejected = 0;
        lost.items_published = 3;
        store.restore_job(&lost).await.unwrap();
        let job = store.job("j").await.unwrap().unwrap();
        assert_eq!(
            (job.items_done, job.rows_done, job.rows_rejected),
            (1, 100, 10)
        );
        assert_eq!((job.status, job.items_published), (JobStatus::Running, 3));
        // Restoring a job nothing is known of lists it, counters absent (0).
        store.restore_job(&record("k", 2)).await.unwrap();
        let job = store.job("k").await.unwrap().unwrap();
        assert_eq!((job.items_done, job.status), (0, JobStatus::Planning));
        assert_eq!(store.recent_jobs(10).await.unwrap(), ["k", "j"]);
    }

    #[tokio::test]
    async fn recent_jobs_are_newest_first_and_deleting_forgets_everything() {
        let store = Store::local();
        for (id, ms) in [("a", 5), ("b", 9), ("c", 5), ("d", 1)] {
            store.put_job(&record(id, ms)).await.unwrap();
        }
        assert_eq!(store.recent_jobs(10).await.unwrap(), ["b", "c", "a", "d"]);
        assert_eq!(store.recent_jobs(2).await.unwrap(), ["b", "c"]);
        // ZREVRANGE 0 0, as the Redis implementation asks for a limit of 0.
        assert_eq!(store.recent_jobs(0).await.unwrap(), ["b"]);
        // Writing the record again moves it by its new created_ms.
        store.put_job(&record("d", 10)).await.unwrap();
        assert_eq!(store.recent_jobs(1).await.unwrap(), ["d"]);

        store
            .start_item("b", &lease(0, "w"), &claim())
            .await
            .unwrap();
        store
            .commit_item("b", &stats_of(1), &[vec![1]])
            .await
            .unwrap();
        store
            .fail_item(
                "b",
                &ItemFailure {
                    seq: 2,
                    class: "poison".into(),
                    reason: "r".into(),
                    worker: "w".into(),
                    attempt: 1,
                    at_ms: 1,
                },
            )
            .await
            .unwrap();
        store.mark_redispatched("b", 0, 4).await.unwrap();
        store.count_work("b", 2, 30).await.unwrap();
        let note = UnableNote {
            class: "unable".into(),
            reason: "r".into(),
            since_ms: 1,
            until_ms: 2,
        };
        store.note_unable("b", "w", &note).await.unwrap();
        assert_eq!(store.work("b").await.unwrap(), (3, 30));
        assert_eq!(
            store.redispatched("b").await.unwrap(),
            BTreeMap::from([(0, 4)])
        );
        store.delete_job("b").await.unwrap();
        assert_eq!(store.job("b").await.unwrap(), None);
        assert!(store.leases("b").await.unwrap().is_empty());
        assert!(store.done_items("b").await.unwrap().is_empty());
        assert!(store.item_stats("b").await.unwrap().is_empty());
        assert!(store.failures("b").await.unwrap().is_empty());
        assert!(store.histogram("b", 1).await.unwrap().is_empty());
        assert!(store.redispatched("b").await.unwrap().is_empty());
        assert!(store.copies("b").await.unwrap().is_empty());
        assert!(store.unable("b").await.unwrap().is_empty());
        assert_eq!(store.work("b").await.unwrap(), (0, 0));
        assert_eq!(store.recent_jobs(10).await.unwrap(), ["d", "c", "a"]);
    }

    #[tokio::test]
    async fn single_failures_and_notes_are_forgotten_one_by_one() {
        let store = Store::local();
        store.put_job(&record("j", 1)).await.unwrap();
        let failure = |seq| ItemFailure {
            seq,
            class: "poison".into(),
            reason: "r".into(),
            worker: "w".into(),
            attempt: 1,
            at_ms: 1,
        };
        for seq in [2, 0] {
            assert!(store.fail_item("j", &failure(seq)).await.unwrap());
        }
        store.clear_failure("j", 2).await.unwrap();
        assert_eq!(store.failures("j").await.unwrap(), [failure(0)]);
        let note = |class: &str| UnableNote {
            class: class.into(),
            reason: "r".into(),
            since_ms: 1,
            until_ms: 2,
        };
        store.note_unable("j", "a", &note("unable")).await.unwrap();
        store
            .note_unable("j", "b", &note("disk_full"))
            .await
            .unwrap();
        store.clear_unable("j", "a").await.unwrap();
        assert_eq!(
            store.unable("j").await.unwrap(),
            BTreeMap::from([("b".to_owned(), note("disk_full"))])
        );
    }

    #[tokio::test]
    async fn an_items_total_that_is_not_a_number_refuses_every_seq() {
        let local = std::sync::Arc::new(LocalStore::default());
        let store = Store::from_backend(local.clone());
        store.put_job(&record("j", 1)).await.unwrap();
        poke(&local, "j", "items_total", "many");
        assert_eq!(
            store
                .start_item("j", &lease(0, "w"), &claim())
                .await
                .unwrap(),
            Start::Mismatch {
                field: "items_total".into(),
                recorded: "many".into()
            }
        );
    }
}
