//! The wire format: what a work item carries and how it is encoded.
//!
//! A work item names data (a path and a byte range), never carries it. The body
//! is a versioned enum encoded with rmp-serde using named fields, so fields can
//! be added without breaking old workers; the delivery attempt travels in the
//! AMQP header [`ATTEMPT_HEADER`] because a retried message body is immutable.
//!
//! Version 2 (what is published) carries the input's layout as one tagged
//! [`Layout`] — CSV columns, JSON Lines keys, Parquet columns or image
//! preprocessing — next to the tagged [`InputSlice`]; version 1 ([`v1`]: a
//! CSV layout always, the others as optional fields) is still decoded.

pub mod v1;

use serde::{Deserialize, Serialize};

/// AMQP content type of every work message.
pub const CONTENT_TYPE: &str = "application/msgpack";
/// AMQP `type` property of a [`Envelope::V1`] work item.
pub const MESSAGE_TYPE_V1: &str = "batchfleet.work_item.v1";
/// AMQP `type` property of a [`Envelope::V2`] work item (what is published).
pub const MESSAGE_TYPE_V2: &str = "batchfleet.work_item.v2";
/// Header with the 1-based delivery attempt, maintained by batchfleet itself
/// (RabbitMQ's `x-death` is not relied on: it is absent after a manual replay).
pub const ATTEMPT_HEADER: &str = "x-bf-attempt";
/// Work items: when the item was published (ms since epoch), for the queue-wait metric.
pub const PUBLISHED_HEADER: &str = "x-bf-published-ms";

/// Dead letters: job id of the item.
pub const JOB_HEADER: &str = "x-bf-job";
/// Dead letters: item seq.
pub const ITEM_HEADER: &str = "x-bf-item";
/// Dead letters and retries: failure class (`poison`, `transient`, `timeout`).
pub const CLASS_HEADER: &str = "x-bf-error-class";
/// Dead letters and retries: the last error message.
pub const ERROR_HEADER: &str = "x-bf-error";
/// Dead letters: the worker that gave up.
pub const WORKER_HEADER: &str = "x-bf-worker";
/// Dead letters: when (ms since epoch).
pub const DEAD_AT_HEADER: &str = "x-bf-dead-at";

/// Every message version a worker understands. New versions are added as new
/// variants; a worker rejects (dead-letters) a variant it does not know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
// Decoded once per message and turned into its item at once: boxing a
// variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Envelope {
    /// Version 1 of the work item (a CSV layout plus optional ones), still decoded.
    V1(v1::WorkItem),
    /// Version 2: the layout as one tagged enum.
    V2(WorkItem),
}

/// One independently processable unit of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkItem {
    /// Stable job id (`<name>-<hash>`).
    pub job_id: String,
    /// Item number within the job, 0-based, dense.
    pub seq: u32,
    /// The slice of input this item covers.
    pub input: InputSlice,
    /// How to turn rows into features and predictions into output.
    pub task: TaskSpec,
    /// Each input file's version when the job was planned
    /// ([`crate::source::Fingerprint::version`]: `mtime:<ns>` or
    /// `etag:<etag>`), in the order of [`InputSlice::input_files`]; a worker
    /// that finds another fails the item rather than read a changed file.
    /// Empty: not checked (messages planned before versions were recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<String>,
}

/// Records of a text file (CSV or JSON Lines) in the bytes `[start, end)`.
///
/// Planned by scanning (`align` false): `start` is the first byte of a
/// record, `end` the first byte after the last one, and `first_line` and
/// `rows` are what the planner counted. Cut blind from the file's size
/// (`align` true): the range owns every record that starts in it, which its
/// reader finds ([`crate::split::align`]); `first_line` and `rows` are 0
/// (unknown until the item is read).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ByteRange {
    /// Absolute path of the file.
    pub path: String,
    /// Byte offset of the first record (`align`: where the range starts).
    pub start: u64,
    /// Byte offset just past the last record (`align`: where the range ends).
    pub end: u64,
    /// 1-based line number of the first record, for error messages (0: unknown).
    pub first_line: u64,
    /// Number of records in the range, as counted by the planner (0 when `align`).
    pub rows: u64,
    /// File length when planned; a different length means the file changed.
    pub file_len: u64,
    /// Cut blind: the reader aligns the range to record boundaries.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub align: bool,
}

/// A slice of one input file.
///
/// The byte-range variants wrap a [`ByteRange`]; encoded they are the same
/// map as a variant with those fields inline (`{"CsvRange": {"path": …}}`),
/// so messages of either shape decode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum InputSlice {
    /// Records of a CSV file (after its header).
    CsvRange(ByteRange),
    /// Records of a JSON Lines file (one JSON object per line), cut at line
    /// boundaries like [`InputSlice::CsvRange`].
    JsonlRange(ByteRange),
    /// Consecutive row groups `[first_group, first_group + groups)` of a
    /// Parquet file; only the task's id and feature columns are read.
    ParquetRowGroups {
        /// Absolute path of the file.
        path: String,
        /// Index of the first row group.
        first_group: u32,
        /// Number of row groups.
        groups: u32,
        /// 0-based index in the file of the first row, for error messages.
        first_row: u64,
        /// Rows in the row groups, from the file's metadata.
        rows: u64,
        /// File length when planned; a different length means the file changed.
        file_len: u64,
    },
    /// Whole files, one record each (images): `files[i]` is a path relative
    /// to `root` and is also the record's id.
    Files {
        /// Absolute folder the files are named relative to.
        root: String,
        /// Relative paths, in the job's order.
        files: Vec<String>,
        /// Each file's length when planned; a different length means it changed.
        sizes: Vec<u64>,
        /// 0-based position of the first file in the job's list, for messages.
        first_index: u64,
    },
}

impl InputSlice {
    /// Number of input rows the planner counted in this slice (0 for a
    /// range cut blind, whose rows are known once it is read: see
    /// [`crate::split::ItemRows`]).
    pub fn rows(&self) -> u64 {
        match self {
            InputSlice::CsvRange(r) | InputSlice::JsonlRange(r) => r.rows,
            InputSlice::ParquetRowGroups { rows, .. } => *rows,
            InputSlice::Files { files, .. } => files.len() as u64,
        }
    }

