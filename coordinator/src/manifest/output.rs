//! `[output]`: where and how predictions are written — the output folder
//! (under the data roots), the part format, the histogram bins, the labels
//! file with `argmax` / `top_k` / `scores`, the output column names, and the
//! input columns copied next to the id. (`merge` needs no check.)

use super::input::Layout;
use super::schema::{HistogramSection, InputFormat, Manifest, OutputSection};
use super::{resolve, Problems};
use batchfleet_shared::message::{HistogramSpec, OutputSpec};
use batchfleet_shared::paths::DataRoots;
use std::path::{Path, PathBuf};

/// The validated `[output]` section.
#[derive(Debug)]
pub(super) struct Output {
    /// What every item carries.
    pub(super) spec: OutputSpec,
    /// CSV input: positions of the copied columns in the header.
    pub(super) include_indices: Vec<u32>,
}

/// Checks `[output]`; `files` and `layout` are the input's, for the columns
/// to copy.
pub(super) fn check(
    m: &Manifest,
    base: &Path,
    roots: &DataRoots,
    files: &[PathBuf],
    layout: &Layout,
    problems: &mut Problems,
) -> Output {
    let out = &m.output;
    let out_dir = resolve(base, &out.dir);
    if let Err(e) = roots.check(&out_dir) {
        problems.add("[output] dir", e.to_string());
    } else if out_dir.exists() && !out_dir.is_dir() {
        problems.add(
            "[output] dir",
            format!(
                "{} exists and is not a folder; choose another path",
                out_dir.display()
            ),
        );
    }

    let histogram = histogram(out.histogram.clone().unwrap_or_default(), problems);

    let labels = match &out.labels {
        None => Vec::new(),
        Some(p) => read_labels(&resolve(base, p), roots).unwrap_or_else(|e| {
            problems.add("[output] labels", e);
            Vec::new()
        }),
    };
    let top_k = out.top_k.unwrap_or(0);
    if out.top_k == Some(0) || top_k > 1000 {
        problems.add("[output] top_k", format!("{top_k} must be 1 to 1000"));
    } else if !labels.is_empty() && top_k as usize > labels.len() {
        problems.add(
            "[output] top_k",
            format!(
                "{top_k} is more than the {} classes in the labels file",
                labels.len()
            ),
        );
    }
    let drop_scores = out.scores == Some(false);
    if drop_scores && !out.argmax && top_k == 0 {
        problems.add(
            "[output] scores",
            "= false leaves no prediction column; set argmax = true or top_k as well".into(),
        );
    }
    if !out.columns.is_empty() && !labels.is_empty() && out.columns.len() != labels.len() {
        problems.add(
            "[output] columns",
            format!(
                "names {} outputs but the labels file {}; they name the same outputs",
                out.columns.len(),
                labels.len()
            ),
        );
    }
    check_column_names(out, problems);
    let include_indices = copied_columns(m, files, layout, problems);

    Output {
        spec: OutputSpec {
            dir: out_dir.to_string_lossy().into_owned(),
            format: out.format,
            histogram,
            columns: out.columns.clone(),
            labels,
            argmax: out.argmax,
            top_k,
            drop_scores,
            include_columns: out.include_columns.clone(),
            vector: out.vector.clone(),
            shadow_columns: out.shadow == Some(super::schema::ShadowOutput::Columns),
        },
        include_indices,
    }
}

/// The histogram bins, defaults filled in: finite, `min < max`, 1–1000 bins.
fn histogram(h: HistogramSection, problems: &mut Problems) -> HistogramSpec {
    let hdefault = HistogramSpec::default();
    let histogram = HistogramSpec {
        min: h.min.unwrap_or(hdefault.min),
        max: h.max.unwrap_or(hdefault.max),
        bins: h.bins.unwrap_or(hdefault.bins),
    };
    if !(histogram.min.is_finite() && histogram.max.is_finite() && histogram.min < histogram.max) {
        problems.add(
            "[output] histogram",
            format!(
                "min ({}) must be below max ({}), both finite",
                histogram.min, histogram.max
            ),
        );
    }
    if !(1..=1000).contains(&histogram.bins) {
        problems.add(
            "[output] histogram",
            format!("bins must be 1 to 1000, not {}", histogram.bins),
        );
    }
    histogram
}

