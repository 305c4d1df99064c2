//! `[input]`: which files a job reads and how their records are laid out.
//!
//! [`files`] resolves the paths — local globs, `s3://` listings, a `files`
//! listing — checks each against the data roots, and checks the `files`
//! root; [`layout`] checks the format-specific settings (id and feature
//! columns with their `f0..f31` ranges, the delimiter) against what the
//! files hold (see [`super::probes`]) and finds the columns' positions.

use super::probes::{check_parquet_columns, probe_all, read_header, read_jsonl_keys, sample};
use super::schema::{InputFormat, Manifest, MissingSetting};
use super::{resolve, Problems};
use batchfleet_shared::message::{JsonLayout, Missing, ParquetLayout};
use batchfleet_shared::paths::DataRoots;
use batchfleet_shared::source::{Fingerprint, Input};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The input files of a job, resolved and checked against the data roots.
#[derive(Debug)]
pub(super) struct Files {
    /// Input files, sorted, deduplicated.
    pub(super) files: Vec<PathBuf>,
    /// What each file is (size, modification time or ETag), in `files`' order.
    pub(super) fingerprints: Vec<Fingerprint>,
    /// `files` input: the folder the files' ids are relative to.
    pub(super) root: Option<PathBuf>,
}

/// How the records of the input files are laid out.
#[derive(Debug)]
pub(super) struct Layout {
    /// Field delimiter (CSV).
    pub(super) delimiter: u8,
    /// The header the files share (JSON Lines and Parquet: id, then
    /// features; `files`: `path`); empty when it could not be read.
    pub(super) header: Vec<String>,
    /// Position of the id column in the header.
    pub(super) id_index: u32,
    /// Positions of the feature columns in the header, in model input order.
    pub(super) feature_indices: Vec<u32>,
    /// JSON Lines input: the keys to read.
    pub(super) jsonl: Option<JsonLayout>,
    /// Parquet input: the columns to read.
    pub(super) parquet: Option<ParquetLayout>,
    /// What a missing feature becomes (`[input] missing`).
    pub(super) missing: Missing,
    /// `[input] text_column`, when the job has one.
    pub(super) text: Option<String>,
    /// Position of the text column in the header (CSV: its field index).
    pub(super) text_index: u32,
}

impl Layout {
    /// Position of the column `name` in the header.
    pub(super) fn column(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }
}

/// Resolves `[input] paths` and `listing` into files, each under the data
/// roots, and checks the `files` root holds them all.
pub(super) fn files(
    m: &Manifest,
    base: &Path,
    roots: &DataRoots,
    problems: &mut Problems,
) -> Files {
    let mut files = Vec::new();
    let mut listed = HashMap::new();
    for pattern in &m.input.paths {
        if pattern.starts_with(batchfleet_shared::source::S3_SCHEME) {
            list_objects(pattern, roots, &mut files, &mut listed, problems);
        } else {
            glob_files(pattern, base, roots, &mut files, problems);
        }
    }
    let files_input = m.input.format == InputFormat::Files;
    if let Some(listing) = &m.input.listing {
        if files_input {
            files.extend(read_listing(&resolve(base, listing), roots, problems));
        } else {
            problems.add(
                "[input] listing",
                "applies to format = \"files\" only; list tables under paths".into(),
            );
        }
    }
    if m.input.paths.is_empty() && m.input.listing.is_none() {
        problems.add(
            "[input] paths",
            "is empty; list at least one file or glob such as \"data/*.csv\"".into(),
        );
    }
    files.sort();
    files.dedup();
    let root = files_input.then(|| {
        let root = m.input.root.as_deref().map_or_else(|| std::path::absolute(base).unwrap_or_else(|_| base.to_owned()), |r| resolve(base, r));
        if let Some(outside) = files.iter().find(|f| !f.starts_with(&root)) {
            problems.add(
                "[input] root",
                format!(
                    "{} is not under {}; ids are paths relative to root, so set root to a folder holding every input file",
                    outside.display(),
                    root.display()
                ),
            );
        }
        root
    });
    let fingerprints = fingerprints(&files, &listed, problems);
    Files {
        files,
        fingerprints,
        root,
    }
}