    /// The input file this slice reads (for files, their root folder).
    pub fn path(&self) -> &str {
        match self {
            InputSlice::CsvRange(r) | InputSlice::JsonlRange(r) => &r.path,
            InputSlice::ParquetRowGroups { path, .. } => path,
            InputSlice::Files { root, .. } => root,
        }
    }

    /// Every file this slice reads, as absolute paths.
    pub fn input_files(&self) -> Vec<std::path::PathBuf> {
        match self {
            InputSlice::Files { root, files, .. } => files
                .iter()
                .map(|f| std::path::Path::new(root).join(f))
                .collect(),
            other => vec![other.path().into()],
        }
    }
}

/// Everything a worker needs besides the input slice; identical for all items of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    /// The model to run.
    pub model: ModelRef,
    /// Where the id and the features are in a record, by input format.
    pub layout: Layout,
    /// Rows per `forward` call.
    pub batch_size: u32,
    /// Where and how predictions are written.
    pub output: OutputSpec,
    /// What to do when something fails.
    #[serde(default)]
    pub failure: FailurePolicy,
    /// Rows between checkpoints inside an item (a multiple of `batch_size`);
    /// 0 = none. A redelivered item resumes after its last checkpoint.
    #[serde(default)]
    pub checkpoint_rows: u32,
    /// Text input tokenized in the worker (`[input] text_column` with
    /// `[model] tokenizer`); `None` for numeric features and images.
    /// Serialized only when set, so other tasks keep their encoding (and
    /// their job ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextSpec>,
}

/// A text column and how the worker turns it into model inputs: the
/// tokenizer's ids (`input_ids`, `int64`) and an attention mask, truncated
/// at `max_length` tokens, rows sorted by length into mini-batches each
/// padded to its longest row (rounded up to `pad_to_multiple_of`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextSpec {
    /// Name of the text column (CSV header name, JSON Lines key, Parquet column).
    pub column: String,
    /// CSV input: index of the text field in each record.
    #[serde(default)]
    pub csv_field: u32,
    /// The Hugging Face `tokenizer.json`.
    pub tokenizer: FileRef,
    /// Tokens per row at most (special tokens included); longer rows are truncated.
    pub max_length: u32,
    /// Padded lengths are rounded up to a multiple of this; 0 or 1: not rounded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pad_to_multiple_of: u32,
}

/// A file a task depends on besides its input, identified by path and content digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileRef {
    /// Absolute path.
    pub path: String,
    /// SHA-256 of the file (hex); the worker refuses a file that does not match.
    pub sha256: String,
}

/// Where a task's id and features are in a record: one variant per input
/// format, each with only what that format needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Layout {
    /// CSV fields by index.
    Csv(CsvLayout),
    /// JSON Lines keys.
    Jsonl(JsonLayout),
    /// Parquet column names.
    Parquet(ParquetLayout),
    /// Image files: how each becomes a model input.
    Image(ImageSpec),
}

impl Layout {
    /// The layout's name in messages (`CSV`, `JSON Lines`, …).
    pub fn describe(&self) -> &'static str {
        match self {
            Layout::Csv(_) => "CSV",
            Layout::Jsonl(_) => "JSON Lines",
            Layout::Parquet(_) => "Parquet",
            Layout::Image(_) => "image",
        }
    }

    /// The CSV layout, if this is one.
    pub fn csv(&self) -> Option<&CsvLayout> {
        match self {
            Layout::Csv(l) => Some(l),
            _ => None,
        }
    }

    /// The JSON Lines layout, if this is one.
    pub fn jsonl(&self) -> Option<&JsonLayout> {
        match self {
            Layout::Jsonl(l) => Some(l),
            _ => None,
        }
    }

    /// The Parquet layout, if this is one.
    pub fn parquet(&self) -> Option<&ParquetLayout> {
        match self {
            Layout::Parquet(l) => Some(l),
            _ => None,
        }
    }

    /// The image preprocessing, if this is an image layout.
    pub fn image(&self) -> Option<&ImageSpec> {
        match self {
            Layout::Image(l) => Some(l),
            _ => None,
        }
    }

    /// Whether `slice` is of this layout's input format.
    pub fn fits(&self, slice: &InputSlice) -> bool {
        matches!(
            (slice, self),
            (InputSlice::CsvRange(_), Layout::Csv(_))
                | (InputSlice::JsonlRange(_), Layout::Jsonl(_))
                | (InputSlice::ParquetRowGroups { .. }, Layout::Parquet(_))
                | (InputSlice::Files { .. }, Layout::Image(_))
        )
    }
}

/// Image preprocessing (from `[preprocess]`): decode, convert to `channels`,
/// resize to `height × width`, scale to [0, 1], then `(x - mean[c]) / std[c]`,
/// laid out channels-first (CHW) — what torchvision's `ToTensor` + `Normalize` give.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageSpec {
    /// Output height in pixels.
    pub height: u32,
    /// Output width in pixels.
    pub width: u32,
    /// 3 (RGB) or 1 (grayscale).
    pub channels: u32,
    /// Per-channel mean subtracted after scaling to [0, 1].
    pub mean: Vec<f32>,
    /// Per-channel standard deviation divided by.
    pub std: Vec<f32>,
}

/// Which columns of a Parquet file hold the id and the features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParquetLayout {
    /// Column of the id (string or integer).
    pub id_column: String,
    /// Columns of the features (numeric), in model input order.
    pub feature_columns: Vec<String>,
    /// Columns copied to the output (`[output] include_columns`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_columns: Vec<String>,
    /// What a null feature becomes (`[input] missing`).
    #[serde(default, skip_serializing_if = "Missing::is_reject")]
    pub missing: Missing,
}

/// Which keys of a JSON Lines record hold the id and the features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonLayout {
    /// Key of the id (a string or a number).
    pub id_key: String,
    /// Keys of the features (numbers), in model input order.
    pub feature_keys: Vec<String>,
    /// Keys copied to the output (`[output] include_columns`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_keys: Vec<String>,
    /// What a `null` feature becomes (`[input] missing`).
    #[serde(default, skip_serializing_if = "Missing::is_reject")]
    pub missing: Missing,
}

