//! The text part of `batchfleet-loadtest bench`: a sentence encoder (a
//! scripted TransformerEncoder taking `input_ids, attention_mask`, pooled
//! to `[rows, dim]`) over a generated corpus tokenized by a WordPiece
//! `tokenizer.json`, measured side by side in one run:
//! - **Python loop**: what a user would write (`loadtest/python/text_loop.py`):
//!   `tokenizers` batch encode padded to each batch's longest, `torch.no_grad()`
//!   forward, rows written to CSV, mini-batches in input order;
//! - **compute ceiling**: the model's forward alone on the corpus
//!   pre-tokenized, sorted by length and pre-padded per mini-batch (and the
//!   same unsorted, padded to `max_length`, and with TorchScript's graph
//!   optimization off: what dynamic padding and the optimizer each give);
//! - **fleet**: `batchfleet run` on W worker processes through RabbitMQ and
//!   Redis, submit to `_SUCCESS`; its outputs checked against the Python
//!   loop's, row by row.

use crate::fleet::{run_job, run_job_with, Fleet};
use anyhow::{bail, Context, Result};
use batchfleet_testkit::python::{interpreter, make_text_job, repo_root, TextGen};
use batchfleet_testkit::services;
use serde::Serialize;
use std::path::Path;
use std::process::Command;

/// Rows per work item of the text job.
const ITEM_ROWS: u64 = 2_000;
/// Rows per `forward`, for the fleet and the Python loop alike.
const BATCH: u32 = 64;
/// Tokens per row at most.
const MAX_LENGTH: u32 = 128;

/// The text regime's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TextRegime {
    /// Rows of the corpus.
    pub rows: u64,
    /// The model.
    pub model: String,
    /// Rows per `forward`.
    pub batch: u32,
    /// The user's Python loop (rows/s).
    pub python_loop_rows_per_s: f64,
    /// Forward alone, length-sorted, pre-padded per mini-batch, warm: the
    /// median of passes after the first (rows/s).
    pub compute_rows_per_s: f64,
    /// The same, the first pass: every length met for the first time, as a
    /// fresh worker meets them (rows/s).
    pub compute_first_pass_rows_per_s: f64,
    /// Forward alone, input order, padded per mini-batch (rows/s).
    pub unsorted_rows_per_s: f64,
    /// Forward alone, input order, padded to `max_length` (rows/s).
    pub max_length_rows_per_s: f64,
    /// The compute ceiling with graph optimization off (rows/s).
    pub no_optimize_rows_per_s: f64,
    /// Real tokens, and tokens once padded: sorted, unsorted, to `max_length`.
    pub tokens: [u64; 4],
    /// The fleet, submit to `_SUCCESS` (rows/s).
    pub fleet_rows_per_s: f64,
    /// Its wall time (s).
    pub fleet_wall_s: f64,
    /// Fleet ÷ Python loop.
    pub fleet_to_python: f64,
    /// Fleet ÷ compute ceiling.
    pub fleet_to_compute: f64,
    /// Seconds tokenizing, summed over workers.
    pub tokenize_s: f64,
    /// Seconds in `forward`, summed over workers.
    pub inference_s: f64,
    /// The same job with `[model] dtype`, on the same fleet: precision,
    /// rows/s, and its outputs against the float32 run's.
    pub reduced: Vec<Reduced>,
    /// Peak resident memory of the fixed-batch fleet's workers (MiB, the largest).
    pub worker_peak_rss_mib: f64,
    /// The same job with `[batching] max_batch_tokens`, each on a fleet of
    /// its own: rows/s and peak memory against the fixed batches.
    pub budgets: Vec<Budgeted>,
}