/// Each file's fingerprint: an `s3://` object's from its listing, a local
/// file's from `stat` (a HEAD for an object named without a listing). The
/// job id covers them, so a file changed in place makes a new job.
fn fingerprints(
    files: &[PathBuf],
    listed: &HashMap<PathBuf, Fingerprint>,
    problems: &mut Problems,
) -> Vec<Fingerprint> {
    let mut unreadable = Vec::new();
    let found = files
        .iter()
        .map(|f| match listed.get(f) {
            Some(fp) => fp.clone(),
            None => match Input::open(f).and_then(|i| i.fingerprint()) {
                Ok(fp) => fp,
                Err(e) => {
                    unreadable.push(format!("{}: {e}", f.display()));
                    Fingerprint {
                        size: 0,
                        mtime_ns: None,
                        etag: None,
                    }
                }
            },
        })
        .collect();
    if !unreadable.is_empty() {
        let more = unreadable.len().saturating_sub(5);
        unreadable.truncate(5);
        if more > 0 {
            unreadable.push(format!("and {more} more"));
        }
        problems.add(
            "[input] paths",
            format!(
                "cannot read the size and modification time of {}; check the files exist and are readable",
                unreadable.join("; ")
            ),
        );
    }
    found
}

/// An `s3://` pattern: the objects listed under its literal prefix; each
/// must lie under an `s3://` data root.
fn list_objects(
    pattern: &str,
    roots: &DataRoots,
    files: &mut Vec<PathBuf>,
    listed: &mut HashMap<PathBuf, Fingerprint>,
    problems: &mut Problems,
) {
    match batchfleet_shared::source::glob_fingerprints(pattern) {
        Err(e) => problems.add(
            "[input] paths",
            format!("cannot list \"{pattern}\": {e}; check the URL and the AWS_* settings in the environment"),
        ),
        Ok(found) if found.is_empty() => problems.add(
            "[input] paths",
            format!("\"{pattern}\" matches no object; check the bucket and key pattern"),
        ),
        Ok(found) => {
            for (url, fingerprint) in found {
                match roots.check(Path::new(&url)) {
                    Ok(p) => {
                        listed.insert(p.clone(), fingerprint);
                        files.push(p);
                    }
                    Err(e) => problems.add("[input] paths", e.to_string()),
                }
            }
        }
    }
}

/// A local glob, relative to `base`: the files it matches, each under the
/// data roots; at least one.
fn glob_files(
    pattern: &str,
    base: &Path,
    roots: &DataRoots,
    files: &mut Vec<PathBuf>,
    problems: &mut Problems,
) {
    let full = resolve(base, pattern);
    match glob::glob(&full.to_string_lossy()) {
        Err(e) => problems.add(
            "[input] paths",
            format!("\"{pattern}\" is not a valid glob: {e}"),
        ),
        Ok(entries) => {
            let mut matched = 0;
            for entry in entries {
                match entry {
                    Ok(p) if p.is_file() => {
                        matched += 1;
                        match roots.check(&p) {
                            Ok(_) => files.push(p),
                            Err(e) => problems.add("[input] paths", e.to_string()),
                        }
                    }
                    Ok(_) => {}
                    Err(e) => problems.add(
                        "[input] paths",
                        format!("cannot read {}: {}", e.path().display(), e.error()),
                    ),
                }
            }
            if matched == 0 {
                problems.add("[input] paths", format!("\"{pattern}\" matches no file (looked for {}); check the path, which is relative to the manifest's folder", full.display()));
            }
        }
    }
}

/// Reads a `files` listing: one path per line, relative to the listing's
/// folder (blank lines and `#` comments skipped); each must be a file under
/// the data roots.
fn read_listing(listing: &Path, roots: &DataRoots, problems: &mut Problems) -> Vec<PathBuf> {
    let field = "[input] listing";
    if let Err(e) = roots.check(listing) {
        problems.add(field, e.to_string());
        return Vec::new();
    }
    let text = match std::fs::read_to_string(listing) {
        Ok(t) => t,
        Err(e) => {
            problems.add(field, format!("cannot read {}: {e}", listing.display()));
            return Vec::new();
        }
    };
    let folder = listing.parent().unwrap_or(Path::new("."));
    let mut files = Vec::new();
    let mut bad = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let path = resolve(folder, line);
        match roots.check(&path) {
            Ok(_) if path.is_file() => files.push(path),
            Ok(_) => bad.push(format!("line {}: {} is not a file", n + 1, path.display())),
            Err(e) => bad.push(format!("line {}: {e}", n + 1)),
        }
    }
    if bad.len() > 5 {
        let more = bad.len() - 5;
        bad.truncate(5);
        bad.push(format!("and {more} more"));
    }
    if !bad.is_empty() {
        problems.add(field, format!("{}: {}", listing.display(), bad.join("; ")));
    } else if files.is_empty() {
        problems.add(field, format!("{} lists no file", listing.display()));
    }
    files
}

