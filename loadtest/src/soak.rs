//! `batchfleet-loadtest soak --faults`: a fleet that runs for a long time.
//! Rounds of jobs, each of several distinct models (so every worker loads,
//! keeps and drops many over the run), go through a pool of worker
//! processes restarted whenever they exit, as systemd or Kubernetes would.
//! Each round also runs a job on a second pool whose workers abort on its
//! item 2 (an item that kills every worker that runs it), and, with
//! `--faults`, one worker is killed -9 and the round's fault comes in turn:
//!
//! - Redis restarted empty while the round's jobs sit in their queues;
//! - a running job's queue deleted under the fleet;
//! - dead letters forged (unsigned, and signed with another key) for a job,
//!   then `batchfleet dlq replay` run on it, as an operator would.
//!
//! After each round every job is checked: each input row predicted exactly
//! once and as PyTorch computes it, the summary's accounting, the output
//! folder's files; the crashing item dead-lettered as `crash` and nothing
//! else lost; the forged letters left dead and nothing replayed. Worker
//! memory must stay under `--max-worker-rss`, and at the end no job of the
//! run may be left running. What it did is printed, and kept in
//! `soak.json` with `--dir`.

use crate::chaos::Fleet;
use crate::fault;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::services;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// Settings of a soak run.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakConfig {
    /// Keep starting rounds of jobs for this long (the last round ends after).
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Inject faults: a worker killed -9 each round, and in turn Redis
    /// restarted empty, a job's queue deleted, forged dead letters replayed.
    #[arg(long)]
    pub faults: bool,
    /// Worker processes on the main pool.
    #[arg(long, default_value_t = 3, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub workers: usize,
    /// Distinct models the jobs go through, in turn.
    #[arg(long, default_value_t = 6, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub models: usize,
    /// Models each worker keeps loaded (`--models-kept`): fewer than
    /// `--models` makes workers drop and load models again.
    #[arg(long, default_value_t = 3)]
    pub models_kept: usize,
    /// Jobs started together in each round on the main pool.
    #[arg(long, default_value_t = 3, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub jobs_per_round: usize,
    /// Rows in each job.
    #[arg(long, default_value_t = 8_000)]
    pub rows: u64,
    /// Rows per work item.
    #[arg(long, default_value_t = 400)]
    pub item_rows: u64,
    /// Artificial delay per mini-batch on every worker (a heavier model).
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub batch_delay: Duration,
    /// A worker whose resident memory passes this is a violation.
    #[arg(long, default_value = "1GiB", value_parser = batchfleet_shared::config::parse_size)]
    pub max_worker_rss: u64,
    /// A round not finished after this long is a violation.
    #[arg(long, default_value = "8m", value_parser = humantime::parse_duration)]
    pub round_timeout: Duration,
    /// Keep data, logs and soak.json here (default: a temporary folder).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Instead of the rounds: a simulated fleet of this many workers (real
    /// workers, many to a process, on a model that does next to nothing)
    /// running `--jobs` jobs of `--items` one-row items together, measured
    /// per item (see docs/scaling.md).
    #[arg(long, value_name = "WORKERS", help_heading = "Simulated fleet", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub simulated: Option<usize>,
    /// Processes the simulated workers share.
    #[arg(long, default_value_t = 4, help_heading = "Simulated fleet")]
    pub processes: usize,
    /// Jobs run together on the simulated fleet.
    #[arg(long, default_value_t = 20, help_heading = "Simulated fleet")]
    pub jobs: usize,
    /// One-row items in all, over the jobs.
    #[arg(long, default_value_t = 1_000_000, help_heading = "Simulated fleet")]
    pub items: u64,
    /// How long the idle fleet is watched for its background Redis commands.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, help_heading = "Simulated fleet")]
    pub idle: Duration,
}

