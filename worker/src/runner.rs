//! The model runner: libtorch on its own OS thread, behind the small
//! synchronous [`Backend`] trait. Async code sends a request over a bounded
//! channel and awaits a oneshot reply, so the tokio runtime never blocks on
//! `forward`, and models are loaded once per (path, digest) and cached.
//!
//! [`predict`] turns single `forward` calls into an item's predictions:
//! mini-batches of `inference_batch_size`; on out-of-memory a mini-batch is
//! retried in halves; when the model raises on a mini-batch it is bisected to
//! find the rows that make it raise (poison-row isolation), so one bad record
//! costs one row, not the item.

use crate::batch::{Batch, Tokens};
use crate::error::ItemError;
use batchfleet_shared::message::{FailurePolicy, ModelRef};
use batchfleet_shared::metrics::names;
use std::collections::HashMap;
use tokio::sync::{mpsc, oneshot};

/// Model outputs of a batch: `rows × width`, row-major.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Predictions {
    /// Values (those of failed rows are NaN).
    pub values: Vec<f32>,
    /// Outputs per row.
    pub width: usize,
    /// Rows the model raised on, with its message, in row order.
    pub failed: Vec<(usize, String)>,
    /// The model returned integers (class ids, counts, flags): written as
    /// integers, not floats.
    pub integer: bool,
}

/// What one `forward` call returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Forwarded {
    /// Values, row-major (integers converted exactly up to 2^24).
    pub values: Vec<f32>,
    /// Outputs per row.
    pub width: usize,
    /// The output tensor held integers (or booleans).
    pub integer: bool,
}

/// Why one `forward` call failed.
#[derive(Debug, Clone, PartialEq)]
pub enum ForwardError {
    /// The model could not be loaded or used at all (class decided by the backend).
    Unusable(ItemError),
    /// The call ran out of memory; a smaller batch may fit.
    OutOfMemory(String),
    /// The model raised on this input (the exception's line).
    Raised(String),
}

/// Runs one `forward` on rows of features, each of shape `row_shape`
/// (`[features]` for tables, `[channels, height, width]` for images), held
/// row-major in one slice. Implementations live on one thread and may keep
/// state (loaded models) between calls.
pub trait Backend {
    /// Returns the outputs, row-major.
    fn forward(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        row_shape: &[usize],
    ) -> Result<Forwarded, ForwardError>;

    /// Runs one `forward(input_ids, attention_mask)` on `rows` rows of
    /// token ids padded to `len` (text input): `ids` and `mask` are `rows ×
    /// len`, row-major, the mask 1 on real tokens and 0 on padding.
    fn forward_tokens(
        &mut self,
        model: &ModelRef,
        ids: &[i64],
        mask: &[i64],
        rows: usize,
        len: usize,
    ) -> Result<Forwarded, ForwardError> {
        let _ = (ids, mask, rows, len);
        Err(ForwardError::Unusable(ItemError::unable(format!(
            "this worker's model backend cannot run {} on token inputs",
            model.path
        ))))
    }

    /// Loads `model` ahead of its first item (a worker's `--preload-model`).
    fn load(&mut self, _model: &ModelRef) -> Result<(), ItemError> {
        Ok(())
    }

    /// Runs `features` in consecutive mini-batches of `rows_per_call` rows:
    /// the outputs of every mini-batch in order up to the first that fails,
    /// then that failure. The default calls [`Backend::forward`] once per
    /// mini-batch; a GPU backend queues them all on the device instead, so
    /// the device never waits for the host between mini-batches.
    fn forward_run(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        row_shape: &[usize],
        rows_per_call: usize,
    ) -> Ran {
        call_by_call(self, model, features, row_shape, rows_per_call)
    }
}

/// [`Backend::forward_run`] as one [`Backend::forward`] per mini-batch.
pub fn call_by_call<B: Backend + ?Sized>(
    backend: &mut B,
    model: &ModelRef,
    features: &[f32],
    row_shape: &[usize],
    rows_per_call: usize,
) -> Ran {
    let cols = row_shape.iter().product::<usize>().max(1);
    let mut ran = Ran::default();
    for chunk in features.chunks(rows_per_call.max(1) * cols) {
        match backend.forward(model, chunk, row_shape) {
            Ok(f) => ran.done.push(f),
            Err(e) => {
                ran.failed = Some(e);
                break;
            }
        }
    }
    ran
}

/// What [`Backend::forward_run`] returned.
#[derive(Debug, Default)]
pub struct Ran {
    /// Outputs of the mini-batches that ran, in order from the first.
    pub done: Vec<Forwarded>,
    /// Why the next mini-batch failed (`None`: all ran).
    pub failed: Option<ForwardError>,
}

/// Error messages that mean the allocator ran out, on CPU or GPU.
pub fn is_out_of_memory(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("out of memory")
        || m.contains("can't allocate memory")
        || m.contains("cannot allocate memory")
}

/// Predicts all rows of `features` in mini-batches of `batch_size` (see module docs).
pub fn predict<B: Backend + ?Sized>(
    backend: &mut B,
    model: &ModelRef,
    features: &[f32],
    row_shape: &[usize],
    batch_size: usize,
    policy: &FailurePolicy,
) -> Result<Predictions, ItemError> {
    let cols = row_shape.iter().product::<usize>();
    let rows = features.len().checked_div(cols).unwrap_or(0);
    let inputs = Inputs::Dense {
        features,
        cols,
        row_shape,
    };
    predict_inputs(backend, model, inputs, rows, batch_size, policy)
}

