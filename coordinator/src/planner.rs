//! Cuts input files into work items: byte ranges of a CSV file that start and
//! end on record boundaries (quoted fields with embedded newlines included),
//! sized evenly so that no item is a straggler by construction.
//!
//! The planner reads each file once (twice with `item_rows`: a counting pass,
//! then a cutting pass) and never holds more than one record in memory.
//! A file with no quote character and only `\n` or `\r\n` line ends — most
//! machine-written CSV — is cut by searching for line ends alone (`memchr`,
//! several GB/s); any other file goes through the full CSV parser. Both give
//! the same ranges (a test checks them against each other).
//!
//! JSON Lines files are cut at line ends the same way. Parquet files are cut
//! at row-group boundaries from the footer alone (no data is read): runs of
//! consecutive row groups of about the item size each.

use crate::manifest::{ItemSizing, JobSpec};
use batchfleet_shared::message::{ByteRange, InputSlice, Layout, StoredTask, WorkItem};
use batchfleet_shared::source::Input;
use batchfleet_shared::split;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// A byte range of one file covering whole records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// First byte of the first record.
    pub start: u64,
    /// Byte just past the last record (start of the next one, or end of file).
    pub end: u64,
    /// 1-based line of the first record.
    pub first_line: u64,
    /// Records in the range.
    pub rows: u64,
}

/// Errors planning a file.
#[derive(Debug, thiserror::Error)]
#[error("cannot plan {path}: {reason}")]
pub struct PlanError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub reason: String,
}

/// The planned items of a job.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Items in seq order.
    pub items: Vec<WorkItem>,
    /// Rows over all items (an estimate when `rows_estimated`).
    pub rows_total: u64,
    /// The items were cut blind: `rows_total` is estimated from the bytes
    /// and the sample's mean record size, and each item's rows are known
    /// once it is read.
    pub rows_estimated: bool,
    /// The job's task, stored once per job: every item names it by digest.
    pub task: StoredTask,
}

/// One file's slices, or why it could not be planned.
type FilePlan = Result<Vec<InputSlice>, PlanError>;

/// Plans every input file of a job, files scanned in parallel (one thread
/// per core) and numbered in file order, so the plan is the same every time.
/// Files with no data rows produce no items.
pub fn plan(spec: &JobSpec) -> Result<Plan, PlanError> {
    if let Some(root) = &spec.root {
        return plan_files(spec, root);
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(spec.files.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let per_file: Vec<std::sync::Mutex<Option<FilePlan>>> = spec
        .files
        .iter()
        .map(|_| std::sync::Mutex::new(None))
        .collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(path) = spec.files.get(i) else {
                    return;
                };
                let result = plan_one(spec, path);
                *per_file[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
            });
        }
    });
    let task = StoredTask::of(&spec.task);
    let mut items = Vec::new();
    let mut rows_total = 0;
    for slot in per_file {
        let slices = slot
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .expect("every file was planned")?;
        for input in slices {
            rows_total += match (&input, spec.blind) {
                // Counted once per file, on its first range.
                (InputSlice::CsvRange(r) | InputSlice::JsonlRange(r), Some(b)) if r.align => {
                    if r.start == 0 {
                        b.rows_of(r.file_len)
                    } else {
                        0
                    }
                }
                _ => input.rows(),
            };
            let versions = versions_of(spec, &input)?;
            items.push(WorkItem {
                job_id: spec.job_id.clone(),
                seq: items.len() as u32,
                input,
                task: spec.task.clone(),
                versions,
                task_sha256: Some(task.sha256.clone()),
            });
        }
    }
    Ok(Plan {
        items,
        rows_total,
        rows_estimated: spec.blind.is_some(),
        task,
    })
}

