//! The wire format: what a work item carries and how it is encoded.
//!
//! A work item names data (a path and a byte range), never carries it. The body
//! is a versioned enum encoded with rmp-serde using named fields, so fields can
//! be added without breaking old workers; the delivery attempt travels in the
//! AMQP header [`ATTEMPT_HEADER`] because a retried message body is immutable.
//!
//! Version 3 carries the item alone and names its job's task by digest
//! ([`ItemRef`]): the task is stored once per job ([`StoredTask`]) and
//! fetched once per job by each worker. Version 4 ([`Bundle`], what is
//! published for jobs of many short items) carries several consecutive
//! items of one job the same way; each is still retried, committed and
//! dead-lettered alone, as the version 3 message it stands for. Version 2
//! carries the whole task with every item, the input's layout as one
//! tagged [`Layout`] — CSV columns, JSON Lines keys, Parquet columns or
//! image preprocessing — next to the tagged [`InputSlice`]; version 1
//! ([`v1`]: a CSV layout always, the others as optional fields) has it as
//! optional fields. Both are still decoded, and a worker seals an item
//! that came whole as version 2 again.
//!
//! # Layout
//! - this file: the envelope and its codec, the work item and its task,
//!   the failure policy, the AMQP headers.
//! - [`input`]: the input slice and the layout of its records.
//! - [`model`]: the model call (which model, its inputs, precision, outputs).
//! - [`output`]: the output spec, its column names and part file names.
//! - [`check`]: what one item may ask of a worker, checked before anything
//!   is read ([`ItemLimits`], `WorkItem::check`).
//! - [`seal`]: sealing (encode and sign) and opening (verify and decode), as
//!   one pair.
//! - [`task`]: the task stored once per job and the version 3 message that
//!   names it.
//! - [`bundle`]: version 4, several items of a job in one message.
//! - [`v1`]: version 1 of the message, still decoded.

pub mod v1;

mod bundle;
mod check;
mod input;
mod model;
mod output;
mod seal;
mod task;

pub use bundle::{
    bundle_size, Bundle, Member, BUNDLE_ROWS, DEFAULT_BUNDLE, MAX_BUNDLE, MIN_MESSAGES,
};
pub use check::{
    valid_job_id, ItemLimits, MAX_MODEL_INPUTS, MAX_SELECTED_OUTPUTS, MAX_TOKENS_PER_ROW,
};
pub use input::{
    ByteRange, CsvLayout, FileRef, ImageSpec, InputSlice, JsonLayout, Layout, Missing,
    ParquetLayout, TextSpec,
};
pub use model::{InputSource, ModelInput, ModelRef, Pooling, Precision, Selector, TensorType};
pub use output::{add_counts, part_file_name, HistogramSpec, OutputFormat, OutputSpec};
pub use seal::{open, seal, seal_bundle, seal_ref, OpenError, Sealed};
pub use task::{ItemRef, Opened, StoredTask, TaskError};

use serde::{Deserialize, Serialize};

/// AMQP content type of every work message.
pub const CONTENT_TYPE: &str = "application/msgpack";
/// AMQP `type` property of a [`Envelope::V1`] work item.
pub const MESSAGE_TYPE_V1: &str = "batchfleet.work_item.v1";
/// AMQP `type` property of a [`Envelope::V2`] work item (a whole item).
pub const MESSAGE_TYPE_V2: &str = "batchfleet.work_item.v2";
/// AMQP `type` property of a [`Envelope::V3`] work item (one item).
pub const MESSAGE_TYPE_V3: &str = "batchfleet.work_item.v3";
/// AMQP `type` property of a [`Envelope::V4`] message (a bundle of items).
pub const MESSAGE_TYPE_V4: &str = "batchfleet.work_bundle.v4";
/// Header with the 1-based delivery attempt, maintained by batchfleet itself
/// (RabbitMQ's `x-death` is not relied on: it is absent after a manual replay).
pub const ATTEMPT_HEADER: &str = "x-bf-attempt";
/// Header (1) on a copy of an item the coordinator published again (a lost
/// message, a dead worker's item, a straggler): its original may be done,
/// so a worker starts it through the start script, which checks. Unsigned:
/// it can only make a worker check more.
pub const COPY_HEADER: &str = "x-bf-copy";

