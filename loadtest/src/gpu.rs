//! `batchfleet-loadtest gpu-check`: on a machine with a GPU, the fleet's
//! rows/s next to raw libtorch `forward` on the device, for a compute-bound
//! and an I/O-bound model, and how much of the job the GPU sat idle. Sized to
//! finish within four minutes; on a machine without a GPU it says so and
//! measures nothing.
//!
//! - Raw `forward`: the job's rows in host memory, each mini-batch copied to
//!   the device and its output back, one after the other (what a plain
//!   script does), at the best of three batch sizes.
//! - The fleet: the services on this machine, one worker with every core on
//!   the first GPU (`[model] device = "cuda"`), running the same rows from
//!   CSV files at that batch size; the output is checked against PyTorch's.
//! - Idle: one minus the device's busy time (the sum of
//!   `batchfleet_worker_device_seconds`) over the job's wall time.

use crate::fault::sibling;
use crate::fleet::{run_job, Fleet};
use crate::forward;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What `gpu-check` runs.
#[derive(Debug, Clone)]
pub struct GpuCheckConfig {
    /// Rows of each of the two jobs.
    pub rows: u64,
    /// Work folder (default: a temporary one).
    pub dir: Option<PathBuf>,
}

/// One model's figures.
#[derive(Debug, Clone, Serialize)]
pub struct GpuFigures {
    /// `compute-bound` or `io-bound`.
    pub name: String,
    /// The model.
    pub model: String,
    /// Rows of the job.
    pub rows: u64,
    /// Raw `forward` rows/s on the device at its best batch size.
    pub forward_rows_per_s: f64,
    /// That batch size.
    pub batch: usize,
    /// The fleet's rows/s (one worker, one GPU).
    pub fleet_rows_per_s: f64,
    /// Fleet over raw `forward`.
    pub ratio: f64,
    /// Share of the job's wall time the GPU had no work from the worker.
    pub gpu_idle: f64,
}

/// Runs the check and prints its figures; `Ok(None)` without a GPU.
pub fn run(cfg: &GpuCheckConfig) -> Result<Option<Vec<GpuFigures>>> {
    if !tch::Cuda::is_available() {
        println!(
            "gpu-check: no CUDA device is visible to libtorch here (device count {}); nothing measured. Run it on a machine with a GPU and the CUDA build of libtorch.",
            tch::Cuda::device_count()
        );
        return Ok(None);
    }
    services::ensure_local()?;
    let (worker, coordinator) = (sibling("batchfleet-worker")?, sibling("batchfleet")?);
    let (root, _tmp) = crate::fault::work_dir(cfg.dir.as_deref())?;
    let prefix = services::unique("bfgpu");
    println!(
        "gpu-check: {} CUDA device(s); measuring on cuda:0, {} rows per model",
        tch::Cuda::device_count(),
        cfg.rows
    );
    let mut figures = Vec::new();
    let outcome = (|| -> Result<()> {
        for (name, hidden) in [("compute-bound", 4096), ("io-bound", 64)] {
            figures.push(one(
                &root.join(name),
                name,
                hidden,
                cfg.rows,
                (&worker, &coordinator),
                &prefix,
            )?);
        }
        Ok(())
    })();
    services::delete_redis_prefix(&prefix);
    outcome?;
    println!("\ngpu-check (cuda:0):");
    println!(
        "  {:<14} {:>14} {:>7} {:>14} {:>7} {:>9}",
        "model", "forward rows/s", "batch", "fleet rows/s", "ratio", "GPU idle"
    );
    for f in &figures {
        println!(
            "  {:<14} {:>14.0} {:>7} {:>14.0} {:>7.2} {:>8.0}%",
            f.name,
            f.forward_rows_per_s,
            f.batch,
            f.fleet_rows_per_s,
            f.ratio,
            f.gpu_idle * 100.0
        );
    }
    Ok(Some(figures))
}

fn one(
    dir: &Path,
    name: &str,
    hidden: u32,
    rows: u64,
    bins: (&Path, &Path),
    prefix: &str,
) -> Result<GpuFigures> {
    let pool = services::unique(&format!("gpu-{name}"));
    println!("gpu-check [{name}] writing {rows} rows and the model…");
    make_job(
        dir,
        &JobGen {
            rows,
            files: 8,
            features: 32,
            hidden,
            outputs: 1,
            name: format!("gpu-{name}"),
            pool: pool.clone(),
            item_rows: 50_000,
            batch_size: 4096,
            ..JobGen::default()
        },
    )?;
    println!("gpu-check [{name}] raw forward on cuda:0…");
    let features = forward::load_csv(&forward::expand(&[format!(
        "{}/data/*.csv",
        dir.display()
    )])?)?;
    let best = forward::measure(
        &dir.join("model.pt"),
        &features,
        &[1024, 4096, 16384],
        0,
        3,
        tch::Device::Cuda(0),
    )?
    .into_iter()
    .max_by(|a, b| a.median_rows_per_s.total_cmp(&b.median_rows_per_s))
    .context("no batch size measured")?;
    drop(features);
    let manifest = dir.join("job.toml");
    let text = std::fs::read_to_string(&manifest)?;
    for needed in ["device = \"cpu\"\n", "inference_batch_size = 4096\n"] {
        if !text.contains(needed) {
            bail!("{} does not set {}", manifest.display(), needed.trim());
        }
    }
    std::fs::write(
        &manifest,
        text.replace("device = \"cpu\"\n", "device = \"cuda\"\n")
            .replace(
                "inference_batch_size = 4096\n",
                &format!("inference_batch_size = {}\n", best.batch_size),
            ),
    )?;
    println!("gpu-check [{name}] the fleet: one worker on cuda:0…");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut fleet = Fleet::start(bins.0, dir, &pool, prefix, 1, cores)?;
    let (wall, _, _) = run_job(bins.1, &manifest, prefix)?;
    let busy = fleet.metric_sum("batchfleet_worker_device_seconds_sum");
    fleet.stop();
    services::delete_pool_queues(&pool);
    // TF32 and kernel choice differ from the CPU's: a looser tolerance.
    let v = batchfleet_testkit::verify::verify(&dir.join("out"), &dir.join("golden.csv"), 1e-3)?;
    if !v.ok() {
        bail!("[{name}] output does not match PyTorch: {}", v.describe());
    }
    let fleet_rate = rows as f64 / wall.max(1e-9);
    Ok(GpuFigures {
        name: name.into(),
        model: format!("MLP 32→{hidden}→{hidden}→1"),
        rows,
        forward_rows_per_s: best.median_rows_per_s,
        batch: best.batch_size,
        fleet_rows_per_s: fleet_rate,
        ratio: fleet_rate / best.median_rows_per_s,
        gpu_idle: (1.0 - busy / wall.max(1e-9)).clamp(0.0, 1.0),
    })
}
