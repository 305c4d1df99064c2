//! The prediction algorithms: an item's rows turned into single `forward`
//! calls. Rows go in mini-batches of `inference_batch_size`; on
//! out-of-memory a mini-batch is retried in halves; when the model raises
//! on a mini-batch it is bisected to find the rows that make it raise
//! (poison-row isolation), so one bad record costs one row, not the item.
//! Token rows are sorted by length and each mini-batch is padded only to
//! its own longest row, then the predictions are put back in input order.

use super::backend::{Arg, ArgValues, Backend, ForwardError, Forwarded, Ran};
use crate::batch::Tokens;
use crate::error::ItemError;
use batchfleet_shared::message::{FailurePolicy, InputSource, ModelRef, TensorType};
use batchfleet_shared::metrics::names;

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
    /// The shadow model's call on the same rows (`[model.shadow]`).
    pub shadow: Option<Box<Shadowed>>,
    /// The mini-batch size the call fell back to after running out of memory.
    pub oom_fit: Option<usize>,
}

/// What the shadow model did on a call's rows, beside the job's model.
#[derive(Debug, Clone, PartialEq)]
pub struct Shadowed {
    /// Its predictions (rows it raised on are NaN), or why it did not run.
    pub result: Result<Predictions, String>,
    /// The job's model's time on these rows.
    pub main: std::time::Duration,
    /// The shadow's.
    pub shadow: std::time::Duration,
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
    predict_segments(
        backend,
        model,
        inputs,
        rows,
        &[(0, rows, batch_size)],
        policy,
    )
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
    let segments = token_batches(&sorted, batch_size, tokens.max_batch_tokens);
    let by_length = predict_segments(
        backend,
        model,
        Inputs::Tokens {
            tokens: &sorted,
            features: &sorted_features,
            cols,
        },
        n,
        &segments,
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
        shadow: None,
        oom_fit: by_length.oom_fit,
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

/// Mini-batches of rows sorted by length, as runs of equal-sized ones:
/// `(first row, end, rows per mini-batch)`. Each mini-batch takes rows
/// while their count times the padded length of its longest (its last)
/// stays within `max_tokens`, and `batch_size` rows at most (at least one
/// row); 0 `max_tokens`: `batch_size` rows each.
fn token_batches(
    sorted: &Tokens,
    batch_size: usize,
    max_tokens: usize,
) -> Vec<(usize, usize, usize)> {
    let n = sorted.rows();
    let batch_size = batch_size.max(1);
    if max_tokens == 0 {
        return vec![(0, n, batch_size)];
    }
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    let mut at = 0;
    while at < n {
        let mut k = 1;
        while k < batch_size
            && at + k < n
            && (k + 1) * sorted.padded_len(sorted.row(at + k).len()) <= max_tokens
        {
            k += 1;
        }
        match runs.last_mut() {
            Some((_, end, size)) if *size == k && *end == at => *end = at + k,
            _ => runs.push((at, at + k, k)),
        }
        at += k;
    }
    runs
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

/// Predicts `rows` rows of `inputs` in runs of mini-batches of their own size
/// (`(first row, end, rows per mini-batch)`, covering every row in order).
/// A mini-batch size that ran out of memory caps the runs after it too.
fn predict_segments<B: Backend + ?Sized>(
    backend: &mut B,
    model: &ModelRef,
    inputs: Inputs<'_>,
    rows: usize,
    segments: &[(usize, usize, usize)],
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
        fit: usize::MAX,
    };
    let mut cap = usize::MAX;
    for &(lo, hi, size) in segments {
        let fit = size.max(1).min(cap);
        run.fit = fit;
        run.in_chunks(lo, hi)?;
        if run.fit < fit {
            cap = run.fit;
        }
    }
    out.oom_fit = (cap < usize::MAX).then_some(cap);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::backend::fake::Fake;

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

    #[test]
    fn a_token_budget_fills_each_mini_batch_with_short_rows_and_few_long_ones() {
        // Lengths 1, 1, 1, 1, 2, 2, 3, 6, 8 (in no order).
        let lengths = [6usize, 1, 2, 1, 8, 1, 3, 2, 1];
        let mut tokens = crate::batch::Tokens {
            pad_id: 7,
            ..Default::default()
        };
        for len in lengths {
            tokens.push(&vec![1i64; len]);
        }
        tokens.max_batch_tokens = 6;
        let mut b = Tokenized::default();
        let p = predict_tokens(
            &mut b,
            &model(),
            &tokens,
            (&[], 0),
            0..lengths.len(),
            4,
            &FailurePolicy::default(),
        )
        .unwrap();
        // Sorted: 1 1 1 1 | 2 2 (3 rows of 2 would be 6, but the next is 3:
        // 3 × 3 = 9) | 3 | 6 | 8 (alone over the budget: one row at least).
        // Four rows at most (the batch size), never more than 6 tokens but
        // for a row longer than that alone.
        assert_eq!(b.calls, [(4, 1), (2, 2), (1, 3), (1, 6), (1, 8)]);
        for (r, len) in lengths.iter().enumerate() {
            assert_eq!(p.values[r * 2], *len as f32, "row {r} back in place");
        }
        // Runs of equal-sized mini-batches: one call to the backend each.
        let sorted = {
            let mut t = crate::batch::Tokens::default();
            for len in [1usize, 1, 1, 1, 1, 1, 4, 4] {
                t.push(&vec![1i64; len]);
            }
            t
        };
        assert_eq!(token_batches(&sorted, 2, 8), [(0, 8, 2)]);
        assert_eq!(token_batches(&sorted, 3, 8), [(0, 6, 3), (6, 8, 2)]);
        assert_eq!(token_batches(&sorted, 5, 0), [(0, 8, 5)]);
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
}
