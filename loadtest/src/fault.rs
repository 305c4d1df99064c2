//! What every fault run shares (`chaos`, `cluster`, `redis-failover`,
//! `redis-cluster`, `slurm`): the job generated for it and the worker
//! settings it runs with, the sibling binaries, starting and stopping
//! processes, the job flags of the runs on clusters of their own
//! ([`FaultJobArgs`], [`PaceArgs`]), reading a job's summary and checking
//! its invariants (INV-ROWS, INV-ACCT, INV-FILES), and keeping the report.

use anyhow::{bail, Context, Result};
use batchfleet_shared::output::{OWNER_FILE, SUCCESS_FILE, SUMMARY_FILE};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The message-signing key of a chaos run's fleet (a test key, not a secret).
pub(crate) const FAULT_KEY: &str = "chaos-run-signing-key-0123456789";

/// A fault run's job in `dir`: `rows` rows of a 16-feature MLP in 4 files
/// (the same data for the same rows), checkpoints every
/// `checkpoint_every` mini-batches.
pub(crate) fn fault_job(
    dir: &Path,
    name: &str,
    pool: &str,
    rows: u64,
    item_rows: u64,
    batch_size: u32,
    checkpoint_every: u32,
) -> Result<()> {
    batchfleet_testkit::python::make_job(
        dir,
        &batchfleet_testkit::python::JobGen {
            rows,
            files: 4,
            features: 16,
            hidden: 64,
            outputs: 1,
            name: format!("{name}-{}", std::process::id()),
            pool: pool.to_owned(),
            item_rows,
            batch_size,
            checkpoint_every: Some(checkpoint_every),
            ..batchfleet_testkit::python::JobGen::default()
        },
    )
}

/// The worker flags of a fault run: one thread and one item at a time,
/// heartbeats every second and 6 s leases (a dead worker's items move on
/// quickly), outages ridden out for `outage_timeout`, every mini-batch
/// slowed by `batch_delay` (a heavier model, so the job lasts through the
/// faults), every path under `root`.
pub(crate) fn fault_worker_args(
    outage_timeout: &str,
    batch_delay: Duration,
    root: &Path,
) -> Vec<String> {
    [
        "--threads",
        "1",
        "--prefetch",
        "1",
        "--drain-timeout",
        "15s",
        "--outage-timeout",
        outage_timeout,
        "--heartbeat",
        "1s",
        "--lease-ttl",
        "6s",
        "--debug-batch-delay",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        format!("{}ms", batch_delay.as_millis()),
        "--data-root".to_owned(),
        root.display().to_string(),
    ])
    .collect()
}

/// `batchfleet <args>` in `dir`, signing with the fleet's key, its output
/// in `dir/<log>`.
pub(crate) fn spawn_coordinator(
    bin: &Path,
    dir: &Path,
    args: &[String],
    log: &str,
) -> Result<Child> {
    let log = std::fs::File::create(dir.join(log))?;
    Command::new(bin)
        .args(args)
        .env("BATCHFLEET_SIGNING_KEY", FAULT_KEY)
        .current_dir(dir)
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))
}

pub(crate) fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status();
}

/// Waits for a child up to `within`, then kills it. `Some(true)` if it exited 0.
pub(crate) fn wait_or_kill(child: &mut Child, within: Duration) -> Option<bool> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status.success());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A binary built next to this one (`target/release/…`).
pub(crate) fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{} not found next to {}; build the workspace's binaries first (make release)",
            path.display(),
            exe.display()
        );
    }
    Ok(path)
}

/// The work folder `dir` (created), or a temporary one, kept as long as the
/// returned guard lives.
pub(crate) fn work_dir(dir: Option<&Path>) -> Result<(PathBuf, Option<tempfile::TempDir>)> {
    match dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            Ok((d.to_owned(), None))
        }
        None => {
            let tmp = tempfile::tempdir()?;
            Ok((tmp.path().to_owned(), Some(tmp)))
        }
    }
}