/// Checks the id and feature columns and the delimiter, reads the header of
/// every file in `files` (which must agree and hold the columns) and finds
/// the columns in it.
pub(super) fn layout(m: &Manifest, files: &[PathBuf], problems: &mut Problems) -> Layout {
    let files_input = m.input.format == InputFormat::Files;
    if files_input && (!m.input.id_column.is_empty() || !m.input.feature_columns.is_empty()) {
        problems.add(
            "[input] id_column",
            "and feature_columns do not apply to format = \"files\": a record's id is its path relative to root and its input the preprocessed image".into(),
        );
    }
    if !files_input && m.input.id_column.is_empty() {
        problems.add(
            "[input] id_column",
            "is required: name the column holding each row's id".into(),
        );
    }

    let delimiter = match m.input.delimiter.as_bytes() {
        [b] if b.is_ascii() && *b != b'"' && *b != b'\n' && *b != b'\r' => *b,
        _ => {
            problems.add(
                "[input] delimiter",
                format!(
                    "\"{}\" must be one ASCII character other than a quote or newline",
                    m.input.delimiter.escape_default()
                ),
            );
            b','
        }
    };

    let text = text_column(m, problems);
    let features = match expand_columns(&m.input.feature_columns) {
        Ok(f) if f.is_empty() && !files_input && text.is_none() => {
            problems.add(
                "[input] feature_columns",
                "is empty; list the columns the model takes, e.g. [\"f0..f31\"]".into(),
            );
            f
        }
        Ok(f) => f,
        Err(e) => {
            problems.add("[input] feature_columns", e);
            Vec::new()
        }
    };

    // Header: read from every file, must agree, must contain the columns.
    let header = match m.input.format {
        InputFormat::Jsonl => jsonl_header(m, files, &features, text.as_deref(), problems),
        InputFormat::Parquet => parquet_header(m, files, &features, text.as_deref(), problems),
        InputFormat::Files => vec!["path".into()],
        InputFormat::Csv => csv_header(files, delimiter, problems),
    };
    let missing = missing(m, problems);
    let mut layout = Layout {
        delimiter,
        header,
        id_index: 0,
        feature_indices: Vec::with_capacity(features.len()),
        jsonl: (m.input.format == InputFormat::Jsonl).then(|| JsonLayout {
            id_key: m.input.id_column.clone(),
            feature_keys: features.clone(),
            include_keys: m.output.include_columns.clone(),
            missing,
        }),
        parquet: (m.input.format == InputFormat::Parquet).then(|| ParquetLayout {
            id_column: m.input.id_column.clone(),
            feature_columns: features.clone(),
            include_columns: m.output.include_columns.clone(),
            missing,
        }),
        missing,
        text,
        text_index: 0,
    };
    if !layout.header.is_empty() && !files_input {
        find_columns(m, files, &features, &mut layout, problems);
    }
    layout
}

/// `[input] text_column`: a named column of table input, which then takes
/// the place of `feature_columns` (the model takes the tokenizer's ids).
fn text_column(m: &Manifest, problems: &mut Problems) -> Option<String> {
    let name = m.input.text_column.as_ref()?;
    if name.is_empty() {
        problems.add(
            "[input] text_column",
            "is empty; name the column holding each row's text".into(),
        );
        return None;
    }
    if m.input.format == InputFormat::Files {
        problems.add(
            "[input] text_column",
            "applies to table input (csv, jsonl, parquet), not to format = \"files\"".into(),
        );
        return None;
    }
    if m.model.tokenizer.is_none() {
        problems.add(
            "[input] text_column",
            "needs [model] tokenizer: name the tokenizer.json that turns the text into the model's input ids".into(),
        );
    }
    Some(name.clone())
}

