//! Reads the rows of a work item: a CSV or JSON Lines byte range parsed
//! straight into one contiguous row-major `f32` buffer (what libtorch takes)
//! plus the row ids.
//!
//! The item's bytes are read into memory once (items are megabytes), so a
//! rejected row can be reported with its exact raw text and line.
//!
//! # Layout
//! - this file: a slice's rows, by input kind — CSV and JSON Lines byte
//!   ranges parsed here — and the checks that the input is still the one
//!   the job was planned with.
//! - [`columnar`]: Parquet row groups, projected columns.
//! - [`images`]: image files, decoded and normalised.
//! - [`text`]: text rows tokenized into token ids.

mod columnar;
mod images;
pub(crate) mod text;

use crate::batch::{raw_text, Batch, Reject, MISSING_HINT};
use crate::error::ItemError;
use batchfleet_shared::message::{
    ByteRange, CsvLayout, InputSlice, JsonLayout, OnBadRow, TextSpec,
};
use batchfleet_shared::numbers::{self, Field};
use batchfleet_shared::source::Input;
use batchfleet_shared::split;
use std::path::Path;

pub use batchfleet_shared::message::Layout;
/// One image as a worker feeds it to the model (`gpu-check --local` checks
/// its CNN's outputs against PyTorch's on these pixels).
pub use images::to_chw;

/// Reads the rows of `slice`. A malformed row is rejected or fails the item
/// (poison), per `on_bad_row`; a file that changed since planning is poison.
///
/// With `text` (text input), each accepted row also carries its text; a row
/// whose text is missing, null or not a string is a bad row.
pub fn read(
    slice: &InputSlice,
    layout: &Layout,
    text: Option<&TextSpec>,
    on_bad_row: OnBadRow,
) -> Result<Batch, ItemError> {
    let mismatch = |path: &str| {
        ItemError::poison(format!(
            "{path}: the item's input format and its task's column layout disagree; the message is malformed"
        ))
    };
    match slice {
        InputSlice::Files {
            root,
            files,
            sizes,
            first_index,
        } => {
            let Layout::Image(spec) = layout else {
                return Err(mismatch(root));
            };
            let list = images::FileList {
                root,
                files,
                sizes,
                first_index: *first_index,
            };
            images::read_files(list, spec, on_bad_row, io_error)
        }
        InputSlice::ParquetRowGroups {
            path,
            first_group,
            groups,
            first_row,
            rows,
            file_len,
        } => {
            let Layout::Parquet(layout) = layout else {
                return Err(mismatch(path));
            };
            let at = columnar::RowGroups {
                path,
                first_group: *first_group,
                groups: *groups,
                first_row: *first_row,
                file_len: *file_len,
            };
            let batch =
                columnar::read_parquet_text(at, layout, text, *rows as usize, on_bad_row, |e| {
                    io_error(path, e)
                })?;
            check_count(&batch, *rows, || {
                format!("{path} row groups {first_group}+{groups}")
            })?;
            Ok(batch)
        }
        InputSlice::CsvRange(range) | InputSlice::JsonlRange(range) => {
            let ByteRange {
                path,
                start,
                end,
                first_line,
                rows,
                file_len,
                align,
            } = range;
            let input = Input::open(Path::new(path)).map_err(|e| io_error(path, e))?;
            let len = input.len().map_err(|e| io_error(path, e))?;
            if len != *file_len {
                return Err(ItemError::poison(format!(
                    "{path} is {len} bytes but was {file_len} when the job was planned; the input changed under the job — restore it or start a new job"
                )));
            }
            if let Layout::Csv(l) = layout {
                check_header(&input, path, *file_len, l)?;
            }
            if *align {
                return read_aligned(&input, range, layout, text, on_bad_row);
            }
            let raw = input
                .read_range(*start..*end)
                .map_err(|e| io_error(path, e))?;
            let batch = match (slice, layout) {
                (InputSlice::CsvRange(_), Layout::Csv(l)) => {
                    let at = (path.as_str(), *first_line, *rows as usize);
                    parse_csv_text(raw, l, text, at, on_bad_row)?
                }
                (InputSlice::JsonlRange(_), Layout::Jsonl(l)) => {
                    let at = (path.as_str(), *first_line, *rows as usize);
                    parse_jsonl_text(raw, l, text, at, on_bad_row)?
                }
                _ => return Err(mismatch(path)),
            };
            check_count(&batch, *rows, || format!("{path} bytes {start}..{end}"))?;
            Ok(batch)
        }
    }
}

