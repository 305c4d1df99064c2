//! A job's record — what the job hash `P:job:{<id>}` holds — with its
//! encoding as hash fields (strings, as Redis holds them; the in-process
//! store keeps the same fields so that both read a record back the same
//! way), and the typed changes each step of a job makes to it
//! ([`RecordUpdate`]).

use super::error::StoreError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

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

    /// The status a stored or printed name stands for.
    pub fn from_name(s: &str) -> Option<Self> {
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
    /// Whether the job's done set is a bitmap (`P:job:{<id>}:donebits`, one
    /// bit per item: jobs created by this version) rather than a set of
    /// seqs (`P:job:{<id>}:done`: jobs created before it, or with
    /// `--whole-messages` for workers before it). Fixed for a job's life.
    pub done_bits: bool,
    /// `[failure] max_crashes`: crashes of one item (its worker died
    /// holding it, leased) after which it is dead-lettered as `crash`; 0
    /// never gives an item up for crashes. A record from before the field
    /// reads [`DEFAULT_MAX_CRASHES`].
    pub max_crashes: u32,
    /// `[failure] max_rejected_rows`: most rows that may be rejected.
    pub max_rejected_rows: Option<u64>,
    /// `[failure] max_rejected_percent`: most percent of rows that may be rejected.
    pub max_rejected_percent: Option<f64>,
    /// `[job] deadline`: when the job should be done (ms since the epoch; 0: none).
    pub deadline_ms: u64,
    /// `[job] worker_hour_cost`: what one worker costs per hour.
    pub worker_hour_cost: Option<f64>,
    /// The job's pace, as its supervising coordinator last measured it.
    pub pace: Option<Pace>,
    /// The `--orphan-grace` of the coordinator that runs the job, in ms (0:
    /// not said, a record from before the field): how long it trusts a
    /// worker's word that it holds deliveries of the job waiting to start,
    /// so workers say it again every half of it (not every heartbeat and a
    /// half).
    pub orphan_grace_ms: u64,
}

/// A running job's pace, measured by its supervising coordinator every few
/// seconds: what its pool's workers achieve on it, whether it will finish
/// by its deadline at the fleet's current size, and what it has cost.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Pace {
    /// When it was measured (ms since the epoch).
    pub at_ms: u64,
    /// Workers consuming the job's pool then.
    pub workers: u32,
    /// Rows of this job per worker-second of its pool, over the last
    /// minute, with the pool shared as it is now (`None` before a rate).
    pub rows_per_worker_s: Option<f64>,
    /// Workers the pool needs for this job to finish by its deadline, the
    /// pool shared as it is now (`None`: no deadline, or no rate yet).
    pub workers_needed: Option<u32>,
    /// When the job finishes at this rate with `workers` (ms since the
    /// epoch; `None`: no rate, or no worker).
    pub finish_ms: Option<u64>,
    /// The job will finish after its deadline at the fleet's current size.
    pub late: bool,
    /// Worker-seconds the job has used: each of its pool's workers counted
    /// for the job's share of the pool (its priority weight among the
    /// pool's active jobs) while it ran.
    pub worker_s: f64,
    /// Worker-seconds it still needs at this rate.
    pub worker_s_to_go: Option<f64>,
}

impl Pace {
    /// Whether it was measured within `max_age_ms` of `now_ms`.
    pub fn is_fresh(&self, now_ms: u64, max_age_ms: u64) -> bool {
        now_ms.saturating_sub(self.at_ms) <= max_age_ms
    }
}

/// Crashes of one item after which it is dead-lettered (class `crash`)
/// unless `[failure] max_crashes` says otherwise.
pub const DEFAULT_MAX_CRASHES: u32 = 2;

impl JobRecord {
    /// A plain record of job `id` — three items of 100 rows, planning,
    /// every other field set to something ordinary — for tests and
    /// examples, which change the fields they care about
    /// (`JobRecord { status: …, ..JobRecord::sample(id) }`).
    pub fn sample(id: &str) -> Self {
        Self {
            id: id.into(),
            name: "t".into(),
            status: JobStatus::Planning,
            pool: "p".into(),
            manifest: "/m".into(),
            output_dir: "/o".into(),
            output_format: "csv".into(),
            model: "/m.pt".into(),
            model_sha256: "ab".into(),
            max_failed_items: None,
            max_failed_percent: None,
            items_total: 3,
            rows_total: 300,
            rows_estimated: false,
            items_done: 0,
            rows_done: 0,
            rows_rejected: 0,
            created_ms: 1,
            published_ms: 0,
            finished_ms: 0,
            items_published: 0,
            merge: false,
            failed_reason: String::new(),
            failed_class: String::new(),
            overrides: Vec::new(),
            resolved_manifest: String::new(),
            priority: String::new(),
            done_bits: true,
            max_crashes: DEFAULT_MAX_CRASHES,
            max_rejected_rows: None,
            max_rejected_percent: None,
            deadline_ms: 0,
            worker_hour_cost: None,
            pace: None,
            orphan_grace_ms: 0,
        }
    }

