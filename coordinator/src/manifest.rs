//! The job manifest: parsing (unknown keys are errors) and complete validation
//! against the file system before anything is published.
//!
//! Relative paths in a manifest are resolved against the manifest's folder.
//! Every problem found is reported, one line each, naming the file and field
//! and saying what to do; see `docs/manifest.md`.

use batchfleet_shared::fsutil::sha256_file;
use batchfleet_shared::message::{
    CsvLayout, FailurePolicy, ModelRef, OnBadRow, OutputFormat, OutputSpec, TaskSpec,
};
use batchfleet_shared::paths::DataRoots;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};

/// Default rows per work item.
pub const DEFAULT_ITEM_ROWS: u64 = 10_000;
/// Default rows per `forward` call.
pub const DEFAULT_BATCH_SIZE: u32 = 1024;
/// Mini-batches between checkpoints inside an item when `[batching] checkpoint_every` is unset.
pub const DEFAULT_CHECKPOINT_EVERY: u32 = 4;

/// The manifest as written (after TOML parsing, before validation).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// `[job]`
    pub job: JobSection,
    /// `[input]`
    pub input: InputSection,
    /// `[model]`
    pub model: ModelSection,
    /// `[batching]`
    #[serde(default)]
    pub batching: BatchingSection,
    /// `[output]`
    pub output: OutputSection,
    /// `[preprocess]` (for `files` input)
    pub preprocess: Option<PreprocessSection>,
    /// `[failure]`
    #[serde(default)]
    pub failure: FailureSection,
    /// `[on_complete]`
    #[serde(default)]
    pub on_complete: OnCompleteSection,
}

/// `[on_complete]`: what runs when the job ends (completed, with failures, or failed).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OnCompleteSection {
    /// A command and its arguments (no shell), run in the manifest's folder
    /// with `BATCHFLEET_SUMMARY`, `BATCHFLEET_JOB_ID`, `BATCHFLEET_JOB_STATUS`
    /// and `BATCHFLEET_OUTPUT_DIR` in its environment.
    pub command: Option<Vec<String>>,
    /// How long the command may run. Default 10m.
    pub command_timeout: Option<String>,
    /// URL to POST the summary JSON to (no credentials in it).
    pub webhook: Option<String>,
    /// Instead of `webhook`: the environment variable holding the URL (for
    /// URLs that carry a token).
    pub webhook_url_env: Option<String>,
    /// Environment variable holding a bearer token sent as `Authorization`.
    pub webhook_token_env: Option<String>,
    /// Attempts before giving up on the webhook (exponential backoff). Default 5.
    pub webhook_attempts: Option<u32>,
}

/// The validated `[on_complete]` section.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OnComplete {
    /// Command and arguments.
    pub command: Option<Vec<String>>,
    /// Command time limit.
    pub command_timeout: std::time::Duration,
    /// Webhook URL (kept secret: it may carry a token).
    pub webhook: Option<batchfleet_shared::secret::SecretUrl>,
    /// Name of the environment variable with the bearer token.
    pub webhook_token_env: Option<String>,
    /// Attempts.
    pub webhook_attempts: u32,
}

/// `[failure]`: retries, bad rows, timeouts and the error budget.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FailureSection {
    /// Attempts per item for transient failures and timeouts. Default 3.
    pub max_attempts: Option<u32>,
    /// Delay before the first retry (`"1s"`); doubles per attempt. Default 1s.
    pub retry_delay: Option<String>,
    /// Cap on the retry delay. Default 5m.
    pub retry_max_delay: Option<String>,
    /// `"reject"` (default) or `"fail_item"`.
    pub on_bad_row: Option<OnBadRow>,
    /// Bisect a mini-batch on which `forward` raises. Default true.
    pub isolate_poison_rows: Option<bool>,
    /// Wall-time limit per item on a worker. Default 10m.
    pub item_timeout: Option<String>,
    /// Extra substrings of model errors that mean "retry later".
    #[serde(default)]
    pub transient_errors: Vec<String>,
    /// Job fails when more items than this fail for good.
    pub max_failed_items: Option<u64>,
    /// Job fails when more than this percent of items fail for good.
    pub max_failed_percent: Option<f64>,
}

/// Error budget of a job (Azure's `error_threshold`): exceeded → job `failed`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ErrorBudget {
    /// Most items that may fail.
    pub max_failed_items: Option<u64>,
    /// Most percent of items that may fail.
    pub max_failed_percent: Option<f64>,
}

impl ErrorBudget {
    /// Whether `failed` of `total` items exceeds the budget.
    pub fn exceeded(&self, failed: u64, total: u64) -> bool {
        let by_count = self.max_failed_items.is_some_and(|max| failed > max);
        let by_share = self
            .max_failed_percent
            .is_some_and(|pct| total > 0 && (failed as f64) * 100.0 > pct * total as f64);
        by_count || by_share
    }
}

/// `[job]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// Job name: letters, digits, `-`, `_`, `.`; at most 64 characters.
    pub name: String,
    /// Worker pool (queue) the items go to. Default `default`.
    #[serde(default = "default_pool")]
    pub pool: String,
}

fn default_pool() -> String {
    "default".into()
}

/// Input file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// CSV with a header row.
    Csv,
    /// JSON Lines: one JSON object per line; columns are its keys.
    Jsonl,
    /// Apache Parquet; items are runs of row groups, and only the id and
    /// feature columns are read.
    Parquet,
    /// One file per record (images); the id is the path relative to `root`.
    Files,
}

/// `[input]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InputSection {
    /// Input format.
    pub format: InputFormat,
    /// Glob patterns; each must match at least one file.
    #[serde(default)]
    pub paths: Vec<String>,
    /// `files` input: a text file listing input files, one per line
    /// (relative to the listing's folder), instead of or besides `paths`.
    pub listing: Option<String>,
    /// `files` input: the folder ids are relative to. Default: the manifest's folder.
    pub root: Option<String>,
    /// Header name of the id column (not for `files`).
    #[serde(default)]
    pub id_column: String,
    /// Header names of the feature columns in model input order; an entry
    /// `"f0..f31"` stands for `f0, f1, …, f31` (not for `files`).
    #[serde(default)]
    pub feature_columns: Vec<String>,
    /// Field delimiter, one ASCII character. Default `,`.
    #[serde(default = "default_delimiter")]
    pub delimiter: String,
}

fn default_delimiter() -> String {
    ",".into()
}

/// `[preprocess]`: how image files become a model input.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PreprocessSection {
    /// `[height, width]` the model takes.
    pub size: Vec<u32>,
    /// 3 (RGB) or 1 (grey). Default 3.
    pub channels: Option<u32>,
    /// Per-channel mean subtracted from the 0–1 values. Default 0.
    pub mean: Option<Vec<f32>>,
    /// Per-channel standard deviation divided by. Default 1.
    pub std: Option<Vec<f32>>,
}

/// `[model]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// TorchScript file (`torch.jit.save`).
    pub path: String,
    /// Expected SHA-256 of the file (hex); checked when given.
    pub sha256: Option<String>,
    /// `cpu`, `cuda` or `cuda:N`. Default `cpu`.
    #[serde(default = "default_device")]
    pub device: String,
}

fn default_device() -> String {
    "cpu".into()
}

