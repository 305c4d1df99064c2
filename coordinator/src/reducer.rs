//! Closes a job: checks every committed item has its part file, writes
//! `_summary.json` atomically, then `_SUCCESS`, then marks the job completed.

use crate::error::RunError;
use batchfleet_shared::fsutil::publish_atomically;
use batchfleet_shared::message::{
    part_file_name, HistogramSpec, ModelRef, OutputFormat, OutputSpec,
};
use batchfleet_shared::output::{SUCCESS_FILE, SUMMARY_FILE};
use batchfleet_shared::store::{ItemFailure, ItemStats, JobRecord, JobStatus, RecordUpdate, Store};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// `_summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Job id.
    pub job_id: String,
    /// Job name.
    pub name: String,
    /// Worker pool.
    pub pool: String,
    /// Final status.
    pub status: String,
    /// Manifest the job ran from.
    pub manifest: String,
    /// Model file.
    pub model: String,
    /// Model SHA-256.
    pub model_sha256: String,
    /// Output folder.
    pub output_dir: String,
    /// Rows of the input: as planned, or, for items cut blind, as read.
    pub rows_total: u64,
    /// `rows_total` is still the planner's estimate: items cut blind that
    /// never ran (failed or skipped) were never read.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rows_total_estimated: bool,
    /// Rows predicted (committed).
    pub rows_predicted: u64,
    /// Rows rejected: malformed, or the model raised on them (see `_rejects/`).
    pub rows_rejected: u64,
    /// Items planned.
    pub items_total: u64,
    /// Items committed.
    pub items_completed: u64,
    /// Part files, in item order.
    pub parts: u64,
    /// Job registration time (ms since epoch).
    pub started_at_ms: u64,
    /// Completion time (ms since epoch).
    pub finished_at_ms: u64,
    /// Wall time from registration to completion.
    pub duration_s: f64,
    /// Predicted rows per wall-clock second.
    pub rows_per_s: f64,
    /// Per-item wall time on its worker.
    pub item_latency_ms: Latency,
    /// Distinct workers that committed items.
    pub workers: u64,
    /// Items whose part file was found published and only the done mark redone.
    pub items_recovered: u64,
    /// Rows a redelivered item did not recompute because its checkpoint held them.
    #[serde(default)]
    pub rows_resumed: u64,
    /// Items the coordinator published again (dead worker, straggler, lost message).
    #[serde(default)]
    pub items_redispatched: u64,
    /// Items started by workers (more than `items_total` when deliveries
    /// repeated: dead workers, speculative copies, outages).
    #[serde(default)]
    pub deliveries: u64,
    /// Rows put through the model, wasted work included; minus the rows
    /// predicted, that is the work faults cost.
    #[serde(default)]
    pub rows_computed: u64,
    /// Items that failed for good (dead-lettered).
    pub items_failed: u64,
    /// Items neither committed nor failed: skipped after the job failed.
    pub items_skipped: u64,
    /// Why the job failed (`failed` status only): the error budget, or what
    /// made it unrunnable (the model, or no able worker), naming them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_reason: Option<String>,
    /// `budget`, `unrunnable` or `unable` (`failed` status only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_class: Option<String>,
    /// Each failed item with its class and reason.
    pub failed_items: Vec<ItemFailure>,
    /// Distribution of each model output over the committed rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predictions: Option<Distribution>,
    /// The vectors written (`[output] vector`): dimension and norms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vectors: Option<VectorSummary>,
    /// What `[on_complete]` did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_complete: Option<crate::hooks::HookOutcome>,
    /// The merged output (`[output] merge = true`), once every item completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged: Option<PathBuf>,
    /// The `--set` overrides the job ran with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<String>,
    /// The manifest as validated (the file with the overrides applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_manifest: Option<serde_json::Value>,
    /// Every input file with what it was when the job was planned (size,
    /// modification time or ETag): the data these predictions came from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<crate::manifest::InputFile>,
    /// `[job] deadline` and `[job] worker_hour_cost`: whether the job met
    /// its deadline, the worker-hours it used and its cost per million rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlook: Option<crate::pace::Outlook>,
    /// `run --since`: the finished job it followed, the files it scored
    /// (new, and changed with where their out-of-date predictions are) and
    /// the files it reused, with the job and output folder holding them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental: Option<crate::since::Incremental>,
    /// `[model.shadow]`: the candidate model against the job's over every
    /// row both predicted (`batchfleet compare JOB` reads it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<crate::shadow::ShadowSummary>,
}

