//! `batchfleet-loadtest slurm`: a job through the Slurm templates of
//! `docker/slurm/` on a single-node Slurm cluster of the run's own — MUNGE,
//! slurmctld and slurmd from Debian's packages as this run's processes,
//! their configuration, state and sockets in its folder, loopback only, two
//! GPUs played by character devices so that each task gets its own
//! `CUDA_VISIBLE_DEVICES`.
//!
//! The workers are `worker-gpu.sbatch` with two array tasks; the
//! coordinator is `coordinator.sbatch`, submitted with
//! `--dependency=after:<workers>`, which cancels the workers when the job
//! ends. While the job runs:
//!
//! * one task reaches its time limit: its limit is cut to a minute or two
//!   ahead, so Slurm sends the template's `--signal=B:TERM@60` to its batch
//!   script; the worker drains, exits 0 and the task is requeued;
//! * the other task is preempted with `scancel --signal=TERM`: the worker
//!   drains, exits 0 and the task is requeued;
//! * the fleet grows: a second array of `worker-cpu.sbatch` with one task
//!   at a time (`%1`), then its throttle raised with `scontrol update
//!   ArrayTaskThrottle=2`;
//! * a job of a higher-priority partition asks for a GPU while both are
//!   taken: Slurm preempts a GPU task (`PreemptMode=REQUEUE`), its worker
//!   drains, and Slurm requeues it.
//!
//! A requeued task waits about two minutes (Slurm's requeue delay, reason
//! `BeginTime`); the run starts it at once with `scontrol update
//! StartTime=now`, as an operator can. Checked at the end: every row
//! exactly once and equal to PyTorch's (INV-ROWS, INV-ACCT, INV-FILES),
//! nothing dead-lettered, both requeued tasks back and consuming while the
//! job still ran, every worker stop a drain with exit 0, the two GPU tasks
//! on different devices with `--threads` from `--cpus-per-task`, the
//! coordinator's Slurm job COMPLETED with exit 0, the workers' job
//! cancelled, `batchfleet status` naming both runs of each GPU task, and,
//! once the daemons are stopped by their pids, none of them or of the
//! job's processes left. Where the local MariaDB answers, slurmdbd keeps
//! accounting in a database of the run's own and `sacct --duplicates` is
//! checked too: each GPU task's REQUEUED run, every worker step COMPLETED
//! 0:0, nothing FAILED.

use crate::chaos;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::nodes::{free_port, wait_listening};
use batchfleet_testkit::python::repo_root;
use batchfleet_testkit::services;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Settings of a Slurm run.
#[derive(Debug, Clone)]
pub struct SlurmConfig {
    /// Rows in the job.
    pub rows: u64,
    /// Rows per item.
    pub item_rows: u64,
    /// Rows per mini-batch.
    pub batch_size: u32,
    /// Artificial delay per mini-batch on every worker (a heavier model:
    /// the job lasts through the faults).
    pub batch_delay: Duration,
    /// Give up after this long (the run fails).
    pub timeout: Duration,
    /// Work folder (a temporary one if `None`), kept with logs if given.
    pub dir: Option<PathBuf>,
}

/// What a run saw.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SlurmReport {
    /// `slurmctld -V`.
    pub slurm: String,
    /// Rows in the job.
    pub rows: u64,
    /// Items in the job.
    pub items: u64,
    /// The workers' array job (worker-gpu.sbatch, two tasks).
    pub worker_job: String,
    /// The coordinator's job (coordinator.sbatch).
    pub coordinator_job: String,
    /// The second array (worker-cpu.sbatch) that grew the fleet.
    pub scale_job: String,
    /// `CUDA_VISIBLE_DEVICES` each GPU task started with.
    pub visible_devices: Vec<String>,
    /// The libtorch threads each GPU worker logged (from --cpus-per-task).
    pub worker_threads: Vec<String>,
    /// The task whose time limit was cut.
    pub time_limited_task: String,
    /// From cutting its limit to the TERM of `--signal=B:TERM@60` (s).
    pub time_signal_after_s: f64,
    /// From cutting its limit to the task back in the queue (s).
    pub time_limited_requeued_after_s: f64,
    /// The task preempted with `scancel --signal=TERM`.
    pub preempted_task: String,
    /// From the signal to the task back in the queue: the drain (s).
    pub preempt_requeued_after_s: f64,
    /// Items committed when the task was preempted.
    pub preempted_at_items: u64,
    /// The GPU task Slurm preempted (PreemptMode=REQUEUE) for a job of a
    /// higher-priority partition, and requeued.
    pub priority_preempted_task: String,
    /// From the urgent job's submission to that task back in the queue (s).
    pub priority_requeued_after_s: f64,
    /// How the urgent job ended.
    pub urgent_state: String,
    /// Tasks of the second array running while the job ran (after the
    /// throttle was raised).
    pub scaled_tasks_running: u32,
    /// Wall time of the job, the coordinator's Slurm job start to end (s).
    pub job_s: f64,
    /// The coordinator job's state and exit code at the end.
    pub coordinator_state: String,
    /// The state of each worker task at the end.
    pub worker_states: Vec<String>,
    /// Each worker run's items committed, by worker id, as `batchfleet
    /// status` lists them.
    pub status_workers: Vec<(String, u64)>,
    /// Whether the cluster kept accounting (slurmdbd on the local MariaDB).
    pub accounting: bool,
    /// `sacct --duplicates` of the workers' and the coordinator's jobs:
    /// `JobID|State|ExitCode`, one line per run and step.
    pub sacct: Vec<String>,
    /// Worker stops seen in the task scripts' logs that drained and exited 0.
    pub drained_exits: u32,
    /// Item deliveries beyond one per item.
    pub items_redelivered: u64,
    /// Messages in the pool's dead-letter queue at the end.
    pub dead_lettered: u64,
    /// Invariant violations found (empty: all hold).
    pub violations: Vec<String>,
}

