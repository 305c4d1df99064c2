//! Writes an item's predictions as a part file, and its rejected rows as a
//! rejects file: staged, fsynced and linked into place, so a reader sees a
//! whole file or none, and the first commit wins. Every path is relative to
//! the job's output folder and reached through its handle, so a link planted
//! inside the folder is refused, never followed.

use crate::batch::{Batch, Reject};
use crate::error::ItemError;
use crate::runner::Predictions;
use batchfleet_shared::fsutil::{publish_under, publish_under_with, NameSync, Publish};
use batchfleet_shared::message::{OutputFormat, OutputSpec};
use batchfleet_shared::shadow::ShadowSpec;
use batchfleet_shared::table::{Cell, Kind, PartWriter};
use std::io::Write;
use std::path::Path;

pub use batchfleet_shared::output::{count_rejects_under, count_rows, REJECTS_DIR};

/// The columns of a part file for a model of `width` outputs: `id`, the
/// copied input columns (`include_columns`), the outputs (unless
/// `drop_scores`), `label` (`argmax`), then `top1_label, top1_score, …`;
/// with `[output] shadow = "columns"`, the same outputs again from the
/// shadow model, each named `<name>_shadow`.
/// The outputs are floats, or integers when `integer` (a model returning
/// class ids or counts); with `[output] vector`, one vector column instead.
/// `parts`: the selected outputs that make up the row (see
/// [`Predictions::parts`]), which name the columns.
pub fn part_columns(
    spec: &OutputSpec,
    width: usize,
    integer: bool,
    parts: &[(String, usize)],
) -> (Vec<String>, Vec<Kind>) {
    let output_kind = if integer { Kind::Int } else { Kind::Float };
    let label_kind = if spec.labels.is_empty() {
        Kind::Int
    } else {
        Kind::Text
    };
    let mut cols = vec![("id".to_owned(), Kind::Text)];
    cols.extend(spec.include_columns.iter().map(|c| (c.clone(), Kind::Text)));
    let mut outputs = Vec::new();
    if let Some(name) = &spec.vector {
        outputs.push((name.clone(), Kind::Vector(width as u32)));
    } else {
        if !spec.drop_scores {
            outputs.extend(
                spec.output_names(width, parts)
                    .into_iter()
                    .map(|n| (n, output_kind)),
            );
        }
        if spec.argmax {
            outputs.push(("label".into(), label_kind));
        }
        for k in 1..=(spec.top_k as usize).min(width) {
            outputs.push((format!("top{k}_label"), label_kind));
            outputs.push((format!("top{k}_score"), output_kind));
        }
    }
    if spec.shadow_columns {
        let shadow: Vec<_> = outputs
            .iter()
            .map(|(n, k)| (ShadowSpec::column_name(n), *k))
            .collect();
        outputs.extend(shadow);
    }
    cols.extend(outputs);
    cols.into_iter().unzip()
}

/// The cells of one row's outputs as [`part_columns`] names them: the
/// vector, or the scores (unless `drop_scores`), `label` and the top
/// classes. `order` is scratch space.
fn push_outputs<'a>(
    cells: &mut Vec<Cell<'a>>,
    row: &'a [f32],
    spec: &'a OutputSpec,
    integer: bool,
    order: &mut Vec<usize>,
) {
    let output = |v: f32| {
        if integer {
            Cell::Int(v as i64)
        } else {
            Cell::Float(v)
        }
    };
    if spec.vector.is_some() {
        cells.push(Cell::Vector(row));
        return;
    }
    // A class's name, or its index when there is no labels file.
    let label = |k: usize| -> Cell<'a> {
        spec.labels
            .get(k)
            .map_or(Cell::Int(k as i64), |l| Cell::Text(l))
    };
    if !spec.drop_scores {
        cells.extend(row.iter().map(|v| output(*v)));
    }
    if spec.argmax || spec.top_k > 0 {
        // Largest first; NaN last; ties keep the lower index first.
        order.clear();
        order.extend(0..row.len());
        let key = |k: usize| {
            if row[k].is_nan() {
                f32::NEG_INFINITY
            } else {
                row[k]
            }
        };
        order.sort_by(|a, b| key(*b).total_cmp(&key(*a)));
        if spec.argmax {
            cells.push(label(order[0]));
        }
        for &k in order.iter().take(spec.top_k as usize) {
            cells.push(label(k));
            cells.push(output(row[k]));
        }
    }
}