/// JSON Lines has no header: every file's first record (of remote files,
/// those of the [`sample`]) must hold the keys (the output's copied columns
/// too), which then stand as the header (id, then features). A record of
/// another file without them is rejected by the worker, naming the key.
fn jsonl_header(
    m: &Manifest,
    files: &[PathBuf],
    features: &[String],
    text: Option<&str>,
    problems: &mut Problems,
) -> Vec<String> {
    let wanted: Vec<&str> = std::iter::once(m.input.id_column.as_str())
        .chain(features.iter().map(String::as_str))
        .chain(text)
        .collect();
    let required: Vec<&str> = wanted
        .iter()
        .copied()
        .chain(m.output.include_columns.iter().map(String::as_str))
        .collect();
    let mut all_there = !files.is_empty();
    let files = sample(files);
    let keys_of = probe_all(&files, read_jsonl_keys);
    for (f, read) in files.iter().zip(keys_of) {
        match read {
            Err(e) => {
                all_there = false;
                problems.add("[input] paths", format!("{}: {e}", f.display()));
            }
            Ok(keys) => {
                let missing: Vec<&str> = required
                    .iter()
                    .copied()
                    .filter(|k| !keys.contains(*k))
                    .collect();
                if !missing.is_empty() {
                    all_there = false;
                    problems.add(
                        "[input] feature_columns",
                        format!(
                            "the first record of {} has no key {}; fix the names (JSON keys are case-sensitive)",
                            f.display(),
                            missing.join(", ")
                        ),
                    );
                }
            }
        }
    }
    if all_there {
        wanted.iter().map(|k| (*k).to_owned()).collect()
    } else {
        Vec::new()
    }
}

/// Every Parquet file's schema must hold the columns, typed right; they
/// then stand as the header (id, then features).
fn parquet_header(
    m: &Manifest,
    files: &[PathBuf],
    features: &[String],
    text: Option<&str>,
    problems: &mut Problems,
) -> Vec<String> {
    let mut all_there = !files.is_empty();
    // The text column is checked for presence like a copied column; a value
    // that is not a string rejects its row.
    let copied: Vec<String> = m
        .output
        .include_columns
        .iter()
        .cloned()
        .chain(text.map(str::to_owned))
        .collect();
    let checks = probe_all(files, |f| {
        check_parquet_columns(f, &m.input.id_column, features, &copied)
    });
    for (f, check) in files.iter().zip(checks) {
        if let Err(e) = check {
            all_there = false;
            problems.add("[input] paths", format!("{}: {e}", f.display()));
        }
    }
    if all_there {
        std::iter::once(m.input.id_column.clone())
            .chain(features.iter().cloned())
            .chain(text.map(str::to_owned))
            .collect()
    } else {
        Vec::new()
    }
}

/// `[input] missing`: `"reject"` (the default), `"nan"` or a finite number.
fn missing(m: &Manifest, problems: &mut Problems) -> Missing {
    let Some(setting) = &m.input.missing else {
        return Missing::Reject;
    };
    if m.input.format == InputFormat::Files {
        problems.add(
            "[input] missing",
            "applies to table input (csv, jsonl, parquet); remove it for format = \"files\"".into(),
        );
        return Missing::Reject;
    }
    match setting {
        MissingSetting::Word(w) if w == "reject" => Missing::Reject,
        MissingSetting::Word(w) if w == "nan" => Missing::Nan,
        MissingSetting::Number(v) if v.is_nan() => Missing::Nan,
        MissingSetting::Number(v) if v.is_finite() && v.abs() <= f64::from(f32::MAX) => {
            Missing::Value(*v as f32)
        }
        MissingSetting::Number(v) => {
            problems.add(
                "[input] missing",
                format!("{v} is not a finite float32; give a number such as 0.0, or \"nan\""),
            );
            Missing::Reject
        }
        MissingSetting::Word(w) => {
            problems.add(
                "[input] missing",
                format!("\"{w}\" is not a policy; use \"reject\" (the row is bad), \"nan\" or a number such as 0.0"),
            );
            Missing::Reject
        }
    }
}

