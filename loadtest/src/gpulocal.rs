//! `batchfleet-loadtest gpu-check --local`: the GPU path measured with no
//! services — on a machine that has PyTorch and nothing else (the bundle of
//! `make gpu-bundle`), or anywhere.
//!
//! Three models — a compute-bound MLP over CSV features, a sentence
//! encoder over CSV text (a word-level `tokenizer.json`), an image CNN over
//! JPEG files — each in float32, float32 with `[model] tf32` (on a GPU) and
//! bfloat16. For each, side by side in one run:
//! - **resident**: `forward` on mini-batches already on the device, at the
//!   host-fed loop's best batch — the device's ceiling;
//! - **host-fed**: the rows in host memory, each mini-batch copied in and
//!   its output back, one after the other (a hand-written PyTorch loop), at
//!   the best of a few batch sizes;
//! - **fleet**: `batchfleet run --local` (one pipeline with every core, the
//!   in-process queues and job store) over files of the same rows at that
//!   batch: read → parse, tokenize or decode → copy → forward → write, from
//!   the command's start to its summary; its output checked against
//!   PyTorch's on a sample of rows;
//! - the fleet over each, and the GPU's busy share during the fleet's run
//!   (`nvidia-smi`'s utilisation, sampled every 200 ms).
//!
//! Each figure gets `--seconds` of device work (10 on a GPU, after a warm-up
//! pass; the host-fed loop tries each batch size for a second first). On a machine
//! without a GPU it says so and runs the same pipeline on the CPU with
//! small models for a second or two per figure, so CI proves the path (and
//! a bundle) works. For the CNN it states how many images one core decodes
//! and preprocesses per second, and sizes the fleet's job to the lower of
//! the host-fed rate and all cores' decoding.
//!
//! The models and PyTorch's predictions come from `python3` (or
//! `BATCHFLEET_PYTHON`) running the generator built into this binary
//! (`loadtest/python/gpu_models.py`, torch and the standard library only).

use crate::fault::{sibling, work_dir};
use crate::fleet::run_job_with;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The generator, written into the work folder and run there.
const GENERATOR: &str = include_str!("../python/gpu_models.py");

/// What `gpu-check --local` runs.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// Seconds of device work per figure (default: 10 on a GPU, 1.5 on the CPU).
    pub seconds: Option<f64>,
    /// Work folder (default: a temporary one).
    pub dir: Option<PathBuf>,
    /// Force the CPU even where a GPU is visible.
    pub cpu: bool,
}

