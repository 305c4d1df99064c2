//! `batchfleet-loadtest chaos`: a real job on a fleet of worker processes
//! while workers are killed (-9 and SIGTERM, alternating) and restarted,
//! the coordinator is killed and resumed, and RabbitMQ and Redis are
//! restarted; then the invariants are checked. The same job first runs once
//! without faults, for the wall-time comparison.
//!
//! Workers get an artificial per-batch delay (`--debug-batch-delay`), which
//! plays a heavier model so that the job lasts long enough for every fault
//! to land mid-job.

use anyhow::{bail, Context, Result};
use batchfleet_loadtest::services;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Settings of a chaos run.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// Rows in the job.
    pub rows: u64,
    /// Worker processes.
    pub workers: usize,
    /// A worker is killed this often.
    pub kill_every: Duration,
    /// Rows per item.
    pub item_rows: u64,
    /// Rows per mini-batch.
    pub batch_size: u32,
    /// Mini-batches per checkpoint.
    pub checkpoint_every: u32,
    /// Artificial delay per mini-batch on every worker.
    pub batch_delay: Duration,
    /// Give up after this long (the run fails).
    pub timeout: Duration,
    /// Restart Redis empty (as one without persistence would come back)
    /// instead of from a snapshot. It empties the whole local Redis.
    pub redis_wipe: bool,
    /// Work folder (a temporary one if `None`), kept with logs if given.
    pub dir: Option<PathBuf>,
}

/// The figures of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ChaosReport {
    /// Rows in the job.
    pub rows: u64,
    /// Items in the job.
    pub items: u64,
    /// Wall time of the fault-free run (s).
    pub baseline_s: f64,
    /// Wall time of the run under faults (s).
    pub chaos_s: f64,
    /// Workers killed with SIGKILL.
    pub worker_kill9: u32,
    /// Workers stopped with SIGTERM (drained).
    pub worker_sigterm: u32,
    /// SIGTERMed workers that exited 0.
    pub worker_sigterm_clean: u32,
    /// Coordinator kills (followed by `batchfleet resume`).
    pub coordinator_kills: u32,
    /// RabbitMQ restarts.
    pub rabbitmq_restarts: u32,
    /// Redis restarts.
    pub redis_restarts: u32,
    /// Items started beyond one per item (deliveries − items).
    pub items_redelivered: u64,
    /// Items the coordinator published again (stale lease, straggler, lost).
    pub items_redispatched: u64,
    /// Rows put through the model beyond the job's rows (wasted work).
    pub rows_recomputed: u64,
    /// Rows a redelivered item skipped thanks to its checkpoint.
    pub rows_resumed: u64,
    /// Redis was restarted empty: the work counters only cover the time after.
    pub redis_wiped: bool,
    /// Invariant violations found (empty: all hold).
    pub violations: Vec<String>,
}

struct Fleet {
    worker_bin: PathBuf,
    dir: PathBuf,
    pool: String,
    prefix: String,
    args: Vec<String>,
    workers: Vec<Child>,
    spawned: u32,
}

impl Fleet {
    fn spawn(&mut self, slot: usize) -> Result<Child> {
        self.spawned += 1;
        let id = format!("chaos-w{slot}-{}", self.spawned);
        let log = std::fs::File::create(self.dir.join(format!("{id}.log")))?;
        Command::new(&self.worker_bin)
            .args([
                "--pool",
                &self.pool,
                "--redis-prefix",
                &self.prefix,
                "--worker-id",
                &id,
            ])
            .args(&self.args)
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {}", self.worker_bin.display()))
    }

    fn start(&mut self, n: usize) -> Result<()> {
        for slot in 0..n {
            let child = self.spawn(slot)?;
            self.workers.push(child);
        }
        Ok(())
    }

    /// SIGTERM every worker and wait for them.
    fn stop(&mut self) {
        for w in &self.workers {
            signal(w, "TERM");
        }
        for w in &mut self.workers {
            wait_or_kill(w, Duration::from_secs(40));
        }
        self.workers.clear();
    }
}

fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status();
}

