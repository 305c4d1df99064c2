//! Part files as tables, in each output format: written row by row by a
//! worker, read back (rows counted, scores histogrammed, checked) by workers,
//! the coordinator and tests, and concatenated into the merged output.
//!
//! - `csv`: a header row, then one record per row; text as is (quoted when
//!   needed), floats in their shortest round-trip form (`ryu`), `NaN` as `NaN`.
//! - `jsonl`: one JSON object per row, keys in column order; a float that is
//!   not finite is `null`.
//! - `parquet`: one row group per part (per 64k rows), snappy; text columns
//!   `Utf8`, floats `Float32`, integers `Int64`, vectors
//!   `FixedSizeList<Float32>`. Readers see one table.
//!
//! A vector column (an embedding per row) is a JSON array in `jsonl`, a
//! fixed-size list in `parquet`, and `D` columns `<name>_0 … <name>_{D-1}`
//! in `csv`.

use crate::message::OutputFormat;
use crate::source::Input;
use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, Int64Builder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use std::io::{self, BufRead, Write};
use std::path::Path;
use std::sync::Arc;

/// What a column holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Text (ids, labels, copied input columns).
    Text,
    /// 32-bit floats (scores).
    Float,
    /// Integers (class indices).
    Int,
    /// A fixed number of 32-bit floats (an embedding).
    Vector(u32),
}

/// One value written to a part file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cell<'a> {
    /// Text.
    Text(&'a str),
    /// A float.
    Float(f32),
    /// An integer.
    Int(i64),
    /// A vector of floats (as many as the column's [`Kind::Vector`]).
    Vector(&'a [f32]),
    /// No value (an empty CSV field, JSON `null`, a Parquet null).
    Null,
}

/// One value read back from a part file.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Text.
    Text(String),
    /// A number.
    Number(f64),
    /// A vector (JSON array, Parquet list; a `null` element is NaN).
    Vector(Vec<f64>),
    /// Empty (JSON `null`, Parquet null).
    Null,
}

impl Value {
    /// The value as a number, if it is one (CSV text that parses as one counts).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Number(v) => Some(*v),
            Value::Text(t) => t.parse().ok(),
            Value::Vector(_) | Value::Null => None,
        }
    }

    /// The value as text (numbers in their shortest form).
    pub fn text(&self) -> String {
        match self {
            Value::Text(t) => t.clone(),
            Value::Number(v) if v.fract() == 0.0 && v.abs() < 1e15 => format!("{}", *v as i64),
            Value::Number(v) => v.to_string(),
            Value::Vector(v) => serde_json::to_string(v).unwrap_or_default(),
            Value::Null => String::new(),
        }
    }
}

/// Rows per Parquet row group (and per Arrow batch when reading).
const PARQUET_ROWS: usize = 65_536;

/// Writes rows of fixed columns to a part file in one of the output formats.
pub struct PartWriter<'w, W: Write + Send> {
    inner: Sink<'w, W>,
    names: Vec<String>,
    kinds: Vec<Kind>,
}

impl<W: Write + Send> std::fmt::Debug for PartWriter<'_, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartWriter")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

