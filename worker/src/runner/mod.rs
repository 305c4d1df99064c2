//! The model runner: libtorch on its own OS thread, behind the small
//! synchronous [`Backend`] trait. Async code sends a request over a bounded
//! channel and awaits a oneshot reply, so the tokio runtime never blocks on
//! `forward`.
//!
//! # Layout
//! - [`backend`]: the [`Backend`] trait and what crosses it.
//! - [`predict`]: the algorithms over single calls — mini-batches,
//!   out-of-memory halving, poison-row isolation, dynamic padding.
//! - [`torch`]: the libtorch backend ([`TorchBackend`]): loading, caching,
//!   tensors, output selection, error classes, queued GPU runs.
//! - [`aoti`]: AOTInductor packages through libtorch's own loader.
//! - [`precision`]: the TF32 switch for CUDA matrix multiplications.
//! - [`auto`]: `inference_batch_size = "auto"`, each runner's search for
//!   its mini-batch size per model.
//! - this file: the runner thread ([`ModelRunner`]) and its requests.

mod aoti;
mod auto;
mod backend;
mod precision;
mod predict;
mod torch;

pub use backend::{Arg, ArgValues, Backend, Delayed, ForwardError, Forwarded, Ran};
pub use precision::set_tf32;
pub use predict::{predict, predict_tokens, Predictions, Shadowed};
pub use torch::{TorchBackend, DEFAULT_MODELS_KEPT};

use crate::batch::Batch;
use crate::error::ItemError;
use batchfleet_shared::message::{FailurePolicy, ModelRef};
use batchfleet_shared::metrics::names;
use tokio::sync::{mpsc, oneshot};

struct Request {
    model: ModelRef,
    /// Run beside `model` on the same rows (`[model.shadow]`).
    shadow: Option<ModelRef>,
    batch: Batch,
    rows: std::ops::Range<usize>,
    batch_size: BatchSize,
    policy: FailurePolicy,
    /// Only load the model (no rows).
    load_only: bool,
    /// Testing aid: panic on the runner thread instead of predicting.
    inject_panic: bool,
    reply: oneshot::Sender<(Batch, Result<Predictions, ItemError>)>,
}

/// Predicts rows `rows` of `batch` with `model`: its tokens, or its
/// features (see [`predict_tokens`], [`predict`]).
fn run_model<B: Backend>(
    backend: &mut B,
    model: &ModelRef,
    batch: &Batch,
    rows: std::ops::Range<usize>,
    batch_size: usize,
    policy: &FailurePolicy,
) -> Result<Predictions, ItemError> {
    if let Some(tokens) = &batch.tokens {
        return predict_tokens(
            backend,
            model,
            tokens,
            (&batch.features, batch.cols),
            rows,
            batch_size,
            policy,
        );
    }
    let cols = batch.cols;
    let features = batch
        .features
        .get(rows.start * cols..rows.end * cols)
        .unwrap_or_default();
    predict(
        backend,
        model,
        features,
        &batch.row_shape(),
        batch_size,
        policy,
    )
}

/// A panic on the runner thread running `model`, as the item's failure.
fn panicked(model: &ModelRef, payload: &(dyn std::any::Any + Send)) -> ItemError {
    metrics::counter!(names::WORKER_PANICS, "where" => "runner").increment(1);
    ItemError::panic(format!(
        "the model runner panicked running {}: {}",
        model.path,
        crate::error::panic_message(payload)
    ))
}

/// Rows per `forward` call: the job's fixed `inference_batch_size`, or
/// the runner's own search per model (`"auto"`, see [`auto`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchSize {
    /// This many rows.
    Fixed(usize),
    /// What the runner's search says.
    Auto,
}

impl BatchSize {
    /// A task's: `inference_batch_size`, or `"auto"`.
    pub fn of(task: &batchfleet_shared::message::TaskSpec) -> Self {
        if task.auto_batch {
            Self::Auto
        } else {
            Self::Fixed(task.batch_size as usize)
        }
    }
}

/// Whether the device `model` runs on is nearly out of memory (a GPU
/// whose memory NVML reports at least [`auto::MEMORY_FULL`] used).
fn memory_full(model: &ModelRef) -> bool {
    model.device.starts_with("cuda")
        && crate::gpu::used_fraction().is_some_and(|f| f >= auto::MEMORY_FULL)
}

/// Handle to a runner thread; cheap to clone.
#[derive(Debug, Clone)]
pub struct ModelRunner {
    tx: mpsc::Sender<Request>,
}