/// Writes `id` (plus copied input columns) and the predictions of every row
/// the model did not fail on, to `out/rel` in the job's output format.
pub fn write_part(
    out: &Path,
    rel: &Path,
    spec: &OutputSpec,
    batch: &Batch,
    preds: &Predictions,
) -> Result<Publish, ItemError> {
    write_part_rows(out, rel, spec, batch, 0..batch.rows(), preds, NameSync::Now)
}

/// Like [`write_part`] for rows `rows` of the batch (a checkpoint segment,
/// or the whole item), whose predictions `preds` are; its folder fsynced
/// now or by the caller (`sync`).
pub fn write_part_rows(
    out: &Path,
    rel: &Path,
    spec: &OutputSpec,
    batch: &Batch,
    rows: std::ops::Range<usize>,
    preds: &Predictions,
    sync: NameSync<'_>,
) -> Result<Publish, ItemError> {
    let width = preds.width.max(1);
    if !rows.is_empty() && preds.values.len() != rows.len() * preds.width {
        return Err(ItemError::poison(format!(
            "model returned {} values for {} rows of width {}",
            preds.values.len(),
            rows.len(),
            preds.width
        )));
    }
    for (what, names) in [
        ("[output] columns", &spec.columns),
        ("[output] labels", &spec.labels),
    ] {
        if !names.is_empty() && !rows.is_empty() && names.len() != width {
            return Err(ItemError::poison(format!(
                "the model returns {width} outputs per row but {what} names {}; make them agree",
                names.len()
            )));
        }
    }
    let (names, kinds) = part_columns(spec, width, preds.integer, &preds.parts);
    // The shadow model's values beside them (`[output] shadow = "columns"`):
    // a row it did not predict, or a shadow of another shape, is empty.
    let shadow = spec
        .shadow_columns
        .then_some(preds.shadow.as_deref())
        .flatten()
        .and_then(|s| s.result.as_ref().ok())
        .filter(|p| p.width == preds.width && p.values.len() == preds.values.len());
    let extras = spec.include_columns.len();
    let result = publish_under_with(out, rel, false, sync, |w| {
        let mut part = PartWriter::new(w, spec.format, names, kinds)?;
        let shadow_cells = (part.kinds().len() - 1 - extras) / 2;
        let mut failed = preds.failed.iter().map(|(i, _)| *i).peekable();
        let mut cells: Vec<Cell> = Vec::with_capacity(part.kinds().len());
        let mut order: Vec<usize> = Vec::with_capacity(width);
        for (i, row) in preds.values.chunks(width).enumerate() {
            if failed.peek() == Some(&i) {
                failed.next();
                continue;
            }
            let r = rows.start + i;
            cells.clear();
            cells.push(Cell::Text(batch.id(r)));
            cells.extend((0..extras).map(|j| Cell::Text(batch.extra(r, j, extras))));
            push_outputs(&mut cells, row, spec, preds.integer, &mut order);
            if spec.shadow_columns {
                match shadow
                    .map(|p| &p.values[i * width..(i + 1) * width])
                    .filter(|s| !s.iter().any(|v| v.is_nan()))
                {
                    Some(s) => push_outputs(&mut cells, s, spec, preds.integer, &mut order),
                    None => cells.extend((0..shadow_cells).map(|_| Cell::Null)),
                }
            }
            part.row(&cells)?;
        }
        part.finish()
    });
    result.map_err(|e| cannot_write(out, rel, &e))
}

fn cannot_write(out: &Path, rel: &Path, e: &std::io::Error) -> ItemError {
    ItemError::output_io(format!("cannot write {}", out.join(rel).display()), e)
}