/// Waits for a child up to `within`, then kills it. `Some(true)` if it exited 0.
fn wait_or_kill(child: &mut Child, within: Duration) -> Option<bool> {
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

/// Runs the baseline and the chaos run; prints and returns the figures.
pub fn run(cfg: &ChaosConfig) -> Result<ChaosReport> {
    services::ensure_local()?;
    let worker_bin = sibling("batchfleet-worker")?;
    let coordinator = sibling("batchfleet")?;
    let tmp;
    let root = match &cfg.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().to_owned()
        }
    };
    let pool = services::unique("chaos");
    let prefix = services::unique("bfchaos");
    let mut report = ChaosReport {
        redis_wiped: cfg.redis_wipe,
        rows: cfg.rows,
        items: cfg.rows.div_ceil(cfg.item_rows),
        ..ChaosReport::default()
    };
    let worker_args: Vec<String> = [
        "--threads",
        "1",
        "--prefetch",
        "1",
        "--drain-timeout",
        "15s",
        "--connect-timeout",
        "3m",
        "--heartbeat",
        "1s",
        "--lease-ttl",
        "6s",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        "--debug-batch-delay".to_owned(),
        format!("{}ms", cfg.batch_delay.as_millis()),
    ])
    .collect();

    let outcome = (|| -> Result<()> {
        // The same data twice (same seed), as two jobs.
        for name in ["baseline", "chaos"] {
            batchfleet_loadtest::python::make_job(
                &root.join(name),
                &batchfleet_loadtest::python::JobGen {
                    rows: cfg.rows,
                    files: 4,
                    features: 16,
                    hidden: 64,
                    outputs: 1,
                    name: format!("{name}-{}", std::process::id()),
                    pool: pool.clone(),
                    item_rows: cfg.item_rows,
                    batch_size: cfg.batch_size,
                    checkpoint_every: Some(cfg.checkpoint_every),
                    ..batchfleet_loadtest::python::JobGen::default()
                },
            )?;
        }
        let coordinator_cmd = |dir: &Path, args: &[&str], log: &str| -> Result<Child> {
            let log = std::fs::File::create(dir.join(log))?;
            Command::new(&coordinator)
                .args(["--redis-prefix", &prefix])
                .args(args)
                .args(["--no-progress", "--speculate-after", "4"])
                .current_dir(dir)
                .stdout(Stdio::from(log.try_clone()?))
                .stderr(Stdio::from(log))
                .spawn()
                .with_context(|| format!("starting {}", coordinator.display()))
        };
        let mut fleet = Fleet {
            worker_bin: worker_bin.clone(),
            dir: root.clone(),
            pool: pool.clone(),
            prefix: prefix.clone(),
            args: worker_args.clone(),
            workers: Vec::new(),
            spawned: 0,
        };

        // Baseline: no faults.
        println!(
            "chaos: baseline run, {} rows, {} workers, no faults",
            cfg.rows, cfg.workers
        );
        let base_dir = root.join("baseline");
        fleet.start(cfg.workers)?;
        let started = Instant::now();
        let mut c = coordinator_cmd(&base_dir, &["run", "job.toml"], "coordinator.log")?;
        let ok = wait_or_kill(&mut c, cfg.timeout);
        report.baseline_s = started.elapsed().as_secs_f64();
        fleet.stop();
        if ok != Some(true) {
            bail!(
                "the baseline job failed; see {}",
                base_dir.join("coordinator.log").display()
            );
        }
        println!("chaos: baseline took {:.1}s", report.baseline_s);

        // Under faults.
        let dir = root.join("chaos");
        fleet.start(cfg.workers)?;
        let started = Instant::now();
        let mut coord = coordinator_cmd(&dir, &["run", "job.toml"], "coordinator-1.log")?;
        let base = report.baseline_s;
        let mut next_kill = started + cfg.kill_every;
        let mut kill9 = true;
        let mut rng = fastrand::Rng::with_seed(u64::from(std::process::id()));
        let (mut coord_done, mut mq_done, mut redis_done) = (false, false, false);
        let finished = loop {
            if let Some(status) = coord.try_wait()? {
                break status.success();
            }
            let t = started.elapsed();
            if t > cfg.timeout {
                let _ = coord.kill();
                fleet.stop();
                bail!(
                    "the job did not finish within {:?} under faults",
                    cfg.timeout
                );
            }
            let at = |fraction: f64| t.as_secs_f64() >= base * fraction;
            if !coord_done && at(0.2) {
                coord_done = true;
                let _ = coord.kill();
                let _ = coord.wait();
                let job = job_id(&prefix)?;
                println!(
                    "chaos: {:>5.1}s killed the coordinator (-9); `batchfleet resume {job}`",
                    t.as_secs_f64()
                );
                coord = coordinator_cmd(&dir, &["resume", &job], "coordinator-2.log")?;
                report.coordinator_kills += 1;
            } else if !mq_done && at(0.4) {
                mq_done = true;
                println!("chaos: {:>5.1}s restarting RabbitMQ", t.as_secs_f64());
                services::restart_rabbitmq()?;
                report.rabbitmq_restarts += 1;
            } else if !redis_done && at(0.6) {
                redis_done = true;
                println!(
                    "chaos: {:>5.1}s restarting Redis ({})",
                    t.as_secs_f64(),
                    if cfg.redis_wipe {
                        "empty"
                    } else {
                        "from a snapshot"
                    }
                );
                services::restart_redis(!cfg.redis_wipe)?;
                report.redis_restarts += 1;
            } else if Instant::now() >= next_kill {
                next_kill = Instant::now() + cfg.kill_every;
                let slot = rng.usize(..fleet.workers.len());
                let w = &mut fleet.workers[slot];
                if kill9 {
                    let _ = w.kill();
                    let _ = w.wait();
                    report.worker_kill9 += 1;
                    println!(
                        "chaos: {:>5.1}s worker {slot}: kill -9, restarted",
                        t.as_secs_f64()
                    );
                } else {
                    signal(w, "TERM");
                    let clean = wait_or_kill(w, Duration::from_secs(30)) == Some(true);
                    report.worker_sigterm += 1;
                    report.worker_sigterm_clean += u32::from(clean);
                    println!(
                        "chaos: {:>5.1}s worker {slot}: SIGTERM, {}, restarted",
                        t.as_secs_f64(),
                        if clean {
                            "drained and exited 0"
                        } else {
                            "did NOT exit cleanly"
                        }
                    );
                }
                kill9 = !kill9;
                fleet.workers[slot] = fleet.spawn(slot)?;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        report.chaos_s = started.elapsed().as_secs_f64();
        fleet.stop();
        if !finished {
            bail!("the coordinator failed under faults; see {}", dir.display());
        }
        check(&dir, &pool, &mut report)?;
        Ok(())
    })();
    cleanup(&pool, &prefix);
    outcome?;
    print(&report);
    if cfg.dir.is_some() {
        std::fs::write(root.join("chaos.json"), serde_json::to_vec_pretty(&report)?)?;
    }
    Ok(report)
}

/// The id of the chaos job under `prefix` (keys `<prefix>:job:<id>[:…]`).
fn job_id(prefix: &str) -> Result<String> {
    let out = Command::new("redis-cli")
        .args([
            "-h",
            "127.0.0.1",
            "--scan",
            "--pattern",
            &format!("{prefix}:job:chaos-*"),
        ])
        .output()
        .context("running redis-cli")?;
    let keys = String::from_utf8_lossy(&out.stdout);
    let head = format!("{prefix}:job:");
    let mut ids: Vec<&str> = keys
        .lines()
        .filter_map(|k| k.strip_prefix(head.as_str()))
        .map(|rest| rest.split(':').next().unwrap_or(rest))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    match ids.as_slice() {
        [id] => Ok((*id).to_owned()),
        other => bail!("expected one chaos job under {prefix}, found {other:?}"),
    }
}

/// INV-ROWS, INV-ACCT and INV-FILES on the finished chaos job.
fn check(dir: &Path, pool: &str, report: &mut ChaosReport) -> Result<()> {
    let out = dir.join("out");
    let summary: serde_json::Value = serde_json::from_slice(
        &std::fs::read(out.join("summary.json")).context("reading summary.json")?,
    )?;
    let num = |k: &str| {
        summary
            .get(k)
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
    };
    report.items_redelivered = num("deliveries").saturating_sub(num("items_total"));
    report.items_redispatched = num("items_redispatched");
    report.rows_recomputed = num("rows_computed").saturating_sub(num("rows_total"));
    report.rows_resumed = num("rows_resumed");
    let v = &mut report.violations;

    // INV-ROWS: every input row exactly once, scores as PyTorch computes them.
    let verification = batchfleet_loadtest::verify::verify(&out, &dir.join("golden.csv"), 1e-5)?;
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
    if num("rows_predicted") + num("rows_rejected") != report.rows {
        v.push(format!(
            "INV-ACCT: summary counts {} + {} rows of {}",
            num("rows_predicted"),
            num("rows_rejected"),
            report.rows
        ));
    }
    for (queue, ready) in queue_depths(pool)? {
        if ready > 0 {
            v.push(format!("INV-ACCT: {queue} still holds {ready} message(s)"));
        }
    }
    // INV-FILES: no temp file outside staging (and staging empty), _SUCCESS iff completed.
    let completed = summary.get("status").and_then(|s| s.as_str()) == Some("completed");
    if completed != out.join("_SUCCESS").is_file() {
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
            || rel.starts_with("rejects/part-")
            || matches!(name.as_str(), "_SUCCESS" | "_JOB" | "summary.json");
        if !known {
            v.push(format!("INV-FILES: unexpected file {rel}"));
        }
    }
    Ok(())
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

/// Ready messages in each of the pool's queues (work, retry tiers, dead).
fn queue_depths(pool: &str) -> Result<Vec<(String, u32)>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let url = services::amqp_url();
        let conn =
            batchfleet_shared::broker::connect(&url, "batchfleet-chaos", Duration::from_secs(30))
                .await?;
        let ch = conn.create_channel().await?;
        let mut depths = Vec::new();
        for q in batchfleet_shared::broker::PoolQueues::new(pool).all() {
            depths.push((
                q.clone(),
                batchfleet_shared::broker::ready_count(&ch, &q).await?,
            ));
        }
        let _ = conn.close(200, "bye".into()).await;
        Ok(depths)
    })
}