enum Sink<'w, W: Write + Send> {
    Csv(Box<csv::Writer<&'w mut W>>, ryu::Buffer),
    Jsonl(&'w mut W, ryu::Buffer),
    Parquet(Box<ParquetSink<'w, W>>),
}

struct ParquetSink<'w, W: Write + Send> {
    writer: parquet::arrow::ArrowWriter<&'w mut W>,
    schema: Arc<Schema>,
    columns: Vec<Builder>,
    rows: usize,
}

enum Builder {
    Text(StringBuilder),
    Float(Float32Builder),
    Int(Int64Builder),
    Vector(FixedSizeListBuilder<Float32Builder>),
}

impl<'w, W: Write + Send> PartWriter<'w, W> {
    /// Starts a part file with these columns (the CSV header is written now).
    pub fn new(
        w: &'w mut W,
        format: OutputFormat,
        names: Vec<String>,
        kinds: Vec<Kind>,
    ) -> io::Result<Self> {
        assert_eq!(names.len(), kinds.len(), "a kind per column");
        let inner = match format {
            OutputFormat::Csv => {
                let mut csv = csv::WriterBuilder::new().from_writer(w);
                let mut header = Vec::with_capacity(names.len());
                for (n, k) in names.iter().zip(&kinds) {
                    match k {
                        Kind::Vector(d) => header.extend((0..*d).map(|i| format!("{n}_{i}"))),
                        _ => header.push(n.clone()),
                    }
                }
                csv.write_record(&header)?;
                Sink::Csv(Box::new(csv), ryu::Buffer::new())
            }
            OutputFormat::Jsonl => Sink::Jsonl(w, ryu::Buffer::new()),
            OutputFormat::Parquet => {
                let fields: Vec<Field> = names
                    .iter()
                    .zip(&kinds)
                    .map(|(n, k)| {
                        let t = match k {
                            Kind::Text => DataType::Utf8,
                            Kind::Float => DataType::Float32,
                            Kind::Int => DataType::Int64,
                            Kind::Vector(d) => vector_type(*d),
                        };
                        Field::new(n, t, true)
                    })
                    .collect();
                let schema = Arc::new(Schema::new(fields));
                let props = parquet::file::properties::WriterProperties::builder()
                    .set_compression(parquet::basic::Compression::SNAPPY)
                    .set_max_row_group_row_count(Some(PARQUET_ROWS))
                    .build();
                let writer = parquet::arrow::ArrowWriter::try_new(w, schema.clone(), Some(props))
                    .map_err(io::Error::other)?;
                let columns = kinds.iter().map(|k| builder(*k)).collect();
                Sink::Parquet(Box::new(ParquetSink {
                    writer,
                    schema,
                    columns,
                    rows: 0,
                }))
            }
        };
        Ok(Self {
            inner,
            names,
            kinds,
        })
    }

    /// Writes one row: a cell per column, of the column's kind.
    pub fn row(&mut self, cells: &[Cell<'_>]) -> io::Result<()> {
        debug_assert_eq!(cells.len(), self.names.len());
        match &mut self.inner {
            Sink::Csv(csv, fmt) => {
                for (cell, kind) in cells.iter().zip(&self.kinds) {
                    match cell {
                        Cell::Null => match kind {
                            Kind::Vector(d) => {
                                for _ in 0..*d {
                                    csv.write_field("")?;
                                }
                            }
                            _ => csv.write_field("")?,
                        },
                        Cell::Text(t) => csv.write_field(t)?,
                        Cell::Float(v) => csv.write_field(fmt.format(*v))?,
                        Cell::Int(v) => csv.write_field(v.to_string())?,
                        Cell::Vector(v) => {
                            for x in *v {
                                csv.write_field(fmt.format(*x))?;
                            }
                        }
                    }
                }
                csv.write_record(None::<&[u8]>)?;
            }
            Sink::Jsonl(w, fmt) => {
                w.write_all(b"{")?;
                for (k, (name, cell)) in self.names.iter().zip(cells).enumerate() {
                    if k > 0 {
                        w.write_all(b",")?;
                    }
                    serde_json::to_writer(&mut **w, name)?;
                    w.write_all(b":")?;
                    match cell {
                        Cell::Text(t) => serde_json::to_writer(&mut **w, t)?,
                        Cell::Float(v) if v.is_finite() => {
                            w.write_all(fmt.format(*v).as_bytes())?
                        }
                        Cell::Float(_) | Cell::Null => w.write_all(b"null")?,
                        Cell::Int(v) => write!(w, "{v}")?,
                        Cell::Vector(v) => {
                            w.write_all(b"[")?;
                            for (i, x) in v.iter().enumerate() {
                                if i > 0 {
                                    w.write_all(b",")?;
                                }
                                if x.is_finite() {
                                    w.write_all(fmt.format(*x).as_bytes())?;
                                } else {
                                    w.write_all(b"null")?;
                                }
                            }
                            w.write_all(b"]")?;
                        }
                    }
                }
                w.write_all(b"}\n")?;
            }
            Sink::Parquet(p) => {
                for (b, cell) in p.columns.iter_mut().zip(cells) {
                    match (b, cell) {
                        (Builder::Text(b), Cell::Text(t)) => b.append_value(t),
                        (Builder::Float(b), Cell::Float(v)) => b.append_value(*v),
                        (Builder::Int(b), Cell::Int(v)) => b.append_value(*v),
                        (Builder::Vector(b), Cell::Vector(v)) => {
                            b.values().append_slice(v);
                            b.append(true);
                        }
                        (Builder::Text(b), _) => b.append_null(),
                        (Builder::Float(b), _) => b.append_null(),
                        (Builder::Int(b), _) => b.append_null(),
                        (Builder::Vector(b), _) => {
                            let d = b.value_length() as usize;
                            b.values().append_nulls(d);
                            b.append(false);
                        }
                    }
                }
                p.rows += 1;
                if p.rows == PARQUET_ROWS {
                    p.flush()?;
                }
            }
        }
        Ok(())
    }

    /// Finishes the file (flushes; writes the Parquet footer).
    pub fn finish(self) -> io::Result<()> {
        match self.inner {
            Sink::Csv(mut csv, _) => csv.flush(),
            Sink::Jsonl(w, _) => w.flush(),
            Sink::Parquet(mut p) => {
                p.flush()?;
                p.writer.close().map(|_| ()).map_err(io::Error::other)
            }
        }
    }

    /// The column kinds.
    pub fn kinds(&self) -> &[Kind] {
        &self.kinds
    }
}

fn builder(k: Kind) -> Builder {
    match k {
        Kind::Text => Builder::Text(StringBuilder::new()),
        Kind::Float => Builder::Float(Float32Builder::new()),
        Kind::Int => Builder::Int(Int64Builder::new()),
        Kind::Vector(d) => Builder::Vector(
            FixedSizeListBuilder::new(Float32Builder::new(), d as i32)
                .with_field(Arc::new(Field::new_list_field(DataType::Float32, true))),
        ),
    }
}

/// The Arrow type of a vector column of `d` floats.
fn vector_type(d: u32) -> DataType {
    DataType::FixedSizeList(
        Arc::new(Field::new_list_field(DataType::Float32, true)),
        d as i32,
    )
}

impl<W: Write + Send> ParquetSink<'_, W> {
    fn flush(&mut self) -> io::Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let arrays: Vec<ArrayRef> = self
            .columns
            .iter_mut()
            .map(|b| -> ArrayRef {
                match b {
                    Builder::Text(b) => Arc::new(b.finish()),
                    Builder::Float(b) => Arc::new(b.finish()),
                    Builder::Int(b) => Arc::new(b.finish()),
                    Builder::Vector(b) => Arc::new(b.finish()),
                }
            })
            .collect();
        let batch = RecordBatch::try_new(self.schema.clone(), arrays).map_err(io::Error::other)?;
        self.writer.write(&batch).map_err(io::Error::other)?;
        self.rows = 0;
        Ok(())
    }
}

