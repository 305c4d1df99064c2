//! `batchfleet-loadtest bench`: the fleet against the machine's ceilings,
//! side by side in one run.
//!
//! For two model regimes — a small MLP (I/O-bound) and a large one
//! (compute-bound) — on the same generated rows:
//! - **compute ceiling**: libtorch `forward` in-process over rows already in
//!   memory, all cores, best batch size;
//! - **I/O ceiling**: the worker's own reader and writer (read + parse +
//!   write part files) with no model, all cores;
//! - **fleet**: `batchfleet run` against W worker processes already running,
//!   through the real RabbitMQ and Redis, from submit to `_SUCCESS`; with
//!   per-stage times scraped from the workers' metrics and peak RSS;
//! - **local**: `batchfleet run --local` on the same data — W pipelines of
//!   cores/W threads in one process, no RabbitMQ or Redis — and the same with
//!   one pipeline of all cores (one shared model runner), submit to `_SUCCESS`.
//!
//! A **sentence encoder** over a text corpus (`crate::textbench`): the fleet
//! against a Python loop and the model's compute ceiling.
//!
//! The **job start** (`crate::startbench`): one-item jobs one after another
//! on an idle fleet, publication to the item's start, and their wall time
//! next to `run --local`'s.
//!
//! And the **control plane**: tens of thousands of one-row items with a tiny
//! model (items/s through publish → consume → done → ack), next to raw
//! RabbitMQ confirmed-publish and consume+ack rates measured in the same
//! run, with worker RSS after 1k and 10k items and the CPU per item each
//! process used (workers, coordinator, RabbitMQ, Redis): on a machine whose
//! cores the services share, that CPU is what bounds items/s.

use crate::fault::sibling;
use crate::fleet::{manifest_into, run_job, run_job_with, CpuPerItem, CpuSample, Fleet};
use crate::forward;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Settings of a bench run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Rows of the small-model job.
    pub small_rows: u64,
    /// Rows of the large-model job.
    pub large_rows: u64,
    /// Items of the control-plane job.
    pub control_items: u64,
    /// Texts of the sentence-encoder job (0: skipped).
    pub text_rows: u64,
    /// Rows of the model-format comparison (0: skipped).
    pub pt2_rows: u64,
    /// Worker processes.
    pub workers: usize,
    /// Work folder (kept) or a temporary one.
    pub dir: Option<PathBuf>,
    /// Write the figures here as JSON.
    pub json: Option<PathBuf>,
    /// Input formats of the small-model job beyond CSV (`jsonl`, `parquet`, `pandas`),
    /// run on the same rows for rows/s per format side by side.
    pub formats: Vec<String>,
    /// Planning time by file count and size (`None`: not measured).
    pub planning: Option<crate::planning::PlanningConfig>,
    /// One-item jobs timed from publication to start (0: skipped).
    pub start_jobs: usize,
}

/// One model regime's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Regime {
    /// `small` or `large` (and `small-jsonl`, …: the small model on another input format).
    pub name: String,
    /// Input format.
    pub format: String,
    /// Model shape.
    pub model: String,
    /// Rows.
    pub rows: u64,
    /// Compute ceiling (rows/s) and the batch size that reached it.
    pub compute_rows_per_s: f64,
    /// Best batch size.
    pub compute_batch: usize,
    /// I/O ceiling (rows/s).
    pub io_rows_per_s: f64,
    /// 1 / (1/compute + 1/io).
    pub serial_sum_rows_per_s: f64,
    /// The fleet, submit to `_SUCCESS` (rows/s).
    pub fleet_rows_per_s: f64,
    /// The fleet's wall time (s).
    pub fleet_wall_s: f64,
    /// Of which planning alone (s): the coordinator's planner on this job, timed on its own.
    pub plan_s: f64,
    /// Fleet / serial-sum ceiling.
    pub ratio_to_serial_sum: f64,
    /// Fleet / compute ceiling.
    pub ratio_to_compute: f64,
    /// `run --local` with W pipelines of cores/W threads, submit to `_SUCCESS` (rows/s).
    pub local_rows_per_s: f64,
    /// Its wall time (s).
    pub local_wall_s: f64,
    /// Its peak RSS (MiB): coordinator and pipelines, one process.
    pub local_peak_rss_mib: f64,
    /// `run --local` with one pipeline of all cores (one shared runner) (rows/s).
    pub local_one_pipeline_rows_per_s: f64,
    /// Local / fleet.
    pub local_to_fleet: f64,
    /// Local / serial-sum ceiling.
    pub local_to_serial_sum: f64,
    /// Seconds summed over workers per stage: queue wait, read, inference, write.
    pub stage_s: StageTimes,
    /// Peak RSS of each worker (MiB).
    pub worker_peak_rss_mib: Vec<f64>,
    /// Peak RSS of the coordinator (MiB).
    pub coordinator_peak_rss_mib: f64,
}