/// Predicts rows of token ids (text input): the rows are sorted by length
/// so each mini-batch of `batch_size` is padded only to its own longest row
/// (dynamic padding), then the predictions are put back in input order.
pub fn predict_tokens<B: Backend + ?Sized>(
    backend: &mut B,
    model: &ModelRef,
    tokens: &Tokens,
    rows: std::ops::Range<usize>,
    batch_size: usize,
    policy: &FailurePolicy,
) -> Result<Predictions, ItemError> {
    let rows = rows.start.min(tokens.rows())..rows.end.min(tokens.rows());
    let mut order: Vec<usize> = rows.clone().collect();
    order.sort_by_key(|&i| tokens.row(i).len());
    let mut sorted = Tokens {
        ids: Vec::with_capacity(tokens.ids.len()),
        ends: Vec::with_capacity(order.len()),
        ..*tokens
    };
    for &i in &order {
        sorted.push(tokens.row(i));
    }
    let n = order.len();
    let by_length = predict_inputs(
        backend,
        model,
        Inputs::Tokens(&sorted),
        n,
        batch_size,
        policy,
    )?;
    // Back to input order (rows relative to the range's start).
    let width = by_length.width;
    let mut out = Predictions {
        values: vec![f32::NAN; n * width],
        width,
        failed: Vec::with_capacity(by_length.failed.len()),
        integer: by_length.integer,
    };
    for (k, &i) in order.iter().enumerate() {
        let at = i - rows.start;
        out.values[at * width..(at + 1) * width]
            .copy_from_slice(&by_length.values[k * width..(k + 1) * width]);
    }
    out.failed = by_length
        .failed
        .into_iter()
        .map(|(k, msg)| (order[k] - rows.start, msg))
        .collect();
    out.failed.sort_by_key(|f| f.0);
    Ok(out)
}

/// What the model takes: rows of `f32` features, or rows of token ids.
#[derive(Clone, Copy)]
enum Inputs<'a> {
    /// Row-major features, each row of `row_shape` (`cols` values).
    Dense {
        features: &'a [f32],
        cols: usize,
        row_shape: &'a [usize],
    },
    /// Token ids, sorted by length; each mini-batch padded to its longest.
    Tokens(&'a Tokens),
}

impl Inputs<'_> {
    /// One `forward` on rows `[lo, hi)`.
    fn call<B: Backend + ?Sized>(
        &self,
        backend: &mut B,
        model: &ModelRef,
        lo: usize,
        hi: usize,
    ) -> Result<Forwarded, ForwardError> {
        match *self {
            Inputs::Dense {
                features,
                cols,
                row_shape,
            } => backend.forward(model, &features[lo * cols..hi * cols], row_shape),
            Inputs::Tokens(tokens) => {
                let longest = (lo..hi).map(|i| tokens.row(i).len()).max().unwrap_or(0);
                let len = tokens.padded_len(longest);
                let n = hi - lo;
                let mut ids = vec![tokens.pad_id; n * len];
                let mut mask = vec![0i64; n * len];
                for (r, i) in (lo..hi).enumerate() {
                    let row = tokens.row(i);
                    ids[r * len..r * len + row.len()].copy_from_slice(row);
                    mask[r * len..r * len + row.len()].fill(1);
                }
                backend.forward_tokens(model, &ids, &mask, n, len)
            }
        }
    }

    /// Rows `[lo, hi)` in mini-batches of `fit` rows, as one run.
    fn run<B: Backend + ?Sized>(
        &self,
        backend: &mut B,
        model: &ModelRef,
        lo: usize,
        hi: usize,
        fit: usize,
    ) -> Ran {
        match *self {
            Inputs::Dense {
                features,
                cols,
                row_shape,
            } => backend.forward_run(model, &features[lo * cols..hi * cols], row_shape, fit),
            Inputs::Tokens(_) => {
                let mut ran = Ran::default();
                let mut at = lo;
                while at < hi {
                    let end = (at + fit.max(1)).min(hi);
                    match self.call(backend, model, at, end) {
                        Ok(f) => ran.done.push(f),
                        Err(e) => {
                            ran.failed = Some(e);
                            break;
                        }
                    }
                    at = end;
                }
                ran
            }
        }
    }
}

/// [`predict`] over any [`Inputs`] of `rows` rows.
fn predict_inputs<B: Backend + ?Sized>(
    backend: &mut B,
    model: &ModelRef,
    inputs: Inputs<'_>,
    rows: usize,
    batch_size: usize,
    policy: &FailurePolicy,
) -> Result<Predictions, ItemError> {
    let mut out = Predictions::default();
    let mut run = Run {
        backend,
        model,
        inputs,
        policy,
        out: &mut out,
        rows,
        fit: batch_size.max(1),
    };
    run.in_chunks(0, rows)?;
    if rows > 0 && out.failed.len() == rows {
        return Err(ItemError::poison(format!(
            "model {} raised on every row of the item: {}",
            model.path, out.failed[0].1
        )));
    }
    Ok(out)
}