/// What a missing feature value becomes (`[input] missing`): a CSV field
/// that is empty or one of the markers pandas reads as missing (`NaN`,
/// `nan`, `NA`, `null`, …; see [`crate::numbers`]), a JSON `null`, a
/// Parquet null. Serialized only when it is not the default, so a task
/// without it keeps its encoding (and its job id).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Missing {
    /// The row is bad (`[failure] on_bad_row` decides: rejected or failing the item).
    #[default]
    Reject,
    /// The value is NaN (for models that handle missing values themselves).
    Nan,
    /// The value is this number (an imputation constant).
    Value(f32),
}

impl Missing {
    /// Whether this is the default, [`Missing::Reject`].
    pub fn is_reject(&self) -> bool {
        matches!(self, Missing::Reject)
    }

    /// The value a missing field takes, or `None` when it rejects its row.
    pub fn fill(self) -> Option<f32> {
        match self {
            Missing::Reject => None,
            Missing::Nan => Some(f32::NAN),
            Missing::Value(v) => Some(v),
        }
    }
}

/// What a bad row does to its item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRow {
    /// Write the row to the item's rejects file with the reason and go on.
    #[default]
    Reject,
    /// Fail the whole item (it is dead-lettered).
    FailItem,
}

/// The job's failure policy, carried by every item (from `[failure]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailurePolicy {
    /// Attempts of an item that fails transiently (or times out) before it is
    /// dead-lettered.
    pub max_attempts: u32,
    /// Delay before the second attempt, in ms; doubles per attempt.
    pub retry_base_ms: u64,
    /// Cap on the retry delay, in ms.
    pub retry_max_ms: u64,
    /// What a malformed row does.
    pub on_bad_row: OnBadRow,
    /// When `forward` raises on a mini-batch, bisect it to reject only the
    /// rows that make it raise.
    pub isolate_poison_rows: bool,
    /// Wall-time limit of one item on a worker, in ms.
    pub item_timeout_ms: u64,
    /// Substrings of model errors that mean "try again later" (transient),
    /// not "this input is bad" (poison).
    pub transient_errors: Vec<String>,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            retry_base_ms: 1_000,
            retry_max_ms: 300_000,
            on_bad_row: OnBadRow::Reject,
            isolate_poison_rows: true,
            item_timeout_ms: 600_000,
            transient_errors: vec![
                "CUBLAS_STATUS_ALLOC_FAILED".into(),
                "CUDNN_STATUS_ALLOC_FAILED".into(),
            ],
        }
    }
}

impl FailurePolicy {
    /// Delay before attempt `next` (2, 3, …): `base · 2^(next-2)`, capped, with
    /// "equal jitter" (uniform in [d/2, d]) so retries of a burst spread out.
    /// `unit` is a uniform random number in [0, 1).
    pub fn retry_delay_ms(&self, next: u32, unit: f64) -> u64 {
        let exp = next.saturating_sub(2).min(40);
        let d = self
            .retry_base_ms
            .saturating_mul(1u64 << exp)
            .min(self.retry_max_ms)
            .max(1);
        let half = d / 2;
        half + ((d - half) as f64 * unit.clamp(0.0, 1.0)) as u64
    }
}

/// The manifest's words for the values of a small enum of the model call:
/// `as_str`, `from_name` and `listed` (every name, for messages).
macro_rules! manifest_names {
    ($ty:ident { $($name:literal => $variant:ident),* $(,)? }) => {
        impl $ty {
            /// The manifest's name of the value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)*
                }
            }

            /// The value a manifest name stands for.
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some($ty::$variant),)*
                    _ => None,
                }
            }

            /// Every name, in order, comma-separated.
            pub fn listed() -> String {
                [$($name),*].join(", ")
            }
        }
    };
}

/// A TorchScript model, identified by path and content digest, and how it
/// is called: which tensors its `forward` takes, in which precision it runs,
/// and which of its outputs are written. The call fields are serialized only
/// when set, so a plain model keeps its encoding (and its jobs their ids).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelRef {
    /// Absolute path of the TorchScript file.
    pub path: String,
    /// SHA-256 of the file (hex); the worker refuses a file that does not match.
    pub sha256: String,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// `forward`'s arguments in order (`[model] inputs`); empty: the
    /// default for the input — `forward(features)` (or pixels), or
    /// `forward(input_ids, attention_mask)` for text.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<ModelInput>,
    /// Reduced precision the model runs in (`[model] dtype`); `None`: as saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Precision>,
    /// The outputs written (`[output] select`), for a model returning a
    /// tuple, a list or a dict of tensors; empty: its one tensor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub select: Vec<Selector>,
    /// How a `[rows, L, D]` output becomes `[rows, D]` (`[output] pooling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooling: Option<Pooling>,
    /// L2-normalise each selected output's rows (`[output] normalize`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub normalize: bool,
}

impl ModelRef {
    /// A model called the default way: one input, one output, as saved.
    pub fn plain(
        path: impl Into<String>,
        sha256: impl Into<String>,
        device: impl Into<String>,
    ) -> Self {
        Self {
            path: path.into(),
            sha256: sha256.into(),
            device: device.into(),
            inputs: Vec::new(),
            dtype: None,
            select: Vec::new(),
            pooling: None,
            normalize: false,
        }
    }

    /// Whether `forward` takes one `float32` tensor of the rows' features
    /// (or pixels) in the saved precision: the default call.
    pub fn takes_plain_features(&self) -> bool {
        self.dtype.is_none()
            && match self.inputs.as_slice() {
                [] => true,
                [one] => {
                    matches!(one.source, InputSource::Features | InputSource::Pixels)
                        && one.dtype == TensorType::Float32
                }
                _ => false,
            }
    }

    /// Whether some input is the tokenizer's `token_type_ids`.
    pub fn wants_type_ids(&self) -> bool {
        self.inputs
            .iter()
            .any(|i| i.source == InputSource::TokenTypeIds)
    }
}

/// One argument of the model's `forward`: its name (the parameter's, checked
/// at validation), where its values come from and the tensor type it takes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelInput {
    /// The `forward` parameter's name.
    pub name: String,
    /// Where the values come from.
    pub source: InputSource,
    /// The tensor's element type.
    pub dtype: TensorType,
}