/// Stage times summed over all workers (from their metrics).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageTimes {
    /// Time items waited in the queue.
    pub queue_wait: f64,
    /// Reading and parsing.
    pub read: f64,
    /// `forward` calls.
    pub inference: f64,
    /// Writing and publishing files.
    pub write: f64,
}

/// Control-plane figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ControlPlane {
    /// Items.
    pub items: u64,
    /// Items per second through the fleet.
    pub items_per_s: f64,
    /// Raw confirmed publishes per second (quorum queue, same broker).
    pub raw_publish_per_s: f64,
    /// Raw consume + ack per second (quorum queue, same broker).
    pub raw_consume_ack_per_s: f64,
    /// Fleet items/s over raw consume+ack/s.
    pub ratio_to_raw_consume: f64,
    /// Each worker's RSS (MiB) after 1,000 items.
    pub rss_after_1k_mib: Vec<f64>,
    /// Each worker's RSS (MiB) after 10,000 items.
    pub rss_after_10k_mib: Vec<f64>,
    /// Each worker's RSS (MiB) once the job ended (after all its items).
    pub rss_at_end_mib: Vec<f64>,
    /// CPU per item by process, while the job ran.
    pub cpu: CpuPerItem,
    /// Body bytes of one of the job's work messages as published (version
    /// 3: the item and its task's digest).
    pub message_body_bytes: usize,
    /// The same item with its whole task in the message (version 2, what
    /// was published before tasks were stored once per job).
    pub whole_message_body_bytes: usize,
    /// Body bytes per item of the job's first message as published: a
    /// bundle of several items (version 4) where the job's items are
    /// short and many, else one item (as `message_body_bytes`).
    pub bundled_body_bytes_per_item: f64,
    /// Items in that message.
    pub bundle_items: usize,
    /// Items per Redis commit call, on average (group commit).
    pub commit_group_mean: f64,
}

/// `batchfleet run --local` with `workers` pipelines of `threads` threads on
/// the job of `dir`, into `out`, with no service reachable; (wall s, peak RSS MiB).
fn run_local(
    coordinator: &Path,
    dir: &Path,
    workers: usize,
    threads: usize,
    out: &str,
) -> Result<(f64, f64)> {
    let manifest = manifest_into(dir, out)?;
    let args = [
        "--local".to_owned(),
        "--workers".into(),
        workers.to_string(),
        "--threads".into(),
        threads.to_string(),
    ];
    let (wall, rss, _) = run_job_with(coordinator, &manifest, "bf-unused", &args, out)?;
    let v = batchfleet_testkit::verify::verify(&dir.join(out), &dir.join("golden.csv"), 1e-4)?;
    if !v.ok() {
        bail!(
            "local run into {out} does not match PyTorch: {}",
            v.describe()
        );
    }
    Ok((wall, rss))
}

/// Everything a bench run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BenchReport {
    /// Cores on this machine.
    pub cores: usize,
    /// Worker processes.
    pub workers: usize,
    /// The two regimes.
    pub regimes: Vec<Regime>,
    /// The control plane.
    pub control: Option<ControlPlane>,
    /// Planning times, cut blind and by reading.
    pub planning: Vec<crate::planning::PlanTime>,
    /// The sentence encoder.
    pub text: Option<crate::textbench::TextRegime>,
    /// TorchScript against an AOTInductor package.
    pub formats: Option<crate::formatbench::FormatRegime>,
    /// How long a new job waits before its first item starts.
    pub starts: Option<crate::startbench::JobStarts>,
}

