//! The model runner: libtorch on its own OS thread, behind the small
//! synchronous [`Backend`] trait. Async code sends a request over a bounded
//! channel and awaits a oneshot reply, so the tokio runtime never blocks on
//! `forward`, and models are loaded once per (path, digest) and cached.

use crate::error::ItemError;
use crate::reader::Batch;
use batchfleet_shared::message::ModelRef;
use std::collections::HashMap;
use tokio::sync::{mpsc, oneshot};

/// Model outputs of a batch: `rows × width`, row-major.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Predictions {
    /// Values.
    pub values: Vec<f32>,
    /// Outputs per row.
    pub width: usize,
}

/// Runs a model on feature rows. Implementations live on one thread and may
/// keep state (loaded models) between calls.
pub trait Backend {
    /// Predicts `features` (`rows × cols`, row-major) in chunks of `batch_size` rows.
    fn predict(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        cols: usize,
        batch_size: usize,
    ) -> Result<Predictions, ItemError>;
}

struct Request {
    model: ModelRef,
    batch: Batch,
    batch_size: usize,
    reply: oneshot::Sender<(Batch, Result<Predictions, ItemError>)>,
}

/// Handle to the runner thread; cheap to clone.
#[derive(Debug, Clone)]
pub struct ModelRunner {
    tx: mpsc::Sender<Request>,
}

impl ModelRunner {
    /// Starts the runner thread. `make_backend` runs on that thread, so
    /// thread-local libtorch settings apply to every later call.
    pub fn spawn<B, F>(make_backend: F) -> std::io::Result<Self>
    where
        B: Backend,
        F: FnOnce() -> B + Send + 'static,
    {
        // Capacity 1: one batch waits while one runs; the readers feeding it
        // block on `send`, which is the backpressure we want.
        let (tx, mut rx) = mpsc::channel::<Request>(1);
        std::thread::Builder::new()
            .name("model-runner".into())
            .spawn(move || {
                let mut backend = make_backend();
                while let Some(req) = rx.blocking_recv() {
                    let result = backend.predict(
                        &req.model,
                        &req.batch.features,
                        req.batch.cols,
                        req.batch_size,
                    );
                    let _ = req.reply.send((req.batch, result));
                }
            })?;
        Ok(Self { tx })
    }

    /// Predicts a batch; hands the batch back with the result.
    pub async fn predict(
        &self,
        model: &ModelRef,
        batch: Batch,
        batch_size: usize,
    ) -> (Batch, Result<Predictions, ItemError>) {
        let (reply, rx) = oneshot::channel();
        let req = Request {
            model: model.clone(),
            batch,
            batch_size,
            reply,
        };
        if let Err(mpsc::error::SendError(req)) = self.tx.send(req).await {
            return (
                req.batch,
                Err(ItemError::fatal("the model runner thread has stopped")),
            );
        }
        match rx.await {
            Ok(out) => out,
            Err(_) => (
                Batch::default(),
                Err(ItemError::fatal(
                    "the model runner thread died while predicting",
                )),
            ),
        }
    }
}

/// libtorch through `tch`: TorchScript modules, cached by path and digest.
pub struct TorchBackend {
    cache: HashMap<(String, String), tch::CModule>,
}

impl std::fmt::Debug for TorchBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchBackend")
            .field("models", &self.cache.len())
            .finish()
    }
}

impl TorchBackend {
    /// Sets libtorch's intra-op threads (0 keeps libtorch's default) and an
    /// inter-op pool of one: each worker runs one forward at a time.
    pub fn new(intra_op_threads: usize) -> Self {
        if intra_op_threads > 0 {
            tch::set_num_threads(intra_op_threads as i32);
        }
        tch::set_num_interop_threads(1);
        Self {
            cache: HashMap::new(),
        }
    }

