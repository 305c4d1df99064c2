//! `[batching]` and `[failure]`: how a job's input is cut into work items
//! and mini-batches (item sizing, batch size, checkpoints), and what happens
//! when something fails (retries and their delays, bad rows, poison rows,
//! item timeouts, transient errors, the job's error budget).

use super::schema::{BatchSizeSetting, BatchingSection, FailureSection};
use super::spec::{ErrorBudget, ItemSizing};
use super::Problems;
use batchfleet_shared::message::FailurePolicy;

/// Default rows per work item.
pub const DEFAULT_ITEM_ROWS: u64 = 10_000;
/// Default rows per `forward` call.
pub const DEFAULT_BATCH_SIZE: u32 = 1024;
/// Mini-batches between checkpoints inside an item when `[batching] checkpoint_every` is unset.
pub const DEFAULT_CHECKPOINT_EVERY: u32 = 4;

/// The validated `[batching]` section.
#[derive(Debug)]
pub(super) struct Batching {
    /// How input is cut into work items.
    pub(super) sizing: ItemSizing,
    /// Rows per `forward` call (`"auto"`: the default, for checkpoints
    /// and workers that do not search).
    pub(super) batch_size: u32,
    /// `inference_batch_size = "auto"`.
    pub(super) auto_batch: bool,
    /// Rows between checkpoints inside an item (0 = none).
    pub(super) checkpoint_rows: u32,
    /// Text input: padded tokens per `forward` call at most (0: no budget).
    pub(super) max_batch_tokens: u32,
}

/// Checks `[batching]`: one of `item_rows` and `item_bytes`, each at least 1,
/// and a batch size of at least 1. `text`: the job has text input, whose
/// rows are sorted by length within each model call, so its items are not
/// cut into checkpoint segments unless `checkpoint_every` says so (a
/// segment would sort only its own rows).
pub(super) fn batching(b: &BatchingSection, text: bool, problems: &mut Problems) -> Batching {
    let sizing = match (b.item_rows, b.item_bytes) {
        (Some(_), Some(_)) => {
            problems.add(
                "[batching] item_rows",
                "and item_bytes are both set; keep one".into(),
            );
            ItemSizing::Rows(DEFAULT_ITEM_ROWS)
        }
        (Some(0), _) => {
            problems.add("[batching] item_rows", "must be at least 1".into());
            ItemSizing::Rows(DEFAULT_ITEM_ROWS)
        }
        (_, Some(0)) => {
            problems.add("[batching] item_bytes", "must be at least 1".into());
            ItemSizing::Rows(DEFAULT_ITEM_ROWS)
        }
        (Some(r), None) => ItemSizing::Rows(r),
        (None, Some(bytes)) => ItemSizing::Bytes(bytes),
        (None, None) => ItemSizing::Rows(DEFAULT_ITEM_ROWS),
    };
    let (batch_size, auto_batch) = match &b.inference_batch_size {
        None => (DEFAULT_BATCH_SIZE, false),
        Some(BatchSizeSetting::Rows(n)) => (*n, false),
        Some(BatchSizeSetting::Word(w)) if w == "auto" => (DEFAULT_BATCH_SIZE, true),
        Some(BatchSizeSetting::Word(w)) => {
            problems.add(
                "[batching] inference_batch_size",
                format!("\"{w}\" is neither a number of rows nor \"auto\""),
            );
            (DEFAULT_BATCH_SIZE, false)
        }
    };
    if batch_size == 0 {
        problems.add(
            "[batching] inference_batch_size",
            "must be at least 1".into(),
        );
    }

    let default_every = if text { 0 } else { DEFAULT_CHECKPOINT_EVERY };
    let checkpoint_every = b.checkpoint_every.unwrap_or(default_every);
    match b.max_batch_tokens {
        Some(0) => problems.add(
            "[batching] max_batch_tokens",
            "must be at least 1 (or left out: mini-batches of inference_batch_size rows)".into(),
        ),
        Some(_) if !text => problems.add(
            "[batching] max_batch_tokens",
            "applies to text input only ([input] text_column with a [model] tokenizer); remove it"
                .into(),
        ),
        _ => {}
    }
    Batching {
        sizing,
        batch_size,
        auto_batch,
        checkpoint_rows: batch_size.saturating_mul(checkpoint_every),
        max_batch_tokens: b.max_batch_tokens.unwrap_or(0),
    }
}