/// Output column names and copied columns: non-empty, unique, and none of
/// the names the worker writes itself.
fn check_column_names(out: &OutputSection, problems: &mut Problems) {
    let mut seen = std::collections::HashSet::new();
    // Without `columns`, the outputs are `score` / `score_<n>`: a copied
    // column may not take those names either.
    let default_score = |name: &str| {
        out.columns.is_empty()
            && (name == "score"
                || name
                    .strip_prefix("score_")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
    };
    for (k, name) in out.columns.iter().chain(&out.include_columns).enumerate() {
        let copied = k >= out.columns.len();
        let reserved = name == "id"
            || name == "label"
            || (copied && default_score(name))
            || (name.starts_with("top") && (name.ends_with("_label") || name.ends_with("_score")));
        if name.is_empty() || reserved || !seen.insert(name.as_str()) {
            problems.add(
                "[output] columns",
                format!("\"{name}\" cannot name an output column: names must be non-empty, unique across columns and include_columns, and not id, label, top<k>_label/_score or (for a copied column) the default score/score_<n>"),
            );
        }
    }
}

/// `include_columns`: none for `files` input; for CSV input, their positions
/// in the header (JSON Lines and Parquet input name them to the worker, and
/// [`super::input`] checked them already).
fn copied_columns(
    m: &Manifest,
    files: &[PathBuf],
    layout: &Layout,
    problems: &mut Problems,
) -> Vec<u32> {
    if m.input.format == InputFormat::Files && !m.output.include_columns.is_empty() {
        problems.add(
            "[output] include_columns",
            "does not apply to format = \"files\" (a file has no columns to copy)".into(),
        );
    }
    let mut include_indices = Vec::new();
    if matches!(m.input.format, InputFormat::Csv) && !layout.header.is_empty() {
        for name in &m.output.include_columns {
            match layout.column(name) {
                Some(i) => include_indices.push(i as u32),
                None => problems.add(
                    "[output] include_columns",
                    format!(
                        "\"{name}\" is not in the header of {}; fix the name",
                        files[0].display()
                    ),
                ),
            }
        }
    }
    include_indices
}

/// Reads a labels file: one class name per line (surrounding blanks
/// trimmed, trailing empty lines ignored), at least one.
fn read_labels(path: &Path, roots: &DataRoots) -> Result<Vec<String>, String> {
    roots.check(path).map_err(|e| e.to_string())?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut labels: Vec<String> = text.lines().map(|l| l.trim().to_owned()).collect();
    while labels.last().is_some_and(String::is_empty) {
        labels.pop();
    }
    if labels.is_empty() {
        return Err(format!(
            "{} holds no class name; write one per line",
            path.display()
        ));
    }
    if let Some(n) = labels.iter().position(String::is_empty) {
        return Err(format!(
            "{} line {} is empty; every output needs a name",
            path.display(),
            n + 1
        ));
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use crate::manifest::load;
    use crate::manifest::testing::{problems, Fixture, GOOD};
    use std::fs;
    use std::path::PathBuf;

    #[test]
    fn output_labels_top_k_and_copied_columns() {
        let fx = Fixture::new();
        fs::write(fx.dir.path().join("labels.txt"), "cat\n dog \nbird\n\n").unwrap();
        let with = |extra: &str| GOOD.replace("dir = \"out\"", &format!("dir = \"out\"\n{extra}"));
        let spec = fx
            .load(&with("format = \"parquet\"\nlabels = \"labels.txt\"\nargmax = true\ntop_k = 2\nscores = false\ninclude_columns = [\"f2\", \"id\"]"))
            .map(|_| ())
            .unwrap_err();
        // "id" cannot be copied under its own name; the rest is fine.
        assert!(
            spec.to_string()
                .contains("\"id\" cannot name an output column"),
            "{spec}"
        );
        let err = problems(fx.load(&with("include_columns = [\"score_1\"]")));
        assert!(
            err.contains("\"score_1\" cannot name an output column"),
            "{err}"
        );
        let spec = fx
            .load(&with("format = \"parquet\"\nlabels = \"labels.txt\"\nargmax = true\ntop_k = 2\nscores = false\ninclude_columns = [\"f2\"]"))
            .unwrap();
        let o = &spec.task.output;
        assert_eq!(o.labels, ["cat", "dog", "bird"]);
        assert_eq!(
            (o.argmax, o.top_k, o.drop_scores, o.format.as_str()),
            (true, 2, true, "parquet")
        );
        assert_eq!(
            spec.task
                .layout
                .csv()
                .expect("a CSV layout")
                .include_columns,
            vec![3]
        );
        assert_eq!(o.include_columns, ["f2"]);
        // Each bad option is named.
        let err = problems(fx.load(&with(
            "labels = \"labels.txt\"\ntop_k = 4\ncolumns = [\"a\", \"b\"]\ninclude_columns = [\"nope\", \"a\"]",
        )));
        for want in [
            "[output] top_k: 4 is more than the 3 classes",
            "[output] columns: names 2 outputs but the labels file 3",
            "\"a\" cannot name an output column",
            "[output] include_columns: \"nope\" is not in the header",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
        let err = problems(fx.load(&with("scores = false")));
        assert!(
            err.contains("[output] scores: = false leaves no prediction column"),
            "{err}"
        );
        fs::write(fx.dir.path().join("empty.txt"), "\n").unwrap();
        let err = problems(fx.load(&with("labels = \"empty.txt\"\nargmax = true")));
        assert!(err.contains("holds no class name"), "{err}");
    }

    #[test]
    fn s3_output_and_an_s3_model_need_an_s3_data_root() {
        let fx = Fixture::new();
        let manifest = GOOD.replace("dir = \"out\"", "dir = \"s3://bucket/jobs/out\"");
        // The default root is the manifest's folder: S3 is outside it.
        let err = problems(fx.load(&manifest));
        assert!(
            err.contains("[output] dir: s3://bucket/jobs/out: is outside the data roots"),
            "{err}"
        );
        let path = fx.dir.path().join("job.toml");
        fs::write(&path, &manifest).unwrap();
        let roots = [fx.dir.path().to_owned(), PathBuf::from("s3://bucket/jobs")];
        let spec = load(&path, &roots).unwrap();
        assert_eq!(spec.task.output.dir, "s3://bucket/jobs/out");
        let err =
            problems(fx.load(&GOOD.replace("path = \"model.pt\"", "path = \"s3://bucket/m.pt\"")));
        assert!(
            err.contains("[model] path: s3://bucket/m.pt: is outside the data roots"),
            "{err}"
        );
    }
}
