//! The wire format: what a work item carries and how it is encoded.
//!
//! A work item names data (a path and a byte range), never carries it. The body
//! is a versioned enum encoded with rmp-serde using named fields, so fields can
//! be added without breaking old workers; the delivery attempt travels in the
//! AMQP header [`ATTEMPT_HEADER`] because a retried message body is immutable.

use serde::{Deserialize, Serialize};

/// AMQP content type of every work message.
pub const CONTENT_TYPE: &str = "application/msgpack";
/// AMQP `type` property of a [`Envelope::V1`] work item.
pub const MESSAGE_TYPE_V1: &str = "batchfleet.work_item.v1";
/// Header with the 1-based delivery attempt, maintained by batchfleet itself
/// (RabbitMQ's `x-death` is not relied on: it is absent after a manual replay).
pub const ATTEMPT_HEADER: &str = "x-bf-attempt";

/// Every message version a worker understands. New versions are added as new
/// variants; a worker rejects (dead-letters) a variant it does not know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Envelope {
    /// Version 1 of the work item.
    V1(WorkItem),
}

/// One independently processable unit of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkItem {
    /// Stable job id (`<name>-<hash>`).
    pub job_id: String,
    /// Item number within the job, 0-based, dense.
    pub seq: u32,
    /// The slice of input this item covers.
    pub input: InputSlice,
    /// How to turn rows into features and predictions into output.
    pub task: TaskSpec,
}

/// A slice of one input file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum InputSlice {
    /// Records of a CSV file whose bytes lie in `[start, end)`; `start` is the
    /// first byte of a record and `end` the first byte after the last one.
    CsvRange {
        /// Absolute path of the file.
        path: String,
        /// Byte offset of the first record.
        start: u64,
        /// Byte offset just past the last record.
        end: u64,
        /// 1-based line number of the first record, for error messages.
        first_line: u64,
        /// Number of records in the range, as counted by the planner.
        rows: u64,
        /// File length when planned; a different length means the file changed.
        file_len: u64,
    },
}

impl InputSlice {
    /// Number of input rows the planner counted in this slice.
    pub fn rows(&self) -> u64 {
        match self {
            InputSlice::CsvRange { rows, .. } => *rows,
        }
    }

    /// The input file this slice reads.
    pub fn path(&self) -> &str {
        match self {
            InputSlice::CsvRange { path, .. } => path,
        }
    }
}

/// Everything a worker needs besides the input slice; identical for all items of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    /// The model to run.
    pub model: ModelRef,
    /// Field layout of the CSV input.
    pub csv: CsvLayout,
    /// Rows per `forward` call.
    pub batch_size: u32,
    /// Where and how predictions are written.
    pub output: OutputSpec,
}

/// A TorchScript model, identified by path and content digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelRef {
    /// Absolute path of the TorchScript file.
    pub path: String,
    /// SHA-256 of the file (hex); the worker refuses a file that does not match.
    pub sha256: String,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
}

/// Which CSV fields hold the id and the features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CsvLayout {
    /// Field delimiter byte.
    pub delimiter: u8,
    /// Number of fields in the header; every record must have exactly this many.
    pub fields: u32,
    /// Index of the id field.
    pub id_column: u32,
    /// Indices of the feature fields, in model input order.
    pub feature_columns: Vec<u32>,
}

/// Output format of part files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// Comma-separated values with a header row.
    Csv,
}

impl OutputFormat {
    /// File extension of a part file.
    pub fn extension(self) -> &'static str {
        match self {
            OutputFormat::Csv => "csv",
        }
    }
}

/// Where predictions go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputSpec {
    /// Absolute output directory of the job.
    pub dir: String,
    /// Part file format.
    pub format: OutputFormat,
}

impl OutputSpec {
    /// File name of the part file for item `seq`.
    pub fn part_name(&self, seq: u32) -> String {
        part_file_name(seq, self.format)
    }
}

/// `part-000042.csv`: the committed output of one item.
pub fn part_file_name(seq: u32, format: OutputFormat) -> String {
    format!("part-{seq:06}.{}", format.extension())
}

/// Errors decoding a message body.
#[derive(Debug, thiserror::Error)]
#[error("undecodable work message ({len} bytes): {source}")]
pub struct DecodeError {
    len: usize,
    #[source]
    source: rmp_serde::decode::Error,
}

impl Envelope {
    /// Encodes with named fields (maps, not arrays), so readers tolerate added fields.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("work items always serialize")
    }

    /// Decodes a message body.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        rmp_serde::from_slice(bytes).map_err(|source| DecodeError {
            len: bytes.len(),
            source,
        })
    }

    /// The work item inside, whatever the version.
    pub fn into_item(self) -> WorkItem {
        match self {
            Envelope::V1(item) => item,
        }
    }
}

#[cfg(test)]
pub(crate) fn sample_item() -> WorkItem {
    WorkItem {
        job_id: "scores-1a2b3c4d".into(),
        seq: 7,
        input: InputSlice::CsvRange {
            path: "/data/in/part-a.csv".into(),
            start: 18,
            end: 4096,
            first_line: 2,
            rows: 100,
            file_len: 8192,
        },
        task: TaskSpec {
            model: ModelRef {
                path: "/models/mlp.pt".into(),
                sha256: "ab".repeat(32),
                device: "cpu".into(),
            },
            csv: CsvLayout {
                delimiter: b',',
                fields: 18,
                id_column: 0,
                feature_columns: (1..17).collect(),
            },
            batch_size: 512,
            output: OutputSpec {
                dir: "/data/out".into(),
                format: OutputFormat::Csv,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_round_trips() {
        let env = Envelope::V1(sample_item());
        let bytes = env.encode();
        assert_eq!(Envelope::decode(&bytes).unwrap(), env);
    }

    #[test]
    fn encoding_uses_named_fields() {
        let bytes = Envelope::V1(sample_item()).encode();
        let as_json: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(as_json["V1"]["input"]["CsvRange"]["first_line"], 2);
        assert_eq!(as_json["V1"]["task"]["output"]["format"], "csv");
    }

    #[test]
    fn garbage_is_a_decode_error_not_a_panic() {
        let err = Envelope::decode(b"\xc1not msgpack").unwrap_err();
        assert!(err.to_string().contains("undecodable work message"));
    }

    #[test]
    fn part_names_sort_in_item_order() {
        assert_eq!(part_file_name(42, OutputFormat::Csv), "part-000042.csv");
        assert!(part_file_name(9, OutputFormat::Csv) < part_file_name(10, OutputFormat::Csv));
    }
}
