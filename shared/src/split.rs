//! Byte ranges of text files cut blind, at offsets computed from the file's
//! size alone, and aligned to record boundaries by whoever reads them — the
//! rule of Hadoop's line input format: a range `[start, end)` owns every
//! record that *starts* inside it. Its reader skips the partial record it
//! begins in (the range starting at 0 skips a CSV header instead) and reads
//! past `end` to finish its last record. Records start at offset 0 and after
//! every `\n`, so this holds for JSON Lines always and for CSV whose quoted
//! fields hold no line break (see [`quoted_line_break`]).

use crate::message::ByteRange;
use crate::source::Input;
use std::io;

/// Bytes read past a range's end at a time, looking for its last record's end.
const OVERRUN: u64 = 64 << 10;

/// How far past its range's end a last record may run. A file with no line
/// end for longer (not line-delimited text, or one giant record) is refused
/// rather than read whole into one worker's memory.
pub const MAX_PAST_END: u64 = 64 << 20;

/// The records a blind range owns: the bytes `[begin, stop)` of the file,
/// every record in them starting inside the range.
#[derive(Debug, Clone, PartialEq)]
pub struct Aligned {
    /// Offset of the first owned record (`stop` when there is none).
    pub begin: u64,
    /// Offset just past the last owned record.
    pub stop: u64,
    /// The bytes `[begin, stop)`.
    pub bytes: Vec<u8>,
    /// Where the bytes read hold a `\r` that is not followed by `\n` (the
    /// CSV parser ends a record there, a blind cut does not).
    pub lone_cr: Option<u64>,
}

/// Reads the records `range` owns. `header`: the file starts with a header
/// line (CSV), which the range starting at 0 skips. A last record running
/// more than [`MAX_PAST_END`] past the range's end is an `InvalidData` error.
pub fn align(input: &Input, range: &ByteRange, header: bool) -> io::Result<Aligned> {
    let len = range.file_len;
    let (start, end) = (range.start.min(len), range.end.min(len));
    // Begin: 0 (after the header, if any), or just after the first line end
    // at or after `start - 1` (a record starting exactly at `start` is ours).
    let from = start.saturating_sub(1);
    let mut buf = input.read_range(from..end.max(from))?;
    let skip_first_line = start > 0 || header;
    let begin = if skip_first_line {
        match memchr::memchr(b'\n', &buf) {
            Some(i) => from + i as u64 + 1,
            // No line end before `end`: the record it is in began earlier
            // (or is the header), so none starts here.
            None => {
                return Ok(Aligned {
                    begin: end,
                    stop: end,
                    bytes: Vec::new(),
                    lone_cr: lone_cr(&buf).map(|i| from + i as u64),
                })
            }
        }
    } else {
        0
    };
    if begin >= end {
        return Ok(Aligned {
            begin: end,
            stop: end,
            bytes: Vec::new(),
            lone_cr: lone_cr(&buf).map(|i| from + i as u64),
        });
    }
    // Stop: just past the first line end at or after `end - 1`.
    let mut scanned = (end - 1 - from) as usize; // index in `buf` of byte `end - 1`
    let stop = loop {
        if let Some(i) = memchr::memchr(b'\n', &buf[scanned.min(buf.len())..]) {
            break from + (scanned + i) as u64 + 1;
        }
        let have = from + buf.len() as u64;
        if have >= len {
            break len; // the last record has no line end
        }
        if have - end >= MAX_PAST_END {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "no line end within {} MiB after byte {end}: a record that long, or a file that is not line-delimited text, is refused",
                    MAX_PAST_END >> 20
                ),
            ));
        }
        scanned = buf.len();
        let more = input.read_range(have..(have + OVERRUN).min(len))?;
        if more.is_empty() {
            break have;
        }
        buf.extend_from_slice(&more);
    };
    buf.truncate((stop - from) as usize);
    let lone_cr = lone_cr(&buf).map(|i| from + i as u64);
    buf.drain(..(begin - from) as usize);
    Ok(Aligned {
        begin,
        stop,
        bytes: buf,
        lone_cr,
    })
}