/// `[batching]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BatchingSection {
    /// Rows per work item (exclusive with `item_bytes`). Default 10000.
    pub item_rows: Option<u64>,
    /// Input bytes per work item (exclusive with `item_rows`).
    pub item_bytes: Option<u64>,
    /// Rows per `forward` call. Default 1024.
    pub inference_batch_size: Option<u32>,
    /// Mini-batches between checkpoints inside an item (0 = off). Default 4.
    pub checkpoint_every: Option<u32>,
}

/// `[output]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Output directory (created if missing).
    pub dir: String,
    /// Part file format.
    #[serde(default = "default_output_format")]
    pub format: OutputFormat,
    /// Bins of the prediction histogram kept per output column.
    pub histogram: Option<HistogramSection>,
    /// After the job completes, also write every part as one file in input
    /// order (`predictions.csv`).
    #[serde(default)]
    pub merge: bool,
    /// Names of the model's output columns (default `score` / `score_0 …`).
    #[serde(default)]
    pub columns: Vec<String>,
    /// A text file of class names, one per line, one per model output.
    pub labels: Option<String>,
    /// Add a `label` column: the class of the largest output.
    #[serde(default)]
    pub argmax: bool,
    /// Add the `top_k` largest outputs' classes and scores.
    pub top_k: Option<u32>,
    /// Keep the raw output columns. Default true.
    pub scores: Option<bool>,
    /// Input columns copied next to the id in every part file.
    #[serde(default)]
    pub include_columns: Vec<String>,
}

/// `[output] histogram = { min = 0.0, max = 1.0, bins = 20 }`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HistogramSection {
    /// Lower edge of the first bin. Default 0.
    pub min: Option<f64>,
    /// Upper edge of the last bin. Default 1.
    pub max: Option<f64>,
    /// Equal-width bins between them (1–1000). Default 20.
    pub bins: Option<u32>,
}

fn default_output_format() -> OutputFormat {
    OutputFormat::Csv
}

/// How input is cut into work items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ItemSizing {
    /// About this many rows per item.
    Rows(u64),
    /// About this many input bytes per item.
    Bytes(u64),
}

/// A manifest that passed validation, with every path resolved.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// Stable job id: `<name>-<first 8 hex of the content hash>`.
    pub job_id: String,
    /// Job name.
    pub name: String,
    /// Pool.
    pub pool: String,
    /// Manifest file.
    pub manifest_path: PathBuf,
    /// Input files, sorted, deduplicated.
    pub files: Vec<PathBuf>,
    /// Header of the input files.
    pub header: Vec<String>,
    /// Work item sizing.
    pub sizing: ItemSizing,
    /// What every work item of the job carries.
    pub task: TaskSpec,
    /// When the job as a whole fails.
    pub budget: ErrorBudget,
    /// What runs when the job ends.
    pub on_complete: OnComplete,
    /// Write the merged output when the job completes.
    pub merge: bool,
    /// `files` input: the folder the files' ids are relative to.
    pub root: Option<PathBuf>,
    /// Sizes of `s3://` input objects as listed (so planning a `files` job
    /// needs no request per object).
    pub listed_sizes: std::collections::HashMap<PathBuf, u64>,
}

impl JobSpec {
    /// Output directory.
    pub fn output_dir(&self) -> &Path {
        Path::new(&self.task.output.dir)
    }
}

/// One problem found in a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `[section] key`, or a line number for syntax errors.
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

/// A manifest that failed validation: every problem found, one per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    /// The manifest file.
    pub file: PathBuf,
    /// The problems, in manifest order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}: {}: {}", self.file.display(), p.field, p.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for ManifestError {}

/// Reads, parses and validates a manifest file. Every path it names must stay
/// under one of `data_roots` (see [`batchfleet_shared::paths`]); none given:
/// under the manifest's own folder.
pub fn load(path: &Path, data_roots: &[PathBuf]) -> Result<JobSpec, ManifestError> {
    let fail = |field: &str, message: String| ManifestError {
        file: path.to_owned(),
        problems: vec![Problem {
            field: field.into(),
            message,
        }],
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        fail(
            "file",
            format!("cannot read the manifest: {e}; check the path"),
        )
    })?;
    let manifest: Manifest = toml::from_str(&text).map_err(|e| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        let field = line.map_or_else(|| "toml".to_owned(), |l| format!("line {l}"));
        let msg = e.message().trim().replace('\n', " ");
        fail(
            &field,
            format!("{msg}; see docs/manifest.md for the accepted keys"),
        )
    })?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let base = if base.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        base
    };
    let roots = if data_roots.is_empty() {
        DataRoots::new(std::slice::from_ref(&base))
    } else {
        DataRoots::new(data_roots)
    }
    .map_err(|e| fail("data roots", e.to_string()))?;
    validate(&manifest, &base, path, &roots)
}