/// Reads a range cut blind: the records that start in it
/// ([`split::align`]), parsed as a scanned range is. CSV whose quoted fields
/// hold line breaks cannot be cut so; finding one is poison that says what
/// to set. Line numbers are counted from the file's start only when a row
/// is bad (to name it), by parsing again.
fn read_aligned(
    input: &Input,
    range: &ByteRange,
    layout: &Layout,
    text: Option<&TextSpec>,
    on_bad_row: OnBadRow,
) -> Result<Batch, ItemError> {
    let path = &range.path;
    let csv = match layout {
        Layout::Csv(l) => Some(l),
        Layout::Jsonl(_) => None,
        _ => {
            return Err(ItemError::poison(format!(
                "{path}: a byte range with a {} layout; the message is malformed",
                layout.describe()
            )))
        }
    };
    let aligned = split::align(input, range, csv.is_some()).map_err(|e| align_error(path, e))?;
    if csv.is_some() {
        if let Some(at) = aligned.lone_cr {
            return Err(ItemError::poison(format!(
                "{path}: byte {at} is a carriage return not followed by a line feed (old Mac line ends?), so the file cannot be cut at byte offsets; set [input] quoted_newlines = true in the manifest (the planner then reads the file to cut it) and run the job again"
            )));
        }
        if let Some(at) = split::quoted_line_break(&aligned.bytes) {
            return Err(ItemError::poison(format!(
                "{path}: the line at byte {} has an unpaired quote — a quoted field with a line break, or a stray quote — so the file cannot be cut at byte offsets; set [input] quoted_newlines = true in the manifest (the planner then reads the file to cut it) and run the job again",
                aligned.begin + at as u64
            )));
        }
    }
    let parse = |raw: Vec<u8>, first_line: u64| match (csv, layout) {
        (Some(l), _) => parse_csv_text(raw, l, text, (path, first_line, 0), on_bad_row),
        (None, Layout::Jsonl(l)) => {
            parse_jsonl_text(raw, l, text, (path, first_line, 0), on_bad_row)
        }
        _ => unreachable!("checked above"),
    };
    // Lines count from 1 at `begin`; the file's line of `begin` is read only
    // to name a bad row.
    let begin = aligned.begin;
    let base = || split::line_of(input, begin).map_err(|e| io_error(path, e));
    match parse(aligned.bytes, 1) {
        Ok(mut batch) => {
            batch.lines_from = Some(begin);
            if !batch.rejects.is_empty() {
                let base = base()?;
                for r in &mut batch.rejects {
                    r.line += base - 1;
                }
                let _ = batch.line_base.set(base);
            }
            Ok(batch)
        }
        // The item fails on a bad row: read it again to name the row's line.
        Err(_) => {
            let line = base()?;
            let again =
                split::align(input, range, csv.is_some()).map_err(|e| align_error(path, e))?;
            parse(again.bytes, line)
        }
    }
}

/// Headers of the CSV files this process has read, by path and length:
/// items of one file check it once per worker, not once per item.
type HeaderCache = std::collections::HashMap<(String, u64), std::sync::Arc<Vec<String>>>;

/// Files whose headers [`check_header`] remembers; more start it over.
const HEADERS_KEPT: usize = 4096;

/// Checks that the CSV file has the header the job was planned with
/// (validation reads a sample of the files when they are remote, so the
/// worker is where every other file is checked). A different header is
/// poison naming the file and the first column that differs; an empty expected header (an
/// item published before the check) checks nothing.
fn check_header(
    input: &Input,
    path: &str,
    file_len: u64,
    layout: &CsvLayout,
) -> Result<(), ItemError> {
    static SEEN: std::sync::OnceLock<std::sync::Mutex<HeaderCache>> = std::sync::OnceLock::new();
    if layout.header.is_empty() {
        return Ok(());
    }
    let seen = SEEN.get_or_init(Default::default);
    let key = (path.to_owned(), file_len);
    let known = seen
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
        .cloned();
    let header = match known {
        Some(h) => h,
        None => {
            let read = batchfleet_shared::columns::csv_header(input, layout.delimiter)
                .map_err(|e| align_error(path, e))?
                .unwrap_or_default();
            let read = std::sync::Arc::new(read);
            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
            if seen.len() >= HEADERS_KEPT {
                seen.clear();
            }
            seen.insert(key, read.clone());
            read
        }
    };
    if *header == layout.header {
        return Ok(());
    }
    let (got, want) = (&*header, &layout.header);
    let difference = match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => format!(
            "its column {} is \"{}\" where the job's input files have \"{}\"",
            i + 1,
            got[i],
            want[i]
        ),
        None if got.is_empty() => "it is empty".to_owned(),
        None => format!(
            "it has {} columns where the job's input files have {}",
            got.len(),
            want.len()
        ),
    };
    Err(ItemError::poison(format!(
        "{path}: the header row differs from the job's ({difference}); all input files of a job must share one header: fix the file or leave it out of the job, and run the job again"
    )))
}

/// [`io_error`], except that a range whose last record never ends
/// ([`split::MAX_PAST_END`]) is poison: reading it again would not help.
fn align_error(path: &str, e: std::io::Error) -> ItemError {
    if e.kind() == std::io::ErrorKind::InvalidData {
        ItemError::poison(format!("{path}: {e}"))
    } else {
        io_error(path, e)
    }
}

/// Poison unless the batch saw (read or rejected) the `rows` the planner counted.
fn check_count(batch: &Batch, rows: u64, what: impl Fn() -> String) -> Result<(), ItemError> {
    let seen = (batch.rows() + batch.rejects.len()) as u64;
    if seen == rows {
        return Ok(());
    }
    Err(ItemError::poison(format!(
        "{} hold {seen} rows but the planner counted {rows}; the input changed under the job",
        what()
    )))
}

/// [`read`], after checking that every file the slice reads is still the
/// version the job was planned with (`versions`, from the item; empty: not
/// checked), and, for local files, again after reading, so that an item is
/// never predicted from a file that changed under its job or mixes two
/// versions of one. A changed file is poison: every copy would meet it.
pub fn read_unchanged(
    slice: &InputSlice,
    versions: &[String],
    layout: &Layout,
    text: Option<&TextSpec>,
    on_bad_row: OnBadRow,
) -> Result<Batch, ItemError> {
    check_versions(slice, versions)?;
    let batch = read(slice, layout, text, on_bad_row)?;
    if !batchfleet_shared::source::is_url(Path::new(slice.path())) {
        check_versions(slice, versions)?;
    }
    Ok(batch)
}

