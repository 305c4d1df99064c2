//! Reads the rows of a Parquet work item: its run of row groups, only the id
//! and feature columns (column projection), decoded by the Arrow reader and
//! copied into the same row-major batch the text formats produce.
//!
//! A row with a null id is a bad row (rejected or failing the item, per
//! `on_bad_row`), and so is a null feature unless `[input] missing` gives
//! it a value; its `raw` text is the row's values as a JSON
//! object, and its `line` is the 1-based row number in the file.

use crate::batch::{Batch, Reject, MISSING_HINT};
use crate::error::ItemError;
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::DataType;
use batchfleet_shared::message::{OnBadRow, ParquetLayout, TextSpec};
use batchfleet_shared::source::Input;
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ProjectionMask;

/// Rows decoded per Arrow record batch.
const DECODE_ROWS: usize = 8192;

/// Where one item's rows are: row groups `[first_group, first_group + groups)` of `path`.
#[derive(Debug, Clone, Copy)]
pub struct RowGroups<'a> {
    /// The file.
    pub path: &'a str,
    /// Index of the first row group.
    pub first_group: u32,
    /// Number of row groups.
    pub groups: u32,
    /// 0-based file row of the first row.
    pub first_row: u64,
    /// File length when planned.
    pub file_len: u64,
}

/// Reads the item's rows. A file that changed since planning (length, row
/// groups or columns) or does not decode is poison.
#[cfg(test)]
pub fn read_parquet(
    at: RowGroups<'_>,
    layout: &ParquetLayout,
    expected_rows: usize,
    on_bad_row: OnBadRow,
    io_error: impl Fn(std::io::Error) -> ItemError,
) -> Result<Batch, ItemError> {
    read_parquet_text(at, layout, None, expected_rows, on_bad_row, io_error)
}

/// Reads the item's rows, with the text column of text input (a row whose
/// text is null or not a string is a bad row). A file that changed since
/// planning (length, row groups or columns) or does not decode is poison.
pub fn read_parquet_text(
    at: RowGroups<'_>,
    layout: &ParquetLayout,
    text: Option<&TextSpec>,
    expected_rows: usize,
    on_bad_row: OnBadRow,
    io_error: impl Fn(std::io::Error) -> ItemError,
) -> Result<Batch, ItemError> {
    let path = at.path;
    let changed = |what: String| {
        ItemError::poison(format!(
            "{path}: {what}; the input changed under the job — restore it or start a new job"
        ))
    };
    let undecodable = |e: &dyn std::fmt::Display| {
        ItemError::poison(format!("{path}: cannot decode Parquet: {e}"))
    };
    let text_column = text.map(|t| &t.column);
    let reader = open(&at, layout, text_column, &changed, &undecodable, &io_error)?;
    let cols = layout.feature_columns.len();
    let mut batch = Batch::with_capacity(cols, expected_rows);
    batch.file = path.to_owned();
    let mut next_row = at.first_row;
    let mut values = Vec::new();
    let mut id = String::new();
    for rb in reader {
        let rb = rb.map_err(|e| undecodable(&e))?;
        let columns = Columns::of(&rb, layout, text_column, &changed)?;
        let n = rb.num_rows();
        // Column by column into a row-major block; nulls are found per row below.
        values.clear();
        values.resize(n * cols, 0f32);
        for (j, (name, col)) in layout
            .feature_columns
            .iter()
            .zip(&columns.features)
            .enumerate()
        {
            fill_column(col, &mut values, cols, j)
                .map_err(|t| changed(format!("feature column {name} is {t}, not a number")))?;
        }
        for r in 0..n {
            let line = next_row + r as u64 + 1;
            let row = &mut values[r * cols..(r + 1) * cols];
            match columns.row(r, layout, text_column, row, &mut id) {
                Ok(row_text) => {
                    batch.push_row(&id, row, line, (0, 0));
                    for col in &columns.includes {
                        batch.push_extra(&cell_text(col, r));
                    }
                    if columns.texts.is_some() {
                        batch.push_text(&row_text);
                    }
                }
                Err(reason) => match on_bad_row {
                    OnBadRow::FailItem => {
                        return Err(ItemError::poison(format!("{path} row {line}: {reason}")))
                    }
                    OnBadRow::Reject => batch.rejects.push(Reject {
                        file: path.to_owned(),
                        line,
                        raw: row_json(&rb, r),
                        reason,
                        stage: "parse".into(),
                    }),
                },
            }
        }
        next_row += n as u64;
    }
    Ok(batch)
}

