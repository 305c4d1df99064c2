//! The layout of a job's output folder, read back: used by workers that find
//! an item already published, and by the coordinator when it rebuilds lost
//! Redis state from the files (which are the truth).

use std::path::{Path, PathBuf};

/// The merged output of a job with `[output] merge = true`: every part, in input order.
pub const MERGED_FILE: &str = "predictions.csv";

/// Writes the CSV files `parts` — each with the same header line — to `w` as
/// one file: the first part's header, then every part's rows, streamed (no
/// part is held in memory).
pub fn concat_csv(w: &mut impl std::io::Write, parts: &[PathBuf]) -> std::io::Result<()> {
    use std::io::BufRead;
    for (k, part) in parts.iter().enumerate() {
        let mut r = std::io::BufReader::with_capacity(1 << 16, std::fs::File::open(part)?);
        let mut header = Vec::new();
        r.read_until(b'\n', &mut header)?;
        if k == 0 {
            w.write_all(&header)?;
        }
        std::io::copy(&mut r, w)?;
    }
    Ok(())
}

/// Folder (inside the output folder) holding `part-<seq>.jsonl` rejects files.
pub const REJECTS_DIR: &str = "rejects";

/// The rejects file of item `seq` in output folder `out`.
pub fn rejects_path(out: &Path, seq: u32) -> PathBuf {
    out.join(REJECTS_DIR).join(format!("part-{seq:06}.jsonl"))
}

/// Counts the data rows of a committed part file (used when a redelivered
/// item finds its output already published).
pub fn count_rows(path: &Path) -> std::io::Result<u64> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_path(path)
        .map_err(std::io::Error::other)?;
    let mut rec = csv::ByteRecord::new();
    let mut n = 0;
    while rdr
        .read_byte_record(&mut rec)
        .map_err(std::io::Error::other)?
    {
        n += 1;
    }
    Ok(n)
}

/// Counts the lines of a rejects file; 0 if there is none.
pub fn count_rejects(path: &Path) -> std::io::Result<u64> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(bytes.iter().filter(|b| **b == b'\n').count() as u64),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

/// Rows of a part file and the histogram of its score columns (`counts[c][bin]`).
pub fn histogram_of_part(
    path: &Path,
    spec: &crate::message::HistogramSpec,
) -> std::io::Result<(u64, Vec<Vec<u64>>)> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_path(path)
        .map_err(std::io::Error::other)?;
    let mut rec = csv::StringRecord::new();
    let mut counts: Vec<Vec<u64>> = Vec::new();
    let mut rows = 0;
    let mut values = Vec::new();
    while rdr.read_record(&mut rec).map_err(std::io::Error::other)? {
        rows += 1;
        values.clear();
        for field in rec.iter().skip(1) {
            values.push(field.parse::<f32>().unwrap_or(f32::NAN));
        }
        spec.add(&mut counts, &values, values.len());
    }
    Ok((rows, counts))
}