/// Publishes `out/rel` as the concatenation of the part files `parts`
/// (relative to `out`, all in `format`, with the same columns), streamed,
/// first commit wins; its folder fsynced now or by the caller (`sync`).
pub fn concat_parts(
    out: &Path,
    rel: &Path,
    format: OutputFormat,
    parts: &[std::path::PathBuf],
    sync: NameSync<'_>,
) -> Result<Publish, ItemError> {
    let inputs = match parts
        .iter()
        .map(|p| batchfleet_shared::fsutil::open_under(out, p))
        .collect::<std::io::Result<Vec<_>>>()
    {
        Ok(inputs) => inputs,
        // Another copy of the item joined the same segments first and
        // removed them: its part file is the item's.
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                && batchfleet_shared::fsutil::exists_under(out, rel).unwrap_or(false) =>
        {
            return Ok(Publish::AlreadyExists)
        }
        Err(e) => return Err(ItemError::output_io("cannot read a checkpoint segment", &e)),
    };
    let result = publish_under_with(out, rel, false, sync, |w| {
        batchfleet_shared::table::concat_parts(w, format, &inputs)
    });
    result.map_err(|e| cannot_write(out, rel, &e))
}

/// Checks (creating it if needed) that the rejects folder of `out` can be
/// written — a real folder, not a planted link — before the part file
/// commits the item, so an item is never published without its rejects.
pub fn rejects_folder_usable(out: &Path) -> Result<(), ItemError> {
    if batchfleet_shared::source::is_url(out) {
        return Ok(());
    }
    batchfleet_shared::fsutil::Folder::open(out, true)
        .and_then(|f| f.sub(Path::new(REJECTS_DIR), true))
        .map(|_| ())
        .map_err(|e| cannot_write(out, Path::new(REJECTS_DIR), &e))
}

/// Reads back the rejects file `out/rel` written by [`write_rejects`]; none if absent.
pub fn read_rejects(out: &Path, rel: &Path) -> std::io::Result<Vec<Reject>> {
    let bytes = match batchfleet_shared::fsutil::open_under(out, rel).and_then(|i| i.read_all()) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let text = String::from_utf8(bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).map_err(std::io::Error::other))
        .collect()
}

