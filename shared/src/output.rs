//! The layout of a job's output folder — every name in it is defined here —
//! and its files read back: used by workers that find an item already
//! published, and by the coordinator when it rebuilds lost Redis state from
//! the files (which are the truth).
//!
//! Only part files match `part-*`, and every other name starts with `_`:
//! pyarrow, pandas, Spark, Hive and DuckDB skip those, so the folder reads
//! as a dataset of the predicted rows (docs/reading-results.md).
//!
//! | name | what |
//! | --- | --- |
//! | `part-<seq>.<format>` | the committed predictions of item `seq` |
//! | `_rejects/part-<seq>.jsonl` | its rejected rows, with why |
//! | `_partial/part-<seq>-<digest>/` | checkpoint segments of an item in progress |
//! | `_staging/` | files being written (random names; never read); emptied when the job settles (a worker killed mid-write leaves its file here) |
//! | `_JOB` | the id of the job that owns the folder |
//! | `_summary.json`, `_SUCCESS` | written when the job settles (`_SUCCESS` only if it completed) |
//! | `_merged/predictions.<format>` | the merged output (`[output] merge = true`) |
//! | `_dead/item-<seq>.json` | an item a `--local` run dead-lettered, with why (`batchfleet dlq list --local`) |

use std::path::{Path, PathBuf};

/// The merged output of a job with `[output] merge = true`, relative to
/// its output folder: every part, in input order, in the job's output
/// format (`_merged/predictions.csv`, …) — in a folder of its own, so that
/// a reader of the output folder does not read its rows twice.
pub fn merged_rel(format: crate::message::OutputFormat) -> PathBuf {
    Path::new(MERGED_DIR).join(legacy_merged_name(format))
}

/// Folder (inside the output folder) holding the merged output.
pub const MERGED_DIR: &str = "_merged";

/// Where batchfleet 0.1 wrote the merged output: beside the parts.
fn legacy_merged_name(format: crate::message::OutputFormat) -> String {
    format!("predictions.{}", format.extension())
}

/// Folder (inside the output folder) holding `part-<seq>.jsonl` rejects files.
pub const REJECTS_DIR: &str = "_rejects";
/// Where batchfleet 0.1 wrote the rejects files.
const LEGACY_REJECTS_DIR: &str = "rejects";
/// File in the output folder naming the job that owns it.
pub const OWNER_FILE: &str = "_JOB";
/// File written into the output folder when a job completed.
pub const SUCCESS_FILE: &str = "_SUCCESS";
/// The job summary.
pub const SUMMARY_FILE: &str = "_summary.json";
/// The job summary's name in batchfleet 0.1 (still read).
pub const LEGACY_SUMMARY_FILE: &str = "summary.json";

/// The summary in output folder `out`: `_summary.json`, or the
/// `summary.json` an older batchfleet wrote where only that exists (local
/// folders and `s3://` prefixes alike).
pub fn summary_in(out: &Path) -> PathBuf {
    let new = out.join(SUMMARY_FILE);
    let old = out.join(LEGACY_SUMMARY_FILE);
    let exists = |p: &Path| crate::source::fs::exists(p).unwrap_or(false);
    if !exists(&new) && exists(&old) {
        old
    } else {
        new
    }
}

/// Brings a folder an older batchfleet wrote to today's layout, so a job
/// run again there reads as a dataset: its rejects files move from
/// `rejects/` to `_rejects/` (local folders; in S3, where nothing moves,
/// they stay and are still counted). Best effort.
pub fn adopt_legacy_layout(out: &Path) {
    if crate::source::is_url(out) {
        return;
    }
    let old = out.join(LEGACY_REJECTS_DIR);
    let Ok(entries) = std::fs::symlink_metadata(&old).map(|m| m.is_dir()) else {
        return;
    };
    if !entries {
        return;
    }
    let new = out.join(REJECTS_DIR);
    if std::fs::create_dir_all(&new).is_err() {
        return;
    }
    for entry in std::fs::read_dir(&old).into_iter().flatten().flatten() {
        let _ = std::fs::rename(entry.path(), new.join(entry.file_name()));
    }
    let _ = std::fs::remove_dir(&old);
}

