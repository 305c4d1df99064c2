//! The job store: job records, progress and the "first commit wins" done set,
//! behind one interface ([`JobStore`]) with two implementations — Redis
//! ([`redis`], the fleet's) and in-process memory ([`local`], for
//! `batchfleet run --local`). Code outside this module holds a [`Store`]
//! and never names either.
//!
//! # Layout
//! - this file: the [`JobStore`] seam, the [`Store`] handle, what a commit,
//!   a failure and a lease record.
//! - [`record`]: a job's record, its hash-field encoding and the typed
//!   updates each step makes ([`RecordUpdate`]).
//! - [`error`]: [`StoreError`], and whether retrying can help.
//! - [`redis`]: the fleet's store (connections, key layout, Lua scripts).
//! - [`local`]: the in-process store of `run --local`.
//!
//! # Keys (Redis; prefix `P`, default `bf`)
//! | key | type | holds |
//! | --- | --- | --- |
//! | `P:jobs` | sorted set | job ids by creation time (ms) |
//! | `P:job:{<id>}` | hash | [`JobRecord`] fields: status, totals, counters, timestamps |
//! | `P:job:{<id>}:done` | set | seqs of committed items |
//! | `P:job:{<id>}:stats` | hash | seq → JSON [`ItemStats`] of the commit that won |
//! | `P:job:{<id>}:failed` | hash | seq → JSON [`ItemFailure`] of items that failed for good |
//! | `P:job:{<id>}:leases` | hash | `<seq>@<worker>` → JSON [`Lease`] of items being processed |
//! | `P:job:{<id>}:beats` | hash | `<worker>/<boot>` → its last beat on the job (ms, Redis's clock): keeps its leases live |
//! | `P:job:{<id>}:redispatched` | hash | seq → ms when the coordinator last published a copy |
//! | `P:job:{<id>}:hist` | hash | `<column>:<bin>` → rows whose prediction fell in the bin (committed items only) |
//! | `P:job:{<id>}:work` | hash | `deliveries` (items started), `rows_computed` (rows through the model, wasted work included) |
//! | `P:job:{<id>}:copies` | hash | seq → how many copies the coordinator published (bounded: see the supervisor) |
//! | `P:job:{<id>}:crashes` | hash | seq → how many workers died holding the item (leased); at the job's `max_crashes` it is dead-lettered as `crash` |
//! | `P:job:{<id>}:unable` | hash | worker → JSON [`UnableNote`]: a worker that cannot take the job's items for now (no CUDA device, disk full) |
//! | `P:job:{<id>}:inputs` | hash | input path → JSON fingerprint (size, version) when the job was planned |
//! | `P:pool:<pool>:jobs` | hash | job id → share weight of the pool's active jobs: the job queues its workers consume |
//! | `P:pool:<pool>:retired` | sorted set | job ids taken off the active jobs, by when (ms, Redis's clock; a sweep's claim moves it on): their queues, deleted a grace later ([`crate::retire`]) |
//! | `P:job:{<id>}:sweeping` | string, TTL | a sweep is deleting the job's queue ([`JobStore::fence_sweep`]) |
//! | `P:job:{<id>}:tasks` | hash | hex SHA-256 → the job's task, encoded ([`crate::message::StoredTask`]); version 3 messages name it by digest |
//!
//! The braces around the id are a Redis Cluster hash tag: every key of one
//! job hashes to the id's slot, so the scripts that touch several of them
//! at once stay within one slot.
//!
//! Lease times (`started_ms`, `heartbeat_ms`) are Redis's own clock (`TIME`),
//! set inside the scripts that write leases, and the coordinator judges
//! them against the same clock ([`Store::now_ms`]): a worker whose clock is
//! off cannot make a live lease look stale, or a dead one look alive.
//!
//! `items_done` and `rows_done` are only ever changed by [`COMMIT_SCRIPT`], in the
//! same atomic step that adds the seq to the done set, so a redelivered item can
//! never be counted twice. Output files remain the source of truth: every
//! committed item has its part file published before it is marked done.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

mod error;
pub mod local;
mod record;
pub mod redis;

pub use error::StoreError;
pub use record::{JobRecord, JobStatus, Pace, RecordUpdate, DEFAULT_MAX_CRASHES};

/// One item's commit, in a group ([`JobStore::commit_group`]).
#[derive(Debug, Clone, Copy)]
pub struct Commit<'a> {
    /// What the committing worker recorded about the item.
    pub stats: &'a ItemStats,
    /// The item's prediction histogram, `counts[column][bin]`.
    pub histogram: &'a [Vec<u64>],
    /// Whether the committer may hold a lease on the item (to drop) and the
    /// item may have failed before (a failure to forget if it wins). False
    /// only for an item started without the start script and never
    /// leased: neither can exist, and the commit writes neither.
    pub leased: bool,
}

