//! What must hold after the Slurm run, checked against the job's output,
//! the queues, Slurm's states and record (`sacct`), `batchfleet status`
//! and the logs; and the readings of those logs the run itself waits on.

use super::{SlurmConfig, SlurmReport};
use crate::fault;
use anyhow::Result;
use batchfleet_testkit::services;
use std::path::Path;

/// Checks what the run saw against what must hold; every violation goes
/// into the report.
pub(super) fn check(
    cfg: &SlurmConfig,
    job_dir: &Path,
    logs: &Path,
    pool: &str,
    tasks: &[String; 2],
    report: &mut SlurmReport,
) -> Result<()> {
    let mut v = Vec::new();
    let summary = fault::job_invariants(job_dir, cfg.rows, &mut v)?;
    report.items_redelivered = fault::summary_u64(&summary, "deliveries")
        .saturating_sub(fault::summary_u64(&summary, "items_total"));
    let dead = batchfleet_shared::broker::PoolQueues::new(pool).dead();
    for (queue, ready) in fault::queue_depths(&services::amqp(), pool)? {
        if queue == dead {
            report.dead_lettered = ready.into();
        } else if ready > 0 {
            v.push(format!("INV-ACCT: {queue} still holds {ready} message(s)"));
        }
    }
    if report.dead_lettered > 0 {
        v.push(format!("{} item(s) dead-lettered", report.dead_lettered));
    }
    slurm_states(tasks, logs, report, &mut v);
    status_workers(tasks, report, &mut v);
    if report.accounting {
        sacct_record(tasks, report, &mut v);
    }
    task_logs(tasks, logs, report, &mut v)?;
    if !report.crashed_task.is_empty()
        && !cpu_worker_log(logs, &report.crashed_task).contains("(a crash: 1 of")
    {
        v.push(format!(
            "the task script of {} logged no restart in place after its worker's SIGKILL",
            report.crashed_task
        ));
    }
    report.violations.extend(v);
    Ok(())
}

/// The coordinator's job COMPLETED 0:0; each GPU task cancelled by it at
/// the end, after the requeues it went through.
fn slurm_states(tasks: &[String; 2], logs: &Path, report: &SlurmReport, v: &mut Vec<String>) {
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
}

/// Each GPU task's first run and its run after the last requeue took work,
/// under their Slurm names, as `batchfleet status` lists them.
fn status_workers(tasks: &[String; 2], report: &SlurmReport, v: &mut Vec<String>) {
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
}

/// Slurm's own record (sacct): the coordinator COMPLETED 0:0; each GPU
/// task a REQUEUED run, then CANCELLED; every worker step exit 0:0
/// (COMPLETED, or CANCELLED when its job's cancel was recorded before the
/// step ended), nothing FAILED or TIMEOUT.
fn sacct_record(tasks: &[String; 2], report: &SlurmReport, v: &mut Vec<String>) {
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
        if id.ends_with(".0") && (!["COMPLETED", "CANCELLED"].contains(&state) || code != "0:0") {
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

/// The task scripts' and workers' logs: every worker stop a drain with
/// exit 0, nothing panicked, each GPU task on a device of its own with
/// `--threads` from `--cpus-per-task`, the signals logged.
fn task_logs(
    tasks: &[String; 2],
    logs: &Path,
    report: &mut SlurmReport,
    v: &mut Vec<String>,
) -> Result<()> {
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
    Ok(())
}

/// Part files committed so far.
pub(super) fn count_parts(out: &Path) -> u64 {
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
pub(super) fn consuming(logs: &Path, task: &str, restarts: u32) -> bool {
    let log = worker_log(logs, task);
    let id = format!("slurm-{task}.0.r{restarts}");
    log.lines()
        .any(|l| l.contains("worker consuming") && l.contains(&id))
}

/// The log of the CPU worker task `task` (worker-cpu.sbatch; all its runs).
pub(super) fn cpu_worker_log(logs: &Path, task: &str) -> String {
    std::fs::read_to_string(logs.join(format!("batchfleet-worker-cpu-{task}.0.log")))
        .unwrap_or_default()
}

/// How many times a worker of CPU task `task` started consuming, over all
/// its runs (requeues and restarts in place alike).
pub(super) fn consuming_runs(logs: &Path, task: &str) -> usize {
    cpu_worker_log(logs, task)
        .lines()
        .filter(|l| l.contains("worker consuming"))
        .count()
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

/// The time of a `batchfleet-slurm-task` log line (to the second).
pub(super) fn log_time(line: &str) -> Option<std::time::SystemTime> {
    humantime::parse_rfc3339(line.split_whitespace().nth(1)?).ok()
}