/// Where a model input's values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputSource {
    /// The tokenizer's ids, `[rows, L]`, padded per mini-batch.
    InputIds,
    /// 1 on real tokens, 0 on padding, `[rows, L]`.
    AttentionMask,
    /// The tokenizer's segment ids, `[rows, L]` (0 on padding).
    TokenTypeIds,
    /// The numeric columns (`[input] feature_columns`), `[rows, F]`.
    Features,
    /// The decoded images, `[rows, C, H, W]`.
    Pixels,
}

manifest_names!(InputSource {
    "input_ids" => InputIds,
    "attention_mask" => AttentionMask,
    "token_type_ids" => TokenTypeIds,
    "features" => Features,
    "pixels" => Pixels,
});

impl InputSource {
    /// Whether the tokenizer makes it.
    pub fn is_token(self) -> bool {
        matches!(
            self,
            InputSource::InputIds | InputSource::AttentionMask | InputSource::TokenTypeIds
        )
    }
}

/// A model input's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorType {
    /// `torch.int64` (`long`).
    Int64,
    /// `torch.int32`.
    Int32,
    /// `torch.float32`; in the model's `[model] dtype` when that is set.
    Float32,
    /// `torch.float64` (`double`).
    Float64,
}

manifest_names!(TensorType {
    "int64" => Int64,
    "int32" => Int32,
    "float32" => Float32,
    "float64" => Float64,
});

impl TensorType {
    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, TensorType::Float32 | TensorType::Float64)
    }
}

/// Reduced precision a model runs in (`[model] dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// `torch.bfloat16`.
    Bfloat16,
    /// `torch.float16` (half).
    Float16,
}

manifest_names!(Precision {
    "bfloat16" => Bfloat16,
    "float16" => Float16,
});

/// One output of a model returning several (`[output] select`): a dict key,
/// or a position in a tuple or list.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Selector {
    /// A key of a returned dict.
    Name(String),
    /// A position in a returned tuple or list (from 0).
    Index(u32),
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::Name(n) => write!(f, "{n:?}"),
            Selector::Index(i) => write!(f, "{i}"),
        }
    }
}

impl Selector {
    /// The prefix of its columns when several outputs are selected: the
    /// key, or `output<k>`.
    pub fn column_prefix(&self) -> String {
        match self {
            Selector::Name(n) => n.clone(),
            Selector::Index(i) => format!("output{i}"),
        }
    }
}

/// How a `[rows, L, D]` output (a last hidden state) becomes one vector per
/// row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The first position's vector (BERT's `[CLS]`).
    Cls,
    /// The mean over positions where the attention mask is 1.
    Mean,
}

manifest_names!(Pooling {
    "cls" => Cls,
    "mean" => Mean,
});

/// Which CSV fields hold the id and the features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CsvLayout {
    /// Field delimiter byte.
    pub delimiter: u8,
    /// Number of fields in the header; every record must have exactly this many.
    pub fields: u32,
    /// Index of the id field.
    pub id_column: u32,
    /// Indices of the feature fields, in model input order.
    pub feature_columns: Vec<u32>,
    /// Indices of fields copied to the output (`[output] include_columns`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_columns: Vec<u32>,
    /// What an empty or missing-marker feature field becomes (`[input] missing`).
    #[serde(default, skip_serializing_if = "Missing::is_reject")]
    pub missing: Missing,
    /// The header row every input file must have (as
    /// [`crate::columns::csv_header`] reads it), checked by the worker
    /// before it reads a file's records; empty: not checked (items published
    /// before the check existed). Not part of the version-1 task a job id
    /// hashes: the files' names and layout already are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub header: Vec<String>,
}

/// Output format of part files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// Comma-separated values with a header row.
    #[default]
    Csv,
    /// JSON Lines: one object per row, keys in column order.
    Jsonl,
    /// Apache Parquet.
    Parquet,
}

impl OutputFormat {
    /// Parses the lower-case name (`csv`, `jsonl`, `parquet`).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "csv" => Some(OutputFormat::Csv),
            "jsonl" => Some(OutputFormat::Jsonl),
            "parquet" => Some(OutputFormat::Parquet),
            _ => None,
        }
    }

    /// The lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            OutputFormat::Csv => "csv",
            OutputFormat::Jsonl => "jsonl",
            OutputFormat::Parquet => "parquet",
        }
    }

    /// File extension of a part file (the name).
    pub fn extension(self) -> &'static str {
        self.as_str()
    }

    /// The format whose part files have this extension.
    pub fn from_extension(ext: &str) -> Option<Self> {
        Self::parse(ext)
    }
}

/// Where predictions go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct OutputSpec {
    /// Absolute output directory of the job.
    pub dir: String,
    /// Part file format.
    pub format: OutputFormat,
    /// Bins of the prediction histogram recorded per output column.
    #[serde(default)]
    pub histogram: HistogramSpec,
    /// Names of the model's output columns; empty: `score` or `score_0 …`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<String>,
    /// Class names, one per model output, for `argmax` and `top_k`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// Add a `label` column: the class of the largest output.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub argmax: bool,
    /// Add `top1_label, top1_score, …` for the `top_k` largest outputs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub top_k: u32,
    /// Leave out the raw output columns (keep only labels).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drop_scores: bool,
    /// Input columns copied next to the id, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_columns: Vec<String>,
    /// Write the model's `[rows, D]` output as one vector column of this
    /// name (`[output] vector`): a fixed-size list of `float32` in Parquet,
    /// a JSON array in JSON Lines, `<name>_0 … <name>_{D-1}` in CSV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vector: Option<String>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Equal-width bins over `[min, max)` for the distribution of a model
/// output, plus one bin below and one above.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HistogramSpec {
    /// Lower edge of the first bin.
    pub min: f64,
    /// Upper edge of the last bin.
    pub max: f64,
    /// Bins between `min` and `max`.
    pub bins: u32,
}

impl Default for HistogramSpec {
    fn default() -> Self {
        Self {
            min: 0.0,
            max: 1.0,
            bins: 20,
        }
    }
}