/// What the worker whose commit won recorded about an item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemStats {
    /// Item seq.
    pub seq: u32,
    /// Rows predicted.
    pub rows: u64,
    /// Rows rejected (written to the item's rejects file).
    #[serde(default)]
    pub rows_rejected: u64,
    /// Worker id.
    pub worker: String,
    /// Processing start (ms since epoch).
    pub started_ms: u64,
    /// Commit time (ms since epoch).
    pub finished_ms: u64,
    /// Delivery attempt that committed.
    pub attempt: u32,
    /// True when the part file was found already published (a previous attempt
    /// died between publishing and marking done) and only the mark was redone.
    pub recovered: bool,
    /// Rows not recomputed because an earlier delivery's checkpoint held them.
    #[serde(default)]
    pub rows_resumed: u64,
    /// The norms of the vectors the item wrote (`[output] vector`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vector: Option<VectorStats>,
    /// What the shadow model did beside the job's (`[model.shadow]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<crate::shadow::ShadowStats>,
}

/// The L2 norms of the vectors written (an embedding job's outputs): how
/// many, of what dimension, their sum, least and largest. Rows holding NaN
/// (rows the model failed on) are not counted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct VectorStats {
    /// Values per vector.
    pub dim: u32,
    /// Vectors counted.
    pub rows: u64,
    /// Sum of their norms.
    pub norm_sum: f64,
    /// Least norm.
    pub norm_min: f64,
    /// Largest norm.
    pub norm_max: f64,
}

impl VectorStats {
    /// Stats of one vector.
    pub fn of_row(row: impl Iterator<Item = f64>) -> Option<Self> {
        let (mut dim, mut sq) = (0u32, 0f64);
        for v in row {
            dim += 1;
            sq += v * v;
        }
        let norm = sq.sqrt();
        norm.is_finite().then_some(Self {
            dim,
            rows: 1,
            norm_sum: norm,
            norm_min: norm,
            norm_max: norm,
        })
    }

    /// Stats of row-major `values` of `width` per row.
    pub fn of(values: &[f32], width: usize) -> Option<Self> {
        if width == 0 {
            return None;
        }
        values.chunks(width).fold(None, |acc, row| {
            Self::merge(acc, Self::of_row(row.iter().map(|v| f64::from(*v))))
        })
    }

    /// Both together.
    pub fn merge(a: Option<Self>, b: Option<Self>) -> Option<Self> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Self {
                dim: a.dim.max(b.dim),
                rows: a.rows + b.rows,
                norm_sum: a.norm_sum + b.norm_sum,
                norm_min: a.norm_min.min(b.norm_min),
                norm_max: a.norm_max.max(b.norm_max),
            }),
            (a, None) => a,
            (None, b) => b,
        }
    }
}

impl ItemStats {
    /// Wall time the item took on its worker.
    pub fn latency_ms(&self) -> u64 {
        self.finished_ms.saturating_sub(self.started_ms)
    }
}

/// An item that failed for good and was dead-lettered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemFailure {
    /// Item seq.
    pub seq: u32,
    /// Failure class (`poison`, …).
    pub class: String,
    /// What went wrong, naming the file, row or model.
    pub reason: String,
    /// Worker that gave up on it.
    pub worker: String,
    /// Delivery attempt that failed.
    pub attempt: u32,
    /// When (ms since epoch).
    pub at_ms: u64,
}

/// A worker's hold on an item it is processing. Written once (again only
/// when what it says changes, or while the item is at the model), and kept
/// live by its worker's beat ([`Store::beat`]): one write per worker and
/// job every heartbeat, however many items the worker holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    /// Item seq.
    pub seq: u32,
    /// Worker id.
    pub worker: String,
    /// Delivery attempt.
    pub attempt: u32,
    /// When the worker took the item (ms since epoch).
    pub started_ms: u64,
    /// Last heartbeat (ms since epoch): when the lease was last written,
    /// or — as [`Store::leases`] and the start script read it — its
    /// worker's last beat on the job, whichever is later.
    pub heartbeat_ms: u64,
    /// The lease is stale (its worker presumed dead) this long after the last heartbeat.
    pub ttl_ms: u64,
    /// Rows of the item done so far (checkpointed segments).
    pub rows_done: u64,
    /// Rows of the item.
    pub rows: u64,
    /// Rows the worker skipped because a checkpoint held them.
    #[serde(default)]
    pub rows_resumed: u64,
    /// Whether the worker acknowledged the delivery already and holds the
    /// item by this lease alone (long items, see the worker's `--ack-after`).
    #[serde(default)]
    pub acked: bool,
    /// Which process of the worker wrote it ([`boot_id`]): a worker restarted
    /// under the same id finds the lease its dead predecessor left, and
    /// counts it as a crash like any other.
    #[serde(default)]
    pub boot: String,
    /// Its worker was told to stop (SIGTERM: a scale-down, a preemption)
    /// and is draining: should the lease go stale, the worker was stopped
    /// from outside, and the item is not counted as one that kills its
    /// workers (`[failure] max_crashes`).
    #[serde(default)]
    pub stopping: bool,
}

