//! A dry run of a job's model call at validation: the model loaded on the
//! CPU and called as workers will call it — the same arguments built the
//! same way, the same output selection, pooling and normalisation — on two
//! sample rows (two short texts through the job's tokenizer, or zeros for
//! features and pixels). What the model returns is a fact of the model, so
//! a call that cannot be written (a dict without the selected key, a
//! `[rows, L, D]` output without pooling, a shape that is not per row)
//! refuses the job before anything is published; a model that raises on
//! the made-up rows only warns, since real rows may be fine.

use crate::batch::Batch;
use crate::error::FailureClass;
use crate::runner::{predict, predict_tokens, TorchBackend};
use batchfleet_shared::message::{FailurePolicy, Layout, TaskSpec};

/// What the model returned for the sample rows.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Probed {
    /// Values per row written.
    pub width: usize,
    /// The selected outputs' column prefixes and widths (several selected).
    pub parts: Vec<(String, usize)>,
    /// The outputs are integers.
    pub integer: bool,
}

/// Why the probe did not return [`Probed`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ProbeFailure {
    /// The job cannot run as written (the reason names the setting to fix).
    Refused(String),
    /// Nothing certain: the model did not load here, or raised on the
    /// made-up rows. Workers will tell.
    Inconclusive(String),
}

/// Texts the probe tokenizes: one short, one shorter.
const SAMPLE_TEXTS: [&str; 2] = ["batchfleet checks the model call", "ok"];

/// Runs `task`'s model call on two sample rows on the CPU. A model for a
/// GPU runs in its saved precision here (the probe checks the call, not
/// the device's support of `dtype`).
pub fn probe(task: &TaskSpec) -> Result<Probed, ProbeFailure> {
    let mut model = task.model.clone();
    if model.device != "cpu" {
        model.device = "cpu".into();
        model.dtype = None;
    }
    let policy = FailurePolicy {
        isolate_poison_rows: false,
        ..FailurePolicy::default()
    };
    let mut backend = TorchBackend::new(0, 1);
    // A model this process cannot load (no libtorch for it, a file only
    // workers can read) says nothing about the call.
    if let Err(e) = crate::runner::Backend::load(&mut backend, &model) {
        return Err(ProbeFailure::Inconclusive(e.message));
    }
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if let Some(text) = &task.text {
            let cols = match &task.layout {
                Layout::Csv(l) => l.feature_columns.len(),
                Layout::Jsonl(j) => j.feature_keys.len(),
                Layout::Parquet(p) => p.feature_columns.len(),
                Layout::Image(_) => 0,
            };
            let mut batch = Batch::with_capacity(cols, SAMPLE_TEXTS.len());
            for (i, t) in SAMPLE_TEXTS.iter().enumerate() {
                batch.push(&format!("probe-{i}"), &vec![0.0; cols]);
                batch.push_text(t);
            }
            crate::reader::text::tokenize(&mut batch, text, model.wants_type_ids())?;
            let tokens = batch.tokens.as_ref().expect("tokenized");
            predict_tokens(
                &mut backend,
                &model,
                tokens,
                (&batch.features, cols),
                0..batch.rows(),
                SAMPLE_TEXTS.len(),
                &policy,
            )
        } else {
            let row_shape: Vec<usize> = match &task.layout {
                Layout::Csv(l) => vec![l.feature_columns.len()],
                Layout::Jsonl(j) => vec![j.feature_keys.len()],
                Layout::Parquet(p) => vec![p.feature_columns.len()],
                Layout::Image(i) => vec![i.channels as usize, i.height as usize, i.width as usize],
            };
            let values = vec![0f32; 2 * row_shape.iter().product::<usize>()];
            predict(&mut backend, &model, &values, &row_shape, 2, &policy)
        }
    }));
    match outcome {
        Err(_) => Err(ProbeFailure::Inconclusive(
            "libtorch panicked calling the model".into(),
        )),
        Ok(Ok(p)) => Ok(Probed {
            width: p.width,
            parts: p.parts,
            integer: p.integer,
        }),
        // The model returned something that cannot be written.
        Ok(Err(e)) if e.class == FailureClass::Unrunnable => Err(ProbeFailure::Refused(e.message)),
        // An operation without a kernel for the reduced precision on this device.
        Ok(Err(e)) if model.dtype.is_some() && e.message.contains("not implemented for") => {
            Err(ProbeFailure::Refused(format!(
                "model {} cannot run in {} on {}: {}; remove [model] dtype or run on a device that supports it",
                model.path,
                model.dtype.map_or("", |d| d.as_str()),
                model.device,
                e.message
            )))
        }
        Ok(Err(e)) => Err(ProbeFailure::Inconclusive(e.message)),
    }
}
