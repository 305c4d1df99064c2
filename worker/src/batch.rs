//! The rows of one item as the model takes them — one contiguous row-major
//! `f32` buffer with the row ids (and copied input columns) beside it — and
//! the rows that were not predicted, with why. Every reader (CSV, JSON Lines,
//! Parquet, image files) fills a [`Batch`]; the runner and the writer take it.
//! Text input carries each row's text instead, which the worker turns into
//! [`Tokens`] before the runner takes them.

use serde::{Deserialize, Serialize};

/// How a rejected row's reason says what to do about a missing value.
pub const MISSING_HINT: &str =
    "set [input] missing = \"nan\" or a number to score rows with missing values";

/// A row that was not predicted, with why. Written to `_rejects/part-<seq>.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reject {
    /// Input file.
    pub file: String,
    /// 1-based line of the record in the file.
    pub line: u64,
    /// The record as it appears in the file (lossy UTF-8, terminator removed).
    pub raw: String,
    /// What is wrong with it.
    pub reason: String,
    /// `parse` (malformed) or `model` (`forward` raised on it).
    pub stage: String,
}

/// The rows of one item, ready for the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// Features, row-major, `rows × cols`.
    pub features: Vec<f32>,
    /// Features per row.
    pub cols: usize,
    /// Shape of one row's features when it is not flat (`[channels, height,
    /// width]` for images); empty means `[cols]`.
    pub shape: Vec<usize>,
    pub(crate) ids: String,
    pub(crate) id_ends: Vec<usize>,
    /// Copied input columns (`[output] include_columns`), row-major as text.
    pub(crate) extras: String,
    pub(crate) extra_ends: Vec<usize>,
    /// Line and byte span (in `raw`) of each row, for reporting rejects.
    pub(crate) lines: Vec<u64>,
    pub(crate) spans: Vec<(usize, usize)>,
    pub(crate) raw: Vec<u8>,
    /// Input file, for reporting rejects.
    pub file: String,
    /// A range cut blind: `lines` count from 1 at this byte of `file`, whose
    /// line number is read the first time a row must be named.
    pub(crate) lines_from: Option<u64>,
    pub(crate) line_base: std::sync::OnceLock<u64>,
    /// Rows rejected while parsing.
    pub rejects: Vec<Reject>,
    /// Text input: each accepted row's text, back to back.
    pub(crate) texts: String,
    pub(crate) text_ends: Vec<usize>,
    /// Text input, once tokenized: what the model takes instead of `features`.
    pub tokens: Option<Tokens>,
}

/// The token ids of an item's rows (special tokens added, truncated, not
/// padded), back to back: the runner pads each mini-batch to its longest row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tokens {
    /// Ids of every row, row after row.
    pub ids: Vec<i64>,
    /// Where each row's ids end in `ids`.
    pub ends: Vec<usize>,
    /// The tokenizer's type (segment) id of each id in `ids`, when the
    /// model takes `token_type_ids`; empty otherwise.
    pub types: Vec<i64>,
    /// The id padded positions take.
    pub pad_id: i64,
    /// Padded lengths are rounded up to a multiple of this (0 or 1: not rounded).
    pub multiple: usize,
    /// Padded tokens per `forward` call at most (0: no budget; `[batching]
    /// max_batch_tokens`).
    pub max_batch_tokens: usize,
}

impl Tokens {
    /// The ids of row `i`.
    pub fn row(&self, i: usize) -> &[i64] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.ids[start..self.ends[i]]
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.ends.len()
    }

    /// The type ids of row `i` (empty when the tokens carry none).
    pub fn row_types(&self, i: usize) -> &[i64] {
        if self.types.is_empty() {
            return &[];
        }
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.types[start..self.ends[i]]
    }

    /// Appends a row of ids (no type ids).
    pub fn push(&mut self, ids: &[i64]) {
        self.ids.extend_from_slice(ids);
        self.ends.push(self.ids.len());
    }

    /// Appends row `i` of `other`, type ids included.
    pub fn push_row(&mut self, other: &Tokens, i: usize) {
        self.types.extend_from_slice(other.row_types(i));
        self.push(other.row(i));
    }

    /// The padded length of a mini-batch whose longest row has `longest` ids.
    pub fn padded_len(&self, longest: usize) -> usize {
        let longest = longest.max(1);
        if self.multiple > 1 {
            longest.div_ceil(self.multiple) * self.multiple
        } else {
            longest
        }
    }
}