/// The beat field of worker `worker` in its process `boot`:
/// `<worker>/<boot>` (see [`Store::beat`]).
pub fn holder(worker: &str, boot: &str) -> String {
    format!("{worker}/{boot}")
}

/// The suffix of a beat field that says its worker holds deliveries of the
/// job that wait to start ([`queued_field`]).
pub const QUEUED_SUFFIX: &str = "+queued";

/// The beat field by which `holder` says it holds deliveries of the job
/// that have waited half a heartbeat or more to start: `<holder>+queued`. Such
/// deliveries are in neither the queue nor a lease, and while this beat is
/// live the coordinator takes none of the job's items for lost.
pub fn queued_field(holder: &str) -> String {
    format!("{holder}{QUEUED_SUFFIX}")
}

/// This process's boot id for its leases: when it started (ms, hex) and its
/// pid. A string, as Lua's JSON would round a number this long.
pub fn boot_id() -> String {
    static BOOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BOOT.get_or_init(|| format!("{:x}-{}", crate::now_ms(), std::process::id()))
        .clone()
}

impl Lease {
    /// Whether the heartbeat is older than the lease's ttl at `now_ms`.
    pub fn is_stale(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.heartbeat_ms) > self.ttl_ms
    }

    /// How long the item has been held at `now_ms`.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.started_ms)
    }

    pub(crate) fn field(&self) -> String {
        format!("{}@{}", self.seq, self.worker)
    }

    /// Who holds it, as its worker's beat names it: `<worker>/<boot>`.
    pub fn holder(&self) -> String {
        holder(&self.worker, &self.boot)
    }
}

/// What a work message claims about its job, checked against the job
/// record by [`Store::start_item`] before anything is written.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The pool the message was consumed from.
    pub pool: &'a str,
    /// The model file it names.
    pub model: &'a str,
    /// The model digest it names.
    pub model_sha256: &'a str,
    /// The output folder it names.
    pub output_dir: &'a str,
    /// The broker returned this delivery (AMQP's `redelivered`): whoever
    /// held it before may have died on it. Another worker's live lease on
    /// the item then makes the start wait ([`Start::Held`]) until that lease
    /// is settled or stale, so that a crash is counted before the item runs
    /// again.
    pub returned: bool,
}

/// What a worker checks a work message against: the job record's fields
/// the start script reads ([`Store::start_item`]), read on their own
/// ([`JobStore::job_facts`]) so that a worker can check the first delivery
/// of an item against a copy it read moments ago, without a round trip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFacts {
    /// The job's status.
    pub status: JobStatus,
    /// Its pool.
    pub pool: String,
    /// Its model file.
    pub model: String,
    /// Its model digest.
    pub model_sha256: String,
    /// Its output folder.
    pub output_dir: String,
    /// Its items.
    pub items_total: u64,
    /// The running coordinator's `--orphan-grace` (`None`: not said).
    pub orphan_grace: Option<std::time::Duration>,
}

/// A record's `orphan_grace_ms` as a grace: `None` for 0 (not said).
pub(crate) fn grace_of(ms: u64) -> Option<std::time::Duration> {
    (ms > 0).then(|| std::time::Duration::from_millis(ms))
}

