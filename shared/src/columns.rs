//! The columns of an input: the header row of a CSV file, and which Arrow
//! column types a Parquet input's id and features may have. Both are checked
//! by the coordinator when it validates a manifest (for a sample of the
//! files, when they are remote) and again by the worker that reads the file.

use crate::source::Input;
use arrow_schema::DataType;
use std::io;

/// Bytes of a CSV file read at a time looking for the end of its header.
const HEADER_CHUNK: u64 = 64 << 10;
/// A header row longer than this is refused (not a CSV file, most likely).
const MAX_HEADER: u64 = 4 << 20;

/// The header row of a CSV file: its column names, trimmed. An empty name is
/// pandas' unnamed index column (what `DataFrame.to_csv` writes by default),
/// named as `pandas.read_csv` names it, `Unnamed: <i>`. `None` for an empty
/// file. Reads only as far as the header's end: a local file through one
/// buffered reader, an `s3://` object in 64 KiB ranges (one ranged GET for a
/// header of usual length).
pub fn csv_header(input: &Input, delimiter: u8) -> io::Result<Option<Vec<String>>> {
    use std::io::Read;
    let (source, buffer): (Box<dyn Read + '_>, u64) = match input {
        Input::S3(_) => (
            Box::new(Ranged {
                input,
                pos: 0,
                len: input.len()?,
            }),
            HEADER_CHUNK,
        ),
        _ => (input.reader()?, 8 << 10),
    };
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .delimiter(delimiter)
        .flexible(true)
        .buffer_capacity(buffer as usize)
        .from_reader(source.take(MAX_HEADER));
    let mut rec = csv::StringRecord::new();
    let found = rdr
        .read_record(&mut rec)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if rdr.position().byte() >= MAX_HEADER {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "no end of the header row within its first {} MiB",
                MAX_HEADER >> 20
            ),
        ));
    }
    Ok(found.then(|| {
        rec.iter()
            .enumerate()
            .map(|(i, s)| match s.trim() {
                "" => format!("Unnamed: {i}"),
                name => name.to_owned(),
            })
            .collect()
    }))
}

/// An input read front to back in [`HEADER_CHUNK`] ranges.
struct Ranged<'a> {
    input: &'a Input,
    pos: u64,
    len: u64,
}

impl std::io::Read for Ranged<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let end = (self.pos + (out.len() as u64).min(HEADER_CHUNK)).min(self.len);
        if end <= self.pos {
            return Ok(0);
        }
        let bytes = self.input.read_range(self.pos..end)?;
        let n = bytes.len().min(out.len());
        out[..n].copy_from_slice(&bytes[..n]);
        self.pos += n as u64;
        Ok(n)
    }
}

/// Whether a feature column of this type can be read as `f32` (integers
/// and floats; integers go through `f64`, exactly as CSV text does).
pub fn is_feature_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Float32 | Float64
    )
}

/// Whether an id column of this type can be read (strings and integers).
pub fn is_id_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Utf8 | LargeUtf8
            | Utf8View
            | Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | UInt64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_of(text: &[u8]) -> Option<Vec<String>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.csv");
        std::fs::write(&path, text).unwrap();
        csv_header(&Input::open(&path).unwrap(), b',').unwrap()
    }

    #[test]
    fn the_header_row_is_read_trimmed_with_pandas_names_for_empty_ones() {
        assert_eq!(
            header_of(b",id, f0 ,\"f,1\"\n0,a,1,2\n"),
            Some(vec![
                "Unnamed: 0".into(),
                "id".into(),
                "f0".into(),
                "f,1".into()
            ])
        );
        assert_eq!(header_of(b"id,f0"), Some(vec!["id".into(), "f0".into()]));
        assert_eq!(header_of(b""), None);
        // Longer than one read: the header is read on to its end.
        let wide: Vec<String> = (0..20_000).map(|i| format!("column_{i}")).collect();
        let text = format!("{}\n{}\n", wide.join(","), vec!["1"; 20_000].join(","));
        assert_eq!(header_of(text.as_bytes()), Some(wide));
    }

    #[test]
    fn numbers_are_features_and_strings_or_integers_are_ids() {
        assert!(is_feature_type(&DataType::Float64) && is_feature_type(&DataType::Int32));
        assert!(!is_feature_type(&DataType::Utf8) && !is_feature_type(&DataType::Boolean));
        assert!(is_id_type(&DataType::Utf8) && is_id_type(&DataType::Int64));
        assert!(
            !is_id_type(&DataType::Float64),
            "float ids do not round-trip as text"
        );
    }
}
