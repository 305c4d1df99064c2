//! The libtorch backend through `tch`: TorchScript modules and AOTInductor
//! packages loaded once per (path, digest, device, precision) and cached —
//! the `--models-kept` most recently used within `--models-memory` bytes
//! on each device, the others dropped — each file
//! read once so its digest is checked on the bytes that are loaded; tensors
//! built from the arguments, the model's output selected, pooled and shaped
//! per row; libtorch's errors classified (out of memory, raised, unusable);
//! on a GPU every mini-batch of a run launched before any result is read.

use super::aoti::Package;
use super::backend::{
    call_by_call, is_out_of_memory, Arg, ArgValues, Backend, ForwardError, Forwarded, Ran,
};
use crate::error::ItemError;
use batchfleet_shared::message::{ModelRef, Pooling, Precision, Selector, TensorType};
use batchfleet_shared::metrics::names;
/// Models a worker keeps loaded by default (`--models-kept`).
pub const DEFAULT_MODELS_KEPT: usize = 4;

/// What a loaded model is cached under: its file, digest, device and
/// precision (the same file on another device is another module).
pub(super) type Key = (String, String, String, Option<Precision>);

pub(super) fn key_of(model: &ModelRef) -> Key {
    (
        model.path.clone(),
        model.sha256.clone(),
        model.device.clone(),
        model.dtype,
    )
}

/// The libtorch backend: the models it has loaded with the bytes each
/// holds, the most recently used last, at most `kept` of them and, on each
/// device, `memory` bytes (a model larger than that alone is kept alone).
pub struct TorchBackend {
    cache: Vec<(Key, Loaded, u64)>,
    kept: usize,
    memory: Option<u64>,
}

/// A model loaded by [`TorchBackend`]: a TorchScript module, or an
/// AOTInductor package (`.pt2`) through libtorch's package loader.
#[derive(Debug)]
pub enum Loaded {
    /// `torch.jit.save`.
    Script(tch::CModule),
    /// `torch._inductor.aoti_compile_and_package`.
    Package(Package),
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
            .field("kept", &self.kept)
            .field("memory", &self.memory)
            .finish()
    }
}

impl TorchBackend {
    /// Sets libtorch's intra-op threads (0 keeps libtorch's default) and an
    /// inter-op pool of one: each worker runs one forward at a time. Keeps
    /// the `kept` (at least 1) most recently used models loaded.
    pub fn new(intra_op_threads: usize, kept: usize) -> Self {
        if intra_op_threads > 0 {
            tch::set_num_threads(intra_op_threads as i32);
        }
        // libtorch allows this only before inter-op work starts, so once per
        // process (a replacement runner after a hung item must not repeat it).
        static INTEROP: std::sync::Once = std::sync::Once::new();
        INTEROP.call_once(|| tch::set_num_interop_threads(1));
        Self {
            cache: Vec::new(),
            kept: kept.max(1),
            memory: None,
        }
    }

    /// Keeps at most `bytes` of models loaded on each device (a model
    /// counts its parameters, or its file when larger; `--models-memory`;
    /// `None`: no bound but the count).
    pub fn with_memory(mut self, bytes: Option<u64>) -> Self {
        self.memory = bytes;
        self
    }

    /// Bytes of models loaded on `device`.
    fn held_on(&self, device: &str) -> u64 {
        self.cache
            .iter()
            .filter(|(k, _, _)| same_device(&k.2, device))
            .map(|(_, _, b)| b)
            .sum()
    }

