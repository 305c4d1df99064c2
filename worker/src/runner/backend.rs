//! What a model backend is: the small synchronous [`Backend`] trait that the
//! runner thread calls (one `forward` on rows of features or on a model's
//! named arguments, and a run of mini-batches), the values that cross it,
//! and [`Delayed`], a backend slowed down on purpose (`--debug-batch-delay`).

use crate::error::ItemError;
use batchfleet_shared::message::{InputSource, ModelRef, TensorType};

/// What one `forward` call returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Forwarded {
    /// Values, row-major (integers converted exactly up to 2^24).
    pub values: Vec<f32>,
    /// Outputs per row.
    pub width: usize,
    /// The output tensor held integers (or booleans).
    pub integer: bool,
    /// The selected outputs (see [`Predictions::parts`](super::Predictions::parts)).
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

/// Error messages that mean the allocator ran out, on CPU or GPU: CUDA's
/// and c10's allocators, and C++'s own (`std::bad_alloc`, which libtorch's
/// model loader throws when a copy of the archive does not fit).
pub fn is_out_of_memory(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("out of memory")
        || m.contains("can't allocate memory")
        || m.contains("cannot allocate memory")
        || m.contains("bad_alloc")
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

/// A backend for tests of the algorithms and the runner thread.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;

    /// Sums each row; raises on a row holding -999, runs out of memory on
    /// batches larger than `max_rows`.
    #[derive(Debug)]
    pub(crate) struct Fake {
        /// Largest batch that fits.
        pub(crate) max_rows: usize,
        /// `forward` calls so far.
        pub(crate) calls: usize,
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
}