/// The I/O ceiling: every item of the job read, parsed and written with the
/// worker's own code, no model, on `threads` threads; and the seconds the
/// planner takes on the job.
fn io_ceiling(manifest: &Path, threads: usize) -> Result<(f64, f64)> {
    let spec = batchfleet_coordinator::manifest::load(manifest, &[])?;
    let planning = Instant::now();
    let plan = batchfleet_coordinator::planner::plan(&spec)?;
    let plan_s = planning.elapsed().as_secs_f64();
    let out = manifest
        .parent()
        .unwrap_or(Path::new("."))
        .join("io-ceiling");
    std::fs::create_dir_all(&out)?;
    let items = std::sync::Mutex::new(plan.items.iter());
    let started = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let mut handles = Vec::new();
        for _ in 0..threads.max(1) {
            handles.push(s.spawn(|| -> Result<()> {
                loop {
                    let Some(item) = items
                        .lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .next()
                    else {
                        return Ok(());
                    };
                    let batch = batchfleet_worker::reader::read(
                        &item.input,
                        &item.task.layout,
                        item.task.text.as_ref(),
                        item.task.failure.on_bad_row,
                    )
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                    let preds = batchfleet_worker::runner::Predictions {
                        values: vec![0.0; batch.rows()],
                        width: 1,
                        failed: Vec::new(),
                        integer: false,
                        parts: Vec::new(),
                        shadow: None,
                        oom_fit: None,
                    };
                    batchfleet_worker::writer::write_part(
                        &out,
                        std::path::Path::new(&item.task.output.part_name(item.seq)),
                        &item.task.output,
                        &batch,
                        &preds,
                    )
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                }
            }));
        }
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("I/O thread panicked"))??;
        }
        Ok(())
    })?;
    let secs = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&out);
    Ok((plan.rows_total as f64 / secs, plan_s))
}

/// The model and data of a regime: hidden width, rows, input format, and
/// the compute ceiling already measured on the same rows (another format).
struct RegimeSpec<'a> {
    name: &'a str,
    rows: u64,
    hidden: u32,
    format: &'a str,
    compute: Option<(f64, usize)>,
}

