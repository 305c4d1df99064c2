//! A preview of a job on a few of its rows, in this process
//! (`batchfleet plan --sample N`): items read, parsed and tokenized with the
//! worker's own code, their first rows predicted on the CPU by one thread
//! with the job's model, written as the job would write them (as CSV, for
//! reading), and timed — so a user sees what the fleet will produce, and
//! how fast one core goes, before anything is published.

use crate::batch::Batch;
use crate::error::ItemError;
use crate::runner::{predict, predict_tokens, Backend, TorchBackend};
use batchfleet_shared::message::{OutputFormat, WorkItem};
use std::path::Path;
use std::time::Instant;

/// What one item gave.
#[derive(Debug, Clone, Default)]
pub struct Preview {
    /// The CSV header of the rows (the job's output columns).
    pub header: String,
    /// The rows picked, as CSV lines in the job's output columns.
    pub lines: Vec<String>,
    /// Rows the item held (all read and parsed).
    pub rows_read: usize,
    /// Seconds reading and parsing (and tokenizing) them took.
    pub read_s: f64,
    /// Rows predicted (the first of the item, at most the cap).
    pub rows_predicted: usize,
    /// Seconds the model calls took on them.
    pub forward_s: f64,
    /// Rows rejected while reading (bad rows).
    pub rows_rejected: usize,
}

/// Runs items of one job: one model, loaded once, on one CPU thread.
pub struct Sampler {
    backend: TorchBackend,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").finish_non_exhaustive()
    }
}

impl Default for Sampler {
    fn default() -> Self {
        Self::new()
    }
}

impl Sampler {
    /// A sampler whose libtorch runs on one thread (a per-core figure).
    pub fn new() -> Self {
        Self {
            backend: TorchBackend::new(1, 1),
        }
    }

    /// Reads `item`, predicts its first `cap` rows (at least `take`) and
    /// returns `take` of them spread evenly, with the timings.
    pub fn item(&mut self, item: &WorkItem, take: usize, cap: usize) -> Result<Preview, ItemError> {
        let task = &item.task;
        let mut model = task.model.clone();
        // A preview runs where the coordinator runs: on the CPU, as saved.
        if model.device != "cpu" {
            model.device = "cpu".into();
            model.dtype = None;
        }
        Backend::load(&mut self.backend, &model)?;
        let started = Instant::now();
        let mut batch: Batch = crate::reader::read(
            &item.input,
            &task.layout,
            task.text.as_ref(),
            task.failure.on_bad_row,
        )?;
        if let Some(text) = &task.text {
            crate::reader::text::tokenize(&mut batch, text, model.wants_type_ids())?;
        }
        let read_s = started.elapsed().as_secs_f64();
        let rows_read = batch.rows();
        let n = rows_read.min(cap.max(take));
        let batch_size = task.batch_size.max(1) as usize;
        let started = Instant::now();
        let preds = match &batch.tokens {
            Some(tokens) => predict_tokens(
                &mut self.backend,
                &model,
                tokens,
                (&batch.features, batch.cols),
                0..n,
                batch_size,
                &task.failure,
            )?,
            None => predict(
                &mut self.backend,
                &model,
                batch.features.get(..n * batch.cols).unwrap_or_default(),
                &batch.row_shape(),
                batch_size,
                &task.failure,
            )?,
        };
        let forward_s = started.elapsed().as_secs_f64();
        // Written as the job writes a part (labels, top-k, copied columns),
        // in CSV to be read, into a folder of its own that goes with it.
        let folder = Scratch::new().map_err(|e| {
            ItemError::transient(format!("a temporary folder for the preview: {e}"))
        })?;
        let mut output = task.output.clone();
        output.format = OutputFormat::Csv;
        let part = Path::new("preview.csv");
        crate::writer::write_part_rows(
            &folder.0,
            part,
            &output,
            &batch,
            0..n,
            &preds,
            batchfleet_shared::fsutil::NameSync::Now,
        )?;
        let text = std::fs::read_to_string(folder.0.join(part))
            .map_err(|e| ItemError::transient(format!("reading the preview back: {e}")))?;
        let mut lines = text.lines();
        let header = lines.next().unwrap_or_default().to_owned();
        let all: Vec<&str> = lines.collect();
        Ok(Preview {
            header,
            lines: spread(all.len(), take)
                .into_iter()
                .map(|i| all[i].to_owned())
                .collect(),
            rows_read,
            read_s,
            rows_predicted: n,
            forward_s,
            rows_rejected: batch.rejects.len(),
        })
    }
}

/// A folder of its own under the temporary folder, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "batchfleet-sample-{}-{:016x}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `take` indices spread evenly over `0..len` (all of them when fewer).
pub fn spread(len: usize, take: usize) -> Vec<usize> {
    if take >= len {
        return (0..len).collect();
    }
    (0..take).map(|k| k * len / take).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_spread_evenly_and_never_twice() {
        assert_eq!(spread(10, 3), [0, 3, 6]);
        assert_eq!(spread(3, 5), [0, 1, 2]);
        assert_eq!(spread(100, 4), [0, 25, 50, 75]);
        assert!(spread(0, 3).is_empty());
    }
}
