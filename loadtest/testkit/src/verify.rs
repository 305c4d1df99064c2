//! Compares committed part files with golden predictions.
//!
//! Checks INV-ROWS for a job without rejects: every golden id appears exactly
//! once across all `part-*` files, no other id appears, and every score is
//! within `tolerance` (absolute, or relative for magnitudes above 1).

use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::path::Path;

/// What the comparison found.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Verification {
    /// Rows in the golden file.
    pub golden_rows: usize,
    /// Rows across part files.
    pub output_rows: usize,
    /// Part files read.
    pub parts: usize,
    /// Golden ids with no output row.
    pub missing: Vec<String>,
    /// Ids that appear more than once in the outputs.
    pub duplicated: Vec<String>,
    /// Output ids not in the golden file.
    pub unexpected: Vec<String>,
    /// (id, column, got, want) beyond tolerance.
    pub mismatched: Vec<(String, String, f64, f64)>,
    /// Largest absolute difference seen.
    pub max_abs_diff: f64,
}

impl Verification {
    /// True when every row is present once and matches.
    pub fn ok(&self) -> bool {
        self.missing.is_empty()
            && self.duplicated.is_empty()
            && self.unexpected.is_empty()
            && self.mismatched.is_empty()
    }

    /// One paragraph for people.
    pub fn describe(&self) -> String {
        let sample = |v: &[String]| v.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        format!(
            "{} golden rows, {} output rows in {} parts; missing {} [{}], duplicated {} [{}], unexpected {} [{}], mismatched {} {:?}; max |diff| {:.3e}",
            self.golden_rows, self.output_rows, self.parts,
            self.missing.len(), sample(&self.missing),
            self.duplicated.len(), sample(&self.duplicated),
            self.unexpected.len(), sample(&self.unexpected),
            self.mismatched.len(), self.mismatched.iter().take(3).collect::<Vec<_>>(),
            self.max_abs_diff
        )
    }
}

type Rows = (Vec<String>, Vec<(String, Vec<f64>)>);

/// The id and the numbers of the columns `wanted` (all but the id when
/// `None`) of every row of a part file of any format (or the golden CSV).
fn read_scores(path: &Path, wanted: Option<&[String]>) -> Result<Rows> {
    let mut rows = Vec::new();
    let mut picked: Option<Result<(Vec<String>, Vec<usize>)>> = None;
    let mut bad = None;
    let mut flat_names: Vec<String> = Vec::new();
    let mut flat: Vec<batchfleet_shared::table::Value> = Vec::new();
    let names = batchfleet_shared::table::read_part(path, |names, row| {
        // A vector column stands for its elements, `<name>_0 …` (as in CSV).
        let (names, row) = if row
            .iter()
            .any(|v| matches!(v, batchfleet_shared::table::Value::Vector(_)))
        {
            flat.clear();
            let fresh = flat_names.is_empty();
            for (n, v) in names.iter().zip(row) {
                match v {
                    batchfleet_shared::table::Value::Vector(xs) => {
                        for (i, x) in xs.iter().enumerate() {
                            if fresh {
                                flat_names.push(format!("{n}_{i}"));
                            }
                            flat.push(batchfleet_shared::table::Value::Number(*x));
                        }
                    }
                    other => {
                        if fresh {
                            flat_names.push(n.clone());
                        }
                        flat.push(other.clone());
                    }
                }
            }
            (flat_names.as_slice(), flat.as_slice())
        } else {
            (names, row)
        };
        let pick = picked.get_or_insert_with(|| pick_columns(path, names, wanted));
        let Ok((_, cols)) = pick else { return };
        let scores: Vec<f64> = cols
            .iter()
            .map(|c| row[*c].as_f64().unwrap_or(f64::NAN))
            .collect();
        if bad.is_none() && cols.iter().any(|c| matches!(row[*c], batchfleet_shared::table::Value::Text(ref t) if t.parse::<f64>().is_err())) {
            bad = Some(format!("{}: a score of row {} is not a number", path.display(), rows.len() + 1));
        }
        rows.push((row[0].text(), scores));
    })
    .with_context(|| format!("reading {}", path.display()))?;
    if let Some(b) = bad {
        bail!(b);
    }
    let (columns, _) = match picked {
        Some(p) => p?,
        None => pick_columns(path, &names, wanted)?,
    };
    Ok((columns, rows))
}