impl HistogramSpec {
    /// Index in a counts vector of `bins + 2` (0 = below `min`, `bins + 1` =
    /// at or above `max`); `None` for NaN.
    pub fn index(&self, v: f64) -> Option<usize> {
        if v.is_nan() {
            return None;
        }
        if v < self.min {
            return Some(0);
        }
        if v >= self.max {
            return Some(self.bins as usize + 1);
        }
        let w = (self.max - self.min) / f64::from(self.bins);
        Some((((v - self.min) / w) as usize).min(self.bins as usize - 1) + 1)
    }

    /// Adds row-major values of `width` columns to `counts` (one vector per column).
    pub fn add(&self, counts: &mut Vec<Vec<u64>>, values: &[f32], width: usize) {
        if width == 0 {
            return;
        }
        if counts.len() < width {
            counts.resize(width, vec![0; self.bins as usize + 2]);
        }
        for row in values.chunks(width) {
            for (c, v) in row.iter().enumerate() {
                if let Some(i) = self.index(f64::from(*v)) {
                    counts[c][i] += 1;
                }
            }
        }
    }
}

impl OutputSpec {
    /// File name of the part file for item `seq`.
    pub fn part_name(&self, seq: u32) -> String {
        part_file_name(seq, self.format)
    }

    /// Names of `width` model outputs: `[output] columns`, else `score` or
    /// `score_0 … score_{width-1}`.
    pub fn score_names(&self, width: usize) -> Vec<String> {
        self.output_names(width, &[])
    }

    /// Names of `width` model outputs made of several selected tensors
    /// (`parts`: each one's column prefix and width, see `[output]
    /// select`): `[output] columns` when given; for several parts `<prefix>`
    /// (width 1) or `<prefix>_<i>`; else `score` or `score_0 … score_{width-1}`.
    pub fn output_names(&self, width: usize, parts: &[(String, usize)]) -> Vec<String> {
        if !self.columns.is_empty() {
            self.columns.clone()
        } else if parts.len() > 1 {
            let mut names = Vec::with_capacity(width);
            for (prefix, w) in parts {
                if *w == 1 {
                    names.push(prefix.clone());
                } else {
                    names.extend((0..*w).map(|i| format!("{prefix}_{i}")));
                }
            }
            names
        } else if width == 1 {
            vec!["score".into()]
        } else {
            (0..width).map(|i| format!("score_{i}")).collect()
        }
    }

    /// Whether a part file column holds a raw model output (what the
    /// prediction histogram counts): anything but the id, copied input
    /// columns and the label columns.
    pub fn is_score_column(&self, name: &str) -> bool {
        name != "id"
            && name != "label"
            && !self.include_columns.iter().any(|c| c == name)
            && !(name.starts_with("top") && (name.ends_with("_label") || name.ends_with("_score")))
    }
}

/// What one work item may ask of a worker. A message is data from the
/// network: every size a worker allocates by comes from facts (the file's
/// length, the job record) or is held under these caps, so one message can
/// never make a worker allocate without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemLimits {
    /// Input bytes one item may read (a byte range, or its files together).
    pub max_item_bytes: u64,
    /// Feature values one item may hold at once (rows × values per row; 4 bytes each).
    pub max_item_values: u64,
    /// Pixels (height × width) of the images an item's preprocessing makes.
    pub max_image_pixels: u64,
    /// Bins of the prediction histogram.
    pub max_histogram_bins: u32,
}

impl Default for ItemLimits {
    fn default() -> Self {
        Self {
            max_item_bytes: 1 << 30,
            max_item_values: 1 << 28,
            max_image_pixels: 8192 * 8192,
            max_histogram_bins: 1000,
        }
    }
}