/// `grace` as a record's `orphan_grace_ms`: whole milliseconds, at least 1
/// (0 reads as not said).
pub fn grace_ms(grace: std::time::Duration) -> u64 {
    u64::try_from(grace.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl JobFacts {
    /// The facts of a job record.
    pub fn of(record: &JobRecord) -> Self {
        Self {
            status: record.status,
            pool: record.pool.clone(),
            model: record.model.clone(),
            model_sha256: record.model_sha256.clone(),
            output_dir: record.output_dir.clone(),
            items_total: record.items_total,
            orphan_grace: grace_of(record.orphan_grace_ms),
        }
    }

    /// Whether item `seq` of a message claiming `claim` may start: the job
    /// runs (or is being published) and agrees with the claim, field by
    /// field, as the start script checks. Anything else — a finished,
    /// failed or cancelled job, a disagreement — is for the start script to
    /// settle, with its exact answer.
    pub fn admit(&self, seq: u32, claim: &Claim<'_>) -> bool {
        matches!(self.status, JobStatus::Planning | JobStatus::Running)
            && self.pool == claim.pool
            && self.model == claim.model
            && self.model_sha256 == claim.model_sha256
            && self.output_dir == claim.output_dir
            && u64::from(seq) < self.items_total
    }
}

/// Work a worker did for a job and counts with its next commit (or on its
/// own, [`JobStore::count_work`]): items it started without the start
/// script, and rows it put through the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Work {
    /// Items started (deliveries).
    pub deliveries: u64,
    /// Rows put through the model, wasted work included.
    pub rows: u64,
}

impl Work {
    /// Whether there is nothing to count.
    pub fn is_empty(&self) -> bool {
        self.deliveries == 0 && self.rows == 0
    }
}

/// What [`Store::start_item`] found. Only [`Start::Started`] wrote anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// The lease is written and the delivery counted; the job is running
    /// (or still being published). `at_ms` is Redis's time, the lease's start.
    Started {
        /// Redis's clock when the lease was written.
        at_ms: u64,
        /// Crashes of the item counted so far: workers that died holding
        /// it. Above 0 the item is a suspect, run alone on its worker.
        crashes: u32,
    },
    /// The broker returned the delivery while another worker's lease on the
    /// item is still live: wait `wait_ms` (until that lease is stale, if its
    /// worker died) and start again, not returned.
    Held {
        /// How long until the live lease goes stale, if it is not renewed.
        wait_ms: u64,
    },
    /// The item's crashes reached the job's `max_crashes`: dead-letter it,
    /// class `crash`. Nothing was written but the count.
    Crashed {
        /// Crashes counted.
        crashes: u32,
        /// The workers that died holding it (the stale leases just counted).
        workers: Vec<String>,
    },
    /// The item is committed already: acknowledge without work.
    Done,
    /// The item failed for good (dead-lettered); a copy arriving now is stale.
    FailedForGood,
    /// The job failed (error budget, or nobody can run it) or was
    /// cancelled: skip its items.
    JobFailed,
    /// No such job in Redis (unknown, deleted, or Redis lost its data and
    /// the coordinator has not restored it yet).
    UnknownJob,
    /// The job is finished; no message of it can be outstanding.
    NotRunning(JobStatus),
    /// The message disagrees with the job record (`field`, what the record says).
    Mismatch {
        /// The field of the job record.
        field: String,
        /// Its value in the record.
        recorded: String,
    },
}

/// What [`Store::task`] found for a job and a task digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskLookup {
    /// The stored task's bytes (to be checked against the digest).
    Found(Vec<u8>),
    /// The job is known but stores no task under that digest.
    NotOfJob,
    /// No such job in Redis (unknown, deleted, or not restored yet).
    UnknownJob,
}

/// A worker that cannot take a job's items for now, as shown by `batchfleet status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnableNote {
    /// `unable` (this worker cannot run the job: no CUDA device, model
    /// missing here, out of memory on one row) or `disk_full` (paused).
    pub class: String,
    /// Why, naming the device, file or path.
    pub reason: String,
    /// When it first said so (Redis time, ms).
    pub since_ms: u64,
    /// Until when it leaves the job's items to others (Redis time, ms).
    pub until_ms: u64,
}

/// Counters of a running job, read in one round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Items committed.
    pub items_done: u64,
    /// Rows committed.
    pub rows_done: u64,
    /// Items planned.
    pub items_total: u64,
    /// Rows planned.
    pub rows_total: u64,
    /// Items that failed for good.
    pub items_failed: u64,
    /// Rows committed as rejected (bad rows, rows the model raised on).
    pub rows_rejected: u64,
    /// The job's status (`None` while the record is missing).
    pub status: Option<JobStatus>,
}

impl Progress {
    /// Whether every planned item is either committed or failed for good.
    pub fn settled(&self) -> bool {
        self.items_done + self.items_failed >= self.items_total
    }
}

/// What the coordinator and the workers do with job state. Every method is
/// one atomic step: the Redis implementation runs a script or a `MULTI`
/// pipeline, the local one holds one lock; both pass the same tests
/// (`shared/tests/it/store.rs`).
#[async_trait::async_trait]
pub trait JobStore: Send + Sync + fmt::Debug {
    /// Where the state lives, for messages (`Redis prefix bf`, `memory`).
    fn describe(&self) -> String;

    /// Reads a job record, `None` if the job is unknown.
    async fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError>;

    /// Writes a new job record (all fields) and lists it in `P:jobs`.
    async fn put_job(&self, job: &JobRecord) -> Result<(), StoreError>;

    /// Writes the fields of a job record that `update` changes (like `HSET`:
    /// the others stay).
    async fn update_job(&self, id: &str, update: &RecordUpdate) -> Result<(), StoreError>;