/// Deletes the run's queues and Redis keys.
fn cleanup(pool: &str, prefix: &str) {
    services::delete_pool_queues(pool);
    services::delete_redis_prefix(prefix);
}

fn print(r: &ChaosReport) {
    println!("\nchaos run: {} rows in {} items", r.rows, r.items);
    println!(
        "  faults     {} kill -9, {} SIGTERM ({} drained cleanly), {} coordinator kill, {} RabbitMQ restart, {} Redis restart",
        r.worker_kill9, r.worker_sigterm, r.worker_sigterm_clean, r.coordinator_kills, r.rabbitmq_restarts, r.redis_restarts
    );
    println!(
        "  redone     {} item deliveries beyond one per item, {} items published again by the coordinator",
        r.items_redelivered, r.items_redispatched
    );
    println!(
        "  rows       {} recomputed ({:.1}% of the job), {} skipped thanks to checkpoints",
        r.rows_recomputed,
        100.0 * r.rows_recomputed as f64 / r.rows.max(1) as f64,
        r.rows_resumed
    );
    if r.redis_wiped {
        println!(
            "  (Redis was restarted empty: the work counters above only cover the time after it)"
        );
    }
    println!(
        "  wall time  {:.1}s under faults vs {:.1}s without (×{:.2})",
        r.chaos_s,
        r.baseline_s,
        r.chaos_s / r.baseline_s.max(1e-9)
    );
    if r.violations.is_empty() {
        println!("  invariants INV-ROWS, INV-ACCT, INV-FILES hold");
    } else {
        for v in &r.violations {
            println!("  VIOLATED   {v}");
        }
    }
}