    /// The record as hash fields (as Redis holds it, and the in-process
    /// store mirrors).
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
            ("done_bits", u8::from(self.done_bits).to_string()),
            ("max_crashes", self.max_crashes.to_string()),
            (
                "max_rejected_rows",
                self.max_rejected_rows
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            ),
            (
                "max_rejected_percent",
                self.max_rejected_percent
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            ),
            ("deadline_ms", self.deadline_ms.to_string()),
            (
                "worker_hour_cost",
                self.worker_hour_cost
                    .map(|v| v.to_string())
                    .unwrap_or_default(),
            ),
            ("pace", pace_field(self.pace.as_ref())),
            ("orphan_grace_ms", self.orphan_grace_ms.to_string()),
        ]
    }

    /// The record of the hash fields of `key`; a field that is missing or
    /// does not parse is [`StoreError::Corrupt`], naming the key and field.
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
            status: JobStatus::from_name(&status)
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
            done_bits: num("done_bits")? == 1,
            max_crashes: match opt_u("max_crashes")? {
                None => DEFAULT_MAX_CRASHES,
                Some(n) => u32::try_from(n)
                    .map_err(|_| corrupt(format!("field max_crashes is too large: {n}")))?,
            },
            max_rejected_rows: opt_u("max_rejected_rows")?,
            max_rejected_percent: opt_f("max_rejected_percent")?,
            deadline_ms: num("deadline_ms")?,
            worker_hour_cost: opt_f("worker_hour_cost")?,
            pace: match map.get("pace").map(String::as_str) {
                None | Some("") => None,
                Some(v) => Some(
                    serde_json::from_str(v)
                        .map_err(|e| corrupt(format!("field pace is not a pace: {e}")))?,
                ),
            },
            orphan_grace_ms: num("orphan_grace_ms")?,
        })
    }
}

/// The `pace` hash field: JSON, or empty for none.
fn pace_field(pace: Option<&Pace>) -> String {
    pace.map(|p| serde_json::to_string(p).expect("a pace serializes"))
        .unwrap_or_default()
}

/// A change to a job's record: the fields one step of the job owns, and
/// nothing else. The done counters are never among them: only commits
/// change those.
#[derive(Debug, Clone, PartialEq)]
pub enum RecordUpdate {
    /// The job's manifest runs again: planning, its failure, reduce claim
    /// and finish time cleared, and whether to merge as the manifest says now.
    Rerun {
        /// `[output] merge`.
        merge: bool,
        /// `[failure] max_crashes`.
        max_crashes: u32,
        /// The running coordinator's `--orphan-grace`, in ms.
        orphan_grace_ms: u64,
    },
    /// The job's share of its pool's workers (`[job] priority`).
    Priority(String),
    /// Items (in seq order) whose publish the broker confirmed.
    Published(u64),
    /// Dead-lettered items replayed: running again, its failure, reduce
    /// claim and finish time cleared, and the model's digest replaced when
    /// the model was fixed (`--update-model`).
    Replayed {
        /// The new model digest.
        model_sha256: Option<String>,
    },
    /// `[job] deadline` and `[job] worker_hour_cost` as the manifest says
    /// now (a run of the manifest sets them again).
    Deadline {
        /// When (ms since the epoch; 0: none).
        deadline_ms: u64,
        /// Per worker-hour.
        worker_hour_cost: Option<f64>,
    },
    /// The job's pace as measured now.
    Pace(Pace),
    /// Reduced: its final status and when.
    Finished {
        /// The final status.
        status: JobStatus,
        /// When (ms since the epoch).
        at_ms: u64,
    },
}

