//! Runs the Python side of the project: the generator script, with the
//! project venv's interpreter (the one whose PyTorch libtorch comes from).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (parent of this crate's folder).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("loadtest/testkit lives in the repository")
        .to_path_buf()
}

/// `BATCHFLEET_PYTHON`, else the project venv's python, else `python3`.
pub fn interpreter() -> PathBuf {
    if let Some(p) = std::env::var_os("BATCHFLEET_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = repo_root().join(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// Options of `make_job.py`.
#[derive(Debug, Clone)]
pub struct JobGen {
    /// Rows in all.
    pub rows: u64,
    /// Input files.
    pub files: u32,
    /// Features per row.
    pub features: u32,
    /// Hidden width of the MLP.
    pub hidden: u32,
    /// Model outputs per row.
    pub outputs: u32,
    /// Random seed.
    pub seed: u64,
    /// Job name in the manifest.
    pub name: String,
    /// Pool in the manifest.
    pub pool: String,
    /// `item_rows` in the manifest.
    pub item_rows: u64,
    /// `inference_batch_size` in the manifest.
    pub batch_size: u32,
    /// Global row numbers whose first feature is the poison sentinel (-999).
    pub poison_rows: Vec<u64>,
    /// Global row numbers whose first feature is the hang sentinel (-777).
    pub hang_rows: Vec<u64>,
    /// `checkpoint_every` in the manifest (unset: the default).
    pub checkpoint_every: Option<u32>,
    /// Input format: `csv`, `jsonl`, `parquet` or `pandas` (CSV written by
    /// `DataFrame.to_csv` with its defaults).
    pub format: String,
    /// Every this many feature values is missing, and the manifest sets
    /// `[input] missing = 0` (0: none missing).
    pub missing_every: u32,
}

impl Default for JobGen {
    fn default() -> Self {
        Self {
            rows: 50_000,
            files: 4,
            features: 16,
            hidden: 64,
            outputs: 1,
            seed: 7,
            name: "demo".into(),
            pool: "default".into(),
            item_rows: 5000,
            batch_size: 1024,
            poison_rows: Vec::new(),
            hang_rows: Vec::new(),
            checkpoint_every: None,
            format: "csv".into(),
            missing_every: 0,
        }
    }
}

/// Writes data, model, golden predictions and `job.toml` into `out`.
pub fn make_job(out: &Path, g: &JobGen) -> Result<()> {
    let script = repo_root().join("loadtest/python/make_job.py");
    let python = interpreter();
    let status = Command::new(&python)
        .arg(&script)
        .arg("--out")
        .arg(out)
        .args([
            "--rows",
            &g.rows.to_string(),
            "--files",
            &g.files.to_string(),
            "--features",
            &g.features.to_string(),
        ])
        .args([
            "--hidden",
            &g.hidden.to_string(),
            "--outputs",
            &g.outputs.to_string(),
            "--seed",
            &g.seed.to_string(),
        ])
        .args([
            "--name",
            &g.name,
            "--pool",
            &g.pool,
            "--item-rows",
            &g.item_rows.to_string(),
            "--batch-size",
            &g.batch_size.to_string(),
        ])
        .args([
            "--poison-rows",
            &join(&g.poison_rows),
            "--hang-rows",
            &join(&g.hang_rows),
        ])
        .args(
            g.checkpoint_every
                .map(|k| vec!["--checkpoint-every".to_owned(), k.to_string()])
                .unwrap_or_default(),
        )
        .args(["--format", &g.format])
        .args(["--missing-every", &g.missing_every.to_string()])
        .status()
        .with_context(|| {
            format!(
                "running {} {}; create the venv with `make venv`",
                python.display(),
                script.display()
            )
        })?;
    if !status.success() {
        bail!("{} failed with {status}", script.display());
    }
    Ok(())
}

fn join(rows: &[u64]) -> String {
    rows.iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Writes the faulty variants of `out/model.pt` (poison.pt, flaky.pt, hang.pt,
/// slow.pt, oom.pt, stuck.pt, hungry.pt) into `out`; see `loadtest/python/make_faulty_models.py`.
pub fn make_faulty_models(out: &Path, slow_ms: f64) -> Result<()> {
    run_model_script(
        "make_faulty_models.py",
        out,
        &["--slow-ms", &slow_ms.to_string()],
    )
}

/// Writes `model.pt` (TorchScript), `model.pt2` (the same MLP compiled by
/// AOTInductor for the CPU), `program.pt2` (the uncompiled `torch.export`
/// program), `input.csv` and `expected.csv` into `out`; see
/// `loadtest/python/make_aoti_model.py`. `size`: rows, features, hidden
/// width, outputs.
pub fn make_aoti_model(out: &Path, size: (u32, u32, u32, u32)) -> Result<()> {
    let script = repo_root().join("loadtest/python/make_aoti_model.py");
    let mut cmd = Command::new(interpreter());
    cmd.arg(&script)
        .arg(out)
        .args(["--rows", &size.0.to_string()])
        .args(["--features", &size.1.to_string()])
        .args(["--hidden", &size.2.to_string()])
        .args(["--outputs", &size.3.to_string()]);
    run_generator(&mut cmd, &script)
}

/// Writes `state_dict.pt`, `pickled.pt` and `exported.pt2` — the files most
/// often mistaken for TorchScript — from the weights of `out/model.pt` into
/// `out`; see `loadtest/python/make_wrong_models.py`.
pub fn make_wrong_models(out: &Path) -> Result<()> {
    run_model_script("make_wrong_models.py", out, &[])
}

/// Writes `candidate.pt` (the base model with its last layer moved by
/// seeded noise), `raising.pt` (raises on rows whose f0 is above 1.5),
/// `shadow_golden.csv` (the candidate's outputs as `<name>_shadow` columns)
/// and `shadow_expected.json` (the figures a shadow run must report,
/// computed in PyTorch) from `out/model.pt` and `out/data/*.csv`; see
/// `loadtest/python/make_shadow_models.py`.
pub fn make_shadow_models(out: &Path) -> Result<()> {
    run_model_script("make_shadow_models.py", out, &[])
}

/// Runs `loadtest/python/<script> --base out/model.pt --out-dir out <extra>`.
fn run_model_script(script: &str, out: &Path, extra: &[&str]) -> Result<()> {
    let script = repo_root().join("loadtest/python").join(script);
    let status = Command::new(interpreter())
        .arg(&script)
        .arg("--base")
        .arg(out.join("model.pt"))
        .arg("--out-dir")
        .arg(out)
        .args(extra)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("{} failed with {status}", script.display());
    }
    Ok(())
}

/// Options of `make_images.py`.
#[derive(Debug, Clone)]
pub struct ImageGen {
    /// Decodable images.
    pub images: u32,
    /// `[height, width]`.
    pub size: (u32, u32),
    /// Model outputs (classes).
    pub classes: u32,
    /// Job name in the manifest.
    pub name: String,
    /// Pool in the manifest.
    pub pool: String,
    /// `item_rows` (files per item) in the manifest.
    pub item_rows: u64,
    /// `inference_batch_size` in the manifest.
    pub batch_size: u32,
    /// Undecodable files under `images/broken/`.
    pub broken: u32,
}

impl Default for ImageGen {
    fn default() -> Self {
        Self {
            images: 200,
            size: (32, 32),
            classes: 4,
            name: "images".into(),
            pool: "default".into(),
            item_rows: 25,
            batch_size: 16,
            broken: 1,
        }
    }
}

/// Writes images, labels, model, golden predictions and `job.toml` into `out`.
pub fn make_image_job(out: &Path, g: &ImageGen) -> Result<()> {
    let script = repo_root().join("loadtest/python/make_images.py");
    let mut cmd = Command::new(interpreter());
    cmd.arg(&script)
        .arg("--out")
        .arg(out)
        .args(["--images", &g.images.to_string()])
        .args(["--size", &g.size.0.to_string(), &g.size.1.to_string()])
        .args(["--classes", &g.classes.to_string()])
        .args(["--name", &g.name, "--pool", &g.pool])
        .args(["--item-rows", &g.item_rows.to_string()])
        .args(["--batch-size", &g.batch_size.to_string()])
        .args(["--broken", &g.broken.to_string()]);
    run_generator(&mut cmd, &script)
}

/// Runs a generator script's command, naming the venv when Python is missing.
fn run_generator(cmd: &mut Command, script: &Path) -> Result<()> {
    let status = cmd.status().with_context(|| {
        format!(
            "running {}; create the venv with `make venv`",
            script.display()
        )
    })?;
    if !status.success() {
        bail!("{} failed with {status}", script.display());
    }
    Ok(())
}

/// Options of `make_text_job.py`: a corpus, a WordPiece `tokenizer.json`
/// trained on it, a small scripted TransformerEncoder and PyTorch's outputs.
#[derive(Debug, Clone)]
pub struct TextGen {
    /// Rows of the corpus.
    pub rows: u32,
    /// Embedding width (outputs per row).
    pub dim: u32,
    /// Encoder layers.
    pub layers: u32,
    /// Tokens per row at most.
    pub max_length: u32,
    /// Rows per mini-batch of the reference run.
    pub batch: u32,
    /// `csv`, `jsonl`, `parquet` or `all`.
    pub format: String,
    /// Skip PyTorch's outputs (for benchmarks).
    pub no_expected: bool,
    /// What the model returns: `pooled` (`[rows, D]`), `hidden` (`[rows,
    /// L, D]`), `dict` (`pooled`, `hidden`, `logits` by name) or `typed`
    /// (takes token type ids and the numeric columns too).
    pub output: String,
}

impl Default for TextGen {
    fn default() -> Self {
        Self {
            rows: 2_000,
            dim: 32,
            layers: 2,
            max_length: 128,
            batch: 32,
            format: "all".into(),
            no_expected: false,
            output: "pooled".into(),
        }
    }
}

/// Writes `corpus.<format>`, `tokenizer.json`, `encoder.pt`,
/// `expected_ids.jsonl` and `expected.csv` (with `expected_cls.csv` and
/// `expected_logits.csv` for the models that return them) into `out`; see
/// `loadtest/python/make_text_job.py`.
pub fn make_text_job(out: &Path, g: &TextGen) -> Result<()> {
    let script = repo_root().join("loadtest/python/make_text_job.py");
    let mut cmd = Command::new(interpreter());
    cmd.arg(&script)
        .arg(out)
        .args(["--rows", &g.rows.to_string()])
        .args(["--dim", &g.dim.to_string()])
        .args(["--layers", &g.layers.to_string()])
        .args(["--max-length", &g.max_length.to_string()])
        .args(["--batch", &g.batch.to_string()])
        .args(["--format", &g.format])
        .args(["--output", &g.output]);
    if g.no_expected {
        cmd.arg("--no-expected");
    }
    run_generator(&mut cmd, &script)
}

/// Replaces `dir/model.pt` by a model that predicts the same but holds
/// `mib` MiB of extra weights (`make_heavy_model.py`), filled with `fill`.
pub fn make_heavy_model(dir: &Path, mib: u32, fill: f32) -> Result<()> {
    let script = repo_root().join("loadtest/python/make_heavy_model.py");
    let (base, heavy) = (dir.join("model.pt"), dir.join("heavy.pt"));
    let status = Command::new(interpreter())
        .arg(&script)
        .arg("--base")
        .arg(&base)
        .arg("--out")
        .arg(&heavy)
        .args(["--mib", &mib.to_string(), "--fill", &fill.to_string()])
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("{} failed with {status}", script.display());
    }
    std::fs::rename(&heavy, &base).context("heavy model in place")?;
    Ok(())
}