/// The format of a part file, from its extension.
pub fn format_of(path: &Path) -> io::Result<OutputFormat> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    OutputFormat::from_extension(ext).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a csv, jsonl or parquet part file", path.display()),
        )
    })
}

/// Reads every row of a part file: returns the column names and calls
/// `visit` with them and each row's values (in column order).
pub fn read_part(path: &Path, visit: impl FnMut(&[String], &[Value])) -> io::Result<Vec<String>> {
    read_input(Input::open(path)?, format_of(path)?, visit)
}

/// [`read_part`] for a part file already opened, in `format`.
pub fn read_input(
    input: Input,
    format: OutputFormat,
    mut visit: impl FnMut(&[String], &[Value]),
) -> io::Result<Vec<String>> {
    let mut row = Vec::new();
    match format {
        OutputFormat::Csv => {
            let mut rdr = csv::ReaderBuilder::new()
                .has_headers(true)
                .from_reader(io::BufReader::with_capacity(1 << 16, input.reader()?));
            let names: Vec<String> = rdr
                .headers()
                .map_err(io::Error::other)?
                .iter()
                .map(str::to_owned)
                .collect();
            let mut rec = csv::StringRecord::new();
            while rdr.read_record(&mut rec).map_err(io::Error::other)? {
                row.clear();
                row.extend(rec.iter().map(|f| Value::Text(f.to_owned())));
                visit(&names, &row);
            }
            Ok(names)
        }
        OutputFormat::Jsonl => {
            let r = io::BufReader::with_capacity(1 << 16, input.reader()?);
            let mut names: Vec<String> = Vec::new();
            for line in r.lines() {
                let line = line?;
                if line.is_empty() {
                    continue;
                }
                let obj: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(&line).map_err(io::Error::other)?;
                if names.is_empty() {
                    names = obj.keys().cloned().collect();
                }
                row.clear();
                row.extend(names.iter().map(|k| match obj.get(k) {
                    Some(serde_json::Value::String(s)) => Value::Text(s.clone()),
                    Some(serde_json::Value::Number(n)) => {
                        Value::Number(n.as_f64().unwrap_or(f64::NAN))
                    }
                    Some(serde_json::Value::Null) | None => Value::Null,
                    Some(serde_json::Value::Array(a))
                        if a.iter().all(|x| x.is_number() || x.is_null()) =>
                    {
                        Value::Vector(a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect())
                    }
                    Some(other) => Value::Text(other.to_string()),
                }));
                visit(&names, &row);
            }
            Ok(names)
        }
        OutputFormat::Parquet => {
            use arrow_array::cast::AsArray;
            use arrow_array::types::{Float32Type, Int64Type};
            use arrow_array::Array;
            let reader =
                parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(input)
                    .map_err(io::Error::other)?;
            let names: Vec<String> = reader
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect();
            for batch in reader
                .with_batch_size(PARQUET_ROWS)
                .build()
                .map_err(io::Error::other)?
            {
                let batch = batch.map_err(io::Error::other)?;
                for r in 0..batch.num_rows() {
                    row.clear();
                    for col in batch.columns() {
                        row.push(if col.is_null(r) {
                            Value::Null
                        } else {
                            match col.data_type() {
                                DataType::Utf8 => {
                                    Value::Text(col.as_string::<i32>().value(r).to_owned())
                                }
                                DataType::Float32 => Value::Number(f64::from(
                                    col.as_primitive::<Float32Type>().value(r),
                                )),
                                DataType::Int64 => {
                                    Value::Number(col.as_primitive::<Int64Type>().value(r) as f64)
                                }
                                DataType::FixedSizeList(f, _)
                                    if f.data_type() == &DataType::Float32 =>
                                {
                                    let v = col.as_fixed_size_list().value(r);
                                    let v = v.as_primitive::<Float32Type>();
                                    Value::Vector(
                                        (0..v.len())
                                            .map(|i| {
                                                if v.is_null(i) {
                                                    f64::NAN
                                                } else {
                                                    f64::from(v.value(i))
                                                }
                                            })
                                            .collect(),
                                    )
                                }
                                other => Value::Text(format!("<{other}>")),
                            }
                        });
                    }
                    visit(&names, &row);
                }
            }
            Ok(names)
        }
    }
}