fn resolve(base: &Path, p: &str) -> PathBuf {
    if p.starts_with(batchfleet_shared::source::S3_SCHEME) {
        return PathBuf::from(p);
    }
    let p = Path::new(p);
    let joined = if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    };
    std::path::absolute(&joined).unwrap_or(joined)
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

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Validates a parsed manifest; `base` is the folder relative paths start from.
pub fn validate(
    m: &Manifest,
    base: &Path,
    manifest_path: &Path,
    roots: &DataRoots,
) -> Result<JobSpec, ManifestError> {
    let mut problems = Vec::new();
    let mut problem = |field: &str, message: String| {
        problems.push(Problem {
            field: field.into(),
            message,
        })
    };

    if !valid_name(&m.job.name) {
        problem(
            "[job] name",
            format!(
                "\"{}\" is not a valid job name; use 1-64 letters, digits, '-', '_' or '.'",
                m.job.name
            ),
        );
    }
    if !valid_name(&m.job.pool) {
        problem(
            "[job] pool",
            format!(
                "\"{}\" is not a valid pool name; use 1-64 letters, digits, '-', '_' or '.'",
                m.job.pool
            ),
        );
    }

    // Input files.
    let mut files = Vec::new();
    let mut listed_sizes = std::collections::HashMap::new();
    for pattern in &m.input.paths {
        if pattern.starts_with(batchfleet_shared::source::S3_SCHEME) {
            // Objects: listed under the pattern's literal prefix; each must
            // lie under an s3:// data root.
            match batchfleet_shared::source::glob(pattern) {
                Err(e) => problem(
                    "[input] paths",
                    format!("cannot list \"{pattern}\": {e}; check the URL and the AWS_* settings in the environment"),
                ),
                Ok(found) if found.is_empty() => problem(
                    "[input] paths",
                    format!("\"{pattern}\" matches no object; check the bucket and key pattern"),
                ),
                Ok(found) => {
                    for (url, size) in found {
                        match roots.check(Path::new(&url)) {
                            Ok(p) => {
                                listed_sizes.insert(p.clone(), size);
                                files.push(p);
                            }
                            Err(e) => problem("[input] paths", e.to_string()),
                        }
                    }
                }
            }
            continue;
        }
        let full = resolve(base, pattern);
        match glob::glob(&full.to_string_lossy()) {
            Err(e) => problem(
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
                                Err(e) => problem("[input] paths", e.to_string()),
                            }
                        }
                        Ok(_) => {}
                        Err(e) => problem(
                            "[input] paths",
                            format!("cannot read {}: {}", e.path().display(), e.error()),
                        ),
                    }
                }
                if matched == 0 {
                    problem("[input] paths", format!("\"{pattern}\" matches no file (looked for {}); check the path, which is relative to the manifest's folder", full.display()));
                }
            }
        }
    }
    let files_input = m.input.format == InputFormat::Files;
    if let Some(listing) = &m.input.listing {
        if files_input {
            files.extend(read_listing(&resolve(base, listing), roots, &mut problem));
        } else {
            problem(
                "[input] listing",
                "applies to format = \"files\" only; list tables under paths".into(),
            );
        }
    }
    if m.input.paths.is_empty() && m.input.listing.is_none() {
        problem(
            "[input] paths",
            "is empty; list at least one file or glob such as \"data/*.csv\"".into(),
        );
    }
    files.sort();
    files.dedup();
    let root = files_input.then(|| {
        let root = m.input.root.as_deref().map_or_else(|| std::path::absolute(base).unwrap_or_else(|_| base.to_owned()), |r| resolve(base, r));
        if let Some(outside) = files.iter().find(|f| !f.starts_with(&root)) {
            problem(
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
    let preprocess = match (&m.preprocess, files_input) {
        (Some(p), true) => image_spec(p, &mut problem),
        (None, true) => {
            problem(
                "[preprocess]",
                "is required for format = \"files\": give at least size = [height, width]".into(),
            );
            None
        }
        (Some(_), false) => {
            problem("[preprocess]", "applies to format = \"files\" only".into());
            None
        }
        (None, false) => None,
    };
    if files_input && (!m.input.id_column.is_empty() || !m.input.feature_columns.is_empty()) {
        problem(
            "[input] id_column",
            "and feature_columns do not apply to format = \"files\": a record's id is its path relative to root and its input the preprocessed image".into(),
        );
    }
    if !files_input && m.input.id_column.is_empty() {
        problem(
            "[input] id_column",
            "is required: name the column holding each row's id".into(),
        );
    }

    let delimiter = match m.input.delimiter.as_bytes() {
        [b] if b.is_ascii() && *b != b'"' && *b != b'\n' && *b != b'\r' => *b,
        _ => {
            problem(
                "[input] delimiter",
                format!(
                    "\"{}\" must be one ASCII character other than a quote or newline",
                    m.input.delimiter.escape_default()
                ),
            );
            b','
        }
    };

    let features = match expand_columns(&m.input.feature_columns) {
        Ok(f) if f.is_empty() && !files_input => {
            problem(
                "[input] feature_columns",
                "is empty; list the columns the model takes, e.g. [\"f0..f31\"]".into(),
            );
            f
        }
        Ok(f) => f,
        Err(e) => {
            problem("[input] feature_columns", e);
            Vec::new()
        }
    };

    // Header: read from every file, must agree, must contain the columns.
    // JSON Lines has none: every file's first record must hold the keys,
    // which then stand as the header (id, then features).
    let mut header: Vec<String> = Vec::new();
    let jsonl = m.input.format == InputFormat::Jsonl;
    if jsonl {
        let wanted: Vec<&str> = std::iter::once(m.input.id_column.as_str())
            .chain(features.iter().map(String::as_str))
            .collect();
        let required: Vec<&str> = wanted
            .iter()
            .copied()
            .chain(m.output.include_columns.iter().map(String::as_str))
            .collect();
        let mut all_there = !files.is_empty();
        for f in &files {
            match read_jsonl_keys(f) {
                Err(e) => {
                    all_there = false;
                    problem("[input] paths", format!("{}: {e}", f.display()));
                }
                Ok(keys) => {
                    let missing: Vec<&str> = required
                        .iter()
                        .copied()
                        .filter(|k| !keys.contains(*k))
                        .collect();
                    if !missing.is_empty() {
                        all_there = false;
                        problem(
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
            header = wanted.iter().map(|k| (*k).to_owned()).collect();
        }
    }
    let parquet = m.input.format == InputFormat::Parquet;
    if parquet {
        let mut all_there = !files.is_empty();
        for f in &files {
            if let Err(e) =
                check_parquet_columns(f, &m.input.id_column, &features, &m.output.include_columns)
            {
                all_there = false;
                problem("[input] paths", format!("{}: {e}", f.display()));
            }
        }
        if all_there {
            header = std::iter::once(m.input.id_column.clone())
                .chain(features.iter().cloned())
                .collect();
        }
    }
    if files_input {
        header = vec!["path".into()];
    }
    for f in files.iter().filter(|_| !jsonl && !parquet && !files_input) {
        match read_header(f, delimiter) {
            Err(e) => problem("[input] paths", format!("{}: {e}", f.display())),
            Ok(h) if header.is_empty() => header = h,
            Ok(h) if h != header => problem(
                "[input] paths",
                format!("{} has header [{}] but {} has [{}]; all input files of a job must share one header", f.display(), h.join(", "), files[0].display(), header.join(", ")),
            ),
            Ok(_) => {}
        }
    }
    let column = |name: &str| header.iter().position(|h| h == name);
    let mut id_index = 0;
    let mut feature_indices = Vec::with_capacity(features.len());
    if !header.is_empty() && !files_input {
        let shown = summarize_header(&header);
        match column(&m.input.id_column) {
            Some(i) => id_index = i as u32,
            None => problem(
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
            .filter(|c| column(c).is_none())
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            let list = if missing.len() > 5 {
                format!("{} and {} more", missing[..5].join(", "), missing.len() - 5)
            } else {
                missing.join(", ")
            };
            problem(
                "[input] feature_columns",
                format!(
                    "not in the header of {}: {list} (columns: {shown}); fix the names",
                    files[0].display()
                ),
            );
        }
        feature_indices.extend(features.iter().filter_map(|c| column(c)).map(|i| i as u32));
    }

    // Model.
    let model_path = resolve(base, &m.model.path);
    let mut model_sha = String::new();
    let local_model = if batchfleet_shared::source::is_url(&model_path) {
        Err(batchfleet_shared::paths::PathError {
            path: model_path.clone(),
            reason:
                "is an s3:// URL; the model must be a local (or shared) file every worker can read"
                    .into(),
        })
    } else {
        roots.check(&model_path)
    };
    match local_model.map(|_| check_torchscript(&model_path)) {
        Err(e) => problem("[model] path", e.to_string()),
        Ok(Err(e)) => problem("[model] path", e),
        Ok(Ok(())) => match sha256_file(&model_path) {
            Err(e) => problem(
                "[model] path",
                format!("cannot read {}: {e}", model_path.display()),
            ),
            Ok(actual) => {
                if let Some(expected) = &m.model.sha256 {
                    if !expected.eq_ignore_ascii_case(&actual) {
                        problem("[model] sha256", format!("{} has sha256 {actual} but the manifest expects {expected}; update the manifest or restore the right model file", model_path.display()));
                    }
                }
                model_sha = actual;
            }
        },
    }
    if !valid_device(&m.model.device) {
        problem(
            "[model] device",
            format!(
                "\"{}\" is not a device; use \"cpu\", \"cuda\" or \"cuda:N\"",
                m.model.device
            ),
        );
    }

    // Batching.
    let b = &m.batching;
    let sizing = match (b.item_rows, b.item_bytes) {
        (Some(_), Some(_)) => {
            problem(
                "[batching] item_rows",
                "and item_bytes are both set; keep one".into(),
            );
            ItemSizing::Rows(DEFAULT_ITEM_ROWS)
        }
        (Some(0), _) => {
            problem("[batching] item_rows", "must be at least 1".into());
            ItemSizing::Rows(DEFAULT_ITEM_ROWS)
        }
        (_, Some(0)) => {
            problem("[batching] item_bytes", "must be at least 1".into());
            ItemSizing::Rows(DEFAULT_ITEM_ROWS)
        }
        (Some(r), None) => ItemSizing::Rows(r),
        (None, Some(bytes)) => ItemSizing::Bytes(bytes),
        (None, None) => ItemSizing::Rows(DEFAULT_ITEM_ROWS),
    };
    let batch_size = b.inference_batch_size.unwrap_or(DEFAULT_BATCH_SIZE);
    if batch_size == 0 {
        problem(
            "[batching] inference_batch_size",
            "must be at least 1".into(),
        );
    }

    let checkpoint_every = b.checkpoint_every.unwrap_or(DEFAULT_CHECKPOINT_EVERY);

    // Failure policy.
    let f = &m.failure;
    let defaults = FailurePolicy::default();
    let mut duration = |field: &str, value: &Option<String>, default_ms: u64| -> u64 {
        match value {
            None => default_ms,
            Some(text) => match humantime::parse_duration(text) {
                Ok(d) if !d.is_zero() => d.as_millis() as u64,
                Ok(_) => {
                    problem(field, "must be longer than zero".into());
                    default_ms
                }
                Err(e) => {
                    problem(field, format!("\"{text}\" is not a duration ({e}); write e.g. \"500ms\", \"30s\", \"5m\""));
                    default_ms
                }
            },
        }
    };
    let retry_base_ms = duration(
        "[failure] retry_delay",
        &f.retry_delay,
        defaults.retry_base_ms,
    );
    let retry_max_ms = duration(
        "[failure] retry_max_delay",
        &f.retry_max_delay,
        defaults.retry_max_ms,
    );
    let item_timeout_ms = duration(
        "[failure] item_timeout",
        &f.item_timeout,
        defaults.item_timeout_ms,
    );
    if retry_max_ms < retry_base_ms {
        problem(
            "[failure] retry_max_delay",
            "is shorter than retry_delay; raise it or lower retry_delay".into(),
        );
    }
    let max_attempts = f.max_attempts.unwrap_or(defaults.max_attempts);
    if max_attempts == 0 {
        problem("[failure] max_attempts", "must be at least 1".into());
    }
    if let Some(pct) = f.max_failed_percent {
        if !(0.0..=100.0).contains(&pct) {
            problem(
                "[failure] max_failed_percent",
                format!("{pct} is not a percentage between 0 and 100"),
            );
        }
    }
    if f.transient_errors.iter().any(|p| p.trim().is_empty()) {
        problem(
            "[failure] transient_errors",
            "holds an empty pattern, which would match every error; remove it".into(),
        );
    }
    let mut transient_errors = defaults.transient_errors.clone();
    transient_errors.extend(f.transient_errors.iter().cloned());
    let failure = FailurePolicy {
        max_attempts,
        retry_base_ms,
        retry_max_ms,
        on_bad_row: f.on_bad_row.unwrap_or_default(),
        isolate_poison_rows: f.isolate_poison_rows.unwrap_or(true),
        item_timeout_ms,
        transient_errors,
    };
    let budget = ErrorBudget {
        max_failed_items: f.max_failed_items,
        max_failed_percent: f.max_failed_percent,
    };

    // Output.
    let out_dir = resolve(base, &m.output.dir);
    if let Err(e) = roots.check(&out_dir) {
        problem("[output] dir", e.to_string());
    } else if out_dir.exists() && !out_dir.is_dir() {
        problem(
            "[output] dir",
            format!(
                "{} exists and is not a folder; choose another path",
                out_dir.display()
            ),
        );
    }

    let hdefault = batchfleet_shared::message::HistogramSpec::default();
    let h = m.output.histogram.clone().unwrap_or_default();
    let histogram = batchfleet_shared::message::HistogramSpec {
        min: h.min.unwrap_or(hdefault.min),
        max: h.max.unwrap_or(hdefault.max),
        bins: h.bins.unwrap_or(hdefault.bins),
    };
    if !(histogram.min.is_finite() && histogram.max.is_finite() && histogram.min < histogram.max) {
        problem(
            "[output] histogram",
            format!(
                "min ({}) must be below max ({}), both finite",
                histogram.min, histogram.max
            ),
        );
    }
    if !(1..=1000).contains(&histogram.bins) {
        problem(
            "[output] histogram",
            format!("bins must be 1 to 1000, not {}", histogram.bins),
        );
    }

    let labels = match &m.output.labels {
        None => Vec::new(),
        Some(p) => read_labels(&resolve(base, p), roots).unwrap_or_else(|e| {
            problem("[output] labels", e);
            Vec::new()
        }),
    };
    let top_k = m.output.top_k.unwrap_or(0);
    if m.output.top_k == Some(0) || top_k > 1000 {
        problem("[output] top_k", format!("{top_k} must be 1 to 1000"));
    } else if !labels.is_empty() && top_k as usize > labels.len() {
        problem(
            "[output] top_k",
            format!(
                "{top_k} is more than the {} classes in the labels file",
                labels.len()
            ),
        );
    }
    let drop_scores = m.output.scores == Some(false);
    if drop_scores && !m.output.argmax && top_k == 0 {
        problem(
            "[output] scores",
            "= false leaves no prediction column; set argmax = true or top_k as well".into(),
        );
    }
    if !m.output.columns.is_empty() && !labels.is_empty() && m.output.columns.len() != labels.len()
    {
        problem(
            "[output] columns",
            format!(
                "names {} outputs but the labels file {}; they name the same outputs",
                m.output.columns.len(),
                labels.len()
            ),
        );
    }
    let mut seen = std::collections::HashSet::new();
    // Without `columns`, the outputs are `score` / `score_<n>`: a copied
    // column may not take those names either.
    let default_score = |name: &str| {
        m.output.columns.is_empty()
            && (name == "score"
                || name
                    .strip_prefix("score_")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
    };
    for (k, name) in m
        .output
        .columns
        .iter()
        .chain(&m.output.include_columns)
        .enumerate()
    {
        let copied = k >= m.output.columns.len();
        let reserved = name == "id"
            || name == "label"
            || (copied && default_score(name))
            || (name.starts_with("top") && (name.ends_with("_label") || name.ends_with("_score")));
        if name.is_empty() || reserved || !seen.insert(name.as_str()) {
            problem(
                "[output] columns",
                format!("\"{name}\" cannot name an output column: names must be non-empty, unique across columns and include_columns, and not id, label, top<k>_label/_score or (for a copied column) the default score/score_<n>"),
            );
        }
    }
    if files_input && !m.output.include_columns.is_empty() {
        problem(
            "[output] include_columns",
            "does not apply to format = \"files\" (a file has no columns to copy)".into(),
        );
    }
    let mut include_indices = Vec::new();
    if matches!(m.input.format, InputFormat::Csv) && !header.is_empty() {
        for name in &m.output.include_columns {
            match column(name) {
                Some(i) => include_indices.push(i as u32),
                None => problem(
                    "[output] include_columns",
                    format!(
                        "\"{name}\" is not in the header of {}; fix the name",
                        files[0].display()
                    ),
                ),
            }
        }
    }

    // On completion.
    let oc = &m.on_complete;
    let command_timeout = match oc.command_timeout.as_deref().map(humantime::parse_duration) {
        None => std::time::Duration::from_secs(600),
        Some(Ok(d)) if !d.is_zero() => d,
        Some(_) => {
            problem(
                "[on_complete] command_timeout",
                "is not a positive duration; write e.g. \"30s\", \"10m\"".into(),
            );
            std::time::Duration::from_secs(600)
        }
    };
    let mut on_complete = OnComplete {
        command: oc.command.clone(),
        command_timeout,
        webhook: None,
        webhook_token_env: oc.webhook_token_env.clone(),
        webhook_attempts: oc.webhook_attempts.unwrap_or(5),
    };
    if oc
        .command
        .as_ref()
        .is_some_and(|c| c.first().is_none_or(String::is_empty))
    {
        problem(
            "[on_complete] command",
            "must name a program, e.g. [\"./load.sh\", \"--fast\"]".into(),
        );
    }
    if !(1..=20).contains(&on_complete.webhook_attempts) {
        problem("[on_complete] webhook_attempts", "must be 1 to 20".into());
    }
    match (&oc.webhook, &oc.webhook_url_env) {
        (Some(_), Some(_)) => problem(
            "[on_complete] webhook",
            "and webhook_url_env are both set; keep one".into(),
        ),
        (Some(url), None) => match webhook_url(url) {
            Ok(u) if has_credentials(u.expose()) => problem(
                "[on_complete] webhook",
                "holds credentials, which never go in a manifest: put the URL in an environment variable named by webhook_url_env, or the token in one named by webhook_token_env".into(),
            ),
            Ok(u) => on_complete.webhook = Some(u),
            Err(e) => problem("[on_complete] webhook", e),
        },
        (None, Some(var)) => match std::env::var(var) {
            Ok(url) => match webhook_url(&url) {
                Ok(u) => on_complete.webhook = Some(u),
                Err(e) => problem("[on_complete] webhook_url_env", format!("${var} {e}")),
            },
            Err(_) => problem(
                "[on_complete] webhook_url_env",
                format!("environment variable {var} is not set; export it before running the job"),
            ),
        },
        (None, None) => {}
    }
    if let Some(var) = &oc.webhook_token_env {
        if std::env::var(var).is_err() {
            problem(
                "[on_complete] webhook_token_env",
                format!("environment variable {var} is not set; export it before running the job"),
            );
        }
    }

    if !problems.is_empty() {
        return Err(ManifestError {
            file: manifest_path.to_owned(),
            problems,
        });
    }

    let task = TaskSpec {
        model: ModelRef {
            path: model_path.to_string_lossy().into_owned(),
            sha256: model_sha,
            device: m.model.device.clone(),
        },
        csv: CsvLayout {
            delimiter,
            fields: header.len() as u32,
            id_column: id_index,
            feature_columns: feature_indices,
            include_columns: include_indices,
        },
        batch_size,
        output: OutputSpec {
            dir: out_dir.to_string_lossy().into_owned(),
            format: m.output.format,
            histogram,
            columns: m.output.columns.clone(),
            labels,
            argmax: m.output.argmax,
            top_k,
            drop_scores,
            include_columns: m.output.include_columns.clone(),
        },
        failure,
        checkpoint_rows: batch_size.saturating_mul(checkpoint_every),
        jsonl: jsonl.then(|| batchfleet_shared::message::JsonLayout {
            id_key: m.input.id_column.clone(),
            feature_keys: features.clone(),
            include_keys: m.output.include_columns.clone(),
        }),
        parquet: parquet.then(|| batchfleet_shared::message::ParquetLayout {
            id_column: m.input.id_column.clone(),
            feature_columns: features.clone(),
            include_columns: m.output.include_columns.clone(),
        }),
        image: preprocess,
    };
    let job_id = job_id(
        &m.job.name,
        &m.job.pool,
        &files,
        root.as_deref(),
        &sizing,
        &task,
    );
    Ok(JobSpec {
        job_id,
        name: m.job.name.clone(),
        pool: m.job.pool.clone(),
        manifest_path: std::path::absolute(manifest_path)
            .unwrap_or_else(|_| manifest_path.to_owned()),
        files,
        header,
        sizing,
        task,
        budget,
        on_complete,
        merge: m.output.merge,
        root,
        listed_sizes,
    })
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

/// Reads a `files` listing: one path per line, relative to the listing's
/// folder (blank lines and `#` comments skipped); each must be a file under
/// the data roots.
fn read_listing(
    listing: &Path,
    roots: &DataRoots,
    problem: &mut impl FnMut(&str, String),
) -> Vec<PathBuf> {
    let field = "[input] listing";
    if let Err(e) = roots.check(listing) {
        problem(field, e.to_string());
        return Vec::new();
    }
    let text = match std::fs::read_to_string(listing) {
        Ok(t) => t,
        Err(e) => {
            problem(field, format!("cannot read {}: {e}", listing.display()));
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
        problem(field, format!("{}: {}", listing.display(), bad.join("; ")));
    } else if files.is_empty() {
        problem(field, format!("{} lists no file", listing.display()));
    }
    files
}

/// The image preprocessing of `[preprocess]`, or problems.
fn image_spec(
    p: &PreprocessSection,
    problem: &mut impl FnMut(&str, String),
) -> Option<batchfleet_shared::message::ImageSpec> {
    let mut ok = true;
    let (height, width) = match p.size.as_slice() {
        [h, w] if (1..=8192).contains(h) && (1..=8192).contains(w) => (*h, *w),
        _ => {
            problem(
                "[preprocess] size",
                format!("{:?} must be [height, width], each 1 to 8192", p.size),
            );
            ok = false;
            (1, 1)
        }
    };
    let channels = p.channels.unwrap_or(3);
    if channels != 1 && channels != 3 {
        problem(
            "[preprocess] channels",
            format!("{channels} must be 3 (RGB) or 1 (grey)"),
        );
        return None;
    }
    let per_channel =
        |field: &str, v: &Option<Vec<f32>>, default: f32, problem: &mut dyn FnMut(&str, String)| {
            match v {
                None => Some(vec![default; channels as usize]),
                Some(v) if v.len() == channels as usize && v.iter().all(|x| x.is_finite()) => {
                    Some(v.clone())
                }
                Some(v) => {
                    problem(
                        field,
                        format!("{v:?} must hold {channels} finite number(s), one per channel"),
                    );
                    None
                }
            }
        };
    let mean = per_channel("[preprocess] mean", &p.mean, 0.0, problem);
    let std = per_channel("[preprocess] std", &p.std, 1.0, problem);
    if std.as_ref().is_some_and(|s| s.iter().any(|x| *x <= 0.0)) {
        problem("[preprocess] std", "every value must be above 0".into());
        ok = false;
    }
    Some(batchfleet_shared::message::ImageSpec {
        height,
        width,
        channels,
        mean: mean?,
        std: std?,
    })
    .filter(|_| ok)
}

/// A webhook URL: http or https with a host. Kept secret (it may hold a token).
fn webhook_url(text: &str) -> Result<batchfleet_shared::secret::SecretUrl, String> {
    let scheme_ok = text.starts_with("http://") || text.starts_with("https://");
    let host = text
        .split_once("://")
        .map(|(_, rest)| rest.split(['/', '?', '#']).next().unwrap_or(""));
    if !scheme_ok || host.is_none_or(str::is_empty) {
        return Err("must be an http:// or https:// URL with a host".into());
    }
    Ok(batchfleet_shared::secret::SecretUrl::new(text))
}

/// Whether a URL carries `user:password@` or a token-like query.
fn has_credentials(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority.contains('@')
        || url.split_once('?').is_some_and(|(_, q)| {
            let q = q.to_ascii_lowercase();
            ["token", "key", "secret", "sig", "password"]
                .iter()
                .any(|k| q.contains(k))
        })
}

/// `<name>-<8 hex>`: a digest of everything that determines the job's output
/// (resolved inputs, model digest, layout, sizing, output), so the same
/// manifest maps to the same job and resumes instead of starting over.
fn job_id(
    name: &str,
    pool: &str,
    files: &[PathBuf],
    root: Option<&Path>,
    sizing: &ItemSizing,
    task: &TaskSpec,
) -> String {
    let mut canonical = serde_json::json!({ "name": name, "pool": pool, "files": files, "sizing": sizing, "task": task });
    // The ids of `files` input are relative to the root (absent otherwise,
    // so other jobs keep their ids).
    if let Some(root) = root {
        canonical["root"] = serde_json::json!(root);
    }
    let digest =
        batchfleet_shared::fsutil::sha256_bytes(sorted_keys(canonical).to_string().as_bytes());
    format!("{name}-{}", &digest[..8])
}

/// `v` with every object's keys in sorted order, so its text (and a job id
/// hashed from it) does not depend on field or insertion order.
fn sorted_keys(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sorted_keys(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(sorted_keys).collect())
        }
        other => other,
    }
}

fn summarize_header(h: &[String]) -> String {
    if h.len() <= 12 {
        h.join(", ")
    } else {
        format!("{}, … {} in all", h[..10].join(", "), h.len())
    }
}

fn valid_device(d: &str) -> bool {
    d == "cpu"
        || d == "cuda"
        || d.strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

/// A streaming reader of an input file, local or `s3://`.
fn open_input(path: &Path) -> Result<Box<dyn std::io::Read + Send>, String> {
    batchfleet_shared::source::Input::open(path)
        .and_then(|i| i.reader())
        .map_err(|e| format!("cannot open: {e}"))
}

/// Reads the header record of a CSV file.
pub fn read_header(path: &Path, delimiter: u8) -> Result<Vec<String>, String> {
    let file = open_input(path)?;
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .delimiter(delimiter)
        .flexible(true)
        .from_reader(file);
    let mut rec = csv::StringRecord::new();
    match rdr.read_record(&mut rec) {
        Ok(true) => Ok(rec.iter().map(|s| s.trim().to_owned()).collect()),
        Ok(false) => Err("is empty; a CSV input needs a header row naming its columns".into()),
        Err(e) => Err(format!("cannot read the header row: {e}")),
    }
}

/// The keys of the first record of a JSON Lines file.
pub fn read_jsonl_keys(path: &Path) -> Result<std::collections::HashSet<String>, String> {
    use std::io::BufRead;
    let file = open_input(path)?;
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("cannot read line {}: {e}", n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        return match serde_json::from_str::<serde_json::Value>(&line) {
            Ok(serde_json::Value::Object(map)) => Ok(map.keys().cloned().collect()),
            Ok(_) => Err(format!(
                "line {} is not a JSON object; JSON Lines input holds one object per line",
                n + 1
            )),
            Err(e) => Err(format!("line {} is not valid JSON: {e}", n + 1)),
        };
    }
    Err("is empty; a JSON Lines input needs at least one record".into())
}

/// Checks that a Parquet file's schema has the id column (string or
/// integer) and every feature column (numeric), naming what is missing or
/// of the wrong type.
pub fn check_parquet_columns(
    path: &Path,
    id: &str,
    features: &[String],
    include: &[String],
) -> Result<(), String> {
    use batchfleet_shared::columns::{is_feature_type, is_id_type};
    let file =
        batchfleet_shared::source::Input::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let meta = parquet::arrow::arrow_reader::ArrowReaderMetadata::load(&file, Default::default())
        .map_err(|e| format!("is not a readable Parquet file: {e}"))?;
    let schema = meta.schema();
    let mut wrong = Vec::new();
    let mut missing = Vec::new();
    for (name, is_id) in
        std::iter::once((id, true)).chain(features.iter().map(|f| (f.as_str(), false)))
    {
        match schema.field_with_name(name) {
            Err(_) => missing.push(name),
            Ok(f) if is_id && !is_id_type(f.data_type()) => wrong.push(format!(
                "id column {name} is {} (use a string or integer column)",
                f.data_type()
            )),
            Ok(f) if !is_id && !is_feature_type(f.data_type()) => wrong.push(format!(
                "feature column {name} is {} (features must be integers or floats)",
                f.data_type()
            )),
            Ok(_) => {}
        }
    }
    missing.extend(
        include
            .iter()
            .map(String::as_str)
            .filter(|n| schema.field_with_name(n).is_err()),
    );
    if !missing.is_empty() {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        let shown = if names.len() > 12 {
            format!("{}, … {} in all", names[..10].join(", "), names.len())
        } else {
            names.join(", ")
        };
        wrong.insert(
            0,
            format!(
                "has no column {} (columns: {shown}); fix the names (they are case-sensitive)",
                missing.join(", ")
            ),
        );
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("; "))
    }
}

/// Checks a model file exists and is a TorchScript archive — `code/` and
/// `constants.pkl` inside — naming what it is otherwise (a `state_dict`, a
/// pickled module, a `torch.export` package) with the one-line fix.
fn check_torchscript(path: &Path) -> Result<(), String> {
    use batchfleet_shared::model_file::{inspect_file, EXPORT_FIX};
    let kind = inspect_file(path).map_err(|e| {
        format!(
            "cannot open model {}: {e}; check the path, which is relative to the manifest's folder",
            path.display()
        )
    })?;
    if kind.is_torchscript() {
        Ok(())
    } else {
        Err(format!(
            "{} is {}; {EXPORT_FIX}",
            path.display(),
            kind.describe()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_shared::message::InputSlice;
    use std::fs;

    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            fs::create_dir(dir.path().join("data")).unwrap();
            fs::write(
                dir.path().join("data/a.csv"),
                "id,f0,f1,f2\n1,0.1,0.2,0.3\n",
            )
            .unwrap();
            fs::write(
                dir.path().join("data/b.csv"),
                "id,f0,f1,f2\n2,0.1,0.2,0.3\n",
            )
            .unwrap();
            fs::write(
                dir.path().join("model.pt"),
                batchfleet_shared::model_file::torchscript_like_zip(),
            )
            .unwrap();
            Self { dir }
        }
        fn load(&self, toml: &str) -> Result<JobSpec, ManifestError> {
            let path = self.dir.path().join("job.toml");
            fs::write(&path, toml).unwrap();
            load(&path, &[])
        }
    }

    const GOOD: &str = r#"
[job]
name = "scores"
[input]
format = "csv"
paths = ["data/*.csv"]
id_column = "id"
feature_columns = ["f0..f2"]
[model]
path = "model.pt"
[batching]
item_rows = 100
inference_batch_size = 64
[output]
dir = "out"
"#;

    #[test]
    fn good_manifest_resolves_paths_and_columns() {
        let fx = Fixture::new();
        let spec = fx.load(GOOD).unwrap();
        assert_eq!(spec.files.len(), 2);
        assert!(spec.files[0].ends_with("data/a.csv"));
        assert_eq!(spec.task.csv.feature_columns, vec![1, 2, 3]);
        assert_eq!(spec.task.csv.fields, 4);
        assert_eq!(spec.sizing, ItemSizing::Rows(100));
        assert!(spec.job_id.starts_with("scores-") && spec.job_id.len() == "scores-".len() + 8);
        assert_eq!(spec.task.model.sha256.len(), 64);
        assert!(Path::new(&spec.task.output.dir).is_absolute());
    }

    #[test]
    fn job_ids_hash_keys_in_sorted_order() {
        let v = serde_json::json!({"b": 1, "a": {"d": [{"z": 1, "y": 2}], "c": 2}});
        assert_eq!(
            sorted_keys(v).to_string(),
            r#"{"a":{"c":2,"d":[{"y":2,"z":1}]},"b":1}"#
        );
    }

    #[test]
    fn same_manifest_same_job_id_and_changes_change_it() {
        let fx = Fixture::new();
        let a = fx.load(GOOD).unwrap().job_id;
        let b = fx
            .load(&GOOD.replace("\n[job]", "# a comment\n[job]"))
            .unwrap()
            .job_id;
        let c = fx
            .load(&GOOD.replace("item_rows = 100", "item_rows = 50"))
            .unwrap()
            .job_id;
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    fn problems(r: Result<JobSpec, ManifestError>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn documented_example_manifests_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples");
        let mut seen = 0;
        for entry in fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|x| x == "toml") {
                let text = fs::read_to_string(&path).unwrap();
                toml::from_str::<Manifest>(&text)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                seen += 1;
            }
        }
        assert!(seen >= 2, "examples in {}", dir.display());
    }

    #[test]
    fn json_lines_input_needs_the_keys_in_every_file() {
        let fx = Fixture::new();
        let good = "{\"id\": \"1\", \"f0\": 0.1, \"f1\": 0.2, \"f2\": 0.3}\n";
        fs::write(fx.dir.path().join("data/a.jsonl"), format!("\n{good}")).unwrap();
        fs::write(fx.dir.path().join("data/b.jsonl"), good).unwrap();
        let manifest = GOOD
            .replace("format = \"csv\"", "format = \"jsonl\"")
            .replace("data/*.csv", "data/*.jsonl");
        let spec = fx.load(&manifest).unwrap();
        assert_eq!(spec.files.len(), 2);
        let layout = spec.task.jsonl.as_ref().expect("a JSON layout");
        assert_eq!(layout.id_key, "id");
        assert_eq!(layout.feature_keys, vec!["f0", "f1", "f2"]);
        // The same manifest as CSV is another job.
        assert_ne!(spec.job_id, fx.load(GOOD).unwrap().job_id);
        // A file whose first record lacks a key, and one that is not JSON, are each named.
        fs::write(
            fx.dir.path().join("data/b.jsonl"),
            "{\"id\": 2, \"f0\": 1}\n",
        )
        .unwrap();
        fs::write(fx.dir.path().join("data/c.jsonl"), "id,f0\n").unwrap();
        let err = problems(fx.load(&manifest));
        assert!(
            err.contains("b.jsonl has no key f1, f2")
                && err.contains("c.jsonl: line 1 is not valid JSON"),
            "{err}"
        );
    }

    #[test]
    fn parquet_input_needs_typed_columns_in_every_file() {
        use batchfleet_loadtest::fixtures::{f64_column, string_column, write_parquet};
        let fx = Fixture::new();
        let one = || f64_column([Some(0.5)]);
        let write = |name: &str, cols: Vec<(&str, arrow_array::ArrayRef)>| {
            write_parquet(&fx.dir.path().join("data").join(name), cols, 10).unwrap()
        };
        let id = || string_column([Some("1")]);
        write(
            "a.parquet",
            vec![("id", id()), ("f0", one()), ("f1", one()), ("f2", one())],
        );
        write(
            "b.parquet",
            vec![
                ("f2", one()),
                ("f1", one()),
                ("f0", one()),
                ("id", id()),
                ("x", id()),
            ],
        );
        let manifest = GOOD
            .replace("format = \"csv\"", "format = \"parquet\"")
            .replace("data/*.csv", "data/*.parquet");
        let spec = fx.load(&manifest).unwrap();
        assert_eq!(spec.files.len(), 2);
        let layout = spec.task.parquet.as_ref().expect("a Parquet layout");
        assert_eq!(
            (layout.id_column.as_str(), layout.feature_columns.len()),
            ("id", 3)
        );
        assert!(spec.task.jsonl.is_none());
        // Missing columns, a text feature and a float id are each named with the file.
        write(
            "b.parquet",
            vec![("id", one()), ("f0", id()), ("f1", one())],
        );
        fs::write(fx.dir.path().join("data/c.parquet"), "id,f0\n").unwrap();
        let err = problems(fx.load(&manifest));
        for want in [
            "b.parquet: has no column f2",
            "id column id is Float64 (use a string or integer column)",
            "feature column f0 is Utf8 (features must be integers or floats)",
            "c.parquet: is not a readable Parquet file",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
    }

    const FILES: &str = r#"
[job]
name = "pics"
[input]
format = "files"
paths = ["img/**/*.png"]
root = "img"
[preprocess]
size = [8, 6]
mean = [0.5, 0.5, 0.5]
std = [0.25, 0.25, 0.25]
[model]
path = "model.pt"
[batching]
item_rows = 2
[output]
dir = "out"
"#;

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
        let image = spec.task.image.as_ref().expect("an image spec");
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
    fn files_input_problems_are_each_named() {
        let fx = Fixture::new();
        fs::create_dir_all(fx.dir.path().join("img")).unwrap();
        fs::write(fx.dir.path().join("img/1.png"), b"png").unwrap();
        fs::write(
            fx.dir.path().join("list.txt"),
            "img/1.png\nimg/nope.png\n../escape.png\n",
        )
        .unwrap();
        let bad = FILES
            .replace(
                "paths = [\"img/**/*.png\"]",
                "paths = [\"data/*.csv\"]\nlisting = \"list.txt\"\nid_column = \"id\"",
            )
            .replace("size = [8, 6]", "size = [8]")
            .replace("mean = [0.5, 0.5, 0.5]", "mean = [0.5]")
            .replace("std = [0.25, 0.25, 0.25]", "std = [0.25, 0.25, 0.0]");
        let err = problems(fx.load(&bad));
        for want in [
            "[input] listing:",
            "line 2:",
            "nope.png is not a file",
            "line 3:",
            "contains `..`",
            "[input] root:",
            "a.csv is not under",
            "[preprocess] size: [8] must be [height, width]",
            "[preprocess] mean: [0.5] must hold 3 finite number(s)",
            "[preprocess] std: every value must be above 0",
            "[input] id_column: and feature_columns do not apply to format = \"files\"",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
        // Tables need no [preprocess], and files need one.
        let err =
            problems(fx.load(&GOOD.replace("[model]", "[preprocess]\nsize = [1, 1]\n[model]")));
        assert!(
            err.contains("[preprocess]: applies to format = \"files\" only"),
            "{err}"
        );
        let start = FILES.find("[preprocess]").unwrap();
        let end = FILES.find("[model]").unwrap();
        let err = problems(fx.load(&(FILES[..start].to_owned() + &FILES[end..])));
        assert!(
            err.contains("[preprocess]: is required for format = \"files\""),
            "{err}"
        );
    }

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
        assert_eq!(spec.task.csv.include_columns, vec![3]);
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
    fn s3_output_needs_an_s3_data_root_and_an_s3_model_is_refused() {
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
            err.contains("[model] path: s3://bucket/m.pt: is an s3:// URL"),
            "{err}"
        );
    }

    #[test]
    fn paths_must_stay_under_the_data_roots() {
        let fx = Fixture::new();
        let elsewhere = tempfile::tempdir().unwrap();
        let far = elsewhere.path().join("far.csv");
        fs::write(&far, "id,f0,f1,f2\n3,0.1,0.2,0.3\n").unwrap();
        fs::write(
            elsewhere.path().join("m.pt"),
            batchfleet_shared::model_file::torchscript_like_zip(),
        )
        .unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), fx.dir.path().join("link")).unwrap();
        // By default the manifest's folder is the root: an absolute path
        // elsewhere, a symlink out of it and `..` are each refused.
        let bad = GOOD
            .replace(
                "\"data/*.csv\"",
                &format!("\"data/*.csv\", \"{}\"", far.display()),
            )
            .replace("path = \"model.pt\"", "path = \"link/m.pt\"")
            .replace("dir = \"out\"", "dir = \"data/../../out\"");
        let err = problems(fx.load(&bad));
        assert!(
            err.contains("[input] paths:")
                && err.contains("far.csv: is outside the data roots")
                && err.contains("[model] path:")
                && err.contains("link/m.pt: is outside the data roots")
                && err.contains("(it resolves to")
                && err.contains("[output] dir:")
                && err.contains("contains `..`"),
            "{err}"
        );
        // Naming both folders as roots lets the same files in (not `..`).
        let path = fx.dir.path().join("job.toml");
        let roots = [fx.dir.path().to_owned(), elsewhere.path().to_owned()];
        let ok = bad.replace("dir = \"data/../../out\"", "dir = \"out\"");
        fs::write(&path, &ok).unwrap();
        let spec = load(&path, &roots).unwrap();
        assert_eq!(spec.files.len(), 3);
        // A root that does not exist is an error of its own.
        let err = load(&path, &[fx.dir.path().join("nope")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data roots:") && err.contains("cannot use it as a data root"),
            "{err}"
        );
    }

    #[test]
    fn unknown_key_is_an_error_with_line() {
        let fx = Fixture::new();
        let err = problems(fx.load(&GOOD.replace("item_rows = 100", "item_row = 100")));
        assert!(
            err.contains("job.toml: line 12: unknown field `item_row`"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1);
    }

    #[test]
    fn empty_glob_missing_columns_and_model_each_reported() {
        let fx = Fixture::new();
        let bad = GOOD
            .replace("\"data/*.csv\"", "\"data/*.csv\", \"nope/*.csv\"")
            .replace("\"f0..f2\"", "\"f0..f3\"")
            .replace("id_column = \"id\"", "id_column = \"key\"")
            .replace("model.pt", "missing.pt");
        let err = problems(fx.load(&bad));
        assert!(
            err.contains("[input] paths: \"nope/*.csv\" matches no file"),
            "{err}"
        );
        assert!(
            err.contains("[input] id_column: \"key\" is not in the header"),
            "{err}"
        );
        assert!(
            err.contains("[input] feature_columns: not in the header of") && err.contains("f3"),
            "{err}"
        );
        assert!(
            err.contains("[model] path: cannot open model") && err.contains("missing.pt"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 4, "{err}");
    }

    #[test]
    fn sha_mismatch_and_not_torchscript() {
        let fx = Fixture::new();
        let err = problems(fx.load(&GOOD.replace(
            "path = \"model.pt\"",
            "path = \"model.pt\"\nsha256 = \"00\"",
        )));
        assert!(
            err.contains("[model] sha256:") && err.contains("expects 00"),
            "{err}"
        );
        fs::write(fx.dir.path().join("model.pt"), b"not a zip").unwrap();
        let err = problems(fx.load(GOOD));
        assert!(err.contains("is not a TorchScript file"), "{err}");
        // The files PyTorch users mistake for TorchScript are each named, with the fix.
        use batchfleet_shared::model_file::stored_zip;
        for (bytes, named) in [
            (
                stored_zip(&[
                    ("m/data.pkl", b"\x80\x02ccollections\nOrderedDict\n"),
                    ("m/data/0", b"w"),
                ]),
                "is a state_dict",
            ),
            (
                stored_zip(&[
                    ("m/data.pkl", b"\x80\x02c__main__\nNet\n_modules"),
                    ("m/data/0", b"w"),
                ]),
                "is a pickled Python module",
            ),
            (
                stored_zip(&[("m/archive_format", b"pt2"), ("m/models/model.json", b"{}")]),
                "is a torch.export package",
            ),
        ] {
            fs::write(fx.dir.path().join("model.pt"), bytes).unwrap();
            let err = problems(fx.load(GOOD));
            assert!(
                err.contains(named) && err.contains("torch.jit.save"),
                "{err}"
            );
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
    fn batching_and_device_rules() {
        let fx = Fixture::new();
        let err = problems(
            fx.load(
                &GOOD
                    .replace("item_rows = 100", "item_rows = 100\nitem_bytes = 5")
                    .replace("inference_batch_size = 64", "inference_batch_size = 0")
                    .replace(
                        "path = \"model.pt\"",
                        "path = \"model.pt\"\ndevice = \"tpu\"",
                    ),
            ),
        );
        assert!(
            err.contains("item_rows: and item_bytes are both set"),
            "{err}"
        );
        assert!(
            err.contains("inference_batch_size: must be at least 1"),
            "{err}"
        );
        assert!(err.contains("[model] device: \"tpu\""), "{err}");
    }

    #[test]
    fn histogram_and_on_complete_rules_keep_secrets_out() {
        let fx = Fixture::new();
        let err = problems(fx.load(&format!(
            "{GOOD}\n[on_complete]\ncommand = []\nwebhook = \"https://u:pw@hooks.example.com/x\"\nwebhook_token_env = \"BF_SURELY_UNSET_VAR\"\n"
        )));
        assert!(
            err.contains("[on_complete] command: must name a program"),
            "{err}"
        );
        assert!(
            err.contains("[on_complete] webhook: holds credentials"),
            "{err}"
        );
        // (`pw@`, not `pw`: the temporary folder's random name may hold "pw".)
        assert!(!err.contains("pw@"), "the password is not echoed: {err}");
        assert!(err.contains("BF_SURELY_UNSET_VAR is not set"), "{err}");
        let err = problems(fx.load(&format!(
            "{GOOD}\n[on_complete]\nwebhook = \"https://hooks.example.com/x?token=abc\"\n"
        )));
        assert!(
            err.contains("holds credentials") && !err.contains("abc"),
            "{err}"
        );
        let err = problems(fx.load(&GOOD.replace(
            "[output]",
            "[output]\nhistogram = { min = 1.0, max = 0.0, bins = 0 }",
        )));
        assert!(err.contains("min (1) must be below max (0)"), "{err}");
        assert!(err.contains("bins must be 1 to 1000, not 0"), "{err}");
        let spec = fx
            .load(&format!(
                "{}\n[on_complete]\nwebhook = \"http://127.0.0.1:9/hook\"\n",
                GOOD.replace(
                    "[output]",
                    "[output]\nhistogram = { min = -3.0, max = 3.0, bins = 12 }"
                )
            ))
            .unwrap();
        assert_eq!(spec.task.output.histogram.bins, 12);
        assert_eq!(spec.on_complete.webhook_attempts, 5);
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