fn regime(
    cfg: &BenchConfig,
    root: &Path,
    spec: &RegimeSpec,
    bins: (&Path, &Path),
    prefix: &str,
) -> Result<Regime> {
    let RegimeSpec {
        name,
        rows,
        hidden,
        format,
        compute,
    } = *spec;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = root.join(name);
    let pool = services::unique(&format!("bench-{name}"));
    let item_rows = if hidden > 256 { 2_000 } else { 20_000 };
    let batch = if hidden > 256 { 256 } else { 4096 };
    make_job(
        &dir,
        &JobGen {
            rows,
            files: 4,
            features: 32,
            hidden,
            outputs: 1,
            name: format!("bench-{name}"),
            pool: pool.clone(),
            item_rows,
            batch_size: batch,
            format: format.into(),
            ..JobGen::default()
        },
    )?;
    let manifest = dir.join("job.toml");
    let (best_rate, best_batch) = match compute {
        // The same seed gives the same model and rows in every format.
        Some(measured) => measured,
        None => {
            println!("bench [{name}] 32→{hidden}→{hidden}→1, {rows} rows: compute ceiling…");
            let features = forward::load_csv(&forward::expand(&[format!(
                "{}/data/*.csv",
                dir.display()
            )])?)?;
            let sizes: Vec<usize> = if hidden > 256 {
                vec![64, 256, 1024]
            } else {
                vec![1024, 4096, 16384]
            };
            let best = forward::measure(
                &dir.join("model.pt"),
                &features,
                &sizes,
                cores,
                3,
                tch::Device::Cpu,
            )?
            .into_iter()
            .max_by(|a, b| a.median_rows_per_s.total_cmp(&b.median_rows_per_s))
            .context("no batch size measured")?;
            (best.median_rows_per_s, best.batch_size)
        }
    };
    // The fleet runs the batch size the ceiling found best, as the sizing guide says to.
    let text = std::fs::read_to_string(&manifest)?;
    let configured = format!("inference_batch_size = {batch}\n");
    if !text.contains(&configured) {
        bail!("{} does not set {}", manifest.display(), configured.trim());
    }
    std::fs::write(
        &manifest,
        text.replace(
            &configured,
            &format!("inference_batch_size = {best_batch}\n"),
        ),
    )?;
    println!("bench [{name}] I/O ceiling…");
    let (io, plan_s) = io_ceiling(&manifest, cores)?;
    println!("bench [{name}] fleet of {} workers…", cfg.workers);
    let threads = (cores / cfg.workers).max(1);
    let mut fleet = Fleet::start(bins.0, &dir, &pool, prefix, cfg.workers, threads)?;
    let (wall, coord_rss, _) = run_job(bins.1, &manifest, prefix)?;
    let stage = |m: &str| fleet.metric_sum(&format!("{m}_sum"));
    let stage_s = StageTimes {
        queue_wait: stage("batchfleet_worker_queue_wait_seconds"),
        read: stage("batchfleet_worker_read_seconds"),
        inference: stage("batchfleet_worker_inference_seconds"),
        write: stage("batchfleet_worker_write_seconds"),
    };
    let worker_rss = fleet.rss("VmHWM");
    fleet.stop();
    services::delete_pool_queues(&pool);
    let v = batchfleet_testkit::verify::verify(&dir.join("out"), &dir.join("golden.csv"), 1e-4)?;
    if !v.ok() {
        bail!("[{name}] output does not match PyTorch: {}", v.describe());
    }
    println!(
        "bench [{name}] run --local, {} pipelines × {threads} thread(s), then 1 × {cores}…",
        cfg.workers
    );
    let (local_wall, local_rss) = run_local(bins.1, &dir, cfg.workers, threads, "out-local")?;
    let (one_wall, _) = run_local(bins.1, &dir, 1, cores, "out-local-1")?;
    let serial = 1.0 / (1.0 / best_rate + 1.0 / io);
    let fleet_rate = rows as f64 / wall.max(1e-9);
    let local_rate = rows as f64 / local_wall.max(1e-9);
    Ok(Regime {
        name: name.into(),
        format: format.into(),
        model: format!("MLP 32→{hidden}→{hidden}→1"),
        rows,
        compute_rows_per_s: best_rate,
        compute_batch: best_batch,
        io_rows_per_s: io,
        serial_sum_rows_per_s: serial,
        fleet_rows_per_s: fleet_rate,
        fleet_wall_s: wall,
        plan_s,
        ratio_to_serial_sum: fleet_rate / serial,
        ratio_to_compute: fleet_rate / best_rate,
        local_rows_per_s: local_rate,
        local_wall_s: local_wall,
        local_peak_rss_mib: local_rss,
        local_one_pipeline_rows_per_s: rows as f64 / one_wall.max(1e-9),
        local_to_fleet: local_rate / fleet_rate,
        local_to_serial_sum: local_rate / serial,
        stage_s,
        worker_peak_rss_mib: worker_rss,
        coordinator_peak_rss_mib: coord_rss,
    })
}

/// Raw RabbitMQ: confirmed publishes/s and consume+ack/s of `n` small
/// messages on a quorum queue of the same broker.
fn raw_broker(n: u64) -> Result<(f64, f64)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let conn = batchfleet_shared::broker::connect(
            &services::amqp(),
            "batchfleet-bench-raw",
            Duration::from_secs(30),
        )
        .await?;
        let pool = services::unique("bench-raw");
        let queues = batchfleet_shared::broker::PoolQueues::new(&pool);
        conn.declare(&queues).await?;
        let body = vec![0u8; 200]; // about a work item's size
        let msgs = (0..n).map(|i| batchfleet_shared::broker::Outgoing {
            message_id: format!("raw/{i}"),
            kind: "raw",
            body: body.clone(),
            headers: Default::default(),
            expiration_ms: None,
        });
        let started = Instant::now();
        conn.publish(&queues.work(), msgs.collect(), 512).await?;
        let publish = n as f64 / started.elapsed().as_secs_f64();
        let mut consumer = conn.consume(&queues.work(), 100).await?;
        let started = Instant::now();
        let mut got = 0;
        while got < n {
            let Some(d) = consumer.next().await else {
                break;
            };
            d?.ack().await?;
            got += 1;
        }
        let consume = got as f64 / started.elapsed().as_secs_f64();
        consumer.cancel().await;
        for q in queues.all() {
            let _ = conn.delete(&q).await;
        }
        conn.close("bye").await;
        Ok::<_, anyhow::Error>((publish, consume))
    })
}