impl ModelRunner {
    /// Starts a runner thread. `make_backend` runs on that thread, so
    /// thread-local libtorch settings apply to every later call. The thread
    /// ends once every handle is dropped and its current call returns.
    pub fn spawn<B, F>(make_backend: F) -> std::io::Result<Self>
    where
        B: Backend,
        F: FnOnce() -> B + Send + 'static,
    {
        // Callers take turns through a gate (see `consumer`), so one slot suffices.
        let (tx, mut rx) = mpsc::channel::<Request>(1);
        std::thread::Builder::new()
            .name("model-runner".into())
            .spawn(move || {
                let mut backend = make_backend();
                let mut autos = auto::AutoBatches::default();
                let mut shadow_turn = false;
                while let Some(req) = rx.blocking_recv() {
                    let Request {
                        model,
                        shadow,
                        batch,
                        rows,
                        batch_size,
                        policy,
                        load_only,
                        inject_panic,
                        reply,
                    } = req;
                    // A panic in the backend (a bug a model or an input
                    // reaches) fails this request, not the thread: the item
                    // is settled like any failed item and the runner goes on.
                    let size = match batch_size {
                        BatchSize::Fixed(n) => n,
                        BatchSize::Auto => autos.of(&model).size(),
                    };
                    // The shadow's call, timed; never the item's failure:
                    // what went wrong is the shadow's, and its section of
                    // the summary says so.
                    let run_shadow = |backend: &mut B, shadow: &ModelRef| {
                        let started = std::time::Instant::now();
                        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            run_model(backend, shadow, &batch, rows.clone(), size, &policy)
                        }))
                        .unwrap_or_else(|payload| Err(panicked(shadow, payload.as_ref())))
                        .map_err(|e| e.message);
                        (out, started.elapsed())
                    };
                    // Every other call runs the shadow first, so neither
                    // model's time is always the one that finds the rows
                    // cold in the caches.
                    let shadow_first = shadow.is_some() && !load_only && shadow_turn;
                    shadow_turn ^= shadow.is_some() && !load_only;
                    let early = match (&shadow, shadow_first) {
                        (Some(shadow), true) => Some(run_shadow(&mut backend, shadow)),
                        _ => None,
                    };
                    let started = std::time::Instant::now();
                    let mut result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        if inject_panic {
                            panic!("injected panic on the model runner thread (--debug-panic)");
                        }
                        if load_only {
                            return backend.load(&model).map(|()| Predictions::default());
                        }
                        run_model(&mut backend, &model, &batch, rows.clone(), size, &policy)
                    }))
                    .unwrap_or_else(|payload| Err(panicked(&model, payload.as_ref())));
                    let main = started.elapsed();
                    if let (BatchSize::Auto, Ok(preds), false) = (batch_size, &result, load_only) {
                        autos.of(&model).observe(
                            rows.len(),
                            main.as_secs_f64(),
                            preds.oom_fit,
                            memory_full(&model),
                        );
                    }
                    if let (Some(shadow), Ok(preds)) = (&shadow, &mut result) {
                        let (out, took) = match early {
                            Some(done) => done,
                            None => run_shadow(&mut backend, shadow),
                        };
                        preds.shadow = Some(Box::new(Shadowed {
                            result: out,
                            main,
                            shadow: took,
                        }));
                    }
                    let _ = reply.send((batch, result));
                }
            })?;
        Ok(Self { tx })
    }

    /// Whether the runner thread is gone (it then takes no more requests).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Loads (and caches) a model on the runner thread, checking its digest.
    pub async fn load(&self, model: &ModelRef) -> Result<(), ItemError> {
        let (reply, rx) = oneshot::channel();
        let req = Request {
            model: model.clone(),
            shadow: None,
            batch: Batch::default(),
            rows: 0..0,
            batch_size: BatchSize::Fixed(1),
            policy: FailurePolicy::default(),
            load_only: true,
            inject_panic: false,
            reply,
        };
        if self.tx.send(req).await.is_err() {
            return Err(ItemError::panic("the model runner thread has stopped"));
        }
        rx.await
            .map_err(|_| ItemError::panic("the model runner thread died while loading"))?
            .1
            .map(|_| ())
    }

    /// Predicts a batch; hands the batch back with the result.
    pub async fn predict(
        &self,
        model: &ModelRef,
        batch: Batch,
        batch_size: usize,
        policy: &FailurePolicy,
    ) -> (Batch, Result<Predictions, ItemError>) {
        let rows = 0..batch.rows();
        let size = BatchSize::Fixed(batch_size);
        self.predict_rows(model, None, batch, rows, size, policy, false)
            .await
    }

    /// Predicts rows `rows` of a batch (a checkpoint segment); the
    /// predictions (and failed row indices) are relative to `rows.start`.
    /// With a `shadow` model, it runs on the same rows right after, and
    /// what it did rides in [`Predictions::shadow`] (its failure is never
    /// the call's). `inject_panic` (a testing aid) panics on the runner
    /// thread instead.
    #[allow(clippy::too_many_arguments)]
    pub async fn predict_rows(
        &self,
        model: &ModelRef,
        shadow: Option<&ModelRef>,
        batch: Batch,
        rows: std::ops::Range<usize>,
        batch_size: BatchSize,
        policy: &FailurePolicy,
        inject_panic: bool,
    ) -> (Batch, Result<Predictions, ItemError>) {
        let (reply, rx) = oneshot::channel();
        let req = Request {
            model: model.clone(),
            shadow: shadow.cloned(),
            batch,
            rows,
            batch_size,
            policy: policy.clone(),
            load_only: false,
            inject_panic,
            reply,
        };
        if let Err(mpsc::error::SendError(req)) = self.tx.send(req).await {
            return (
                req.batch,
                Err(ItemError::panic("the model runner thread has stopped")),
            );
        }
        match rx.await {
            Ok(out) => out,
            Err(_) => (
                Batch::default(),
                Err(ItemError::panic(
                    "the model runner thread died while predicting",
                )),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::backend::fake::Fake;

    fn model() -> ModelRef {
        ModelRef::plain("m.pt", "x", "cpu")
    }

    #[tokio::test]
    async fn runner_thread_returns_batch_and_predictions() {
        let runner = ModelRunner::spawn(|| Fake {
            max_rows: 9,
            calls: 0,
        })
        .unwrap();
        let mut b = Batch::with_capacity(2, 2);
        b.push("a", &[1.0, 2.0]);
        b.push("b", &[3.0, 4.0]);
        let (back, preds) = runner
            .predict(&model(), b.clone(), 8, &FailurePolicy::default())
            .await;
        assert_eq!(back, b);
        assert_eq!(preds.unwrap().values, vec![3.0, 7.0]);
    }
}