/// One token-budget run of the text job.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Budgeted {
    /// `max_batch_tokens` (0: none).
    pub max_batch_tokens: u32,
    /// `inference_batch_size` beside it (rows per call at most; 0: `"auto"`).
    pub batch: u32,
    /// Rows/s, submit to `_SUCCESS` (0 when the run failed).
    pub rows_per_s: f64,
    /// Its rate ÷ the fixed-batch run's.
    pub to_fixed: f64,
    /// Peak resident memory of its workers (MiB, the largest).
    pub worker_peak_rss_mib: f64,
    /// Largest absolute difference from the fixed-batch embeddings.
    pub max_abs_diff: f64,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

/// Token budgets tried, with the rows per call they allow at most.
/// `(max_batch_tokens, inference_batch_size)` of the batching variants: a
/// token budget of 0 is none, a batch of 0 is `"auto"`.
const BUDGETS: [(u32, u32); 3] = [(2_048, 1_024), (4_096, 1_024), (0, 0)];

/// One reduced-precision run of the text job.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Reduced {
    /// `bfloat16` or `float16`.
    pub dtype: String,
    /// Rows/s, submit to `_SUCCESS` (0 when the run failed).
    pub rows_per_s: f64,
    /// Its rate ÷ the float32 run's.
    pub to_float32: f64,
    /// Largest absolute difference from the float32 embeddings.
    pub max_abs_diff: f64,
    /// Least cosine similarity with the float32 embedding, over rows.
    pub min_cosine: f64,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