fn control_plane(
    cfg: &BenchConfig,
    root: &Path,
    bins: (&Path, &Path),
    prefix: &str,
) -> Result<ControlPlane> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = root.join("control");
    let pool = services::unique("bench-control");
    let items = cfg.control_items;
    make_job(
        &dir,
        &JobGen {
            rows: items,
            files: 1,
            features: 1,
            hidden: 1,
            outputs: 1,
            name: "bench-control".into(),
            pool: pool.clone(),
            item_rows: 1,
            batch_size: 1,
            ..JobGen::default()
        },
    )?;
    let (message_body_bytes, whole_message_body_bytes, bundle_items, bundled_body_bytes) =
        message_sizes(&dir.join("job.toml"))?;
    println!("bench [control] raw RabbitMQ, {items} messages…");
    let (raw_publish, raw_consume) = raw_broker(items)?;
    println!("bench [control] {items} one-row items through the fleet…");
    let threads = (cores / cfg.workers).max(1);
    let mut fleet = Fleet::start(bins.0, &dir, &pool, prefix, cfg.workers, threads)?;
    let done = std::sync::atomic::AtomicBool::new(false);
    let cpu_before = CpuSample::take(&fleet.pids());
    let (wall, summary, rss_1k, rss_10k, rss_end, cpu_after) =
        std::thread::scope(|s| -> Result<_> {
            let fleet = &fleet;
            let done_ref = &done;
            let watcher = s.spawn(move || {
                // Sample the workers' RSS as the committed-item count passes 1k and 10k.
                let (mut at_1k, mut at_10k) = (Vec::new(), Vec::new());
                while !done_ref.load(std::sync::atomic::Ordering::Relaxed) {
                    let n = fleet.metric_sum("batchfleet_worker_items_completed_total");
                    if at_1k.is_empty() && n >= 1_000.0 {
                        at_1k = fleet.rss("VmRSS");
                    }
                    if at_10k.is_empty() && n >= 10_000.0 {
                        at_10k = fleet.rss("VmRSS");
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                (at_1k, at_10k)
            });
            let r = run_job(bins.1, &dir.join("job.toml"), prefix);
            let cpu_after = CpuSample::take(&fleet.pids());
            let at_end = fleet.rss("VmRSS");
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            let (a, b) = watcher
                .join()
                .map_err(|_| anyhow::anyhow!("watcher panicked"))?;
            let (wall, _, summary) = r?;
            Ok((wall, summary, a, b, at_end, cpu_after))
        })?;
    // Group commit: items per commit call, over the job (0 with a build
    // that commits one item per call and has no such metric).
    let group =
        |part: &str| fleet.metric_sum(&format!("batchfleet_worker_commit_group_items_{part}"));
    let commit_group_mean = group("sum") / group("count").max(1.0);
    fleet.stop();
    services::delete_pool_queues(&pool);
    if summary["items_completed"].as_u64() != Some(items) {
        bail!(
            "control-plane job committed {:?} of {items} items",
            summary["items_completed"]
        );
    }
    let items_per_s = items as f64 / wall.max(1e-9);
    Ok(ControlPlane {
        items,
        items_per_s,
        raw_publish_per_s: raw_publish,
        raw_consume_ack_per_s: raw_consume,
        ratio_to_raw_consume: items_per_s / raw_consume,
        rss_after_1k_mib: rss_1k,
        rss_after_10k_mib: rss_10k,
        rss_at_end_mib: rss_end,
        cpu: cpu_before.per_item(&cpu_after, items, cores),
        message_body_bytes,
        whole_message_body_bytes,
        bundled_body_bytes_per_item: bundled_body_bytes as f64 / bundle_items.max(1) as f64,
        bundle_items,
        commit_group_mean,
    })
}

/// Body bytes of the first work message of the job of `manifest`: as
/// published for one item (the task named by digest), with the task
/// inside, and — with the items in the job's first message as the
/// coordinator bundles them by default — how many items that is and its
/// body bytes.
fn message_sizes(manifest: &Path) -> Result<(usize, usize, usize, usize)> {
    use batchfleet_shared::message::{bundle_size, seal, seal_bundle, Bundle, DEFAULT_BUNDLE};
    let spec = batchfleet_coordinator::manifest::load(manifest, &[])?;
    let plan = batchfleet_coordinator::planner::plan(&spec)?;
    let mut item = plan.items.first().context("the job has no items")?.clone();
    let published = seal(&item, None).body.len();
    let n = plan.items.len();
    let size = bundle_size(n, plan.rows_total / n.max(1) as u64, DEFAULT_BUNDLE);
    let refs: Vec<_> = plan.items[..size.min(n)]
        .iter()
        .filter_map(|i| i.to_ref())
        .collect();
    let bundled = match Bundle::of(&refs) {
        Some(b) if refs.len() > 1 => seal_bundle(b, None).body.len(),
        _ => published,
    };
    item.task_sha256 = None;
    let whole = seal(&item, None).body.len();
    Ok((published, whole, refs.len().max(1), bundled))
}

/// Runs the benchmark and prints the table.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport> {
    services::ensure_local()?;
    let worker = sibling("batchfleet-worker")?;
    let coordinator = sibling("batchfleet")?;
    let (root, _tmp) = crate::fault::work_dir(cfg.dir.as_deref())?;
    let prefix = services::unique("bfbench");
    let bins = (worker.as_path(), coordinator.as_path());
    let mut report = BenchReport {
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        workers: cfg.workers,
        ..BenchReport::default()
    };
    let outcome = (|| -> Result<()> {
        let small = RegimeSpec {
            name: "small",
            rows: cfg.small_rows,
            hidden: 64,
            format: "csv",
            compute: None,
        };
        // 0 rows skips a regime (to measure one part alone).
        let formats: &[String] = if cfg.small_rows > 0 {
            &cfg.formats
        } else {
            &[]
        };
        let mut measured = None;
        if cfg.small_rows > 0 {
            let csv = regime(cfg, &root, &small, bins, &prefix)?;
            measured = Some((csv.compute_rows_per_s, csv.compute_batch));
            report.regimes.push(csv);
        }
        for format in formats {
            let name = format!("small-{format}");
            let spec = RegimeSpec {
                name: &name,
                format,
                compute: measured,
                ..small
            };
            report
                .regimes
                .push(regime(cfg, &root, &spec, bins, &prefix)?);
        }
        let large = RegimeSpec {
            name: "large",
            rows: cfg.large_rows,
            hidden: 2048,
            format: "csv",
            compute: None,
        };
        if cfg.large_rows > 0 {
            report
                .regimes
                .push(regime(cfg, &root, &large, bins, &prefix)?);
        }
        if cfg.text_rows > 0 {
            report.text = Some(crate::textbench::run(
                &root,
                cfg.text_rows,
                cfg.workers,
                bins,
                &prefix,
            )?);
        }
        if cfg.pt2_rows > 0 {
            report.formats = Some(crate::formatbench::run(&root, cfg.pt2_rows)?);
        }
        if cfg.control_items > 0 {
            report.control = Some(control_plane(cfg, &root, bins, &prefix)?);
        }
        if cfg.start_jobs > 0 {
            report.starts = Some(crate::startbench::run(
                &root,
                cfg.start_jobs,
                cfg.workers,
                bins,
                &prefix,
            )?);
        }
        if let Some(p) = cfg.planning {
            report.planning = crate::planning::run(p, &root)?;
        }
        Ok(())
    })();
    // Job state of the bench's own prefix.
    services::delete_redis_prefix(&prefix);
    outcome?;
    print(&report);
    if let Some(path) = &cfg.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
        println!("figures written to {}", path.display());
    }
    Ok(report)
}