/// A reader of the item's row groups, projected to the id, feature,
/// copied and text columns, after checking the file is the one planned
/// (its length, its row groups, its columns).
fn open(
    at: &RowGroups<'_>,
    layout: &ParquetLayout,
    text_column: Option<&String>,
    changed: &dyn Fn(String) -> ItemError,
    undecodable: &dyn Fn(&dyn std::fmt::Display) -> ItemError,
    io_error: &dyn Fn(std::io::Error) -> ItemError,
) -> Result<ParquetRecordBatchReader, ItemError> {
    let file = Input::open(std::path::Path::new(at.path)).map_err(io_error)?;
    let len = file.len().map_err(io_error)?;
    if len != at.file_len {
        return Err(changed(format!(
            "is {len} bytes but was {} when the job was planned",
            at.file_len
        )));
    }
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| undecodable(&e))?;
    let groups = at.first_group as usize..(at.first_group + at.groups) as usize;
    if groups.end > builder.metadata().num_row_groups() {
        return Err(changed(format!(
            "has {} row groups, not the {} planned",
            builder.metadata().num_row_groups(),
            groups.end
        )));
    }
    let schema = builder.schema().clone();
    let mut roots = Vec::with_capacity(layout.feature_columns.len() + 1);
    for name in std::iter::once(&layout.id_column)
        .chain(&layout.feature_columns)
        .chain(&layout.include_columns)
        .chain(text_column)
    {
        roots.push(
            schema
                .index_of(name)
                .map_err(|_| changed(format!("has no column {name}")))?,
        );
    }
    roots.sort_unstable();
    roots.dedup();
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    builder
        .with_projection(mask)
        .with_row_groups(groups.collect())
        .with_batch_size(DECODE_ROWS)
        .build()
        .map_err(|e| undecodable(&e))
}

/// The columns of one decoded record batch that an item reads.
struct Columns {
    ids: ArrayRef,
    features: Vec<ArrayRef>,
    includes: Vec<ArrayRef>,
    texts: Option<ArrayRef>,
}

impl Columns {
    fn of(
        rb: &RecordBatch,
        layout: &ParquetLayout,
        text_column: Option<&String>,
        changed: &dyn Fn(String) -> ItemError,
    ) -> Result<Self, ItemError> {
        let column = |name: &str| {
            rb.column_by_name(name)
                .cloned()
                .ok_or_else(|| changed(format!("has no column {name}")))
        };
        let all = |names: &[String]| -> Result<Vec<ArrayRef>, ItemError> {
            names.iter().map(|n| column(n)).collect()
        };
        Ok(Self {
            ids: column(&layout.id_column)?,
            features: all(&layout.feature_columns)?,
            includes: all(&layout.include_columns)?,
            texts: text_column.map(|n| column(n)).transpose()?,
        })
    }