/// The column names of a part file already opened, in `format`, from its
/// header alone (CSV: the first line; JSON Lines: the first record's keys;
/// Parquet: the footer's schema). A vector column is one name (CSV: its
/// `<name>_<i>` columns).
pub fn column_names(input: Input, format: OutputFormat) -> io::Result<Vec<String>> {
    match format {
        OutputFormat::Csv | OutputFormat::Jsonl => {
            let mut first = String::new();
            io::BufReader::new(input.reader()?).read_line(&mut first)?;
            if format == OutputFormat::Csv {
                let mut rdr = csv::ReaderBuilder::new()
                    .has_headers(false)
                    .from_reader(first.as_bytes());
                let mut rec = csv::StringRecord::new();
                rdr.read_record(&mut rec).map_err(io::Error::other)?;
                Ok(rec.iter().map(str::to_owned).collect())
            } else if first.trim().is_empty() {
                Ok(Vec::new())
            } else {
                let obj: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(&first).map_err(io::Error::other)?;
                Ok(obj.keys().cloned().collect())
            }
        }
        OutputFormat::Parquet => {
            let reader =
                parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(input)
                    .map_err(io::Error::other)?;
            Ok(reader
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect())
        }
    }
}

/// Counts the rows of a part file (Parquet: from its footer).
pub fn count_rows(path: &Path) -> io::Result<u64> {
    count_input_rows(Input::open(path)?, format_of(path)?)
}