fn print(r: &BenchReport) {
    println!(
        "\nbench: {} cores, {} workers × {} thread(s)",
        r.cores,
        r.workers,
        (r.cores / r.workers.max(1)).max(1)
    );
    println!(
        "  {:<11} {:>12} {:>12} {:>12} {:>12} {:>9} {:>9} {:>8}",
        "model", "compute/s", "io/s", "serial-sum/s", "fleet/s", "÷serial", "÷compute", "wall s"
    );
    for g in &r.regimes {
        println!(
            "  {:<11} {:>12.0} {:>12.0} {:>12.0} {:>12.0} {:>9.2} {:>9.2} {:>8.2}",
            g.name,
            g.compute_rows_per_s,
            g.io_rows_per_s,
            g.serial_sum_rows_per_s,
            g.fleet_rows_per_s,
            g.ratio_to_serial_sum,
            g.ratio_to_compute,
            g.fleet_wall_s
        );
        println!(
            "          planning {:.2} s; stages (s, all workers): queue wait {:.2}, read {:.2}, inference {:.2}, write {:.2}; peak RSS workers {:?} MiB, coordinator {:.0} MiB; best batch {} (the fleet runs it)",
            g.plan_s, g.stage_s.queue_wait, g.stage_s.read, g.stage_s.inference, g.stage_s.write,
            rounded(&g.worker_peak_rss_mib), g.coordinator_peak_rss_mib, g.compute_batch
        );
        println!(
            "          run --local: {:.0} rows/s ({} pipelines; ÷fleet {:.2}, ÷serial {:.2}, wall {:.2} s, peak RSS {:.0} MiB); one pipeline of all cores {:.0} rows/s",
            g.local_rows_per_s, r.workers, g.local_to_fleet, g.local_to_serial_sum, g.local_wall_s, g.local_peak_rss_mib, g.local_one_pipeline_rows_per_s
        );
    }
    if let Some(t) = &r.text {
        crate::textbench::print(t);
    }
    if let Some(f) = &r.formats {
        crate::formatbench::print(f);
    }
    for p in &r.planning {
        println!(
            "  planning ({}): {} files, {:.1} MB: cut blind {:.3} s ({} items), by reading every record {:.3} s ({} items)",
            p.place, p.files, p.bytes as f64 / 1e6, p.blind_s, p.items_blind, p.read_s, p.items_read
        );
    }
    if let Some(c) = &r.control {
        println!(
            "  control plane: {} one-row items at {:.0} items/s; raw RabbitMQ {:.0} confirmed publishes/s, {:.0} consume+ack/s (fleet ÷ raw consume {:.2})",
            c.items, c.items_per_s, c.raw_publish_per_s, c.raw_consume_ack_per_s, c.ratio_to_raw_consume
        );
        println!(
            "  work message body: {} bytes (the item, its task named by digest); {} bytes with the whole task inside; {:.0} bytes per item in a bundle of {}; {:.1} items per commit call",
            c.message_body_bytes, c.whole_message_body_bytes, c.bundled_body_bytes_per_item, c.bundle_items, c.commit_group_mean
        );
        println!(
            "  worker RSS after 1k items {:?} MiB, after 10k items {:?} MiB, after all {} items {:?} MiB",
            rounded(&c.rss_after_1k_mib),
            rounded(&c.rss_after_10k_mib),
            c.items,
            rounded(&c.rss_at_end_mib),
        );
        let cpu = &c.cpu;
        println!(
            "  CPU per item: workers {:?} ms, coordinator {:.3} ms, RabbitMQ {:.3} ms, Redis {:.3} ms; {:.3} ms in all → at most {:.0} items/s on {} cores (RabbitMQ and Redis alone: {:.0})",
            cpu.workers_ms.iter().map(|m| (m * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
            cpu.coordinator_ms, cpu.rabbitmq_ms, cpu.redis_ms, cpu.total_ms,
            cpu.ceiling_items_per_s, r.cores, cpu.services_ceiling_items_per_s
        );
    }
    if let Some(j) = &r.starts {
        let ms = rounded(&j.fleet_start_ms);
        println!(
            "  job start: {} one-item jobs; first item started {:.0} ms after publication (median; each {:?} ms), wall {:.2} s per job (median) on the fleet; run --local {:.2} s per job (median)",
            j.jobs, j.fleet_start_median_ms, ms, j.fleet_wall_median_s, j.local_wall_median_s
        );
    }
}

/// Figures rounded to whole numbers, for printing.
fn rounded(v: &[f64]) -> Vec<f64> {
    v.iter().map(|m| m.round()).collect()
}
