//! The model-format part of `batchfleet-loadtest bench`: one MLP saved as
//! TorchScript (`torch.jit.script`) and compiled as an AOTInductor package
//! (`torch._inductor.aoti_compile_and_package`, CPU), run side by side by
//! the worker's own model backend (`TorchBackend`, the code path items
//! take) on the same rows in memory, passes alternating; plus the largest
//! difference between their outputs.

use anyhow::{Context, Result};
use batchfleet_shared::message::{FailurePolicy, ModelRef};
use batchfleet_testkit::python::make_aoti_model;
use batchfleet_worker::runner::{predict, TorchBackend};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

/// Features, hidden width and outputs of the MLP.
const SHAPE: (u32, u32, u32) = (64, 512, 16);
/// Rows per `forward`.
const BATCH: usize = 1024;
/// Timed passes per format (the median is reported).
const PASSES: usize = 5;

/// The format regime's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FormatRegime {
    /// Rows per pass.
    pub rows: u64,
    /// The model.
    pub model: String,
    /// TorchScript, median rows/s.
    pub torchscript_rows_per_s: f64,
    /// AOTInductor package, median rows/s.
    pub aoti_rows_per_s: f64,
    /// Package ÷ TorchScript.
    pub aoti_to_torchscript: f64,
    /// Largest absolute difference between the two formats' outputs.
    pub max_abs_diff: f64,
    /// Seconds the package took to compile (Python, once).
    pub compile_s: f64,
}

/// Runs the regime on `rows` rows under `root`.
pub fn run(root: &Path, rows: u64) -> Result<FormatRegime> {
    let dir = root.join("formats");
    std::fs::create_dir_all(&dir)?;
    println!("bench [formats] compiling the MLP as an AOTInductor package…");
    let started = Instant::now();
    make_aoti_model(&dir, (rows as u32, SHAPE.0, SHAPE.1, SHAPE.2))?;
    let compile_s = started.elapsed().as_secs_f64();
    let features = crate::forward::load_csv(&[dir.join("input.csv")])?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut backend = TorchBackend::new(cores, 1);
    let model = |file: &str| -> Result<ModelRef> {
        let path = dir.join(file);
        let sha = batchfleet_shared::fsutil::sha256_file(&path)
            .with_context(|| format!("hashing {}", path.display()))?;
        Ok(ModelRef::plain(path.to_string_lossy(), sha, "cpu"))
    };
    let (script, package) = (model("model.pt")?, model("model.pt2")?);
    let policy = FailurePolicy::default();
    let shape = [features.cols];
    let mut run = |m: &ModelRef| -> Result<(f64, Vec<f32>)> {
        let started = Instant::now();
        let p = predict(&mut backend, m, &features.values, &shape, BATCH, &policy)
            .map_err(|e| anyhow::anyhow!("{}: {e}", m.path))?;
        Ok((
            features.rows() as f64 / started.elapsed().as_secs_f64(),
            p.values,
        ))
    };
    // Loaded and warmed once each, outside the timed passes.
    let (_, a) = run(&script)?;
    let (_, b) = run(&package)?;
    let max_abs_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max);
    let (mut ts, mut pt2) = (Vec::new(), Vec::new());
    for _ in 0..PASSES {
        ts.push(run(&script)?.0);
        pt2.push(run(&package)?.0);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ts, pt2) = (median(&mut ts), median(&mut pt2));
    Ok(FormatRegime {
        rows,
        model: format!("MLP {}→{}→{}→{}", SHAPE.0, SHAPE.1, SHAPE.1, SHAPE.2),
        torchscript_rows_per_s: ts,
        aoti_rows_per_s: pt2,
        aoti_to_torchscript: pt2 / ts.max(1e-9),
        max_abs_diff,
        compile_s,
    })
}

/// Prints the figures.
pub fn print(f: &FormatRegime) {
    println!(
        "  formats: {} rows, {}, batch {BATCH}, median of {PASSES}: TorchScript {:.0} rows/s, AOTInductor .pt2 {:.0} rows/s (÷ {:.2}); outputs differ by at most {:.1e}; package compiled in {:.0} s",
        f.rows, f.model, f.torchscript_rows_per_s, f.aoti_rows_per_s, f.aoti_to_torchscript, f.max_abs_diff, f.compile_s
    );
}