/// [`count_rows`] for a part file already opened, in `format`.
pub fn count_input_rows(input: Input, format: OutputFormat) -> io::Result<u64> {
    if format == OutputFormat::Parquet {
        use parquet::file::reader::FileReader;
        let reader =
            parquet::file::reader::SerializedFileReader::new(input).map_err(io::Error::other)?;
        return Ok(reader.metadata().file_metadata().num_rows().max(0) as u64);
    }
    let mut n = 0;
    read_input(input, format, |_, _| n += 1)?;
    Ok(n)
}

/// Writes the part files `parts` (all of `format`, with the same columns) to
/// `w` as one file, in order, streamed: CSV keeps the first header, JSON
/// Lines are appended, Parquet row groups are re-written into one file.
pub fn concat_parts(
    w: &mut (impl Write + Send),
    format: OutputFormat,
    parts: &[Input],
) -> io::Result<()> {
    match format {
        OutputFormat::Csv => {
            for (k, part) in parts.iter().enumerate() {
                let mut r = io::BufReader::with_capacity(1 << 16, part.reader()?);
                let mut header = Vec::new();
                r.read_until(b'\n', &mut header)?;
                if k == 0 {
                    w.write_all(&header)?;
                }
                io::copy(&mut r, w)?;
            }
            Ok(())
        }
        OutputFormat::Jsonl => {
            for part in parts {
                io::copy(&mut part.reader()?, w)?;
            }
            Ok(())
        }
        OutputFormat::Parquet => {
            let mut writer: Option<parquet::arrow::ArrowWriter<&mut _>> = None;
            let mut w = Some(w);
            for part in parts {
                let reader =
                    parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
                        part.clone(),
                    )
                    .map_err(io::Error::other)?
                    .with_batch_size(PARQUET_ROWS)
                    .build()
                    .map_err(io::Error::other)?;
                let schema = arrow_array::RecordBatchReader::schema(&reader);
                if writer.is_none() {
                    let props = parquet::file::properties::WriterProperties::builder()
                        .set_compression(parquet::basic::Compression::SNAPPY)
                        .set_max_row_group_row_count(Some(PARQUET_ROWS))
                        .build();
                    let sink = w.take().expect("the output is taken once");
                    writer = Some(
                        parquet::arrow::ArrowWriter::try_new(sink, schema, Some(props))
                            .map_err(io::Error::other)?,
                    );
                }
                let out = writer.as_mut().expect("a writer was made");
                for batch in reader {
                    out.write(&batch.map_err(io::Error::other)?)
                        .map_err(io::Error::other)?;
                }
            }
            if let Some(out) = writer {
                out.close().map_err(io::Error::other)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn write(format: OutputFormat, dir: &Path, name: &str, rows: &[(&str, f32, i64)]) -> PathBuf {
        let path = dir.join(format!("{name}.{}", format.extension()));
        let mut file = std::fs::File::create(&path).unwrap();
        let mut w = PartWriter::new(
            &mut file,
            format,
            vec!["id".into(), "score".into(), "class".into()],
            vec![Kind::Text, Kind::Float, Kind::Int],
        )
        .unwrap();
        for (id, s, c) in rows {
            w.row(&[Cell::Text(id), Cell::Float(*s), Cell::Int(*c)])
                .unwrap();
        }
        w.finish().unwrap();
        path
    }

    #[test]
    fn every_format_reads_back_what_was_written_and_concatenates_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for format in [
            OutputFormat::Csv,
            OutputFormat::Jsonl,
            OutputFormat::Parquet,
        ] {
            let a = write(
                format,
                dir.path(),
                "a",
                &[("x,\"1\"", 0.1, 3), ("y", f32::NAN, -1)],
            );
            let b = write(format, dir.path(), "b", &[("z", 2.5e-8, 7)]);
            let mut rows = Vec::new();
            let names = read_part(&a, |_, r| rows.push(r.to_vec())).unwrap();
            assert_eq!(names, ["id", "score", "class"], "{format:?}");
            assert_eq!(rows[0][0], Value::Text("x,\"1\"".into()));
            assert_eq!(
                rows[0][1].as_f64().map(|v| v as f32),
                Some(0.1f32),
                "{format:?}"
            );
            assert_eq!(rows[0][2].as_f64(), Some(3.0));
            assert!(
                rows[1][1].as_f64().is_none_or(f64::is_nan),
                "{format:?}: {:?}",
                rows[1][1]
            );
            assert_eq!(count_rows(&a).unwrap(), 2);
            let merged = dir.path().join(format!("m.{}", format.extension()));
            let mut out = std::fs::File::create(&merged).unwrap();
            // A part by path and one opened already (as through an output folder's handle).
            let opened = Input::opened(std::fs::File::open(&b).unwrap(), b.clone());
            concat_parts(&mut out, format, &[Input::open(&a).unwrap(), opened]).unwrap();
            drop(out);
            let mut ids = Vec::new();
            read_part(&merged, |_, r| ids.push(r[0].text())).unwrap();
            assert_eq!(ids, ["x,\"1\"", "y", "z"], "{format:?}");
            let mut last = Vec::new();
            read_part(&merged, |_, r| last = r.to_vec()).unwrap();
            assert_eq!(last[1].as_f64().map(|v| v as f32), Some(2.5e-8));
        }
    }

    #[test]
    fn vector_columns_are_lists_arrays_or_numbered_columns_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        for format in [
            OutputFormat::Csv,
            OutputFormat::Jsonl,
            OutputFormat::Parquet,
        ] {
            let path = dir.path().join(format!("v.{}", format.extension()));
            let mut file = std::fs::File::create(&path).unwrap();
            let mut w = PartWriter::new(
                &mut file,
                format,
                vec!["id".into(), "embedding".into()],
                vec![Kind::Text, Kind::Vector(3)],
            )
            .unwrap();
            w.row(&[Cell::Text("a"), Cell::Vector(&[0.5, -1.0, 2.25])])
                .unwrap();
            w.row(&[Cell::Text("b"), Cell::Vector(&[0.0, f32::NAN, 1.0])])
                .unwrap();
            w.finish().unwrap();
            drop(file);
            let mut rows = Vec::new();
            let names = read_part(&path, |_, row| rows.push(row.to_vec())).unwrap();
            let values = |row: &[Value]| -> Vec<f64> {
                match row {
                    [_, Value::Vector(v)] => v.clone(),
                    [_, rest @ ..] => rest
                        .iter()
                        .map(|v| v.as_f64().unwrap_or(f64::NAN))
                        .collect(),
                    [] => Vec::new(),
                }
            };
            let header = column_names(Input::open(&path).unwrap(), format).unwrap();
            assert_eq!(
                header, names,
                "{format:?}: the header alone names the columns"
            );
            if format == OutputFormat::Csv {
                assert_eq!(names, ["id", "embedding_0", "embedding_1", "embedding_2"]);
            } else {
                assert_eq!(names, ["id", "embedding"], "{format:?}");
                assert!(matches!(rows[0][1], Value::Vector(_)), "{format:?}");
            }
            assert_eq!(values(&rows[0]), [0.5, -1.0, 2.25], "{format:?}");
            let second = values(&rows[1]);
            assert_eq!((second[0], second[2]), (0.0, 1.0));
            assert!(
                second[1].is_nan(),
                "{format:?}: NaN (null in JSON) reads back as NaN"
            );
        }
        // A Parquet vector column is a fixed-size list of float32.
        let file = std::fs::File::open(dir.path().join("v.parquet")).unwrap();
        let reader =
            parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
        assert_eq!(
            reader.schema().field(1).data_type(),
            &vector_type(3),
            "{:?}",
            reader.schema()
        );
    }

    #[test]
    fn unknown_extensions_are_refused() {
        assert!(format_of(Path::new("part-000001.txt")).is_err());
        assert_eq!(
            format_of(Path::new("p.jsonl")).unwrap(),
            OutputFormat::Jsonl
        );
    }
}