/// Runs the job through Slurm; prints and returns what it saw.
pub fn run(cfg: &SlurmConfig) -> Result<SlurmReport> {
    for program in [
        "munged",
        "slurmctld",
        "slurmd",
        "sbatch",
        "scontrol",
        "mknod",
    ] {
        if which(program).is_none() {
            bail!("{program} not found; `make slurm-test` installs Slurm and MUNGE from Debian's packages (slurm-wlm, munge), or run .ci/ensure-slurm.sh");
        }
    }
    if !is_root() {
        bail!("the Slurm run needs root: slurmd starts every task as its submitting user, and the GPU stand-ins are device nodes (mknod)");
    }
    services::ensure_local()?;
    let worker_bin = chaos::sibling("batchfleet-worker")?;
    let coordinator_bin = chaos::sibling("batchfleet")?;
    let (root, _tmp) = chaos::work_dir(cfg.dir.as_deref())?;
    let pool = services::unique("slurm");
    let prefix = services::unique("bfslurm");
    let mut report = SlurmReport {
        rows: cfg.rows,
        items: cfg.rows.div_ceil(cfg.item_rows),
        ..SlurmReport::default()
    };
    let started = Instant::now();
    let mut slurm = Slurm::start(&root.join("slurm"))?;
    report.slurm = slurm.version.clone();
    println!(
        "slurm: {} (slurmctld pid {}, slurmd pid {}, munged pid {}) up after {:.1}s",
        slurm.version,
        slurm.ctld.0.id(),
        slurm.slurmd.0.id(),
        slurm.munged.0.id(),
        started.elapsed().as_secs_f64()
    );
    let outcome = run_job(
        cfg,
        &slurm,
        &root,
        &pool,
        &prefix,
        &worker_bin,
        &coordinator_bin,
        &mut report,
    );
    let stopped = slurm.stop(&root);
    services::delete_redis_prefix(&prefix);
    services::delete_pool_queues(&pool);
    if let (Err(_), Err(e)) = (&outcome, &stopped) {
        eprintln!("slurm: and stopping the cluster: {e:#}");
    }
    outcome?;
    if let Err(e) = stopped {
        report.violations.push(format!("{e:#}"));
    }
    print(&report);
    chaos::keep_report(cfg.dir.as_deref(), &root, "slurm.json", &report)?;
    Ok(report)
}