/// Removes what an older batchfleet wrote under another name and this job
/// writes anew: `summary.json` and the merged `predictions.<format>` beside
/// the parts (which a reader of the folder would take for data). Best effort.
pub fn remove_legacy(out: &Path, format: crate::message::OutputFormat) {
    for name in [LEGACY_SUMMARY_FILE.to_owned(), legacy_merged_name(format)] {
        let _ = crate::source::fs::remove_file(&out.join(name));
    }
}
/// Folder holding the checkpoint segments of items in progress.
pub const PARTIAL_DIR: &str = "_partial";
/// Folder holding temporary files while they are written (never read):
/// the atomic publication's, so [`crate::fsutil`] owns its name.
pub use crate::fsutil::STAGING_DIR;

/// Removes what no writer of a settled job needs any more from its output
/// folder `out`: checkpoint segments a slower copy of an item left
/// (`_partial/`) and files a worker killed mid-write left staged
/// (`_staging/`). Best effort: what cannot be removed stays.
pub fn remove_leftovers(out: &Path) {
    for left in [PARTIAL_DIR, STAGING_DIR] {
        let _ = crate::fsutil::remove_tree_under(out, Path::new(left));
    }
}
/// Items a `--local` run dead-lettered, one JSON file each with the reason
/// (the fleet keeps them in its dead queue instead).
pub const DEAD_DIR: &str = "_dead";

/// Counts the data rows of a committed part file (used when a redelivered
/// item finds its output already published).
pub use crate::table::count_rows;

/// The rejects file of item `seq`, relative to its output folder.
pub fn rejects_rel(seq: u32) -> PathBuf {
    Path::new(REJECTS_DIR).join(format!("part-{seq:06}.jsonl"))
}

