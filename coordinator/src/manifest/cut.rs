//! How a CSV or JSON Lines job is cut into items: blind, at byte offsets
//! from the files' sizes alone (the default: planning reads no data), or by
//! reading every record (`[input] quoted_newlines = true`, or when the
//! sample shows a quoted field with a line break, which a blind cut could
//! split; or a lone carriage return, where a blind cut finds no line end).
//! The sample — the first MiB of input, from the first files — gives the
//! mean record size and the header's length, from which each file's rows,
//! and so its items for `item_rows`, are estimated.

use super::schema::{InputFormat, Manifest};
use super::spec::BlindCut;
use super::Problems;
use batchfleet_shared::source::Input;
use std::path::PathBuf;

/// Bytes of input the sample reads at most.
const SAMPLE_BYTES: u64 = 1 << 20;
/// Files the sample reads at most.
const SAMPLE_FILES: usize = 16;

/// The blind cut of a CSV or JSON Lines job, or `None` when it is planned
/// by reading (other formats, `quoted_newlines`, line breaks in quoted
/// fields of the sample, or a sample with no record to measure).
pub(super) fn blind_cut(
    m: &Manifest,
    files: &[PathBuf],
    problems: &mut Problems,
) -> Option<BlindCut> {
    if m.input.quoted_newlines && m.input.format != InputFormat::Csv {
        problems.add(
            "[input] quoted_newlines",
            "applies to format = \"csv\" only (JSON Lines records never hold a raw line break)"
                .into(),
        );
    }
    let csv = match m.input.format {
        _ if m.input.quoted_newlines => return None,
        InputFormat::Csv => true,
        InputFormat::Jsonl => false,
        InputFormat::Parquet | InputFormat::Files => return None,
    };
    let (mut bytes, mut rows, mut header_bytes) = (0u64, 0u64, None);
    for path in files.iter().take(SAMPLE_FILES) {
        let left = SAMPLE_BYTES.saturating_sub(bytes);
        if left == 0 {
            break;
        }
        let sample = match Input::open(path).and_then(|i| {
            let len = i.len()?;
            let data = i.read_range(0..len.min(left))?;
            Ok((len, data))
        }) {
            Ok(s) => s,
            Err(e) => {
                problems.add(
                    "[input] paths",
                    format!("{}: cannot read a sample: {e}", path.display()),
                );
                return None;
            }
        };
        let (len, data) = sample;
        if csv && batchfleet_shared::split::lone_cr(&data).is_some() {
            tracing::info!(file = %path.display(), "a lone carriage return (old Mac line ends?): the job is planned by reading its files");
            return None;
        }
        // Whole lines only (the last one may be cut by the sample's size).
        let data = if (data.len() as u64) < len {
            match memchr::memrchr(b'\n', &data) {
                Some(i) => &data[..=i],
                None => continue,
            }
        } else {
            &data[..]
        };
        let body = if csv {
            match memchr::memchr(b'\n', data) {
                Some(i) => {
                    header_bytes.get_or_insert(i as u64 + 1);
                    &data[i + 1..]
                }
                None => continue,
            }
        } else {
            data
        };
        if csv && batchfleet_shared::split::quoted_line_break(body).is_some() {
            tracing::info!(file = %path.display(), "a line with an unpaired quote (a quoted field with a line break?): the job is planned by reading its files (set [input] quoted_newlines = true to say so)");
            return None;
        }
        bytes += body.len() as u64;
        rows += body
            .split(|b| *b == b'\n')
            .filter(|l| !l.trim_ascii().is_empty())
            .count() as u64;
    }
    if rows == 0 {
        return None; // nothing to measure (empty or header-only files): read them
    }
    Some(BlindCut {
        bytes_per_row: bytes as f64 / rows as f64,
        header_bytes: header_bytes.unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use crate::manifest::testing::{problems, Fixture, GOOD};
    use crate::manifest::{BlindCut, ItemSizing};
    use std::fs;

    #[test]
    fn csv_is_cut_blind_unless_quoted_line_breaks_are_declared_or_sampled() {
        let fx = Fixture::new();
        let blind = fx.load(GOOD).unwrap();
        // Two files of "id,f0,f1,f2\n" (12 bytes) and one 14-byte record.
        assert_eq!(
            blind.blind,
            Some(BlindCut {
                bytes_per_row: 14.0,
                header_bytes: 12
            })
        );
        let declared = fx
            .load(&GOOD.replace("id_column", "quoted_newlines = true\nid_column"))
            .unwrap();
        assert_eq!(declared.blind, None);
        assert_ne!(declared.job_id, blind.job_id, "other items, another job");
        fs::write(
            fx.dir.path().join("data/b.csv"),
            "id,f0,f1,f2\n2,0.1,\"0.2\n\",0.3\n",
        )
        .unwrap();
        assert_eq!(fx.load(GOOD).unwrap().blind, None, "the sample shows one");
        fs::write(
            fx.dir.path().join("data/b.csv"),
            "id,f0,f1,f2\r2,0.1,0.2,0.3\r",
        )
        .unwrap();
        assert_eq!(fx.load(GOOD).unwrap().blind, None, "lone carriage returns");
        let p = problems(
            fx.load(
                &GOOD
                    .replace("format = \"csv\"", "format = \"jsonl\"")
                    .replace("id_column", "quoted_newlines = true\nid_column"),
            ),
        );
        assert!(
            p.contains("[input] quoted_newlines: applies to format = \"csv\" only"),
            "{p}"
        );
    }

    #[test]
    fn items_and_rows_are_estimated_from_sizes() {
        let cut = BlindCut {
            bytes_per_row: 10.0,
            header_bytes: 20,
        };
        // 1000 rows of 10 bytes after a 20-byte header.
        assert_eq!(cut.rows_of(10_020), 1_000);
        assert_eq!(cut.items_of(10_020, ItemSizing::Rows(250)), 4);
        assert_eq!(cut.items_of(10_020, ItemSizing::Rows(300)), 4);
        assert_eq!(cut.items_of(10_020, ItemSizing::Bytes(3_000)), 3);
        assert_eq!(cut.items_of(25, ItemSizing::Rows(250)), 1);
        assert_eq!(cut.items_of(0, ItemSizing::Bytes(3_000)), 1);
    }
}