/// Whether `id` can be a job id: `<name>-<hash>`, the name 1–64 of
/// `[A-Za-z0-9._-]` (as the manifest allows).
pub fn valid_job_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 80
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl WorkItem {
    /// Checks the message is internally consistent and within `limits`,
    /// before anything is read or allocated for it: the layout's column
    /// indices fit its field count, a byte range lies inside the file length
    /// it names and holds at most one row per byte, the model digest is a
    /// SHA-256, images have 1 or 3 channels. The reason names the field.
    pub fn check(&self, limits: &ItemLimits) -> Result<(), String> {
        let t = &self.task;
        if !valid_job_id(&self.job_id) {
            return Err(format!(
                "job id {:?} is not a batchfleet job id",
                truncated(&self.job_id)
            ));
        }
        let sha = &t.model.sha256;
        if sha.len() != 64
            || !sha
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err(format!(
                "model sha256 {:?} is not a SHA-256 in hex",
                truncated(sha)
            ));
        }
        let device_ok = t.model.device == "cpu"
            || t.model.device == "cuda"
            || t.model
                .device
                .strip_prefix("cuda:")
                .is_some_and(|n| n.len() <= 3 && n.parse::<u16>().is_ok());
        if !device_ok {
            return Err(format!(
                "device {:?} is not cpu, cuda or cuda:N",
                truncated(&t.model.device)
            ));
        }
        if t.batch_size == 0 {
            return Err("batch_size is 0".into());
        }
        if t.failure.max_attempts == 0 || t.failure.item_timeout_ms == 0 {
            return Err("the failure policy allows no attempt or no time".into());
        }
        let h = &t.output.histogram;
        if h.bins == 0
            || h.bins > limits.max_histogram_bins
            || !(h.min.is_finite() && h.max.is_finite() && h.min < h.max)
        {
            return Err(format!(
                "histogram of {} bins over [{}, {}) (at most {} bins over a finite, non-empty range)",
                h.bins, h.min, h.max, limits.max_histogram_bins
            ));
        }
        let values = |rows: u64, per_row: u64| -> Result<(), String> {
            match rows.checked_mul(per_row) {
                Some(n) if n <= limits.max_item_values => Ok(()),
                _ => Err(format!(
                    "{rows} rows of {per_row} values exceed the {} values one item may hold (--max-item-values)",
                    limits.max_item_values
                )),
            }
        };
        if !t.layout.fits(&self.input) {
            return Err(format!(
                "{} with a {} layout",
                match &self.input {
                    InputSlice::CsvRange(_) => "a CSV range",
                    InputSlice::JsonlRange(_) => "a JSON Lines range",
                    InputSlice::ParquetRowGroups { .. } => "Parquet row groups",
                    InputSlice::Files { .. } => "image files",
                },
                t.layout.describe()
            ));
        }
        // Text input feeds the model token ids instead of features.
        let text = t.text.as_ref();
        if let Some(x) = text {
            if x.max_length == 0 || x.max_length > MAX_TOKENS_PER_ROW {
                return Err(format!(
                    "max_length {} (1 to {MAX_TOKENS_PER_ROW} tokens per row)",
                    x.max_length
                ));
            }
            if x.column.is_empty() || x.tokenizer.path.is_empty() {
                return Err("text input with no column or no tokenizer".into());
            }
            if matches!(t.layout, Layout::Image(_)) {
                return Err("text input with an image layout".into());
            }
        }
        check_call(t)?;
        let files = match &self.input {
            InputSlice::Files { files, .. } => files.len(),
            _ => 1,
        };
        if !self.versions.is_empty() && self.versions.len() != files {
            return Err(format!(
                "{} input versions for {files} input files",
                self.versions.len()
            ));
        }
        if self.versions.iter().any(|v| v.len() > 256) {
            return Err("an input version longer than 256 bytes".into());
        }
        match (&self.input, &t.layout) {
            (InputSlice::CsvRange(r), Layout::Csv(l)) => {
                check_range(r, limits)?;
                check_csv_layout(l, text)?;
                values(r.rows, l.feature_columns.len() as u64)?;
            }
            (InputSlice::JsonlRange(r), Layout::Jsonl(j)) => {
                check_range(r, limits)?;
                if j.feature_keys.is_empty() && text.is_none() {
                    return Err("the JSON Lines layout names no feature".into());
                }
                values(r.rows, j.feature_keys.len() as u64)?;
            }
            (InputSlice::ParquetRowGroups { groups, rows, .. }, Layout::Parquet(p)) => {
                if *groups == 0 || (p.feature_columns.is_empty() && text.is_none()) {
                    return Err("no row group or no feature column".into());
                }
                values(*rows, p.feature_columns.len() as u64)?;
            }
            (InputSlice::Files { files, sizes, .. }, Layout::Image(img)) => {
                if files.is_empty() || files.len() != sizes.len() {
                    return Err(format!("{} files with {} sizes", files.len(), sizes.len()));
                }
                let bytes = sizes.iter().try_fold(0u64, |a, s| a.checked_add(*s));
                if bytes.is_none_or(|b| b > limits.max_item_bytes) {
                    return Err(format!(
                        "the item's files exceed the {} bytes one item may read (--max-item-bytes)",
                        limits.max_item_bytes
                    ));
                }
                if img.channels != 1 && img.channels != 3 {
                    return Err(format!("images of {} channels (1 or 3)", img.channels));
                }
                if img.mean.len() != img.channels as usize
                    || img.std.len() != img.channels as usize
                    || img.std.iter().any(|s| !(*s > 0.0 && s.is_finite()))
                    || img.mean.iter().any(|m| !m.is_finite())
                {
                    return Err(
                        "mean and std must hold one finite value per channel, std above 0".into(),
                    );
                }
                let pixels = u64::from(img.height) * u64::from(img.width);
                if img.height == 0 || img.width == 0 || pixels > limits.max_image_pixels {
                    return Err(format!(
                        "images of {}×{} pixels (1 to {} pixels, --max-image-pixels)",
                        img.height, img.width, limits.max_image_pixels
                    ));
                }
                values(files.len() as u64, pixels * u64::from(img.channels))?;
            }
            _ => unreachable!("the layout fits the slice (checked above)"),
        }
        Ok(())
    }
}

/// Arguments a model's `forward` may be given, and outputs one item may select.
pub const MAX_MODEL_INPUTS: usize = 16;
/// See [`MAX_MODEL_INPUTS`].
pub const MAX_SELECTED_OUTPUTS: usize = 64;

/// The model's call: each input has a source the task provides, and the
/// selected outputs and names are few and short.
fn check_call(t: &TaskSpec) -> Result<(), String> {
    let m = &t.model;
    if m.inputs.len() > MAX_MODEL_INPUTS || m.select.len() > MAX_SELECTED_OUTPUTS {
        return Err(format!(
            "{} model inputs and {} selected outputs (at most {MAX_MODEL_INPUTS} and {MAX_SELECTED_OUTPUTS})",
            m.inputs.len(),
            m.select.len()
        ));
    }
    let image = matches!(t.layout, Layout::Image(_));
    let features = match &t.layout {
        Layout::Csv(l) => !l.feature_columns.is_empty(),
        Layout::Jsonl(j) => !j.feature_keys.is_empty(),
        Layout::Parquet(p) => !p.feature_columns.is_empty(),
        Layout::Image(_) => false,
    };
    for input in &m.inputs {
        if input.name.is_empty() || input.name.len() > 256 {
            return Err("a model input with an empty or over-long name".into());
        }
        let provided = match input.source {
            s if s.is_token() => t.text.is_some(),
            InputSource::Pixels => image,
            _ => features,
        };
        if !provided {
            return Err(format!(
                "model input {:?} takes {}, which this task does not provide",
                truncated(&input.name),
                input.source.as_str()
            ));
        }
    }
    let long_name = |n: &str| n.is_empty() || n.len() > 256;
    if m.select
        .iter()
        .any(|s| matches!(s, Selector::Name(n) if long_name(n)))
        || t.output.vector.as_deref().is_some_and(long_name)
    {
        return Err("an output name that is empty or over-long".into());
    }
    Ok(())
}

fn truncated(s: &str) -> String {
    s.chars().take(80).collect()
}

fn check_range(r: &ByteRange, limits: &ItemLimits) -> Result<(), String> {
    if r.start > r.end || r.end > r.file_len {
        return Err(format!(
            "byte range {}..{} does not lie inside the {} bytes of {}",
            r.start, r.end, r.file_len, r.path
        ));
    }
    if r.end - r.start > limits.max_item_bytes {
        return Err(format!(
            "byte range {}..{} of {} exceeds the {} bytes one item may read (--max-item-bytes)",
            r.start, r.end, r.path, limits.max_item_bytes
        ));
    }
    if r.rows > r.end - r.start {
        return Err(format!(
            "{} rows claimed in the {} bytes {}..{} of {}",
            r.rows,
            r.end - r.start,
            r.start,
            r.end,
            r.path
        ));
    }
    Ok(())
}