/// Histograms of the model's outputs: equal-width bins over `[min, max)`,
/// plus one below and one above.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    /// Lower edge of the first bin.
    pub min: f64,
    /// Upper edge of the last bin.
    pub max: f64,
    /// Bins between `min` and `max`.
    pub bins: u32,
    /// One histogram per output column.
    pub columns: Vec<ColumnDistribution>,
}

/// The histogram of one output column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ColumnDistribution {
    /// Column name in the part files (`score`, `score_0`, …).
    pub name: String,
    /// Rows counted.
    pub rows: u64,
    /// `bins + 2` counts: below `min`, the bins in order, at or above `max`.
    pub counts: Vec<u64>,
}

impl Distribution {
    /// From `counts[column][bin]` as stored in Redis; `names` are the
    /// output columns' names (`[output] columns`), empty for the defaults.
    pub fn new(spec: &HistogramSpec, counts: Vec<Vec<u64>>, names: &[String]) -> Option<Self> {
        if counts.is_empty() {
            return None;
        }
        let width = counts.len();
        Some(Self {
            min: spec.min,
            max: spec.max,
            bins: spec.bins,
            columns: counts
                .into_iter()
                .enumerate()
                .map(|(i, c)| ColumnDistribution {
                    name: column_name(names, i, width),
                    rows: c.iter().sum(),
                    counts: c,
                })
                .collect(),
        })
    }
}

/// The name of output column `i` of `width`: `names[i]` when `names`
/// names every column (as the part files do), else the default `score` /
/// `score_<i>`.
pub(crate) fn column_name(names: &[String], i: usize, width: usize) -> String {
    match names.get(i) {
        Some(n) if names.len() == width => n.clone(),
        _ if width == 1 => "score".into(),
        _ => format!("score_{i}"),
    }
}

/// What an embedding job wrote: how many vectors of what dimension, and
/// their L2 norms (about 1 throughout when `[output] normalize` is set; a
/// spread of norms, or zeros, is worth a look otherwise).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VectorSummary {
    /// Values per vector.
    pub dim: u32,
    /// Vectors counted (rows the model failed on are not).
    pub rows: u64,
    /// Mean L2 norm.
    pub mean_norm: f64,
    /// Least norm.
    pub min_norm: f64,
    /// Largest norm.
    pub max_norm: f64,
}

impl VectorSummary {
    /// Over the items' stats.
    pub fn of(stats: &[ItemStats]) -> Option<Self> {
        let all = stats.iter().fold(None, |acc, s| {
            batchfleet_shared::store::VectorStats::merge(acc, s.vector)
        })?;
        Some(Self {
            dim: all.dim,
            rows: all.rows,
            mean_norm: all.norm_sum / all.rows.max(1) as f64,
            min_norm: all.norm_min,
            max_norm: all.norm_max,
        })
    }
}

/// The names of the model-output columns in the header of the first
/// committed part file (see [`OutputSpec::is_score_column`]); else
/// `[output] columns`.
fn output_names(
    out: &std::path::Path,
    format: OutputFormat,
    stats: &[ItemStats],
    output: &OutputSpec,
) -> Vec<String> {
    let header = stats.first().and_then(|s| {
        let rel = std::path::PathBuf::from(part_file_name(s.seq, format));
        batchfleet_shared::fsutil::open_under(out, &rel)
            .and_then(|input| batchfleet_shared::table::column_names(input, format))
            .ok()
    });
    match header {
        Some(names) => names
            .into_iter()
            .filter(|n| output.is_score_column(n))
            .collect(),
        None => output.columns.clone(),
    }
}