    /// Row `r`'s text (empty without text input), its id into `id` and
    /// its missing features filled into `row`; or why it is a bad row (a
    /// null id, feature or text, an id of another type).
    fn row(
        &self,
        r: usize,
        layout: &ParquetLayout,
        text_column: Option<&String>,
        row: &mut [f32],
        id: &mut String,
    ) -> Result<String, String> {
        if self.ids.is_null(r) {
            return Err(format!("column {} is null", layout.id_column));
        }
        for (j, (name, col)) in layout
            .feature_columns
            .iter()
            .zip(&self.features)
            .enumerate()
        {
            if col.is_null(r) {
                match layout.missing.fill() {
                    Some(v) => row[j] = v,
                    None => return Err(format!("column {name} is null; {MISSING_HINT}")),
                }
            }
        }
        let text = match &self.texts {
            Some(col) => {
                let name = text_column.map_or("", |c| c.as_str());
                match cell_json(col, r) {
                    serde_json::Value::String(s) => s,
                    serde_json::Value::Null => {
                        return Err(format!("column {name} (the text) is null"))
                    }
                    other => {
                        return Err(format!("column {name} (the text) is not a string: {other}"))
                    }
                }
            }
            None => String::new(),
        };
        id.clear();
        id_text(&self.ids, r, id).map_err(|t| {
            format!(
                "id column {} is {t}, not a string or integer",
                layout.id_column
            )
        })?;
        Ok(text)
    }
}

/// Writes column `j` of a row-major block of `cols` columns as `f32`
/// (through `f64`, as text input is read); the column's type if it is not numeric.
fn fill_column(col: &ArrayRef, out: &mut [f32], cols: usize, j: usize) -> Result<(), DataType> {
    macro_rules! fill {
        ($t:ty) => {
            for (slot, v) in out
                .iter_mut()
                .skip(j)
                .step_by(cols)
                .zip(col.as_primitive::<$t>().values().iter())
            {
                *slot = (*v as f64) as f32;
            }
        };
    }
    match col.data_type() {
        DataType::Float32 => fill!(Float32Type),
        DataType::Float64 => fill!(Float64Type),
        DataType::Int8 => fill!(Int8Type),
        DataType::Int16 => fill!(Int16Type),
        DataType::Int32 => fill!(Int32Type),
        DataType::Int64 => fill!(Int64Type),
        DataType::UInt8 => fill!(UInt8Type),
        DataType::UInt16 => fill!(UInt16Type),
        DataType::UInt32 => fill!(UInt32Type),
        DataType::UInt64 => fill!(UInt64Type),
        other => return Err(other.clone()),
    }
    Ok(())
}

/// Appends the text of id `r` (a string, or an integer in decimal) to `out`.
fn id_text(col: &ArrayRef, r: usize, out: &mut String) -> Result<(), DataType> {
    use std::fmt::Write;
    macro_rules! int {
        ($t:ty) => {{
            let _ = write!(out, "{}", col.as_primitive::<$t>().value(r));
        }};
    }
    match col.data_type() {
        DataType::Utf8 => out.push_str(col.as_string::<i32>().value(r)),
        DataType::LargeUtf8 => out.push_str(col.as_string::<i64>().value(r)),
        DataType::Utf8View => out.push_str(col.as_string_view().value(r)),
        DataType::Int8 => int!(Int8Type),
        DataType::Int16 => int!(Int16Type),
        DataType::Int32 => int!(Int32Type),
        DataType::Int64 => int!(Int64Type),
        DataType::UInt8 => int!(UInt8Type),
        DataType::UInt16 => int!(UInt16Type),
        DataType::UInt32 => int!(UInt32Type),
        DataType::UInt64 => int!(UInt64Type),
        other => return Err(other.clone()),
    }
    Ok(())
}