/// Writes rejected rows as JSON lines (file, line, raw, reason, stage) to
/// `out/rel`, replacing any earlier rejects file of the item; with no
/// rejects, removes it. Only the copy whose part file won writes it.
pub fn write_rejects(out: &Path, rel: &Path, rejects: &[Reject]) -> Result<(), ItemError> {
    let io_err = |e: std::io::Error| cannot_write(out, rel, &e);
    if rejects.is_empty() {
        return match batchfleet_shared::fsutil::remove_under(out, rel) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(e)),
        };
    }
    let result = publish_under(out, rel, true, |w| {
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
        let (out, rel) = (dir.path(), Path::new("part-000001.csv"));
        let dest = out.join(rel);
        let mut b = Batch::with_capacity(1, 3);
        b.push("a,1", &[0.0]);
        b.push("x", &[0.0]);
        b.push("b", &[0.0]);
        let p = Predictions {
            values: vec![0.1, 1e-7, f32::NAN, f32::NAN, -2.5, 3.0],
            width: 2,
            failed: vec![(1, "boom".into())],
            integer: false,
            parts: Vec::new(),
            shadow: None,
            oom_fit: None,
        };
        let spec = OutputSpec::default();
        assert_eq!(
            write_part(out, rel, &spec, &b, &p).unwrap(),
            Publish::Committed
        );
        let text = std::fs::read_to_string(&dest).unwrap();
        assert_eq!(text, "id,score_0,score_1\n\"a,1\",0.1,1e-7\nb,-2.5,3.0\n");
        assert_eq!(count_rows(&dest).unwrap(), 2);
        assert_eq!(
            write_part(out, rel, &spec, &b, &p).unwrap(),
            Publish::AlreadyExists
        );
    }

    fn three_rows() -> (Batch, Predictions) {
        let mut b = Batch::with_capacity(1, 3);
        for id in ["a", "b", "c"] {
            b.push(id, &[0.0]);
        }
        let p = Predictions {
            values: vec![0.1, 0.7, 0.2, 5.0, f32::NAN, 1.0, 0.0, 0.0, 3.0],
            width: 3,
            failed: vec![],
            integer: false,
            parts: Vec::new(),
            shadow: None,
            oom_fit: None,
        };
        (b, p)
    }

    #[test]
    fn labels_argmax_and_top_k_columns() {
        let dir = tempfile::tempdir().unwrap();
        let (b, p) = three_rows();
        let spec = OutputSpec {
            labels: vec!["cat".into(), "dog".into(), "bird".into()],
            argmax: true,
            top_k: 2,
            ..OutputSpec::default()
        };
        let dest = dir.path().join("p.csv");
        write_part(dir.path(), Path::new("p.csv"), &spec, &b, &p).unwrap();
        assert_eq!(
            std::fs::read_to_string(&dest).unwrap(),
            "id,score_0,score_1,score_2,label,top1_label,top1_score,top2_label,top2_score\n\
             a,0.1,0.7,0.2,dog,dog,0.7,bird,0.2\n\
             b,5.0,NaN,1.0,cat,cat,5.0,bird,1.0\n\
             c,0.0,0.0,3.0,bird,bird,3.0,cat,0.0\n"
        );
        // Named outputs, no raw scores, class indices without a labels file.
        let spec = OutputSpec {
            columns: vec!["x".into(), "y".into(), "z".into()],
            argmax: true,
            drop_scores: true,
            ..OutputSpec::default()
        };
        let dest = dir.path().join("q.csv");
        write_part(dir.path(), Path::new("q.csv"), &spec, &b, &p).unwrap();
        assert_eq!(
            std::fs::read_to_string(&dest).unwrap(),
            "id,label\na,1\nb,0\nc,2\n"
        );
        assert_eq!(part_columns(&spec, 3, false, &[]).0, ["id", "label"]);
        // A model returning integers (class ids) writes integers.
        let ints = Predictions {
            values: vec![3.0, 0.0, 7.0],
            width: 1,
            failed: vec![],
            integer: true,
            parts: Vec::new(),
            shadow: None,
            oom_fit: None,
        };
        let dest = dir.path().join("i.csv");
        write_part(
            dir.path(),
            Path::new("i.csv"),
            &OutputSpec::default(),
            &b,
            &ints,
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(&dest).unwrap(),
            "id,score\na,3\nb,0\nc,7\n"
        );
        // A labels file that does not match the model is poison.
        let spec = OutputSpec {
            labels: vec!["cat".into()],
            argmax: true,
            ..OutputSpec::default()
        };
        let e = write_part(dir.path(), Path::new("r.csv"), &spec, &b, &p).unwrap_err();
        assert!(
            e.message
                .contains("returns 3 outputs per row but [output] labels names 1"),
            "{}",
            e.message
        );
    }

    /// A part file's column names and rows as text, numbers shown by `number`.
    fn read_back(path: &Path, number: impl Fn(f64) -> String) -> (Vec<String>, Vec<Vec<String>>) {
        let mut rows = Vec::new();
        let names = batchfleet_shared::table::read_part(path, |_, r| {
            rows.push(
                r.iter()
                    .map(|v| v.as_f64().map_or_else(|| v.text(), &number))
                    .collect(),
            )
        })
        .unwrap();
        (names, rows)
    }

    #[test]
    fn json_lines_and_parquet_parts_hold_the_same_table() {
        let dir = tempfile::tempdir().unwrap();
        let (b, p) = three_rows();
        let mut tables = Vec::new();
        for format in [
            OutputFormat::Csv,
            OutputFormat::Jsonl,
            OutputFormat::Parquet,
        ] {
            let spec = OutputSpec {
                format,
                labels: vec!["cat".into(), "dog".into(), "bird".into()],
                argmax: true,
                ..OutputSpec::default()
            };
            write_part(dir.path(), Path::new(&spec.part_name(1)), &spec, &b, &p).unwrap();
            tables.push(read_back(&dir.path().join(spec.part_name(1)), |x| {
                format!("{:.3}", x as f32)
            }));
        }
        let jsonl = std::fs::read_to_string(dir.path().join("part-000001.jsonl")).unwrap();
        assert!(jsonl.starts_with("{\"id\":\"a\",\"score_0\":0.1,\"score_1\":0.7,\"score_2\":0.2,\"label\":\"dog\"}\n"), "{jsonl}");
        assert!(jsonl.contains("\"score_1\":null"), "NaN is null: {jsonl}");
        // NaN reads back as text "NaN" from CSV and as null elsewhere: compare the rest.
        for (names, rows) in &tables[1..] {
            assert_eq!(names, &tables[0].0);
            assert_eq!(rows[0], tables[0].1[0]);
            assert_eq!(rows[2], tables[0].1[2]);
        }
    }

    #[test]
    fn shadow_columns_follow_the_outputs_and_are_empty_where_the_shadow_missed() {
        let dir = tempfile::tempdir().unwrap();
        let (b, mut p) = three_rows();
        // The shadow predicted rows 0 and 2, not row 1.
        let shadow = Predictions {
            values: vec![0.6, 0.3, 0.1, f32::NAN, f32::NAN, f32::NAN, 0.0, 1.0, 0.0],
            ..p.clone()
        };
        p.shadow = Some(Box::new(crate::runner::Shadowed {
            result: Ok(shadow),
            main: std::time::Duration::ZERO,
            shadow: std::time::Duration::ZERO,
        }));
        for format in [
            OutputFormat::Csv,
            OutputFormat::Jsonl,
            OutputFormat::Parquet,
        ] {
            let spec = OutputSpec {
                format,
                labels: vec!["cat".into(), "dog".into(), "bird".into()],
                argmax: true,
                shadow_columns: true,
                ..OutputSpec::default()
            };
            let rel = spec.part_name(1);
            write_part(dir.path(), Path::new(&rel), &spec, &b, &p).unwrap();
            let (names, rows) = read_back(&dir.path().join(&rel), |x| (x as f32).to_string());
            assert_eq!(
                names,
                [
                    "id",
                    "score_0",
                    "score_1",
                    "score_2",
                    "label",
                    "score_0_shadow",
                    "score_1_shadow",
                    "score_2_shadow",
                    "label_shadow"
                ],
                "{format:?}"
            );
            assert_eq!(
                rows[0][4..],
                ["dog", "0.6", "0.3", "0.1", "cat"],
                "{format:?}"
            );
            assert_eq!(rows[1][5..], ["", "", "", ""], "{format:?}: {rows:?}");
            assert_eq!(rows[2][8], "dog", "{format:?}");
            // The job's histogram reads the job's model's columns only.
            assert!(!spec.is_score_column("score_0_shadow") && spec.is_score_column("score_0"));
        }
    }

    #[test]
    fn segments_concatenate_with_one_header_and_rejects_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        let (a, b) = (Path::new("a.csv"), Path::new("b.csv"));
        std::fs::write(out.join(a), "id,score\nr1,0.5\nr2,1\n").unwrap();
        std::fs::write(out.join(b), "id,score\nr3,2\n").unwrap();
        let dest = out.join("part-000000.csv");
        assert_eq!(
            concat_parts(
                out,
                Path::new("part-000000.csv"),
                OutputFormat::Csv,
                &[a.into(), b.into()],
                NameSync::Now
            )
            .unwrap(),
            Publish::Committed
        );
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
        let path = Path::new("r.jsonl");
        write_rejects(out, path, std::slice::from_ref(&r)).unwrap();
        assert_eq!(read_rejects(out, path).unwrap(), vec![r]);
        assert!(read_rejects(out, Path::new("none")).unwrap().is_empty());
    }

    #[test]
    fn rejects_are_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let rel = batchfleet_shared::output::rejects_rel(1);
        let dest = dir.path().join(&rel);
        let r = Reject {
            file: "in.csv".into(),
            line: 7,
            raw: "1,\"x\"".into(),
            reason: "field 2 is not a number".into(),
            stage: "parse".into(),
        };
        write_rejects(dir.path(), &rel, &[r.clone(), r]).unwrap();
        let text = std::fs::read_to_string(&dest).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["line"], 7);
        assert_eq!(first["raw"], "1,\"x\"");
        assert_eq!(count_rejects_under(dir.path(), 1).unwrap(), 2);
        assert_eq!(count_rejects_under(dir.path(), 2).unwrap(), 0);
        // A later attempt without rejects removes the stale file.
        write_rejects(dir.path(), &rel, &[]).unwrap();
        assert!(!dest.exists());
    }

    #[test]
    fn mismatched_prediction_count_is_poison() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Batch::with_capacity(1, 1);
        b.push("a", &[0.0]);
        let err = write_part(
            dir.path(),
            Path::new("p.csv"),
            &OutputSpec::default(),
            &b,
            &Predictions {
                values: vec![1.0, 2.0],
                width: 1,
                failed: vec![],
                integer: false,
                parts: Vec::new(),
                shadow: None,
                oom_fit: None,
            },
        )
        .unwrap_err();
        assert!(err.message.contains("2 values for 1 rows"));
    }
}
