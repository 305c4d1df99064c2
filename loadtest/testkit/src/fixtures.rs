//! Small input files for tests, written from Rust where the test needs
//! control the Python generator does not give (types, nulls, row groups).

use anyhow::{Context, Result};
use arrow_array::{ArrayRef, RecordBatch};
use std::path::Path;
use std::sync::Arc;

/// Writes `columns` (name, array; all the same length) to a Parquet file at
/// `path` with row groups of at most `row_group_rows` rows (snappy).
pub fn write_parquet(
    path: &Path,
    columns: Vec<(&str, ArrayRef)>,
    row_group_rows: usize,
) -> Result<()> {
    let batch = RecordBatch::try_from_iter(columns).context("columns of one length")?;
    let props = parquet::file::properties::WriterProperties::builder()
        .set_max_row_group_row_count(Some(row_group_rows.max(1)))
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let file = std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props))?;
    w.write(&batch)?;
    w.close()?;
    Ok(())
}

/// An `f64` column.
pub fn f64_column(values: impl IntoIterator<Item = Option<f64>>) -> ArrayRef {
    Arc::new(arrow_array::Float64Array::from_iter(values))
}

/// A string column.
pub fn string_column<S: AsRef<str>>(values: impl IntoIterator<Item = Option<S>>) -> ArrayRef {
    Arc::new(arrow_array::StringArray::from_iter(values))
}