    fn device(spec: &str) -> Result<tch::Device, ItemError> {
        let device = match spec {
            "cpu" => tch::Device::Cpu,
            "cuda" => tch::Device::Cuda(0),
            other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => tch::Device::Cuda(n),
                None => return Err(ItemError::poison(format!("unknown device {other:?}"))),
            },
        };
        if let tch::Device::Cuda(n) = device {
            if !tch::Cuda::is_available() || n >= tch::Cuda::device_count() as usize {
                return Err(ItemError::fatal(format!("device {spec} requested but this worker has no such CUDA device; run GPU items on a GPU pool")));
            }
        }
        Ok(device)
    }

    /// Loads (or finds cached) the module of `model`, checking its digest.
    pub fn module(&mut self, model: &ModelRef) -> Result<&tch::CModule, ItemError> {
        let key = (model.path.clone(), model.sha256.clone());
        if !self.cache.contains_key(&key) {
            let started = std::time::Instant::now();
            let actual = batchfleet_shared::fsutil::sha256_file(std::path::Path::new(&model.path))
                .map_err(|e| ItemError::fatal(format!("cannot read model {}: {e}", model.path)))?;
            if actual != model.sha256 {
                return Err(ItemError::fatal(format!(
                    "model {} has sha256 {actual} but the job expects {}; the file changed after the job was planned — restore it or start a new job",
                    model.path, model.sha256
                )));
            }
            let device = Self::device(&model.device)?;
            let mut module = tch::CModule::load_on_device(&model.path, device).map_err(|e| {
                ItemError::fatal(format!(
                    "cannot load TorchScript model {}: {}",
                    model.path,
                    first_line(&e.to_string())
                ))
            })?;
            module.set_eval();
            tracing::info!(model = %model.path, device = %model.device, ms = started.elapsed().as_millis() as u64, "model loaded");
            self.cache.insert(key.clone(), module);
        }
        Ok(&self.cache[&key])
    }
}

fn first_line(s: &str) -> &str {
    s.lines().find(|l| !l.trim().is_empty()).unwrap_or(s)
}

impl Backend for TorchBackend {
    fn predict(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        cols: usize,
        batch_size: usize,
    ) -> Result<Predictions, ItemError> {
        let device = Self::device(&model.device)?;
        let module = self.module(model)?;
        let _guard = tch::no_grad_guard();
        let rows = features.len().checked_div(cols).unwrap_or(0);
        let mut out = Predictions {
            values: Vec::new(),
            width: 0,
        };
        for chunk in features.chunks((batch_size.max(1) * cols).max(1)) {
            let n = (chunk.len() / cols) as i64;
            let forward_err = |e: tch::TchError| {
                let msg = e.to_string();
                if msg.contains("out of memory") {
                    ItemError::transient(format!(
                        "out of memory running {} on {n} rows: {}",
                        model.path,
                        first_line(&msg)
                    ))
                } else {
                    ItemError::poison(format!(
                        "model {} raised on this input: {}",
                        model.path,
                        first_line(&msg)
                    ))
                }
            };
            let input = tch::Tensor::f_from_slice(chunk)
                .and_then(|t| t.f_view([n, cols as i64]))
                .and_then(|t| t.f_to_device(device))
                .map_err(forward_err)?;
            let y = module.forward_ts(&[input]).map_err(forward_err)?;
            let width = match y.size().as_slice() {
                [m] if *m == n => 1,
                [m, k] if *m == n => *k as usize,
                other => {
                    return Err(ItemError::poison(format!(
                        "model {} returned shape {other:?} for {n} rows; batchfleet expects [rows] or [rows, outputs]",
                        model.path
                    )))
                }
            };
            if out.width == 0 {
                out.width = width;
                out.values.reserve(rows * width);
            }
            let y = y
                .f_to_kind(tch::Kind::Float)
                .and_then(|t| t.f_to_device(tch::Device::Cpu))
                .and_then(|t| t.f_contiguous())
                .map_err(forward_err)?;
            let at = out.values.len();
            out.values.resize(at + n as usize * width, 0.0);
            y.f_copy_data(&mut out.values[at..], n as usize * width)
                .map_err(forward_err)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums each row; fails on a sentinel.
    struct SumBackend;
    impl Backend for SumBackend {
        fn predict(
            &mut self,
            _m: &ModelRef,
            f: &[f32],
            cols: usize,
            _bs: usize,
        ) -> Result<Predictions, ItemError> {
            if f.contains(&-999.0) {
                return Err(ItemError::poison("sentinel"));
            }
            Ok(Predictions {
                values: f.chunks(cols).map(|r| r.iter().sum()).collect(),
                width: 1,
            })
        }
    }

    fn model() -> ModelRef {
        ModelRef {
            path: "m.pt".into(),
            sha256: "x".into(),
            device: "cpu".into(),
        }
    }

    #[tokio::test]
    async fn runner_returns_batch_and_predictions() {
        let runner = ModelRunner::spawn(|| SumBackend).unwrap();
        let mut b = Batch::with_capacity(2, 2);
        b.push("a", &[1.0, 2.0]);
        b.push("b", &[3.0, 4.0]);
        let (back, preds) = runner.predict(&model(), b.clone(), 8).await;
        assert_eq!(back, b);
        assert_eq!(preds.unwrap().values, vec![3.0, 7.0]);
        let mut bad = Batch::with_capacity(1, 1);
        bad.push("c", &[-999.0]);
        assert_eq!(
            runner
                .predict(&model(), bad, 8)
                .await
                .1
                .unwrap_err()
                .message,
            "sentinel"
        );
    }
}