struct Run<'a, B: Backend + ?Sized> {
    backend: &'a mut B,
    model: &'a ModelRef,
    inputs: Inputs<'a>,
    policy: &'a FailurePolicy,
    out: &'a mut Predictions,
    rows: usize,
    /// Largest mini-batch not known to run out of memory.
    fit: usize,
}

impl<B: Backend + ?Sized> Run<'_, B> {
    /// One `forward` on rows `[lo, hi)`, its failure handled.
    fn range(&mut self, lo: usize, hi: usize) -> Result<(), ItemError> {
        let started = std::time::Instant::now();
        let result = self.inputs.call(self.backend, self.model, lo, hi);
        metrics::histogram!(names::WORKER_INFERENCE).record(started.elapsed().as_secs_f64());
        metrics::histogram!(names::WORKER_BATCH_SIZE).record((hi - lo) as f64);
        match result {
            Ok(f) => self.keep(lo, hi, f),
            Err(e) => self.failed(lo, hi, e),
        }
    }

    fn keep(&mut self, lo: usize, hi: usize, f: Forwarded) -> Result<(), ItemError> {
        self.out.integer = f.integer;
        self.store(lo, hi, &f.values, f.width)
    }

    /// Handles a failed `forward` on rows `[lo, hi)`: smaller mini-batches
    /// after an out-of-memory, bisection to the rows the model raises on.
    fn failed(&mut self, lo: usize, hi: usize, error: ForwardError) -> Result<(), ItemError> {
        match error {
            ForwardError::Unusable(e) => Err(e),
            ForwardError::OutOfMemory(msg) if hi - lo > 1 => {
                let half = (hi - lo).div_ceil(2);
                if half < self.fit {
                    tracing::warn!(rows = hi - lo, now = half, error = %msg, "out of memory; retrying the mini-batch in halves");
                    self.fit = half;
                }
                self.in_chunks(lo, hi)
            }
            ForwardError::OutOfMemory(msg) => Err(ItemError::unable(format!(
                "out of memory running {} on a single row on this worker: {msg}",
                self.model.path
            ))),
            ForwardError::Raised(msg) => {
                if let Some(p) = self
                    .policy
                    .transient_errors
                    .iter()
                    .find(|p| msg.contains(p.as_str()))
                {
                    return Err(ItemError::transient(format!(
                        "model {} failed with a transient error (matches {p:?}): {msg}",
                        self.model.path
                    )));
                }
                if !self.policy.isolate_poison_rows {
                    return Err(ItemError::poison(format!(
                        "model {} raised on this input: {msg}",
                        self.model.path
                    )));
                }
                if hi - lo == 1 {
                    self.out.failed.push((lo, msg));
                    Ok(())
                } else {
                    self.split(lo, hi)
                }
            }
        }
    }

    /// Runs `[lo, hi)` in mini-batches of the current `fit`, which shrinks
    /// after an out-of-memory so later mini-batches do not repeat it.
    /// The mini-batches go to the backend as one run ([`Backend::forward_run`]);
    /// from a failed one on, they are handled one by one.
    fn in_chunks(&mut self, lo: usize, hi: usize) -> Result<(), ItemError> {
        let mut at = lo;
        while at < hi {
            let fit = self.fit;
            let started = std::time::Instant::now();
            let ran = self.inputs.run(self.backend, self.model, at, hi, fit);
            let calls = ran.done.len() + usize::from(ran.failed.is_some());
            if calls == 0 {
                return Err(ItemError::panic(format!(
                    "the model backend ran none of {} rows of {}",
                    hi - at,
                    self.model.path
                )));
            }
            let each = started.elapsed().as_secs_f64() / calls.max(1) as f64;
            for f in ran.done {
                let end = (at + fit).min(hi);
                metrics::histogram!(names::WORKER_INFERENCE).record(each);
                metrics::histogram!(names::WORKER_BATCH_SIZE).record((end - at) as f64);
                self.keep(at, end, f)?;
                at = end;
            }
            if let Some(e) = ran.failed {
                let end = (at + fit).min(hi);
                metrics::histogram!(names::WORKER_INFERENCE).record(each);
                metrics::histogram!(names::WORKER_BATCH_SIZE).record((end - at) as f64);
                self.failed(at, end, e)?;
                at = end;
            }
        }
        Ok(())
    }

    /// Bisects `[lo, hi)` (poison-row isolation).
    fn split(&mut self, lo: usize, hi: usize) -> Result<(), ItemError> {
        let mid = lo + (hi - lo).div_ceil(2);
        self.range(lo, mid)?;
        self.range(mid, hi)
    }

    fn store(
        &mut self,
        lo: usize,
        hi: usize,
        values: &[f32],
        width: usize,
    ) -> Result<(), ItemError> {
        if self.out.width == 0 {
            self.out.width = width;
            self.out.values = vec![f32::NAN; self.rows * width];
        } else if width != self.out.width {
            return Err(ItemError::poison(format!(
                "model {} returned {width} outputs per row, earlier {}",
                self.model.path, self.out.width
            )));
        }
        if values.len() != (hi - lo) * width {
            return Err(ItemError::poison(format!(
                "model {} returned {} values for {} rows",
                self.model.path,
                values.len(),
                hi - lo
            )));
        }
        self.out.values[lo * width..hi * width].copy_from_slice(values);
        Ok(())
    }
}

