//! The manifest as written: the TOML types a manifest file is parsed into,
//! one per section. Every struct denies unknown keys, so a misspelt key is an
//! error with its line rather than a silently ignored setting. Nothing here
//! checks values; the other submodules of [`super`] do. The same types give
//! the manifest's JSON Schema ([`json_schema`], `batchfleet schema`), so the
//! schema editors check `job.toml` against cannot drift from the parser.

use batchfleet_shared::message::{OnBadRow, OutputFormat};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The manifest as written (after TOML parsing, before validation).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
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

/// `[failure]`: retries, bad rows, timeouts and the error budget.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
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
    /// Job fails when more rows than this are rejected (bad rows, rows the
    /// model raised on).
    pub max_rejected_rows: Option<u64>,
    /// Job fails when more than this percent of its rows are rejected.
    pub max_rejected_percent: Option<f64>,
    /// Workers that may die holding one item (a crash: killed, out of
    /// memory, a fault inside libtorch) before it is dead-lettered as
    /// `crash`. Default 2; 0 never gives an item up for crashes.
    pub max_crashes: Option<u32>,
}

/// `[job]`
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// Job name: letters, digits, `-`, `_`, `.`; at most 64 characters.
    pub name: String,
    /// Worker pool (queue) the items go to. Default `default`.
    #[serde(default = "default_pool")]
    pub pool: String,
    /// The job's share of its pool's workers while other jobs run beside it.
    #[serde(default)]
    pub priority: Priority,
    /// When the job should be done: a duration from the job's first run
    /// (`"2h"`, `"90m"`, `"1h 30m"`) or an RFC 3339 time
    /// (`"2026-12-08T06:00:00Z"`). The coordinator then keeps
    /// `batchfleet_pool_workers_needed{pool}`, the workers the pool needs to
    /// finish it on time, and warns as soon as the job will finish late at
    /// the fleet's current size.
    pub deadline: Option<String>,
    /// What one worker costs per hour, in any currency (`1.20`): `status`
    /// shows the job's cost so far and to go, and `_summary.json` its cost
    /// per million rows.
    pub worker_hour_cost: Option<f64>,
}

fn default_pool() -> String {
    "default".into()
}

/// `[job] priority`: how the workers of a pool share their time among
/// the jobs that have items queued — in proportion to these weights.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Weight 4.
    High,
    /// Weight 2.
    #[default]
    Normal,
    /// Weight 1.
    Low,
}

impl Priority {
    /// The job's weight in the pool's fair share.
    pub fn weight(self) -> u32 {
        match self {
            Priority::High => 4,
            Priority::Normal => 2,
            Priority::Low => 1,
        }
    }

    /// The priority a job record names (`""` or an unknown name: normal).
    pub fn of_record(name: &str) -> Self {
        match name {
            "high" => Priority::High,
            "low" => Priority::Low,
            _ => Priority::Normal,
        }
    }

    /// Its name in the manifest.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

/// Input file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
    /// What a missing feature becomes: `"reject"` (default), `"nan"` or a number.
    pub missing: Option<MissingSetting>,
    /// CSV: quoted fields may hold line breaks, so files are cut by reading
    /// them rather than at byte offsets. Default false.
    #[serde(default)]
    pub quoted_newlines: bool,
    /// Name of a string column tokenized by `[model] tokenizer` into the
    /// model's `input_ids` and `attention_mask` (instead of `feature_columns`).
    pub text_column: Option<String>,
}

/// `[input] missing`, as written: a word or a number.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum MissingSetting {
    /// `"reject"` or `"nan"`.
    Word(String),
    /// An imputation constant.
    Number(f64),
}

fn default_delimiter() -> String {
    ",".into()
}