/// Checks `[failure]`: the failure policy every item carries, and the error
/// budget of the job as a whole.
pub(super) fn failure(f: &FailureSection, problems: &mut Problems) -> (FailurePolicy, ErrorBudget) {
    let defaults = FailurePolicy::default();
    let mut duration = |field: &str, value: &Option<String>, default_ms: u64| -> u64 {
        match value {
            None => default_ms,
            Some(text) => match humantime::parse_duration(text) {
                Ok(d) if !d.is_zero() => d.as_millis() as u64,
                Ok(_) => {
                    problems.add(field, "must be longer than zero".into());
                    default_ms
                }
                Err(e) => {
                    problems.add(field, format!("\"{text}\" is not a duration ({e}); write e.g. \"500ms\", \"30s\", \"5m\""));
                    default_ms
                }
            },
        }
    };
    let retry_base_ms = duration(
        "[failure] retry_delay",
        &f.retry_delay,
        defaults.retry_base_ms,
    );
    let retry_max_ms = duration(
        "[failure] retry_max_delay",
        &f.retry_max_delay,
        defaults.retry_max_ms,
    );
    let item_timeout_ms = duration(
        "[failure] item_timeout",
        &f.item_timeout,
        defaults.item_timeout_ms,
    );
    if retry_max_ms < retry_base_ms {
        problems.add(
            "[failure] retry_max_delay",
            "is shorter than retry_delay; raise it or lower retry_delay".into(),
        );
    }
    let max_attempts = f.max_attempts.unwrap_or(defaults.max_attempts);
    if max_attempts == 0 {
        problems.add("[failure] max_attempts", "must be at least 1".into());
    }
    for (field, pct) in [
        ("[failure] max_failed_percent", f.max_failed_percent),
        ("[failure] max_rejected_percent", f.max_rejected_percent),
    ] {
        if let Some(pct) = pct.filter(|p| !(0.0..=100.0).contains(p)) {
            problems.add(
                field,
                format!("{pct} is not a percentage between 0 and 100"),
            );
        }
    }
    if f.transient_errors.iter().any(|p| p.trim().is_empty()) {
        problems.add(
            "[failure] transient_errors",
            "holds an empty pattern, which would match every error; remove it".into(),
        );
    }
    let mut transient_errors = defaults.transient_errors.clone();
    transient_errors.extend(f.transient_errors.iter().cloned());
    let failure = FailurePolicy {
        max_attempts,
        retry_base_ms,
        retry_max_ms,
        on_bad_row: f.on_bad_row.unwrap_or_default(),
        isolate_poison_rows: f.isolate_poison_rows.unwrap_or(true),
        item_timeout_ms,
        transient_errors,
    };
    let budget = ErrorBudget {
        max_failed_items: f.max_failed_items,
        max_failed_percent: f.max_failed_percent,
        max_rejected_rows: f.max_rejected_rows,
        max_rejected_percent: f.max_rejected_percent,
        max_crashes: f
            .max_crashes
            .unwrap_or(batchfleet_shared::store::DEFAULT_MAX_CRASHES),
    };
    (failure, budget)
}

#[cfg(test)]
mod tests {
    use crate::manifest::testing::{problems, Fixture, GOOD};

    #[test]
    fn batching_and_device_rules() {
        let fx = Fixture::new();
        let err = problems(
            fx.load(
                &GOOD
                    .replace("item_rows = 100", "item_rows = 100\nitem_bytes = 5")
                    .replace("inference_batch_size = 64", "inference_batch_size = 0")
                    .replace(
                        "path = \"model.pt\"",
                        "path = \"model.pt\"\ndevice = \"tpu\"",
                    ),
            ),
        );
        assert!(
            err.contains("item_rows: and item_bytes are both set"),
            "{err}"
        );
        assert!(
            err.contains("inference_batch_size: must be at least 1"),
            "{err}"
        );
        assert!(err.contains("[model] device: \"tpu\""), "{err}");
        // A token budget is for text input; 0 is no budget.
        let budget = |n: u32| {
            problems(fx.load(&GOOD.replace(
                "inference_batch_size = 64",
                &format!("inference_batch_size = 64\nmax_batch_tokens = {n}"),
            )))
        };
        assert!(
            budget(512).contains("[batching] max_batch_tokens: applies to text input only"),
            "{}",
            budget(512)
        );
        assert!(budget(0).contains("must be at least 1"), "{}", budget(0));
    }

    #[test]
    fn auto_batches_search_from_the_default_and_other_words_are_refused() {
        let fx = Fixture::new();
        let auto = fx
            .load(&GOOD.replace(
                "inference_batch_size = 64",
                "inference_batch_size = \"auto\"",
            ))
            .unwrap();
        assert!(auto.task.auto_batch);
        assert_eq!(auto.task.batch_size, super::DEFAULT_BATCH_SIZE);
        let fixed = fx.load(GOOD).unwrap();
        assert!(!fixed.task.auto_batch);
        assert_ne!(auto.job_id, fixed.job_id, "another batching, another job");
        let err = problems(fx.load(&GOOD.replace(
            "inference_batch_size = 64",
            "inference_batch_size = \"fast\"",
        )));
        assert!(
            err.contains("inference_batch_size: \"fast\" is neither a number of rows nor \"auto\""),
            "{err}"
        );
    }
}