/// The header row of the first CSV file; every other file must have the same
/// (of remote files, those of the [`sample`]; workers check the rest).
fn csv_header(files: &[PathBuf], delimiter: u8, problems: &mut Problems) -> Vec<String> {
    let mut header: Vec<String> = Vec::new();
    let files = sample(files);
    let headers = probe_all(&files, |f| read_header(f, delimiter));
    for (f, read) in files.iter().zip(headers) {
        match read {
            Err(e) => problems.add("[input] paths", format!("{}: {e}", f.display())),
            Ok(h) if header.is_empty() => header = h,
            Ok(h) if h != header => problems.add(
                "[input] paths",
                format!("{} has header [{}] but {} has [{}]; all input files of a job must share one header", f.display(), h.join(", "), files[0].display(), header.join(", ")),
            ),
            Ok(_) => {}
        }
    }
    header
}

/// Finds the id and feature columns in the header, naming those missing.
fn find_columns(
    m: &Manifest,
    files: &[PathBuf],
    features: &[String],
    layout: &mut Layout,
    problems: &mut Problems,
) {
    let shown = summarize_header(&layout.header);
    match layout.column(&m.input.id_column) {
        Some(i) => layout.id_index = i as u32,
        None => problems.add(
            "[input] id_column",
            format!(
                "\"{}\" is not in the header of {} (columns: {shown}); fix the name",
                m.input.id_column,
                files[0].display()
            ),
        ),
    }
    let missing: Vec<&str> = features
        .iter()
        .filter(|c| layout.column(c).is_none())
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        let list = if missing.len() > 5 {
            format!("{} and {} more", missing[..5].join(", "), missing.len() - 5)
        } else {
            missing.join(", ")
        };
        problems.add(
            "[input] feature_columns",
            format!(
                "not in the header of {}: {list} (columns: {shown}); fix the names",
                files[0].display()
            ),
        );
    }
    let indices: Vec<u32> = features
        .iter()
        .filter_map(|c| layout.column(c))
        .map(|i| i as u32)
        .collect();
    layout.feature_indices.extend(indices);
    if let Some(text) = layout.text.clone() {
        match layout.column(&text) {
            Some(i) => layout.text_index = i as u32,
            None => problems.add(
                "[input] text_column",
                format!(
                    "\"{text}\" is not in the header of {} (columns: {shown}); fix the name",
                    files[0].display()
                ),
            ),
        }
    }
}

fn summarize_header(h: &[String]) -> String {
    if h.len() <= 12 {
        h.join(", ")
    } else {
        format!("{}, … {} in all", h[..10].join(", "), h.len())
    }
}