/// The text of a copied column's value: strings as they are, numbers in
/// their shortest form, null as empty, other types as JSON.
fn cell_text(col: &ArrayRef, r: usize) -> String {
    match cell_json(col, r) {
        serde_json::Value::String(s) => s,
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Row `r` of the projected columns as a JSON object (nulls as `null`), for
/// a rejects file.
fn row_json(rb: &RecordBatch, r: usize) -> String {
    let mut map = serde_json::Map::new();
    for (field, col) in rb.schema().fields().iter().zip(rb.columns()) {
        let value = cell_json(col, r);
        map.insert(field.name().clone(), value);
    }
    serde_json::Value::Object(map).to_string()
}

/// One value as JSON (nulls as `null`, other types as `"<type>"`).
fn cell_json(col: &ArrayRef, r: usize) -> serde_json::Value {
    if col.is_null(r) {
        serde_json::Value::Null
    } else {
        let float = |v: f64| {
            serde_json::Number::from_f64(v)
                .map_or_else(|| v.to_string().into(), serde_json::Value::Number)
        };
        match col.data_type() {
            DataType::Float64 => float(col.as_primitive::<Float64Type>().value(r)),
            DataType::Float32 => {
                // The float32's own shortest text, not its f64 expansion.
                let v = col.as_primitive::<Float32Type>().value(r);
                serde_json::from_str(ryu::Buffer::new().format(v))
                    .unwrap_or_else(|_| v.to_string().into())
            }
            DataType::Boolean => serde_json::Value::Bool(col.as_boolean().value(r)),
            t => {
                let mut text = String::new();
                match id_text(col, r, &mut text) {
                    Ok(()) if t.is_integer() => {
                        serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text))
                    }
                    Ok(()) => serde_json::Value::String(text),
                    Err(t) => serde_json::Value::String(format!("<{t}>")),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_testkit::fixtures::{f64_column, string_column, write_parquet};
    use std::sync::Arc;

    fn layout() -> ParquetLayout {
        ParquetLayout {
            id_column: "id".into(),
            feature_columns: vec!["b".into(), "a".into()],
            include_columns: Vec::new(),
            missing: Default::default(),
        }
    }

    /// 12 rows in row groups of 4: id "r<i>" (null at 6), a = i / 2 (null
    /// at 9), b = 100 - i as int32, and a string column nobody reads.
    fn file() -> (tempfile::TempDir, String, u64) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.parquet");
        let ids: Vec<Option<String>> = (0..12).map(|i| (i != 6).then(|| format!("r{i}"))).collect();
        let a = f64_column((0..12).map(|i| (i != 9).then_some(f64::from(i) / 2.0)));
        let b: ArrayRef = Arc::new(arrow_array::Int32Array::from_iter_values(
            (0..12).map(|i| 100 - i),
        ));
        let note = string_column((0..12).map(|i| Some(format!("n{i}"))));
        write_parquet(
            &p,
            vec![
                ("note", note),
                ("a", a),
                ("id", string_column(ids)),
                ("b", b),
            ],
            4,
        )
        .unwrap();
        let len = std::fs::metadata(&p).unwrap().len();
        (dir, p.to_string_lossy().into_owned(), len)
    }

    fn at(path: &str, first_group: u32, groups: u32, file_len: u64) -> RowGroups<'_> {
        RowGroups {
            path,
            first_group,
            groups,
            first_row: u64::from(first_group) * 4,
            file_len,
        }
    }

    fn io(e: std::io::Error) -> ItemError {
        ItemError::transient(e.to_string())
    }

    #[test]
    fn reads_only_its_row_groups_in_layout_order_and_rejects_nulls() {
        let (_d, path, len) = file();
        let b = read_parquet(at(&path, 1, 2, len), &layout(), 8, OnBadRow::Reject, io).unwrap();
        let ids: Vec<&str> = (0..b.rows()).map(|i| b.id(i)).collect();
        assert_eq!(ids, ["r4", "r5", "r7", "r8", "r10", "r11"]);
        assert_eq!(b.cols, 2);
        // Row r5: b = 95 (an integer column), a = 2.5.
        assert_eq!(&b.features[2..4], &[95.0, 2.5]);
        assert_eq!(b.rejects.len(), 2);
        assert_eq!((b.rejects[0].line, b.rejects[1].line), (7, 10));
        assert_eq!(b.rejects[0].reason, "column id is null");
        assert!(
            b.rejects[1]
                .reason
                .starts_with("column a is null; set [input] missing"),
            "{}",
            b.rejects[1].reason
        );
        let raw: serde_json::Value = serde_json::from_str(&b.rejects[1].raw).unwrap();
        assert_eq!(raw, serde_json::json!({"a": null, "id": "r9", "b": 91}));
        // With a fill value the null feature takes it; a null id is still bad.
        let filled = ParquetLayout {
            missing: batchfleet_shared::message::Missing::Value(-2.0),
            ..layout()
        };
        let b = read_parquet(at(&path, 1, 2, len), &filled, 8, OnBadRow::Reject, io).unwrap();
        assert_eq!((b.rows(), b.rejects.len()), (7, 1));
        assert_eq!(b.id(4), "r9");
        assert_eq!(&b.features[8..10], &[91.0, -2.0]);
        // A model reject of a Parquet row names it by id.
        assert_eq!(b.model_reject(1, "boom").raw, "r5");
        // Copied columns (a string and an integer) come with accepted rows only.
        let copy = ParquetLayout {
            include_columns: vec!["note".into(), "b".into()],
            ..layout()
        };
        let b = read_parquet(at(&path, 1, 2, len), &copy, 8, OnBadRow::Reject, io).unwrap();
        let row = |i| (b.extra(i, 0, 2).to_owned(), b.extra(i, 1, 2).to_owned());
        assert_eq!(row(0), ("n4".to_owned(), "96".to_owned()));
        assert_eq!(row(5), ("n11".to_owned(), "89".to_owned()));
    }

    #[test]
    fn fail_item_names_the_row_and_changed_files_are_poison() {
        let (_d, path, len) = file();
        let e =
            read_parquet(at(&path, 2, 1, len), &layout(), 4, OnBadRow::FailItem, io).unwrap_err();
        assert!(
            e.message.contains("row 10: column a is null"),
            "{}",
            e.message
        );
        let e =
            read_parquet(at(&path, 0, 1, len + 1), &layout(), 4, OnBadRow::Reject, io).unwrap_err();
        assert!(
            e.message.contains("the input changed under the job"),
            "{}",
            e.message
        );
        let e = read_parquet(at(&path, 2, 2, len), &layout(), 4, OnBadRow::Reject, io).unwrap_err();
        assert!(
            e.message.contains("has 3 row groups, not the 4 planned"),
            "{}",
            e.message
        );
        let mut missing = layout();
        missing.feature_columns.push("zz".into());
        let e = read_parquet(at(&path, 0, 1, len), &missing, 4, OnBadRow::Reject, io).unwrap_err();
        assert!(e.message.contains("has no column zz"), "{}", e.message);
        let mut text_feature = layout();
        text_feature.feature_columns.push("note".into());
        let e =
            read_parquet(at(&path, 0, 1, len), &text_feature, 4, OnBadRow::Reject, io).unwrap_err();
        assert!(
            e.message.contains("feature column note is Utf8"),
            "{}",
            e.message
        );
    }

    #[test]
    fn integer_ids_read_as_decimal_text() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("i.parquet");
        let id: ArrayRef = Arc::new(arrow_array::UInt64Array::from(vec![u64::MAX, 7]));
        write_parquet(
            &p,
            vec![
                ("id", id),
                ("a", f64_column([Some(1.0), Some(2.0)])),
                ("b", f64_column([Some(0.1), None])),
            ],
            10,
        )
        .unwrap();
        let path = p.to_string_lossy();
        let len = std::fs::metadata(&p).unwrap().len();
        let b = read_parquet(at(&path, 0, 1, len), &layout(), 2, OnBadRow::Reject, io).unwrap();
        assert_eq!(b.id(0), u64::MAX.to_string());
        assert_eq!(b.features, vec![0.1f64 as f32, 1.0]);
        assert_eq!(b.rejects[0].raw, r#"{"id":7,"a":2.0,"b":null}"#);
    }
}