/// Tokens one row of text input may have at most (`max_length`).
pub const MAX_TOKENS_PER_ROW: u32 = 1 << 16;

fn check_csv_layout(l: &CsvLayout, text: Option<&TextSpec>) -> Result<(), String> {
    let outside = std::iter::once(l.id_column)
        .chain(l.feature_columns.iter().copied())
        .chain(l.include_columns.iter().copied())
        .chain(text.map(|t| t.csv_field))
        .find(|c| *c >= l.fields);
    if let Some(c) = outside {
        return Err(format!(
            "CSV column index {c} is outside the {} fields of the layout",
            l.fields
        ));
    }
    if l.feature_columns.is_empty() && text.is_none() {
        return Err("the CSV layout names no feature column".into());
    }
    Ok(())
}

/// `part-000042.csv`: the committed output of one item.
pub fn part_file_name(seq: u32, format: OutputFormat) -> String {
    format!("part-{seq:06}.{}", format.extension())
}

/// Errors decoding a message body.
#[derive(Debug, thiserror::Error)]
#[error("undecodable work message ({len} bytes): {source}")]
pub struct DecodeError {
    len: usize,
    #[source]
    source: rmp_serde::decode::Error,
}

impl Envelope {
    /// Encodes with named fields (maps, not arrays), so readers tolerate added fields.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("work items always serialize")
    }

    /// Decodes a message body.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        rmp_serde::from_slice(bytes).map_err(|source| DecodeError {
            len: bytes.len(),
            source,
        })
    }

    /// The AMQP `type` of a message of this version.
    pub fn kind(&self) -> &'static str {
        match self {
            Envelope::V1(_) => MESSAGE_TYPE_V1,
            Envelope::V2(_) => MESSAGE_TYPE_V2,
        }
    }

    /// The work item inside, whatever the version.
    pub fn into_item(self) -> WorkItem {
        match self {
            Envelope::V1(item) => item.into(),
            Envelope::V2(item) => item,
        }
    }
}