/// The first `\r` in `bytes` followed by something other than `\n` (one at
/// the very end is not judged).
pub fn lone_cr(bytes: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\r', bytes).find(|&i| bytes.get(i + 1).is_some_and(|b| *b != b'\n'))
}

/// Where `bytes` (CSV text cut at line ends) has a line with an odd number
/// of quotes: the offset of that line. In well-formed CSV the quotes of one
/// line pair up unless a quoted field holds a line break, and such a file
/// cannot be cut blind (a cut inside the field would start a record there).
/// Both sides of such a break show it — the line that opens the field and
/// the one that closes it — so a reader that finds none read whole records.
/// A stray quote inside an unquoted field shows the same way.
pub fn quoted_line_break(bytes: &[u8]) -> Option<usize> {
    memchr::memchr(b'"', bytes)?;
    let mut at = 0;
    for line in bytes.split_inclusive(|b| *b == b'\n') {
        if memchr::memchr_iter(b'"', line).count() % 2 == 1 {
            return Some(at);
        }
        at += line.len();
    }
    None
}

/// How many records a work item has: counted by the planner, or, for a
/// range cut blind, found by reading it (to check a part file left by an
/// earlier delivery against its item).
#[derive(Debug, Clone)]
pub enum ItemRows {
    /// As the planner counted.
    Known(u64),
    /// A range cut blind, of a CSV file (with this delimiter) or JSON Lines.
    Count {
        /// The range.
        range: ByteRange,
        /// `Some(delimiter)`: CSV with a header; `None`: JSON Lines.
        csv: Option<u8>,
    },
}

impl ItemRows {
    /// The rows of `item`.
    pub fn of(item: &crate::message::WorkItem) -> Self {
        use crate::message::{InputSlice, Layout};
        match (&item.input, &item.task.layout) {
            (InputSlice::CsvRange(r), Layout::Csv(l)) if r.align => ItemRows::Count {
                range: r.clone(),
                csv: Some(l.delimiter),
            },
            (InputSlice::JsonlRange(r), _) if r.align => ItemRows::Count {
                range: r.clone(),
                csv: None,
            },
            (input, _) => ItemRows::Known(input.rows()),
        }
    }

    /// The number (reads the range when it was cut blind).
    pub fn get(&self) -> io::Result<u64> {
        match self {
            ItemRows::Known(n) => Ok(*n),
            ItemRows::Count { range, csv } => {
                let input = Input::open(std::path::Path::new(&range.path))?;
                let aligned = align(&input, range, csv.is_some())?;
                count_records(&aligned.bytes, *csv)
            }
        }
    }
}

/// Records in `bytes` as the workers' readers count them (rows read plus
/// rows rejected): CSV records (`Some(delimiter)`; blank lines are none),
/// or JSON Lines lines that are not empty.
pub fn count_records(bytes: &[u8], csv: Option<u8>) -> io::Result<u64> {
    match csv {
        Some(delimiter) => {
            let mut rdr = csv::ReaderBuilder::new()
                .has_headers(false)
                .delimiter(delimiter)
                .flexible(true)
                .from_reader(bytes);
            let mut rec = csv::ByteRecord::new();
            let mut n = 0;
            while rdr
                .read_byte_record(&mut rec)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?
            {
                n += 1;
            }
            Ok(n)
        }
        None => Ok(bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.strip_suffix(b"\r").unwrap_or(l).is_empty())
            .count() as u64),
    }
}

/// 1-based line number of byte `at` of a file: one more than the line ends
/// before it. Read on demand (to name a bad row of a blind range), in chunks.
pub fn line_of(input: &Input, at: u64) -> io::Result<u64> {
    let mut lines = 1u64;
    let mut pos = 0u64;
    while pos < at {
        let to = (pos + (8 << 20)).min(at);
        let chunk = input.read_range(pos..to)?;
        if chunk.is_empty() {
            break;
        }
        lines += memchr::memchr_iter(b'\n', &chunk).count() as u64;
        pos += chunk.len() as u64;
    }
    Ok(lines)
}