/// The slices of one input file, in the job's input format.
fn plan_one(spec: &JobSpec, path: &Path) -> FilePlan {
    let delimiter = match &spec.task.layout {
        Layout::Parquet(_) => return plan_parquet(path, spec.sizing),
        Layout::Csv(csv) => Some(csv.delimiter),
        Layout::Jsonl(_) => None,
        Layout::Image(_) => {
            return Err(err(
                path,
                "image files are planned as a listing (the job's root), not file by file",
            ))
        }
    };
    let file_len = match spec.fingerprint(path) {
        Some(f) => f.size,
        None => input_len(path)?,
    };
    let name = path.to_string_lossy().into_owned();
    let jsonl = delimiter.is_none();
    let slice = |range: ByteRange| {
        if jsonl {
            InputSlice::JsonlRange(range)
        } else {
            InputSlice::CsvRange(range)
        }
    };
    if let Some(blind) = spec.blind {
        // From the size alone: the worker finds the records each range owns.
        let items = blind.items_of(file_len, spec.sizing);
        return Ok(split::cuts(file_len, blind.header_bytes, items)
            .into_iter()
            .map(|(start, end)| {
                slice(ByteRange {
                    path: name.clone(),
                    start,
                    end,
                    first_line: 0,
                    rows: 0,
                    file_len,
                    align: true,
                })
            })
            .collect());
    }
    let ranges = match delimiter {
        None => plan_jsonl(path, spec.sizing)?,
        Some(d) => plan_csv(path, d, spec.sizing)?,
    };
    Ok(ranges
        .into_iter()
        .map(|r| {
            slice(ByteRange {
                path: name.clone(),
                start: r.start,
                end: r.end,
                first_line: r.first_line,
                rows: r.rows,
                file_len,
                align: false,
            })
        })
        .collect())
}

/// Plans a `files` job: the files in order, cut into runs of about
/// `item_rows` files, balanced by bytes (each run about the same total
/// size), or about `item_bytes` bytes each.
fn plan_files(spec: &JobSpec, root: &Path) -> Result<Plan, PlanError> {
    let mut sizes = Vec::with_capacity(spec.files.len());
    let mut names = Vec::with_capacity(spec.files.len());
    for path in &spec.files {
        sizes.push(match spec.fingerprint(path) {
            Some(f) => f.size,
            None => input_len(path)?,
        });
        let rel = path
            .strip_prefix(root)
            .map_err(|_| err(path, format!("is not under {}", root.display())))?;
        names.push(rel.to_string_lossy().into_owned());
    }
    let runs = file_runs(&sizes, spec.sizing);
    let task = StoredTask::of(&spec.task);
    let items = runs
        .into_iter()
        .enumerate()
        .map(|(seq, run)| {
            let input = InputSlice::Files {
                root: root.to_string_lossy().into_owned(),
                files: names[run.clone()].to_vec(),
                sizes: sizes[run.clone()].to_vec(),
                first_index: run.start as u64,
            };
            Ok(WorkItem {
                job_id: spec.job_id.clone(),
                seq: seq as u32,
                versions: versions_of(spec, &input)?,
                input,
                task: spec.task.clone(),
                task_sha256: Some(task.sha256.clone()),
            })
        })
        .collect::<Result<_, PlanError>>()?;
    Ok(Plan {
        items,
        rows_total: spec.files.len() as u64,
        rows_estimated: false,
        task,
    })
}

/// Runs of consecutive files for items: by count (`Rows(n)`: ⌈files / n⌉
/// items, each about the same total bytes) or by bytes.
pub fn file_runs(sizes: &[u64], sizing: ItemSizing) -> Vec<std::ops::Range<usize>> {
    match sizing {
        ItemSizing::Rows(n) => {
            let items = (sizes.len() as u64).div_ceil(n.max(1)).max(1);
            // Every file weighs at least a byte, so empty files still spread out.
            let weights: Vec<u64> = sizes.iter().map(|s| s + 1).collect();
            let total: u64 = weights.iter().sum();
            even_runs(&weights, total.div_ceil(items))
        }
        ItemSizing::Bytes(b) => even_runs(sizes, b),
    }
}

/// Splits a sequence of weights into consecutive runs of about `per_run`
/// in total each, never splitting one element: `n = ⌈total / per_run⌉` runs
/// at most, the k-th ending at the first element that reaches `k/n` of the
/// total. An element heavier than `per_run` is a run of its own.
pub fn even_runs(weights: &[u64], per_run: u64) -> Vec<std::ops::Range<usize>> {
    let total: u128 = weights.iter().map(|w| u128::from(*w)).sum();
    let n = total.div_ceil(u128::from(per_run.max(1))).max(1);
    let mut runs = Vec::new();
    let (mut start, mut acc, mut k) = (0, 0u128, 1u128);
    for (i, w) in weights.iter().enumerate() {
        if i > start && k < n && acc >= total * k / n {
            runs.push(start..i);
            start = i;
            while k < n && acc >= total * k / n {
                k += 1;
            }
        }
        acc += u128::from(*w);
    }
    if start < weights.len() {
        runs.push(start..weights.len());
    }
    runs
}

