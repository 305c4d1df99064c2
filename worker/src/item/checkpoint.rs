//! Checkpoints inside an item: an item of more than `checkpoint_rows` rows
//! is predicted in segments of that many rows, and each finished segment is
//! published (atomically, first writer wins) as
//! `_partial/part-<seq>-<model digest>/seg-<start>-<end>.<format>` with its
//! model rejects beside it. A redelivered item uses the run of finished
//! segments from row 0 and predicts only the rest. Segment boundaries are
//! fixed by the manifest, so two copies of one item write identical segments
//! and either may continue the other's work.
//!
//! [`segments`] is that loop; the rest names and finds the segment files.
//!
//! Everything here is reached through the output folder's handle
//! ([`batchfleet_shared::fsutil`]): a link planted under `_partial/` is
//! refused, never followed.

use super::call;
use super::settle::Handled;
use super::signals::Signals;
use crate::batch::{Batch, Reject};
use crate::context::ItemContext;
use crate::error::{blocking, blocking_within, ItemError};
use crate::writer;
use batchfleet_shared::message::{OutputFormat, WorkItem};
use batchfleet_shared::metrics::names;
use batchfleet_shared::shadow::ShadowStats;
use batchfleet_shared::store::VectorStats;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub use batchfleet_shared::output::PARTIAL_DIR;

/// The checkpoint folder of item `seq` run with the model of digest `sha256`,
/// relative to the output folder.
pub fn item_dir(seq: u32, sha256: &str) -> PathBuf {
    let short: String = sha256.chars().take(12).collect();
    Path::new(PARTIAL_DIR).join(format!("part-{seq:06}-{short}"))
}

/// Removes an item's checkpoint folder `dir` (relative to the output folder
/// `out`), and `_partial/` itself once it holds no other item's: a copy
/// that loses the race may write its segments after the job's summary
/// removed `_partial/`, and must not leave it behind.
pub fn remove(out: &Path, dir: &Path) -> std::io::Result<()> {
    batchfleet_shared::fsutil::remove_tree_under(out, dir)?;
    batchfleet_shared::fsutil::remove_empty_dir_under(out, Path::new(PARTIAL_DIR))
}

/// `seg-<start>-<end>.csv` in an item's checkpoint folder `dir` (relative).
pub fn segment_path(dir: &Path, (start, end): (usize, usize), format: OutputFormat) -> PathBuf {
    dir.join(format!("seg-{start:09}-{end:09}.{}", format.extension()))
}

/// The model rejects recorded beside a segment.
pub fn segment_rejects(segment: &Path) -> PathBuf {
    segment.with_extension("rejects.jsonl")
}

/// Finished segments (row spans) and the model rejects recorded for them.
pub type Checkpoint = (Vec<(usize, usize)>, Vec<Reject>);

/// The finished segments of an item's checkpoint folder `dir` (relative to
/// the output folder `out`) that follow each other from row 0 on the
/// expected boundaries (anything else is ignored and recomputed), with the
/// model rejects recorded for them.
pub fn finished_segments(
    out: &Path,
    dir: &Path,
    seg: usize,
    rows: usize,
    format: OutputFormat,
) -> Result<Checkpoint, ItemError> {
    let unreadable = |e: std::io::Error| {
        ItemError::output_io(
            format!("cannot read the checkpoint {}", out.join(dir).display()),
            &e,
        )
    };
    let mut found = Vec::new();
    let mut rejects = Vec::new();
    let mut start = 0;
    while start < rows {
        let span = (start, (start + seg).min(rows));
        let path = segment_path(dir, span, format);
        if !batchfleet_shared::fsutil::exists_under(out, &path).map_err(unreadable)? {
            break;
        }
        rejects.extend(writer::read_rejects(out, &segment_rejects(&path)).map_err(unreadable)?);
        found.push(span);
        start = span.1;
    }
    Ok((found, rejects))
}