struct Request {
    model: ModelRef,
    batch: Batch,
    rows: std::ops::Range<usize>,
    batch_size: usize,
    policy: FailurePolicy,
    /// Only load the model (no rows).
    load_only: bool,
    /// Testing aid: panic on the runner thread instead of predicting.
    inject_panic: bool,
    reply: oneshot::Sender<(Batch, Result<Predictions, ItemError>)>,
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
                while let Some(req) = rx.blocking_recv() {
                    let Request {
                        model,
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
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        if inject_panic {
                            panic!("injected panic on the model runner thread (--debug-panic)");
                        }
                        if load_only {
                            return backend.load(&model).map(|()| Predictions::default());
                        }
                        if let Some(tokens) = &batch.tokens {
                            return predict_tokens(
                                &mut backend,
                                &model,
                                tokens,
                                rows.clone(),
                                batch_size,
                                &policy,
                            );
                        }
                        let cols = batch.cols;
                        let features = batch
                            .features
                            .get(rows.start * cols..rows.end * cols)
                            .unwrap_or_default();
                        predict(
                            &mut backend,
                            &model,
                            features,
                            &batch.row_shape(),
                            batch_size,
                            &policy,
                        )
                    }))
                    .unwrap_or_else(|payload| {
                        metrics::counter!(names::WORKER_PANICS, "where" => "runner").increment(1);
                        Err(ItemError::panic(format!(
                            "the model runner panicked running {}: {}",
                            model.path,
                            crate::error::panic_message(payload.as_ref())
                        )))
                    });
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
            batch: Batch::default(),
            rows: 0..0,
            batch_size: 1,
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
        self.predict_rows(model, batch, rows, batch_size, policy, false)
            .await
    }

    /// Predicts rows `rows` of a batch (a checkpoint segment); the
    /// predictions (and failed row indices) are relative to `rows.start`.
    /// `inject_panic` (a testing aid) panics on the runner thread instead.
    pub async fn predict_rows(
        &self,
        model: &ModelRef,
        batch: Batch,
        rows: std::ops::Range<usize>,
        batch_size: usize,
        policy: &FailurePolicy,
        inject_panic: bool,
    ) -> (Batch, Result<Predictions, ItemError>) {
        let (reply, rx) = oneshot::channel();
        let req = Request {
            model: model.clone(),
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

/// A backend that sleeps before every `forward`: a deliberately slow worker
/// for straggler tests and demonstrations (`--debug-batch-delay`).
#[derive(Debug)]
pub struct Delayed<B> {
    /// The backend doing the work.
    pub inner: B,
    /// Sleep before each call.
    pub delay: std::time::Duration,
}

impl<B: Backend> Backend for Delayed<B> {
    fn forward(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        row_shape: &[usize],
    ) -> Result<Forwarded, ForwardError> {
        std::thread::sleep(self.delay);
        self.inner.forward(model, features, row_shape)
    }

    fn load(&mut self, model: &ModelRef) -> Result<(), ItemError> {
        self.inner.load(model)
    }

    fn forward_tokens(
        &mut self,
        model: &ModelRef,
        ids: &[i64],
        mask: &[i64],
        rows: usize,
        len: usize,
    ) -> Result<Forwarded, ForwardError> {
        std::thread::sleep(self.delay);
        self.inner.forward_tokens(model, ids, mask, rows, len)
    }

    fn forward_run(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        row_shape: &[usize],
        rows_per_call: usize,
    ) -> Ran {
        if self.delay.is_zero() {
            return self
                .inner
                .forward_run(model, features, row_shape, rows_per_call);
        }
        // Delayed call by call, as `forward` is.
        call_by_call(self, model, features, row_shape, rows_per_call)
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
        // libtorch allows this only before inter-op work starts, so once per
        // process (a replacement runner after a hung item must not repeat it).
        static INTEROP: std::sync::Once = std::sync::Once::new();
        INTEROP.call_once(|| tch::set_num_interop_threads(1));
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
                None => return Err(ItemError::rejected(format!("unknown device {other:?}"))),
            },
        };
        if let tch::Device::Cuda(n) = device {
            if !tch::Cuda::is_available() || n >= tch::Cuda::device_count() as usize {
                return Err(ItemError::unable(format!(
                    "device {spec} requested but this worker has no such CUDA device ({} visible); run GPU jobs on a pool of GPU workers",
                    if tch::Cuda::is_available() { tch::Cuda::device_count() } else { 0 }
                )));
            }
        }
        Ok(device)
    }

    /// Loads (or finds cached) the module of `model`. The file is read once:
    /// the digest is checked on those bytes and those bytes are loaded, so a
    /// file swapped in between can never run unpinned.
    pub fn module(&mut self, model: &ModelRef) -> Result<&tch::CModule, ItemError> {
        let key = (model.path.clone(), model.sha256.clone());
        if !self.cache.contains_key(&key) {
            let started = std::time::Instant::now();
            let module = load_pinned(model)?;
            tracing::info!(model = %model.path, device = %model.device, ms = started.elapsed().as_millis() as u64, "model loaded");
            metrics::histogram!(names::WORKER_MODEL_LOAD).record(started.elapsed().as_secs_f64());
            self.cache.insert(key.clone(), module);
        }
        Ok(&self.cache[&key])
    }
}