/// `[preprocess]`: how image files become a model input.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// TorchScript file (`torch.jit.save`).
    pub path: String,
    /// Expected SHA-256 of the file (hex); checked when given.
    pub sha256: Option<String>,
    /// `cpu`, `cuda` or `cuda:N`. Default `cpu`.
    #[serde(default = "default_device")]
    pub device: String,
    /// A Hugging Face `tokenizer.json` for `[input] text_column`.
    pub tokenizer: Option<String>,
    /// Tokens per row at most, special tokens included (longer rows are
    /// truncated). Default: the tokenizer file's truncation, else 512.
    pub max_length: Option<u32>,
    /// Round each mini-batch's padded length up to a multiple of this.
    pub pad_to_multiple_of: Option<u32>,
    /// `forward`'s arguments in order, each a source (`"input_ids"`) or a
    /// table `{ name, source, dtype }`. Default: `forward(features)`, or
    /// `forward(input_ids, attention_mask)` with a tokenizer.
    #[serde(default)]
    pub inputs: Vec<InputSetting>,
    /// `"bfloat16"` or `"float16"`: run the model in reduced precision.
    pub dtype: Option<String>,
    /// Let CUDA matrix multiplications run in TF32 (10-bit mantissa, on
    /// compute capability 8.0 and newer): faster, about 1e-3 relative
    /// error per product. Default false. No effect on the CPU.
    #[serde(default)]
    pub tf32: bool,
    /// A candidate model run beside this one on every mini-batch, on the
    /// same rows: the output stays this model's; the summary's `shadow`
    /// section compares the two (see `[output] shadow`).
    pub shadow: Option<ShadowSection>,
}

/// `[model.shadow]`: the candidate model. Its inputs, outputs and device
/// are the job's model's.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ShadowSection {
    /// TorchScript file (or `.pt2` package, or `s3://` object), as `[model] path`.
    pub path: String,
    /// Expected SHA-256 of the file (hex); checked when given.
    pub sha256: Option<String>,
    /// `"bfloat16"` or `"float16"`: run the shadow in reduced precision.
    /// Default: as saved (not the job's model's `dtype`).
    pub dtype: Option<String>,
}

/// `[output] shadow`: what a shadow model adds to the output folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ShadowOutput {
    /// Nothing in the part files: the comparison in `_summary.json` only.
    Stats,
    /// Each output column again from the shadow, as `<name>_shadow`.
    Columns,
}

/// One entry of `[model] inputs`, as written.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum InputSetting {
    /// A source name: `"input_ids"`, `"attention_mask"`, `"token_type_ids"`,
    /// `"features"` or `"pixels"`; the parameter has the same name.
    Source(String),
    /// `{ name = "…", source = "…", dtype = "int64" }`.
    Table(InputTable),
}

/// `{ name, source, dtype }` of `[model] inputs`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InputTable {
    /// The `forward` parameter's name. Default: the source's name.
    pub name: Option<String>,
    /// Where the values come from.
    pub source: String,
    /// `int64`, `int32`, `float32` or `float64`. Default: `int64` for
    /// token sources, `float32` for features and pixels.
    pub dtype: Option<String>,
}

/// `[output] select`, as written: a key, a position, or several.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum SelectSetting {
    /// A dict key.
    Name(String),
    /// A tuple or list position.
    Index(i64),
    /// Several keys or positions, written side by side.
    Many(Vec<SelectOne>),
}

/// One entry of a list `[output] select`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum SelectOne {
    /// A dict key.
    Name(String),
    /// A tuple or list position.
    Index(i64),
}

fn default_device() -> String {
    "cpu".into()
}

/// `[batching]`
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchingSection {
    /// Rows per work item (exclusive with `item_bytes`). Default 10000.
    pub item_rows: Option<u64>,
    /// Input bytes per work item (exclusive with `item_rows`).
    pub item_bytes: Option<u64>,
    /// Rows per `forward` call, or `"auto"`: each worker doubles its
    /// mini-batch from 32 while rows/s improves by 5 %, below the size that
    /// ran out of memory and 90 % of a GPU's memory. Default 1024.
    pub inference_batch_size: Option<BatchSizeSetting>,
    /// Mini-batches between checkpoints inside an item (0 = off). Default 4.
    pub checkpoint_every: Option<u32>,
    /// Text input: padded tokens per `forward` call at most. The rows,
    /// sorted by length, fill each mini-batch up to this budget (rows ×
    /// padded length), and to `inference_batch_size` rows at most: many
    /// short rows per call, few long ones.
    pub max_batch_tokens: Option<u32>,
}

/// `[batching] inference_batch_size`, as written.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum BatchSizeSetting {
    /// Rows per `forward` call.
    Rows(u32),
    /// `"auto"`.
    Word(String),
}