/// Latency percentiles in milliseconds (nearest-rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct Latency {
    /// Median.
    pub p50: u64,
    /// 95th percentile.
    pub p95: u64,
    /// Maximum.
    pub max: u64,
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Latency figures of a set of committed items.
pub fn latency(stats: &[ItemStats]) -> Latency {
    let mut v: Vec<u64> = stats.iter().map(ItemStats::latency_ms).collect();
    v.sort_unstable();
    Latency {
        p50: percentile(&v, 50.0),
        p95: percentile(&v, 95.0),
        max: v.last().copied().unwrap_or(0),
    }
}

/// Reads a job's `_summary.json`.
pub fn read_summary(path: &std::path::Path) -> Result<Summary, RunError> {
    let bytes = batchfleet_shared::source::fs::read(path)
        .map_err(RunError::io_while(format!("read {}", path.display())))?;
    serde_json::from_slice(&bytes).map_err(|e| RunError::NotA {
        path: path.to_owned(),
        what: "a batchfleet summary",
        reason: e.to_string(),
    })
}

/// Replaces `_summary.json` (after the completion hooks added their outcome).
pub fn rewrite(path: &std::path::Path, summary: &Summary) -> Result<(), RunError> {
    let json = serde_json::to_vec_pretty(summary).expect("summary serializes");
    publish_atomically(path, true, |w| std::io::Write::write_all(w, &json))
        .map(|_| ())
        .map_err(RunError::io_while(format!("write {}", path.display())))
}