/// One model in one precision.
#[derive(Debug, Clone, Serialize)]
pub struct CaseFigures {
    /// The model, in words.
    pub model: String,
    /// `float32`, `float32+tf32` (`[model] tf32`, on a GPU only) or `bfloat16`.
    pub dtype: String,
    /// Rows per `forward` call (the host-fed loop's best).
    pub batch: usize,
    /// Rows/s of `forward` on rows already on the device.
    pub resident_rows_per_s: f64,
    /// Rows/s of the host-fed loop at `batch`.
    pub host_fed_rows_per_s: f64,
    /// Rows of the fleet's job.
    pub fleet_rows: u64,
    /// Rows/s of `batchfleet run --local`, start to summary.
    pub fleet_rows_per_s: f64,
    /// Its wall time (s).
    pub fleet_wall_s: f64,
    /// Fleet ÷ host-fed.
    pub fleet_vs_host_fed: f64,
    /// Fleet ÷ resident.
    pub fleet_vs_resident: f64,
    /// The GPU's mean utilisation during the fleet's run (0–1; none on the
    /// CPU or without `nvidia-smi`).
    pub gpu_busy: Option<f64>,
    /// Largest difference from PyTorch's float32 predictions on the sample.
    pub max_abs_diff: f64,
    /// The difference allowed (relative to the sample's largest output).
    pub tolerance: f64,
    /// Images only: decoded and preprocessed per second on one core.
    pub decode_per_core: Option<f64>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct LocalFigures {
    /// `cuda:0 (<name>)` or `cpu`.
    pub device: String,
    /// Whether a GPU was used.
    pub gpu: bool,
    /// Cores of this machine.
    pub cores: usize,
    /// Seconds of device work per figure.
    pub seconds: f64,
    /// Each model and precision.
    pub cases: Vec<CaseFigures>,
}

/// A model of the check and the sizes of its data.
struct Case {
    /// The model, in words.
    label: String,
    /// MLP (features) or sentence encoder (text).
    kind: CaseKind,
    /// The generator's flags for it.
    args: Vec<String>,
    /// Rows of the one CSV file the job's files are links of.
    file_rows: usize,
    item_rows: usize,
    batches: &'static [usize],
}

enum CaseKind {
    /// `features` columns `f0..`.
    Mlp { features: usize },
    /// A `text` column of words `w0..w{vocab-1}`.
    Text { vocab: usize },
    /// `distinct` JPEG files of `size × size` pixels (the job's files are
    /// links of them, `max_files` at most).
    Images {
        size: u32,
        distinct: usize,
        max_files: usize,
    },
}

/// The generator's flags for a model of `kind`: `--kind <kind> --<k> <v> …`.
fn generator_args(kind: &str, pairs: &[(&str, usize)]) -> Vec<String> {
    ["--kind".to_owned(), kind.to_owned()]
        .into_iter()
        .chain(
            pairs
                .iter()
                .flat_map(|(k, v)| [format!("--{k}"), v.to_string()]),
        )
        .collect()
}

/// The cases: an MLP, a sentence encoder and an image CNN, large on a GPU,
/// small on the CPU.
fn cases(gpu: bool) -> Vec<Case> {
    let pick = |on_gpu: usize, on_cpu: usize| if gpu { on_gpu } else { on_cpu };
    let batches = |on_gpu: &'static [usize], on_cpu: &'static [usize]| {
        if gpu {
            on_gpu
        } else {
            on_cpu
        }
    };
    let (hidden, layers) = (pick(8192, 512), pick(4, 2));
    let mlp = Case {
        label: format!("MLP 64→{hidden}×{layers}→4"),
        kind: CaseKind::Mlp { features: 64 },
        args: generator_args(
            "mlp",
            &[
                ("features", 64),
                ("hidden", hidden),
                ("layers", layers),
                ("outputs", 4),
            ],
        ),
        file_rows: pick(100_000, 20_000),
        item_rows: pick(50_000, 5_000),
        batches: batches(&[1024, 4096, 16384], &[1024, 4096]),
    };
    let (vocab, dim, layers) = (pick(8000, 1000), pick(768, 64), pick(6, 2));
    let text = Case {
        label: format!("encoder {dim}d×{layers}"),
        kind: CaseKind::Text { vocab },
        args: generator_args(
            "text",
            &[
                ("vocab", vocab),
                ("dim", dim),
                ("heads", pick(12, 4)),
                ("layers", layers),
                ("ff", pick(3072, 128)),
                ("outputs", 4),
            ],
        ),
        file_rows: pick(50_000, 5_000),
        item_rows: pick(10_000, 1_000),
        batches: batches(&[64, 256, 1024], &[64, 256]),
    };
    let (size, layers) = (pick(224, 64), pick(5, 4));
    let cnn = Case {
        label: format!("CNN {size}px×{layers}"),
        kind: CaseKind::Images {
            size: size as u32,
            distinct: pick(64, 32),
            max_files: pick(300_000, 2_000),
        },
        args: generator_args("cnn", &[("size", size), ("layers", layers), ("outputs", 4)]),
        // The images held in host memory for the loops.
        file_rows: pick(1024, 256),
        item_rows: pick(256, 64),
        batches: batches(&[64, 256, 1024], &[32, 128]),
    };
    vec![mlp, text, cnn]
}

/// Runs the check and prints its figures.
pub fn run(cfg: &LocalConfig) -> Result<LocalFigures> {
    let gpu = !cfg.cpu && tch::Cuda::is_available();
    let device = if gpu {
        tch::Device::Cuda(0)
    } else {
        tch::Device::Cpu
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Eight model and precision pairs × three figures: 10 s each keeps a
    // GPU run under six minutes.
    let seconds = cfg.seconds.unwrap_or(if gpu { 10.0 } else { 1.5 });
    let name = if gpu {
        format!("cuda:0 ({})", gpu_name().unwrap_or_else(|| "GPU".into()))
    } else {
        "cpu".to_owned()
    };
    if gpu {
        println!("gpu-check --local: {name}, {seconds} s of device work per figure");
    } else {
        println!(
            "gpu-check --local: no CUDA device is visible to libtorch here (device count {}); running the same pipeline on the CPU, {seconds} s per figure, to show it works",
            tch::Cuda::device_count()
        );
    }
    let (root, _tmp) = work_dir(cfg.dir.as_deref())?;
    let coordinator = sibling("batchfleet")?;
    let script = root.join("gpu_models.py");
    std::fs::write(&script, GENERATOR)?;
    let mut figures = Vec::new();
    for (i, case) in cases(gpu).iter().enumerate() {
        let dir = root.join(format!("case-{i}"));
        std::fs::create_dir_all(&dir)?;
        let base = dir.join("rows.csv");
        let mut decode = None;
        let (host, verify) = match case.kind {
            CaseKind::Mlp { features } => (
                Host::Features(write_rows(&base, features, case.file_rows)?, features),
                dir.join("verify.csv"),
            ),
            CaseKind::Text { vocab } => (
                Host::Tokens(write_text(&base, vocab, case.file_rows)?),
                dir.join("verify.csv"),
            ),
            CaseKind::Images { size, distinct, .. } => {
                let (pixels, per_core) = write_images(&dir, size, distinct, case.file_rows)?;
                println!("  decoding and preprocessing: {per_core:.0} images/s per core");
                decode = Some(per_core);
                (Host::Pixels(pixels, size as usize), dir.join("verify.bin"))
            }
        };
        if !matches!(case.kind, CaseKind::Images { .. }) {
            write_head(&base, &verify, 256)?;
        }
        generate(&script, &dir, &case.args, &verify)?;
        // TF32 only where it does something: on a GPU.
        // And not for the CNN: libtorch lets cuDNN's convolutions use TF32
        // already, as PyTorch does; the switch is the matrix products'.
        let images = matches!(case.kind, CaseKind::Images { .. });
        let precisions: &[(&str, tch::Kind)] = if gpu && !images {
            &[
                ("float32", tch::Kind::Float),
                ("float32+tf32", tch::Kind::Float),
                ("bfloat16", tch::Kind::BFloat16),
            ]
        } else {
            &[
                ("float32", tch::Kind::Float),
                ("bfloat16", tch::Kind::BFloat16),
            ]
        };
        for &(dtype, kind) in precisions {
            // The loops here run under the same switch as the job.
            batchfleet_worker::runner::set_tf32(dtype.ends_with("+tf32"));
            let result = one(
                case,
                &dir,
                &host,
                dtype,
                kind,
                device,
                seconds,
                cores,
                &coordinator,
                decode,
            );
            batchfleet_worker::runner::set_tf32(false);
            figures.push(result?);
        }
    }
    let figures = LocalFigures {
        device: name,
        gpu,
        cores,
        seconds,
        cases: figures,
    };
    print(&figures);
    Ok(figures)
}

/// One case in one precision: the three figures and the check.
#[allow(clippy::too_many_arguments)]
fn one(
    case: &Case,
    dir: &Path,
    host: &Host,
    dtype: &str,
    kind: tch::Kind,
    device: tch::Device,
    seconds: f64,
    cores: usize,
    coordinator: &Path,
    decode: Option<f64>,
) -> Result<CaseFigures> {
    let label = &case.label;
    let model = dir.join("model.pt");
    println!("gpu-check [{label}, {dtype}] forward, rows on the device and fed from host memory…");
    let (batch, host_fed) = best_host_fed(&model, host, case.batches, device, kind, seconds)?;
    let resident = resident(&model, host, batch, device, kind, seconds)?;
    // The fleet's job: as many rows as `seconds` of the host-fed loop's
    // rate take — or, for images, of the rate the machine's cores decode
    // them at, if that is lower — in links of the rows' file (of the
    // images).
    let rate = decode.map_or(host_fed, |d| host_fed.min(d * cores as f64));
    let rows_wanted = (rate * seconds).max(case.file_rows as f64);
    let job = dir.join(format!("job-{}", dtype.replace('+', "-")));
    let _ = std::fs::remove_dir_all(&job);
    std::fs::create_dir_all(job.join("data"))?;
    let (fleet_rows, files) = match case.kind {
        CaseKind::Images {
            distinct,
            max_files,
            ..
        } => {
            let n = (rows_wanted as usize).clamp(distinct, max_files.max(distinct));
            for i in 0..n {
                let name = if i < distinct {
                    image_id(i)
                } else {
                    format!("l-{i:07}.jpg")
                };
                link(
                    &dir.join("img").join(image_id(i % distinct)),
                    job.join("data").join(name),
                )?;
            }
            (n as u64, n)
        }
        _ => {
            let files = (rows_wanted / case.file_rows as f64).ceil() as usize;
            for i in 0..files {
                link(
                    &dir.join("rows.csv"),
                    job.join(format!("data/part-{i:05}.csv")),
                )?;
            }
            ((files * case.file_rows) as u64, files)
        }
    };
    // The model (and tokenizer) under the job's folder: the data root of
    // `run --local`.
    link(&model, job.join("model.pt"))?;
    if matches!(case.kind, CaseKind::Text { .. }) {
        link(&dir.join("tokenizer.json"), job.join("tokenizer.json"))?;
    }
    let manifest = job.join("job.toml");
    std::fs::write(
        &manifest,
        manifest_text(
            case,
            dtype,
            batch,
            if device.is_cuda() { "cuda" } else { "cpu" },
        ),
    )?;
    println!("gpu-check [{label}, {dtype}] the fleet: run --local, {fleet_rows} rows in {files} files, batch {batch}…");
    let sampler = device.is_cuda().then(UtilSampler::start).flatten();
    let local = ["--local", "--workers", "1", "--threads"]
        .map(str::to_owned)
        .into_iter()
        .chain([cores.to_string()])
        .collect::<Vec<_>>();
    let ran = run_job_with(coordinator, &manifest, "bf-unused", &local, "out");
    let gpu_busy = sampler.and_then(UtilSampler::stop);
    let (wall, _, summary) = ran?;
    let done = summary["rows_predicted"].as_u64().unwrap_or(0);
    if done != fleet_rows {
        bail!("[{label}, {dtype}] the job predicted {done} rows of {fleet_rows}");
    }
    // cuDNN's convolutions may run in TF32 on a GPU whatever the switch
    // says (libtorch's default, as PyTorch's): the CNN in float32 there is
    // held to TF32's tolerance.
    let tf32 = dtype.ends_with("+tf32")
        || (device.is_cuda() && matches!(case.kind, CaseKind::Images { .. }));
    let (max_abs_diff, tolerance) = check(&job.join("out"), &dir.join("golden.csv"), kind, tf32)?;
    if max_abs_diff > tolerance {
        bail!("[{label}, {dtype}] output differs from PyTorch's by {max_abs_diff:.3e} (allowed {tolerance:.3e})");
    }
    let _ = std::fs::remove_dir_all(&job);
    let fleet = fleet_rows as f64 / wall.max(1e-9);
    Ok(CaseFigures {
        model: label.clone(),
        dtype: dtype.to_owned(),
        batch,
        resident_rows_per_s: resident,
        host_fed_rows_per_s: host_fed,
        fleet_rows,
        fleet_rows_per_s: fleet,
        fleet_wall_s: wall,
        fleet_vs_host_fed: fleet / host_fed,
        fleet_vs_resident: fleet / resident,
        gpu_busy,
        max_abs_diff,
        tolerance,
        decode_per_core: decode,
    })
}

/// A hard link of `from` at `to` (a copy where links are not possible).
fn link(from: &Path, to: PathBuf) -> Result<()> {
    std::fs::hard_link(from, &to).or_else(|_| std::fs::copy(from, &to).map(|_| ()))?;
    Ok(())
}

/// A case's rows in host memory.
enum Host {
    /// Row-major features, and their number per row.
    Features(Vec<f32>, usize),
    /// Each row's token ids (`[CLS] … [SEP]`).
    Tokens(Vec<Vec<i64>>),
    /// Preprocessed images, `[3, size, size]` each, and their size.
    Pixels(Vec<f32>, usize),
}

impl Host {
    fn rows(&self) -> usize {
        match self {
            Host::Features(v, cols) => v.len() / cols,
            Host::Tokens(t) => t.len(),
            Host::Pixels(v, size) => v.len() / (3 * size * size),
        }
    }

    /// The rows as mini-batches of `batch` rows on the CPU: features
    /// `[n, F]`; or token ids and mask `[n, L]`, the rows sorted by length
    /// and each batch padded to its longest (as a worker does).
    fn batches(&self, batch: usize) -> Result<Vec<Vec<tch::Tensor>>> {
        match self {
            Host::Features(values, cols) => values
                .chunks(batch * cols)
                .map(|chunk| {
                    let n = (chunk.len() / cols) as i64;
                    Ok(vec![
                        tch::Tensor::f_from_slice(chunk)?.f_view([n, *cols as i64])?
                    ])
                })
                .collect(),
            Host::Pixels(values, size) => {
                let row = 3 * size * size;
                values
                    .chunks(batch * row)
                    .map(|chunk| {
                        let n = (chunk.len() / row) as i64;
                        let s = *size as i64;
                        Ok(vec![tch::Tensor::f_from_slice(chunk)?.f_view([n, 3, s, s])?])
                    })
                    .collect()
            }
            Host::Tokens(rows) => {
                let mut order: Vec<&Vec<i64>> = rows.iter().collect();
                order.sort_by_key(|r| r.len());
                order
                    .chunks(batch)
                    .map(|chunk| {
                        let len = chunk.iter().map(|r| r.len()).max().unwrap_or(1);
                        let mut ids = vec![0i64; chunk.len() * len];
                        let mut mask = vec![0i64; chunk.len() * len];
                        for (i, r) in chunk.iter().enumerate() {
                            ids[i * len..i * len + r.len()].copy_from_slice(r);
                            mask[i * len..i * len + r.len()].fill(1);
                        }
                        let shape = [chunk.len() as i64, len as i64];
                        Ok(vec![
                            tch::Tensor::f_from_slice(&ids)?.f_view(shape)?,
                            tch::Tensor::f_from_slice(&mask)?.f_view(shape)?,
                        ])
                    })
                    .collect()
            }
        }
    }
}

/// A batch's tensors on `device`, floating-point ones in `kind`.
fn to_device(
    batch: &[tch::Tensor],
    device: tch::Device,
    kind: tch::Kind,
) -> Result<Vec<tch::Tensor>> {
    batch
        .iter()
        .map(|t| {
            let t = t.f_to_device(device)?;
            Ok(if t.is_floating_point() {
                t.f_to_kind(kind)?
            } else {
                t
            })
        })
        .collect()
}

fn print(f: &LocalFigures) {
    println!("\ngpu-check --local on {} ({} cores):", f.device, f.cores);
    println!(
        "  {:<22} {:<9} {:>6} {:>14} {:>14} {:>14} {:>8} {:>8} {:>8} {:>10}",
        "model",
        "dtype",
        "batch",
        "resident/s",
        "host-fed/s",
        "fleet/s",
        "÷host",
        "÷resid",
        "GPU busy",
        "max diff"
    );
    for c in &f.cases {
        println!(
            "  {:<22} {:<9} {:>6} {:>14.0} {:>14.0} {:>14.0} {:>8.2} {:>8.2} {:>8} {:>10.2e}",
            c.model,
            c.dtype,
            c.batch,
            c.resident_rows_per_s,
            c.host_fed_rows_per_s,
            c.fleet_rows_per_s,
            c.fleet_vs_host_fed,
            c.fleet_vs_resident,
            c.gpu_busy
                .map_or_else(|| "n/a".to_owned(), |b| format!("{:.0}%", b * 100.0)),
            c.max_abs_diff
        );
    }
    for c in f.cases.iter().filter(|c| c.dtype == "float32") {
        if let Some(d) = c.decode_per_core {
            println!(
                "  {}: one core decodes and preprocesses {d:.0} images/s ({:.0} on {} cores)",
                c.model,
                d * f.cores as f64,
                f.cores
            );
        }
    }
}

/// The name of GPU 0, from `nvidia-smi`.
fn gpu_name() -> Option<String> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,driver_version",
            "--format=csv,noheader",
            "-i",
            "0",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Deterministic rows `id,f0..` with values in [-1, 1] at four decimals,
/// written to `path` and returned.
fn write_rows(path: &Path, features: usize, rows: usize) -> Result<Vec<f32>> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let header: Vec<String> = std::iter::once("id".to_owned())
        .chain((0..features).map(|k| format!("f{k}")))
        .collect();
    writeln!(out, "{}", header.join(","))?;
    let mut rng = fastrand::Rng::with_seed(11);
    let mut values = Vec::with_capacity(rows * features);
    for i in 0..rows {
        write!(out, "r{i}")?;
        for _ in 0..features {
            // The value as written, so the host rows are the file's.
            let v: f32 = format!("{:.4}", rng.f32() * 2.0 - 1.0).parse()?;
            write!(out, ",{v}")?;
            values.push(v);
        }
        writeln!(out)?;
    }
    out.flush()?;
    Ok(values)
}

/// Deterministic rows `id,text` of 8–64 words `w0..w{vocab-1}`, written to
/// `path`; each row's token ids returned as the generator's tokenizer
/// gives them: `[CLS]` (2), word k as 4 + k, `[SEP]` (3).
fn write_text(path: &Path, vocab: usize, rows: usize) -> Result<Vec<Vec<i64>>> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(out, "id,text")?;
    let mut rng = fastrand::Rng::with_seed(13);
    let mut tokens = Vec::with_capacity(rows);
    for i in 0..rows {
        let words = rng.usize(8..=64);
        let mut ids = Vec::with_capacity(words + 2);
        ids.push(2);
        write!(out, "r{i},")?;
        for w in 0..words {
            let k = rng.usize(0..vocab);
            write!(out, "{}w{k}", if w == 0 { "" } else { " " })?;
            ids.push(4 + k as i64);
        }
        ids.push(3);
        writeln!(out)?;
        tokens.push(ids);
    }
    out.flush()?;
    Ok(tokens)
}