/// Header of a handed-back message of an unknown job: when a worker first
/// found the job missing (ms), so the grace runs out however often it
/// returns. Sealed ([`SETTLE_HEADER`]) with the attempt when signing is on.
pub const UNKNOWN_SINCE_HEADER: &str = "x-bf-unknown-since";

/// Header sealing, with a signing key, the headers that change how an item
/// is settled — the attempt ([`ATTEMPT_HEADER`]) and the unknown-job grace
/// ([`UNKNOWN_SINCE_HEADER`]) — to the signed body (`x-bf-signature`): an
/// HMAC-SHA256 over those values and the body's signature. A worker that
/// holds a key ignores those headers when the seal is missing or wrong, so
/// whoever can publish cannot make a signed item dead-letter on its first
/// failure, or retry without end. Whoever publishes with the key seals.
pub const SETTLE_HEADER: &str = "x-bf-settle";
/// Work items: when the item was published (ms since epoch), for the queue-wait metric.
pub const PUBLISHED_HEADER: &str = "x-bf-published-ms";

/// Dead letters: job id of the item.
pub const JOB_HEADER: &str = "x-bf-job";
/// Dead letters: item seq.
pub const ITEM_HEADER: &str = "x-bf-item";
/// Dead letters and retries: failure class (`poison`, `transient`, `timeout`).
pub const CLASS_HEADER: &str = "x-bf-error-class";
/// Dead letters and retries: the last error message.
pub const ERROR_HEADER: &str = "x-bf-error";
/// Dead letters: the worker that gave up.
pub const WORKER_HEADER: &str = "x-bf-worker";
/// Dead letters: when (ms since epoch).
pub const DEAD_AT_HEADER: &str = "x-bf-dead-at";

/// Every message version a worker understands. New versions are added as new
/// variants; a worker rejects (dead-letters) a variant it does not know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
// Decoded once per message and turned into its item at once: boxing a
// variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Envelope {
    /// Version 1 of the work item (a CSV layout plus optional ones), still decoded.
    V1(v1::WorkItem),
    /// Version 2: the layout as one tagged enum, the task in every message.
    V2(WorkItem),
    /// Version 3: the item naming its job's stored task by digest.
    V3(ItemRef),
    /// Version 4: several items of one job naming its stored task.
    V4(Bundle),
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
    /// Each input file's version when the job was planned
    /// ([`crate::source::Fingerprint::version`]: `mtime:<ns>` or
    /// `etag:<etag>`), in the order of [`InputSlice::input_files`]; a worker
    /// that finds another fails the item rather than read a changed file.
    /// Empty: not checked (messages planned before versions were recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<String>,
    /// The digest of the job's stored task ([`StoredTask`]) this item names:
    /// set, it is sealed as version 3; `None`, as version 2 with the task
    /// inside. Never on the wire of version 2 itself.
    #[serde(skip)]
    pub task_sha256: Option<String>,
}

/// Everything a worker needs besides the input slice; identical for all items of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    /// The model to run.
    pub model: ModelRef,
    /// Where the id and the features are in a record, by input format.
    pub layout: Layout,
    /// Rows per `forward` call (with `auto_batch`, the size a worker
    /// that does not search uses).
    pub batch_size: u32,
    /// `inference_batch_size = "auto"`: each worker searches for its own
    /// mini-batch size per model. Serialized only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_batch: bool,
    /// Where and how predictions are written.
    pub output: OutputSpec,
    /// What to do when something fails.
    #[serde(default)]
    pub failure: FailurePolicy,
    /// Rows between checkpoints inside an item (a multiple of `batch_size`);
    /// 0 = none. A redelivered item resumes after its last checkpoint.
    #[serde(default)]
    pub checkpoint_rows: u32,
    /// Text input tokenized in the worker (`[input] text_column` with
    /// `[model] tokenizer`); `None` for numeric features and images.
    /// Serialized only when set, so other tasks keep their encoding (and
    /// their job ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextSpec>,
    /// A candidate model run beside `model` on the same rows
    /// (`[model.shadow]`); serialized only when set, as `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<crate::shadow::ShadowSpec>,
}

