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
use batchfleet_shared::message::{
    FailurePolicy, InputSource, ModelRef, Pooling, Precision, Selector, TensorType,
};
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
    /// The selected outputs making up each row when `[output] select`
    /// names several tensors, in order: each one's column prefix (its key,
    /// or `output<k>`) and width; empty: one output.
    pub parts: Vec<(String, usize)>,
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
    /// The selected outputs (see [`Predictions::parts`]).
    pub parts: Vec<(String, usize)>,
}

impl Forwarded {
    /// One output of `width` values per row.
    pub fn single(values: Vec<f32>, width: usize, integer: bool) -> Self {
        Self {
            values,
            width,
            integer,
            parts: Vec::new(),
        }
    }
}

/// The values of one `forward` argument, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValues<'a> {
    /// Floats (features, pixels).
    F32(std::borrow::Cow<'a, [f32]>),
    /// Integers (token ids, masks).
    I64(std::borrow::Cow<'a, [i64]>),
}

/// One argument of a `forward` call: values, shape (rows first) and the
/// element type the model takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Arg<'a> {
    /// Where the values come from.
    pub source: InputSource,
    /// The values.
    pub values: ArgValues<'a>,
    /// Shape, rows first.
    pub shape: Vec<usize>,
    /// Element type of the tensor handed to the model.
    pub dtype: TensorType,
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

    /// Runs one `forward(args…)` with the arguments in order (a model of
    /// several inputs, token inputs, or a dtype other than the plain
    /// `float32` features). `mask`, for text input, is the attention mask
    /// (`[rows, L]`) that `[output] pooling = "mean"` averages under, whether
    /// or not the model takes it.
    fn forward_args(
        &mut self,
        model: &ModelRef,
        args: &[Arg<'_>],
        mask: Option<&Arg<'_>>,
    ) -> Result<Forwarded, ForwardError> {
        let _ = (args, mask);
        Err(ForwardError::Unusable(ItemError::unable(format!(
            "this worker's model backend cannot run {} on these inputs",
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

/// Predicts rows of token ids (text input), with `features` (`cols` per
/// row) beside them for a model that also takes numeric columns: the rows
/// are sorted by length so each mini-batch of `batch_size` is padded only
/// to its own longest row (dynamic padding), then the predictions are put
/// back in input order.
#[allow(clippy::too_many_arguments)]
pub fn predict_tokens<B: Backend + ?Sized>(
    backend: &mut B,
    model: &ModelRef,
    tokens: &Tokens,
    features: (&[f32], usize),
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
        types: Vec::with_capacity(tokens.types.len()),
        ..*tokens
    };
    let (features, cols) = features;
    let wants_features = cols > 0
        && model
            .inputs
            .iter()
            .any(|i| i.source == InputSource::Features);
    let mut sorted_features = Vec::with_capacity(if wants_features {
        order.len() * cols
    } else {
        0
    });
    for &i in &order {
        sorted.push_row(tokens, i);
        if wants_features {
            sorted_features.extend_from_slice(&features[i * cols..(i + 1) * cols]);
        }
    }
    let n = order.len();
    let by_length = predict_inputs(
        backend,
        model,
        Inputs::Tokens {
            tokens: &sorted,
            features: &sorted_features,
            cols,
        },
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
        parts: by_length.parts,
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
    /// Token ids, sorted by length, each mini-batch padded to its longest;
    /// with the rows' features (`cols` each, same order) when the model takes them.
    Tokens {
        tokens: &'a Tokens,
        features: &'a [f32],
        cols: usize,
    },
}

/// One mini-batch of padded token rows: ids, attention mask and type ids
/// (empty when not wanted), each `rows × len`, and `len`.
struct Padded<'a> {
    ids: &'a [i64],
    mask: &'a [i64],
    types: &'a [i64],
    len: usize,
}

/// The arguments of a `forward` on `rows` rows, in the order of
/// `model.inputs` (default: `input_ids, attention_mask` for text, the
/// features otherwise). `tokens`: ids, mask and type ids (`rows × len`);
/// `dense`: the rows' features and one row's shape.
fn arguments<'a>(
    model: &ModelRef,
    rows: usize,
    tokens: Option<Padded<'a>>,
    dense: (&'a [f32], &[usize]),
) -> (Vec<Arg<'a>>, Option<Arg<'a>>) {
    let (features, row_shape) = dense;
    let dense_shape: Vec<usize> = std::iter::once(rows)
        .chain(row_shape.iter().copied())
        .collect();
    let mut args = Vec::new();
    let mut mask_arg = None;
    match tokens {
        Some(Padded {
            ids,
            mask,
            types,
            len,
        }) => {
            let shape = vec![rows, len];
            let token = |source, values: &'a [i64], dtype| Arg {
                source,
                values: ArgValues::I64(std::borrow::Cow::Borrowed(values)),
                shape: shape.clone(),
                dtype,
            };
            if model.inputs.is_empty() {
                args.push(token(InputSource::InputIds, ids, TensorType::Int64));
                args.push(token(InputSource::AttentionMask, mask, TensorType::Int64));
            } else {
                for input in &model.inputs {
                    args.push(match input.source {
                        InputSource::InputIds => token(input.source, ids, input.dtype),
                        InputSource::AttentionMask => token(input.source, mask, input.dtype),
                        InputSource::TokenTypeIds => token(input.source, types, input.dtype),
                        InputSource::Features | InputSource::Pixels => Arg {
                            source: input.source,
                            values: ArgValues::F32(std::borrow::Cow::Borrowed(features)),
                            shape: dense_shape.clone(),
                            dtype: input.dtype,
                        },
                    });
                }
            }
            mask_arg = Some(token(InputSource::AttentionMask, mask, TensorType::Int64));
        }
        None => {
            let dense = |source, dtype| Arg {
                source,
                values: ArgValues::F32(std::borrow::Cow::Borrowed(features)),
                shape: dense_shape.clone(),
                dtype,
            };
            if model.inputs.is_empty() {
                args.push(dense(InputSource::Features, TensorType::Float32));
            }
            for input in &model.inputs {
                args.push(dense(input.source, input.dtype));
            }
        }
    }
    (args, mask_arg)
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
            } => {
                let rows = &features[lo * cols..hi * cols];
                if model.takes_plain_features() {
                    backend.forward(model, rows, row_shape)
                } else {
                    let (args, _) = arguments(model, hi - lo, None, (rows, row_shape));
                    backend.forward_args(model, &args, None)
                }
            }
            Inputs::Tokens {
                tokens,
                features,
                cols,
            } => {
                let longest = (lo..hi).map(|i| tokens.row(i).len()).max().unwrap_or(0);
                let len = tokens.padded_len(longest);
                let n = hi - lo;
                let mut ids = vec![tokens.pad_id; n * len];
                let mut mask = vec![0i64; n * len];
                let mut types = if tokens.types.is_empty() {
                    Vec::new()
                } else {
                    vec![0i64; n * len]
                };
                for (r, i) in (lo..hi).enumerate() {
                    let row = tokens.row(i);
                    ids[r * len..r * len + row.len()].copy_from_slice(row);
                    mask[r * len..r * len + row.len()].fill(1);
                    if !types.is_empty() {
                        types[r * len..r * len + row.len()].copy_from_slice(tokens.row_types(i));
                    }
                }
                let dense = if features.is_empty() {
                    &features[..0]
                } else {
                    &features[lo * cols..hi * cols]
                };
                let padded = Padded {
                    ids: &ids,
                    mask: &mask,
                    types: &types,
                    len,
                };
                let (args, mask) = arguments(model, n, Some(padded), (dense, &[cols]));
                backend.forward_args(model, &args, mask.as_ref())
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
            } if model.takes_plain_features() => {
                backend.forward_run(model, &features[lo * cols..hi * cols], row_shape, fit)
            }
            _ => {
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
        if self.out.parts.is_empty() {
            self.out.parts = f.parts;
        }
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
                                (&batch.features, batch.cols),
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

    fn forward_args(
        &mut self,
        model: &ModelRef,
        args: &[Arg<'_>],
        mask: Option<&Arg<'_>>,
    ) -> Result<Forwarded, ForwardError> {
        std::thread::sleep(self.delay);
        self.inner.forward_args(model, args, mask)
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

/// libtorch through `tch`: TorchScript modules, cached by path, digest and
/// precision.
pub struct TorchBackend {
    cache: HashMap<(String, String, Option<Precision>), Loaded>,
}

/// A model loaded by [`TorchBackend`]: a TorchScript module, or an
/// AOTInductor package (`.pt2`) through libtorch's package loader.
#[derive(Debug)]
pub enum Loaded {
    /// `torch.jit.save`.
    Script(tch::CModule),
    /// `torch._inductor.aoti_compile_and_package`.
    Package(crate::aoti::Package),
}

impl Loaded {
    /// One `forward` on `inputs`: a TorchScript module's return value, or
    /// a package's outputs (one tensor, or a tuple of them: `select` picks
    /// by position).
    fn call(&self, inputs: Vec<tch::Tensor>) -> Result<tch::IValue, ForwardError> {
        match self {
            Loaded::Script(m) => {
                let inputs: Vec<tch::IValue> =
                    inputs.into_iter().map(tch::IValue::Tensor).collect();
                m.forward_is(&inputs).map_err(classify)
            }
            Loaded::Package(p) => {
                let mut out = p
                    .run(&inputs)
                    .map_err(|e| classify_line(error_summary(&e)))?;
                Ok(if out.len() == 1 {
                    tch::IValue::Tensor(out.pop().expect("one output"))
                } else {
                    tch::IValue::Tuple(out.into_iter().map(tch::IValue::Tensor).collect())
                })
            }
        }
    }
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
    pub fn module(&mut self, model: &ModelRef) -> Result<&Loaded, ItemError> {
        let key = (model.path.clone(), model.sha256.clone(), model.dtype);
        if !self.cache.contains_key(&key) {
            let started = std::time::Instant::now();
            let module = load_pinned(model)?;
            tracing::info!(model = %model.path, device = %model.device, dtype = model.dtype.map_or("as saved", Precision::as_str), ms = started.elapsed().as_millis() as u64, "model loaded");
            metrics::histogram!(names::WORKER_MODEL_LOAD).record(started.elapsed().as_secs_f64());
            self.cache.insert(key.clone(), module);
        }
        Ok(&self.cache[&key])
    }
}

/// The libtorch element type of a reduced precision.
fn precision_kind(p: Precision) -> tch::Kind {
    match p {
        Precision::Bfloat16 => tch::Kind::BFloat16,
        Precision::Float16 => tch::Kind::Half,
    }
}

/// Reads `model`'s file once, checks its digest and kind on those bytes,
/// and loads them onto the model's device (in its `dtype`, when set); an
/// AOTInductor package is loaded from a private copy of those bytes. Who
/// is at fault decides the class: a file this worker cannot read is this
/// worker's problem (`unable`: another may have it mounted); a file that is
/// not the job's (digest) or not TorchScript, or that libtorch refuses,
/// fails the job (`unrunnable`).
fn load_pinned(model: &ModelRef) -> Result<Loaded, ItemError> {
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
    if !kind.is_runnable() {
        return Err(ItemError::unrunnable(format!(
            "model {} is {}; {}",
            model.path,
            kind.describe(),
            batchfleet_shared::model_file::EXPORT_FIX
        )));
    }
    let device = TorchBackend::device(&model.device)?;
    if kind == batchfleet_shared::model_file::ModelKind::AotiPackage {
        return load_package(model, &bytes, device).map(Loaded::Package);
    }
    let mut module =
        tch::CModule::load_data_on_device(&mut bytes.as_slice(), device).map_err(|e| {
            ItemError::unrunnable(format!(
                "libtorch cannot load TorchScript model {}: {}",
                model.path,
                error_summary(&e.to_string())
            ))
        })?;
    module.set_eval();
    if let Some(p) = model.dtype {
        // Floating-point parameters and buffers only (integer buffers keep their type).
        module.to(device, precision_kind(p), false);
    }
    Ok(Loaded::Script(module))
}

/// Loads an AOTInductor package from `bytes` (already checked against the
/// job's digest), through a private copy the loader reads and extracts.
fn load_package(
    model: &ModelRef,
    bytes: &[u8],
    device: tch::Device,
) -> Result<crate::aoti::Package, ItemError> {
    if model.dtype.is_some() {
        return Err(ItemError::unrunnable(format!(
            "model {} is an AOTInductor package, compiled in one precision; remove [model] dtype, or compile the package from the model in that precision",
            model.path
        )));
    }
    static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let copy = std::env::temp_dir().join(format!(
        "batchfleet-{}-{}-{}.pt2",
        std::process::id(),
        COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        &model.sha256[..model.sha256.len().min(16)]
    ));
    std::fs::write(&copy, bytes).map_err(|e| {
        ItemError::unable(format!(
            "cannot stage package {} in {}: {e}",
            model.path,
            copy.display()
        ))
    })?;
    let cuda = match device {
        tch::Device::Cuda(n) => Some(n),
        _ => None,
    };
    let loaded = crate::aoti::Package::load(&copy, cuda);
    let _ = std::fs::remove_file(&copy);
    loaded.map_err(|e| {
        ItemError::unrunnable(format!(
            "libtorch cannot load AOTInductor package {} on {}: {}; a package runs only on the device kind it was compiled for (compile it with the model and inputs on that device)",
            model.path,
            model.device,
            error_summary(&e)
        ))
    })
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
    classify_line(error_summary(&e.to_string()))
}

/// [`classify`] for an error's informative line.
fn classify_line(line: String) -> ForwardError {
    if is_out_of_memory(&line) {
        ForwardError::OutOfMemory(line)
    } else {
        ForwardError::Raised(line)
    }
}

/// One `forward` launched: its output on its way to host memory.
struct Launched {
    /// `float32`, `[rows, width]`, on the host (or, after a non-blocking
    /// copy, arriving there).
    y: tch::Tensor,
    rows: usize,
    width: usize,
    integer: bool,
    parts: Vec<(String, usize)>,
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
            parts: self.parts,
        })
    }
}

/// Launches `forward` on `features` on `device`. `queued`: the device is a
/// GPU and the call must not wait for it: the rows go through pinned host
/// memory with a non-blocking copy, and the output comes back the same way
/// (read it after the device is synchronized). Otherwise the call returns
/// with the output on the host.
fn launch(
    module: &Loaded,
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
    let y = module.call(vec![input])?;
    landed(y, n, model, None, queued)
}

/// What a `forward` returned, for messages: `a tensor`, `a tuple of 3`, `a
/// dict with keys "a", "b"`.
fn describe(y: &tch::IValue) -> String {
    match y {
        tch::IValue::Tensor(_) => "a tensor".into(),
        tch::IValue::Tuple(v) => format!("a tuple of {}", v.len()),
        tch::IValue::TensorList(v) => format!("a list of {} tensors", v.len()),
        tch::IValue::GenericList(v) => format!("a list of {}", v.len()),
        tch::IValue::GenericDict(kv) => format!(
            "a dict with keys {}",
            kv.iter()
                .map(|(k, _)| match k {
                    tch::IValue::String(s) => format!("{s:?}"),
                    other => format!("{other:?}"),
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => "a value that is not a tensor".into(),
    }
}

/// The tensors `model` writes out of what its `forward` returned: its one
/// tensor, or those `[output] select` names (dict keys, or positions in a
/// tuple or list), in order. A selection the output does not have fails
/// the job: every item returns the same structure.
fn selected(y: tch::IValue, model: &ModelRef) -> Result<Vec<tch::Tensor>, ForwardError> {
    let wrong = |why: String| {
        ForwardError::Unusable(ItemError::unrunnable(format!(
            "model {} returned {}; {why}",
            model.path,
            describe(&y)
        )))
    };
    let tensor = |v: &tch::IValue| match v {
        tch::IValue::Tensor(t) => Some(t.shallow_clone()),
        _ => None,
    };
    if model.select.is_empty() {
        return match &y {
            tch::IValue::Tensor(t) => Ok(vec![t.shallow_clone()]),
            _ => Err(wrong(
                "set [output] select to the key (or position) of the output to write".into(),
            )),
        };
    }
    let mut out = Vec::with_capacity(model.select.len());
    for s in &model.select {
        let found = match (&y, s) {
            (tch::IValue::GenericDict(kv), Selector::Name(name)) => kv
                .iter()
                .find(|(k, _)| matches!(k, tch::IValue::String(key) if key == name))
                .and_then(|(_, v)| tensor(v)),
            (tch::IValue::Tuple(v) | tch::IValue::GenericList(v), Selector::Index(i)) => {
                v.get(*i as usize).and_then(tensor)
            }
            (tch::IValue::TensorList(v), Selector::Index(i)) => {
                v.get(*i as usize).map(tch::Tensor::shallow_clone)
            }
            (tch::IValue::Tensor(t), Selector::Index(0)) => Some(t.shallow_clone()),
            _ => None,
        };
        match found {
            Some(t) => out.push(t),
            None => {
                return Err(wrong(format!(
                    "[output] select = {s} names no tensor in it; select a key of a dict or a position in a tuple or list"
                )))
            }
        }
    }
    Ok(out)
}

/// One selected output as `float32` `[n, width]`: `[n]` is one column,
/// `[n, D]` is `D`, `[n, L, D]` is pooled (`[output] pooling`, the mean
/// under `mask`); then L2-normalised rows (`[output] normalize`). Returns
/// the tensor, its width and whether the model returned integers.
fn shaped(
    t: tch::Tensor,
    n: i64,
    model: &ModelRef,
    mask: Option<&tch::Tensor>,
) -> Result<(tch::Tensor, usize, bool), ForwardError> {
    let integer = !t.is_floating_point();
    let size = t.size();
    let t = t.f_to_kind(tch::Kind::Float).map_err(classify)?;
    let (t, width) = match (size.as_slice(), model.pooling) {
        ([m], _) if *m == n => (t.f_unsqueeze(1).map_err(classify)?, 1),
        ([m, k], _) if *m == n => (t, *k as usize),
        ([m, l, d], Some(pooling)) if *m == n => {
            let pooled = match pooling {
                Pooling::Cls => t.f_select(1, 0),
                Pooling::Mean => {
                    let Some(mask) = mask.filter(|m| m.size() == [n, *l]) else {
                        return Err(ForwardError::Unusable(ItemError::unrunnable(format!(
                            "model {} returned [{n}, {l}, {d}] but pooling = \"mean\" averages under the attention mask of the rows' tokens ({}); use text input with a tokenizer, or pooling = \"cls\"",
                            model.path,
                            mask.map_or("none here".into(), |m| format!("{:?}", m.size()))
                        ))));
                    };
                    let m = mask.f_to_kind(tch::Kind::Float).and_then(|m| m.f_unsqueeze(-1));
                    m.and_then(|m| {
                        let sum = (&t * &m).f_sum_dim_intlist(1, false, tch::Kind::Float)?;
                        let count = m
                            .f_sum_dim_intlist(1, false, tch::Kind::Float)?
                            .f_clamp_min(1e-9)?;
                        sum.f_div(&count)
                    })
                }
            }
            .map_err(classify)?;
            (pooled, *d as usize)
        }
        ([m, l, d], None) if *m == n => {
            return Err(ForwardError::Unusable(ItemError::unrunnable(format!(
                "model {} returned [{n}, {l}, {d}] (a vector per token); set [output] pooling = \"mean\" or \"cls\" to write one vector per row",
                model.path
            ))))
        }
        (other, _) => {
            return Err(ForwardError::Unusable(ItemError::unrunnable(format!(
                "model {} returned shape {other:?} for {n} rows; batchfleet expects [rows], [rows, outputs] or, with [output] pooling, [rows, tokens, dim]",
                model.path
            ))))
        }
    };
    let t = if model.normalize {
        t.f_norm_scalaropt_dim(2, [1i64].as_slice(), true)
            .and_then(|norm| norm.f_clamp_min(1e-12))
            .and_then(|norm| t.f_div(&norm))
            .map_err(classify)?
    } else {
        t
    };
    Ok((t, width, integer))
}

/// `forward`'s output `y` for `n` rows, as written (see [`selected`] and
/// [`shaped`]), on its way to host memory (`queued`: a non-blocking copy;
/// read it after the device is synchronized).
fn landed(
    y: tch::IValue,
    n: i64,
    model: &ModelRef,
    mask: Option<&tch::Tensor>,
    queued: bool,
) -> Result<Launched, ForwardError> {
    let mut tensors = Vec::new();
    let mut parts = Vec::new();
    let mut integer = true;
    for (k, t) in selected(y, model)?.into_iter().enumerate() {
        let (t, width, int) = shaped(t, n, model, mask)?;
        tensors.push(t);
        let prefix = model.select.get(k).map(Selector::column_prefix);
        parts.push((prefix.unwrap_or_default(), width));
        integer &= int;
    }
    let y = if tensors.len() == 1 {
        tensors.pop().expect("one tensor")
    } else {
        tch::Tensor::f_cat(&tensors, 1).map_err(classify)?
    };
    let width = parts.iter().map(|p| p.1).sum();
    if parts.len() == 1 {
        parts.clear();
    }
    let y = y
        .f_to_device_(tch::Device::Cpu, tch::Kind::Float, queued, false)
        .map_err(classify)?;
    Ok(Launched {
        y,
        rows: n as usize,
        width,
        integer,
        parts,
    })
}

/// One argument as a tensor on `device`, of its element type (float
/// inputs in the model's `dtype` when it has one).
fn tensor_of(
    arg: &Arg<'_>,
    device: tch::Device,
    model: &ModelRef,
) -> Result<tch::Tensor, ForwardError> {
    let dims: Vec<i64> = arg.shape.iter().map(|d| *d as i64).collect();
    let host = match &arg.values {
        ArgValues::F32(v) => tch::Tensor::f_from_slice(v),
        ArgValues::I64(v) => tch::Tensor::f_from_slice(v),
    }
    .and_then(|t| t.f_view(dims.as_slice()))
    .map_err(classify)?;
    let kind = match arg.dtype {
        TensorType::Int64 => tch::Kind::Int64,
        TensorType::Int32 => tch::Kind::Int,
        TensorType::Float32 => model.dtype.map_or(tch::Kind::Float, precision_kind),
        TensorType::Float64 => tch::Kind::Double,
    };
    host.f_to_device_(device, kind, false, false)
        .map_err(classify)
}

impl Backend for TorchBackend {
    fn load(&mut self, model: &ModelRef) -> Result<(), ItemError> {
        self.module(model).map(|_| ())
    }

    fn forward_args(
        &mut self,
        model: &ModelRef,
        args: &[Arg<'_>],
        mask: Option<&Arg<'_>>,
    ) -> Result<Forwarded, ForwardError> {
        let device = Self::device(&model.device).map_err(ForwardError::Unusable)?;
        let module = self.module(model).map_err(ForwardError::Unusable)?;
        let _guard = tch::no_grad_guard();
        let inputs = args
            .iter()
            .map(|a| tensor_of(a, device, model))
            .collect::<Result<Vec<_>, _>>()?;
        let mask = match mask {
            Some(m) if model.pooling == Some(Pooling::Mean) => Some(tensor_of(m, device, model)?),
            _ => None,
        };
        let rows = args
            .first()
            .and_then(|a| a.shape.first())
            .copied()
            .unwrap_or(0);
        let started = std::time::Instant::now();
        let y = module.call(inputs)?;
        let landed = landed(y, rows as i64, model, mask.as_ref(), false)?.collect();
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
            Ok(Forwarded::single(
                f.chunks(cols).map(|r| r.iter().sum()).collect(),
                1,
                false,
            ))
        }
    }

    fn model() -> ModelRef {
        ModelRef::plain("m.pt", "x", "cpu")
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

        fn forward_args(
            &mut self,
            _m: &ModelRef,
            args: &[Arg<'_>],
            mask_arg: Option<&Arg<'_>>,
        ) -> Result<Forwarded, ForwardError> {
            let values = |a: &Arg<'_>| match &a.values {
                ArgValues::I64(v) => v.to_vec(),
                ArgValues::F32(_) => panic!("token ids are integers"),
            };
            let [ids, mask] = args else {
                panic!("the default text call is forward(input_ids, attention_mask)")
            };
            assert_eq!(
                (ids.source, mask.source, ids.dtype),
                (
                    InputSource::InputIds,
                    InputSource::AttentionMask,
                    TensorType::Int64
                )
            );
            assert_eq!(mask_arg.map(values), Some(values(mask)));
            let (rows, len) = (ids.shape[0], ids.shape[1]);
            let (ids, mask) = (values(ids), values(mask));
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
            Ok(Forwarded::single(values, 2, false))
        }
    }

    /// Records each call's arguments — (source, dtype, shape), the feature
    /// values, the type ids — and returns each row's first feature.
    #[derive(Default)]
    struct Recording {
        calls: Vec<Vec<(InputSource, TensorType, Vec<usize>)>>,
        features: Vec<Vec<f32>>,
        types: Vec<Vec<i64>>,
    }
    impl Backend for Recording {
        fn forward(
            &mut self,
            _m: &ModelRef,
            _f: &[f32],
            _shape: &[usize],
        ) -> Result<Forwarded, ForwardError> {
            unreachable!("named inputs go through forward_args")
        }

        fn forward_args(
            &mut self,
            _m: &ModelRef,
            args: &[Arg<'_>],
            _mask: Option<&Arg<'_>>,
        ) -> Result<Forwarded, ForwardError> {
            self.calls.push(
                args.iter()
                    .map(|a| (a.source, a.dtype, a.shape.clone()))
                    .collect(),
            );
            let mut first = Vec::new();
            for a in args {
                match (&a.source, &a.values) {
                    (InputSource::Features, ArgValues::F32(v)) => {
                        self.features.push(v.to_vec());
                        first = v.chunks(a.shape[1]).map(|r| r[0]).collect();
                    }
                    (InputSource::TokenTypeIds, ArgValues::I64(v)) => self.types.push(v.to_vec()),
                    _ => {}
                }
            }
            assert_eq!(first.len(), args[0].shape[0], "one value per row");
            Ok(Forwarded::single(first, 1, false))
        }
    }

    #[test]
    fn named_inputs_are_built_in_order_with_each_rows_features_and_type_ids() {
        use batchfleet_shared::message::ModelInput;
        // Rows of lengths 3, 1, 2; row r's features are [r, 10 r].
        let mut tokens = crate::batch::Tokens {
            pad_id: 0,
            ..Default::default()
        };
        for (r, len) in [3usize, 1, 2].iter().enumerate() {
            tokens.types.extend(std::iter::repeat_n(r as i64 + 1, *len));
            tokens.push(&vec![5; *len]);
        }
        let features = [0.0, 0.0, 1.0, 10.0, 2.0, 20.0];
        let input = |name: &str, source, dtype| ModelInput {
            name: name.into(),
            source,
            dtype,
        };
        let model = ModelRef {
            inputs: vec![
                input("ids", InputSource::InputIds, TensorType::Int32),
                input("numeric", InputSource::Features, TensorType::Float64),
                input("types", InputSource::TokenTypeIds, TensorType::Int64),
                input("mask", InputSource::AttentionMask, TensorType::Int64),
            ],
            ..model()
        };
        let mut b = Recording::default();
        let p = predict_tokens(
            &mut b,
            &model,
            &tokens,
            (&features, 2),
            0..3,
            2,
            &FailurePolicy::default(),
        )
        .unwrap();
        // Sorted by length: rows 1 and 2 (padded to 2), then row 0 (3).
        use InputSource::*;
        use TensorType::*;
        assert_eq!(
            b.calls[0],
            [
                (InputIds, Int32, vec![2, 2]),
                (Features, Float64, vec![2, 2]),
                (TokenTypeIds, Int64, vec![2, 2]),
                (AttentionMask, Int64, vec![2, 2]),
            ]
        );
        assert_eq!(b.calls[1][0].2, [1, 3]);
        // Each row's features and type ids travel with it; pads get type 0.
        assert_eq!(b.features, [vec![1.0, 10.0, 2.0, 20.0], vec![0.0, 0.0]]);
        assert_eq!(b.types, [vec![2, 0, 3, 3], vec![1, 1, 1]]);
        // Back in input order: each row's first feature is its index.
        assert_eq!(p.values, [0.0, 1.0, 2.0]);
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
            (&[], 0),
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
            (&[], 0),
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
