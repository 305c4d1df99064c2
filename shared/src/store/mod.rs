//! The job store: job records, progress and the "first commit wins" done set,
//! behind one interface ([`JobStore`]) with two implementations — Redis
//! ([`redis`], the fleet's) and in-process memory ([`local`], for
//! `batchfleet run --local`). Code outside this module holds a [`Store`]
//! and never names either.
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
//! | `P:job:{<id>}:redispatched` | hash | seq → ms when the coordinator last published a copy |
//! | `P:job:{<id>}:hist` | hash | `<column>:<bin>` → rows whose prediction fell in the bin (committed items only) |
//! | `P:job:{<id>}:work` | hash | `deliveries` (items started), `rows_computed` (rows through the model, wasted work included) |
//! | `P:job:{<id>}:copies` | hash | seq → how many copies the coordinator published (bounded: see the supervisor) |
//! | `P:job:{<id>}:unable` | hash | worker → JSON [`UnableNote`]: a worker that cannot take the job's items for now (no CUDA device, disk full) |
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

pub mod local;
pub mod redis;

/// Errors talking to Redis. Messages never contain credentials.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis could not be reached or refused the login.
    #[error("cannot connect to Redis at {url}: {reason}. {hint}")]
    Connect {
        /// Redacted URL.
        url: String,
        /// Client library message, credentials scrubbed.
        reason: String,
        /// What to do about it.
        hint: String,
    },
    /// Redis refused the credentials; retrying will not help.
    #[error("Redis at {url} refused the login: {reason}. Check the password in the Redis URL (BATCHFLEET_REDIS_URL)")]
    Auth {
        /// Redacted URL.
        url: String,
        /// Client library message, credentials scrubbed.
        reason: String,
    },
    /// A command failed.
    #[error("Redis {op} failed: {reason}")]
    Command {
        /// What was being done.
        op: &'static str,
        /// Client library message.
        reason: String,
    },
    /// Redis may evict keys of a running job under memory pressure.
    #[error("Redis at {url} has maxmemory-policy {policy}, which evicts any key when memory runs short — a running job's progress, leases and done items included, which would lose or repeat work. Set it to noeviction (or a volatile-* policy, which evicts only finished jobs' state, the keys with a time to live): `CONFIG SET maxmemory-policy noeviction`, maxmemory-policy in redis.conf, or the parameter group of a managed Redis")]
    Evicts {
        /// Redacted URL.
        url: String,
        /// The policy in force.
        policy: String,
    },
    /// A TLS file (`BATCHFLEET_REDIS_*_FILE`) cannot be used.
    #[error("Redis TLS settings: {0}")]
    TlsSetup(crate::endpoint::TlsSetupError),
    /// The TLS handshake refused the server's certificate.
    #[error("Redis at {url} did not pass the TLS handshake: {reason}. {hint}")]
    Untrusted {
        /// Redacted URL.
        url: String,
        /// What the TLS library said.
        reason: String,
        /// What to do about it.
        hint: String,
    },
    /// Stored data could not be read back.
    #[error("Redis key {key} holds unexpected data: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

impl StoreError {
    /// Whether retrying cannot help (wrong credentials).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            StoreError::Auth { .. }
                | StoreError::Evicts { .. }
                | StoreError::TlsSetup(_)
                | StoreError::Untrusted { .. }
        )
    }
}

/// Lifecycle of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Registered; items are being planned and published.
    Planning,
    /// All items published; workers are processing them.
    Running,
    /// Every item committed.
    Completed,
    /// Every item settled, some failed for good (dead-lettered).
    CompletedWithFailures,
    /// The error budget was exceeded; remaining items are skipped.
    Failed,
    /// Stopped by `batchfleet cancel`: queued items are skipped, in-flight
    /// ones stop at their next checkpoint, committed parts stay; running
    /// the manifest again continues it from what was committed.
    Cancelled,
}