/// What a bad row does to its item.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRow {
    /// Write the row to the item's rejects file with the reason and go on.
    #[default]
    Reject,
    /// Fail the whole item (it is dead-lettered).
    FailItem,
}

/// The job's failure policy, carried by every item (from `[failure]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailurePolicy {
    /// Attempts of an item that fails transiently (or times out) before it is
    /// dead-lettered.
    pub max_attempts: u32,
    /// Delay before the second attempt, in ms; doubles per attempt.
    pub retry_base_ms: u64,
    /// Cap on the retry delay, in ms.
    pub retry_max_ms: u64,
    /// What a malformed row does.
    pub on_bad_row: OnBadRow,
    /// When `forward` raises on a mini-batch, bisect it to reject only the
    /// rows that make it raise.
    pub isolate_poison_rows: bool,
    /// Wall-time limit of one item on a worker, in ms.
    pub item_timeout_ms: u64,
    /// Substrings of model errors that mean "try again later" (transient),
    /// not "this input is bad" (poison).
    pub transient_errors: Vec<String>,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            retry_base_ms: 1_000,
            retry_max_ms: 300_000,
            on_bad_row: OnBadRow::Reject,
            isolate_poison_rows: true,
            item_timeout_ms: 600_000,
            transient_errors: vec![
                "CUBLAS_STATUS_ALLOC_FAILED".into(),
                "CUDNN_STATUS_ALLOC_FAILED".into(),
            ],
        }
    }
}

impl FailurePolicy {
    /// Delay before attempt `next` (2, 3, …): `base · 2^(next-2)`, capped, with
    /// "equal jitter" (uniform in [d/2, d]) so retries of a burst spread out.
    /// `unit` is a uniform random number in [0, 1).
    pub fn retry_delay_ms(&self, next: u32, unit: f64) -> u64 {
        let exp = next.saturating_sub(2).min(40);
        let d = self
            .retry_base_ms
            .saturating_mul(1u64 << exp)
            .min(self.retry_max_ms)
            .max(1);
        let half = d / 2;
        half + ((d - half) as f64 * unit.clamp(0.0, 1.0)) as u64
    }
}

/// Errors decoding a message body.
#[derive(Debug, thiserror::Error)]
#[error("undecodable work message ({len} bytes): {reason}")]
pub struct DecodeError {
    len: usize,
    reason: String,
}

/// The first bytes of a zstd frame: a body that starts with them is a
/// packed bundle ([`Envelope::encode_packed`]).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// Most bytes a packed body may unpack to (a bundle holds at most
/// [`MAX_BUNDLE`] items of about [`BUNDLE_ROWS`] rows in all).
pub const MAX_UNPACKED: usize = 16 << 20;
/// Bodies shorter than this are not worth packing.
const PACK_FROM: usize = 512;