/// Reads `model`'s file once, checks its digest and kind on those bytes,
/// and loads them onto the model's device. Who is at fault decides the class:
/// a file this worker cannot read is this worker's problem (`unable`:
/// another may have it mounted); a file that is not the job's (digest) or not
/// TorchScript, or that libtorch refuses, fails the job (`unrunnable`).
fn load_pinned(model: &ModelRef) -> Result<tch::CModule, ItemError> {
    let bytes = std::fs::read(&model.path).map_err(|e| {
        ItemError::unable(format!(
            "cannot read model {} on this worker: {e}",
            model.path
        ))
    })?;
    let actual = batchfleet_shared::fsutil::sha256_bytes(&bytes);
    let kind = batchfleet_shared::model_file::inspect_bytes(&bytes);
    if actual != model.sha256 {
        return Err(ItemError::unrunnable(format!(
            "model {} has sha256 {actual} but the job expects {} (it is now {}); the file changed after the job was planned — restore it, or run the manifest again to start a job with the new model",
            model.path,
            model.sha256,
            kind.describe()
        )));
    }
    if !kind.is_torchscript() {
        return Err(ItemError::unrunnable(format!(
            "model {} is {}; {}",
            model.path,
            kind.describe(),
            batchfleet_shared::model_file::EXPORT_FIX
        )));
    }
    let device = TorchBackend::device(&model.device)?;
    let mut module =
        tch::CModule::load_data_on_device(&mut bytes.as_slice(), device).map_err(|e| {
            ItemError::unrunnable(format!(
                "libtorch cannot load TorchScript model {}: {}",
                model.path,
                error_summary(&e.to_string())
            ))
        })?;
    module.set_eval();
    Ok(module)
}

/// The informative line of a libtorch error. TorchScript errors carry a
/// traceback and put the exception (`RuntimeError: …`) on its last such line.
pub fn error_summary(full: &str) -> String {
    let lines: Vec<&str> = full
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let pick = lines
        .iter()
        .rev()
        .find(|l| l.contains("Error: "))
        .or(lines.first())
        .copied()
        .unwrap_or(full);
    pick.to_owned()
}

/// Classifies a libtorch error by the exception's own line: the traceback
/// around it quotes source code, which may mention any error text.
fn classify(e: tch::TchError) -> ForwardError {
    let line = error_summary(&e.to_string());
    if is_out_of_memory(&line) {
        ForwardError::OutOfMemory(line)
    } else {
        ForwardError::Raised(line)
    }
}

/// One `forward` launched: its output on its way to host memory.
struct Launched {
    /// `float32`, `[rows, width]` or `[rows]`, on the host (or, after a
    /// non-blocking copy, arriving there).
    y: tch::Tensor,
    rows: usize,
    width: usize,
    integer: bool,
}

impl Launched {
    /// The values, once the copy to the host has landed.
    fn collect(self) -> Result<Forwarded, ForwardError> {
        let y = self.y.f_contiguous().map_err(classify)?;
        let mut values = vec![0f32; self.rows * self.width];
        y.f_copy_data(&mut values, self.rows * self.width)
            .map_err(classify)?;
        Ok(Forwarded {
            values,
            width: self.width,
            integer: self.integer,
        })
    }
}

/// Launches `forward` on `features` on `device`. `queued`: the device is a
/// GPU and the call must not wait for it: the rows go through pinned host
/// memory with a non-blocking copy, and the output comes back the same way
/// (read it after the device is synchronized). Otherwise the call returns
/// with the output on the host.
fn launch(
    module: &tch::CModule,
    model: &ModelRef,
    features: &[f32],
    row_shape: &[usize],
    device: tch::Device,
    queued: bool,
) -> Result<Launched, ForwardError> {
    let cols = row_shape.iter().product::<usize>();
    let n = (features.len() / cols.max(1)) as i64;
    let dims: Vec<i64> = std::iter::once(n)
        .chain(row_shape.iter().map(|d| *d as i64))
        .collect();
    let host = tch::Tensor::f_from_slice(features)
        .and_then(|t| t.f_view(dims.as_slice()))
        .map_err(classify)?;
    let input = if queued {
        host.f_pin_memory(device)
            .and_then(|t| t.f_to_device_(device, tch::Kind::Float, true, false))
    } else {
        host.f_to_device(device)
    }
    .map_err(classify)?;
    let y = module.forward_ts(&[input]).map_err(classify)?;
    landed(y, n, model, queued)
}

/// `forward`'s output `y` for `n` rows on its way to host memory as `f32`
/// (`queued`: a non-blocking copy; read it after the device is synchronized).
fn landed(
    y: tch::Tensor,
    n: i64,
    model: &ModelRef,
    queued: bool,
) -> Result<Launched, ForwardError> {
    let width = match y.size().as_slice() {
        [m] if *m == n => 1,
        [m, k] if *m == n => *k as usize,
        other => {
            return Err(ForwardError::Unusable(ItemError::poison(format!(
                "model {} returned shape {other:?} for {n} rows; batchfleet expects [rows] or [rows, outputs]",
                model.path
            ))))
        }
    };
    let integer = !y.is_floating_point();
    let y = y
        .f_to_kind(tch::Kind::Float)
        .and_then(|t| t.f_to_device_(tch::Device::Cpu, tch::Kind::Float, queued, false))
        .map_err(classify)?;
    Ok(Launched {
        y,
        rows: n as usize,
        width,
        integer,
    })
}