impl Batch {
    /// An empty batch of `cols` features per row with room for `rows`.
    pub fn with_capacity(cols: usize, rows: usize) -> Self {
        Self {
            features: Vec::with_capacity(rows * cols),
            cols,
            id_ends: Vec::with_capacity(rows),
            lines: Vec::with_capacity(rows),
            spans: Vec::with_capacity(rows),
            ..Self::default()
        }
    }

    /// Appends one row (tests and callers without source text).
    pub fn push(&mut self, id: &str, features: &[f32]) {
        self.push_row(id, features, 0, (0, 0));
    }

    pub(crate) fn push_row(&mut self, id: &str, features: &[f32], line: u64, span: (usize, usize)) {
        // `id` may borrow from a record, so it is copied here, once.
        debug_assert_eq!(features.len(), self.cols);
        self.ids.push_str(id);
        self.id_ends.push(self.ids.len());
        self.features.extend_from_slice(features);
        self.lines.push(line);
        self.spans.push(span);
    }

    /// The shape of one row as the model takes it.
    pub fn row_shape(&self) -> Vec<usize> {
        if self.shape.is_empty() {
            vec![self.cols]
        } else {
            self.shape.clone()
        }
    }

    /// Number of rows (not counting parse rejects).
    pub fn rows(&self) -> usize {
        self.id_ends.len()
    }

    /// Appends the text of the next copied input column of the row being
    /// read (call once per include column, for accepted rows only).
    pub fn push_extra(&mut self, text: &str) {
        self.extras.push_str(text);
        self.extra_ends.push(self.extras.len());
    }

    /// Copied input column `j` (of `per_row`) of row `i`.
    pub fn extra(&self, i: usize, j: usize, per_row: usize) -> &str {
        let k = i * per_row + j;
        let start = if k == 0 { 0 } else { self.extra_ends[k - 1] };
        &self.extras[start..self.extra_ends[k]]
    }

    /// Appends the text of the row being read (text input; accepted rows only).
    pub fn push_text(&mut self, text: &str) {
        self.texts.push_str(text);
        self.text_ends.push(self.texts.len());
    }

    /// The text of row `i` (text input).
    pub fn text(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.text_ends[i - 1] };
        &self.texts[start..self.text_ends[i]]
    }

    /// Id of row `i`.
    pub fn id(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.id_ends[i - 1] };
        &self.ids[start..self.id_ends[i]]
    }

    /// The 1-based line of row `i` in its file (0 when it cannot be read).
    pub fn line(&self, i: usize) -> u64 {
        match self.lines_from {
            None => self.lines[i],
            Some(at) => {
                let base = *self.line_base.get_or_init(|| {
                    batchfleet_shared::source::Input::open(std::path::Path::new(&self.file))
                        .and_then(|input| batchfleet_shared::split::line_of(&input, at))
                        .unwrap_or(0)
                });
                if base == 0 {
                    0
                } else {
                    base + self.lines[i] - 1
                }
            }
        }
    }

    /// A reject record for row `i`, which the model raised on. Its `raw` is
    /// the record's text, or the row's id for input with no text (Parquet).
    pub fn model_reject(&self, i: usize, reason: &str) -> Reject {
        let raw = if self.spans[i].0 == self.spans[i].1 {
            self.id(i).to_owned()
        } else {
            raw_text(&self.raw, self.spans[i])
        };
        Reject {
            file: self.file.clone(),
            line: self.line(i),
            raw,
            reason: reason.to_owned(),
            stage: "model".into(),
        }
    }
}

pub(crate) fn raw_text(raw: &[u8], (start, end): (usize, usize)) -> String {
    let bytes = raw.get(start..end).unwrap_or_default();
    String::from_utf8_lossy(bytes)
        .trim_end_matches(['\r', '\n'])
        .to_owned()
}
