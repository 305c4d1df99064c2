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
//! After that job, a second one on a pool of its own whose item 2 kills
//! every worker that runs it (the worker aborts), through a two-task array
//! of `worker-cpu.sbatch`: the task script restarts each dead worker in its
//! allocation, the item is recorded failed as `crash` once `max_crashes`
//! (2) workers died on it, and the job ends without it while both tasks
//! still run.
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

//!
//! # Layout
//! - this file: the run — the cluster started, the job run, the checks,
//!   the cluster stopped — and its report.
//! - [`cluster`]: the Slurm daemons of the run's own and the commands it uses.
//! - [`job`]: the job and its faults, phase by phase.
//! - [`check`]: what must hold at the end.

mod check;
mod cluster;
mod job;

use crate::fault;
use anyhow::{bail, Result};
use batchfleet_testkit::services;
use cluster::{is_root, which, Slurm};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Settings of a Slurm run.
#[derive(Debug, Clone, clap::Args)]
pub struct SlurmConfig {
    /// Rows in the job.
    #[arg(long, default_value_t = 200_000)]
    pub rows: u64,
    /// Rows per work item.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub item_rows: u64,
    /// Rows per mini-batch.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: u32,
    /// Artificial delay per mini-batch on every worker (plays a heavier
    /// model, so the job lasts through the time limit's signal, which
    /// Slurm sends on a 30 s check).
    #[arg(long, default_value = "600ms", value_parser = humantime::parse_duration)]
    pub batch_delay: Duration,
    /// Fail if the job has not finished after this long.
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Keep data, logs, Slurm's files and slurm.json here (default: a temporary folder).
    #[arg(long)]
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
    /// The task whose worker was killed with SIGKILL mid-job.
    pub crashed_task: String,
    /// From the SIGKILL to the restarted worker consuming again in the same
    /// allocation (s).
    pub crash_restarted_after_s: f64,
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
    /// The array of the crashing-item job (worker-cpu.sbatch, two tasks on
    /// a pool of its own).
    pub crash_job: String,
    /// Its workers that died on the crashing item and were restarted in
    /// place by the task script.
    pub crash_restarts: u32,
    /// Each of its tasks' state once its job had ended (RUNNING expected).
    pub crash_task_states: Vec<String>,
    /// The crashing job's coordinator exit code (3 expected).
    pub crash_job_exit: Option<i32>,
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
    let worker_bin = fault::sibling("batchfleet-worker")?;
    let coordinator_bin = fault::sibling("batchfleet")?;
    let (root, _tmp) = fault::work_dir(cfg.dir.as_deref())?;
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
    let outcome = job::JobRun::install(
        cfg,
        &slurm,
        &root,
        &pool,
        &prefix,
        (&worker_bin, &coordinator_bin),
    )
    .and_then(|mut run| {
        run.run(&coordinator_bin, &mut report)?;
        check::check(cfg, &run.job_dir, &run.logs, &pool, &run.tasks, &mut report)
    });
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
    fault::keep_report(cfg.dir.as_deref(), &root, "slurm.json", &report)?;
    Ok(report)
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
        "crashing item: array {}: {} workers died on it and were restarted in place; job exit {:?}; tasks {}",
        r.crash_job,
        r.crash_restarts,
        r.crash_job_exit,
        r.crash_task_states.join(", ")
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
    fault::print_verdict("", &r.violations, "all invariants hold");
}