impl Backend for TorchBackend {
    fn load(&mut self, model: &ModelRef) -> Result<(), ItemError> {
        self.module(model).map(|_| ())
    }

    fn forward_tokens(
        &mut self,
        model: &ModelRef,
        ids: &[i64],
        mask: &[i64],
        rows: usize,
        len: usize,
    ) -> Result<Forwarded, ForwardError> {
        let device = Self::device(&model.device).map_err(ForwardError::Unusable)?;
        let module = self.module(model).map_err(ForwardError::Unusable)?;
        let _guard = tch::no_grad_guard();
        let dims = [rows as i64, len as i64];
        let tensor = |v: &[i64]| {
            tch::Tensor::f_from_slice(v)
                .and_then(|t| t.f_view(dims))
                .and_then(|t| t.f_to_device(device))
                .map_err(classify)
        };
        let (ids, mask) = (tensor(ids)?, tensor(mask)?);
        let started = std::time::Instant::now();
        let y = module.forward_ts(&[ids, mask]).map_err(classify)?;
        let landed = landed(y, rows as i64, model, false)?.collect();
        metrics::histogram!(names::WORKER_DEVICE_SECONDS, "device" => model.device.clone())
            .record(started.elapsed().as_secs_f64());
        landed
    }

    fn forward(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        row_shape: &[usize],
    ) -> Result<Forwarded, ForwardError> {
        let device = Self::device(&model.device).map_err(ForwardError::Unusable)?;
        let module = self.module(model).map_err(ForwardError::Unusable)?;
        let _guard = tch::no_grad_guard();
        launch(module, model, features, row_shape, device, false)?.collect()
    }

    /// On a GPU, every mini-batch is launched before any result is read:
    /// the host stages mini-batch k+1 into pinned memory while the device
    /// runs k, the copies in and out are non-blocking, and the host waits
    /// for the device once, at the end. On the CPU, call by call. The run's
    /// time on its device goes to [`names::WORKER_DEVICE_SECONDS`]: its sum's
    /// rate is the share of time the device was kept busy.
    fn forward_run(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        row_shape: &[usize],
        rows_per_call: usize,
    ) -> Ran {
        let device = match Self::device(&model.device) {
            Ok(d) => d,
            Err(e) => {
                return Ran {
                    done: Vec::new(),
                    failed: Some(ForwardError::Unusable(e)),
                }
            }
        };
        // Loaded first: loading is not device time.
        if let Err(e) = self.module(model) {
            return Ran {
                done: Vec::new(),
                failed: Some(ForwardError::Unusable(e)),
            };
        }
        let started = std::time::Instant::now();
        let ran = if let tch::Device::Cuda(index) = device {
            self.queued_run(model, features, row_shape, rows_per_call, index)
        } else {
            call_by_call(self, model, features, row_shape, rows_per_call)
        };
        metrics::histogram!(names::WORKER_DEVICE_SECONDS, "device" => model.device.clone())
            .record(started.elapsed().as_secs_f64());
        ran
    }
}

/// Input bytes a GPU run stages ahead of the device at most (in pinned host
/// memory) before it waits for the device to catch up.
const MAX_QUEUED_BYTES: usize = 256 << 20;