#[allow(clippy::too_many_arguments)]
fn run_job(
    cfg: &SlurmConfig,
    slurm: &Slurm,
    root: &Path,
    pool: &str,
    prefix: &str,
    worker_bin: &Path,
    coordinator_bin: &Path,
    report: &mut SlurmReport,
) -> Result<()> {
    let job_dir = root.join("job");
    chaos::fault_job(
        &job_dir,
        "slurm",
        pool,
        cfg.rows,
        cfg.item_rows,
        cfg.batch_size,
        2,
    )?;
    // What a site installs on its shared file system: the binaries and the
    // task script in one bin/, the secrets as files, one environment file.
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin)?;
    let templates = repo_root().join("docker/slurm");
    for (name, target) in [
        ("batchfleet", coordinator_bin.to_owned()),
        ("batchfleet-worker", worker_bin.to_owned()),
        (
            "batchfleet-slurm-task",
            templates.join("batchfleet-slurm-task"),
        ),
    ] {
        let link = bin.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link)?;
    }
    let secrets = root.join("secrets");
    std::fs::create_dir_all(&secrets)?;
    let secret = |name: &str, value: &str| -> Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let path = secrets.join(name);
        std::fs::write(&path, value)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400))?;
        Ok(path)
    };
    let amqp = secret("amqp-url", services::amqp().url.expose())?;
    let redis = secret("redis-url", "redis://127.0.0.1:6379/")?;
    let key = secret("signing-key", chaos::CHAOS_KEY)?;
    let env = [
        ("BATCHFLEET_BIN", bin.display().to_string()),
        ("BATCHFLEET_DATA_ROOTS", root.display().to_string()),
        ("BATCHFLEET_AMQP_URL_FILE", amqp.display().to_string()),
        ("BATCHFLEET_REDIS_URL_FILE", redis.display().to_string()),
        ("BATCHFLEET_SIGNING_KEY_FILE", key.display().to_string()),
        ("BATCHFLEET_POOL", pool.to_owned()),
        ("BATCHFLEET_REDIS_PREFIX", prefix.to_owned()),
        // A fault run's worker settings (chaos::fault_worker_args).
        ("BATCHFLEET_PREFETCH", "1".to_owned()),
        ("BATCHFLEET_HEARTBEAT", "1s".to_owned()),
        ("BATCHFLEET_LEASE_TTL", "6s".to_owned()),
        ("BATCHFLEET_CONNECT_TIMEOUT", "2m".to_owned()),
        (
            "BATCHFLEET_DEBUG_BATCH_DELAY",
            format!("{}ms", cfg.batch_delay.as_millis()),
        ),
    ];
    let env_text: String = env.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    std::fs::write(root.join("batchfleet.env"), env_text)?;
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs)?;
    let sbatch = |args: &[&str]| -> Result<String> {
        let out = slurm.run_in(root, "sbatch", &[&["--parsable"], args].concat())?;
        Ok(out.trim().split(';').next().unwrap_or_default().to_owned())
    };
    let gpu = templates.join("worker-gpu.sbatch");
    let gpu = gpu.to_str().context("template path")?;

    // Two GPU workers, then the coordinator once they run.
    let workers = sbatch(&["--array=0-1", "--cpus-per-task=2", gpu])?;
    report.worker_job = workers.clone();
    let tasks = [format!("{workers}_0"), format!("{workers}_1")];
    println!("slurm: workers {workers} (worker-gpu.sbatch, 2 tasks)");
    for t in &tasks {
        slurm.wait_state(t, "RUNNING", Duration::from_secs(60))?;
    }
    let manifest = job_dir.join("job.toml");
    let coordinator = sbatch(&[
        &format!("--dependency=after:{workers}"),
        templates
            .join("coordinator.sbatch")
            .to_str()
            .context("template path")?,
        manifest.to_str().context("manifest path")?,
        &workers,
    ])?;
    report.coordinator_job = coordinator.clone();
    slurm.wait_state(&coordinator, "RUNNING", Duration::from_secs(60))?;
    let job_started = Instant::now();
    println!("slurm: coordinator {coordinator} (coordinator.sbatch, --dependency=after:{workers}) running");
    let out_dir = job_dir.join("out");
    let committed = || count_parts(&out_dir);
    let running = |what: &str| -> Result<()> {
        if slurm.job(&coordinator)?.get("JobState").map(String::as_str) != Some("RUNNING") {
            bail!("the job ended before {what}; give it more rows or a longer --batch-delay");
        }
        Ok(())
    };

    // Task 0 reaches its time limit: its limit cut to end 100–160 s from
    // now, more than the template's 60 s signal offset plus Slurm's 30 s
    // check interval, so the TERM comes at a check within about a minute
    // and the drain ends well before the limit.
    let limited = &tasks[0];
    let elapsed = slurm.run_seconds(limited)?;
    let minutes = (elapsed + 100).div_ceil(60);
    let cut = Instant::now();
    let cut_at = std::time::SystemTime::now();
    slurm.run(
        "scontrol",
        &[
            "update",
            &format!("JobId={limited}"),
            &format!("TimeLimit={minutes}"),
        ],
    )?;
    report.time_limited_task = limited.clone();
    println!("slurm: {limited}'s time limit cut to {minutes} min ({elapsed}s run so far)");

    // Task 1 preempted once a tenth of the items are in.
    wait_for(cfg.timeout, || {
        Ok(committed() * 10 >= report.items || !is_running(slurm, &coordinator))
    })?;
    running("the preemption")?;
    let preempted = &tasks[1];
    report.preempted_task = preempted.clone();
    report.preempted_at_items = committed();
    let signalled = Instant::now();
    slurm.run("scancel", &["--signal=TERM", preempted])?;
    println!(
        "slurm: {preempted} preempted (scancel --signal=TERM) at {} of {} items",
        report.preempted_at_items, report.items
    );
    slurm.wait_requeued(preempted, Duration::from_secs(90))?;
    report.preempt_requeued_after_s = signalled.elapsed().as_secs_f64();
    slurm.start_now(preempted, &[])?;
    wait_for(Duration::from_secs(60), || {
        Ok(consuming(&logs, preempted, 1) || !is_running(slurm, &coordinator))
    })?;
    running("the preempted task came back")?;
    println!(
        "slurm: {preempted} drained and was requeued {:.1}s after the signal, running again",
        report.preempt_requeued_after_s
    );

    // More workers: a second array, one task at a time, then two.
    let cpu = templates.join("worker-cpu.sbatch");
    let scale = sbatch(&[
        "--array=0-1%1",
        "--cpus-per-task=1",
        cpu.to_str().context("template path")?,
    ])?;
    report.scale_job = scale.clone();
    slurm.wait_state(&format!("{scale}_0"), "RUNNING", Duration::from_secs(60))?;
    slurm.run(
        "scontrol",
        &["update", &format!("JobId={scale}"), "ArrayTaskThrottle=2"],
    )?;
    slurm.wait_state(&format!("{scale}_1"), "RUNNING", Duration::from_secs(60))?;
    running("the fleet grew")?;
    report.scaled_tasks_running = 2;
    println!("slurm: fleet grown by {scale} (worker-cpu.sbatch, %1 then ArrayTaskThrottle=2)");

    // The time-limited task: signalled, drained, requeued; started again
    // without the cut limit.
    slurm.wait_requeued(limited, Duration::from_secs(180))?;
    report.time_limited_requeued_after_s = cut.elapsed().as_secs_f64();
    slurm.start_now(limited, &["TimeLimit=UNLIMITED"])?;
    wait_for(Duration::from_secs(60), || {
        Ok(consuming(&logs, limited, 1) || !is_running(slurm, &coordinator))
    })?;
    running("the time-limited task came back")?;
    let batch_log = std::fs::read_to_string(logs.join(format!("batchfleet-worker-{limited}.out")))
        .unwrap_or_default();
    report.time_signal_after_s = batch_log
        .lines()
        .find(|l| l.contains("SIGTERM for job"))
        .and_then(log_time)
        .and_then(|at| at.duration_since(cut_at).ok())
        .map_or(-1.0, |d| d.as_secs_f64());
    println!(
        "slurm: {limited} signalled {:.0}s after its limit was cut, requeued after {:.0}s, running again",
        report.time_signal_after_s, report.time_limited_requeued_after_s
    );

    // A real preemption: a job of the higher-priority partition wants a
    // GPU while both are taken; Slurm (PreemptMode=REQUEUE) signals one
    // GPU task, which drains, and requeues it itself.
    let urgent = sbatch(&[
        "--partition=urgent",
        "--gpus=1",
        "--job-name=urgent",
        "--output=logs/urgent-%j.out",
        "--wrap=echo urgent job on GPU $CUDA_VISIBLE_DEVICES",
    ])?;
    let preempted_at = Instant::now();
    let mut by_slurm = None;
    wait_for(Duration::from_secs(90), || {
        by_slurm = tasks.iter().find(|t| slurm.requeued(t, 2)).cloned();
        Ok(by_slurm.is_some() || !is_running(slurm, &coordinator))
    })
    .with_context(|| {
        format!(
            "no GPU task was preempted for {urgent}: {:?}",
            tasks.iter().map(|t| slurm.job(t).ok()).collect::<Vec<_>>()
        )
    })?;
    running("the preemption by a higher-priority job")?;
    let by_slurm = by_slurm.context("preempted task")?;
    report.priority_preempted_task = by_slurm.clone();
    report.priority_requeued_after_s = preempted_at.elapsed().as_secs_f64();
    slurm.wait_gone(&urgent, Duration::from_secs(60))?;
    report.urgent_state = slurm
        .job(&urgent)?
        .get("JobState")
        .cloned()
        .unwrap_or_default();
    slurm.start_now(&by_slurm, &[])?;
    wait_for(Duration::from_secs(60), || {
        Ok(consuming(&logs, &by_slurm, 2) || !is_running(slurm, &coordinator))
    })?;
    running("the task preempted by Slurm came back")?;
    println!(
        "slurm: {by_slurm} preempted by {urgent} (partition urgent), requeued by Slurm after {:.1}s, running again",
        report.priority_requeued_after_s
    );

    // The job's end: the coordinator exits, its template cancels the workers.
    let left = cfg.timeout.saturating_sub(job_started.elapsed());
    slurm.wait_gone(&coordinator, left)?;
    report.job_s = job_started.elapsed().as_secs_f64();
    let c = slurm.job(&coordinator)?;
    report.coordinator_state = format!(
        "{} {}",
        c.get("JobState").cloned().unwrap_or_default(),
        c.get("ExitCode").cloned().unwrap_or_default()
    );
    for t in &tasks {
        slurm.wait_gone(t, Duration::from_secs(60))?;
        let j = slurm.job(t)?;
        report.worker_states.push(format!(
            "{t} {} restarts={}",
            j.get("JobState").cloned().unwrap_or_default(),
            j.get("Restarts").cloned().unwrap_or_default()
        ));
    }
    // What `batchfleet status` says of the workers: each Slurm task and
    // run by its id.
    let job_id = std::fs::read_to_string(out_dir.join(batchfleet_shared::output::OWNER_FILE))?;
    let status = Command::new(coordinator_bin)
        .args(["status", job_id.trim(), "--json"])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()?;
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).with_context(|| {
        format!(
            "batchfleet status: {}",
            String::from_utf8_lossy(&status.stderr)
        )
    })?;
    for w in status["workers"].as_array().into_iter().flatten() {
        report.status_workers.push((
            w["worker"].as_str().unwrap_or_default().to_owned(),
            w["items"].as_u64().unwrap_or(0),
        ));
    }
    report.status_workers.sort();
    slurm.run("scancel", &[&scale])?;
    if slurm.dbd.is_some() {
        report.accounting = true;
        let jobs = format!("{workers},{coordinator},{scale}");
        // slurmctld hands records to slurmdbd as jobs end: wait for each
        // job's last run (an earlier, requeued run does not count).
        wait_for(Duration::from_secs(60), || {
            report.sacct = slurm
                .run(
                    "sacct",
                    &[
                        "-j",
                        &jobs,
                        "--duplicates",
                        "--parsable2",
                        "--noheader",
                        "--format=JobID,State,ExitCode",
                    ],
                )?
                .lines()
                .map(str::to_owned)
                .collect();
            let ended = |job: &str| {
                report.sacct.iter().any(|l| {
                    l.starts_with(&format!("{job}|"))
                        && !l.contains("|RUNNING|")
                        && !l.contains("|PENDING|")
                        && !l.contains("|REQUEUED|")
                        && !l.contains("|PREEMPTED|")
                })
            };
            Ok(ended(&coordinator)
                && tasks.iter().all(|t| ended(t))
                && ended(&format!("{scale}_0"))
                && ended(&format!("{scale}_1")))
        })
        .with_context(|| format!("sacct never showed the jobs' ends: {:?}", report.sacct))?;
    }
    for t in [format!("{scale}_0"), format!("{scale}_1")] {
        slurm.wait_gone(&t, Duration::from_secs(60))?;
    }
    check(cfg, &job_dir, &logs, pool, &tasks, report)
}