/// Checks each input file of `slice` against the version it had when the
/// job was planned.
pub fn check_versions(slice: &InputSlice, versions: &[String]) -> Result<(), ItemError> {
    if versions.is_empty() {
        return Ok(());
    }
    for (path, planned) in slice.input_files().iter().zip(versions) {
        let name = path.to_string_lossy();
        let now = Input::open(path)
            .and_then(|i| i.fingerprint())
            .map_err(|e| io_error(&name, e))?;
        if now.version().as_deref() != Some(planned.as_str()) {
            return Err(ItemError::poison(format!(
                "{name}: the input changed under the job ({} when the job was planned, {} now, {} bytes); this item is not predicted from a changed file — restore the file, or run the manifest again, which starts a new job for the new data",
                describe_version(planned),
                now.version().as_deref().map_or_else(|| "no version".to_owned(), describe_version),
                now.size
            )));
        }
    }
    Ok(())
}

/// `mtime:<ns>` as "modified <time>", `etag:<e>` as "ETag <e>".
fn describe_version(v: &str) -> String {
    if let Some(ns) = v.strip_prefix("mtime:").and_then(|n| n.parse::<u64>().ok()) {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns);
        return format!("modified {}", humantime::format_rfc3339_nanos(t));
    }
    match v.strip_prefix("etag:") {
        Some(e) => format!("ETag {e}"),
        None => v.to_owned(),
    }
}

fn io_error(path: &str, e: std::io::Error) -> ItemError {
    if e.kind() == std::io::ErrorKind::NotFound {
        ItemError::poison(format!(
            "{path}: input file is gone ({e}); it was there when the job was planned"
        ))
    } else {
        ItemError::transient(format!("{path}: {e}"))
    }
}

/// Parses CSV records (no header) held in `raw` into a batch. `first_line` is
/// the file line of the first record, for messages.
pub fn parse_csv(
    raw: Vec<u8>,
    layout: &CsvLayout,
    path: &str,
    first_line: u64,
    expected_rows: usize,
    on_bad_row: OnBadRow,
) -> Result<Batch, ItemError> {
    let at = (path, first_line, expected_rows);
    parse_csv_text(raw, layout, None, at, on_bad_row)
}

/// [`parse_csv`] with the text column of text input; `(path, first_line,
/// expected_rows)` as there.
fn parse_csv_text(
    raw: Vec<u8>,
    layout: &CsvLayout,
    text: Option<&TextSpec>,
    (path, first_line, expected_rows): (&str, u64, usize),
    on_bad_row: OnBadRow,
) -> Result<Batch, ItemError> {
    let cols = layout.feature_columns.len();
    let mut batch = Batch::with_capacity(cols, expected_rows);
    batch.file = path.to_owned();
    let mut row = vec![0f32; cols];
    // Byte offset of every record (accepted or not); a record ends where the next starts.
    let mut starts: Vec<usize> = Vec::with_capacity(expected_rows + 1);
    let mut reject_records = Vec::new();
    {
        let mut rdr = csv::ReaderBuilder::new()
            .has_headers(false)
            .delimiter(layout.delimiter)
            .flexible(true) // we check field counts ourselves, to name the row
            .from_reader(raw.as_slice());
        let mut rec = csv::ByteRecord::new();
        loop {
            match rdr.read_byte_record(&mut rec) {
                Ok(false) => break,
                Ok(true) => {}
                Err(e) => {
                    let line = first_line + e.position().map_or(0, |p| p.line().saturating_sub(1));
                    return Err(ItemError::poison(format!(
                        "{path}: malformed CSV near line {line}: {e}"
                    )));
                }
            }
            let pos = rec.position().expect("csv reader sets record positions");
            let line = first_line + pos.line().saturating_sub(1);
            let record = starts.len();
            starts.push(pos.byte() as usize);
            let parsed = parse_record(&rec, layout, &mut row).and_then(|id| {
                let Some(t) = text else {
                    return Ok((id, ""));
                };
                let field = t.csv_field as usize;
                std::str::from_utf8(&rec[field])
                    .map(|s| (id, s))
                    .map_err(|_| format!("text (field {}) is not valid UTF-8", field + 1))
            });
            match parsed {
                // The span holds the record index until the ends are known.
                Ok((id, row_text)) => {
                    batch.push_row(id, &row, line, (record, 0));
                    if text.is_some() {
                        batch.push_text(row_text);
                    }
                    for &i in &layout.include_columns {
                        batch.push_extra(&String::from_utf8_lossy(&rec[i as usize]));
                    }
                }
                Err(reason) => match on_bad_row {
                    OnBadRow::FailItem => {
                        return Err(ItemError::poison(format!("{path} line {line}: {reason}")))
                    }
                    OnBadRow::Reject => {
                        reject_records.push(record);
                        batch.rejects.push(Reject {
                            file: path.to_owned(),
                            line,
                            raw: String::new(),
                            reason,
                            stage: "parse".into(),
                        });
                    }
                },
            }
        }
    }
    let span = |record: usize| {
        (
            starts[record],
            starts.get(record + 1).copied().unwrap_or(raw.len()),
        )
    };
    for s in &mut batch.spans {
        *s = span(s.0);
    }
    for (r, record) in batch.rejects.iter_mut().zip(reject_records) {
        r.raw = raw_text(&raw, span(record));
    }
    batch.raw = raw;
    Ok(batch)
}

/// Parses JSON Lines records (blank lines skipped) held in `raw` into a
/// batch. `first_line` is the file line where `raw` starts, for messages.
pub fn parse_jsonl(
    raw: Vec<u8>,
    layout: &JsonLayout,
    path: &str,
    first_line: u64,
    expected_rows: usize,
    on_bad_row: OnBadRow,
) -> Result<Batch, ItemError> {
    let at = (path, first_line, expected_rows);
    parse_jsonl_text(raw, layout, None, at, on_bad_row)
}

