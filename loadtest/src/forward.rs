//! The compute ceiling: libtorch `forward` throughput on rows already in memory.
//!
//! Same model, same rows, same thread count as a worker, but no queue, no
//! Redis, no parsing and no output — what the fleet is compared against.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Rows loaded into one contiguous buffer.
#[derive(Debug, Clone)]
pub(crate) struct Features {
    /// Row-major values.
    pub values: Vec<f32>,
    /// Features per row.
    pub cols: usize,
}

impl Features {
    /// Rows held.
    pub fn rows(&self) -> usize {
        self.values.len().checked_div(self.cols).unwrap_or(0)
    }
}

/// Reads CSV files whose first column is an id and the rest are features.
pub fn load_csv(files: &[PathBuf]) -> Result<Features> {
    let mut values = Vec::new();
    let mut cols = 0;
    for f in files {
        let mut rdr =
            csv::Reader::from_path(f).with_context(|| format!("opening {}", f.display()))?;
        let width = rdr.headers()?.len().saturating_sub(1);
        if cols != 0 && width != cols {
            bail!("{} has {width} features, earlier files {cols}", f.display());
        }
        cols = width;
        let mut rec = csv::ByteRecord::new();
        while rdr.read_byte_record(&mut rec)? {
            for field in rec.iter().skip(1) {
                values.push(std::str::from_utf8(field)?.trim().parse::<f32>()?);
            }
        }
    }
    Ok(Features { values, cols })
}

/// Expands glob patterns into a sorted list of files.
pub fn expand(patterns: &[String]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in patterns {
        for e in glob::glob(p)? {
            files.push(e?);
        }
    }
    files.sort();
    if files.is_empty() {
        bail!("no files match {patterns:?}");
    }
    Ok(files)
}

/// One measured batch size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForwardResult {
    /// Rows per `forward` call.
    pub batch_size: usize,
    /// Median rows/s over the repeats.
    pub median_rows_per_s: f64,
}

/// Runs `forward` over all rows `repeats` times per batch size (after one
/// warm-up pass) and returns the median rows/s of each. On a GPU `device`
/// the rows start in host memory and each mini-batch is copied to the
/// device and its output back, one after the other, as a plain script does.
pub fn measure(
    model: &Path,
    features: &Features,
    batch_sizes: &[usize],
    threads: usize,
    repeats: usize,
    device: tch::Device,
) -> Result<Vec<ForwardResult>> {
    if threads > 0 {
        tch::set_num_threads(threads as i32);
    }
    let mut module = tch::CModule::load_on_device(model, device)
        .with_context(|| format!("loading {} on {device:?}", model.display()))?;
    module.set_eval();
    let _guard = tch::no_grad_guard();
    let pass = |bs: usize| -> Result<f64> {
        let started = Instant::now();
        for chunk in features.values.chunks(bs * features.cols) {
            let n = (chunk.len() / features.cols) as i64;
            let x = tch::Tensor::f_from_slice(chunk)?
                .f_view([n, features.cols as i64])?
                .f_to_device(device)?;
            let y = module.forward_ts(&[x])?;
            // Copy out as a worker does, so the figure includes that cost.
            let y = y
                .f_to_kind(tch::Kind::Float)?
                .f_to_device(tch::Device::Cpu)?
                .f_contiguous()?;
            let mut out = vec![0f32; y.numel()];
            y.f_copy_data(&mut out, y.numel())?;
        }
        Ok(features.rows() as f64 / started.elapsed().as_secs_f64())
    };
    let mut results = Vec::new();
    for &bs in batch_sizes {
        pass(bs)?;
        let mut runs = (0..repeats.max(1))
            .map(|_| pass(bs))
            .collect::<Result<Vec<_>>>()?;
        runs.sort_by(f64::total_cmp);
        results.push(ForwardResult {
            batch_size: bs,
            median_rows_per_s: runs[runs.len() / 2],
        });
    }
    Ok(results)
}
