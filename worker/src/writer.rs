//! Writes an item's predictions as a part file, and its rejected rows as a
//! rejects file: staged, fsynced and linked into place, so a reader sees a
//! whole file or none, and the first commit wins.

use crate::error::ItemError;
use crate::reader::{Batch, Reject};
use crate::runner::Predictions;
use batchfleet_shared::fsutil::{publish_atomically, Publish};
use std::io::Write;
use std::path::Path;

pub use batchfleet_shared::output::{count_rejects, count_rows, REJECTS_DIR};

/// Column names for `width` model outputs: `score`, or `score_0 … score_{k-1}`.
pub fn score_columns(width: usize) -> Vec<String> {
    if width == 1 {
        vec!["score".into()]
    } else {
        (0..width).map(|i| format!("score_{i}")).collect()
    }
}

/// Writes `id` plus one column per model output for every row the model did
/// not fail on, to `dest` (CSV with a header).
pub fn write_csv(
    dest: &Path,
    tag: &str,
    batch: &Batch,
    preds: &Predictions,
) -> Result<Publish, ItemError> {
    write_csv_rows(dest, tag, batch, 0..batch.rows(), preds)
}

/// Like [`write_csv`] for rows `rows` of the batch (a checkpoint segment),
/// whose predictions `preds` are.
pub fn write_csv_rows(
    dest: &Path,
    tag: &str,
    batch: &Batch,
    rows: std::ops::Range<usize>,
    preds: &Predictions,
) -> Result<Publish, ItemError> {
    if !rows.is_empty() && preds.values.len() != rows.len() * preds.width {
        return Err(ItemError::poison(format!(
            "model returned {} values for {} rows of width {}",
            preds.values.len(),
            rows.len(),
            preds.width
        )));
    }
    let result = publish_atomically(dest, tag, false, |w| {
        let mut csv = csv::WriterBuilder::new().from_writer(w);
        let mut header = vec!["id".to_owned()];
        header.extend(score_columns(preds.width.max(1)));
        csv.write_record(&header)?;
        let mut fmt = ryu::Buffer::new();
        let mut failed = preds.failed.iter().map(|(i, _)| *i).peekable();
        for (i, row) in preds.values.chunks(preds.width.max(1)).enumerate() {
            if failed.peek() == Some(&i) {
                failed.next();
                continue;
            }
            csv.write_field(batch.id(rows.start + i))?;
            for v in row {
                csv.write_field(fmt.format(*v))?;
            }
            csv.write_record(None::<&[u8]>)?;
        }
        csv.flush()?;
        Ok(())
    });
    result.map_err(|e| ItemError::transient(format!("cannot write {}: {e}", dest.display())))
}

/// Publishes `dest` as the concatenation of the CSV files `parts` (each with
/// the same header, kept once), streamed, first commit wins.
pub fn concat_csv(
    dest: &Path,
    tag: &str,
    parts: &[std::path::PathBuf],
) -> Result<Publish, ItemError> {
    let result = publish_atomically(dest, tag, false, |w| {
        batchfleet_shared::output::concat_csv(w, parts)
    });
    result.map_err(|e| ItemError::transient(format!("cannot write {}: {e}", dest.display())))
}

/// Reads back a rejects file written by [`write_rejects`]; none if absent.
pub fn read_rejects(path: &Path) -> std::io::Result<Vec<Reject>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).map_err(std::io::Error::other))
        .collect()
}

/// Writes rejected rows as JSON lines (file, line, raw, reason, stage),
/// replacing any earlier rejects file of the item; with no rejects, removes it.
/// Call before publishing the part file, which is what commits the item.
pub fn write_rejects(dest: &Path, tag: &str, rejects: &[Reject]) -> Result<(), ItemError> {
    let io_err =
        |e: std::io::Error| ItemError::transient(format!("cannot write {}: {e}", dest.display()));
    if rejects.is_empty() {
        return match std::fs::remove_file(dest) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(e)),
        };
    }
    let result = publish_atomically(dest, tag, true, |w| {
        for r in rejects {
            serde_json::to_writer(&mut *w, r)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    });
    result.map(|_| ()).map_err(io_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_header_ids_and_scores_round_trippable_skipping_failed_rows() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("part-000001.csv");
        let mut b = Batch::with_capacity(1, 3);
        b.push("a,1", &[0.0]);
        b.push("x", &[0.0]);
        b.push("b", &[0.0]);
        let p = Predictions {
            values: vec![0.1, 1e-7, f32::NAN, f32::NAN, -2.5, 3.0],
            width: 2,
            failed: vec![(1, "boom".into())],
        };
        assert_eq!(write_csv(&dest, "t", &b, &p).unwrap(), Publish::Committed);
        let text = std::fs::read_to_string(&dest).unwrap();
        assert_eq!(text, "id,score_0,score_1\n\"a,1\",0.1,1e-7\nb,-2.5,3.0\n");
        assert_eq!(count_rows(&dest).unwrap(), 2);
        assert_eq!(
            write_csv(&dest, "t2", &b, &p).unwrap(),
            Publish::AlreadyExists
        );
    }

    #[test]
    fn segments_concatenate_with_one_header_and_rejects_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.csv"), dir.path().join("b.csv"));
        std::fs::write(&a, "id,score\nr1,0.5\nr2,1\n").unwrap();
        std::fs::write(&b, "id,score\nr3,2\n").unwrap();
        let dest = dir.path().join("part-000000.csv");
        assert_eq!(concat_csv(&dest, "t", &[a, b]).unwrap(), Publish::Committed);
        assert_eq!(
            std::fs::read_to_string(&dest).unwrap(),
            "id,score\nr1,0.5\nr2,1\nr3,2\n"
        );
        assert_eq!(count_rows(&dest).unwrap(), 3);
        let r = Reject {
            file: "in.csv".into(),
            line: 3,
            raw: "r2,x".into(),
            reason: "bad".into(),
            stage: "model".into(),
        };
        let path = dir.path().join("r.jsonl");
        write_rejects(&path, "t", std::slice::from_ref(&r)).unwrap();
        assert_eq!(read_rejects(&path).unwrap(), vec![r]);
        assert!(read_rejects(&dir.path().join("none")).unwrap().is_empty());
    }

    #[test]
    fn rejects_are_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join(REJECTS_DIR).join("part-000001.jsonl");
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        let r = Reject {
            file: "in.csv".into(),
            line: 7,
            raw: "1,\"x\"".into(),
            reason: "field 2 is not a number".into(),
            stage: "parse".into(),
        };
        write_rejects(&dest, "t", &[r.clone(), r]).unwrap();
        let text = std::fs::read_to_string(&dest).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["line"], 7);
        assert_eq!(first["raw"], "1,\"x\"");
        assert_eq!(count_rejects(&dest).unwrap(), 2);
        assert_eq!(count_rejects(&dir.path().join("none")).unwrap(), 0);
        // A later attempt without rejects removes the stale file.
        write_rejects(&dest, "t2", &[]).unwrap();
        assert!(!dest.exists());
    }

    #[test]
    fn mismatched_prediction_count_is_poison() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Batch::with_capacity(1, 1);
        b.push("a", &[0.0]);
        let err = write_csv(
            &dir.path().join("p.csv"),
            "t",
            &b,
            &Predictions {
                values: vec![1.0, 2.0],
                width: 1,
                failed: vec![],
            },
        )
        .unwrap_err();
        assert!(err.message.contains("2 values for 1 rows"));
    }
}