impl JobStatus {
    /// The name stored in Redis and printed by the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Planning => "planning",
            JobStatus::Running => "running",
            JobStatus::Completed => "completed",
            JobStatus::CompletedWithFailures => "completed_with_failures",
            JobStatus::Failed => "failed",
            JobStatus::Cancelled => "cancelled",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "planning" => JobStatus::Planning,
            "running" => JobStatus::Running,
            "completed" => JobStatus::Completed,
            "completed_with_failures" => JobStatus::CompletedWithFailures,
            "failed" => JobStatus::Failed,
            "cancelled" => JobStatus::Cancelled,
            _ => return None,
        })
    }

    /// Whether the job will make no further progress.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobStatus::Completed | JobStatus::CompletedWithFailures
        )
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The job hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// Job id.
    pub id: String,
    /// Job name from the manifest.
    pub name: String,
    /// Current status.
    pub status: JobStatus,
    /// Pool the items went to.
    pub pool: String,
    /// Manifest file the job was started from.
    pub manifest: String,
    /// Output directory.
    pub output_dir: String,
    /// Part file format (`csv`).
    pub output_format: String,
    /// Model file.
    pub model: String,
    /// Model SHA-256.
    pub model_sha256: String,
    /// Error budget: most items that may fail.
    pub max_failed_items: Option<u64>,
    /// Error budget: most percent of items that may fail.
    pub max_failed_percent: Option<f64>,
    /// Items planned.
    pub items_total: u64,
    /// Rows planned.
    pub rows_total: u64,
    /// `rows_total` is an estimate (items cut blind): the rows are known
    /// once every item is read.
    pub rows_estimated: bool,
    /// Items committed.
    pub items_done: u64,
    /// Rows settled: predicted or rejected.
    pub rows_done: u64,
    /// Rows rejected (bad rows and rows the model raised on).
    pub rows_rejected: u64,
    /// When the job was first registered (ms since epoch).
    pub created_ms: u64,
    /// When publishing finished (ms), 0 before.
    pub published_ms: u64,
    /// When the job completed (ms), 0 before.
    pub finished_ms: u64,
    /// Items (in seq order) whose publish the broker confirmed: a resumed
    /// dispatch starts there instead of publishing everything again.
    pub items_published: u64,
    /// Write the merged output when every item has completed (`[output] merge`).
    pub merge: bool,
    /// Why the job failed (`failed` status only): what happened, naming the
    /// model, workers or items; empty otherwise.
    pub failed_reason: String,
    /// What made it fail: `budget` (too many items failed), `unrunnable`
    /// (nobody can run it: the model) or `unable` (no worker could take its
    /// items in time); empty unless failed.
    pub failed_class: String,
    /// The `--set key=value` overrides the job was started with, applied
    /// over its manifest file (`resume` applies them again).
    pub overrides: Vec<String>,
    /// The manifest as validated — the file with the overrides applied — in TOML.
    pub resolved_manifest: String,
    /// `[job] priority` (`high`, `normal`, `low`; empty: normal): its
    /// share of the pool's workers beside other jobs.
    pub priority: String,
}

impl JobRecord {
    pub(crate) fn to_fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("id", self.id.clone()),
            ("name", self.name.clone()),
            ("status", self.status.as_str().to_owned()),
            ("pool", self.pool.clone()),
            ("manifest", self.manifest.clone()),
            ("output_dir", self.output_dir.clone()),
            ("output_format", self.output_format.clone()),
            ("model", self.model.clone()),
            ("model_sha256", self.model_sha256.clone()),
            (
                "max_failed_items",
                self.max_failed_items
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            ),
            (
                "max_failed_percent",
                self.max_failed_percent
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            ),
            ("items_total", self.items_total.to_string()),
            ("rows_total", self.rows_total.to_string()),
            ("rows_estimated", u8::from(self.rows_estimated).to_string()),
            ("items_done", self.items_done.to_string()),
            ("rows_done", self.rows_done.to_string()),
            ("rows_rejected", self.rows_rejected.to_string()),
            ("created_ms", self.created_ms.to_string()),
            ("published_ms", self.published_ms.to_string()),
            ("finished_ms", self.finished_ms.to_string()),
            ("items_published", self.items_published.to_string()),
            ("merge", u8::from(self.merge).to_string()),
            ("failed_reason", self.failed_reason.clone()),
            ("failed_class", self.failed_class.clone()),
            (
                "overrides",
                serde_json::to_string(&self.overrides).expect("strings serialize"),
            ),
            ("resolved_manifest", self.resolved_manifest.clone()),
            ("priority", self.priority.clone()),
        ]
    }

    pub(crate) fn from_fields(
        key: &str,
        map: &BTreeMap<String, String>,
    ) -> Result<Self, StoreError> {
        let corrupt = |reason: String| StoreError::Corrupt {
            key: key.to_owned(),
            reason,
        };
        let text = |f: &str| {
            map.get(f)
                .cloned()
                .ok_or_else(|| corrupt(format!("field {f} missing")))
        };
        let num = |f: &str| -> Result<u64, StoreError> {
            map.get(f).map_or(Ok(0), |v| {
                v.parse()
                    .map_err(|_| corrupt(format!("field {f} is not a number: {v}")))
            })
        };
        fn opt<T: std::str::FromStr>(
            map: &BTreeMap<String, String>,
            f: &str,
        ) -> Result<Option<T>, String> {
            match map.get(f).map(String::as_str) {
                None | Some("") => Ok(None),
                Some(v) => v
                    .parse()
                    .map(Some)
                    .map_err(|_| format!("field {f} is not a number: {v}")),
            }
        }
        let opt_u = |f: &str| opt::<u64>(map, f).map_err(corrupt);
        let opt_f = |f: &str| opt::<f64>(map, f).map_err(corrupt);
        let status = text("status")?;
        Ok(Self {
            id: text("id")?,
            name: text("name")?,
            status: JobStatus::parse(&status)
                .ok_or_else(|| corrupt(format!("unknown status {status}")))?,
            pool: text("pool")?,
            manifest: text("manifest")?,
            output_dir: text("output_dir")?,
            output_format: text("output_format")?,
            model: text("model")?,
            model_sha256: text("model_sha256")?,
            max_failed_items: opt_u("max_failed_items")?,
            max_failed_percent: opt_f("max_failed_percent")?,
            items_total: num("items_total")?,
            rows_total: num("rows_total")?,
            rows_estimated: num("rows_estimated")? == 1,
            items_done: num("items_done")?,
            rows_done: num("rows_done")?,
            rows_rejected: num("rows_rejected")?,
            created_ms: num("created_ms")?,
            published_ms: num("published_ms")?,
            finished_ms: num("finished_ms")?,
            items_published: num("items_published")?,
            merge: num("merge")? == 1,
            failed_reason: map.get("failed_reason").cloned().unwrap_or_default(),
            failed_class: map.get("failed_class").cloned().unwrap_or_default(),
            overrides: match map.get("overrides").map(String::as_str) {
                None | Some("") => Vec::new(),
                Some(v) => serde_json::from_str(v)
                    .map_err(|e| corrupt(format!("field overrides is not a JSON list: {e}")))?,
            },
            resolved_manifest: map.get("resolved_manifest").cloned().unwrap_or_default(),
            priority: map.get("priority").cloned().unwrap_or_default(),
        })
    }
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