/// Writes the merged output (for a job recorded with `merge`, when every
/// item completed), the summary, and `_SUCCESS` when no item failed, and
/// returns the summary; [`mark_finished`] then records the final status
/// (`completed`, `completed_with_failures`, `failed`, `cancelled`).
/// `output` is the job's `[output]` (its histogram bins and column names);
/// the output columns' names are read from a committed part file's header
/// when there is one, so the histograms carry the names the parts do (the
/// selected outputs' `<key>_<i>`, `[output] columns`, or the defaults).
pub async fn finish(
    store: &Store,
    job_id: &str,
    output: &OutputSpec,
    shadow: Option<&ModelRef>,
) -> Result<(PathBuf, Summary), RunError> {
    let histogram = &output.histogram;
    let job = store.job(job_id).await?.ok_or_else(|| {
        RunError::UnknownJob(format!("job {job_id} vanished from Redis while finishing"))
    })?;
    let format = OutputFormat::parse(&job.output_format).ok_or_else(|| RunError::BadRecord {
        job: job_id.to_owned(),
        problem: format!("unknown output format {:?}", job.output_format),
    })?;
    let stats = store.item_stats(job_id).await?;
    let (deliveries, rows_computed) = store.work(job_id).await?;
    let failures = store.failures(job_id).await?;
    let status = if matches!(job.status, JobStatus::Failed | JobStatus::Cancelled) {
        job.status
    } else if failures.is_empty() {
        JobStatus::Completed
    } else {
        JobStatus::CompletedWithFailures
    };
    let out = std::path::Path::new(&job.output_dir);
    check_parts(out, format, &stats)?;
    let finished = batchfleet_shared::now_ms();
    let duration_s = finished.saturating_sub(job.created_ms) as f64 / 1000.0;
    // rows_done counts every settled row: predicted or rejected.
    let rows_predicted = job.rows_done.saturating_sub(job.rows_rejected);
    let workers: BTreeSet<&str> = stats.iter().map(|s| s.worker.as_str()).collect();
    let names = output_names(out, format, &stats, output);
    let mut summary = Summary {
        job_id: job.id.clone(),
        name: job.name.clone(),
        pool: job.pool.clone(),
        status: status.as_str().into(),
        manifest: job.manifest.clone(),
        model: job.model.clone(),
        model_sha256: job.model_sha256.clone(),
        output_dir: job.output_dir.clone(),
        // Items cut blind: every committed one counted its rows.
        rows_total: if job.rows_estimated && job.items_done == job.items_total {
            job.rows_done
        } else {
            job.rows_total
        },
        rows_total_estimated: job.rows_estimated && job.items_done < job.items_total,
        rows_predicted,
        rows_rejected: job.rows_rejected,
        items_total: job.items_total,
        items_completed: job.items_done,
        parts: stats.len() as u64,
        started_at_ms: job.created_ms,
        finished_at_ms: finished,
        duration_s,
        rows_per_s: if duration_s > 0.0 {
            (rows_predicted as f64 / duration_s).round()
        } else {
            0.0
        },
        item_latency_ms: latency(&stats),
        workers: workers.len() as u64,
        items_recovered: stats.iter().filter(|s| s.recovered).count() as u64,
        rows_resumed: stats.iter().map(|s| s.rows_resumed).sum(),
        items_redispatched: store.redispatched(job_id).await?.len() as u64,
        deliveries,
        rows_computed,
        items_failed: failures.len() as u64,
        items_skipped: job
            .items_total
            .saturating_sub(job.items_done + failures.len() as u64),
        failed_reason: (matches!(status, JobStatus::Failed | JobStatus::Cancelled)
            && !job.failed_reason.is_empty())
        .then(|| job.failed_reason.clone()),
        failed_class: matches!(status, JobStatus::Failed | JobStatus::Cancelled).then(|| {
            if job.failed_class.is_empty() {
                "budget".to_owned()
            } else {
                job.failed_class.clone()
            }
        }),
        failed_items: failures,
        predictions: Distribution::new(
            histogram,
            store.histogram(job_id, histogram.bins as usize + 2).await?,
            &names,
        ),
        shadow: crate::shadow::ShadowSummary::of(&stats, shadow, output, &names),
        vectors: VectorSummary::of(&stats),
        on_complete: None,
        merged: None,
        overrides: job.overrides.clone(),
        resolved_manifest: toml::from_str::<toml::Value>(&job.resolved_manifest)
            .ok()
            .filter(|_| !job.resolved_manifest.is_empty())
            .and_then(|v| serde_json::to_value(v).ok()),
        inputs: store
            .inputs(job_id)
            .await?
            .into_iter()
            .filter_map(|(path, json)| {
                // The fingerprint's fields, and (jobs since it) the items.
                let mut v: serde_json::Value = serde_json::from_str(&json).ok()?;
                v.as_object_mut()?.insert("path".into(), path.into());
                serde_json::from_value(v).ok()
            })
            .collect(),
        incremental: crate::since::read(out),
        outlook: crate::pace::Outlook::of(
            &JobRecord {
                status,
                finished_ms: finished,
                ..job.clone()
            },
            finished,
        ),
    };
    if job.merge {
        if status == JobStatus::Completed {
            summary.merged = Some(merge(job_id, out, format, &stats)?);
        } else {
            tracing::warn!(job = %job_id, items_failed = summary.items_failed, "no merged output: not every item completed; replay the dead-letter queue to complete the job, which then writes it");
        }
    }
    batchfleet_shared::output::remove_legacy(out, format);
    let path = write_summary(out, &summary, status)?;
    Ok((path, summary))
}

/// Every committed item has its part file in `out`: an error naming the
/// missing ones otherwise (the output folder was changed during the job).
fn check_parts(out: &Path, format: OutputFormat, stats: &[ItemStats]) -> Result<(), RunError> {
    // One listing of the folder (one request for S3), not a lookup per part.
    let present: std::collections::HashSet<String> = batchfleet_shared::source::fs::list_dir(out)
        .map_err(RunError::io_while(format!("list {}", out.display())))?
        .into_iter()
        .collect();
    let missing: Vec<String> = stats
        .iter()
        .map(|s| part_file_name(s.seq, format))
        .filter(|name| !present.contains(name))
        .collect();
    if let Some(first) = missing.first() {
        return Err(RunError::OutputChanged(format!(
            "{} committed item(s) have no part file in {} (first: {first})",
            missing.len(),
            out.display(),
        )));
    }
    Ok(())
}

