//! Reads the rows of a work item: a CSV byte range parsed straight into one
//! contiguous row-major `f32` buffer (what libtorch takes) plus the row ids.

use crate::error::ItemError;
use batchfleet_shared::message::{CsvLayout, InputSlice};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};

/// The rows of one item, ready for the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// Features, row-major, `rows × cols`.
    pub features: Vec<f32>,
    /// Features per row.
    pub cols: usize,
    ids: String,
    id_ends: Vec<usize>,
}

impl Batch {
    /// An empty batch of `cols` features per row with room for `rows`.
    pub fn with_capacity(cols: usize, rows: usize) -> Self {
        Self {
            features: Vec::with_capacity(rows * cols),
            cols,
            ids: String::new(),
            id_ends: Vec::with_capacity(rows),
        }
    }

    /// Appends one row.
    pub fn push(&mut self, id: &str, features: &[f32]) {
        debug_assert_eq!(features.len(), self.cols);
        self.ids.push_str(id);
        self.id_ends.push(self.ids.len());
        self.features.extend_from_slice(features);
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.id_ends.len()
    }

    /// Id of row `i`.
    pub fn id(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.id_ends[i - 1] };
        &self.ids[start..self.id_ends[i]]
    }
}

/// Reads the rows of `slice`. Any malformed row fails the item (poison) with
/// the file, line and reason; a file that changed since planning is poison too.
pub fn read(slice: &InputSlice, layout: &CsvLayout) -> Result<Batch, ItemError> {
    match slice {
        InputSlice::CsvRange {
            path,
            start,
            end,
            first_line,
            rows,
            file_len,
        } => {
            let mut file = File::open(path).map_err(|e| io_error(path, e))?;
            let len = file.metadata().map_err(|e| io_error(path, e))?.len();
            if len != *file_len {
                return Err(ItemError::poison(format!(
                    "{path} is {len} bytes but was {file_len} when the job was planned; the input changed under the job — restore it or start a new job"
                )));
            }
            file.seek(SeekFrom::Start(*start))
                .map_err(|e| io_error(path, e))?;
            let reader = BufReader::with_capacity(1 << 20, file.take(end - start));
            let batch = parse_csv(reader, layout, path, *first_line, *rows as usize)?;
            if batch.rows() as u64 != *rows {
                return Err(ItemError::poison(format!(
                    "{path} bytes {start}..{end} hold {} rows but the planner counted {rows}; the input changed under the job",
                    batch.rows()
                )));
            }
            Ok(batch)
        }
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

/// Parses CSV records (no header) into a batch. `first_line` is the file line
/// of the first record, for error messages.
pub fn parse_csv<R: Read>(
    reader: R,
    layout: &CsvLayout,
    path: &str,
    first_line: u64,
    expected_rows: usize,
) -> Result<Batch, ItemError> {
    let cols = layout.feature_columns.len();
    let mut batch = Batch::with_capacity(cols, expected_rows);
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .delimiter(layout.delimiter)
        .flexible(true) // we check field counts ourselves, to name the row
        .from_reader(reader);
    let mut rec = csv::ByteRecord::new();
    let mut row = vec![0f32; cols];
    loop {
        let line = |rec: &csv::ByteRecord| {
            first_line + rec.position().map_or(0, |p| p.line().saturating_sub(1))
        };
        match rdr.read_byte_record(&mut rec) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                return Err(ItemError::poison(format!(
                    "{path}: malformed CSV near line {}: {e}",
                    first_line + e.position().map_or(0, |p| p.line().saturating_sub(1))
                )))
            }
        }
        let bad =
            |reason: String| ItemError::poison(format!("{path} line {}: {reason}", line(&rec)));
        if rec.len() != layout.fields as usize {
            return Err(bad(format!(
                "expected {} fields, found {}",
                layout.fields,
                rec.len()
            )));
        }
        let id = std::str::from_utf8(&rec[layout.id_column as usize]).map_err(|_| {
            bad(format!(
                "id (field {}) is not valid UTF-8",
                layout.id_column + 1
            ))
        })?;
        for (slot, &idx) in row.iter_mut().zip(&layout.feature_columns) {
            let raw = &rec[idx as usize];
            *slot = parse_f32(raw).ok_or_else(|| {
                bad(format!(
                    "field {} is not a number: {:?}",
                    idx + 1,
                    String::from_utf8_lossy(raw)
                ))
            })?;
        }
        batch.push(id, &row);
    }
    Ok(batch)
}

fn parse_f32(raw: &[u8]) -> Option<f32> {
    std::str::from_utf8(raw).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> CsvLayout {
        CsvLayout {
            delimiter: b',',
            fields: 4,
            id_column: 1,
            feature_columns: vec![3, 0],
        }
    }

    #[test]
    fn parses_rows_into_contiguous_features_in_column_order() {
        let data = "1.5,a,x,2\n-3,\"b,c\",y, 4e-1 \n";
        let b = parse_csv(data.as_bytes(), &layout(), "f.csv", 2, 2).unwrap();
        assert_eq!(b.rows(), 2);
        assert_eq!(b.features, vec![2.0, 1.5, 0.4, -3.0]);
        assert_eq!(b.id(0), "a");
        assert_eq!(b.id(1), "b,c");
    }

    #[test]
    fn bad_rows_name_file_line_and_field() {
        let data = "1,a,x,2\n1,b,x,zz\n";
        let err = parse_csv(data.as_bytes(), &layout(), "in/f.csv", 10, 2).unwrap_err();
        assert_eq!(err.class, crate::error::FailureClass::Poison);
        assert!(
            err.message
                .contains("in/f.csv line 11: field 4 is not a number: \"zz\""),
            "{}",
            err.message
        );
        let err = parse_csv("1,a,x\n".as_bytes(), &layout(), "f.csv", 2, 1).unwrap_err();
        assert!(
            err.message.contains("line 2: expected 4 fields, found 3"),
            "{}",
            err.message
        );
    }

    #[test]
    fn reads_a_byte_range_and_detects_changed_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("in.csv");
        let content = "h1,h2,h3,h4\n1,a,x,2\n3,b,y,4\n5,c,z,6\n";
        std::fs::write(&p, content).unwrap();
        let path = p.to_string_lossy().into_owned();
        let slice = |rows, file_len| InputSlice::CsvRange {
            path: path.clone(),
            start: 20,
            end: 28,
            first_line: 3,
            rows,
            file_len,
        };
        let b = read(&slice(1, content.len() as u64), &layout()).unwrap();
        assert_eq!((b.id(0), b.features.as_slice()), ("b", &[4.0, 3.0][..]));
        let err = read(&slice(2, content.len() as u64), &layout()).unwrap_err();
        assert!(err.message.contains("planner counted 2"), "{}", err.message);
        let err = read(&slice(1, 5), &layout()).unwrap_err();
        assert!(err.message.contains("input changed"), "{}", err.message);
    }
}