/// A worker's hold on an item it is processing, refreshed by heartbeats.
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
    /// Last heartbeat (ms since epoch).
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
}

/// What [`Store::start_item`] found. Only [`Start::Started`] wrote anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// The lease is written and the delivery counted; the job is running
    /// (or still being published). `at_ms` is Redis's time, the lease's start.
    Started {
        /// Redis's clock when the lease was written.
        at_ms: u64,
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

    /// Sets some fields of a job record. Never use it for the done counters.
    async fn set_job_fields(&self, id: &str, fields: &[(&str, String)]) -> Result<(), StoreError>;

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
    ) -> Result<bool, StoreError>;

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

    /// Starts holding an item (see [`start_script`]): checks the message's
    /// `claim` against the job record and, only if the job runs and the item
    /// is neither done nor failed, writes the lease (started and heartbeat
    /// at Redis's time) and counts the delivery.
    async fn start_item(
        &self,
        job: &str,
        lease: &Lease,
        claim: &Claim<'_>,
    ) -> Result<Start, StoreError>;

    /// Refreshes a lease (the heartbeat; its `heartbeat_ms` is set to
    /// Redis's time). Returns `false`, writing nothing, once the item is
    /// done or its job cancelled: the holder may stop working on it.
    async fn heartbeat(&self, job: &str, lease: &Lease) -> Result<bool, StoreError>;

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

    /// Every lease of a job, in seq order.
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
    /// its queue, choosing among the active jobs by weight.
    async fn activate_job(&self, pool: &str, job: &str, weight: u32) -> Result<(), StoreError>;

    /// Takes `job` off the active jobs of `pool` (it ended, or was cancelled).
    async fn deactivate_job(&self, pool: &str, job: &str) -> Result<(), StoreError>;

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

    fn record() -> JobRecord {
        JobRecord {
            id: "j-1".into(),
            name: "j".into(),
            status: JobStatus::Running,
            pool: "default".into(),
            manifest: "/m.toml".into(),
            output_dir: "/out".into(),
            output_format: "csv".into(),
            model: "/m.pt".into(),
            model_sha256: "ab".into(),
            max_failed_items: Some(2),
            max_failed_percent: None,
            items_total: 3,
            rows_total: 30,
            rows_estimated: false,
            items_done: 1,
            rows_done: 10,
            rows_rejected: 1,
            created_ms: 5,
            published_ms: 6,
            finished_ms: 0,
            items_published: 2,
            merge: true,
            failed_reason: String::new(),
            failed_class: String::new(),
            overrides: Vec::new(),
            resolved_manifest: String::new(),
            priority: String::new(),
        }
    }

    #[test]
    fn job_record_round_trips_through_hash_fields() {
        let r = record();
        let map: BTreeMap<String, String> = r
            .to_fields()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        assert_eq!(JobRecord::from_fields("k", &map).unwrap(), r);
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
        };
        assert!(!lease.is_stale(7_000));
        assert!(lease.is_stale(7_001));
        assert_eq!(lease.age_ms(7_000), 6_000);
        assert_eq!(lease.field(), "3@w");
    }

    #[test]
    fn corrupt_record_names_key_and_field() {
        let mut map: BTreeMap<String, String> = record()
            .to_fields()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        map.insert("rows_total".into(), "lots".into());
        let err = JobRecord::from_fields("bf:job:j-1", &map)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bf:job:j-1") && err.contains("rows_total"),
            "{err}"
        );
    }
}