/// Runs the text regime on `rows` rows under `root`.
pub fn run(
    root: &Path,
    rows: u64,
    workers: usize,
    bins: (&Path, &Path),
    prefix: &str,
) -> Result<TextRegime> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = root.join("text");
    println!("bench [text] encoder over {rows} texts: generating…");
    make_text_job(
        &dir,
        &TextGen {
            rows: rows as u32,
            dim: 64,
            layers: 2,
            max_length: MAX_LENGTH,
            batch: BATCH,
            format: "csv".into(),
            no_expected: true,
            ..TextGen::default()
        },
    )?;
    println!("bench [text] Python loop and compute ceilings…");
    let script = repo_root().join("loadtest/python/text_loop.py");
    let figures = dir.join("python.json");
    let status = Command::new(interpreter())
        .arg(&script)
        .arg(&dir)
        .args(["--batch", &BATCH.to_string()])
        .args(["--threads", &cores.to_string()])
        .args(["--max-length", &MAX_LENGTH.to_string()])
        .arg("--json")
        .arg(&figures)
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("{} failed with {status}", script.display());
    }
    let py: serde_json::Value = serde_json::from_slice(&std::fs::read(&figures)?)?;
    let f = |k: &str| py[k].as_f64().unwrap_or(0.0);
    let pool = services::unique("bench-text");
    let manifest = dir.join("job.toml");
    std::fs::write(
        &manifest,
        format!(
            "[job]\nname = \"bench-text\"\npool = \"{pool}\"\n\n[input]\nformat = \"csv\"\npaths = [\"corpus.csv\"]\nid_column = \"id\"\ntext_column = \"text\"\n\n[model]\npath = \"encoder.pt\"\ntokenizer = \"tokenizer.json\"\nmax_length = {MAX_LENGTH}\n\n[batching]\nitem_rows = {ITEM_ROWS}\ninference_batch_size = {BATCH}\n\n[output]\ndir = \"out\"\nformat = \"csv\"\n"
        ),
    )?;
    println!("bench [text] fleet of {workers} workers…");
    let threads = (cores / workers).max(1);
    let mut fleet = Fleet::start(bins.0, &dir, &pool, prefix, workers, threads)?;
    let (wall, _, _) = run_job(bins.1, &manifest, prefix)?;
    let tokenize_s = fleet.metric_sum("batchfleet_worker_tokenize_seconds_sum");
    let inference_s = fleet.metric_sum("batchfleet_worker_inference_seconds_sum");
    let worker_peak_rss_mib = fleet.rss("VmHWM").into_iter().fold(0.0, f64::max);
    // The same job in reduced precision on the same fleet.
    let job = std::fs::read_to_string(&manifest)?;
    let mut reduced = Vec::new();
    for dtype in ["bfloat16", "float16"] {
        println!("bench [text] fleet in {dtype}…");
        let edited = job.replace(
            "tokenizer = \"tokenizer.json\"",
            &format!("tokenizer = \"tokenizer.json\"\ndtype = \"{dtype}\""),
        );
        let mut r = Reduced {
            dtype: dtype.into(),
            ..Reduced::default()
        };
        match run_variant(bins.1, &dir, &edited, dtype, prefix) {
            Ok((w, (diff, cosine))) => {
                r.rows_per_s = rows as f64 / w.max(1e-9);
                r.to_float32 = wall / w.max(1e-9);
                (r.max_abs_diff, r.min_cosine) = (diff, cosine);
            }
            Err(e) => r.error = Some(format!("{e:#}")),
        }
        reduced.push(r);
    }
    fleet.stop();
    // Token budgets, each on a fresh fleet (its peak memory its own).
    let mut budgets = Vec::new();
    for (tokens, batch) in BUDGETS {
        let setting = batching(tokens, batch);
        println!(
            "bench [text] fleet with {}…",
            setting.trim().replace('\n', ", ")
        );
        let edited = job.replace(&format!("inference_batch_size = {BATCH}\n"), &setting);
        let mut b = Budgeted {
            max_batch_tokens: tokens,
            batch,
            ..Budgeted::default()
        };
        let mut own = Fleet::start(bins.0, &dir, &pool, prefix, workers, threads)?;
        let name = if batch == 0 {
            "auto".to_owned()
        } else {
            format!("tokens-{tokens}")
        };
        match run_variant(bins.1, &dir, &edited, &name, prefix) {
            Ok((w, (diff, _))) => {
                b.rows_per_s = rows as f64 / w.max(1e-9);
                b.to_fixed = wall / w.max(1e-9);
                b.max_abs_diff = diff;
                b.worker_peak_rss_mib = own.rss("VmHWM").into_iter().fold(0.0, f64::max);
            }
            Err(e) => b.error = Some(format!("{e:#}")),
        }
        own.stop();
        budgets.push(b);
    }
    services::delete_pool_queues(&pool);
    // The fleet's embeddings are the Python loop's (its CSV as the golden file).
    let golden = dir.join("python-golden.csv");
    let loop_out = std::fs::read_to_string(dir.join("python-loop.csv"))?;
    let dim = loop_out
        .lines()
        .next()
        .map_or(0, |l| l.split(',').count().saturating_sub(1));
    let header: Vec<String> = std::iter::once("id".to_owned())
        .chain((0..dim).map(|j| format!("score_{j}")))
        .collect();
    std::fs::write(&golden, format!("{}\n{loop_out}", header.join(",")))?;
    let v = batchfleet_testkit::verify::verify(&dir.join("out"), &golden, 1e-4)?;
    if !v.ok() {
        bail!(
            "[text] the fleet's output does not match the Python loop's: {}",
            v.describe()
        );
    }
    let fleet_rate = rows as f64 / wall.max(1e-9);
    let compute = f("ceiling_rows_per_s");
    let python = f("python_loop_rows_per_s");
    let tok = |k: &str| py[k].as_u64().unwrap_or(0);
    Ok(TextRegime {
        rows,
        model: "TransformerEncoder 2 × 64 (4 heads), mean-pooled".into(),
        batch: BATCH,
        python_loop_rows_per_s: python,
        compute_rows_per_s: compute,
        compute_first_pass_rows_per_s: f("ceiling_first_pass_rows_per_s"),
        unsorted_rows_per_s: f("unsorted_rows_per_s"),
        max_length_rows_per_s: f("max_length_rows_per_s"),
        no_optimize_rows_per_s: f("ceiling_no_optimize_rows_per_s"),
        tokens: [
            tok("tokens_real"),
            tok("tokens_padded_sorted"),
            tok("tokens_padded_unsorted"),
            tok("tokens_padded_max_length"),
        ],
        fleet_rows_per_s: fleet_rate,
        fleet_wall_s: wall,
        fleet_to_python: fleet_rate / python.max(1e-9),
        fleet_to_compute: fleet_rate / compute.max(1e-9),
        tokenize_s,
        inference_s,
        reduced,
        worker_peak_rss_mib,
        budgets,
    })
}