impl Envelope {
    /// Encodes with named fields (maps, not arrays), so readers tolerate added fields.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("work items always serialize")
    }

    /// [`Envelope::encode`], packed with zstd where that makes it smaller —
    /// only a bundle ([`Envelope::V4`]) of some size is: its items repeat
    /// their field names and, mostly, their file's path, and pack to a
    /// fraction. A packed body is a zstd frame, told apart by its first
    /// bytes, so no header needs to say so (and the signature covers the
    /// bytes on the wire).
    pub fn encode_packed(&self) -> Vec<u8> {
        let plain = self.encode();
        if !matches!(self, Envelope::V4(_)) || plain.len() < PACK_FROM {
            return plain;
        }
        match zstd::bulk::compress(&plain, 3) {
            Ok(packed) if packed.len() < plain.len() => packed,
            _ => plain,
        }
    }

    /// Decodes a message body (a packed bundle unpacked first, to at most
    /// [`MAX_UNPACKED`] bytes).
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let fail = |reason: String| DecodeError {
            len: bytes.len(),
            reason,
        };
        if bytes.starts_with(&ZSTD_MAGIC) {
            let plain = zstd::bulk::decompress(bytes, MAX_UNPACKED).map_err(|e| {
                fail(format!(
                    "a packed body that does not unpack to at most {MAX_UNPACKED} bytes ({e})"
                ))
            })?;
            return match rmp_serde::from_slice(&plain) {
                Ok(bundle @ Envelope::V4(_)) => Ok(bundle),
                Ok(other) => Err(fail(format!(
                    "only bundles are packed, and this is {}",
                    other.kind()
                ))),
                Err(e) => Err(fail(e.to_string())),
            };
        }
        rmp_serde::from_slice(bytes).map_err(|e| fail(e.to_string()))
    }

    /// The AMQP `type` of a message of this version.
    pub fn kind(&self) -> &'static str {
        match self {
            Envelope::V1(_) => MESSAGE_TYPE_V1,
            Envelope::V2(_) => MESSAGE_TYPE_V2,
            Envelope::V3(_) => MESSAGE_TYPE_V3,
            Envelope::V4(_) => MESSAGE_TYPE_V4,
        }
    }

    /// What is inside, whatever the version: a whole item, or one naming
    /// its job's stored task.
    pub fn into_opened(self) -> Opened {
        match self {
            Envelope::V1(item) => Opened::Whole(item.into()),
            Envelope::V2(item) => Opened::Whole(item),
            Envelope::V3(r) => Opened::Ref(r),
            Envelope::V4(b) => Opened::Bundle(b),
        }
    }

    /// The whole work item inside a version 1 or 2 message; `None` for a
    /// version 3 or 4 one, whose task is stored apart.
    pub fn into_item(self) -> Option<WorkItem> {
        match self.into_opened() {
            Opened::Whole(item) => Some(item),
            Opened::Ref(_) | Opened::Bundle(_) => None,
        }
    }
}

