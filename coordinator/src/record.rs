//! A job's record, made from its spec and plan ([`job_record`], with its
//! input files' fingerprints, [`input_fields`]) and rebuilt from its output
//! folder ([`scan_job_outputs`]: the committed items a part file proves,
//! with their prediction histograms) — what a job resumed after Redis lost
//! its state, or run again, starts from.

use crate::error::RunError;
use crate::manifest::JobSpec;
use crate::planner::{self, Plan};
use batchfleet_shared::split::ItemRows;
use batchfleet_shared::store::{Commit, ItemStats, JobRecord, JobStatus};
use std::path::Path;

/// A new job's record: planned totals, no progress.
pub fn job_record(spec: &JobSpec, plan: &planner::Plan, created_ms: u64) -> JobRecord {
    JobRecord {
        id: spec.job_id.clone(),
        name: spec.name.clone(),
        status: JobStatus::Planning,
        pool: spec.pool.clone(),
        manifest: spec.manifest_path.to_string_lossy().into_owned(),
        output_dir: spec.task.output.dir.clone(),
        output_format: spec.task.output.format.as_str().to_owned(),
        model: spec.task.model.path.clone(),
        model_sha256: spec.task.model.sha256.clone(),
        max_failed_items: spec.budget.max_failed_items,
        max_failed_percent: spec.budget.max_failed_percent,
        items_total: plan.items.len() as u64,
        rows_total: plan.rows_total,
        rows_estimated: plan.rows_estimated,
        items_done: 0,
        rows_done: 0,
        rows_rejected: 0,
        created_ms,
        published_ms: 0,
        finished_ms: 0,
        items_published: 0,
        merge: spec.merge,
        failed_reason: String::new(),
        failed_class: String::new(),
        overrides: spec.overrides.clone(),
        resolved_manifest: spec.resolved_manifest.clone(),
        priority: spec.priority.as_str().to_owned(),
        // A bitmap done set; `--whole-messages` (workers before it) turns it off.
        done_bits: true,
        max_crashes: spec.budget.max_crashes,
        max_rejected_rows: spec.budget.max_rejected_rows,
        max_rejected_percent: spec.budget.max_rejected_percent,
        deadline_ms: spec.deadline.map_or(0, |d| d.at_ms(created_ms)),
        worker_hour_cost: spec.worker_hour_cost,
        pace: None,
        // The coordinator that runs it says its own.
        orphan_grace_ms: 0,
    }
}

/// The job's input files as the store records them: path → JSON
/// fingerprint, with the first and last item holding the file's rows.
pub fn input_fields(spec: &JobSpec, plan: &planner::Plan) -> Vec<(String, String)> {
    let mut items: std::collections::HashMap<std::path::PathBuf, [u32; 2]> =
        std::collections::HashMap::new();
    for item in &plan.items {
        for file in item.input.input_files() {
            let range = items.entry(file).or_insert([item.seq, item.seq]);
            range[0] = range[0].min(item.seq);
            range[1] = range[1].max(item.seq);
        }
    }
    spec.input_files()
        .into_iter()
        .map(|f| {
            let file = crate::manifest::InputFile {
                items: items.get(std::path::Path::new(&f.path)).copied(),
                ..f
            };
            let mut json = serde_json::to_value(&file).expect("an input file serializes");
            if let Some(o) = json.as_object_mut() {
                o.remove("path");
            }
            (file.path, json.to_string())
        })
        .collect()
}

/// A committed item found in the output folder: its stats and the histogram
/// of its predictions (`counts[column][bin]`).
pub type Recovered = (ItemStats, Vec<Vec<u64>>);

/// Commits the items found in the output folder, a few hundred per Redis
/// call (group commit); how many of them won (were not committed yet).
pub async fn commit_found(
    store: &batchfleet_shared::store::Store,
    job: &str,
    found: &[Recovered],
) -> Result<u64, RunError> {
    let mut won = 0;
    for chunk in found.chunks(256) {
        let commits: Vec<Commit<'_>> = chunk
            .iter()
            .map(|(stats, histogram)| Commit {
                stats,
                histogram,
                leased: true,
            })
            .collect();
        let answers = store
            .commit_group(job, &commits, batchfleet_shared::store::Work::default())
            .await?;
        won += answers.into_iter().filter(|w| *w).count() as u64;
    }
    Ok(won)
}