impl TorchBackend {
    /// [`Backend::forward_run`] on CUDA device `index`: all launched, then
    /// one wait (or one per [`MAX_QUEUED_BYTES`] of input). A failure to
    /// launch keeps what was launched before it.
    fn queued_run(
        &mut self,
        model: &ModelRef,
        features: &[f32],
        row_shape: &[usize],
        rows_per_call: usize,
        index: usize,
    ) -> Ran {
        let device = tch::Device::Cuda(index);
        let module = match self.module(model) {
            Ok(m) => m,
            Err(e) => {
                return Ran {
                    done: Vec::new(),
                    failed: Some(ForwardError::Unusable(e)),
                }
            }
        };
        let _guard = tch::no_grad_guard();
        let cols = row_shape.iter().product::<usize>().max(1);
        let mut launched = Vec::new();
        let mut failed = None;
        let mut queued_bytes = 0;
        for chunk in features.chunks(rows_per_call.max(1) * cols) {
            // Pinned staging buffers are reused once their copy has run:
            // bound what is staged ahead of the device.
            queued_bytes += std::mem::size_of_val(chunk);
            if queued_bytes > MAX_QUEUED_BYTES {
                tch::Cuda::synchronize(index as i64);
                queued_bytes = std::mem::size_of_val(chunk);
            }
            match launch(module, model, chunk, row_shape, device, true) {
                Ok(l) => launched.push(l),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        tch::Cuda::synchronize(index as i64);
        let mut ran = Ran {
            done: Vec::with_capacity(launched.len()),
            failed: None,
        };
        for l in launched {
            match l.collect() {
                Ok(f) => ran.done.push(f),
                Err(e) => {
                    ran.failed = Some(e);
                    return ran;
                }
            }
        }
        ran.failed = failed;
        ran
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums each row; raises on a row holding -999, runs out of memory on
    /// batches larger than `max_rows`.
    struct Fake {
        max_rows: usize,
        calls: usize,
    }
    impl Backend for Fake {
        fn forward(
            &mut self,
            _m: &ModelRef,
            f: &[f32],
            shape: &[usize],
        ) -> Result<Forwarded, ForwardError> {
            let cols = shape[0];
            self.calls += 1;
            if f.len() / cols > self.max_rows {
                return Err(ForwardError::OutOfMemory("CUDA out of memory".into()));
            }
            if f.contains(&-999.0) {
                return Err(ForwardError::Raised("RuntimeError: sentinel".into()));
            }
            Ok(Forwarded {
                values: f.chunks(cols).map(|r| r.iter().sum()).collect(),
                width: 1,
                integer: false,
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

    fn rows(values: &[f32]) -> Vec<f32> {
        values.iter().flat_map(|v| [*v, 1.0]).collect()
    }

    #[test]
    fn bisection_rejects_exactly_the_rows_that_raise() {
        let f = rows(&[1.0, -999.0, 3.0, 4.0, 5.0, 6.0, -999.0, 8.0]);
        let mut b = Fake {
            max_rows: 100,
            calls: 0,
        };
        let p = predict(&mut b, &model(), &f, &[2], 8, &FailurePolicy::default()).unwrap();
        assert_eq!(
            p.failed.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            vec![1, 6]
        );
        assert_eq!(p.values[0], 2.0);
        assert_eq!(p.values[7], 9.0);
        assert!(p.values[1].is_nan());
        assert!(
            b.calls <= 1 + 2 * 2 * 3,
            "bisection stays logarithmic: {} calls",
            b.calls
        );
    }

    /// Token rows: each row's output is the sum of its real ids and the
    /// padded length it came with; a row holding id 666 raises; every call's
    /// (rows, len) is kept.
    #[derive(Default)]
    struct Tokenized {
        calls: Vec<(usize, usize)>,
    }
    impl Backend for Tokenized {
        fn forward(
            &mut self,
            _m: &ModelRef,
            _f: &[f32],
            _shape: &[usize],
        ) -> Result<Forwarded, ForwardError> {
            unreachable!("token rows only")
        }

        fn forward_tokens(
            &mut self,
            _m: &ModelRef,
            ids: &[i64],
            mask: &[i64],
            rows: usize,
            len: usize,
        ) -> Result<Forwarded, ForwardError> {
            self.calls.push((rows, len));
            assert_eq!((ids.len(), mask.len()), (rows * len, rows * len));
            if ids.contains(&666) {
                return Err(ForwardError::Raised("RuntimeError: 666".into()));
            }
            let mut values = Vec::new();
            for r in 0..rows {
                let row = &ids[r * len..(r + 1) * len];
                let m = &mask[r * len..(r + 1) * len];
                let real: i64 = row
                    .iter()
                    .zip(m)
                    .filter(|(_, m)| **m == 1)
                    .map(|(i, _)| i)
                    .sum();
                assert!(
                    row.iter().zip(m).all(|(i, m)| *m == 1 || *i == 7),
                    "pads hold the pad id"
                );
                values.extend([real as f32, len as f32]);
            }
            Ok(Forwarded {
                values,
                width: 2,
                integer: false,
            })
        }
    }

    #[test]
    fn token_rows_are_sorted_padded_per_mini_batch_and_put_back_in_order() {
        // Lengths 5, 1, 3, 2, 4, 1 (ids 1 each, row 3 holds a 666).
        let lengths = [5usize, 1, 3, 2, 4, 1];
        let mut tokens = crate::batch::Tokens {
            pad_id: 7,
            multiple: 0,
            ..Default::default()
        };
        for (r, len) in lengths.iter().enumerate() {
            let mut row = vec![1i64; *len];
            if r == 3 {
                row[0] = 666;
            }
            tokens.push(&row);
        }
        let mut b = Tokenized::default();
        let p = predict_tokens(
            &mut b,
            &model(),
            &tokens,
            0..6,
            2,
            &FailurePolicy::default(),
        )
        .unwrap();
        // Sorted by length: [1, 5] (len 1), [3, 2] (2 and 3: padded to 3,
        // raises, bisected into [3] and [2]), [4, 0] (4 and 5: padded to 5).
        assert_eq!(b.calls, [(2, 1), (2, 3), (1, 2), (1, 3), (2, 5)]);
        // The raising mini-batch was bisected to row 3 alone.
        assert_eq!(p.failed.iter().map(|f| f.0).collect::<Vec<_>>(), [3]);
        for (r, len) in lengths.iter().enumerate() {
            if r == 3 {
                continue;
            }
            assert_eq!(p.values[r * 2], *len as f32, "row {r} back in place");
        }
        let padded: Vec<f32> = (0..6).map(|r| p.values[r * 2 + 1]).collect();
        assert_eq!(padded[..3], [5.0, 1.0, 3.0]);
        assert_eq!(padded[4..], [5.0, 1.0]);
        // A range of rows (a checkpoint segment) comes back relative to its start;
        // lengths round up to pad_to_multiple_of.
        tokens.multiple = 4;
        let mut b = Tokenized::default();
        let p = predict_tokens(
            &mut b,
            &model(),
            &tokens,
            4..6,
            8,
            &FailurePolicy::default(),
        )
        .unwrap();
        assert_eq!(b.calls, [(2, 4)]);
        assert_eq!(p.values, [4.0, 4.0, 1.0, 4.0]);
    }

    /// Like [`Fake`], but runs mini-batches as one run the way a GPU
    /// backend does, counting runs; a run stops at the first failure.
    struct Queued {
        inner: Fake,
        runs: Vec<usize>,
    }
    impl Backend for Queued {
        fn forward(
            &mut self,
            m: &ModelRef,
            f: &[f32],
            shape: &[usize],
        ) -> Result<Forwarded, ForwardError> {
            self.inner.forward(m, f, shape)
        }
        fn forward_run(
            &mut self,
            m: &ModelRef,
            f: &[f32],
            shape: &[usize],
            rows_per_call: usize,
        ) -> Ran {
            self.runs.push(f.len() / shape[0]);
            let mut ran = Ran::default();
            for chunk in f.chunks(rows_per_call * shape[0]) {
                match self.inner.forward(m, chunk, shape) {
                    Ok(out) => ran.done.push(out),
                    Err(e) => {
                        ran.failed = Some(e);
                        break;
                    }
                }
            }
            ran
        }
    }

    #[test]
    fn a_run_of_mini_batches_keeps_what_ran_and_handles_the_failed_one_alone() {
        // Mini-batches of 2: [1 2] [3 -999] [5 6] [7 8] — and out of memory
        // above 2 rows, so halving never applies.
        let f = rows(&[1.0, 2.0, 3.0, -999.0, 5.0, 6.0, 7.0, 8.0]);
        let mut b = Queued {
            inner: Fake {
                max_rows: 2,
                calls: 0,
            },
            runs: Vec::new(),
        };
        let p = predict(&mut b, &model(), &f, &[2], 2, &FailurePolicy::default()).unwrap();
        assert_eq!(
            p.failed.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            vec![3]
        );
        let want = [2.0, 3.0, 4.0, f32::NAN, 6.0, 7.0, 8.0, 9.0];
        for (i, (got, want)) in p.values.iter().zip(want).enumerate() {
            assert!(
                got == &want || (got.is_nan() && want.is_nan()),
                "row {i}: {got}"
            );
        }
        // One run of all 8 rows, stopped at the second mini-batch; that one
        // bisected call by call; the rest (4 rows) again as one run.
        assert_eq!(b.runs, vec![8, 4]);
    }

    #[test]
    fn without_isolation_or_when_every_row_raises_the_item_is_poison() {
        let f = rows(&[1.0, -999.0]);
        let policy = FailurePolicy {
            isolate_poison_rows: false,
            ..FailurePolicy::default()
        };
        let err = predict(
            &mut Fake {
                max_rows: 9,
                calls: 0,
            },
            &model(),
            &f,
            &[2],
            8,
            &policy,
        )
        .unwrap_err();
        assert_eq!(err.class, crate::error::FailureClass::Poison);
        let err = predict(
            &mut Fake {
                max_rows: 9,
                calls: 0,
            },
            &model(),
            &rows(&[-999.0, -999.0]),
            &[2],
            8,
            &FailurePolicy::default(),
        )
        .unwrap_err();
        assert!(
            err.message.contains("raised on every row"),
            "{}",
            err.message
        );
    }

    #[test]
    fn out_of_memory_halves_the_mini_batch_then_this_worker_is_unable() {
        let f = rows(&[
            1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0,
        ]);
        let mut fake = Fake {
            max_rows: 3,
            calls: 0,
        };
        let p = predict(&mut fake, &model(), &f, &[2], 12, &FailurePolicy::default()).unwrap();
        assert_eq!(
            p.values,
            (1..=12).map(|v| v as f32 + 1.0).collect::<Vec<_>>()
        );
        // 12 → oom, 6 → oom, 3 fits; the rest of the item then runs in 3s:
        // 2 wasted calls and 4 good ones, not one oom per mini-batch.
        assert_eq!(fake.calls, 6);
        let err = predict(
            &mut Fake {
                max_rows: 0,
                calls: 0,
            },
            &model(),
            &f,
            &[2],
            5,
            &FailurePolicy::default(),
        )
        .unwrap_err();
        assert_eq!(err.class, crate::error::FailureClass::Unable);
    }

    #[test]
    fn error_summary_finds_the_exception_line_of_a_traceback() {
        let full = "Internal torch error: The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript:\n  File \"x.py\", line 3\nRuntimeError: poison sentinel in input\n";
        assert_eq!(
            error_summary(full),
            "RuntimeError: poison sentinel in input"
        );
        assert_eq!(error_summary("plain message\nmore"), "plain message");
    }

    #[test]
    fn configured_patterns_make_model_errors_transient() {
        let policy = FailurePolicy {
            transient_errors: vec!["sentinel".into()],
            ..FailurePolicy::default()
        };
        let err = predict(
            &mut Fake {
                max_rows: 9,
                calls: 0,
            },
            &model(),
            &rows(&[-999.0]),
            &[2],
            8,
            &policy,
        )
        .unwrap_err();
        assert_eq!(err.class, crate::error::FailureClass::Transient);
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