/// [`parse_jsonl`] with the text key of text input; `(path, first_line,
/// expected_rows)` as there.
fn parse_jsonl_text(
    raw: Vec<u8>,
    layout: &JsonLayout,
    text: Option<&TextSpec>,
    (path, first_line, expected_rows): (&str, u64, usize),
    on_bad_row: OnBadRow,
) -> Result<Batch, ItemError> {
    let cols = layout.feature_keys.len();
    let mut batch = Batch::with_capacity(cols, expected_rows);
    batch.file = path.to_owned();
    let mut row = vec![0f32; cols];
    let mut keys = JsonKeys::new(layout);
    keys.text = text.map(|t| t.column.as_str());
    let mut line = first_line;
    let mut pos = 0;
    while pos < raw.len() {
        let end = memchr::memchr(b'\n', &raw[pos..]).map_or(raw.len(), |i| pos + i + 1);
        let line_text = &raw[pos..end];
        let line_text = line_text.strip_suffix(b"\n").unwrap_or(line_text);
        let line_text = line_text.strip_suffix(b"\r").unwrap_or(line_text);
        // Blank exactly as the planner counts it: a line of spaces is a (bad) record.
        if !line_text.is_empty() {
            match keys.record(line_text.trim_ascii(), &mut row) {
                Ok(id) => {
                    batch.push_row(&id, &row, line, (pos, end));
                    for e in &keys.extras {
                        batch.push_extra(e);
                    }
                    if text.is_some() {
                        batch.push_text(&keys.text_value);
                    }
                }
                Err(reason) => match on_bad_row {
                    OnBadRow::FailItem => {
                        return Err(ItemError::poison(format!("{path} line {line}: {reason}")))
                    }
                    OnBadRow::Reject => batch.rejects.push(Reject {
                        file: path.to_owned(),
                        line,
                        raw: raw_text(&raw, (pos, end)),
                        reason,
                        stage: "parse".into(),
                    }),
                },
            }
        }
        line += 1;
        pos = end;
    }
    batch.raw = raw;
    Ok(batch)
}

/// The keys a JSON Lines reader looks for, and where each goes.
struct JsonKeys<'a> {
    layout: &'a JsonLayout,
    /// Feature key → position in the row.
    index: std::collections::HashMap<&'a str, usize>,
    /// Which features the current record has set.
    seen: Vec<bool>,
    /// Text of the include keys of the last record read.
    extras: Vec<String>,
    /// Text input: the key of the text, and its value in the last record read.
    text: Option<&'a str>,
    text_value: String,
}

impl<'a> JsonKeys<'a> {
    fn new(layout: &'a JsonLayout) -> Self {
        Self {
            layout,
            index: layout
                .feature_keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.as_str(), i))
                .collect(),
            seen: vec![false; layout.feature_keys.len()],
            extras: Vec::new(),
            text: None,
            text_value: String::new(),
        }
    }

    /// The id of one JSON object, its features written into `row`. Reads
    /// only the wanted keys straight into `row` and skips the rest; anything
    /// unusual (a bad record, escaped keys) goes to [`parse_json_value`],
    /// which gives the same result or names what is wrong. With include
    /// keys, the record is parsed whole and their text left in `extras`
    /// (a string as is, a missing key or null as empty, anything else as JSON).
    fn record(&mut self, text: &[u8], row: &mut [f32]) -> Result<String, String> {
        if !self.layout.include_keys.is_empty() || self.text.is_some() {
            let map = json_object(text)?;
            let id = record_of_map(&map, self.layout, row)?;
            if let Some(key) = self.text {
                self.text_value = match map.get(key) {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    None => return Err(format!("no key \"{key}\" (the text)")),
                    Some(other) => {
                        return Err(format!("\"{key}\" (the text) is not a string: {other}"))
                    }
                };
            }
            self.extras.clear();
            self.extras
                .extend(self.layout.include_keys.iter().map(|k| match map.get(k) {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    None | Some(serde_json::Value::Null) => String::new(),
                    Some(other) => other.to_string(),
                }));
            return Ok(id);
        }
        self.seen.iter_mut().for_each(|s| *s = false);
        let mut de = serde_json::Deserializer::from_slice(text);
        let fast = serde::de::DeserializeSeed::deserialize(
            FastRecord {
                keys: self,
                row: &mut *row,
            },
            &mut de,
        )
        .ok()
        .flatten()
        .filter(|_| de.end().is_ok());
        match fast {
            Some(id) => Ok(id),
            None => parse_json_value(text, self.layout, row),
        }
    }
}

/// One record read by [`JsonKeys::record`]'s fast path: `None` when a key is missing.
struct FastRecord<'k, 'a, 'r> {
    keys: &'k mut JsonKeys<'a>,
    row: &'r mut [f32],
}

impl<'de> serde::de::DeserializeSeed<'de> for FastRecord<'_, '_, '_> {
    type Value = Option<String>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for FastRecord<'_, '_, '_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut id = None;
        while let Some(key) = map.next_key::<&'de str>()? {
            let feature = self.keys.index.get(key).copied();
            if key == self.keys.layout.id_key {
                let value = map.next_value::<serde_json::Value>()?;
                id = match &value {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Number(n) => Some(n.to_string()),
                    _ => return Ok(None),
                };
                if let Some(i) = feature {
                    let Some(v) = value.as_f64() else {
                        return Ok(None);
                    };
                    self.row[i] = v as f32;
                    self.keys.seen[i] = true;
                }
            } else if let Some(i) = feature {
                // As for CSV: the correctly rounded f64, then f32; null is missing.
                let fill = self.keys.layout.missing.fill();
                self.row[i] = match (map.next_value::<Option<f64>>()?, fill) {
                    (Some(v), _) => v as f32,
                    (None, Some(v)) => v,
                    // The value path names the null.
                    (None, None) => return Ok(None),
                };
                self.keys.seen[i] = true;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(id.filter(|_| self.keys.seen.iter().all(|s| *s)))
    }
}