/// Expands `"f0..f31"` into `f0, …, f31`; other entries pass through.
pub fn expand_columns(entries: &[String]) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for entry in entries {
        let Some((a, b)) = entry.split_once("..") else {
            out.push(entry.clone());
            continue;
        };
        let split = |s: &str| {
            let digits = s.len() - s.trim_end_matches(|c: char| c.is_ascii_digit()).len();
            let (prefix, num) = s.split_at(s.len() - digits);
            (prefix.to_owned(), num.to_owned())
        };
        let ((pa, na), (pb, nb)) = (split(a), split(b));
        let bad = || {
            format!(
                "range \"{entry}\" must look like \"f0..f31\": same prefix, numbers at both ends"
            )
        };
        if pa != pb || na.is_empty() || nb.is_empty() {
            return Err(bad());
        }
        let (lo, hi): (u64, u64) = (
            na.parse().map_err(|_| bad())?,
            nb.parse().map_err(|_| bad())?,
        );
        if lo > hi {
            return Err(format!(
                "range \"{entry}\" runs backwards; write the smaller number first"
            ));
        }
        if hi - lo > 100_000 {
            return Err(format!("range \"{entry}\" names more than 100000 columns"));
        }
        let width = if na.len() > 1 && na.starts_with('0') {
            na.len()
        } else {
            0
        };
        out.extend((lo..=hi).map(|i| format!("{pa}{i:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::testing::{problems, Fixture, FILES, GOOD};
    use batchfleet_shared::message::InputSlice;
    use std::fs;

    #[test]
    fn files_input_lists_files_relative_to_root_with_preprocessing() {
        let fx = Fixture::new();
        let img = fx.dir.path().join("img");
        fs::create_dir_all(img.join("a")).unwrap();
        for f in ["a/1.png", "a/2.png", "3.png"] {
            fs::write(img.join(f), b"png").unwrap();
        }
        let spec = fx.load(FILES).unwrap();
        assert_eq!(spec.files.len(), 3);
        assert_eq!(spec.root.as_deref(), Some(img.as_path()));
        let image = spec.task.layout.image().expect("an image spec");
        assert_eq!((image.height, image.width, image.channels), (8, 6, 3));
        // A listing instead of globs: relative to its folder, comments skipped.
        fs::write(
            fx.dir.path().join("list.txt"),
            "# two files\nimg/a/1.png\n\nimg/3.png\n",
        )
        .unwrap();
        let listed = FILES.replace("paths = [\"img/**/*.png\"]", "listing = \"list.txt\"");
        let spec = fx.load(&listed).unwrap();
        assert_eq!(spec.files, vec![img.join("3.png"), img.join("a/1.png")]);
        // Planned: ids relative to root, two files per item.
        let plan = crate::planner::plan(&spec).unwrap();
        assert_eq!((plan.items.len(), plan.rows_total), (1, 2));
        match &plan.items[0].input {
            InputSlice::Files { files, sizes, .. } => {
                assert_eq!(
                    (files.clone(), sizes.clone()),
                    (vec!["3.png".to_owned(), "a/1.png".to_owned()], vec![3, 3])
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn mismatched_headers_and_empty_file() {
        let fx = Fixture::new();
        fs::write(fx.dir.path().join("data/b.csv"), "id,f0,f2,f1\n").unwrap();
        assert!(problems(fx.load(GOOD)).contains("all input files of a job must share one header"));
        fs::write(fx.dir.path().join("data/b.csv"), "").unwrap();
        assert!(problems(fx.load(GOOD)).contains("b.csv: is empty; a CSV input needs a header row"));
    }

    #[test]
    fn missing_policies_parse_reach_the_layout_and_change_the_job_id() {
        let fx = Fixture::new();
        let with = |setting: &str| {
            GOOD.replace(
                "feature_columns = [\"f0..f2\"]",
                &format!("feature_columns = [\"f0..f2\"]\nmissing = {setting}"),
            )
        };
        let csv_missing = |toml: &str| {
            let spec = fx.load(toml).unwrap();
            (spec.task.layout.csv().unwrap().missing, spec.job_id)
        };
        let (default, id) = csv_missing(GOOD);
        assert_eq!(default, Missing::Reject);
        assert_eq!(
            csv_missing(&with("\"reject\"")),
            (Missing::Reject, id.clone())
        );
        let (nan, nan_id) = csv_missing(&with("\"nan\""));
        assert_eq!(nan, Missing::Nan);
        assert_ne!(nan_id, id);
        assert_eq!(csv_missing(&with("0")).0, Missing::Value(0.0));
        let (value, value_id) = csv_missing(&with("-1.5"));
        assert_eq!(value, Missing::Value(-1.5));
        assert_ne!(value_id, nan_id);
        for (bad, says) in [
            ("\"zero\"", "\"zero\" is not a policy; use \"reject\""),
            ("inf", "inf is not a finite float32"),
            ("1e39", "is not a finite float32"),
        ] {
            let p = problems(fx.load(&with(bad)));
            assert!(
                p.contains("[input] missing") && p.contains(says),
                "{bad}: {p}"
            );
        }
    }

    #[test]
    fn pandas_unnamed_index_column_is_named_as_pandas_names_it() {
        let fx = Fixture::new();
        for f in ["a", "b"] {
            fs::write(
                fx.dir.path().join(format!("data/{f}.csv")),
                ",id,f0,f1,f2\n0,x,0.1,,0.30000000000000004\n",
            )
            .unwrap();
        }
        let spec = fx
            .load(&GOOD.replace("id_column = \"id\"", "id_column = \"Unnamed: 0\""))
            .unwrap();
        let layout = spec.task.layout.csv().unwrap();
        assert_eq!((layout.fields, layout.id_column), (5, 0));
        assert_eq!(layout.feature_columns, vec![2, 3, 4]);
    }

    #[test]
    fn column_ranges_expand() {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            expand_columns(&s(&["f0..f2", "x"])).unwrap(),
            s(&["f0", "f1", "f2", "x"])
        );
        assert_eq!(
            expand_columns(&s(&["c08..c10"])).unwrap(),
            s(&["c08", "c09", "c10"])
        );
        assert!(expand_columns(&s(&["f3..f1"]))
            .unwrap_err()
            .contains("backwards"));
        assert!(expand_columns(&s(&["f0..g3"])).is_err());
    }
}