/// Cuts one Parquet file into runs of consecutive row groups, from its
/// footer: about `item_rows` rows or `item_bytes` compressed bytes each.
/// Row groups with no rows are skipped; a file with none has no items.
pub fn plan_parquet(path: &Path, sizing: ItemSizing) -> Result<Vec<InputSlice>, PlanError> {
    use parquet::file::reader::FileReader;
    let input = Input::open(path).map_err(|e| err(path, e))?;
    let file_len = input.len().map_err(|e| err(path, e))?;
    let reader = parquet::file::reader::SerializedFileReader::new(input)
        .map_err(|e| err(path, format!("not a readable Parquet file: {e}")))?;
    let groups = reader.metadata().row_groups();
    let rows: Vec<u64> = groups.iter().map(|g| g.num_rows().max(0) as u64).collect();
    let (weights, per_run): (Vec<u64>, u64) = match sizing {
        ItemSizing::Rows(n) => (rows.clone(), n),
        ItemSizing::Bytes(n) => (
            groups
                .iter()
                .map(|g| g.compressed_size().max(0) as u64)
                .collect(),
            n,
        ),
    };
    let mut first_row = 0;
    let mut slices = Vec::new();
    let mut row_starts = Vec::with_capacity(rows.len());
    for r in &rows {
        row_starts.push(first_row);
        first_row += r;
    }
    for run in even_runs(&weights, per_run) {
        // Trim empty row groups off both ends; a run of only empty ones is dropped.
        let Some(a) = run.clone().find(|&g| rows[g] > 0) else {
            continue;
        };
        let b = run.clone().rev().find(|&g| rows[g] > 0).unwrap_or(a);
        slices.push(InputSlice::ParquetRowGroups {
            path: path.to_string_lossy().into_owned(),
            first_group: a as u32,
            groups: (b - a + 1) as u32,
            first_row: row_starts[a],
            rows: rows[a..=b].iter().sum(),
            file_len,
        });
    }
    Ok(slices)
}

/// A small valid work item, for tests and examples of the wire format.
pub fn sample_item(job_id: &str, seq: u32) -> WorkItem {
    use batchfleet_shared::message::{
        CsvLayout, FailurePolicy, ModelRef, OutputFormat, OutputSpec, TaskSpec,
    };
    WorkItem {
        job_id: job_id.to_owned(),
        seq,
        input: InputSlice::CsvRange(ByteRange {
            path: "/data/in.csv".into(),
            start: 3,
            end: 9,
            first_line: 2,
            rows: 1,
            file_len: 9,
            align: false,
        }),
        task: TaskSpec {
            model: ModelRef::plain("/models/m.pt", "00".repeat(32), "cpu"),
            layout: Layout::Csv(CsvLayout {
                delimiter: b',',
                fields: 2,
                id_column: 0,
                feature_columns: vec![1],
                include_columns: Vec::new(),
                missing: Default::default(),
                header: Vec::new(),
            }),
            batch_size: 1,
            auto_batch: false,
            output: OutputSpec {
                dir: "/data/out".into(),
                format: OutputFormat::Csv,
                histogram: Default::default(),
                ..OutputSpec::default()
            },
            failure: FailurePolicy::default(),
            checkpoint_rows: 0,
            text: None,
            shadow: None,
        },
        versions: Vec::new(),
        task_sha256: None,
    }
}

/// The versions validation recorded for the files `input` reads, in
/// [`InputSlice::input_files`] order — after checking that the length it
/// was planned with is the one recorded (a file that changed between
/// validation and planning is not planned from two versions). Empty when
/// no file has a version (a store that gives neither time nor ETag).
fn versions_of(spec: &JobSpec, input: &InputSlice) -> Result<Vec<String>, PlanError> {
    let files = input.input_files();
    let lens: Vec<u64> = match input {
        InputSlice::CsvRange(r) | InputSlice::JsonlRange(r) => vec![r.file_len],
        InputSlice::ParquetRowGroups { file_len, .. } => vec![*file_len],
        InputSlice::Files { sizes, .. } => sizes.clone(),
    };
    let mut versions = Vec::with_capacity(files.len());
    for (path, len) in files.iter().zip(lens) {
        let Some(f) = spec.fingerprint(path) else {
            return Ok(Vec::new());
        };
        if f.size != len {
            return Err(err(
                path,
                format!("it was {} bytes at validation and {len} when planned: the file changed meanwhile; run the job again once it is written", f.size),
            ));
        }
        match f.version() {
            Some(v) => versions.push(v),
            None => return Ok(Vec::new()),
        }
    }
    Ok(versions)
}

