//! The layout of a job's output folder, read back: used by workers that find
//! an item already published, and by the coordinator when it rebuilds lost
//! Redis state from the files (which are the truth).

use std::path::{Path, PathBuf};

/// The merged output of a job with `[output] merge = true`: every part, in
/// input order, in the job's output format (`predictions.csv`, …).
pub fn merged_file_name(format: crate::message::OutputFormat) -> String {
    format!("predictions.{}", format.extension())
}

/// Folder (inside the output folder) holding `part-<seq>.jsonl` rejects files.
pub const REJECTS_DIR: &str = "rejects";

/// The rejects file of item `seq` in output folder `out`.
pub fn rejects_path(out: &Path, seq: u32) -> PathBuf {
    out.join(REJECTS_DIR).join(format!("part-{seq:06}.jsonl"))
}

/// Counts the data rows of a committed part file (used when a redelivered
/// item finds its output already published).
pub use crate::table::count_rows;

/// Counts the lines of a rejects file; 0 if there is none.
pub fn count_rejects(path: &Path) -> std::io::Result<u64> {
    match crate::source::fs::read(path) {
        Ok(bytes) => Ok(bytes.iter().filter(|b| **b == b'\n').count() as u64),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

/// Rows of a part file and the histogram of its model-output columns
/// (`counts[c][bin]`, see [`crate::message::OutputSpec::is_score_column`]).
pub fn histogram_of_part(
    path: &Path,
    spec: &crate::message::OutputSpec,
) -> std::io::Result<(u64, Vec<Vec<u64>>)> {
    let mut counts: Vec<Vec<u64>> = Vec::new();
    let mut rows = 0;
    let mut values = Vec::new();
    let mut scores: Option<Vec<usize>> = None;
    crate::table::read_part(path, |names, row| {
        rows += 1;
        let cols = scores.get_or_insert_with(|| {
            (0..names.len())
                .filter(|c| spec.is_score_column(&names[*c]))
                .collect()
        });
        values.clear();
        values.extend(
            cols.iter()
                .map(|c| row[*c].as_f64().map_or(f32::NAN, |v| v as f32)),
        );
        spec.histogram.add(&mut counts, &values, values.len());
    })?;
    Ok((rows, counts))
}
