//! Checkpoints inside an item: an item of more than `checkpoint_rows` rows
//! is predicted in segments of that many rows, and each finished segment is
//! published (atomically, first writer wins) as
//! `_partial/part-<seq>-<model digest>/seg-<start>-<end>.<format>` with its
//! model rejects beside it. A redelivered item uses the run of finished
//! segments from row 0 and predicts only the rest. Segment boundaries are
//! fixed by the manifest, so two copies of one item write identical segments
//! and either may continue the other's work.
//!
//! Everything here is reached through the output folder's handle
//! ([`batchfleet_shared::fsutil`]): a link planted under `_partial/` is
//! refused, never followed.

use crate::batch::Reject;
use crate::error::ItemError;
use crate::writer;
use batchfleet_shared::message::OutputFormat;
use std::path::{Path, PathBuf};

pub use batchfleet_shared::output::PARTIAL_DIR;

/// The checkpoint folder of item `seq` run with the model of digest `sha256`,
/// relative to the output folder.
pub fn item_dir(seq: u32, sha256: &str) -> PathBuf {
    let short: String = sha256.chars().take(12).collect();
    Path::new(PARTIAL_DIR).join(format!("part-{seq:06}-{short}"))
}

/// Removes an item's checkpoint folder `dir` (relative to the output folder
/// `out`), and `_partial/` itself once it holds no other item's: a copy
/// that loses the race may write its segments after the job's summary
/// removed `_partial/`, and must not leave it behind.
pub fn remove(out: &Path, dir: &Path) -> std::io::Result<()> {
    batchfleet_shared::fsutil::remove_tree_under(out, dir)?;
    batchfleet_shared::fsutil::remove_empty_dir_under(out, Path::new(PARTIAL_DIR))
}

/// `seg-<start>-<end>.csv` in an item's checkpoint folder `dir` (relative).
pub fn segment_path(dir: &Path, (start, end): (usize, usize), format: OutputFormat) -> PathBuf {
    dir.join(format!("seg-{start:09}-{end:09}.{}", format.extension()))
}

/// The model rejects recorded beside a segment.
pub fn segment_rejects(segment: &Path) -> PathBuf {
    segment.with_extension("rejects.jsonl")
}

/// Finished segments (row spans) and the model rejects recorded for them.
pub type Checkpoint = (Vec<(usize, usize)>, Vec<Reject>);

/// The finished segments of an item's checkpoint folder `dir` (relative to
/// the output folder `out`) that follow each other from row 0 on the
/// expected boundaries (anything else is ignored and recomputed), with the
/// model rejects recorded for them.
pub fn finished_segments(
    out: &Path,
    dir: &Path,
    seg: usize,
    rows: usize,
    format: OutputFormat,
) -> Result<Checkpoint, ItemError> {
    let unreadable = |e: std::io::Error| {
        ItemError::output_io(
            format!("cannot read the checkpoint {}", out.join(dir).display()),
            &e,
        )
    };
    let mut found = Vec::new();
    let mut rejects = Vec::new();
    let mut start = 0;
    while start < rows {
        let span = (start, (start + seg).min(rows));
        let path = segment_path(dir, span, format);
        if !batchfleet_shared::fsutil::exists_under(out, &path).map_err(unreadable)? {
            break;
        }
        rejects.extend(writer::read_rejects(out, &segment_rejects(&path)).map_err(unreadable)?);
        found.push(span);
        start = span.1;
    }
    Ok((found, rejects))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reject(line: u64) -> Reject {
        Reject {
            file: "in.csv".into(),
            line,
            raw: "x".into(),
            reason: "model raised".into(),
            stage: "model".into(),
        }
    }

    #[test]
    fn a_checkpoint_is_the_run_of_finished_segments_from_row_0() {
        let out = tempfile::tempdir().unwrap();
        let o = out.path();
        let d = item_dir(3, &"ab".repeat(32));
        assert_eq!(
            finished_segments(o, &d, 200, 1000, OutputFormat::Csv)
                .unwrap()
                .0,
            vec![]
        );
        std::fs::create_dir_all(o.join(&d)).unwrap();
        for span in [(0, 200), (200, 400), (600, 800)] {
            std::fs::write(
                o.join(segment_path(&d, span, OutputFormat::Csv)),
                "id,score\n",
            )
            .unwrap();
        }
        writer::write_rejects(
            o,
            &segment_rejects(&segment_path(&d, (200, 400), OutputFormat::Csv)),
            &[reject(250)],
        )
        .unwrap();
        // 600..800 does not follow 400: it is not part of the checkpoint.
        let (spans, rejects) = finished_segments(o, &d, 200, 1000, OutputFormat::Csv).unwrap();
        assert_eq!(spans, vec![(0, 200), (200, 400)]);
        assert_eq!(rejects, vec![reject(250)]);
        // Boundaries of another segment size do not count.
        assert_eq!(
            finished_segments(o, &d, 300, 1000, OutputFormat::Csv)
                .unwrap()
                .0,
            vec![]
        );
    }

    #[test]
    fn a_linked_checkpoint_folder_is_refused() {
        let out = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), out.path().join(PARTIAL_DIR)).unwrap();
        let d = item_dir(1, &"cd".repeat(32));
        let e = finished_segments(out.path(), &d, 10, 100, OutputFormat::Csv).unwrap_err();
        assert_eq!(e.class, crate::error::FailureClass::Poison, "{e}");
        // A digest that is not ASCII cannot split a character.
        assert!(item_dir(1, "ééééééééé")
            .to_string_lossy()
            .contains("ééééééééé"));
    }
}
