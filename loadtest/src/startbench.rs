//! The job-start part of `batchfleet-loadtest bench`: how long a new job
//! waits before anything happens to it. One-item, one-row jobs run one
//! after another on a warm, idle fleet: for each, the time from its item's
//! publication to a worker starting it (the worker's own queue-wait
//! histogram, read before and after the job) and the job's wall time from
//! submission to its summary; then the same jobs with `run --local`, whose
//! wall time (process start, libtorch and the model included) is all there
//! is to compare.

use crate::fleet::{manifest_into, run_job_with, Fleet};
use anyhow::{bail, Result};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services;
use serde::Serialize;
use std::path::Path;

/// The job-start figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobStarts {
    /// Jobs timed on each backend.
    pub jobs: usize,
    /// Fleet: each job's item, publication to start (ms), in job order.
    pub fleet_start_ms: Vec<f64>,
    /// Fleet: their median (ms).
    pub fleet_start_median_ms: f64,
    /// Fleet: each job's wall time, submission to summary (s).
    pub fleet_wall_s: Vec<f64>,
    /// Fleet: their median (s).
    pub fleet_wall_median_s: f64,
    /// `run --local`: each job's wall time (s).
    pub local_wall_s: Vec<f64>,
    /// `run --local`: their median (s).
    pub local_wall_median_s: f64,
}

/// Runs `jobs` one-item jobs on a fleet of `workers` workers, then with
/// `run --local`, under `root`; `bins` = (worker, coordinator).
pub fn run(
    root: &Path,
    jobs: usize,
    workers: usize,
    bins: (&Path, &Path),
    prefix: &str,
) -> Result<JobStarts> {
    let dir = root.join("starts");
    let pool = services::unique("bench-starts");
    make_job(
        &dir,
        &JobGen {
            rows: 1,
            files: 1,
            features: 4,
            hidden: 4,
            outputs: 1,
            name: "bench-starts".into(),
            pool: pool.clone(),
            item_rows: 1,
            batch_size: 1,
            ..JobGen::default()
        },
    )?;
    println!(
        "bench [starts] {jobs} one-item jobs on {workers} idle workers, then with run --local…"
    );
    let mut fleet = Fleet::start(bins.0, &dir, &pool, prefix, workers, 1)?;
    let timed = time_fleet(&fleet, &dir, jobs, bins.1, prefix);
    fleet.stop();
    services::delete_pool_queues(&pool);
    let (fleet_start_ms, fleet_wall_s) = timed?;
    let mut local_wall_s = Vec::with_capacity(jobs);
    let local = ["--local", "--workers", "1", "--threads", "1"].map(str::to_owned);
    for i in 0..jobs {
        let out = format!("out-local-{i}");
        let manifest = manifest_into(&dir, &out)?;
        let (wall, _, _) = run_job_with(bins.1, &manifest, "bf-unused", &local, &out)?;
        local_wall_s.push(wall);
    }
    Ok(JobStarts {
        jobs,
        fleet_start_median_ms: median(&fleet_start_ms),
        fleet_start_ms,
        fleet_wall_median_s: median(&fleet_wall_s),
        fleet_wall_s,
        local_wall_median_s: median(&local_wall_s),
        local_wall_s,
    })
}

/// Each job's item start after publication (ms) and wall time (s) on `fleet`.
fn time_fleet(
    fleet: &Fleet,
    dir: &Path,
    jobs: usize,
    coordinator: &Path,
    prefix: &str,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let waited = |fleet: &Fleet| {
        (
            fleet.metric_sum("batchfleet_worker_queue_wait_seconds_sum"),
            fleet.metric_sum("batchfleet_worker_queue_wait_seconds_count"),
        )
    };
    let (mut starts, mut walls) = (Vec::with_capacity(jobs), Vec::with_capacity(jobs));
    for i in 0..jobs {
        let out = format!("out-{i}");
        let manifest = manifest_into(dir, &out)?;
        let (sum0, n0) = waited(fleet);
        let (wall, _, _) = run_job_with(coordinator, &manifest, prefix, &[], &out)?;
        let (sum1, n1) = waited(fleet);
        if n1 - n0 < 1.0 {
            bail!("job {i}: no worker recorded its item's wait");
        }
        starts.push((sum1 - sum0) / (n1 - n0) * 1000.0);
        walls.push(wall);
    }
    Ok((starts, walls))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}