impl RecordUpdate {
    /// The hash fields it writes.
    pub(crate) fn fields(&self) -> Vec<(&'static str, String)> {
        // The reduce claim (`reducer`) is not a record field: only the
        // reduce script reads it.
        let cleared = |status: JobStatus| {
            vec![
                ("status", status.as_str().to_owned()),
                ("failed_reason", String::new()),
                ("failed_class", String::new()),
                ("reducer", String::new()),
                ("finished_ms", "0".to_owned()),
            ]
        };
        match self {
            RecordUpdate::Rerun {
                merge,
                max_crashes,
                orphan_grace_ms,
            } => {
                let mut f = cleared(JobStatus::Planning);
                f.push(("merge", u8::from(*merge).to_string()));
                f.push(("max_crashes", max_crashes.to_string()));
                f.push(("orphan_grace_ms", orphan_grace_ms.to_string()));
                f
            }
            RecordUpdate::Priority(p) => vec![("priority", p.clone())],
            RecordUpdate::Published(n) => vec![("items_published", n.to_string())],
            RecordUpdate::Replayed { model_sha256 } => {
                let mut f = cleared(JobStatus::Running);
                if let Some(sha) = model_sha256 {
                    f.push(("model_sha256", sha.clone()));
                }
                f
            }
            RecordUpdate::Deadline {
                deadline_ms,
                worker_hour_cost,
            } => vec![
                ("deadline_ms", deadline_ms.to_string()),
                (
                    "worker_hour_cost",
                    worker_hour_cost.map(|v| v.to_string()).unwrap_or_default(),
                ),
            ],
            RecordUpdate::Pace(p) => vec![("pace", pace_field(Some(p)))],
            RecordUpdate::Finished { status, at_ms } => vec![
                ("status", status.as_str().to_owned()),
                ("finished_ms", at_ms.to_string()),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> JobRecord {
        JobRecord {
            name: "j".into(),
            status: JobStatus::Running,
            pool: "default".into(),
            manifest: "/m.toml".into(),
            output_dir: "/out".into(),
            max_failed_items: Some(2),
            rows_total: 30,
            items_done: 1,
            rows_done: 10,
            rows_rejected: 1,
            created_ms: 5,
            published_ms: 6,
            items_published: 2,
            merge: true,
            max_crashes: 5,
            max_rejected_rows: Some(7),
            max_rejected_percent: Some(2.5),
            deadline_ms: 7_200_005,
            worker_hour_cost: Some(1.2),
            orphan_grace_ms: 10_000,
            pace: Some(Pace {
                at_ms: 9,
                workers: 3,
                rows_per_worker_s: Some(12.5),
                workers_needed: Some(4),
                finish_ms: Some(8_000_000),
                late: true,
                worker_s: 30.5,
                worker_s_to_go: Some(100.0),
            }),
            ..JobRecord::sample("j-1")
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

    #[test]
    fn an_update_writes_only_the_fields_its_step_owns() {
        let names = |u: RecordUpdate| -> Vec<&'static str> {
            u.fields().into_iter().map(|(k, _)| k).collect()
        };
        for u in [
            RecordUpdate::Rerun {
                merge: true,
                max_crashes: 2,
                orphan_grace_ms: 10_000,
            },
            RecordUpdate::Priority("high".into()),
            RecordUpdate::Published(3),
            RecordUpdate::Replayed {
                model_sha256: Some("ab".into()),
            },
            RecordUpdate::Deadline {
                deadline_ms: 9,
                worker_hour_cost: Some(2.0),
            },
            RecordUpdate::Pace(Pace::default()),
            RecordUpdate::Finished {
                status: JobStatus::Completed,
                at_ms: 5,
            },
        ] {
            let written = names(u.clone());
            assert!(
                !written
                    .iter()
                    .any(|f| matches!(*f, "items_done" | "rows_done" | "rows_rejected")),
                "{u:?} writes a done counter: {written:?}"
            );
        }
        let rerun: BTreeMap<_, _> = RecordUpdate::Rerun {
            merge: false,
            max_crashes: 1,
            orphan_grace_ms: 4_000,
        }
        .fields()
        .into_iter()
        .collect();
        assert_eq!(rerun["status"], "planning");
        assert_eq!(
            (
                rerun["merge"].as_str(),
                rerun["finished_ms"].as_str(),
                rerun["orphan_grace_ms"].as_str()
            ),
            ("0", "0", "4000")
        );
        let replayed: BTreeMap<_, _> = RecordUpdate::Replayed { model_sha256: None }
            .fields()
            .into_iter()
            .collect();
        assert_eq!(replayed["status"], "running");
        assert!(!replayed.contains_key("model_sha256"));
    }
}