/// What a soak run did and found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SoakReport {
    /// Seconds the rounds took.
    pub seconds: f64,
    /// Rounds run.
    pub rounds: u32,
    /// Jobs run (the crashing ones included).
    pub jobs: u32,
    /// Rows predicted, over all jobs.
    pub rows_predicted: u64,
    /// Distinct models run.
    pub models: usize,
    /// Model loads the main pool's workers logged.
    pub model_loads: u64,
    /// Models those workers dropped from their caches.
    pub models_dropped: u64,
    /// Workers killed -9 by the soak.
    pub worker_kill9: u32,
    /// Worker processes that exited on their own (crashes included), by
    /// exit code or signal, and were restarted.
    pub worker_exits: std::collections::BTreeMap<String, u32>,
    /// Items dead-lettered as `crash`.
    pub crash_items: u32,
    /// Redis restarts (empty).
    pub redis_restarts: u32,
    /// Job queues deleted under the fleet.
    pub queues_deleted: u32,
    /// Forged dead letters put in the dead queue.
    pub forged_letters: u32,
    /// Of them, left dead by `dlq replay`.
    pub forged_refused: u32,
    /// Largest resident memory of a main-pool worker, after each round (MiB).
    pub worker_rss_mib: Vec<u64>,
    /// Invariant violations (empty: all held).
    pub violations: Vec<String>,
}

/// A job of a round: its folder and coordinator.
struct RoundJob {
    dir: PathBuf,
    name: String,
    crash: bool,
    coordinator: Child,
    exit: Option<i32>,
}

/// Runs the soak; prints and returns what it did.
pub fn run(cfg: &SoakConfig) -> Result<SoakReport> {
    services::ensure_local()?;
    let worker_bin = fault::sibling("batchfleet-worker")?;
    let coordinator = fault::sibling("batchfleet")?;
    let (root, _tmp) = fault::work_dir(cfg.dir.as_deref())?;
    let pool = services::unique("soak");
    let crash_pool = services::unique("soakcrash");
    let prefix = services::unique("bfsoak");
    let mut report = SoakReport {
        models: cfg.models,
        ..SoakReport::default()
    };
    println!(
        "soak: {} for {:?}: {} workers, {} models ({} kept), {} jobs of {} rows per round, in {}",
        if cfg.faults {
            "with faults"
        } else {
            "without faults"
        },
        cfg.duration,
        cfg.workers,
        cfg.models,
        cfg.models_kept,
        cfg.jobs_per_round,
        cfg.rows,
        root.display()
    );
    let templates = root.join("templates");
    for m in 0..cfg.models {
        template(
            &templates.join(format!("m{m}")),
            cfg,
            &pool,
            16 + 8 * m as u32,
        )?;
    }
    template(&templates.join("crash"), cfg, &crash_pool, 12)?;

    let mut args = fault::fault_worker_args("60s", cfg.batch_delay, &root);
    args.extend(["--models-kept".to_owned(), cfg.models_kept.to_string()]);
    let logs = root.join("logs");
    std::fs::create_dir_all(logs.join("crash"))?;
    let mut fleet = Fleet::new(
        worker_bin.clone(),
        logs.clone(),
        &pool,
        &prefix,
        args.clone(),
    )
    .named("soak-w");
    let mut crash_args = args;
    crash_args.extend(["--debug-panic".to_owned(), "abort:2".to_owned()]);
    let mut crash_fleet = Fleet::new(
        worker_bin,
        logs.join("crash"),
        &crash_pool,
        &prefix,
        crash_args,
    )
    .named("soakcrash-w");
    fleet.start(cfg.workers)?;
    crash_fleet.start(2)?;

    let outcome = rounds(
        cfg,
        &coordinator,
        &root,
        &prefix,
        &pool,
        &mut fleet,
        &mut crash_fleet,
        &mut report,
    );
    fleet.stop();
    crash_fleet.stop();
    let (loads, dropped) = model_churn(&logs);
    report.model_loads = loads;
    report.models_dropped = dropped;
    if let Err(e) = outcome {
        report.violations.push(format!("the soak stopped: {e:#}"));
    }
    match crate::chaos::running_jobs(&prefix, "soak-") {
        Ok(running) if !running.is_empty() => report.violations.push(format!(
            "jobs left running at the end: {}",
            running.join(", ")
        )),
        Ok(_) => {}
        Err(e) => report
            .violations
            .push(format!("cannot list the jobs left: {e:#}")),
    }
    services::delete_pool_queues(&pool);
    services::delete_pool_queues(&crash_pool);
    services::delete_redis_prefix(&prefix);
    print(&report);
    fault::keep_report(cfg.dir.as_deref(), &root, "soak.json", &report)?;
    Ok(report)
}