/// Writes the merged output of the committed items' part files, in seq
/// order (which is input order: items are numbered file by file, range by
/// range); its path.
fn merge(
    job_id: &str,
    out: &Path,
    format: OutputFormat,
    stats: &[ItemStats],
) -> Result<PathBuf, RunError> {
    let parts = stats
        .iter()
        .map(|s| {
            batchfleet_shared::fsutil::open_under(out, Path::new(&part_file_name(s.seq, format)))
        })
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(RunError::io_while(format!(
            "read the part files in {}",
            out.display()
        )))?;
    let rel = batchfleet_shared::output::merged_rel(format);
    let merged = out.join(&rel);
    batchfleet_shared::fsutil::publish_under(out, &rel, true, |w| {
        batchfleet_shared::table::concat_parts(w, format, &parts)
    })
    .map_err(RunError::io_while(format!("write {}", merged.display())))?;
    tracing::info!(job = %job_id, path = %merged.display(), parts = parts.len(), "merged output written");
    Ok(merged)
}

/// Writes `_summary.json` (and `_SUCCESS` when the job completed) into
/// `out`; its path.
fn write_summary(out: &Path, summary: &Summary, status: JobStatus) -> Result<PathBuf, RunError> {
    let path = out.join(SUMMARY_FILE);
    let json = serde_json::to_vec_pretty(summary).expect("summary serializes");
    let write = |p: &Path, bytes: &[u8]| {
        publish_atomically(p, true, |w| std::io::Write::write_all(w, bytes))
            .map_err(RunError::io_while(format!("write {}", p.display())))
    };
    // Checkpoint segments left by a slower copy of an item that lost the
    // race, and staged files a worker killed mid-write left behind (every
    // item is settled: no writer of this job needs them) — unless the job
    // was cancelled: then the segments are what a run of it again
    // continues from.
    if status != JobStatus::Cancelled {
        batchfleet_shared::output::remove_leftovers(out);
    }
    write(&path, &json)?;
    if status == JobStatus::Completed {
        write(&out.join(SUCCESS_FILE), b"")?;
    }
    Ok(path)
}

/// The reduce step's last write: the job's final status and finish time
/// (what followers wait for — so after the hooks ran), then the retention
/// of its state: kept that long, its summary for good.
pub async fn mark_finished(
    store: &Store,
    summary: &Summary,
    retention: std::time::Duration,
) -> Result<(), RunError> {
    let status = JobStatus::from_name(&summary.status).ok_or_else(|| RunError::BadRecord {
        job: summary.job_id.clone(),
        problem: format!("its summary has unknown status {:?}", summary.status),
    })?;
    let finished = RecordUpdate::Finished {
        status,
        at_ms: summary.finished_at_ms,
    };
    store.update_job(&summary.job_id, &finished).await?;
    store.expire_job(&summary.job_id, retention).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_name_columns_as_the_part_files_do() {
        let spec = HistogramSpec::default();
        let counts = || vec![vec![1; 22], vec![2; 22]];
        let names = |d: Option<Distribution>| {
            d.unwrap()
                .columns
                .into_iter()
                .map(|c| c.name)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(Distribution::new(&spec, counts(), &[])),
            ["score_0", "score_1"]
        );
        let named = ["cat".to_owned(), "dog".to_owned()];
        assert_eq!(
            names(Distribution::new(&spec, counts(), &named)),
            ["cat", "dog"]
        );
        assert_eq!(
            names(Distribution::new(&spec, vec![vec![0; 22]], &[])),
            ["score"]
        );
        assert!(Distribution::new(&spec, Vec::new(), &named).is_none());
    }

    fn stat(seq: u32, ms: u64) -> ItemStats {
        ItemStats {
            seq,
            rows: 1,
            rows_rejected: 0,
            worker: "w".into(),
            started_ms: 1000,
            finished_ms: 1000 + ms,
            attempt: 1,
            recovered: false,
            rows_resumed: 0,
            vector: None,
            shadow: None,
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let stats: Vec<ItemStats> = (1..=20).map(|i| stat(i, u64::from(i) * 10)).collect();
        assert_eq!(
            latency(&stats),
            Latency {
                p50: 100,
                p95: 190,
                max: 200
            }
        );
        assert_eq!(latency(&[]), Latency::default());
        assert_eq!(
            latency(&[stat(0, 7)]),
            Latency {
                p50: 7,
                p95: 7,
                max: 7
            }
        );
    }
}