/// Counts the rejected rows of item `seq` in output folder `out` (the
/// lines of its rejects file, or of the one an older batchfleet wrote under
/// `rejects/`; 0 if it has none), following no link inside the folder.
pub fn count_rejects_under(out: &Path, seq: u32) -> std::io::Result<u64> {
    let legacy = Path::new(LEGACY_REJECTS_DIR).join(format!("part-{seq:06}.jsonl"));
    for rel in [rejects_rel(seq), legacy] {
        match crate::fsutil::open_under(out, &rel).and_then(|i| i.read_all()) {
            Ok(bytes) => return Ok(bytes.iter().filter(|b| **b == b'\n').count() as u64),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(0)
}

/// What a part file holds, as the job's summary counts it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// Rows.
    pub rows: u64,
    /// The histogram of its model-output columns (`counts[c][bin]`, see
    /// [`crate::message::OutputSpec::is_score_column`]); none for vectors.
    pub counts: Vec<Vec<u64>>,
    /// The norms of its vectors (`[output] vector`).
    pub vector: Option<crate::store::VectorStats>,
}

/// The [`Tally`] of the part file `rel` of output folder `out`, following
/// no link inside the folder.
pub fn histogram_under(
    out: &Path,
    rel: &Path,
    spec: &crate::message::OutputSpec,
) -> std::io::Result<Tally> {
    histogram_of(
        crate::fsutil::open_under(out, rel)?,
        crate::table::format_of(rel)?,
        spec,
    )
}

/// [`histogram_under`] for a part file already opened, in `format`.
pub fn histogram_of(
    input: crate::source::Input,
    format: crate::message::OutputFormat,
    spec: &crate::message::OutputSpec,
) -> std::io::Result<Tally> {
    let mut tally = Tally::default();
    let mut values = Vec::new();
    let mut scores: Option<Vec<usize>> = None;
    crate::table::read_input(input, format, |names, row| {
        tally.rows += 1;
        let cols = scores.get_or_insert_with(|| match &spec.vector {
            // One column (JSON Lines, Parquet) or `<name>_<i>` (CSV).
            Some(v) => (0..names.len())
                .filter(|c| {
                    names[*c] == *v
                        || names[*c].strip_prefix(v.as_str()).is_some_and(|rest| {
                            rest.strip_prefix('_').is_some_and(|n| {
                                !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
                            })
                        })
                })
                .collect(),
            None => (0..names.len())
                .filter(|c| spec.is_score_column(&names[*c]))
                .collect(),
        });
        if spec.vector.is_some() {
            // One vector value (JSON Lines, Parquet), or one number per column (CSV).
            let one_vector = match cols.as_slice() {
                [one] => match &row[*one] {
                    crate::table::Value::Vector(v) => Some(v),
                    _ => None,
                },
                _ => None,
            };
            let row_stats = match one_vector {
                Some(v) => crate::store::VectorStats::of_row(v.iter().copied()),
                None => crate::store::VectorStats::of_row(
                    cols.iter().map(|c| row[*c].as_f64().unwrap_or(f64::NAN)),
                ),
            };
            tally.vector = crate::store::VectorStats::merge(tally.vector, row_stats);
            return;
        }
        values.clear();
        values.extend(
            cols.iter()
                .map(|c| row[*c].as_f64().map_or(f32::NAN, |v| v as f32)),
        );
        spec.histogram.add(&mut tally.counts, &values, values.len());
    })?;
    Ok(tally)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{OutputFormat, OutputSpec};
    use crate::table::{Cell, Kind, PartWriter};

    #[test]
    fn a_folder_an_older_batchfleet_wrote_is_read_and_brought_to_todays_layout() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        // Nothing yet: the summary is where this version writes it.
        assert_eq!(summary_in(out), out.join("_summary.json"));
        std::fs::write(out.join("summary.json"), "{}").unwrap();
        std::fs::write(out.join("predictions.csv"), "id,score\n").unwrap();
        std::fs::create_dir(out.join("rejects")).unwrap();
        std::fs::write(out.join("rejects/part-000003.jsonl"), "{}\n{}\n").unwrap();
        assert_eq!(summary_in(out), out.join("summary.json"));
        assert_eq!(count_rejects_under(out, 3).unwrap(), 2);

        adopt_legacy_layout(out);
        assert!(!out.join("rejects").exists());
        assert_eq!(
            std::fs::read_to_string(out.join("_rejects/part-000003.jsonl")).unwrap(),
            "{}\n{}\n"
        );
        assert_eq!(count_rejects_under(out, 3).unwrap(), 2);

        // The job's new summary replaces the old names.
        std::fs::write(out.join("_summary.json"), "{}").unwrap();
        assert_eq!(summary_in(out), out.join("_summary.json"));
        remove_legacy(out, OutputFormat::Csv);
        let mut left: Vec<_> = crate::source::fs::list_dir(out).unwrap();
        left.sort();
        assert_eq!(left, ["_rejects", "_summary.json"]);
    }

    #[test]
    fn every_name_but_the_parts_starts_with_an_underscore() {
        for format in [
            OutputFormat::Csv,
            OutputFormat::Jsonl,
            OutputFormat::Parquet,
        ] {
            let merged = merged_rel(format);
            assert!(merged.to_string_lossy().starts_with('_'), "{merged:?}");
        }
        for name in [
            REJECTS_DIR,
            OWNER_FILE,
            SUCCESS_FILE,
            SUMMARY_FILE,
            PARTIAL_DIR,
            STAGING_DIR,
            DEAD_DIR,
        ] {
            assert!(name.starts_with('_'), "{name}");
        }
        assert!(rejects_rel(1).to_string_lossy().starts_with('_'));
    }

    #[test]
    fn a_vector_parts_tally_holds_its_norms_in_every_format() {
        let dir = tempfile::tempdir().unwrap();
        let spec = OutputSpec {
            vector: Some("embedding".into()),
            ..OutputSpec::default()
        };
        for format in [
            OutputFormat::Csv,
            OutputFormat::Jsonl,
            OutputFormat::Parquet,
        ] {
            let rel = Path::new("p").with_extension(format.extension());
            let mut file = std::fs::File::create(dir.path().join(&rel)).unwrap();
            let mut w = PartWriter::new(
                &mut file,
                format,
                vec!["id".into(), "embedding".into()],
                vec![Kind::Text, Kind::Vector(2)],
            )
            .unwrap();
            w.row(&[Cell::Text("a"), Cell::Vector(&[3.0, 4.0])])
                .unwrap();
            w.row(&[Cell::Text("b"), Cell::Vector(&[0.0, 1.0])])
                .unwrap();
            // A failed row (NaN) is not counted.
            w.row(&[Cell::Text("c"), Cell::Vector(&[f32::NAN, 1.0])])
                .unwrap();
            w.finish().unwrap();
            drop(file);
            let tally = histogram_under(dir.path(), &rel, &spec).unwrap();
            assert_eq!(tally.rows, 3, "{format:?}");
            assert!(
                tally.counts.is_empty(),
                "{format:?}: no histogram per dimension"
            );
            let v = tally.vector.expect("vector stats");
            assert_eq!((v.dim, v.rows), (2, 2), "{format:?}");
            assert_eq!(
                (v.norm_sum, v.norm_min, v.norm_max),
                (6.0, 1.0, 5.0),
                "{format:?}"
            );
        }
    }
}