/// A job template: data, model, golden predictions and manifest in `dir`.
fn template(dir: &Path, cfg: &SoakConfig, pool: &str, hidden: u32) -> Result<()> {
    batchfleet_testkit::python::make_job(
        dir,
        &batchfleet_testkit::python::JobGen {
            rows: cfg.rows,
            files: 2,
            features: 16,
            hidden,
            outputs: 1,
            name: "soak-template".into(),
            pool: pool.to_owned(),
            item_rows: cfg.item_rows,
            batch_size: 100,
            ..batchfleet_testkit::python::JobGen::default()
        },
    )
}

/// A copy of `template` in `dir` as a job of its own, named `name`.
pub(crate) fn instance(template: &Path, dir: &Path, name: &str) -> Result<()> {
    std::fs::create_dir_all(dir.join("data"))?;
    for entry in std::fs::read_dir(template.join("data"))? {
        let path = entry?.path();
        std::fs::copy(
            &path,
            dir.join("data").join(path.file_name().expect("a file")),
        )?;
    }
    std::fs::copy(template.join("model.pt"), dir.join("model.pt"))?;
    std::fs::copy(template.join("golden.csv"), dir.join("golden.csv"))?;
    let manifest = std::fs::read_to_string(template.join("job.toml"))?
        .replace("name = \"soak-template\"", &format!("name = \"{name}\""));
    std::fs::write(dir.join("job.toml"), manifest)?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn rounds(
    cfg: &SoakConfig,
    coordinator: &Path,
    root: &Path,
    prefix: &str,
    pool: &str,
    fleet: &mut Fleet,
    crash_fleet: &mut Fleet,
    report: &mut SoakReport,
) -> Result<()> {
    let started = Instant::now();
    let mut r = 0u32;
    while started.elapsed() < cfg.duration {
        let round_started = Instant::now();
        let mut jobs = Vec::new();
        for j in 0..=cfg.jobs_per_round {
            let crash = j == cfg.jobs_per_round;
            let m = (r as usize * cfg.jobs_per_round + j) % cfg.models;
            let template = if crash {
                root.join("templates/crash")
            } else {
                root.join(format!("templates/m{m}"))
            };
            let name = format!(
                "soak-r{r}-{}",
                if crash {
                    "crash".to_owned()
                } else {
                    format!("j{j}")
                }
            );
            let dir = root.join("jobs").join(&name);
            instance(&template, &dir, &name)?;
            let args: Vec<String> = [
                "--redis-prefix",
                prefix,
                "run",
                "job.toml",
                "--no-progress",
                "--orphan-grace",
                "5s",
                // Started as a scheduler would start them, with the
                // patience of a production run: the broker on the 2-core
                // reference machine has stalled for 20 s (no log line, no answer)
                // while the rounds create and delete quorum queues, and a
                // CLI's default of 10 s then failed the job's start.
                "--connect-timeout",
                "60s",
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
            let child = fault::spawn_coordinator(coordinator, &dir, &args, "coordinator.log")?;
            jobs.push(RoundJob {
                dir,
                name,
                crash,
                coordinator: child,
                exit: None,
            });
        }
        let fault_kind = r % 3;
        let (mut killed, mut faulted) = (!cfg.faults, !cfg.faults);
        loop {
            restart_exited(fleet, report)?;
            restart_exited(crash_fleet, report)?;
            for job in &mut jobs {
                if job.exit.is_none() {
                    if let Some(status) = job.coordinator.try_wait()? {
                        job.exit = Some(status.code().unwrap_or(-1));
                    }
                }
            }
            if jobs.iter().all(|j| j.exit.is_some()) {
                break;
            }
            let t = round_started.elapsed();
            if t > cfg.round_timeout {
                for job in &mut jobs {
                    let _ = job.coordinator.kill();
                }
                bail!("round {r} did not finish within {:?}", cfg.round_timeout);
            }
            if !killed && t > Duration::from_millis(1500) {
                killed = true;
                let slot = fastrand::usize(..fleet.workers.len());
                let _ = fleet.workers[slot].kill();
                let _ = fleet.workers[slot].wait();
                fleet.workers[slot] = fleet.spawn(slot)?;
                report.worker_kill9 += 1;
            }
            if !faulted && fault_kind != 2 && crate::chaos::published(prefix, &jobs[0].name)? {
                faulted = true;
                if fault_kind == 0 {
                    services::restart_redis(false)?;
                    report.redis_restarts += 1;
                    println!("soak: round {r}: Redis restarted empty with the round's jobs queued");
                } else {
                    let id = job_id(&jobs[0].dir)?;
                    delete_queue(&batchfleet_shared::broker::PoolQueues::new(pool).job(&id))?;
                    report.queues_deleted += 1;
                    println!("soak: round {r}: the queue of {id} deleted under the fleet");
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if cfg.faults && fault_kind == 2 {
            forge_and_replay(coordinator, prefix, pool, &jobs[0].dir, report)?;
        }
        check_round(&jobs, cfg.rows, report)?;
        report.worker_rss_mib.push(
            fleet
                .workers
                .iter()
                .filter_map(|w| batchfleet_shared::process_memory(Some(w.id()), "VmRSS"))
                .max()
                .unwrap_or(0)
                >> 20,
        );
        let rss = *report.worker_rss_mib.last().expect("just pushed") << 20;
        if rss > cfg.max_worker_rss {
            report.violations.push(format!(
                "round {r}: a worker holds {} MiB, over --max-worker-rss ({} MiB)",
                rss >> 20,
                cfg.max_worker_rss >> 20
            ));
        }
        report.rounds += 1;
        report.jobs += jobs.len() as u32;
        println!(
            "soak: round {r} done in {:.1}s: {} jobs, worker RSS ≤ {} MiB, {} violation(s) so far",
            round_started.elapsed().as_secs_f64(),
            jobs.len(),
            rss >> 20,
            report.violations.len()
        );
        r += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(())
}

/// Restarts every worker of `fleet` that exited (a supervisor's job),
/// counting how each ended.
fn restart_exited(fleet: &mut Fleet, report: &mut SoakReport) -> Result<()> {
    use std::os::unix::process::ExitStatusExt;
    for slot in 0..fleet.workers.len() {
        if let Some(status) = fleet.workers[slot].try_wait()? {
            let how = match (status.code(), status.signal()) {
                (Some(c), _) => format!("exit {c}"),
                (None, Some(s)) => format!("signal {s}"),
                _ => "unknown".to_owned(),
            };
            *report.worker_exits.entry(how).or_default() += 1;
            fleet.workers[slot] = fleet.spawn(slot)?;
        }
    }
    Ok(())
}

/// Checks every job of a finished round.
fn check_round(jobs: &[RoundJob], rows: u64, report: &mut SoakReport) -> Result<()> {
    for job in jobs {
        let label = &job.name;
        let summary = match fault::read_summary(&job.dir) {
            Ok(s) => s,
            Err(e) => {
                report.violations.push(format!(
                    "{label}: no summary (coordinator exit {:?}): {e:#}; see {}",
                    job.exit,
                    job.dir.join("coordinator.log").display()
                ));
                continue;
            }
        };
        let num = |k: &str| fault::summary_u64(&summary, k);
        report.rows_predicted += num("rows_predicted");
        if !job.crash {
            if job.exit != Some(0) {
                report.violations.push(format!(
                    "{label}: coordinator exit {:?}, 0 expected",
                    job.exit
                ));
            }
            let mut v = Vec::new();
            fault::job_invariants(&job.dir, rows, &mut v)?;
            report
                .violations
                .extend(v.into_iter().map(|e| format!("{label}: {e}")));
            continue;
        }
        // The crashing job: item 2 dead-lettered as `crash`, nothing else lost.
        let mut v = Vec::new();
        if fault::crash_job_invariants(&job.dir, rows, 2, job.exit, &mut v)? {
            report.crash_items += 1;
        }
        report
            .violations
            .extend(v.into_iter().map(|e| format!("{label}: {e}")));
    }
    Ok(())
}

/// Puts two forged dead letters of the job in `dir` in the pool's dead
/// queue — one unsigned, one signed with another key — runs `batchfleet
/// dlq replay` on the job as an operator would, and checks that it
/// replays neither; then purges them.
fn forge_and_replay(
    coordinator: &Path,
    prefix: &str,
    pool: &str,
    dir: &Path,
    report: &mut SoakReport,
) -> Result<()> {
    use batchfleet_shared::broker::{Outgoing, PoolQueues};
    use batchfleet_shared::message::CLASS_HEADER;
    let item = crate::chaos::first_item(dir)?;
    let id = item.job_id.clone();
    let other =
        batchfleet_shared::signing::SigningKey::new(b"not-the-fleet-key-0123456789", "soak")?;
    let dead = |key: Option<&batchfleet_shared::signing::SigningKey>| {
        let mut m = Outgoing::work_item(&item, 1, key);
        m.headers.set([(CLASS_HEADER, "model".to_owned())], []);
        m
    };
    let letters = vec![dead(None), dead(Some(&other))];
    let n = letters.len() as u32;
    fault::on_broker(&services::amqp(), "batchfleet-soak", |conn| async move {
        conn.publish(&PoolQueues::new(pool).dead(), letters, 2)
            .await?;
        Ok(())
    })?;
    report.forged_letters += n;
    let out = std::process::Command::new(coordinator)
        .args([
            "--redis-prefix",
            prefix,
            "dlq",
            "replay",
            "--job",
            &id,
            "--pool",
            pool,
            "--no-wait",
        ])
        .env("BATCHFLEET_SIGNING_KEY", fault::FAULT_KEY)
        .output()
        .context("running dlq replay")?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let refused = said
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("left ")?
                .split(' ')
                .next()?
                .parse::<u32>()
                .ok()
        })
        .unwrap_or(0);
    report.forged_refused += refused;
    if !out.status.success() || !said.contains("replayed 0 item(s)") || refused != n {
        report.violations.push(format!(
            "{id}: dlq replay of {n} forged dead letters: exit {:?}, {said}",
            out.status.code()
        ));
    }
    println!(
        "soak: {n} forged dead letters of {id}: dlq replay left {refused} dead, replayed none"
    );
    let purged = std::process::Command::new(coordinator)
        .args([
            "--redis-prefix",
            prefix,
            "dlq",
            "purge",
            "--pool",
            pool,
            "--job",
            &id,
            "--yes",
        ])
        .output()
        .context("running dlq purge")?;
    if !purged.status.success() {
        bail!("dlq purge: {}", String::from_utf8_lossy(&purged.stderr));
    }
    Ok(())
}

/// The id of the job whose manifest is in `dir`.
fn job_id(dir: &Path) -> Result<String> {
    Ok(batchfleet_coordinator::manifest::load(&dir.join("job.toml"), &[])?.job_id)
}

/// Deletes a queue on the local RabbitMQ.
fn delete_queue(queue: &str) -> Result<()> {
    fault::on_broker(&services::amqp(), "batchfleet-soak", |conn| async move {
        conn.delete(queue).await?;
        Ok(())
    })
}

/// Model loads and drops the main pool's workers logged.
fn model_churn(logs: &Path) -> (u64, u64) {
    let (mut loads, mut dropped) = (0, 0);
    for entry in std::fs::read_dir(logs).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            loads += text.matches("model loaded").count() as u64;
            dropped += text.matches("model dropped from the cache").count() as u64;
        }
    }
    (loads, dropped)
}

fn print(r: &SoakReport) {
    println!(
        "\nsoak: {} rounds in {:.0} s: {} jobs, {} rows predicted, {} models",
        r.rounds, r.seconds, r.jobs, r.rows_predicted, r.models
    );
    println!(
        "  models: {} loads, {} dropped from worker caches; worker RSS after each round (MiB): {:?}",
        r.model_loads, r.models_dropped, r.worker_rss_mib
    );
    println!(
        "  faults: {} workers killed -9, {} Redis restarts (empty), {} job queues deleted, {} forged dead letters ({} left dead by replay)",
        r.worker_kill9, r.redis_restarts, r.queues_deleted, r.forged_letters, r.forged_refused
    );
    println!(
        "  crashes: {} items dead-lettered as crash; worker exits restarted: {:?}",
        r.crash_items, r.worker_exits
    );
    fault::print_verdict(
        "  ",
        &r.violations,
        "every invariant held for every job; no job left running",
    );
}