/// `[output]`
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
    /// order (`_merged/predictions.csv`).
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
    /// For a model returning a tuple, list or dict: the output(s) written.
    pub select: Option<SelectSetting>,
    /// Write a `[rows, D]` output as one vector column of this name.
    pub vector: Option<String>,
    /// L2-normalise each row of the output. Default false.
    #[serde(default)]
    pub normalize: bool,
    /// `"mean"` or `"cls"`: one vector per row from a `[rows, L, D]` output.
    pub pooling: Option<String>,
    /// With `[model.shadow]`: `"stats"` (the default) compares the models
    /// in `_summary.json` only; `"columns"` also writes each output column
    /// from the shadow as `<name>_shadow`.
    pub shadow: Option<ShadowOutput>,
}

/// `[output] histogram = { min = 0.0, max = 1.0, bins = 20 }`
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
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

/// Takes `null` out of the schema, which TOML cannot write: out of `type`
/// lists and `anyOf` alternatives (an `Option`'s schema), and the unset keys
/// out of every `default` a section's `Default` gave (an empty one goes).
fn drop_nulls(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            if let Some(Value::Object(default)) = map.get_mut("default") {
                default.retain(|_, v| !v.is_null());
                if default.is_empty() {
                    map.remove("default");
                }
            }
            if let Some(Value::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if let [one] = types.as_slice() {
                    let one = one.clone();
                    map.insert("type".into(), one);
                }
            }
            let null = serde_json::json!({ "type": "null" });
            if let Some(Value::Array(alternatives)) = map.get_mut("anyOf") {
                alternatives.retain(|a| *a != null);
                if alternatives.len() == 1 {
                    if let Some(Value::Object(only)) = alternatives.pop() {
                        map.remove("anyOf");
                        for (k, v) in only {
                            map.entry(k).or_insert(v);
                        }
                    }
                }
            }
            map.values_mut().for_each(drop_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// Where the schema says it lives (its `$id`).
pub const SCHEMA_ID: &str = "https://batchfleet.dev/schema/manifest.json";

/// The JSON Schema (draft 2020-12) of a manifest as written: every section,
/// key, type, default and description, unknown keys refused. Editors that
/// read JSON Schema for TOML (Taplo and Even Better TOML, JetBrains IDEs)
/// complete and check `job.toml` with it. Values are checked further at
/// validation (paths, globs, ranges).
pub fn json_schema() -> serde_json::Value {
    let schema = schemars::schema_for!(Manifest);
    let mut value = serde_json::to_value(&schema).unwrap_or_default();
    // TOML has no null: an optional key is one that may be left out.
    drop_nulls(&mut value);
    if let Some(top) = value.as_object_mut() {
        top.insert("$id".into(), SCHEMA_ID.into());
        top.insert("title".into(), "batchfleet job manifest".into());
        top.insert(
            "description".into(),
            format!(
                "A batchfleet {} job manifest (job.toml); see docs/manifest.md.",
                env!("CARGO_PKG_VERSION")
            )
            .into(),
        );
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::Path;

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

    /// Every section and key the parser takes is in the schema, which
    /// refuses unknown keys as the parser does.
    #[test]
    fn the_schema_names_every_section_and_refuses_unknown_keys() {
        let schema = json_schema();
        let text = schema.to_string();
        assert_eq!(schema["additionalProperties"], serde_json::json!(false));
        for section in [
            "job",
            "input",
            "model",
            "batching",
            "output",
            "preprocess",
            "failure",
            "on_complete",
        ] {
            assert!(
                schema["properties"][section].is_object(),
                "no [{section}] in {text}"
            );
        }
        let defs = &schema["$defs"];
        assert_eq!(
            defs["JobSection"]["additionalProperties"],
            serde_json::json!(false)
        );
        assert_eq!(
            defs["JobSection"]["properties"]["pool"]["default"],
            serde_json::json!("default")
        );
        assert!(defs["ModelSection"]["properties"]["sha256"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("SHA-256")));
        assert_eq!(
            defs["InputFormat"]["oneOf"].as_array().map(Vec::len),
            Some(4),
            "{}",
            defs["InputFormat"]
        );
        assert_eq!(
            schema["required"],
            serde_json::json!(["job", "input", "model", "output"])
        );
        // TOML has no null: nothing in the schema allows or defaults to one.
        assert!(!text.contains("null"), "{text}");
        assert_eq!(
            defs["ModelSection"]["properties"]["sha256"]["type"],
            serde_json::json!("string")
        );
    }
}
