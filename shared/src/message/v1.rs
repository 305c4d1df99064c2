//! Version 1 of the work message, still decoded: a task with a CSV layout
//! always present and the other formats' layouts as optional fields beside
//! it. Version 2 ([`super::TaskSpec`]) carries one tagged [`super::Layout`]
//! instead; a version-1 item converts into it exactly as workers read it
//! (image settings, else JSON Lines keys, else Parquet columns, else CSV).
//!
//! The coordinator still builds a version-1 task first: job ids hash it, so
//! a job keeps its id across the change of wire format and a job started
//! before an upgrade resumes after it.

use super::{
    CsvLayout, FailurePolicy, ImageSpec, InputSlice, JsonLayout, Layout, ModelRef, OutputSpec,
    ParquetLayout, TextSpec,
};
use serde::{Deserialize, Serialize};

/// A version-1 work item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkItem {
    /// Stable job id (`<name>-<hash>`).
    pub job_id: String,
    /// Item number within the job.
    pub seq: u32,
    /// The slice of input this item covers.
    pub input: InputSlice,
    /// The task, version 1.
    pub task: TaskSpec,
}

/// A version-1 task: a CSV layout plus optional layouts of the other formats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    /// The model to run.
    pub model: ModelRef,
    /// Field layout of the CSV input.
    pub csv: CsvLayout,
    /// Rows per `forward` call.
    pub batch_size: u32,
    /// `inference_batch_size = "auto"` (here so such a job's id hashes it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_batch: bool,
    /// Where and how predictions are written.
    pub output: OutputSpec,
    /// What to do when something fails.
    #[serde(default)]
    pub failure: FailurePolicy,
    /// Rows between checkpoints inside an item.
    #[serde(default)]
    pub checkpoint_rows: u32,
    /// Keys of the id and the features, for JSON Lines input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jsonl: Option<JsonLayout>,
    /// Names of the id and feature columns, for Parquet input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parquet: Option<ParquetLayout>,
    /// How image files become a model input, for `files` input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    /// Text input and its tokenizer (added with version 2's text input;
    /// here so a text job's id hashes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextSpec>,
    /// The shadow model (`[model.shadow]`; here so a shadow job's id hashes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<crate::shadow::ShadowSpec>,
}

impl From<TaskSpec> for super::TaskSpec {
    fn from(t: TaskSpec) -> Self {
        let layout = match (t.image, t.jsonl, t.parquet) {
            (Some(image), ..) => Layout::Image(image),
            (None, Some(j), _) => Layout::Jsonl(j),
            (None, None, Some(p)) => Layout::Parquet(p),
            (None, None, None) => Layout::Csv(t.csv),
        };
        super::TaskSpec {
            model: t.model,
            layout,
            batch_size: t.batch_size,
            auto_batch: t.auto_batch,
            output: t.output,
            failure: t.failure,
            checkpoint_rows: t.checkpoint_rows,
            text: t.text,
            shadow: t.shadow,
        }
    }
}

impl From<WorkItem> for super::WorkItem {
    fn from(i: WorkItem) -> Self {
        super::WorkItem {
            job_id: i.job_id,
            seq: i.seq,
            input: i.input,
            task: i.task.into(),
            versions: Vec::new(),
            task_sha256: None,
        }
    }
}