fn pick_columns(
    path: &Path,
    names: &[String],
    wanted: Option<&[String]>,
) -> Result<(Vec<String>, Vec<usize>)> {
    if names.first().map(String::as_str) != Some("id") {
        bail!(
            "{}: first column must be id, columns are {names:?}",
            path.display()
        );
    }
    match wanted {
        None => Ok((names[1..].to_vec(), (1..names.len()).collect())),
        Some(w) => {
            let cols = w
                .iter()
                .map(|n| {
                    names.iter().position(|h| h == n).with_context(|| {
                        format!("{} has no column {n} (columns: {names:?})", path.display())
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((w.to_vec(), cols))
        }
    }
}

/// Compares every `part-*` file (CSV, JSON Lines or Parquet) in
/// `output_dir` with `golden`, column by golden column name (other columns,
/// such as labels or copied input columns, are not compared).
pub fn verify(output_dir: &Path, golden: &Path, tolerance: f64) -> Result<Verification> {
    let (columns, golden_rows) = read_scores(golden, None)?;
    let mut want: HashMap<String, Vec<f64>> = HashMap::with_capacity(golden_rows.len());
    let mut v = Verification {
        golden_rows: golden_rows.len(),
        ..Verification::default()
    };
    for (id, s) in golden_rows {
        want.insert(id, s);
    }
    let mut seen: HashMap<String, u32> = HashMap::with_capacity(want.len());
    // A local folder or an s3:// prefix.
    let mut parts: Vec<_> = batchfleet_shared::source::fs::list_dir(output_dir)
        .with_context(|| format!("reading {}", output_dir.display()))?
        .into_iter()
        .filter(|n| n.starts_with("part-"))
        .map(|n| output_dir.join(n))
        .collect();
    parts.sort();
    for part in &parts {
        let (_, rows) = read_scores(part, Some(&columns))?;
        v.parts += 1;
        for (id, got) in rows {
            v.output_rows += 1;
            let n = seen.entry(id.clone()).or_insert(0);
            *n += 1;
            if *n == 2 {
                v.duplicated.push(id.clone());
            }
            let Some(expected) = want.get(&id) else {
                v.unexpected.push(id);
                continue;
            };
            for ((g, w), col) in got.iter().zip(expected).zip(&columns) {
                let diff = (g - w).abs();
                v.max_abs_diff = v.max_abs_diff.max(diff);
                if diff > tolerance * w.abs().max(1.0) || diff.is_nan() {
                    v.mismatched.push((id.clone(), col.clone(), *g, *w));
                }
            }
        }
    }
    v.missing = want
        .keys()
        .filter(|id| !seen.contains_key(*id))
        .cloned()
        .collect();
    v.missing.sort();
    Ok(v)
}

/// Every row's values after its id, by id: of one file in a part file's
/// format (`id` first), or of every `part-*` file of a folder; a vector
/// value counts as its elements.
pub fn rows_by_id(path: &Path) -> Result<HashMap<String, Vec<f64>>> {
    let files = if path.is_dir() {
        let mut parts: Vec<_> = batchfleet_shared::source::fs::list_dir(path)?
            .into_iter()
            .filter(|n| n.starts_with("part-"))
            .map(|n| path.join(n))
            .collect();
        parts.sort();
        parts
    } else {
        vec![path.to_owned()]
    };
    let mut rows = HashMap::new();
    for file in &files {
        batchfleet_shared::table::read_part(file, |_, row| {
            let mut values = Vec::with_capacity(row.len());
            for v in &row[1..] {
                match v {
                    batchfleet_shared::table::Value::Vector(xs) => values.extend(xs),
                    other => values.push(other.as_f64().unwrap_or(f64::NAN)),
                }
            }
            rows.insert(row[0].text(), values);
        })
        .with_context(|| format!("reading {}", file.display()))?;
    }
    Ok(rows)
}

/// How far the rows of `b` are from those of `a` (see [`rows_by_id`]),
/// which must hold the same ids: the largest absolute difference and the
/// least cosine similarity over rows.
pub fn agreement(a: &Path, b: &Path) -> Result<(f64, f64)> {
    let (a, b) = (rows_by_id(a)?, rows_by_id(b)?);
    if a.len() != b.len() {
        bail!("{} rows against {}", b.len(), a.len());
    }
    let norm = |v: &[f64]| v.iter().map(|p| p * p).sum::<f64>().sqrt();
    let (mut diff, mut cosine) = (0f64, 1f64);
    for (id, x) in &a {
        let y = b.get(id).with_context(|| format!("row {id} missing"))?;
        let dot: f64 = x.iter().zip(y).map(|(p, q)| p * q).sum();
        cosine = cosine.min(dot / (norm(x) * norm(y)).max(1e-12));
        diff = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(diff, f64::max);
    }
    Ok((diff, cosine))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(parts: &[&str]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let golden = dir.path().join("golden.csv");
        std::fs::write(&golden, "id,score\na,1.0\nb,2.0\nc,3.0\n").unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        for (i, p) in parts.iter().enumerate() {
            std::fs::write(
                out.join(format!("part-{i:06}.csv")),
                format!("id,score\n{p}"),
            )
            .unwrap();
        }
        (dir, golden)
    }

    #[test]
    fn passes_only_when_every_row_is_present_once_and_close() {
        let (d, g) = setup(&["a,1.000001\nb,2.0\n", "c,3.0\n"]);
        let v = verify(&d.path().join("out"), &g, 1e-5).unwrap();
        assert!(v.ok(), "{}", v.describe());

        let (d, g) = setup(&["a,1.0\nb,2.0\n", "b,2.0\nz,0\n"]);
        let v = verify(&d.path().join("out"), &g, 1e-5).unwrap();
        assert_eq!(
            (
                v.missing.clone(),
                v.duplicated.clone(),
                v.unexpected.clone()
            ),
            (
                vec!["c".to_string()],
                vec!["b".to_string()],
                vec!["z".to_string()]
            )
        );
        assert!(!v.ok());

        let (d, g) = setup(&["a,1.1\nb,2.0\nc,3.0\n"]);
        let v = verify(&d.path().join("out"), &g, 1e-5).unwrap();
        assert_eq!(v.mismatched.len(), 1);
    }
}