/// Runs the text job's manifest `edited` (another setting) as a job of its
/// own named `name` (`job-<name>.toml`, output `out-<name>`) on the fleet
/// running: its wall time, and its embeddings' largest difference from the
/// first run's and least cosine similarity with them.
fn run_variant(
    coordinator: &Path,
    dir: &Path,
    edited: &str,
    name: &str,
    prefix: &str,
) -> Result<(f64, (f64, f64))> {
    let path = dir.join(format!("job-{name}.toml"));
    let out = format!("out-{name}");
    std::fs::write(
        &path,
        edited
            .replace(
                "name = \"bench-text\"",
                &format!("name = \"bench-text-{name}\""),
            )
            .replace("dir = \"out\"", &format!("dir = \"{out}\"")),
    )?;
    let (wall, _, _) = run_job_with(coordinator, &path, prefix, &[], &out)?;
    Ok((
        wall,
        batchfleet_testkit::verify::agreement(&dir.join("out"), &dir.join(&out))?,
    ))
}

/// The `[batching]` lines of a variant (see [`BUDGETS`]).
fn batching(tokens: u32, batch: u32) -> String {
    let mut lines = if batch == 0 {
        "inference_batch_size = \"auto\"\n".to_owned()
    } else {
        format!("inference_batch_size = {batch}\n")
    };
    if tokens > 0 {
        lines.push_str(&format!("max_batch_tokens = {tokens}\n"));
    }
    lines
}

/// Prints the figures.
pub fn print(t: &TextRegime) {
    println!(
        "  text: {} rows, {}, batch {}: fleet {:.0} rows/s ({:.2} s); Python loop {:.0} (fleet ÷ {:.2}); compute ceiling {:.0} (fleet ÷ {:.2})",
        t.rows, t.model, t.batch, t.fleet_rows_per_s, t.fleet_wall_s, t.python_loop_rows_per_s,
        t.fleet_to_python, t.compute_rows_per_s, t.fleet_to_compute
    );
    println!(
        "          forward alone: sorted + padded per batch {:.0} rows/s (first pass {:.0}), input order padded per batch {:.0}, padded to max_length {:.0}, graph optimization off {:.0}; tokens real {} / padded sorted {} / unsorted {} / max_length {}; workers' tokenize {:.2} s, inference {:.2} s",
        t.compute_rows_per_s, t.compute_first_pass_rows_per_s, t.unsorted_rows_per_s, t.max_length_rows_per_s, t.no_optimize_rows_per_s,
        t.tokens[0], t.tokens[1], t.tokens[2], t.tokens[3], t.tokenize_s, t.inference_s
    );
    for b in &t.budgets {
        match &b.error {
            Some(e) => println!(
                "          {}: failed: {e}",
                batching(b.max_batch_tokens, b.batch).trim().replace('\n', ", ")
            ),
            None => println!(
                "          {}: fleet {:.0} rows/s ({:.2}× batches of {}), worker peak RSS {:.0} MiB (fixed {:.0}); max |diff| {:.2e}",
                batching(b.max_batch_tokens, b.batch).trim().replace('\n', ", "),
                b.rows_per_s, b.to_fixed, t.batch, b.worker_peak_rss_mib, t.worker_peak_rss_mib, b.max_abs_diff
            ),
        }
    }
    for r in &t.reduced {
        match &r.error {
            Some(e) => println!("          dtype = {}: failed: {e}", r.dtype),
            None => println!(
                "          dtype = {}: fleet {:.0} rows/s ({:.2}× float32); against float32: max |diff| {:.2e}, least cosine {:.6}",
                r.dtype, r.rows_per_s, r.to_float32, r.max_abs_diff, r.min_cosine
            ),
        }
    }
}