    /// Drops the least recently used models on `device` until `bytes` more
    /// fit within `--models-memory` (or none is left there).
    fn make_room(&mut self, device: &str, bytes: u64) {
        let Some(limit) = self.memory else { return };
        while self.held_on(device) + bytes > limit {
            let Some(i) = self
                .cache
                .iter()
                .position(|(k, _, _)| same_device(&k.2, device))
            else {
                break;
            };
            self.drop_at(i, "more model memory than --models-memory");
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
    ///
    /// The cache keeps the `kept` most recently used models: room is made
    /// (the least recently used dropped, freeing its memory) before a new
    /// one loads. A load that runs out of memory with other models still
    /// loaded drops them all and tries once more; out of memory alone, the
    /// worker cannot take the job now (`unable`: another worker may have
    /// the memory), where any other load error fails the job.
    pub fn module(&mut self, model: &ModelRef) -> Result<&Loaded, ItemError> {
        // Called before every forward: the model's own TF32 setting, the
        // switch being the process's.
        super::precision::set_tf32(model.tf32);
        // Found without building a key.
        let found = self
            .cache
            .iter()
            .position(|((path, sha, device, dtype), _, _)| {
                *path == model.path
                    && *sha == model.sha256
                    && *device == model.device
                    && *dtype == model.dtype
            });
        if let Some(i) = found {
            if i + 1 < self.cache.len() {
                let used = self.cache.remove(i);
                self.cache.push(used);
            }
        } else {
            while self.cache.len() >= self.kept {
                self.drop_oldest("more models than --models-kept");
            }
            // Room before the load, for its file's size (the weights it
            // holds, about), so the load itself fits; checked again below
            // with what it holds once loaded.
            if self.memory.is_some() {
                let file = batchfleet_shared::pinned::local_file(&model.path, &model.sha256)
                    .and_then(|f| std::fs::metadata(f).ok())
                    .map_or(0, |m| m.len());
                self.make_room(&model.device, file);
            }
            let started = std::time::Instant::now();
            let loaded = match load_pinned(model) {
                Err(e)
                    if e.class == crate::error::FailureClass::Unable
                        && is_out_of_memory(&e.message)
                        && !self.cache.is_empty() =>
                {
                    tracing::warn!(model = %model.path, "out of memory loading the model; dropping the other models and trying again");
                    while !self.cache.is_empty() {
                        self.drop_oldest("out of memory loading another");
                    }
                    load_pinned(model)?
                }
                other => other?,
            };
            let (module, bytes) = loaded;
            self.make_room(&model.device, bytes);
            tracing::info!(model = %model.path, device = %model.device, dtype = model.dtype.map_or("as saved", Precision::as_str), mib = bytes >> 20, ms = started.elapsed().as_millis() as u64, "model loaded");
            metrics::histogram!(names::WORKER_MODEL_LOAD).record(started.elapsed().as_secs_f64());
            self.cache.push((key_of(model), module, bytes));
            self.report();
        }
        Ok(&self.cache.last().expect("the model just used").1)
    }

    /// Drops the least recently used model (its memory freed with it).
    fn drop_oldest(&mut self, why: &str) {
        if !self.cache.is_empty() {
            self.drop_at(0, why);
        }
    }

    /// Drops the model at `i` of the cache (its memory freed with it).
    fn drop_at(&mut self, i: usize, why: &str) {
        let ((path, _, device, _), _, bytes) = self.cache.remove(i);
        tracing::info!(model = %path, device = %device, mib = bytes >> 20, reason = why, "model dropped from the cache");
        self.report();
    }

    /// The cache's size in the metrics.
    fn report(&self) {
        metrics::gauge!(names::WORKER_MODELS_LOADED).set(self.cache.len() as f64);
        let bytes: u64 = self.cache.iter().map(|(_, _, b)| b).sum();
        metrics::gauge!(names::WORKER_MODELS_BYTES).set(bytes as f64);
    }

    /// The models loaded, least recently used first: (path, device, bytes).
    pub fn cached(&self) -> Vec<(String, String, u64)> {
        self.cache
            .iter()
            .map(|((path, _, device, _), _, b)| (path.clone(), device.clone(), *b))
            .collect()
    }
}

/// Whether two device names are one device (`cuda` is `cuda:0`).
fn same_device(a: &str, b: &str) -> bool {
    let canonical = |d: &str| {
        if d == "cuda" {
            "cuda:0".to_owned()
        } else {
            d.to_owned()
        }
    };
    canonical(a) == canonical(b)
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
/// is at fault decides the class: a file this worker cannot read, or a
/// load that runs out of memory, is this worker's problem (`unable`:
/// another may have it mounted, or the memory); a file that is not the
/// job's (digest) or not TorchScript, or that libtorch refuses otherwise,
/// fails the job (`unrunnable`). Returns the model with the bytes it
/// holds: its parameters' (in the loaded precision) or its file's, the
/// larger (a frozen module keeps its weights as constants, not parameters).
fn load_pinned(model: &ModelRef) -> Result<(Loaded, u64), ItemError> {
    use batchfleet_shared::pinned::PinnedError;
    // An `s3://` model comes through this machine's cache (downloaded once).
    let bytes = match batchfleet_shared::pinned::read(&model.path, &model.sha256) {
        Ok(bytes) => bytes,
        Err(PinnedError::Unreadable(e)) => {
            return Err(ItemError::unable(format!(
                "cannot read model {} on this worker: {e}",
                model.path
            )))
        }
        Err(PinnedError::Changed { actual, bytes }) => {
            return Err(ItemError::unrunnable(format!(
                "model {} has sha256 {actual} but the job expects {} (it is now {}); the file changed after the job was planned — restore it, or run the manifest again to start a job with the new model",
                model.path,
                model.sha256,
                batchfleet_shared::model_file::inspect_bytes(&bytes).describe()
            )))
        }
    };
    let kind = batchfleet_shared::model_file::inspect_bytes(&bytes);
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
        let size = bytes.len() as u64;
        return load_package(model, &bytes, device).map(|p| (Loaded::Package(p), size));
    }
    let mut module = tch::CModule::load_data_on_device(&mut bytes.as_slice(), device)
        .map_err(|e| load_error(model, &e.to_string()))?;
    module.set_eval();
    if let Some(p) = model.dtype {
        // Floating-point parameters and buffers only (integer buffers keep their type).
        module.to(device, precision_kind(p), false);
    }
    let params: u64 = module.named_parameters().map_or(0, |ps| {
        ps.iter()
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    });
    Ok((Loaded::Script(module), params.max(bytes.len() as u64)))
}

/// A libtorch load error, classed: out of memory is this worker's
/// (`unable`), anything else the model's (`unrunnable`).
fn load_error(model: &ModelRef, text: &str) -> ItemError {
    let summary = error_summary(text);
    if is_out_of_memory(text) {
        ItemError::unable(format!(
            "out of memory loading model {} on {}: {summary}; this worker leaves the job to others for now",
            model.path, model.device
        ))
    } else {
        ItemError::unrunnable(format!(
            "libtorch cannot load TorchScript model {}: {summary}",
            model.path
        ))
    }
}

/// Loads an AOTInductor package from `bytes` (already checked against the
/// job's digest), through a private copy the loader reads and extracts.
fn load_package(model: &ModelRef, bytes: &[u8], device: tch::Device) -> Result<Package, ItemError> {
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
    let loaded = Package::load(&copy, cuda);
    let _ = std::fs::remove_file(&copy);
    loaded.map_err(|e| {
        if is_out_of_memory(&e) {
            return load_error(model, &e);
        }
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
    fn a_model_on_another_device_is_another_cache_entry() {
        let cpu = ModelRef::plain("/models/m.pt", "ab".repeat(32), "cpu");
        let mut cuda = cpu.clone();
        cuda.device = "cuda:0".into();
        assert_ne!(key_of(&cpu), key_of(&cuda));
        let mut half = cpu.clone();
        half.dtype = Some(Precision::Float16);
        assert_ne!(key_of(&cpu), key_of(&half));
        assert_eq!(key_of(&cpu), key_of(&cpu.clone()));
    }

    #[test]
    fn out_of_memory_loading_is_this_workers_and_other_load_errors_the_models() {
        let model = ModelRef::plain("/models/m.pt", "ab".repeat(32), "cuda:0");
        let oom = load_error(
            &model,
            "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.8 GiB total capacity)",
        );
        assert_eq!(oom.class, crate::error::FailureClass::Unable, "{oom}");
        assert!(oom.message.contains("leaves the job to others"), "{oom}");
        let cpu = load_error(&model, "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes");
        assert_eq!(cpu.class, crate::error::FailureClass::Unable, "{cpu}");
        // A copy of the archive that does not fit (tch's loader copies it twice).
        let copy = load_error(&model, "Internal torch error: std::bad_alloc");
        assert_eq!(copy.class, crate::error::FailureClass::Unable, "{copy}");
        let bad = load_error(
            &model,
            "PytorchStreamReader failed locating file constants.pkl: file not found",
        );
        assert_eq!(bad.class, crate::error::FailureClass::Unrunnable, "{bad}");
    }
}