#[allow(clippy::too_many_arguments)]
fn check(
    cfg: &SlurmConfig,
    job_dir: &Path,
    logs: &Path,
    pool: &str,
    tasks: &[String; 2],
    report: &mut SlurmReport,
) -> Result<()> {
    let mut v = Vec::new();
    let summary = chaos::job_invariants(job_dir, cfg.rows, &mut v)?;
    report.items_redelivered = chaos::summary_u64(&summary, "deliveries")
        .saturating_sub(chaos::summary_u64(&summary, "items_total"));
    let dead = batchfleet_shared::broker::PoolQueues::new(pool).dead();
    for (queue, ready) in chaos::queue_depths(&services::amqp(), pool)? {
        if queue == dead {
            report.dead_lettered = ready.into();
        } else if ready > 0 {
            v.push(format!("INV-ACCT: {queue} still holds {ready} message(s)"));
        }
    }
    if report.dead_lettered > 0 {
        v.push(format!("{} item(s) dead-lettered", report.dead_lettered));
    }
    if report.coordinator_state != "COMPLETED 0:0" {
        v.push(format!(
            "the coordinator's Slurm job ended {} (expected COMPLETED 0:0); see {}",
            report.coordinator_state,
            logs.display()
        ));
    }
    for (t, state) in tasks.iter().zip(&report.worker_states) {
        if !state.contains(" CANCELLED ") {
            v.push(format!(
                "worker task {t} ended as {state}, not cancelled by coordinator.sbatch"
            ));
        }
        let expected = if *t == report.priority_preempted_task {
            2
        } else {
            1
        };
        if !state.ends_with(&format!("restarts={expected}")) {
            v.push(format!(
                "worker task {t}: {state}, expected {expected} requeue(s)"
            ));
        }
    }
    // Each GPU task's first run and its run after the last requeue took
    // work, under their Slurm names.
    for t in tasks {
        let last = if *t == report.priority_preempted_task {
            2
        } else {
            1
        };
        for run in [0, last] {
            let id = format!("slurm-{t}.0.r{run}");
            let items = report
                .status_workers
                .iter()
                .find(|(w, _)| *w == id)
                .map_or(0, |(_, n)| *n);
            if items == 0 {
                v.push(format!(
                    "batchfleet status lists no item committed by {id}: {:?}",
                    report.status_workers
                ));
            }
        }
    }
    // Slurm's own record (sacct): the coordinator COMPLETED 0:0; each GPU
    // task a REQUEUED run, then CANCELLED; every worker step exit 0:0
    // (COMPLETED, or CANCELLED when its job's cancel was recorded before
    // the step ended), nothing FAILED or TIMEOUT.
    if report.accounting {
        let sacct = &report.sacct;
        let coordinator = format!("{}|COMPLETED|0:0", report.coordinator_job);
        if !sacct.contains(&coordinator) {
            v.push(format!("sacct has no {coordinator:?}: {sacct:?}"));
        }
        if !sacct
            .iter()
            .any(|l| l.starts_with(&format!("{}|PREEMPTED", report.priority_preempted_task)))
        {
            v.push(format!(
                "sacct shows no PREEMPTED run of {}: {sacct:?}",
                report.priority_preempted_task
            ));
        }
        for t in tasks {
            for state in ["REQUEUED", "CANCELLED"] {
                if !sacct.iter().any(|l| l.starts_with(&format!("{t}|{state}"))) {
                    v.push(format!("sacct shows no {state} run of {t}: {sacct:?}"));
                }
            }
        }
        for line in sacct {
            let mut f = line.split('|');
            let (id, state, code) = (
                f.next().unwrap_or(""),
                f.next().unwrap_or(""),
                f.next().unwrap_or(""),
            );
            if id.ends_with(".0") && (!["COMPLETED", "CANCELLED"].contains(&state) || code != "0:0")
            {
                v.push(format!(
                    "sacct: step {id} ended {state} {code}, not with exit 0:0"
                ));
            }
            if ["FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_ME"]
                .iter()
                .any(|bad| state.starts_with(bad))
            {
                v.push(format!("sacct: {line}"));
            }
        }
    }
    // Every worker stop in the task scripts' logs: a drain with exit 0.
    let mut devices = Vec::new();
    for entry in std::fs::read_dir(logs)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        for line in text.lines() {
            if line.contains("drained and exited 0") {
                report.drained_exits += 1;
            }
            if line.contains("; ending the job with that code") {
                v.push(format!("{name}: {line}"));
            }
            if line.contains("panicked") || line.contains(" ERROR ") {
                v.push(format!("{name}: {line}"));
            }
        }
        if name.ends_with(".out")
            && name.starts_with("batchfleet-worker-")
            && !name.contains("-cpu-")
        {
            if let Some(first) = text.lines().find(|l| l.contains(" starting on ")) {
                let cvd = first
                    .split("CUDA_VISIBLE_DEVICES=")
                    .nth(1)
                    .and_then(|r| r.split(')').next())
                    .unwrap_or("?")
                    .to_owned();
                devices.push((name.clone(), cvd));
            }
        }
    }
    devices.sort();
    report.visible_devices = devices.iter().map(|(_, d)| d.clone()).collect();
    let distinct: std::collections::BTreeSet<_> = report.visible_devices.iter().collect();
    if report.visible_devices.len() != 2
        || distinct.len() != 2
        || report
            .visible_devices
            .iter()
            .any(|d| d == "unset" || d == "?")
    {
        v.push(format!(
            "the GPU tasks' CUDA_VISIBLE_DEVICES were {:?}, not one device each",
            report.visible_devices
        ));
    }
    for t in tasks {
        let log = worker_log(logs, t);
        let threads = log
            .lines()
            .find(|l| l.contains("worker consuming"))
            .and_then(|l| l.split(" threads=").nth(1))
            .map(|r| r.split_whitespace().next().unwrap_or_default().to_owned())
            .unwrap_or_default();
        if threads != "2" {
            v.push(format!(
                "{t}: the worker ran with threads={threads:?}, not --cpus-per-task=2"
            ));
        }
        report.worker_threads.push(threads);
    }
    // Two requeues by the task script (time limit, preemption by signal)
    // and the end of four workers (two GPU tasks, two of the second
    // array): six drains logged by the task scripts.
    if report.urgent_state != "COMPLETED" {
        v.push(format!("the urgent job ended {}", report.urgent_state));
    }
    // Preempted by Slurm, the worker drains as well; its batch script may
    // be ended before it logs (Slurm holds the preempted job for KillWait),
    // so the worker's own log tells.
    if !stopped_cleanly(logs, &report.priority_preempted_task, 1) {
        v.push(format!(
            "the worker of {} (run r1) did not log a clean stop when Slurm preempted it",
            report.priority_preempted_task
        ));
    }
    if report.drained_exits < 6 {
        v.push(format!(
            "{} worker stop(s) logged as drained with exit 0, expected 6 (2 requeues, 4 at the end)",
            report.drained_exits
        ));
    }
    if report.time_signal_after_s < 0.0 {
        v.push(format!(
            "{}'s batch script never logged the --signal TERM",
            report.time_limited_task
        ));
    }
    report.violations.extend(v);
    Ok(())
}