/// [`scan_outputs`] over the job's output folder, for the plan's items
/// that `wanted` selects, on a blocking thread.
pub async fn scan_job_outputs(
    spec: &JobSpec,
    plan: &Plan,
    wanted: impl Fn(u32) -> bool,
    strict: bool,
) -> Result<Vec<Recovered>, RunError> {
    let out = spec.output_dir().to_owned();
    let output = spec.task.output.clone();
    let items: Vec<(u32, ItemRows)> = plan
        .items
        .iter()
        .filter(|i| wanted(i.seq))
        .map(|i| (i.seq, ItemRows::of(i)))
        .collect();
    tokio::task::spawn_blocking(move || scan_outputs(&out, &output, &items, strict))
        .await
        .map_err(|e| RunError::Task {
            what: "the output scan",
            reason: e.to_string(),
        })?
}

/// The committed items found in an output folder, with the histograms of
/// their predictions: each part file whose rows plus rejects add up to its
/// item's rows. A part file that does not add up is an error naming it (the
/// folder was changed under the job) when `strict`; otherwise it is left out,
/// for a worker to complete (its writer died between the part and its rejects).
pub fn scan_outputs(
    out: &Path,
    spec: &batchfleet_shared::message::OutputSpec,
    items: &[(u32, ItemRows)],
    strict: bool,
) -> Result<Vec<Recovered>, RunError> {
    let now = batchfleet_shared::now_ms();
    let mut found = Vec::new();
    for (seq, rows) in items {
        let seq = *seq;
        let name = spec.part_name(seq);
        let part = out.join(&name);
        // Read through the folder's handle: a link planted there is refused.
        let there = batchfleet_shared::fsutil::exists_under(out, Path::new(&name))
            .map_err(RunError::io_while(format!("look for {}", part.display())))?;
        if !there {
            continue;
        }
        let read = |e: std::io::Error| RunError::io(format!("read {}", part.display()), e);
        let tally = batchfleet_shared::output::histogram_under(out, Path::new(&name), spec)
            .map_err(read)?;
        let (predicted, hist) = (tally.rows, tally.counts);
        let rejected = batchfleet_shared::output::count_rejects_under(out, seq).map_err(read)?;
        let rows = rows.get().map_err(RunError::io_while(format!(
            "count the input rows of item {seq}"
        )))?;
        if predicted + rejected != rows && !strict {
            tracing::warn!(part = %part.display(), predicted, rejected, rows, "a part file whose rows do not add up; its item is computed again");
            continue;
        }
        if predicted + rejected != rows {
            return Err(RunError::OutputChanged(format!(
                "{} holds {predicted} rows and {rejected} rejects but item {seq} has {rows}",
                part.display()
            )));
        }
        found.push((
            ItemStats {
                seq,
                rows: predicted,
                rows_rejected: rejected,
                worker: "rebuilt-from-files".into(),
                started_ms: now,
                finished_ms: now,
                attempt: 0,
                recovered: true,
                rows_resumed: 0,
                vector: tally.vector,
                shadow: None,
            },
            hist,
        ));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_finds_committed_parts_and_rejects_and_refuses_a_short_one() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        std::fs::write(out.join("part-000000.csv"), "id,score\na,1\nb,2\n").unwrap();
        std::fs::create_dir_all(out.join("_rejects")).unwrap();
        std::fs::write(out.join("_rejects/part-000000.jsonl"), "{}\n").unwrap();
        let spec = batchfleet_shared::message::OutputSpec {
            histogram: batchfleet_shared::message::HistogramSpec {
                min: 0.0,
                max: 2.0,
                bins: 2,
            },
            ..Default::default()
        };
        let found = scan_outputs(
            out,
            &spec,
            &[(0, ItemRows::Known(3)), (1, ItemRows::Known(4))],
            true,
        )
        .unwrap();
        assert_eq!(found.len(), 1, "item 1 has no part file");
        let (stats, hist) = &found[0];
        assert_eq!((stats.seq, stats.rows, stats.rows_rejected), (0, 2, 1));
        assert!(stats.recovered);
        // Scores 1 and 2 over [0, 2) in 2 bins: one in the second bin, one above.
        assert_eq!(hist, &vec![vec![0, 0, 1, 1]]);
        let err = scan_outputs(out, &spec, &[(0, ItemRows::Known(5))], true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("part-000000.csv") && err.contains("item 0 has 5"),
            "{err}"
        );
        // Not strict (a resume): the item whose part does not add up is left out.
        assert!(scan_outputs(out, &spec, &[(0, ItemRows::Known(5))], false)
            .unwrap()
            .is_empty());
    }
}