/// What an item's segments came to.
#[derive(Debug)]
pub(super) struct Segmented {
    /// Rows the model raised on (rejected).
    pub failed: usize,
    /// Their rejects, resumed segments' included.
    pub rejects: Vec<Reject>,
    /// Histogram of the predictions of every segment.
    pub hist: Vec<Vec<u64>>,
    /// Norms of the vectors written (`[output] vector`).
    pub vector: Option<VectorStats>,
    /// What the shadow model did beside the job's (`[model.shadow]`).
    pub shadow: Option<ShadowStats>,
    /// Rows the checkpoint already held.
    pub resumed: u64,
    /// Every segment's part file (relative), in row order.
    pub files: Vec<PathBuf>,
    /// The checkpoint folder (relative), to remove after the commit.
    pub dir: PathBuf,
}

/// Predicts `batch` segment by segment from the first row that no
/// finished segment holds, publishing each finished segment with its model
/// rejects. Between segments it stops for a faster copy's commit
/// (`AlreadyDone`, its segments removed), a shutdown (`Released`, segments
/// kept) or the job's cancellation (`Skipped`, segments kept for a run of
/// the job again). `budget` is the item's model time left; each segment's
/// write is bounded by `item_timeout` on its own.
pub(super) async fn segments(
    item: &WorkItem,
    attempt: u32,
    mut batch: Batch,
    signals: &Signals,
    ctx: &ItemContext,
    out: &Path,
    budget: &mut Duration,
) -> Result<Result<Segmented, Handled>, ItemError> {
    let format = item.task.output.format;
    let seg = item.task.checkpoint_rows as usize;
    let rows = batch.rows();
    let dir = item_dir(item.seq, &item.task.model.sha256);
    let (o, d) = (out.to_owned(), dir.clone());
    let (segments, mut model_rejects) =
        blocking(move || finished_segments(&o, &d, seg, rows, format)).await??;
    let resumed_files: Vec<PathBuf> = segments
        .iter()
        .map(|s| segment_path(&dir, *s, format))
        .collect();
    let (o, spec, files) = (
        out.to_owned(),
        item.task.output.clone(),
        resumed_files.clone(),
    );
    let (mut hist, mut vector) = blocking(move || {
        let (mut h, mut v) = (Vec::new(), None);
        for f in &files {
            let part = batchfleet_shared::output::histogram_under(&o, f, &spec)?;
            batchfleet_shared::message::add_counts(&mut h, &part.counts);
            v = VectorStats::merge(v, part.vector);
        }
        Ok::<_, std::io::Error>((h, v))
    })
    .await?
    .map_err(|e| {
        ItemError::output_io(
            format!("cannot read the checkpoint {}", out.join(&dir).display()),
            &e,
        )
    })?;
    let mut next = segments.last().map_or(0, |s| s.1);
    let resumed = next;
    if resumed > 0 {
        tracing::info!(
            rows_resumed = resumed,
            rows,
            "resuming the item from its checkpoint"
        );
    }
    signals
        .rows_resumed
        .store(resumed as u64, Ordering::Relaxed);
    signals.rows_done.store(resumed as u64, Ordering::Relaxed);
    let mut shadow = call::shadow_missed(item, resumed as u64);
    let mut files = resumed_files;
    let mut predicted = 0usize;
    let mut failed = model_rejects.len();
    while next < rows {
        if signals.done_elsewhere.is_cancelled() {
            // A faster copy committed: this copy's segments are not
            // needed (and the job's summary may already be written).
            let (o, d) = (out.to_owned(), dir.clone());
            let _ = blocking(move || remove(&o, &d)).await;
            return Ok(Err(Handled::AlreadyDone));
        }
        if ctx.shutdown.is_cancelled() {
            tracing::info!(
                rows_done = next,
                rows,
                "shutdown: the item goes back to the queue with its checkpoint"
            );
            return Ok(Err(Handled::Released));
        }
        if signals.job_stopped.is_cancelled() {
            // Cancelled: the finished segments stay for a run of the job
            // again to continue from.
            tracing::info!(
                rows_done = next,
                rows,
                "the job was cancelled: the item stops at this checkpoint"
            );
            return Ok(Err(Handled::Skipped));
        }
        let end = (next + seg).min(rows);
        let called = call::model(ctx, item, attempt, batch, next..end, budget, signals).await?;
        let preds = match called {
            Ok((b, p)) => {
                batch = b;
                p
            }
            Err(early) => return Ok(Err(early)),
        };
        let seg_rejects: Vec<_> = preds
            .failed
            .iter()
            .map(|(i, msg)| batch.model_reject(next + i, msg))
            .collect();
        failed += seg_rejects.len();
        vector = VectorStats::merge(vector, call::tally(&mut hist, item, &preds));
        shadow = ShadowStats::merge(shadow, call::shadow(item, &preds));
        let path = segment_path(&dir, (next, end), format);
        ctx.debug.check_disk(&out.join(&path))?;
        let (o, p, b, spec) = (
            out.to_owned(),
            path.clone(),
            batch,
            item.task.output.clone(),
        );
        let sr = seg_rejects.clone();
        let write_started = Instant::now();
        let item_timeout = Duration::from_millis(item.task.failure.item_timeout_ms);
        batch = blocking_within(item_timeout, "write", move || {
            // The segment's rejects first: its part file is what marks it finished.
            if !sr.is_empty() {
                writer::write_rejects(&o, &segment_rejects(&p), &sr)?;
            }
            let sync = batchfleet_shared::fsutil::NameSync::Now;
            writer::write_part_rows(&o, &p, &spec, &b, next..end, &preds, sync)?;
            Ok::<_, ItemError>(b)
        })
        .await??;
        metrics::histogram!(names::WORKER_WRITE).record(write_started.elapsed().as_secs_f64());
        model_rejects.extend(seg_rejects);
        files.push(path);
        predicted += end - next;
        next = end;
        signals.rows_done.store(next as u64, Ordering::Relaxed);
    }
    tracing::debug!(predicted, resumed, "segments finished");
    Ok(Ok(Segmented {
        failed,
        rejects: model_rejects,
        hist,
        vector,
        shadow,
        resumed: resumed as u64,
        files,
        dir,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reject(line: u64) -> Reject {
        Reject {
            file: "in.csv".into(),
            line,
            raw: "x".into(),
            reason: "model raised".into(),
            stage: "model".into(),
        }
    }

    #[test]
    fn a_checkpoint_is_the_run_of_finished_segments_from_row_0() {
        let out = tempfile::tempdir().unwrap();
        let o = out.path();
        let d = item_dir(3, &"ab".repeat(32));
        assert_eq!(
            finished_segments(o, &d, 200, 1000, OutputFormat::Csv)
                .unwrap()
                .0,
            vec![]
        );
        std::fs::create_dir_all(o.join(&d)).unwrap();
        for span in [(0, 200), (200, 400), (600, 800)] {
            std::fs::write(
                o.join(segment_path(&d, span, OutputFormat::Csv)),
                "id,score\n",
            )
            .unwrap();
        }
        writer::write_rejects(
            o,
            &segment_rejects(&segment_path(&d, (200, 400), OutputFormat::Csv)),
            &[reject(250)],
        )
        .unwrap();
        // 600..800 does not follow 400: it is not part of the checkpoint.
        let (spans, rejects) = finished_segments(o, &d, 200, 1000, OutputFormat::Csv).unwrap();
        assert_eq!(spans, vec![(0, 200), (200, 400)]);
        assert_eq!(rejects, vec![reject(250)]);
        // Boundaries of another segment size do not count.
        assert_eq!(
            finished_segments(o, &d, 300, 1000, OutputFormat::Csv)
                .unwrap()
                .0,
            vec![]
        );
    }

    #[test]
    fn a_linked_checkpoint_folder_is_refused() {
        let out = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), out.path().join(PARTIAL_DIR)).unwrap();
        let d = item_dir(1, &"cd".repeat(32));
        let e = finished_segments(out.path(), &d, 10, 100, OutputFormat::Csv).unwrap_err();
        assert_eq!(e.class, crate::error::FailureClass::Poison, "{e}");
        // A digest that is not ASCII cannot split a character.
        assert!(item_dir(1, "ééééééééé")
            .to_string_lossy()
            .contains("ééééééééé"));
    }
}