#[cfg(test)]
pub(crate) fn sample_item() -> WorkItem {
    WorkItem {
        job_id: "scores-1a2b3c4d".into(),
        seq: 7,
        input: InputSlice::CsvRange(ByteRange {
            path: "/data/in/part-a.csv".into(),
            start: 18,
            end: 4096,
            first_line: 2,
            rows: 100,
            file_len: 8192,
            align: false,
        }),
        task: TaskSpec {
            model: ModelRef::plain("/models/mlp.pt", "ab".repeat(32), "cpu"),
            layout: Layout::Csv(CsvLayout {
                delimiter: b',',
                fields: 18,
                id_column: 0,
                feature_columns: (1..17).collect(),
                include_columns: Vec::new(),
                missing: Default::default(),
                header: Vec::new(),
            }),
            batch_size: 512,
            auto_batch: false,
            output: OutputSpec {
                dir: "/data/out".into(),
                format: OutputFormat::Csv,
                histogram: HistogramSpec::default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `sample_item` as version 1 encoded it: the CSV layout as `csv`.
    fn sample_v1() -> v1::WorkItem {
        let item = sample_item();
        let Layout::Csv(csv) = item.task.layout.clone() else {
            unreachable!("the sample is a CSV item")
        };
        v1::WorkItem {
            job_id: item.job_id,
            seq: item.seq,
            input: item.input,
            task: v1::TaskSpec {
                model: item.task.model,
                csv,
                batch_size: item.task.batch_size,
                auto_batch: false,
                output: item.task.output,
                failure: item.task.failure,
                checkpoint_rows: item.task.checkpoint_rows,
                text: item.task.text.clone(),
                shadow: None,
                jsonl: None,
                parquet: None,
                image: None,
            },
        }
    }

    #[test]
    fn v2_round_trips_with_the_layout_as_one_tagged_enum() {
        let env = Envelope::V2(sample_item());
        let bytes = env.encode();
        assert_eq!(Envelope::decode(&bytes).unwrap(), env);
        let as_json: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        let task = &as_json["V2"]["task"];
        assert_eq!(task["layout"]["Csv"]["fields"], 18);
        for gone in ["csv", "jsonl", "parquet", "image"] {
            assert!(task.get(gone).is_none(), "{gone} in {task}");
        }
    }

    #[test]
    fn version_1_messages_still_decode_into_the_same_item() {
        let bytes = Envelope::V1(sample_v1()).encode();
        let item = Envelope::decode(&bytes).unwrap().into_item();
        assert_eq!(item, Some(sample_item()));
        // Each optional layout of version 1 picks its variant, images first.
        let mut v1 = sample_v1();
        let keys = JsonLayout {
            id_key: "id".into(),
            feature_keys: vec!["a".into(), "b".into()],
            include_keys: Vec::new(),
            missing: Default::default(),
        };
        v1.task.jsonl = Some(keys.clone());
        let task: TaskSpec = v1.task.clone().into();
        assert_eq!(task.layout, Layout::Jsonl(keys));
        v1.task.jsonl = None;
        let columns = ParquetLayout {
            id_column: "id".into(),
            feature_columns: vec!["a".into()],
            include_columns: Vec::new(),
            missing: Default::default(),
        };
        v1.task.parquet = Some(columns.clone());
        assert_eq!(
            TaskSpec::from(v1.task.clone()).layout,
            Layout::Parquet(columns)
        );
        let image = ImageSpec {
            height: 8,
            width: 8,
            channels: 1,
            mean: vec![0.0],
            std: vec![1.0],
        };
        v1.task.image = Some(image.clone());
        assert_eq!(TaskSpec::from(v1.task).layout, Layout::Image(image));
    }

    #[test]
    fn parquet_items_round_trip() {
        let mut item = sample_item();
        item.input = InputSlice::ParquetRowGroups {
            path: "/data/in.parquet".into(),
            first_group: 4,
            groups: 2,
            first_row: 40_000,
            rows: 20_000,
            file_len: 1 << 20,
        };
        item.task.layout = Layout::Parquet(ParquetLayout {
            id_column: "id".into(),
            feature_columns: vec!["a".into(), "b".into()],
            include_columns: Vec::new(),
            missing: Default::default(),
        });
        let env = Envelope::V2(item);
        assert_eq!(Envelope::decode(&env.encode()).unwrap(), env);
        let item = env.into_item().unwrap();
        assert_eq!(item.input.rows(), 20_000);
        assert_eq!(item.input.path(), "/data/in.parquet");
    }

    #[test]
    fn byte_ranges_encode_as_the_inline_fields_they_replaced() {
        // The shape of the byte-range variants before `ByteRange` existed.
        #[derive(Serialize)]
        enum Inline {
            CsvRange {
                path: String,
                start: u64,
                end: u64,
                first_line: u64,
                rows: u64,
                file_len: u64,
            },
        }
        let inline = Inline::CsvRange {
            path: "/data/in.csv".into(),
            start: 18,
            end: 4096,
            first_line: 2,
            rows: 100,
            file_len: 8192,
        };
        let wrapped = InputSlice::CsvRange(ByteRange {
            path: "/data/in.csv".into(),
            start: 18,
            end: 4096,
            first_line: 2,
            rows: 100,
            file_len: 8192,
            align: false,
        });
        let old = rmp_serde::to_vec_named(&inline).unwrap();
        assert_eq!(rmp_serde::to_vec_named(&wrapped).unwrap(), old);
        assert_eq!(rmp_serde::from_slice::<InputSlice>(&old).unwrap(), wrapped);
    }

    #[test]
    fn encoding_uses_named_fields() {
        let bytes = Envelope::V2(sample_item()).encode();
        let as_json: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(as_json["V2"]["input"]["CsvRange"]["first_line"], 2);
        assert_eq!(as_json["V2"]["task"]["output"]["format"], "csv");
    }

    #[test]
    fn garbage_is_a_decode_error_not_a_panic() {
        let err = Envelope::decode(b"\xc1not msgpack").unwrap_err();
        assert!(err.to_string().contains("undecodable work message"));
    }

    #[test]
    fn retry_delays_grow_exponentially_with_jitter_up_to_the_cap() {
        let p = FailurePolicy {
            retry_base_ms: 1000,
            retry_max_ms: 5000,
            ..FailurePolicy::default()
        };
        assert_eq!(
            (p.retry_delay_ms(2, 0.0), p.retry_delay_ms(2, 0.999)),
            (500, 999)
        );
        assert_eq!(p.retry_delay_ms(3, 0.0), 1000);
        assert_eq!(p.retry_delay_ms(4, 0.0), 2000);
        assert_eq!(
            p.retry_delay_ms(9, 0.0),
            2500,
            "capped at 5000, jittered down to half"
        );
        assert!(p.retry_delay_ms(60, 1.0) <= 5000);
    }
}
