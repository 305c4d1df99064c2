//! One model call as an item sees it: a turn at the model through the
//! context's gate ([`model`]), what came back turned into the batch and
//! its predictions or the item's early end, and what the item keeps of each
//! call — the histogram of its predictions, or its vectors' norms
//! ([`tally`]), and what a shadow model did beside it ([`shadow`]).

use super::settle::Handled;
use super::signals::Signals;
use crate::batch::{Batch, Reject};
use crate::context::{ItemContext, Predicted};
use crate::error::ItemError;
use crate::runner::Predictions;
use batchfleet_shared::message::{FailurePolicy, WorkItem};
use batchfleet_shared::shadow::{Outputs, ShadowStats};
use batchfleet_shared::store::VectorStats;
use std::ops::Range;
use std::time::Duration;

/// Runs the model on rows `rows` of `batch` within the item's model-time
/// `budget` (see [`ItemContext::predict`]): the batch back with its
/// predictions, or how the item ends early (`Err` inside: handed back or
/// released; `Err` outside: timed out or failed).
pub(super) async fn model(
    ctx: &ItemContext,
    item: &WorkItem,
    attempt: u32,
    batch: Batch,
    rows: Range<usize>,
    budget: &mut Duration,
    signals: &Signals,
) -> Result<Result<(Batch, Predictions), Handled>, ItemError> {
    let predicted = ctx
        .predict(item, attempt, batch, rows, budget, signals)
        .await;
    turn(predicted, &item.task.failure)
}

/// What a model call came back with: the batch and its predictions, or how
/// the item ends early — a timeout is the item's failure, a shutdown gives it
/// back, a wait for the model that took too long hands it to another worker,
/// an item committed elsewhere meanwhile ends as done.
fn turn(
    predicted: Predicted,
    policy: &FailurePolicy,
) -> Result<Result<(Batch, Predictions), Handled>, ItemError> {
    match predicted {
        Predicted::Done(b, p) => Ok(Ok((*b, p?))),
        Predicted::TimedOut => Err(timed_out(policy)),
        Predicted::Shutdown => Ok(Err(Handled::Released)),
        Predicted::WaitedTooLong => Ok(Err(Handled::HandedBack)),
        Predicted::DoneElsewhere => Ok(Err(Handled::AlreadyDone)),
    }
}

fn timed_out(policy: &FailurePolicy) -> ItemError {
    ItemError::timeout(format!(
        "the model call did not finish within item_timeout ({}s)",
        Duration::from_millis(policy.item_timeout_ms).as_secs_f64()
    ))
}

/// One warning for an item's rejected rows.
pub(super) fn log_rejects(rejects: &[Reject]) {
    if let Some(first) = rejects.first() {
        tracing::warn!(rejected = rejects.len(), first = %first.reason, "rows rejected");
    }
}

/// Adds predictions to the item's histogram, or, for a vector output,
/// returns the stats of their norms (no histogram per dimension).
pub(super) fn tally(
    hist: &mut Vec<Vec<u64>>,
    item: &WorkItem,
    preds: &Predictions,
) -> Option<VectorStats> {
    if item.task.output.vector.is_some() {
        return VectorStats::of(&preds.values, preds.width);
    }
    item.task
        .output
        .histogram
        .add(hist, &preds.values, preds.width);
    None
}

/// What the shadow model (`[model.shadow]`) did beside the job's on the
/// call's rows, for a job that has one: the two compared, or why the
/// shadow missed them. Its failure is never the item's.
pub(super) fn shadow(item: &WorkItem, preds: &Predictions) -> Option<ShadowStats> {
    let spec = item.task.shadow.as_ref()?;
    let rows = preds.values.len().checked_div(preds.width).unwrap_or(0);
    let predicted = rows.saturating_sub(preds.failed.len()) as u64;
    let Some(shadowed) = &preds.shadow else {
        return Some(ShadowStats::missed(
            predicted,
            "the shadow model was not run on these rows",
        ));
    };
    let stats = match &shadowed.result {
        Ok(p) => ShadowStats::compare(
            Outputs {
                values: &preds.values,
                width: preds.width,
            },
            Outputs {
                values: &p.values,
                width: p.width,
            },
            &item.task.output,
        ),
        Err(why) => ShadowStats::missed(
            predicted,
            format!("the shadow model {} did not run: {why}", spec.model.path),
        ),
    };
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    Some(stats.timed(nanos(shadowed.main), nanos(shadowed.shadow), rows as u64))
}

/// For a job with a shadow model: `rows` an earlier delivery computed,
/// which this one does not compare.
pub(super) fn shadow_missed(item: &WorkItem, rows: u64) -> Option<ShadowStats> {
    (item.task.shadow.is_some() && rows > 0).then(|| {
        ShadowStats::missed(
            rows,
            "rows an earlier delivery of their item computed are not compared again",
        )
    })
}
