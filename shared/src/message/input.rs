//! What an item reads: the slice of input it covers ([`InputSlice`] — a
//! byte range of a CSV or JSON Lines file, Parquet row groups, image files)
//! and where each record's id and features are ([`Layout`], one variant per
//! input format), with text input's tokenizer and what a missing value becomes.

use serde::{Deserialize, Serialize};

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
    #[serde(default, skip_serializing_if = "super::output::is_zero")]
    pub pad_to_multiple_of: u32,
    /// Padded tokens per `forward` call at most: the rows, sorted by
    /// length, fill each mini-batch up to it (and to the batch size in
    /// rows); 0: mini-batches of the batch size.
    #[serde(default, skip_serializing_if = "super::output::is_zero")]
    pub max_batch_tokens: u32,
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