#[cfg(test)]
pub(crate) fn sample_item() -> WorkItem {
    WorkItem {
        job_id: "scores-1a2b3c4d".into(),
        seq: 7,
        input: InputSlice::CsvRange(ByteRange {
            path: "/data/in/part-a.csv".into(),
            start: 18,
            end: 4096,
            first_line: 2,
            rows: 100,
            file_len: 8192,
            align: false,
        }),
        task: TaskSpec {
            model: ModelRef::plain("/models/mlp.pt", "ab".repeat(32), "cpu"),
            layout: Layout::Csv(CsvLayout {
                delimiter: b',',
                fields: 18,
                id_column: 0,
                feature_columns: (1..17).collect(),
                include_columns: Vec::new(),
                missing: Default::default(),
                header: Vec::new(),
            }),
            batch_size: 512,
            output: OutputSpec {
                dir: "/data/out".into(),
                format: OutputFormat::Csv,
                histogram: HistogramSpec::default(),
                ..OutputSpec::default()
            },
            failure: FailurePolicy::default(),
            checkpoint_rows: 0,
            text: None,
        },
        versions: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sample_item` as version 1 encoded it: the CSV layout as `csv`.
    fn sample_v1() -> v1::WorkItem {
        let item = sample_item();
        let Layout::Csv(csv) = item.task.layout.clone() else {
            unreachable!("the sample is a CSV item")
        };
        v1::WorkItem {
            job_id: item.job_id,
            seq: item.seq,
            input: item.input,
            task: v1::TaskSpec {
                model: item.task.model,
                csv,
                batch_size: item.task.batch_size,
                output: item.task.output,
                failure: item.task.failure,
                checkpoint_rows: item.task.checkpoint_rows,
                text: item.task.text.clone(),
                jsonl: None,
                parquet: None,
                image: None,
            },
        }
    }

    #[test]
    fn v2_round_trips_with_the_layout_as_one_tagged_enum() {
        let env = Envelope::V2(sample_item());
        let bytes = env.encode();
        assert_eq!(Envelope::decode(&bytes).unwrap(), env);
        let as_json: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        let task = &as_json["V2"]["task"];
        assert_eq!(task["layout"]["Csv"]["fields"], 18);
        for gone in ["csv", "jsonl", "parquet", "image"] {
            assert!(task.get(gone).is_none(), "{gone} in {task}");
        }
    }

    #[test]
    fn version_1_messages_still_decode_into_the_same_item() {
        let bytes = Envelope::V1(sample_v1()).encode();
        let item = Envelope::decode(&bytes).unwrap().into_item();
        assert_eq!(item, sample_item());
        // Each optional layout of version 1 picks its variant, images first.
        let mut v1 = sample_v1();
        let keys = JsonLayout {
            id_key: "id".into(),
            feature_keys: vec!["a".into(), "b".into()],
            include_keys: Vec::new(),
            missing: Default::default(),
        };
        v1.task.jsonl = Some(keys.clone());
        let task: TaskSpec = v1.task.clone().into();
        assert_eq!(task.layout, Layout::Jsonl(keys));
        v1.task.jsonl = None;
        let columns = ParquetLayout {
            id_column: "id".into(),
            feature_columns: vec!["a".into()],
            include_columns: Vec::new(),
            missing: Default::default(),
        };
        v1.task.parquet = Some(columns.clone());
        assert_eq!(
            TaskSpec::from(v1.task.clone()).layout,
            Layout::Parquet(columns)
        );
        let image = ImageSpec {
            height: 8,
            width: 8,
            channels: 1,
            mean: vec![0.0],
            std: vec![1.0],
        };
        v1.task.image = Some(image.clone());
        assert_eq!(TaskSpec::from(v1.task).layout, Layout::Image(image));
    }

    #[test]
    fn parquet_items_round_trip() {
        let mut item = sample_item();
        item.input = InputSlice::ParquetRowGroups {
            path: "/data/in.parquet".into(),
            first_group: 4,
            groups: 2,
            first_row: 40_000,
            rows: 20_000,
            file_len: 1 << 20,
        };
        item.task.layout = Layout::Parquet(ParquetLayout {
            id_column: "id".into(),
            feature_columns: vec!["a".into(), "b".into()],
            include_columns: Vec::new(),
            missing: Default::default(),
        });
        let env = Envelope::V2(item);
        assert_eq!(Envelope::decode(&env.encode()).unwrap(), env);
        assert_eq!(env.clone().into_item().input.rows(), 20_000);
        assert_eq!(env.into_item().input.path(), "/data/in.parquet");
    }

    #[test]
    fn byte_ranges_encode_as_the_inline_fields_they_replaced() {
        // The shape of the byte-range variants before `ByteRange` existed.
        #[derive(Serialize)]
        enum Inline {
            CsvRange {
                path: String,
                start: u64,
                end: u64,
                first_line: u64,
                rows: u64,
                file_len: u64,
            },
        }
        let inline = Inline::CsvRange {
            path: "/data/in.csv".into(),
            start: 18,
            end: 4096,
            first_line: 2,
            rows: 100,
            file_len: 8192,
        };
        let wrapped = InputSlice::CsvRange(ByteRange {
            path: "/data/in.csv".into(),
            start: 18,
            end: 4096,
            first_line: 2,
            rows: 100,
            file_len: 8192,
            align: false,
        });
        let old = rmp_serde::to_vec_named(&inline).unwrap();
        assert_eq!(rmp_serde::to_vec_named(&wrapped).unwrap(), old);
        assert_eq!(rmp_serde::from_slice::<InputSlice>(&old).unwrap(), wrapped);
    }

    #[test]
    fn encoding_uses_named_fields() {
        let bytes = Envelope::V2(sample_item()).encode();
        let as_json: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(as_json["V2"]["input"]["CsvRange"]["first_line"], 2);
        assert_eq!(as_json["V2"]["task"]["output"]["format"], "csv");
    }

    #[test]
    fn garbage_is_a_decode_error_not_a_panic() {
        let err = Envelope::decode(b"\xc1not msgpack").unwrap_err();
        assert!(err.to_string().contains("undecodable work message"));
    }

    #[test]
    fn retry_delays_grow_exponentially_with_jitter_up_to_the_cap() {
        let p = FailurePolicy {
            retry_base_ms: 1000,
            retry_max_ms: 5000,
            ..FailurePolicy::default()
        };
        assert_eq!(
            (p.retry_delay_ms(2, 0.0), p.retry_delay_ms(2, 0.999)),
            (500, 999)
        );
        assert_eq!(p.retry_delay_ms(3, 0.0), 1000);
        assert_eq!(p.retry_delay_ms(4, 0.0), 2000);
        assert_eq!(
            p.retry_delay_ms(9, 0.0),
            2500,
            "capped at 5000, jittered down to half"
        );
        assert!(p.retry_delay_ms(60, 1.0) <= 5000);
    }

    #[test]
    fn sane_items_pass_and_each_impossible_field_is_named() {
        let limits = ItemLimits::default();
        assert_eq!(sample_item().check(&limits), Ok(()));
        let refused = |f: &dyn Fn(&mut WorkItem), what: &str| {
            let mut item = sample_item();
            f(&mut item);
            let err = item.check(&limits).expect_err(what);
            assert!(err.contains(what), "{what}: {err}");
        };
        let csv = |f: fn(&mut CsvLayout)| {
            move |i: &mut WorkItem| {
                if let Layout::Csv(l) = &mut i.task.layout {
                    f(l);
                }
            }
        };
        refused(
            &csv(|l| l.id_column = 99),
            "index 99 is outside the 18 fields",
        );
        refused(&csv(|l| l.include_columns = vec![40]), "index 40");
        refused(
            &|i| {
                i.task.layout = Layout::Jsonl(JsonLayout {
                    id_key: "id".into(),
                    feature_keys: vec!["a".into()],
                    include_keys: Vec::new(),
                    missing: Default::default(),
                })
            },
            "a CSV range with a JSON Lines layout",
        );
        refused(
            &|i| {
                if let InputSlice::CsvRange(r) = &mut i.input {
                    r.end = 1 << 40;
                }
            },
            "does not lie inside the 8192 bytes",
        );
        refused(
            &|i| {
                if let InputSlice::CsvRange(r) = &mut i.input {
                    r.rows = 1 << 50;
                }
            },
            "rows claimed",
        );
        refused(
            &|i| i.task.model.sha256 = "é".repeat(32),
            "is not a SHA-256",
        );
        refused(
            &|i| i.job_id = "../../etc".into(),
            "is not a batchfleet job id",
        );
        refused(&|i| i.task.output.histogram.bins = 1 << 30, "bins");
        refused(&|i| i.task.model.device = "tpu".into(), "device");
        refused(
            &|i| {
                i.input = InputSlice::ParquetRowGroups {
                    path: "/d.parquet".into(),
                    first_group: 0,
                    groups: 1,
                    first_row: 0,
                    rows: u64::MAX / 2,
                    file_len: 10,
                };
                i.task.layout = Layout::Parquet(ParquetLayout {
                    id_column: "id".into(),
                    feature_columns: vec!["a".into(), "b".into()],
                    include_columns: Vec::new(),
                    missing: Default::default(),
                });
            },
            "exceed the 268435456 values",
        );
        let image = |channels: u32, side: u32| {
            move |i: &mut WorkItem| {
                i.input = InputSlice::Files {
                    root: "/d".into(),
                    files: vec!["a.png".into()],
                    sizes: vec![10],
                    first_index: 0,
                };
                i.task.layout = Layout::Image(ImageSpec {
                    height: side,
                    width: side,
                    channels,
                    mean: vec![0.0; channels as usize],
                    std: vec![1.0; channels as usize],
                });
            }
        };
        let mut ok = sample_item();
        image(3, 224)(&mut ok);
        assert_eq!(ok.check(&limits), Ok(()));
        refused(&image(4, 224), "4 channels");
        refused(&image(3, 100_000), "pixels");
    }

    #[test]
    fn part_names_sort_in_item_order() {
        assert_eq!(part_file_name(42, OutputFormat::Csv), "part-000042.csv");
        assert!(part_file_name(9, OutputFormat::Csv) < part_file_name(10, OutputFormat::Csv));
    }
}