/// The name (and id) of distinct image `i`.
fn image_id(i: usize) -> String {
    format!("o-{i:05}.jpg")
}

/// `distinct` seeded JPEG images of `size × size` pixels (smooth colour
/// gradients with noise, quality 90) in `dir/img/`; their pixels as a
/// worker preprocesses them (decoded with the worker's code) written to
/// `dir/verify.bin` with their ids in `dir/verify.ids`, and repeated to
/// `rows` images in host memory; and how many images one core decodes and
/// preprocesses per second.
fn write_images(dir: &Path, size: u32, distinct: usize, rows: usize) -> Result<(Vec<f32>, f64)> {
    let img_dir = dir.join("img");
    std::fs::create_dir_all(&img_dir)?;
    let mut rng = fastrand::Rng::with_seed(17);
    let mut encoded = Vec::with_capacity(distinct);
    for i in 0..distinct {
        let (a, b, c) = (rng.f32(), rng.f32(), rng.f32());
        let img = image::RgbImage::from_fn(size, size, |x, y| {
            let (u, v) = (x as f32 / size as f32, y as f32 / size as f32);
            let noise = rng.f32() * 0.2;
            let px = |t: f32| ((t.fract() * 0.8 + noise) * 255.0).clamp(0.0, 255.0) as u8;
            image::Rgb([px(a + u), px(b + v), px(c + u * v)])
        });
        let mut bytes = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90).encode_image(&img)?;
        std::fs::write(img_dir.join(image_id(i)), &bytes)?;
        encoded.push(bytes);
    }
    let spec = batchfleet_shared::message::ImageSpec {
        height: size,
        width: size,
        channels: 3,
        mean: vec![0.0; 3],
        std: vec![1.0; 3],
    };
    let row = 3 * (size * size) as usize;
    let preprocess = |bytes: &[u8], out: &mut [f32]| -> Result<()> {
        let img = image::load_from_memory(bytes)?;
        batchfleet_worker::reader::to_chw(&img, &spec, out);
        Ok(())
    };
    let mut pixels = vec![0f32; distinct * row];
    for (bytes, out) in encoded.iter().zip(pixels.chunks_mut(row)) {
        preprocess(bytes, out)?;
    }
    let mut raw = Vec::with_capacity(pixels.len() * 4);
    for v in &pixels {
        raw.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(dir.join("verify.bin"), raw)?;
    let ids: Vec<String> = (0..distinct).map(image_id).collect();
    std::fs::write(dir.join("verify.ids"), ids.join("\n") + "\n")?;
    // One core's rate, for a second.
    let mut scratch = vec![0f32; row];
    let started = Instant::now();
    let mut decoded = 0usize;
    while started.elapsed() < Duration::from_secs(1) {
        preprocess(&encoded[decoded % distinct], &mut scratch)?;
        decoded += 1;
    }
    let per_core = decoded as f64 / started.elapsed().as_secs_f64();
    let host: Vec<f32> = (0..rows)
        .flat_map(|i| {
            pixels[(i % distinct) * row..(i % distinct + 1) * row]
                .iter()
                .copied()
        })
        .collect();
    Ok((host, per_core))
}