/// Part files committed so far.
fn count_parts(out: &Path) -> u64 {
    std::fs::read_dir(out)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("part-"))
                .count() as u64
        })
        .unwrap_or(0)
}

/// The log of the worker of GPU task `task` (all its runs, appended).
fn worker_log(logs: &Path, task: &str) -> String {
    std::fs::read_to_string(logs.join(format!("batchfleet-worker-{task}.0.log")))
        .unwrap_or_default()
}

/// Whether the worker of `task`, in its run after `restarts` requeues,
/// logged that it consumes.
fn consuming(logs: &Path, task: &str, restarts: u32) -> bool {
    let log = worker_log(logs, task);
    let id = format!("slurm-{task}.0.r{restarts}");
    log.lines()
        .any(|l| l.contains("worker consuming") && l.contains(&id))
}

/// Whether the worker of `task`, in its run after `restarts` requeues,
/// logged a clean stop (drained, exit 0) before the next run started.
fn stopped_cleanly(logs: &Path, task: &str, restarts: u32) -> bool {
    let log = worker_log(logs, task);
    let id = format!("slurm-{task}.0.r{restarts}");
    log.lines()
        .skip_while(|l| !(l.contains("worker consuming") && l.contains(&id)))
        .skip(1)
        .take_while(|l| !l.contains("worker consuming"))
        .any(|l| l.contains("worker stopped cleanly"))
}

fn is_running(slurm: &Slurm, job: &str) -> bool {
    slurm
        .job(job)
        .map(|j| j.get("JobState").map(String::as_str) == Some("RUNNING"))
        .unwrap_or(false)
}