/// The job and fleet flags of the fault runs on clusters of their own
/// (`cluster`, `redis-failover`, `redis-cluster`).
#[derive(Debug, Clone, clap::Args)]
pub struct FaultJobArgs {
    /// Worker processes.
    #[arg(long, default_value_t = 3, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub workers: usize,
    /// Rows per work item.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub item_rows: u64,
    /// Fail if a job has not finished after this long.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Keep data, logs and the run's report (`<command>.json`) here
    /// (default: a temporary folder).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// How heavy the model of a fault run plays (`cluster`, `redis-failover`).
#[derive(Debug, Clone, clap::Args)]
pub struct PaceArgs {
    /// Rows per mini-batch.
    #[arg(long, default_value_t = 500)]
    pub batch_size: u32,
    /// Artificial delay per mini-batch on every worker (plays a heavier
    /// model, so the job lasts long enough for the fault).
    #[arg(long, default_value = "60ms", value_parser = humantime::parse_duration)]
    pub batch_delay: Duration,
}

/// A finished job's summary (`out/_summary.json` under its folder).
pub(crate) fn read_summary(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("out").join(SUMMARY_FILE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// The job's own duration in its summary (s): planning to settled.
pub(crate) fn job_seconds(summary: &serde_json::Value) -> f64 {
    summary
        .get("duration_s")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.0)
}

/// Waits until `at` seconds after `started`, or until `done` is set (a
/// fault thread's clock beside a running job); whether `done` is still
/// unset. Nothing to await but the clock and the coordinator's exit: poll.
pub(crate) fn wait_until(at: f64, started: Instant, done: &std::sync::atomic::AtomicBool) -> bool {
    let is_done = || done.load(std::sync::atomic::Ordering::SeqCst);
    while !is_done() && started.elapsed().as_secs_f64() < at {
        std::thread::sleep(Duration::from_millis(50));
    }
    !is_done()
}

/// Writes a run's figures as JSON to `root/file` when the run was given a
/// folder to keep (`--dir`).
pub(crate) fn keep_report<T: serde::Serialize>(
    kept: Option<&Path>,
    root: &Path,
    file: &str,
    report: &T,
) -> Result<()> {
    if kept.is_some() {
        std::fs::write(root.join(file), serde_json::to_vec_pretty(report)?)?;
    }
    Ok(())
}

/// A count of a job's `_summary.json` (0 when absent).
pub(crate) fn summary_u64(summary: &serde_json::Value, key: &str) -> u64 {
    summary
        .get(key)
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

/// INV-ROWS, INV-ACCT (the summary's counts) and INV-FILES of the finished
/// job in `dir` (`out/` against `golden.csv`, `rows` input rows): pushes
/// each violation to `v` and returns the job's summary.
pub(crate) fn job_invariants(
    dir: &Path,
    rows: u64,
    v: &mut Vec<String>,
) -> Result<serde_json::Value> {
    let out = dir.join("out");
    let summary = read_summary(dir)?;
    let num = |k: &str| summary_u64(&summary, k);

    // INV-ROWS: every input row exactly once, scores as PyTorch computes them.
    let verification = batchfleet_testkit::verify::verify(&out, &dir.join("golden.csv"), 1e-5)?;
    if !verification.ok() {
        v.push(format!("INV-ROWS: {}", verification.describe()));
    }
    // INV-ACCT: items planned = done ⊎ dead-lettered; the queues end empty.
    if num("items_completed") + num("items_failed") != num("items_total") {
        v.push(format!(
            "INV-ACCT: {} items planned but {} done and {} failed",
            num("items_total"),
            num("items_completed"),
            num("items_failed")
        ));
    }
    if num("rows_predicted") + num("rows_rejected") != rows {
        v.push(format!(
            "INV-ACCT: summary counts {} + {} rows of {}",
            num("rows_predicted"),
            num("rows_rejected"),
            rows
        ));
    }
    // INV-FILES: no temp file outside staging (and staging empty), _SUCCESS iff completed.
    let completed = summary.get("status").and_then(|s| s.as_str()) == Some("completed");
    if completed != out.join(SUCCESS_FILE).is_file() {
        v.push(format!(
            "INV-FILES: status {:?} but _SUCCESS present = {}",
            summary.get("status"),
            !completed
        ));
    }
    for entry in walk(&out)? {
        let rel = entry
            .strip_prefix(&out)
            .unwrap_or(&entry)
            .to_string_lossy()
            .into_owned();
        let name = entry
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let known = rel.starts_with("part-")
            || rel.starts_with("_rejects/part-")
            || [SUCCESS_FILE, OWNER_FILE, SUMMARY_FILE].contains(&name.as_str());
        if !known {
            v.push(format!("INV-FILES: unexpected file {rel}"));
        }
    }
    Ok(summary)
}

/// The checks of a finished job whose item `seq` kills every worker that
/// runs it: its coordinator exited 3 (completed with failures), the item
/// is its only failure, recorded as `crash`, and every other row was
/// predicted exactly once and as PyTorch computes it (`rows` input rows).
/// Pushes each violation to `v`; whether the item was given up as `crash`.
pub(crate) fn crash_job_invariants(
    dir: &Path,
    rows: u64,
    seq: u64,
    exit: Option<i32>,
    v: &mut Vec<String>,
) -> Result<bool> {
    let summary = read_summary(dir)?;
    let failed = summary
        .get("failed_items")
        .and_then(|f| f.as_array())
        .cloned()
        .unwrap_or_default();
    let crashed = failed.len() == 1
        && failed[0].get("seq").and_then(serde_json::Value::as_u64) == Some(seq)
        && failed[0].get("class").and_then(|c| c.as_str()) == Some("crash");
    if exit != Some(3) || !crashed {
        v.push(format!(
            "exit {exit:?} and failed items {failed:?}; exit 3 and item {seq} dead-lettered as crash expected"
        ));
    }
    let verification =
        batchfleet_testkit::verify::verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5)?;
    let lost = verification.missing.len() as u64;
    if !verification.duplicated.is_empty()
        || !verification.unexpected.is_empty()
        || !verification.mismatched.is_empty()
        || lost == 0
        || lost + summary_u64(&summary, "rows_predicted") != rows
    {
        v.push(format!(
            "INV-ROWS: {} (only the crashing item's rows may be missing)",
            verification.describe()
        ));
    }
    Ok(exit == Some(3) && crashed)
}

/// Prints a fault run's verdict, each line after `indent`: `held` when no
/// invariant was violated, else each violation.
pub(crate) fn print_verdict(indent: &str, violations: &[String], held: &str) {
    if violations.is_empty() {
        println!("{indent}{held}");
    } else {
        for v in violations {
            println!("{indent}VIOLATED   {v}");
        }
    }
}

/// Runs `f` on a connection named `name` to the broker at `amqp`, from
/// synchronous code, and closes the connection.
pub(crate) fn on_broker<T, F, Fut>(
    amqp: &batchfleet_shared::endpoint::Endpoint,
    name: &str,
    f: F,
) -> Result<T>
where
    F: FnOnce(std::sync::Arc<dyn batchfleet_shared::broker::Broker>) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let conn = batchfleet_shared::broker::connect(amqp, name, Duration::from_secs(30)).await?;
        let done = f(conn.clone()).await;
        conn.close("bye").await;
        done
    })
}

/// Ready messages in each of the pool's queues (work, retry tiers, dead)
/// on the broker at `amqp`.
pub(crate) fn queue_depths(
    amqp: &batchfleet_shared::endpoint::Endpoint,
    pool: &str,
) -> Result<Vec<(String, u32)>> {
    on_broker(amqp, "batchfleet-chaos", |conn| async move {
        let mut depths = Vec::new();
        for q in batchfleet_shared::broker::PoolQueues::new(pool).all() {
            let ready = conn.ready_count(&q).await?.unwrap_or(0);
            depths.push((q, ready));
        }
        Ok(depths)
    })
}

fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(walk(&path)?);
        } else {
            files.push(path);
        }
    }
    Ok(files)
}