/// [`JsonKeys::record`] through a whole `serde_json::Value`: slower, and
/// names what is wrong with a bad record.
fn parse_json_value(text: &[u8], layout: &JsonLayout, row: &mut [f32]) -> Result<String, String> {
    record_of_map(&json_object(text)?, layout, row)
}

fn json_object(text: &[u8]) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| format!("not valid JSON: {e}"))?;
    match value {
        serde_json::Value::Object(map) => Ok(map),
        _ => Err("not a JSON object".into()),
    }
}

/// The id and features of a parsed JSON record, or what is wrong with it.
fn record_of_map(
    map: &serde_json::Map<String, serde_json::Value>,
    layout: &JsonLayout,
    row: &mut [f32],
) -> Result<String, String> {
    let id = match map.get(&layout.id_key) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(format!(
                "id \"{}\" is neither a string nor a number: {other}",
                layout.id_key
            ))
        }
        None => return Err(format!("no key \"{}\" (the id)", layout.id_key)),
    };
    for (slot, key) in row.iter_mut().zip(&layout.feature_keys) {
        *slot = match map.get(key) {
            // As for CSV: the correctly rounded f64, then f32.
            Some(serde_json::Value::Number(n)) => n.as_f64().map(|v| v as f32),
            Some(serde_json::Value::Null) => Some(
                layout
                    .missing
                    .fill()
                    .ok_or_else(|| format!("\"{key}\" is null; {MISSING_HINT}"))?,
            ),
            Some(_) => None,
            None => return Err(format!("no key \"{key}\" (a feature)")),
        }
        .ok_or_else(|| format!("\"{key}\" is not a number: {}", map[key]))?;
    }
    Ok(id)
}