/// Cut points of a `len`-byte file into `n` ranges: the first `skip`
/// bytes (a header) go to the first range and the rest is divided evenly.
/// `(start, end)` pairs covering `[0, len)`; none for an empty file.
pub fn cuts(len: u64, skip: u64, n: u64) -> Vec<(u64, u64)> {
    if len == 0 {
        return Vec::new();
    }
    let skip = skip.min(len);
    let (data, n) = (len - skip, n.max(1));
    let at = |k: u64| {
        if k == 0 {
            0
        } else {
            skip + data * k / n
        }
    };
    (0..n).map(|k| (at(k), at(k + 1))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(path: &str, start: u64, end: u64, len: u64) -> ByteRange {
        ByteRange {
            path: path.into(),
            start,
            end,
            first_line: 0,
            rows: 0,
            file_len: len,
            align: true,
        }
    }

    /// Every way of cutting `text` gives every record to exactly one range.
    #[test]
    fn any_cuts_give_every_record_to_exactly_one_range() {
        let dir = tempfile::tempdir().unwrap();
        for (text, header) in [
            ("id,a\n1,x\n22,yy\n\n333,\"z,z\"\n4444,w", true),
            ("id,a\r\n1,x\r\n2,y\r\n", true),
            ("{\"a\":1}\n{\"a\":22}\n\n{\"a\":333}\n", false),
            ("id,a\n", true),
            ("x\ny\n", false),
        ] {
            let path = dir.path().join("f");
            std::fs::write(&path, text).unwrap();
            let input = Input::open(&path).unwrap();
            let len = text.len() as u64;
            let expected: Vec<&str> = text
                .split_inclusive('\n')
                .skip(usize::from(header))
                .collect();
            for n in 1..=len + 1 {
                let mut got = String::new();
                let mut last_stop = None;
                for (s, e) in cuts(len, 3, n) {
                    let a = align(&input, &range("f", s, e, len), header).unwrap();
                    assert_eq!(a.bytes.len() as u64, a.stop - a.begin);
                    if !a.bytes.is_empty() {
                        if let Some(prev) = last_stop {
                            assert_eq!(a.begin, prev, "ranges meet: {text:?} in {n}");
                        }
                        last_stop = Some(a.stop);
                    }
                    got.push_str(std::str::from_utf8(&a.bytes).unwrap());
                }
                assert_eq!(got, expected.concat(), "{text:?} cut in {n}");
            }
        }
    }

    #[test]
    fn quoted_line_breaks_are_found_and_plain_quotes_are_not() {
        assert_eq!(
            quoted_line_break(b"1,\"a,b\"\n2,\"say \"\"hi\"\"\"\n"),
            None
        );
        assert_eq!(quoted_line_break(b"1,x\n2,\"a\nb\"\n"), Some(4));
        // A range that begins inside such a field sees its closing quote.
        assert_eq!(quoted_line_break(b"4,y\nb\",3\n"), Some(4));
        assert_eq!(quoted_line_break(b"no quotes\nat all\n"), None);
    }

    #[test]
    fn lone_carriage_returns_are_found() {
        assert_eq!(lone_cr(b"a\r\nb\r\n"), None);
        assert_eq!(lone_cr(b"a\rb\rc"), Some(1));
        assert_eq!(lone_cr(b"a\r"), None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // Old Mac line ends: no `\n` at all, so no range finds a record.
        std::fs::write(&path, "id,a\r1,x\r2,y\r").unwrap();
        let input = Input::open(&path).unwrap();
        let a = align(&input, &range("f", 0, 8, 15), true).unwrap();
        assert!(a.bytes.is_empty());
        assert_eq!(a.lone_cr, Some(4));
    }

    #[test]
    fn a_record_running_far_past_its_range_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let len = MAX_PAST_END + 200;
        std::fs::write(&path, vec![b'x'; len as usize]).unwrap();
        let input = Input::open(&path).unwrap();
        let err = align(&input, &range("f", 0, 100, len), false).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(
            err.to_string()
                .contains("no line end within 64 MiB after byte 100"),
            "{err}"
        );
    }

    #[test]
    fn lines_are_counted_on_demand() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "a\nb\nc\n").unwrap();
        let input = Input::open(&path).unwrap();
        assert_eq!(line_of(&input, 0).unwrap(), 1);
        assert_eq!(line_of(&input, 2).unwrap(), 2);
        assert_eq!(line_of(&input, 6).unwrap(), 4);
    }
}