/// The header and first `rows` rows of `from`.
fn write_head(from: &Path, to: &Path, rows: usize) -> Result<()> {
    let text = std::fs::read_to_string(from)?;
    let head: Vec<&str> = text.lines().take(rows + 1).collect();
    std::fs::write(to, head.join("\n") + "\n")?;
    Ok(())
}

/// The model (and tokenizer) and PyTorch's predictions on `verify`, by
/// the generator.
fn generate(script: &Path, dir: &Path, args: &[String], verify: &Path) -> Result<()> {
    let python = std::env::var("BATCHFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .arg(script)
        .arg("--out")
        .arg(dir)
        .args(args)
        .arg("--verify")
        .arg(verify)
        .output()
        .with_context(|| {
            format!("running {python} (a Python with torch; BATCHFLEET_PYTHON names another)")
        })?;
    if !out.status.success() {
        bail!(
            "{python} {} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn load(model: &Path, device: tch::Device, kind: tch::Kind) -> Result<tch::CModule> {
    let mut m = tch::CModule::load_on_device(model, device)
        .with_context(|| format!("loading {} on {device:?}", model.display()))?;
    m.set_eval();
    if kind != tch::Kind::Float {
        m.to(device, kind, false);
    }
    Ok(m)
}

fn sync(device: tch::Device) {
    if let tch::Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Passes over the rows until `seconds` have gone (one warm-up pass
/// first): rows/s.
fn timed(seconds: f64, rows_per_pass: usize, mut pass: impl FnMut() -> Result<()>) -> Result<f64> {
    pass()?;
    let started = Instant::now();
    let mut rows = 0usize;
    while started.elapsed().as_secs_f64() < seconds {
        pass()?;
        rows += rows_per_pass;
    }
    Ok(rows as f64 / started.elapsed().as_secs_f64())
}

/// The host-fed loop at each batch size (an equal share of `seconds`
/// each): every mini-batch copied to the device, through `forward`, and its
/// output copied back. The best batch and its rows/s.
fn best_host_fed(
    model: &Path,
    host: &Host,
    batches: &[usize],
    device: tch::Device,
    kind: tch::Kind,
    seconds: f64,
) -> Result<(usize, f64)> {
    let m = load(model, device, kind)?;
    let _guard = tch::no_grad_guard();
    let pass = |on_host: &[Vec<tch::Tensor>]| -> Result<()> {
        for b in on_host {
            let y = m
                .forward_ts(&to_device(b, device, kind)?)?
                .f_to_kind(tch::Kind::Float)?
                .f_to_device(tch::Device::Cpu)?
                .f_contiguous()?;
            let mut out = vec![0f32; y.numel()];
            y.f_copy_data(&mut out, y.numel())?;
        }
        Ok(())
    };
    // Each batch size tried briefly; the best measured for `seconds`.
    let probe = (seconds / batches.len() as f64).min(1.0);
    let mut best: Option<(usize, f64, Vec<Vec<tch::Tensor>>)> = None;
    for &batch in batches {
        let on_host = host.batches(batch)?;
        let rate = timed(probe, host.rows(), || pass(&on_host))?;
        println!("  host-fed, batch {batch}: {rate:.0} rows/s ({probe:.1} s)");
        if best.as_ref().is_none_or(|(_, r, _)| rate > *r) {
            best = Some((batch, rate, on_host));
        }
    }
    let (batch, _, on_host) = best.context("no batch size to try")?;
    let rate = timed(seconds, host.rows(), || pass(&on_host))?;
    println!("  host-fed, batch {batch}: {rate:.0} rows/s ({seconds} s)");
    Ok((batch, rate))
}

/// `forward` on the same mini-batches already on the device, for `seconds`.
fn resident(
    model: &Path,
    host: &Host,
    batch: usize,
    device: tch::Device,
    kind: tch::Kind,
    seconds: f64,
) -> Result<f64> {
    let m = load(model, device, kind)?;
    let _guard = tch::no_grad_guard();
    let on_device = host
        .batches(batch)?
        .iter()
        .map(|b| to_device(b, device, kind))
        .collect::<Result<Vec<_>>>()?;
    let rate = timed(seconds, host.rows(), || {
        for b in &on_device {
            let _ = m.forward_ts(b)?;
        }
        sync(device);
        Ok(())
    })?;
    println!("  resident, batch {batch}: {rate:.0} rows/s");
    Ok(rate)
}

fn manifest_text(case: &Case, dtype: &str, batch: usize, device: &str) -> String {
    let precision = match dtype {
        "float32" => String::new(),
        "float32+tf32" => "tf32 = true\n".to_owned(),
        other => format!("dtype = \"{other}\"\n"),
    };
    let (input, tokenizer) = match case.kind {
        CaseKind::Mlp { features } => (
            format!("format = \"csv\"\npaths = [\"data/*.csv\"]\nid_column = \"id\"\nfeature_columns = [\"f0..f{}\"]\n", features - 1),
            "",
        ),
        CaseKind::Text { .. } => (
            "format = \"csv\"\npaths = [\"data/*.csv\"]\nid_column = \"id\"\ntext_column = \"text\"\n".to_owned(),
            "tokenizer = \"tokenizer.json\"\n",
        ),
        CaseKind::Images { size, .. } => (
            format!("format = \"files\"\npaths = [\"data/*.jpg\"]\nroot = \"data\"\n\n[preprocess]\nsize = [{size}, {size}]\nchannels = 3\n"),
            "",
        ),
    };
    format!(
        "[job]\nname = \"gpu-check-{}\"\n\n[input]\n{input}\n[model]\npath = \"model.pt\"\n{tokenizer}device = \"{device}\"\n{precision}\n[batching]\nitem_rows = {}\ninference_batch_size = {batch}\n\n[output]\ndir = \"out\"\nformat = \"csv\"\n",
        dtype.replace('+', "-"),
        case.item_rows,
    )
}

/// The largest difference between the output's rows and PyTorch's on the
/// sample (each id looked up in the part files until all are found), and
/// the difference allowed: 1e-3 of the sample's largest output in float32,
/// 2e-2 with TF32 (10 bits of mantissa in every product), 0.1 in bfloat16
/// (8 bits through every layer).
fn check(out: &Path, golden: &Path, kind: tch::Kind, tf32: bool) -> Result<(f64, f64)> {
    let mut want: HashMap<String, Vec<f64>> = HashMap::new();
    let mut g = csv::Reader::from_path(golden)?;
    for rec in g.records() {
        let rec = rec?;
        let vals = rec
            .iter()
            .skip(1)
            .map(str::parse::<f64>)
            .collect::<Result<Vec<_>, _>>()?;
        want.insert(rec[0].to_owned(), vals);
    }
    let scale = want
        .values()
        .flatten()
        .fold(0f64, |m, v| m.max(v.abs()))
        .max(1e-6);
    let tolerance = scale
        * match (kind, tf32) {
            (tch::Kind::Float, false) => 1e-3,
            (tch::Kind::Float, true) => 2e-2,
            _ => 0.1,
        };
    let mut parts: Vec<PathBuf> = std::fs::read_dir(out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("part-") && n.ends_with(".csv"))
        })
        .collect();
    parts.sort();
    let mut worst = 0f64;
    for part in parts {
        if want.is_empty() {
            break;
        }
        let mut r = csv::Reader::from_path(&part)?;
        for rec in r.records() {
            let rec = rec?;
            let Some(expected) = want.remove(&rec[0]) else {
                continue;
            };
            for (got, e) in rec.iter().skip(1).zip(&expected) {
                let got: f64 = got
                    .parse()
                    .with_context(|| format!("{}: {got:?} is not a number", part.display()))?;
                worst = worst.max((got - e).abs());
            }
        }
    }
    if !want.is_empty() {
        bail!(
            "{} of the sample's rows are not in {}",
            want.len(),
            out.display()
        );
    }
    Ok((worst, tolerance))
}

/// `nvidia-smi`'s utilisation of GPU 0, sampled every 200 ms on a thread.
struct UtilSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl UtilSampler {
    fn start() -> Option<Self> {
        gpu_name()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                if let Ok(out) = Command::new("nvidia-smi")
                    .args([
                        "--query-gpu=utilization.gpu",
                        "--format=csv,noheader,nounits",
                        "-i",
                        "0",
                    ])
                    .output()
                {
                    if let Ok(v) = String::from_utf8_lossy(&out.stdout).trim().parse::<f64>() {
                        samples.push(v / 100.0);
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            samples
        });
        Some(Self { stop, thread })
    }

    /// The mean of the samples.
    fn stop(self) -> Option<f64> {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.thread.join().ok()?;
        (!samples.is_empty()).then(|| samples.iter().sum::<f64>() / samples.len() as f64)
    }
}