fn parse_record<'r>(
    rec: &'r csv::ByteRecord,
    layout: &CsvLayout,
    row: &mut [f32],
) -> Result<&'r str, String> {
    if rec.len() != layout.fields as usize {
        return Err(format!(
            "expected {} fields, found {}",
            layout.fields,
            rec.len()
        ));
    }
    let id = std::str::from_utf8(&rec[layout.id_column as usize])
        .map_err(|_| format!("id (field {}) is not valid UTF-8", layout.id_column + 1))?;
    for (slot, &idx) in row.iter_mut().zip(&layout.feature_columns) {
        let raw = &rec[idx as usize];
        *slot = match numbers::parse_field(raw) {
            Some(Field::Number(v)) => v,
            Some(Field::Missing) => layout.missing.fill().ok_or_else(|| {
                let shown = String::from_utf8_lossy(raw);
                let what = if shown.trim().is_empty() {
                    "is empty".to_owned()
                } else {
                    format!("is missing ({shown:?})")
                };
                format!("field {} {what}; {MISSING_HINT}", idx + 1)
            })?,
            None => {
                return Err(format!(
                    "field {} is not a number: {:?}",
                    idx + 1,
                    String::from_utf8_lossy(raw)
                ))
            }
        };
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_shared::message::Missing;

    fn layout() -> CsvLayout {
        CsvLayout {
            delimiter: b',',
            fields: 4,
            id_column: 1,
            feature_columns: vec![3, 0],
            include_columns: Vec::new(),
            missing: Default::default(),
            header: Vec::new(),
        }
    }

    fn json_layout() -> JsonLayout {
        JsonLayout {
            id_key: "id".into(),
            feature_keys: vec!["b".into(), "a".into()],
            include_keys: Vec::new(),
            missing: Default::default(),
        }
    }

    #[test]
    fn copied_columns_follow_accepted_rows_only() {
        let csv = CsvLayout {
            include_columns: vec![2, 0],
            ..layout()
        };
        let raw = b"1.5,a,\"x, y\",2\n9,b,z,oops\n3,c,,4\n".to_vec();
        let b = parse_csv(raw, &csv, "in.csv", 2, 3, OnBadRow::Reject).unwrap();
        assert_eq!((b.rows(), b.rejects.len()), (2, 1));
        assert_eq!((b.extra(0, 0, 2), b.extra(0, 1, 2)), ("x, y", "1.5"));
        assert_eq!(
            (b.id(1), b.extra(1, 0, 2), b.extra(1, 1, 2)),
            ("c", "", "3")
        );
        let json = JsonLayout {
            include_keys: vec!["name".into(), "tags".into(), "gone".into()],
            ..json_layout()
        };
        let raw = br#"{"id": "p", "a": 1, "b": 2, "name": "Zoe", "tags": [1, "x"]}
{"id": "q", "a": "bad", "b": 2, "name": "Al"}
{"id": "r", "a": 3, "b": 4, "name": 7, "gone": null}
"#
        .to_vec();
        let b = parse_jsonl(raw, &json, "in.jsonl", 1, 3, OnBadRow::Reject).unwrap();
        assert_eq!((b.rows(), b.rejects.len()), (2, 1));
        assert_eq!(b.features, vec![2.0, 1.0, 4.0, 3.0]);
        let row = |i| {
            (0..3)
                .map(|j| b.extra(i, j, 3).to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(row(0), ["Zoe", "[1,\"x\"]", ""]);
        assert_eq!(row(1), ["7", "", ""]);
    }

    #[test]
    fn the_fast_json_path_agrees_with_the_value_path() {
        let layout = json_layout();
        let mut keys = JsonKeys::new(&layout);
        for text in [
            r#"{"id": "x", "a": 1.5, "b": -2}"#,
            r#"{"b": 3, "extra": {"nested": [1, {"a": 9}]}, "a": 2e-3, "id": 12345678901234567890}"#,
            r#"{"id": "dup", "a": 1, "a": 2, "b": 0.30000001192092896}"#,
            r#"{"id": "esc"aped", "a": 4, "b": 5}"#,
            r#"{"id": -3.5, "a": 1, "b": 18446744073709551615}"#,
            r#"{"id": "x", "a": 1, "b": 2} trailing"#,
            r#"{"id": null, "a": 1, "b": 2}"#,
            r#"{"id": "x", "a": true, "b": 2}"#,
            r#"{"a": 1, "b": 2}"#,
        ] {
            let (mut fast_row, mut slow_row) = ([0f32; 2], [0f32; 2]);
            let fast = keys.record(text.as_bytes(), &mut fast_row);
            let slow = parse_json_value(text.as_bytes(), &layout, &mut slow_row);
            assert_eq!(fast, slow, "{text}");
            if fast.is_ok() {
                assert_eq!(fast_row, slow_row, "{text}");
            }
        }
        // The id key may be a feature too.
        let both = JsonLayout {
            id_key: "a".into(),
            feature_keys: vec!["a".into(), "b".into()],
            include_keys: Vec::new(),
            missing: Default::default(),
        };
        let mut keys = JsonKeys::new(&both);
        let mut row = [0f32; 2];
        assert_eq!(
            keys.record(br#"{"a": 7, "b": 1}"#, &mut row),
            Ok("7".into())
        );
        assert_eq!(row, [7.0, 1.0]);
    }

    #[test]
    fn json_lines_parse_by_key_and_bad_records_are_rejected_with_their_line() {
        let data = concat!(
            "{\"a\": 1.5, \"id\": \"x\", \"b\": -2, \"extra\": [1]}\n",
            "\n",
            "{\"id\": 7, \"a\": 0.1, \"b\": 1e3}\r\n",
            "{\"id\": \"m\", \"a\": 1}\n",
            "{\"id\": \"s\", \"a\": \"1\", \"b\": 2}\n",
            "[1, 2]\n",
            "{\"id\": \"t\", \"a\": 3, \"b\": 4\n",
            "  \n",
            "{\"id\": \"z\", \"a\": 0.30000001192092896, \"b\": 5}",
        );
        let b = parse_jsonl(
            data.as_bytes().to_vec(),
            &json_layout(),
            "in.jsonl",
            10,
            7,
            OnBadRow::Reject,
        )
        .unwrap();
        assert_eq!(b.rows(), 3);
        assert_eq!((b.id(0), b.id(1), b.id(2)), ("x", "7", "z"));
        // Features in the layout's key order (b, a), as f64 then f32.
        assert_eq!(
            b.features,
            vec![
                -2.0,
                1.5,
                1000.0,
                0.1_f64 as f32,
                5.0,
                0.30000001192092896_f64 as f32
            ]
        );
        let rejected: Vec<(u64, &str)> = b
            .rejects
            .iter()
            .map(|r| (r.line, r.reason.as_str()))
            .collect();
        assert_eq!(rejected.len(), 5, "{rejected:?}");
        assert!(
            rejected[4].0 == 17 && rejected[4].1.starts_with("not valid JSON"),
            "{rejected:?}"
        );
        assert_eq!(rejected[0], (13, "no key \"b\" (a feature)"));
        assert_eq!(rejected[1], (14, "\"a\" is not a number: \"1\""));
        assert_eq!(rejected[2], (15, "not a JSON object"));
        assert!(
            rejected[3].0 == 16 && rejected[3].1.starts_with("not valid JSON"),
            "{rejected:?}"
        );
        assert_eq!(b.rejects[2].raw, "[1, 2]");
        assert!(b
            .rejects
            .iter()
            .all(|r| r.stage == "parse" && r.file == "in.jsonl"));
        // Failing the item instead names the file and line.
        let err = parse_jsonl(
            data.as_bytes().to_vec(),
            &json_layout(),
            "in.jsonl",
            10,
            7,
            OnBadRow::FailItem,
        )
        .unwrap_err();
        assert!(
            err.message.contains("in.jsonl line 13: no key \"b\""),
            "{}",
            err.message
        );
    }

    fn parse(data: &str, first_line: u64, on_bad_row: OnBadRow) -> Result<Batch, ItemError> {
        parse_csv(
            data.as_bytes().to_vec(),
            &layout(),
            "in/f.csv",
            first_line,
            4,
            on_bad_row,
        )
    }

    #[test]
    fn every_field_reads_as_parsing_as_f64_then_f32() {
        let number = |text: &str| match numbers::parse_field(text.as_bytes()) {
            Some(Field::Number(v)) => Some(v),
            _ => None,
        };
        let cases = [
            "0",
            "-0",
            "1",
            "0.5",
            "-3.25",
            "+7.000001",
            " 4e-1 ",
            "12345.678901",
            "0.000001",
            "123456789012345",
            "1234567890123456",
            "1.",
            ".5",
            "3.14159265358979",
            "0.1",
            "16777217",
            "-0.000000",
        ];
        for c in cases {
            let expected = c.trim().parse::<f64>().ok().map(|v| v as f32);
            assert_eq!(
                number(c).map(f32::to_bits),
                expected.map(f32::to_bits),
                "{c}"
            );
        }
        // Many random values, both as the generator writes them (6 decimals)
        // and as pandas' to_csv does (the shortest text that round-trips).
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = (x >> 11) as f64 / (1u64 << 53) as f64 * 20.0 - 10.0;
            for text in [
                format!("{v:.6}"),
                format!("{v:?}"),
                format!("{:e}", v * 1e-30),
            ] {
                let expected = text.parse::<f64>().map(|v| v as f32).expect("valid");
                assert_eq!(
                    number(&text).map(f32::to_bits),
                    Some(expected.to_bits()),
                    "{text}"
                );
            }
        }
        for bad in ["-", ".", "1.2.3", "1,5", "abc", "--1"] {
            assert_eq!(numbers::parse_field(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(number("inf"), Some(f32::INFINITY));
    }

    #[test]
    fn missing_values_follow_the_policy_in_every_text_format() {
        let raw = b"1,a,x,\n,b,x,2\nNaN,c,x,NA\n2,d,x,3\n";
        let csv = |missing| {
            let layout = CsvLayout {
                missing,
                ..layout()
            };
            parse_csv(raw.to_vec(), &layout, "in.csv", 2, 4, OnBadRow::Reject).unwrap()
        };
        let b = csv(Missing::Reject);
        assert_eq!((b.rows(), b.rejects.len()), (1, 3));
        assert_eq!(b.id(0), "d");
        assert!(
            b.rejects[0]
                .reason
                .starts_with("field 4 is empty; set [input] missing"),
            "{}",
            b.rejects[0].reason
        );
        assert!(b.rejects[2]
            .reason
            .starts_with("field 4 is missing (\"NA\")"));
        assert_eq!(b.rejects[1].line, 3);
        let b = csv(Missing::Value(-1.0));
        assert_eq!((b.rows(), b.rejects.len()), (4, 0));
        assert_eq!(b.features, vec![-1.0, 1.0, 2.0, -1.0, -1.0, -1.0, 3.0, 2.0]);
        let b = csv(Missing::Nan);
        assert_eq!(b.features.iter().filter(|v| v.is_nan()).count(), 4);

        let raw = br#"{"id": "p", "a": null, "b": 2}
{"id": "q", "a": 1, "b": null}
{"id": "r", "a": 1}
"#;
        let jsonl = |missing| {
            let layout = JsonLayout {
                missing,
                ..json_layout()
            };
            parse_jsonl(raw.to_vec(), &layout, "in.jsonl", 1, 3, OnBadRow::Reject).unwrap()
        };
        let b = jsonl(Missing::Reject);
        assert_eq!((b.rows(), b.rejects.len()), (0, 3));
        assert!(b.rejects[0]
            .reason
            .starts_with("\"a\" is null; set [input] missing"));
        // An absent key is a malformed record, not a missing value.
        assert_eq!(b.rejects[2].reason, "no key \"b\" (a feature)");
        let b = jsonl(Missing::Value(0.5));
        assert_eq!((b.rows(), b.rejects.len()), (2, 1));
        assert_eq!(b.features, vec![2.0, 0.5, 0.5, 1.0]);
    }

    #[test]
    fn parses_rows_into_contiguous_features_in_column_order() {
        let b = parse("1.5,a,x,2\n-3,\"b,c\",y, 4e-1 \n", 2, OnBadRow::FailItem).unwrap();
        assert_eq!(b.rows(), 2);
        assert_eq!(b.features, vec![2.0, 1.5, 0.4, -3.0]);
        assert_eq!((b.id(0), b.id(1)), ("a", "b,c"));
        let r = b.model_reject(1, "boom");
        assert_eq!(
            (r.line, r.raw.as_str(), r.stage.as_str()),
            (3, "-3,\"b,c\",y, 4e-1 ", "model")
        );
    }

    #[test]
    fn bad_rows_fail_the_item_naming_file_line_and_field() {
        let err = parse("1,a,x,2\n1,b,x,zz\n", 10, OnBadRow::FailItem).unwrap_err();
        assert_eq!(err.class, crate::error::FailureClass::Poison);
        assert!(
            err.message
                .contains("in/f.csv line 11: field 4 is not a number: \"zz\""),
            "{}",
            err.message
        );
        let err = parse("1,a,x\n", 2, OnBadRow::FailItem).unwrap_err();
        assert!(
            err.message.contains("line 2: expected 4 fields, found 3"),
            "{}",
            err.message
        );
    }

    #[test]
    fn bad_rows_are_rejected_with_raw_text_and_the_rest_parsed() {
        let b = parse(
            "1,a,x,2\n1,b,x,zz\n\"q\nr\",c,x\n5,d,x,6",
            2,
            OnBadRow::Reject,
        )
        .unwrap();
        assert_eq!((b.rows(), b.id(0), b.id(1)), (2, "a", "d"));
        assert_eq!(b.features, vec![2.0, 1.0, 6.0, 5.0]);
        let got: Vec<(u64, &str)> = b.rejects.iter().map(|r| (r.line, r.raw.as_str())).collect();
        assert_eq!(got, vec![(3, "1,b,x,zz"), (4, "\"q\nr\",c,x")]);
        assert!(b.rejects[1].reason.contains("expected 4 fields, found 3"));
        assert_eq!(b.model_reject(1, "m").raw, "5,d,x,6");
    }

    #[test]
    fn reads_a_byte_range_and_detects_changed_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("in.csv");
        let content = "h1,h2,h3,h4\n1,a,x,2\n3,b,y,4\n5,c,z,6\n";
        std::fs::write(&p, content).unwrap();
        let path = p.to_string_lossy().into_owned();
        let slice = |rows, file_len| {
            InputSlice::CsvRange(ByteRange {
                path: path.clone(),
                start: 20,
                end: 28,
                first_line: 3,
                rows,
                file_len,
                align: false,
            })
        };
        let b = read(
            &slice(1, content.len() as u64),
            &Layout::Csv(layout()),
            None,
            OnBadRow::Reject,
        )
        .unwrap();
        assert_eq!((b.id(0), b.features.as_slice()), ("b", &[4.0, 3.0][..]));
        let err = read(
            &slice(2, content.len() as u64),
            &Layout::Csv(layout()),
            None,
            OnBadRow::Reject,
        )
        .unwrap_err();
        assert!(err.message.contains("planner counted 2"), "{}", err.message);
        let err = read(&slice(1, 5), &Layout::Csv(layout()), None, OnBadRow::Reject).unwrap_err();
        assert!(err.message.contains("input changed"), "{}", err.message);
    }

    /// A range cut blind at `start..end` of the file at `path`.
    fn blind(path: &std::path::Path, start: u64, end: u64) -> InputSlice {
        let file_len = std::fs::metadata(path).unwrap().len();
        InputSlice::CsvRange(ByteRange {
            path: path.to_string_lossy().into_owned(),
            start,
            end,
            first_line: 0,
            rows: 0,
            file_len,
            align: true,
        })
    }

    #[test]
    fn blind_ranges_read_the_records_starting_in_them_and_name_file_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("in.csv");
        // Header, then rows 0..9 on lines 2..11; row 6 (line 8) is bad.
        let mut text = "f0,id,x,f3\n".to_owned();
        for i in 0..10 {
            let f3 = if i == 6 {
                "oops".to_owned()
            } else {
                i.to_string()
            };
            text.push_str(&format!("{i}.5,r{i},\"q, {i}\",{f3}\n"));
        }
        std::fs::write(&p, &text).unwrap();
        let len = text.len() as u64;
        let csv = Layout::Csv(layout());
        // Three cuts at arbitrary offsets: every row once, in order.
        let (a, b) = (len / 3, 2 * len / 3);
        let mut ids = Vec::new();
        let mut rejects = Vec::new();
        for (s, e) in [(0, a), (a, b), (b, len)] {
            let batch = read(&blind(&p, s, e), &csv, None, OnBadRow::Reject).unwrap();
            ids.extend((0..batch.rows()).map(|i| batch.id(i).to_owned()));
            rejects.extend(batch.rejects.iter().map(|r| (r.line, r.raw.clone())));
            // A model reject of any row names its line in the file.
            for i in 0..batch.rows() {
                let n: u64 = batch.id(i)[1..].parse().unwrap();
                assert_eq!(batch.model_reject(i, "m").line, n + 2, "{}", batch.id(i));
            }
        }
        let want: Vec<String> = (0..10)
            .filter(|i| *i != 6)
            .map(|i| format!("r{i}"))
            .collect();
        assert_eq!(ids, want);
        assert_eq!(rejects, vec![(8, "6.5,r6,\"q, 6\",oops".to_owned())]);
        // fail_item names the line too.
        let at = text.find("6.5,").unwrap() as u64;
        let err = read(&blind(&p, at - 1, len), &csv, None, OnBadRow::FailItem).unwrap_err();
        assert!(
            err.message
                .contains("in.csv line 8: field 4 is not a number"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_quoted_line_break_in_a_blind_range_is_poison_saying_what_to_set() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("in.csv");
        let text = "f0,id,x,f3\n1,a,\"two\nlines\",2\n3,b,c,4\n";
        std::fs::write(&p, text).unwrap();
        let len = text.len() as u64;
        // Whether the range starts before, inside or after the field.
        for start in [0, 15, 20] {
            let err = read(
                &blind(&p, start, len),
                &Layout::Csv(layout()),
                None,
                OnBadRow::Reject,
            )
            .unwrap_err();
            assert_eq!(err.class, crate::error::FailureClass::Poison);
            assert!(
                err.message.contains("set [input] quoted_newlines = true"),
                "{start}: {}",
                err.message
            );
        }
    }

    #[test]
    fn a_file_whose_header_differs_from_the_jobs_is_poison_for_every_range_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = (dir.path().join("good.csv"), dir.path().join("bad.csv"));
        std::fs::write(&good, "f0,id,x,f3\n1,a,b,2\n3,c,d,4\n").unwrap();
        // The same width, two columns swapped: read blind, f0 and f3 would
        // be taken from the wrong fields.
        std::fs::write(&bad, "f3,id,x,f0\n1,a,b,2\n3,c,d,4\n").unwrap();
        let checked = Layout::Csv(CsvLayout {
            header: ["f0", "id", "x", "f3"].map(String::from).to_vec(),
            ..layout()
        });
        let len = std::fs::metadata(&good).unwrap().len();
        assert_eq!(
            read(&blind(&good, 0, len), &checked, None, OnBadRow::Reject)
                .unwrap()
                .rows(),
            2
        );
        // Every range of the file, not only the one holding its header.
        for start in [0, 15] {
            let err = read(&blind(&bad, start, len), &checked, None, OnBadRow::Reject).unwrap_err();
            assert_eq!(err.class, crate::error::FailureClass::Poison);
            assert!(
                err.message.contains("bad.csv: the header row differs from the job's (its column 1 is \"f3\" where the job's input files have \"f0\")"),
                "{}",
                err.message
            );
        }
        // An item published before the check (no header in its layout) reads on.
        let unchecked = Layout::Csv(layout());
        assert_eq!(
            read(&blind(&bad, 0, len), &unchecked, None, OnBadRow::Reject)
                .unwrap()
                .rows(),
            2
        );
    }
}