/// The length of an input file (local or `s3://`).
fn input_len(path: &Path) -> Result<u64, PlanError> {
    Input::open(path)
        .and_then(|i| i.len())
        .map_err(|e| err(path, e))
}

/// A streaming reader of an input file (local or `s3://`).
fn reader(path: &Path) -> Result<Box<dyn std::io::Read + Send>, PlanError> {
    Input::open(path)
        .and_then(|i| i.reader())
        .map_err(|e| err(path, e))
}

fn err(path: &Path, e: impl std::fmt::Display) -> PlanError {
    PlanError {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

/// Chunk size of the planner's reads.
const SCAN_CHUNK: usize = 1 << 20;

/// Whether a file can be cut at line ends alone: no `"` anywhere (so no
/// record spans lines) and every `\r` directly before a `\n` (the CSV
/// parser would end a record at a lone `\r`).
fn lines_are_records(path: &Path, chunk: usize) -> Result<bool, PlanError> {
    let mut file = reader(path)?;
    let mut buf = vec![0u8; chunk];
    let mut cr_pending = false; // the previous chunk ended with `\r`
    loop {
        let n = read_chunk(&mut file, &mut buf).map_err(|e| err(path, e))?;
        if n == 0 {
            return Ok(!cr_pending);
        }
        let chunk = &buf[..n];
        if cr_pending && chunk[0] != b'\n' {
            return Ok(false);
        }
        for i in memchr::memchr2_iter(b'"', b'\r', chunk) {
            if chunk[i] == b'"' {
                return Ok(false);
            }
            match chunk.get(i + 1) {
                Some(b'\n') => {}
                Some(_) => return Ok(false),
                None => {} // the chunk ends with it: checked above on the next one
            }
        }
        cr_pending = chunk[n - 1] == b'\r';
    }
}

/// Fills `buf` as far as the file allows; 0 at end of file.
fn read_chunk(file: &mut dyn std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// [`Scan::records`] for a file where [`lines_are_records`] holds: every
/// non-blank line is a record. Blank lines are skipped. Positions are the
/// CSV parser's: a record starts where the previous one ended (blank lines
/// between them included), and a record's `\r\n` ends at its `\r`.
fn scan_lines(
    path: &Path,
    chunk: usize,
    header: bool,
    mut visit: impl FnMut(u64, u64),
) -> Result<u64, PlanError> {
    let mut file = reader(path)?;
    let mut buf = vec![0u8; chunk];
    let mut offset = 0u64; // of the chunk in the file
    let mut line = 1u64;
    let mut rec_start = (0u64, 1u64); // (byte, line) where the previous record ended
    let mut prev_cr = false; // the previous chunk ended with `\r`
    let mut line_blank = true; // nothing but a `\r` seen on this line so far
    let mut header_seen = !header;
    let mut record = |start: u64, line: u64| {
        if std::mem::replace(&mut header_seen, true) {
            visit(start, line);
        }
    };
    loop {
        let n = read_chunk(&mut file, &mut buf).map_err(|e| err(path, e))?;
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        let mut from = 0usize; // first byte of the current line within this chunk
        for i in memchr::memchr_iter(b'\n', chunk) {
            let body = &chunk[from..i];
            let body = body.strip_suffix(b"\r").unwrap_or(body);
            let crlf = if i > 0 {
                chunk[i - 1] == b'\r'
            } else {
                prev_cr
            };
            if !(line_blank && body.is_empty()) {
                record(rec_start.0, rec_start.1);
                let lf = offset + i as u64;
                rec_start = if crlf { (lf, line) } else { (lf + 1, line + 1) };
            }
            line += 1;
            line_blank = true;
            from = i + 1;
        }
        // The rest of the chunk starts (or continues) a line ending later.
        let rest = &chunk[from..];
        if !rest.is_empty() && rest != b"\r" {
            line_blank = false;
        }
        prev_cr = chunk[n - 1] == b'\r';
        offset += n as u64;
    }
    if !line_blank {
        record(rec_start.0, rec_start.1); // last line without a line end
    }
    Ok(offset)
}

/// How a file's records are found.
#[derive(Clone, Copy)]
enum Scan {
    /// Line ends alone ([`lines_are_records`] holds).
    Lines,
    /// The CSV parser.
    Parsed(u8),
    /// JSON Lines: every non-blank line is a record, and there is no header.
    JsonLines,
}

impl Scan {
    fn of(path: &Path, delimiter: u8) -> Result<Self, PlanError> {
        Ok(if lines_are_records(path, SCAN_CHUNK)? {
            Scan::Lines
        } else {
            Scan::Parsed(delimiter)
        })
    }

    /// Reads records of a CSV file after its header, calling
    /// `visit(start, line)` for each, and returns the file length.
    fn records(self, path: &Path, visit: impl FnMut(u64, u64)) -> Result<u64, PlanError> {
        match self {
            Scan::Lines => scan_lines(path, SCAN_CHUNK, true, visit),
            Scan::Parsed(delimiter) => scan_parsed(path, delimiter, visit),
            Scan::JsonLines => scan_lines(path, SCAN_CHUNK, false, visit),
        }
    }
}

/// [`Scan::records`] through the full CSV parser (quoted fields may span lines).
fn scan_parsed(
    path: &Path,
    delimiter: u8,
    mut visit: impl FnMut(u64, u64),
) -> Result<u64, PlanError> {
    let len = input_len(path)?;
    let file = reader(path)?;
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .delimiter(delimiter)
        .flexible(true) // field counts are the worker's to check, row by row
        .from_reader(BufReader::with_capacity(1 << 20, file));
    let mut rec = csv::ByteRecord::new();
    let mut header_seen = false;
    loop {
        match rdr.read_byte_record(&mut rec) {
            Ok(false) => break,
            Ok(true) => {
                if !header_seen {
                    header_seen = true;
                    continue;
                }
                let pos = rec.position().expect("csv reader sets record positions");
                visit(pos.byte(), pos.line());
            }
            Err(e) => return Err(err(path, format!("malformed CSV: {e}"))),
        }
    }
    Ok(len)
}

/// Cuts one CSV file (with a header row) into ranges of whole records.
pub fn plan_csv(path: &Path, delimiter: u8, sizing: ItemSizing) -> Result<Vec<Range>, PlanError> {
    plan_file(path, Scan::of(path, delimiter)?, sizing)
}

/// Cuts one JSON Lines file into ranges of whole lines (blank lines skipped).
pub fn plan_jsonl(path: &Path, sizing: ItemSizing) -> Result<Vec<Range>, PlanError> {
    plan_file(path, Scan::JsonLines, sizing)
}

fn plan_file(path: &Path, scan: Scan, sizing: ItemSizing) -> Result<Vec<Range>, PlanError> {
    // Record starts arrive in order; `cut` decides whether a record opens a new range.
    let mut ranges: Vec<Range> = Vec::new();
    let mut push = |start: u64, line: u64, new_range: bool| {
        if new_range || ranges.is_empty() {
            if let Some(last) = ranges.last_mut() {
                last.end = start;
            }
            ranges.push(Range {
                start,
                end: start,
                first_line: line,
                rows: 0,
            });
        }
        ranges.last_mut().expect("a range was just pushed").rows += 1;
    };
    let len = match sizing {
        ItemSizing::Rows(per_item) => {
            let mut total = 0u64;
            scan.records(path, |_, _| total += 1)?;
            // Even split: n items of `base` or `base + 1` rows.
            let n = total.div_ceil(per_item.max(1)).max(1);
            let (base, extra) = (total / n, total % n);
            let mut in_item = 0u64;
            let mut item = 0u64;
            scan.records(path, |start, line| {
                let size = base + u64::from(item < extra);
                let new = in_item == size;
                if new {
                    item += 1;
                    in_item = 0;
                }
                in_item += 1;
                push(start, line, new);
            })?
        }
        ItemSizing::Bytes(per_item) => {
            // Cut at the first record starting at or after each evenly spaced target.
            let file_len = input_len(path)?;
            let mut body_start = None;
            let mut n = 1;
            let mut next_target = u64::MAX;
            let mut k = 1;
            scan.records(path, |start, line| {
                let body = *body_start.get_or_insert_with(|| {
                    n = (file_len - start).div_ceil(per_item.max(1)).max(1);
                    next_target = start + (file_len - start) / n;
                    start
                });
                let new = k < n && start >= next_target;
                if new {
                    k += 1;
                    next_target = body + (file_len - body) * k / n;
                }
                push(start, line, new);
            })?
        }
    };
    if let Some(last) = ranges.last_mut() {
        last.end = len;
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn file(content: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("in.csv");
        fs::write(&p, content).unwrap();
        (dir, p)
    }

    /// Parses the records of each range independently, as a worker would.
    fn records_of(content: &str, ranges: &[Range]) -> Vec<Vec<String>> {
        ranges
            .iter()
            .map(|r| {
                let slice = &content.as_bytes()[r.start as usize..r.end as usize];
                let mut rdr = csv::ReaderBuilder::new()
                    .has_headers(false)
                    .from_reader(slice);
                let recs: Vec<String> = rdr
                    .records()
                    .map(|r| r.unwrap().iter().collect::<Vec<_>>().join("|"))
                    .collect();
                assert_eq!(recs.len() as u64, r.rows, "range {r:?} row count");
                recs
            })
            .collect()
    }

    /// Record starts and lines, and the file length, as a scanner saw them.
    type Seen = (Vec<(u64, u64)>, u64);

    /// What the line scan (if it applies) and the CSV parser see.
    fn scans(path: &Path, chunk: usize) -> (Option<Seen>, Seen) {
        let fast = lines_are_records(path, chunk).unwrap().then(|| {
            let mut seen = Vec::new();
            let len = scan_lines(path, chunk, true, |s, l| seen.push((s, l))).unwrap();
            (seen, len)
        });
        let mut seen = Vec::new();
        let len = scan_parsed(path, b',', |s, l| seen.push((s, l))).unwrap();
        (fast, (seen, len))
    }

    #[test]
    fn line_scan_agrees_with_the_csv_parser() {
        let pieces = [
            "a", "1,2", "", " ", ",", "\n", "\r\n", "\n\n", "\r\n\r\n", "x,y,z",
        ];
        let mut rng = fastrand::Rng::with_seed(7);
        let mut fast_cases = 0;
        for case in 0..2_000 {
            let content: String = (0..rng.usize(0..12))
                .map(|_| pieces[rng.usize(..pieces.len())])
                .collect();
            let (_d, p) = file(&content);
            for chunk in [1, 2, 3, 5, 64] {
                let (fast, parsed) = scans(&p, chunk);
                let fast = fast.unwrap_or_else(|| {
                    panic!("case {case}: {content:?} has no quotes or lone CRs")
                });
                assert_eq!(fast, parsed, "case {case}, chunk {chunk}: {content:?}");
                fast_cases += 1;
            }
        }
        assert!(fast_cases > 0);
    }

    #[test]
    fn quotes_and_lone_carriage_returns_take_the_parser() {
        for content in [
            "h\n\"a\nb\",1\n",
            "h\n\"x\"\n",
            "h\ra\rb\r",
            "h\r\na\rb\r\n",
            "h\na\r",
        ] {
            let (_d, p) = file(content);
            for chunk in [1, 2, 4, 64] {
                assert!(!lines_are_records(&p, chunk).unwrap(), "{content:?}");
            }
        }
        let (_d, p) = file("h\r\na\r\nb\r\n");
        assert!((1..8).all(|chunk| lines_are_records(&p, chunk).unwrap()));
    }

    #[test]
    fn ranges_cover_every_record_once_and_skip_header() {
        let content: String = std::iter::once("id,x\n".to_string())
            .chain((0..10).map(|i| format!("{i},{i}.5\n")))
            .collect();
        let (_d, p) = file(&content);
        let ranges = plan_csv(&p, b',', ItemSizing::Rows(3)).unwrap();
        let flat: Vec<String> = records_of(&content, &ranges).concat();
        assert_eq!(
            flat,
            (0..10).map(|i| format!("{i}|{i}.5")).collect::<Vec<_>>()
        );
        // 10 rows at <=3 per item: 4 items, evenly 3/3/2/2.
        assert_eq!(
            ranges.iter().map(|r| r.rows).collect::<Vec<_>>(),
            vec![3, 3, 2, 2]
        );
        assert_eq!(ranges[0].start, 5);
        assert_eq!(ranges[0].first_line, 2);
        assert_eq!(ranges.last().unwrap().end, content.len() as u64);
        for w in ranges.windows(2) {
            assert_eq!(w[0].end, w[1].start, "ranges are contiguous");
        }
    }

    #[test]
    fn json_lines_are_cut_at_lines_with_no_header_and_blank_lines_skipped() {
        let lines: Vec<String> = (0..7)
            .map(|i| format!("{{\"id\":\"r{i}\",\"x\":{i}.5}}"))
            .collect();
        // CRLF and blank lines in places, and no line end after the last record.
        let content = format!(
            "{}\n\n{}\r\n{}\n{}\n\r\n{}\n{}\n{}",
            lines[0], lines[1], lines[2], lines[3], lines[4], lines[5], lines[6]
        );
        let (_d, p) = file(&content);
        let ranges = plan_jsonl(&p, ItemSizing::Rows(3)).unwrap();
        assert_eq!(
            ranges.iter().map(|r| r.rows).collect::<Vec<_>>(),
            vec![3, 2, 2]
        );
        assert_eq!((ranges[0].start, ranges[0].first_line), (0, 1));
        assert_eq!(ranges.last().unwrap().end, content.len() as u64);
        let seen: Vec<String> = ranges
            .iter()
            .flat_map(|r| {
                content[r.start as usize..r.end as usize]
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(seen, lines, "every record once, in order");
        for w in ranges.windows(2) {
            assert_eq!(w[0].end, w[1].start, "ranges are contiguous");
        }
        // Line numbers count blank lines: the second item starts at record 4 (line 5).
        let (_d, p2) = file("\n\n");
        assert!(plan_jsonl(&p2, ItemSizing::Rows(3)).unwrap().is_empty());
    }

    #[test]
    fn quoted_newlines_never_split_a_record() {
        let content = "id,text\n1,\"a\nb\"\n2,\"c,\n\nd\"\n3,e\n4,\"\"\"q\"\"\n\"\n";
        let (_d, p) = file(content);
        for per in 1..=4 {
            let ranges = plan_csv(&p, b',', ItemSizing::Rows(per)).unwrap();
            let flat = records_of(content, &ranges).concat();
            assert_eq!(
                flat,
                vec!["1|a\nb", "2|c,\n\nd", "3|e", "4|\"q\"\n"],
                "per={per}"
            );
        }
        let ranges = plan_csv(&p, b',', ItemSizing::Rows(1)).unwrap();
        assert_eq!(
            ranges.iter().map(|r| r.first_line).collect::<Vec<_>>(),
            vec![2, 4, 7, 8]
        );
    }

    #[test]
    fn last_line_without_newline_and_crlf() {
        let content = "id,x\r\n1,a\r\n2,b\r\n3,c";
        let (_d, p) = file(content);
        let ranges = plan_csv(&p, b',', ItemSizing::Rows(2)).unwrap();
        assert_eq!(
            records_of(content, &ranges).concat(),
            vec!["1|a", "2|b", "3|c"]
        );
        assert_eq!(ranges.last().unwrap().end, content.len() as u64);
    }

    #[test]
    fn empty_and_header_only_files_have_no_items() {
        for content in ["", "id,x\n", "id,x"] {
            let (_d, p) = file(content);
            assert!(
                plan_csv(&p, b',', ItemSizing::Rows(10)).unwrap().is_empty(),
                "{content:?}"
            );
            assert!(
                plan_csv(&p, b',', ItemSizing::Bytes(10))
                    .unwrap()
                    .is_empty(),
                "{content:?}"
            );
        }
    }

    #[test]
    fn byte_sizing_gives_even_items() {
        let content: String = std::iter::once("id,x\n".to_string())
            .chain((0..1000).map(|i| format!("{i:04},{i}\n")))
            .collect();
        let (_d, p) = file(&content);
        let ranges = plan_csv(&p, b',', ItemSizing::Bytes(2500)).unwrap();
        let body = content.len() as u64 - 5;
        assert_eq!(ranges.len() as u64, body.div_ceil(2500));
        let sizes: Vec<u64> = ranges.iter().map(|r| r.end - r.start).collect();
        let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(max - min <= 20, "uneven items: {sizes:?}");
        assert_eq!(records_of(&content, &ranges).concat().len(), 1000);
    }

    #[test]
    fn even_runs_never_split_an_element_and_cover_all() {
        assert_eq!(even_runs(&[10; 8], 20), vec![0..2, 2..4, 4..6, 6..8]);
        // ⌈80 / 25⌉ = 4 runs: as even as the budget allows, not 25 + 25 + 25 + 5.
        assert_eq!(even_runs(&[10; 8], 25), vec![0..2, 2..4, 4..6, 6..8]);
        // A heavy element is a run of its own; the rest still balance.
        assert_eq!(even_runs(&[1, 100, 1, 1, 1, 1], 50), vec![0..2, 2..6]);
        assert_eq!(even_runs(&[5, 5], 1000), vec![0..2]);
        assert!(even_runs(&[], 10).is_empty());
        assert_eq!(even_runs(&[0, 0, 0], 10), vec![0..3]);
        for (n, per) in [(97usize, 7u64), (1000, 333), (13, 1)] {
            let w: Vec<u64> = (0..n as u64).map(|i| 1 + i % 5).collect();
            let runs = even_runs(&w, per);
            assert_eq!(runs.first().unwrap().start, 0);
            assert_eq!(runs.last().unwrap().end, n);
            assert!(runs
                .windows(2)
                .all(|p| p[0].end == p[1].start && p[0].start < p[0].end));
            let total: u64 = w.iter().sum();
            assert!(runs.len() as u64 <= total.div_ceil(per));
        }
    }

    #[test]
    fn file_items_balance_bytes_not_counts() {
        // Two big files and ten small ones, two items by count: one big file
        // and the small ones ahead of it in one item, the other big file in the other.
        let mut sizes = vec![1000];
        sizes.extend([2; 10]);
        sizes.push(1000);
        let runs = file_runs(&sizes, ItemSizing::Rows(6));
        assert_eq!(runs.len(), 2);
        let bytes: Vec<u64> = runs.iter().map(|r| sizes[r.clone()].iter().sum()).collect();
        assert!(bytes[0].abs_diff(bytes[1]) <= 20, "{runs:?} {bytes:?}");
        // Equal files: equal counts; by bytes: about that many bytes per item.
        assert_eq!(
            file_runs(&[10; 9], ItemSizing::Rows(3)),
            vec![0..3, 3..6, 6..9]
        );
        assert_eq!(file_runs(&[10; 9], ItemSizing::Bytes(45)).len(), 2);
        // Empty files still count.
        assert_eq!(file_runs(&[0; 4], ItemSizing::Rows(2)), vec![0..2, 2..4]);
        assert!(file_runs(&[], ItemSizing::Rows(2)).is_empty());
    }

    fn parquet_file(rows: usize, group: usize) -> (tempfile::TempDir, PathBuf) {
        use batchfleet_testkit::fixtures::{f64_column, string_column, write_parquet};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("in.parquet");
        let ids: Vec<Option<String>> = (0..rows).map(|i| Some(format!("r{i}"))).collect();
        let x = f64_column((0..rows).map(|i| Some(i as f64)));
        write_parquet(&p, vec![("id", string_column(ids)), ("x", x)], group).unwrap();
        (dir, p)
    }

    fn groups_of(slices: &[InputSlice]) -> Vec<(u32, u32, u64, u64)> {
        slices
            .iter()
            .map(|s| match s {
                InputSlice::ParquetRowGroups {
                    first_group,
                    groups,
                    first_row,
                    rows,
                    ..
                } => (*first_group, *groups, *first_row, *rows),
                other => panic!("not a Parquet slice: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn parquet_items_are_runs_of_row_groups_from_the_footer() {
        // 10 groups of 100 rows and one of 50.
        let (_d, p) = parquet_file(1050, 100);
        let by_rows = groups_of(&plan_parquet(&p, ItemSizing::Rows(300)).unwrap());
        assert_eq!(
            by_rows,
            vec![
                (0, 3, 0, 300),
                (3, 3, 300, 300),
                (6, 2, 600, 200),
                (8, 3, 800, 250)
            ]
        );
        // Smaller than a row group: one group per item, never a split group.
        let single = groups_of(&plan_parquet(&p, ItemSizing::Rows(10)).unwrap());
        assert_eq!(single.len(), 11);
        assert_eq!(single[10], (10, 1, 1000, 50));
        // By compressed bytes: about as many items as the budget asks.
        let len = std::fs::metadata(&p).unwrap().len();
        let by_bytes = plan_parquet(&p, ItemSizing::Bytes(len / 4)).unwrap();
        assert!((3..=6).contains(&by_bytes.len()), "{by_bytes:?}");
        assert_eq!(by_bytes.iter().map(InputSlice::rows).sum::<u64>(), 1050);
        assert!(by_bytes.iter().all(|s| match s {
            InputSlice::ParquetRowGroups { file_len, .. } => *file_len == len,
            _ => false,
        }));
    }

    #[test]
    fn empty_parquet_files_have_no_items_and_garbage_is_named() {
        let (_d, p) = parquet_file(0, 100);
        assert!(plan_parquet(&p, ItemSizing::Rows(10)).unwrap().is_empty());
        let (_d2, bad) = file("id,x\n1,2\n");
        let e = plan_parquet(&bad, ItemSizing::Rows(10)).unwrap_err();
        assert!(
            e.to_string().contains("in.csv")
                && e.to_string().contains("not a readable Parquet file"),
            "{e}"
        );
    }

    #[test]
    fn other_delimiters() {
        let content = "id;x\n1;a\n2;b\n";
        let (_d, p) = file(content);
        let ranges = plan_csv(&p, b';', ItemSizing::Rows(1)).unwrap();
        assert_eq!(ranges.len(), 2);
        assert_eq!(ranges[1].start, 9);
    }
}