    /// Reads the counters of a job in one round trip.
    async fn progress(&self, id: &str) -> Result<Progress, StoreError>;

    /// Marks an item done and adds its prediction histogram (`counts[column][bin]`),
    /// and drops the lease of `stats.worker` on it.
    /// Returns `true` if this call won (first commit), `false` if the item
    /// had already been committed by someone else (nothing is added then).
    async fn commit_item(
        &self,
        job: &str,
        stats: &ItemStats,
        histogram: &[Vec<u64>],
    ) -> Result<bool, StoreError> {
        let won = self
            .commit_group(
                job,
                &[Commit {
                    stats,
                    histogram,
                    leased: true,
                }],
                Work::default(),
            )
            .await?;
        Ok(won.first().copied().unwrap_or(false))
    }

    /// [`JobStore::commit_item`] for several items of one job in one
    /// atomic step (group commit): whether each won, in order — first commit
    /// wins per item, and only the winners' counters, stats and histograms
    /// are added (the histograms summed first: one write per filled bin of
    /// the group). Adds `work` — what the committing worker did for the
    /// job since it last counted: items it started without the start
    /// script, and rows it ran through the model, wasted work included — to
    /// the job's work counters whatever wins: a worker counts its work with
    /// its commits, never under the model gate nor at an item's start.
    async fn commit_group(
        &self,
        job: &str,
        commits: &[Commit<'_>],
        work: Work,
    ) -> Result<Vec<bool>, StoreError>;

    /// Records that an item failed for good. Returns `false` (and records
    /// nothing) if the item is already done.
    async fn fail_item(&self, job: &str, failure: &ItemFailure) -> Result<bool, StoreError>;

    /// Items that failed for good, in seq order.
    async fn failures(&self, job: &str) -> Result<Vec<ItemFailure>, StoreError>;

    /// Forgets recorded failures of a job (before its failed items are published again).
    async fn clear_failures(&self, job: &str) -> Result<(), StoreError>;

    /// Forgets the failure of one item (before it is published again).
    async fn clear_failure(&self, job: &str, seq: u32) -> Result<(), StoreError>;

    /// Whether an item is marked done.
    async fn is_done(&self, job: &str, seq: u32) -> Result<bool, StoreError>;

    /// Which of `seqs` are done (one round trip).
    async fn done_among(&self, job: &str, seqs: &[u32]) -> Result<HashSet<u32>, StoreError>;

    /// All done seqs of a job.
    async fn done_items(&self, job: &str) -> Result<HashSet<u32>, StoreError>;

    /// Stats of every committed item, in seq order.
    async fn item_stats(&self, job: &str) -> Result<Vec<ItemStats>, StoreError>;

    /// Stats of up to `n` committed items picked at random (`HRANDFIELD`):
    /// what a running job's median item time is estimated from, at a cost
    /// that does not grow with the job.
    async fn sample_item_stats(&self, job: &str, n: usize) -> Result<Vec<ItemStats>, StoreError>;

    /// Starts holding an item (see [`start_script`]): checks the message's
    /// `claim` against the job record and, only if the job runs and the item
    /// is neither done nor failed, writes the lease (started and heartbeat
    /// at Redis's time) and counts the delivery. Other workers' stale leases
    /// on the item are crashes: each is dropped and counted, and once the
    /// count reaches the job's `max_crashes` the answer is
    /// [`Start::Crashed`]. A returned delivery waits for another worker's
    /// live lease ([`Start::Held`]).
    async fn start_item(
        &self,
        job: &str,
        lease: &Lease,
        claim: &Claim<'_>,
    ) -> Result<Start, StoreError>;

    /// Refreshes a lease, or writes it the first time for an item started
    /// without one (the heartbeat; its `heartbeat_ms` is set to Redis's
    /// time, and a lease whose `started_ms` is 0 starts `held_ms` — how long
    /// the worker has held the item — before that). Returns `false`,
    /// writing nothing, once the item is done or its job cancelled: the
    /// holder may stop working on it.
    async fn heartbeat(&self, job: &str, lease: &Lease, held_ms: u64) -> Result<bool, StoreError>;

    /// Keeps every lease `holder` ([`Lease::holder`]) has on the job's items
    /// live, in one write stamped with Redis's clock: a worker beats once
    /// per heartbeat for each job it holds leased items of, and a lease is
    /// stale only when neither it nor its holder's beat is younger than the
    /// lease's ttl. Every field in `fields` is set: the holder's own, and
    /// its [`queued_field`] while it holds deliveries of the job that wait
    /// to start.
    async fn beat(&self, job: &str, fields: &[String]) -> Result<(), StoreError>;

    /// [`JobStore::beat`] on several jobs (job, fields) at once: on one
    /// Redis server in one request, whatever their number. Each job is
    /// beaten whatever the others did; the first error is returned.
    async fn beat_jobs(&self, beats: &[(String, Vec<String>)]) -> Result<(), StoreError> {
        let mut first = None;
        for (job, fields) in beats {
            if let Err(e) = self.beat(job, fields).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// The job's beats: field → last beat (ms, Redis's clock).
    async fn beats(&self, job: &str) -> Result<BTreeMap<String, u64>, StoreError>;

    /// The fields of a job record a work message is checked against, in one
    /// cheap read (not the whole record); `None` if the job is unknown.
    async fn job_facts(&self, id: &str) -> Result<Option<JobFacts>, StoreError> {
        Ok(self.job(id).await?.as_ref().map(JobFacts::of))
    }

    /// The job's pace (its record's `pace` field) alone, in one cheap read;
    /// `None` if the job is unknown or has none.
    async fn job_pace(&self, id: &str) -> Result<Option<Pace>, StoreError> {
        Ok(self.job(id).await?.and_then(|j| j.pace))
    }

    /// Redis's clock (`TIME`), in ms: the one clock leases are written and judged by.
    async fn now_ms(&self) -> Result<u64, StoreError>;

    /// Fails a running job at once with `class` and `reason` (see
    /// [`JobRecord::failed_class`]); class `cancelled` makes its status
    /// [`JobStatus::Cancelled`] instead (`batchfleet cancel`). `false` if it
    /// was not running (finished, failed or cancelled already — the first
    /// reason stays).
    async fn fail_job(&self, job: &str, class: &str, reason: &str) -> Result<bool, StoreError>;

    /// Marks the job published (every item confirmed by the broker) and
    /// running, unless it failed meanwhile ([`PUBLISHED_SCRIPT`]).
    async fn mark_published(&self, job: &str, at_ms: u64, items: u64) -> Result<(), StoreError>;

    /// Records that `worker` cannot take the job's items for now.
    async fn note_unable(
        &self,
        job: &str,
        worker: &str,
        note: &UnableNote,
    ) -> Result<(), StoreError>;

    /// Forgets that `worker` could not take the job's items.
    async fn clear_unable(&self, job: &str, worker: &str) -> Result<(), StoreError>;

    /// Forgets every worker's note on the job (the job runs again).
    async fn clear_unable_notes(&self, job: &str) -> Result<(), StoreError>;

    /// Workers that said they cannot take the job's items, by worker id.
    async fn unable(&self, job: &str) -> Result<BTreeMap<String, UnableNote>, StoreError>;

    /// Drops a lease (the holder settled the item or gave it back).
    async fn release(&self, job: &str, lease: &Lease) -> Result<(), StoreError> {
        self.drop_leases(job, &[lease.field()]).await
    }

    /// Drops leases by their `<seq>@<worker>` field.
    async fn drop_leases(&self, job: &str, fields: &[String]) -> Result<(), StoreError>;

    /// The items that have crashes counted, with their counts (a small
    /// hash: only items workers died holding).
    async fn crashes(&self, job: &str) -> Result<BTreeMap<u32, u32>, StoreError>;

    /// Drops stale leases (`<seq>@<worker>` fields) of items that are not
    /// settled, counting a crash of the item for each lease this call
    /// dropped (a worker died holding it; a lease another caller dropped
    /// first is not counted twice). Returns each named item's crash count.
    async fn count_crashes(
        &self,
        job: &str,
        fields: &[String],
    ) -> Result<BTreeMap<u32, u32>, StoreError>;

    /// Every lease of a job, in seq order, each `heartbeat_ms` the later of
    /// its own and its holder's last beat on the job.
    async fn leases(&self, job: &str) -> Result<Vec<Lease>, StoreError>;

    /// The job's prediction histogram, `counts[column][bin]` (bins + 2 per column).
    async fn histogram(&self, job: &str, bins: usize) -> Result<Vec<Vec<u64>>, StoreError>;

    /// Adds to the job's work counters: items started and rows put through
    /// the model (the work actually done, including work a fault wasted).
    async fn count_work(&self, job: &str, deliveries: u64, rows: u64) -> Result<(), StoreError>;

    /// The job's work counters: (items started, rows computed).
    async fn work(&self, job: &str) -> Result<(u64, u64), StoreError>;

    /// When the coordinator last published a copy of each item (seq → ms).
    async fn redispatched(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError>;

    /// Records that a copy of item `seq` was published at `at_ms` (Redis
    /// time); returns how many copies of it have been published in all.
    async fn mark_redispatched(&self, job: &str, seq: u32, at_ms: u64) -> Result<u64, StoreError>;

    /// How many copies of each item the coordinator published (seq → count).
    async fn copies(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError>;

    /// Restores the descriptive fields of a job record lost with Redis's data
    /// (status, totals, settings), never the counters the commits maintain.
    async fn restore_job(&self, job: &JobRecord) -> Result<(), StoreError>;

    /// Most recent job ids, newest first.
    async fn recent_jobs(&self, limit: usize) -> Result<Vec<String>, StoreError>;

    /// Deletes every key of a job (tests, `gc`, and the listing of a job
    /// whose keys expired).
    async fn delete_job(&self, id: &str) -> Result<(), StoreError>;

    /// Records what each input file was when the job was planned: path →
    /// JSON fingerprint (`P:job:{<id>}:inputs`).
    async fn put_inputs(&self, job: &str, inputs: &[(String, String)]) -> Result<(), StoreError>;

    /// Stores the job's task under its digest (once per job and version:
    /// storing it again changes nothing).
    async fn put_task(
        &self,
        job: &str,
        task: &crate::message::StoredTask,
    ) -> Result<(), StoreError>;

    /// The job's task stored under `sha256`, if the job stores one.
    async fn task(&self, job: &str, sha256: &str) -> Result<TaskLookup, StoreError>;

    /// [`JobStore::task`] and, where the job is known, its
    /// [`JobStore::job_facts`]: a worker's first item of a job needs both,
    /// read here in one round trip (Redis).
    async fn task_and_facts(
        &self,
        job: &str,
        sha256: &str,
    ) -> Result<(TaskLookup, Option<JobFacts>), StoreError> {
        let task = self.task(job, sha256).await?;
        let facts = match task {
            TaskLookup::UnknownJob => None,
            _ => self.job_facts(job).await?,
        };
        Ok((task, facts))
    }

    /// The input files [`JobStore::put_inputs`] recorded, by path.
    async fn inputs(&self, job: &str) -> Result<BTreeMap<String, String>, StoreError>;

    /// Lets every key of a finished job expire after `ttl` (Redis:
    /// `PEXPIRE` on each; the local store keeps its state for the process's
    /// life, so it does nothing).
    async fn expire_job(&self, job: &str, ttl: std::time::Duration) -> Result<(), StoreError>;

    /// Makes a job's keys permanent again: a finished job run again is
    /// running, and a running job's state never expires.
    async fn persist_job(&self, job: &str) -> Result<(), StoreError>;

    /// The store's eviction policy (Redis's `maxmemory-policy`); `None`
    /// where nothing is evicted (the local store).
    async fn eviction_policy(&self) -> Result<Option<String>, StoreError>;

    /// Takes, or keeps, the job's follower lease for `who` for `ttl`
    /// (`P:job:{<id>}:follower`): the one coordinator process — `run`,
    /// `wait`, `resume` or `supervise` — that supervises the job (copies of
    /// lost and straggling items) while the others only watch. `true` when
    /// `who` holds it now.
    async fn follow_lease(&self, job: &str, who: &str, ttl: Duration) -> Result<bool, StoreError>;

    /// Gives the follower lease up, if `who` holds it.
    async fn release_follow(&self, job: &str, who: &str) -> Result<(), StoreError>;

    /// Claims the job's reduce step (summary, `_SUCCESS`, merge, hooks)
    /// for `who`: `true` for exactly one caller per run of the job, unless
    /// the claim is older than `stale` and the job still unfinished (its
    /// reducer died), when the next caller takes it over. `false` once the
    /// job is reduced. Running the job again (`dispatch`) clears the claim.
    async fn claim_reduce(&self, job: &str, who: &str, stale: Duration)
        -> Result<bool, StoreError>;

    /// Lists `job` among the active jobs of `pool` with its share weight
    /// (`P:pool:{pool}:jobs`, job → weight): workers of the pool consume
    /// its queue, choosing among the active jobs by weight. A run of a job
    /// noted retired takes the note back first
    /// ([`JobStore::forget_retired`]).
    async fn activate_job(&self, pool: &str, job: &str, weight: u32) -> Result<(), StoreError>;

    /// Takes `job` off the active jobs of `pool` (it ended, or was cancelled).
    async fn deactivate_job(&self, pool: &str, job: &str) -> Result<(), StoreError>;

    /// Notes that `job` of `pool` was just retired (taken off the active
    /// jobs), by the store's clock (`P:pool:{pool}:retired`, job → ms): its
    /// queue is deleted once [`JobStore::take_retired`] hands it out, not
    /// at once (see [`crate::retire`]). A run of the job takes the note
    /// back ([`JobStore::forget_retired`]).
    async fn note_retired(&self, pool: &str, job: &str) -> Result<(), StoreError>;

    /// Takes the note that `job` of `pool` was retired back, if there is
    /// one: called before its queue is declared again (the job run again,
    /// its dead letters replayed, its state rebuilt), so that no sweep
    /// deletes the queue of its new run. Whether there was one (without,
    /// no sweep can be deleting its queue: a sweep drops a note only once
    /// the queue is gone).
    async fn forget_retired(&self, pool: &str, job: &str) -> Result<bool, StoreError>;

    /// Claims up to `limit` of the jobs of `pool` retired at least `grace`
    /// ago, for the caller to delete their queues: each note's time is set
    /// to now (the store's clock), so that no other sweep takes it within
    /// another grace, and returned with it — the claim, for
    /// [`JobStore::drop_retired`] once the queue is gone. A claim whose
    /// holder dies comes due again a grace later.
    async fn take_retired(
        &self,
        pool: &str,
        grace: Duration,
        limit: usize,
    ) -> Result<Vec<(String, u64)>, StoreError>;

    /// Drops the note that `job` of `pool` was retired, if it is still the
    /// one claimed at `claim` ([`JobStore::take_retired`]): its queue is gone.
    async fn drop_retired(&self, pool: &str, job: &str, claim: u64) -> Result<(), StoreError>;

    /// Marks `job`'s queue as being swept, for at most `ttl`
    /// (`P:job:{<id>}:sweeping`); `false` if another sweep holds it.
    /// Set before the sweep reads the active jobs and cleared after the
    /// queue is deleted, so that a run of the job listed in between can wait
    /// for the deletion and declare its queue again
    /// ([`crate::retire::after_sweeps`]).
    async fn fence_sweep(&self, job: &str, ttl: Duration) -> Result<bool, StoreError>;

    /// Clears [`JobStore::fence_sweep`]'s mark.
    async fn unfence_sweep(&self, job: &str) -> Result<(), StoreError>;

    /// Whether a sweep holds `job`'s queue ([`JobStore::fence_sweep`]).
    async fn is_swept(&self, job: &str) -> Result<bool, StoreError>;

    /// The active jobs of `pool` with their weights.
    async fn active_jobs(&self, pool: &str) -> Result<BTreeMap<String, u32>, StoreError>;
}

/// Whether an eviction policy may evict a running job's state: the
/// `allkeys-*` policies evict any key; `noeviction` evicts nothing and the
/// `volatile-*` ones only keys with a time to live — of batchfleet's, the
/// finished jobs' whose retention is running anyway.
pub fn evicts_job_state(policy: &str) -> bool {
    policy.starts_with("allkeys")
}

/// Handle to the job store in use; cheap to clone, derefs to [`JobStore`].
#[derive(Clone, Debug)]
pub struct Store(Arc<dyn JobStore>);

impl std::ops::Deref for Store {
    type Target = dyn JobStore;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl Store {
    /// Connects to Redis and checks the server answers `PING` within `timeout`.
    pub async fn connect(
        endpoint: &crate::endpoint::Endpoint,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let url = &endpoint.url;
        let store = redis::RedisStore::connect(endpoint, prefix, timeout).await?;
        // A store that may evict a running job's keys breaks every
        // guarantee at the first memory pressure: refuse it at once.
        if let Some(policy) = store.eviction_policy().await? {
            if evicts_job_state(&policy) {
                return Err(StoreError::Evicts {
                    url: url.redacted(),
                    policy,
                });
            }
        }
        Ok(Self(Arc::new(store)))
    }

    /// A store in this process's memory (`batchfleet run --local`).
    pub fn local() -> Self {
        Self(Arc::new(local::LocalStore::default()))
    }

    /// A handle on any implementation.
    pub fn from_backend(backend: Arc<dyn JobStore>) -> Self {
        Self(backend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grace_is_written_in_ms_and_read_back_never_as_not_said() {
        let grace = std::time::Duration::from_millis(2_500);
        assert_eq!(grace_of(grace_ms(grace)), Some(grace));
        assert_eq!(
            grace_ms(std::time::Duration::ZERO),
            1,
            "0 reads as not said"
        );
        assert_eq!(grace_of(0), None);
    }

    #[test]
    fn a_lease_is_stale_after_its_ttl_without_heartbeat() {
        let lease = Lease {
            seq: 3,
            worker: "w".into(),
            attempt: 1,
            started_ms: 1_000,
            heartbeat_ms: 5_000,
            ttl_ms: 2_000,
            rows_done: 0,
            rows: 10,
            rows_resumed: 0,
            acked: false,
            boot: String::new(),
            stopping: false,
        };
        assert!(!lease.is_stale(7_000));
        assert!(lease.is_stale(7_001));
        assert_eq!(lease.age_ms(7_000), 6_000);
        assert_eq!(lease.field(), "3@w");
    }
}