/// Polls `done` every 200 ms for up to `within` (Slurm's state is polled:
/// its commands are the only way to watch it).
fn wait_for(within: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + within;
    while !done()? {
        if Instant::now() > deadline {
            bail!("gave up after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// The time of a `batchfleet-slurm-task` log line (to the second).
fn log_time(line: &str) -> Option<std::time::SystemTime> {
    humantime::parse_rfc3339(line.split_whitespace().nth(1)?).ok()
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Processes of the run left running: those whose command line names
/// `root` or whose working folder is under it (the daemons, slurmstepd,
/// the task scripts and the workers), this process and its parents aside.
fn processes_under(root: &Path) -> Vec<String> {
    let needle = root.display().to_string();
    let mut ours = vec![std::process::id().to_string()];
    while let Some(parent) = std::fs::read_to_string(format!("/proc/{}/stat", ours[ours.len() - 1]))
        .ok()
        .and_then(|stat| {
            let after = stat.rsplit_once(')')?.1.to_owned();
            after.split_whitespace().nth(1).map(str::to_owned)
        })
        .filter(|p| p != "0" && !ours.contains(p))
    {
        ours.push(parent);
    }
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) || ours.contains(&pid) {
            continue;
        }
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let in_root =
            std::fs::read_link(entry.path().join("cwd")).is_ok_and(|cwd| cwd.starts_with(root));
        if !cmd.trim().is_empty() && (cmd.contains(&needle) || in_root) {
            found.push(format!("{pid}: {}", cmd.trim()));
        }
    }
    found
}

/// slurmdbd on the local MariaDB (user root, no password, a database of
/// the run's own), reached on `port`, the cluster registered in it.
fn start_dbd(
    dir: &Path,
    conf: &Path,
    socket: &Path,
    port: u16,
    log: &dyn Fn(&str) -> Result<Stdio>,
) -> Result<(Daemon, String)> {
    use std::os::unix::fs::PermissionsExt;
    let db = format!("batchfleet_slurm_{}", std::process::id());
    let d = dir.display();
    // Next to slurm.conf, private to its user: slurmdbd refuses it otherwise.
    let path = dir.join("slurmdbd.conf");
    std::fs::write(
        &path,
        format!(
            "AuthType=auth/munge
AuthInfo=socket={socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=root
StorageLoc={db}
PidFile={d}/run/slurmdbd.pid
LogFile={d}/log/slurmdbd.log
",
            socket = socket.display()
        ),
    )?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let child = Command::new("slurmdbd")
        .arg("-D")
        .env("SLURM_CONF", conf)
        .stdout(log("slurmdbd.out")?)
        .stderr(log("slurmdbd.err")?)
        .spawn()
        .context("starting slurmdbd")?;
    let mut dbd = (Daemon(child), db);
    let up = wait_listening(
        port,
        Duration::from_secs(60),
        "slurmdbd",
        &mut dbd.0 .0,
        &dir.join("log/slurmdbd.log"),
    );
    let registered = up.and_then(|()| {
        let out = Command::new("sacctmgr")
            .args(["-i", "add", "cluster", "batchfleet"])
            .env("SLURM_CONF", conf)
            .output()?;
        if !out.status.success() {
            bail!(
                "sacctmgr add cluster: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    });
    if let Err(e) = registered {
        drop_database(&dbd.1);
        return Err(e.context(format!(
            "slurmdbd did not come up; see {d}/log/slurmdbd.log"
        )));
    }
    Ok(dbd)
}

/// Drops the run's accounting database (best effort: needs the `mysql` client).
fn drop_database(db: &str) {
    let _ = Command::new("mysql")
        .args([
            "-uroot",
            "-h127.0.0.1",
            "-e",
            &format!("DROP DATABASE IF EXISTS `{db}`"),
        ])
        .output();
}

/// A daemon of the run, killed if dropped before [`Slurm::stop`] stopped it
/// (a start that failed half-way leaves nothing running).
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A single-node Slurm cluster of the run's own.
struct Slurm {
    conf: PathBuf,
    version: String,
    munged: Daemon,
    ctld: Daemon,
    slurmd: Daemon,
    /// slurmdbd and its database, when MariaDB answers: what `sacct` reads.
    dbd: Option<(Daemon, String)>,
}

impl Slurm {
    fn start(dir: &Path) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir)?;
        // munged refuses a socket below a folder others cannot enter (a
        // temporary folder is 0700).
        for d in [dir, dir.parent().unwrap_or(dir)] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        }
        for sub in ["state", "spool", "log", "run", "key", "dev"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        // munged wants its key private and its socket folder open to all.
        std::fs::set_permissions(dir.join("key"), std::fs::Permissions::from_mode(0o700))?;
        std::fs::set_permissions(dir.join("run"), std::fs::Permissions::from_mode(0o755))?;
        let key: Vec<u8> = (0..1024).map(|_| fastrand::u8(..)).collect();
        let key_file = dir.join("key/munge.key");
        std::fs::write(&key_file, key)?;
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o400))?;
        let socket = dir.join("run/munge.socket");
        let log = |name: &str| -> Result<Stdio> {
            Ok(Stdio::from(std::fs::File::create(
                dir.join("log").join(name),
            )?))
        };
        let munged = Command::new("munged")
            .arg("--foreground")
            .arg(format!("--key-file={}", key_file.display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(format!(
                "--pid-file={}",
                dir.join("run/munged.pid").display()
            ))
            .arg(format!(
                "--log-file={}",
                dir.join("log/munged.log").display()
            ))
            .arg(format!(
                "--seed-file={}",
                dir.join("key/munged.seed").display()
            ))
            .stdout(log("munged.out")?)
            .stderr(log("munged.err")?)
            .spawn()
            .map(Daemon)
            .context("starting munged")?;
        wait_for(Duration::from_secs(20), || Ok(socket.exists()))
            .context("munged did not create its socket; see its log")?;

        // Two GPUs played by character devices (/dev/null's numbers): Slurm
        // accepts only device files for a GPU, and numbers
        // CUDA_VISIBLE_DEVICES after them.
        for i in 0..2 {
            let dev = dir.join(format!("dev/nvidia{i}"));
            if !dev.exists() {
                let status = Command::new("mknod")
                    .arg(&dev)
                    .args(["c", "1", "3"])
                    .status()?;
                if !status.success() {
                    bail!("mknod {} failed", dev.display());
                }
            }
        }
        let host = String::from_utf8(Command::new("hostname").arg("-s").output()?.stdout)?
            .trim()
            .to_owned();
        let (ctld_port, node_port) = (free_port()?, free_port()?);
        let d = dir.display();
        // Accounting (slurmdbd on the local MariaDB), for sacct.
        let dbd_port = if services::listening("127.0.0.1:3306") && which("slurmdbd").is_some() {
            Some(free_port()?)
        } else {
            None
        };
        let accounting = match dbd_port {
            // AccountingStoragePass: the MUNGE socket to reach slurmdbd with.
            Some(port) => format!(
                "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\nAccountingStoragePort={port}\nAccountingStoragePass={}\n",
                socket.display()
            ),
            None => "AccountingStorageType=accounting_storage/none\n".to_owned(),
        };
        let conf = format!(
            "# A single-node cluster of batchfleet's Slurm run: loopback only.
ClusterName=batchfleet
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
{accounting}SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=3600
GresTypes=gpu
SlurmdParameters=config_overrides
NodeName=bfnode NodeHostname={host} NodeAddr=127.0.0.1 CPUs=16 RealMemory=64000 Gres=gpu:2 State=UNKNOWN
PartitionName=batch Nodes=bfnode Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=bfnode MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
",
            socket = socket.display(),
        );
        let conf_path = dir.join("slurm.conf");
        std::fs::write(&conf_path, conf)?;
        std::fs::write(
            dir.join("gres.conf"),
            format!("NodeName=bfnode Name=gpu File={d}/dev/nvidia[0-1]\n"),
        )?;
        let version =
            String::from_utf8_lossy(&Command::new("slurmctld").arg("-V").output()?.stdout)
                .trim()
                .to_owned();
        let dbd = match dbd_port {
            Some(port) => Some(start_dbd(dir, &conf_path, &socket, port, &log)?),
            None => {
                println!("slurm: no MariaDB at 127.0.0.1:3306 (or no slurmdbd): running without accounting, sacct not checked");
                None
            }
        };
        let ctld = Command::new("slurmctld")
            .args(["-D", "-i", "-f"])
            .arg(&conf_path)
            .env("SLURM_CONF", &conf_path)
            .stdout(log("slurmctld.out")?)
            .stderr(log("slurmctld.err")?)
            .spawn()
            .map(Daemon)
            .context("starting slurmctld")?;
        let slurmd = Command::new("slurmd")
            .args(["-D", "-N", "bfnode", "-f"])
            .arg(&conf_path)
            .env("SLURM_CONF", &conf_path)
            .stdout(log("slurmd.out")?)
            .stderr(log("slurmd.err")?)
            .spawn()
            .map(Daemon)
            .context("starting slurmd")?;
        let slurm = Self {
            conf: conf_path,
            version,
            munged,
            ctld,
            slurmd,
            dbd,
        };
        wait_for(Duration::from_secs(60), || {
            Ok(slurm
                .run("sinfo", &["-h", "-o", "%t"])
                .map(|s| s.trim() == "idle")
                .unwrap_or(false))
        })
        .with_context(|| format!("the node never came up idle; see {}/log", d))?;
        Ok(slurm)
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Runs a Slurm command; its stdout, or an error with its stderr.
    fn run(&self, program: &str, args: &[&str]) -> Result<String> {
        self.output(self.command(program).args(args), program, args)
    }

    /// [`Self::run`] from the folder `dir` (sbatch's submit folder).
    fn run_in(&self, dir: &Path, program: &str, args: &[&str]) -> Result<String> {
        self.output(
            self.command(program).args(args).current_dir(dir),
            program,
            args,
        )
    }

    fn output(&self, c: &mut Command, program: &str, args: &[&str]) -> Result<String> {
        let out = c.output().with_context(|| format!("running {program}"))?;
        if !out.status.success() {
            bail!(
                "{program} {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `scontrol show job -o JOB` as its fields (one job, or an array task).
    fn job(&self, job: &str) -> Result<HashMap<String, String>> {
        let out = self.run("scontrol", &["show", "job", "-o", job])?;
        let line = out.lines().next().unwrap_or_default();
        Ok(line
            .split_whitespace()
            .filter_map(|f| f.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect())
    }

    /// Waits for `job` to be in `state`. A pending array's tasks have no
    /// record of their own until they are split off to start: until then
    /// `scontrol` does not know them, and that counts as not yet.
    fn wait_state(&self, job: &str, state: &str, within: Duration) -> Result<()> {
        wait_for(within, || {
            Ok(self
                .job(job)
                .is_ok_and(|j| j.get("JobState").map(String::as_str) == Some(state)))
        })
        .with_context(|| format!("{job} never reached {state}: {:?}", self.job(job).ok()))
    }

    /// Waits for `job` to be back in the queue after a requeue.
    fn wait_requeued(&self, job: &str, within: Duration) -> Result<()> {
        wait_for(within, || Ok(self.requeued(job, 1)))
            .with_context(|| format!("{job} was not requeued: {:?}", self.job(job).ok()))
    }

    /// Whether `job` waits in the queue after its `restarts`th requeue.
    fn requeued(&self, job: &str, restarts: u32) -> bool {
        self.job(job).is_ok_and(|j| {
            j.get("Restarts") == Some(&restarts.to_string())
                && j.get("JobState").map(String::as_str) == Some("PENDING")
        })
    }

    /// Starts a just requeued `job` without Slurm's requeue delay
    /// (`scontrol update StartTime=now`, with `settings` besides) and waits
    /// until it runs. The delay is set when the requeue has finished (reason
    /// `BeginTime`); an update before that is overwritten, so it is made
    /// (again) whenever the job waits for its begin time. Not within 2 s of
    /// the requeue: slurmd refuses (exit 1, the job FAILED) a launch whose
    /// credential is from the second in which the previous run's was
    /// revoked — the reason for Slurm's own delay — so this is a wait on
    /// Slurm's clock, not on an event.
    fn start_now(&self, job: &str, settings: &[&str]) -> Result<()> {
        let id = format!("JobId={job}");
        let earliest = Instant::now() + Duration::from_secs(2);
        wait_for(Duration::from_secs(90), || {
            let j = self.job(job)?;
            match (
                j.get("JobState").map(String::as_str),
                j.get("Reason").map(String::as_str),
            ) {
                (Some("RUNNING"), _) => return Ok(true),
                (Some("PENDING"), Some("BeginTime")) if Instant::now() >= earliest => {
                    self.run(
                        "scontrol",
                        &[&["update", &id], settings, &["StartTime=now"]].concat(),
                    )?;
                }
                (Some("PENDING" | "REQUEUED" | "COMPLETING" | "CONFIGURING") | None, _) => {}
                (Some(state), _) => bail!("{job} ended {state} instead of starting again"),
            }
            Ok(false)
        })
        .with_context(|| format!("{job} did not start again: {:?}", self.job(job).ok()))
    }

    /// Waits until `job` has ended (neither pending, running nor completing).
    fn wait_gone(&self, job: &str, within: Duration) -> Result<()> {
        wait_for(within, || {
            let j = self.job(job)?;
            Ok(!matches!(
                j.get("JobState").map(String::as_str),
                Some("PENDING" | "RUNNING" | "COMPLETING" | "REQUEUED" | "CONFIGURING")
            ))
        })
        .with_context(|| format!("{job} did not end: {:?}", self.job(job).ok()))
    }

    /// Seconds `job` has run.
    fn run_seconds(&self, job: &str) -> Result<u64> {
        let j = self.job(job)?;
        let t = j.get("RunTime").context("RunTime")?;
        let (days, hms) = t.split_once('-').unwrap_or(("0", t));
        let mut secs: u64 = days.parse::<u64>().unwrap_or(0) * 86_400;
        for part in hms.split(':') {
            secs = secs * 60 + part.parse::<u64>().unwrap_or(0);
        }
        Ok(secs)
    }

    /// Cancels whatever is left, stops slurmd, slurmctld and munged by
    /// their pids and checks that none of them, nor any process of the
    /// run's jobs, is left.
    fn stop(&mut self, root: &Path) -> Result<()> {
        // Every job left, by its own id or its array's (a pending array's
        // tasks are listed as `ID_[0-1%1]`, which scancel does not take).
        let queued = || -> Vec<String> {
            let ids = self.run("squeue", &["-h", "-o", "%F"]).unwrap_or_default();
            let mut ids: Vec<String> = ids.split_whitespace().map(str::to_owned).collect();
            ids.sort();
            ids.dedup();
            ids
        };
        let mut left = Vec::new();
        for id in queued() {
            let _ = self.run("scancel", &[&id]);
        }
        if wait_for(Duration::from_secs(60), || Ok(queued().is_empty())).is_err() {
            left.push(format!("jobs still queued after scancel: {:?}", queued()));
        }
        let mut daemons = vec![
            ("slurmd", &mut self.slurmd.0),
            ("slurmctld", &mut self.ctld.0),
        ];
        let mut db = None;
        if let Some((daemon, name)) = self.dbd.as_mut() {
            daemons.push(("slurmdbd", &mut daemon.0));
            db = Some(name.clone());
        }
        daemons.push(("munged", &mut self.munged.0));
        for (name, child) in daemons {
            chaos::signal(child, "TERM");
            if chaos::wait_or_kill(child, Duration::from_secs(30)).is_none() {
                left.push(format!(
                    "{name} (pid {}) ignored SIGTERM for 30 s",
                    child.id()
                ));
            }
            if Path::new(&format!("/proc/{}", child.id())).exists()
                && std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
                    .map(|s| !s.contains(") Z "))
                    .unwrap_or(false)
            {
                left.push(format!("{name} (pid {}) still running", child.id()));
            }
        }
        if let Some(db) = db {
            drop_database(&db);
        }
        let stray = processes_under(root);
        for p in &stray {
            if let Some(pid) = p.split(':').next() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
        left.extend(stray);
        if !left.is_empty() {
            bail!("after stopping the daemons: {left:?}");
        }
        println!("slurm: the daemons stopped by their pids; no process of the run left");
        Ok(())
    }
}

fn print(r: &SlurmReport) {
    println!("== slurm run ({})", r.slurm);
    println!(
        "job: {} rows in {} items, {:.1}s from the coordinator's start (Slurm job {}: {})",
        r.rows, r.items, r.job_s, r.coordinator_job, r.coordinator_state
    );
    println!(
        "workers {}: CUDA_VISIBLE_DEVICES {:?}, threads {:?}; {}",
        r.worker_job,
        r.visible_devices,
        r.worker_threads,
        r.worker_states.join(", ")
    );
    println!(
        "time limit: {} got TERM {:.0}s after its limit was cut, back in the queue after {:.0}s",
        r.time_limited_task, r.time_signal_after_s, r.time_limited_requeued_after_s
    );
    println!(
        "preemption: {} at {} items, drained and requeued {:.1}s after scancel --signal=TERM",
        r.preempted_task, r.preempted_at_items, r.preempt_requeued_after_s
    );
    println!(
        "preemption by Slurm: {} requeued {:.1}s after the urgent job's submission (urgent job {})",
        r.priority_preempted_task, r.priority_requeued_after_s, r.urgent_state
    );
    println!(
        "scaled: {} ({} tasks running); {} drained exits 0; {} redelivered, {} dead-lettered",
        r.scale_job, r.scaled_tasks_running, r.drained_exits, r.items_redelivered, r.dead_lettered
    );
    println!(
        "batchfleet status, items by worker: {}",
        r.status_workers
            .iter()
            .map(|(w, n)| format!("{w} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if r.accounting {
        println!("sacct --duplicates: {}", r.sacct.join("  "));
    }
    if r.violations.is_empty() {
        println!("all invariants hold");
    } else {
        for v in &r.violations {
            println!("VIOLATION {v}");
        }
    }
}
