//! `batchfleet status`: a job's state from Redis, for people or as JSON.

use batchfleet_shared::store::{JobRecord, JobStatus, Lease, Store, StoreError};
use serde::Serialize;
use std::fmt::Write;

/// What `status` reports.
#[derive(Debug, Clone, Serialize)]
pub struct JobStatusReport {
    /// The job record.
    #[serde(flatten)]
    pub job: JobRecord,
    /// Items that failed for good (dead-lettered).
    pub items_failed: u64,
    /// Items neither committed nor failed yet.
    pub items_remaining: u64,
    /// Percent of rows committed.
    pub percent_done: f64,
    /// Rows per second since registration (to completion, or to now).
    pub rows_per_s: f64,
    /// Seconds since the job was registered (to its finish, once finished).
    pub elapsed_s: f64,
    /// Seconds to go at the rate so far (a running job past its first
    /// settled item; `null` otherwise).
    pub eta_s: Option<f64>,
    /// Items being processed now: by which worker, since when, how far.
    pub in_flight: Vec<InFlight>,
    /// Items the coordinator published again (dead worker, straggler, lost message).
    pub items_redispatched: u64,
    /// Items failed for good, by failure class.
    pub failures_by_class: std::collections::BTreeMap<String, u64>,
    /// Workers that committed items or hold one now.
    pub workers: Vec<WorkerReport>,
    /// Workers that leave the job's items to others now: they cannot run it
    /// (`unable`: no CUDA device, model unreadable there, out of memory on
    /// one row) or their output disk is full (`disk_full`, paused).
    pub workers_unable: Vec<UnableReport>,
    /// Consumers of the pool's work queue now (`None`: the broker was not asked).
    pub consumers: Option<u32>,
    /// Its deadline and cost (`[job] deadline`, `[job] worker_hour_cost`):
    /// projected finish, workers needed, cost so far and to go.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outlook: Option<crate::pace::Outlook>,
}

/// A worker that cannot take the job's items for now.
#[derive(Debug, Clone, Serialize)]
pub struct UnableReport {
    /// Worker id.
    pub worker: String,
    /// The note it left.
    #[serde(flatten)]
    pub note: batchfleet_shared::store::UnableNote,
    /// Seconds until it tries again (0: it may be trying now).
    pub for_s: f64,
}

/// One worker's part in a job.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerReport {
    /// Worker id.
    pub worker: String,
    /// Items it committed.
    pub items: u64,
    /// Rows it predicted.
    pub rows: u64,
    /// Items it holds now.
    pub in_flight: u64,
}

/// One line of `batchfleet jobs`.
#[derive(Debug, Clone, Serialize)]
pub struct JobLine {
    /// Job id.
    pub id: String,
    /// Status.
    pub status: String,
    /// Pool.
    pub pool: String,
    /// Items committed.
    pub items_done: u64,
    /// Items planned.
    pub items_total: u64,
    /// Rows settled.
    pub rows_done: u64,
    /// Rows planned.
    pub rows_total: u64,
    /// Registered at (ms since epoch).
    pub created_ms: u64,
    /// Seconds from registration to completion (or to now).
    pub duration_s: f64,
}

/// The most recent jobs, newest first (jobs whose record is gone are skipped).
pub async fn jobs(store: &Store, limit: usize) -> Result<Vec<JobLine>, StoreError> {
    loop {
        let mut out = Vec::new();
        let mut expired = false;
        for id in store.recent_jobs(limit).await? {
            let Some(j) = store.job(&id).await? else {
                // Its state expired (retention): forget the listing too,
                // so that the jobs retained fill the list.
                store.delete_job(&id).await?;
                expired = true;
                continue;
            };
            let end = if j.finished_ms > 0 {
                j.finished_ms
            } else {
                batchfleet_shared::now_ms()
            };
            out.push(JobLine {
                duration_s: end.saturating_sub(j.created_ms) as f64 / 1000.0,
                id: j.id,
                status: j.status.to_string(),
                pool: j.pool,
                items_done: j.items_done,
                items_total: j.items_total,
                rows_done: j.rows_done,
                rows_total: j.rows_total,
                created_ms: j.created_ms,
            });
        }
        if !expired {
            return Ok(out);
        }
    }
}

/// `batchfleet jobs` as a table.
pub fn render_jobs(jobs: &[JobLine]) -> String {
    let mut s = format!(
        "{:<40} {:<24} {:<12} {:>13} {:>10}",
        "job", "status", "pool", "items", "duration"
    );
    for j in jobs {
        let _ = write!(
            s,
            "\n{:<40} {:<24} {:<12} {:>13} {:>9.1}s",
            j.id,
            j.status,
            j.pool,
            format!("{}/{}", j.items_done, j.items_total),
            j.duration_s
        );
    }
    if jobs.is_empty() {
        s.push_str("\n(no jobs)");
    }
    s
}

/// What `batchfleet scale-advice` says: per pool, the workers it needs
/// for its jobs' deadlines beside the workers it has.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleAdvice {
    /// The pools, by name.
    pub pools: Vec<PoolAdvice>,
}

/// One pool's advice.
#[derive(Debug, Clone, Serialize)]
pub struct PoolAdvice {
    /// Pool name.
    pub pool: String,
    /// Consumers of its work queue now (`None`: the broker did not say).
    pub workers: Option<u32>,
    /// Workers it needs to finish every job of it that has a deadline on
    /// time, the pool shared as now: the most any of them needs (0: none
    /// has a deadline, or none has a rate yet). The value of
    /// `batchfleet_pool_workers_needed{pool}`.
    pub workers_needed: u32,
    /// Its active jobs.
    pub jobs: Vec<JobAdvice>,
}

/// One active job of a pool.
#[derive(Debug, Clone, Serialize)]
pub struct JobAdvice {
    /// Job id.
    pub job: String,
    /// Its pace is older than [`crate::pace::FRESH_MS`] (its coordinator
    /// is gone, or stuck): not counted in the pool's need.
    pub stale: bool,
    /// Deadline, finish, need and cost (a job with neither a deadline nor
    /// a worker-hour cost has none).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub outlook: Option<crate::pace::Outlook>,
}

/// The advice for `pools` (none given: the pools of the unfinished jobs
/// among the last `limit`).
pub async fn scale_advice(
    store: &Store,
    pools: &[String],
    limit: usize,
) -> Result<ScaleAdvice, StoreError> {
    let mut names: std::collections::BTreeSet<String> = pools.iter().cloned().collect();
    if names.is_empty() {
        for id in store.recent_jobs(limit).await? {
            if let Some(j) = store.job(&id).await? {
                if !j.status.is_final() {
                    names.insert(j.pool);
                }
            }
        }
    }
    let now = store.now_ms().await?;
    let mut out = Vec::new();
    for pool in names {
        let mut jobs = Vec::new();
        let mut paces = Vec::new();
        for id in store.active_jobs(&pool).await?.into_keys() {
            let Some(job) = store.job(&id).await? else {
                continue;
            };
            if let Some(p) = &job.pace {
                paces.push(p.clone());
            }
            jobs.push(JobAdvice {
                stale: job
                    .pace
                    .as_ref()
                    .is_some_and(|p| !p.is_fresh(now, crate::pace::FRESH_MS)),
                outlook: crate::pace::Outlook::of(&job, now),
                job: id,
            });
        }
        out.push(PoolAdvice {
            workers_needed: crate::pace::pool_needed(&paces, now),
            workers: None,
            pool,
            jobs,
        });
    }
    Ok(ScaleAdvice { pools: out })
}

/// `batchfleet scale-advice` for people.
pub fn render_scale_advice(a: &ScaleAdvice) -> String {
    if a.pools.is_empty() {
        return "(no pool with an unfinished job; name one with --pool)".into();
    }
    let mut s = String::new();
    for p in &a.pools {
        let now = p
            .workers
            .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
        let _ = writeln!(
            s,
            "pool {}: {} worker(s) now, {} needed for its deadlines",
            p.pool, now, p.workers_needed
        );
        for j in &p.jobs {
            let what = match &j.outlook {
                Some(o) if o.deadline.is_some() => format!(
                    "deadline {}, finish {}{}, needs {}",
                    o.deadline.as_deref().unwrap_or_default(),
                    o.projected_finish.as_deref().unwrap_or("not known yet"),
                    if o.late { " (LATE)" } else { "" },
                    o.workers_needed
                        .map_or_else(|| "not known yet".to_owned(), |n| n.to_string())
                ),
                _ => "no deadline".into(),
            };
            let stale = if j.stale {
                " [pace stale: not counted]"
            } else {
                ""
            };
            let _ = writeln!(s, "  {:<40} {what}{stale}", j.job);
        }
    }
    s.trim_end().to_owned()
}

/// One item in progress, from its worker's lease.
#[derive(Debug, Clone, Serialize)]
pub struct InFlight {
    /// The lease.
    #[serde(flatten)]
    pub lease: Lease,
    /// How long the worker has held it (ms).
    pub held_ms: u64,
    /// Whether its heartbeat stopped (the worker is presumed dead).
    pub stale: bool,
}

/// Reads the report of `job_id`, `None` if the job is unknown.
pub async fn report(store: &Store, job_id: &str) -> Result<Option<JobStatusReport>, StoreError> {
    let Some(job) = store.job(job_id).await? else {
        return Ok(None);
    };
    let end = if job.finished_ms > 0 {
        job.finished_ms
    } else {
        batchfleet_shared::now_ms()
    };
    let secs = end.saturating_sub(job.created_ms) as f64 / 1000.0;
    let items_failed = store.progress(job_id).await?.items_failed;
    // Leases and workers' notes are on Redis's clock.
    let now = store.now_ms().await?;
    let workers_unable = store
        .unable(job_id)
        .await?
        .into_iter()
        .map(|(worker, note)| UnableReport {
            for_s: note.until_ms.saturating_sub(now) as f64 / 1000.0,
            worker,
            note,
        })
        .collect();
    let done = store.done_items(job_id).await?;
    let in_flight: Vec<InFlight> = store
        .leases(job_id)
        .await?
        .into_iter()
        .filter(|l| !done.contains(&l.seq))
        .map(|lease| InFlight {
            held_ms: lease.age_ms(now),
            stale: lease.is_stale(now),
            lease,
        })
        .collect();
    let items_redispatched = store.redispatched(job_id).await?.len() as u64;
    let mut failures_by_class = std::collections::BTreeMap::new();
    for f in store.failures(job_id).await? {
        *failures_by_class.entry(f.class).or_insert(0) += 1;
    }
    let mut by_worker: std::collections::BTreeMap<String, WorkerReport> = Default::default();
    let blank = |w: &str| WorkerReport {
        worker: w.to_owned(),
        items: 0,
        rows: 0,
        in_flight: 0,
    };
    for s in store.item_stats(job_id).await? {
        let w = by_worker
            .entry(s.worker.clone())
            .or_insert_with(|| blank(&s.worker));
        w.items += 1;
        w.rows += s.rows;
    }
    let mut in_flight = in_flight;
    for f in &in_flight {
        by_worker
            .entry(f.lease.worker.clone())
            .or_insert_with(|| blank(&f.lease.worker))
            .in_flight += 1;
    }
    in_flight.sort_by_key(|f| std::cmp::Reverse(f.held_ms));
    Ok(Some(JobStatusReport {
        workers_unable,
        failures_by_class,
        workers: by_worker.into_values().collect(),
        in_flight,
        items_redispatched,
        items_failed,
        items_remaining: job
            .items_total
            .saturating_sub(job.items_done + items_failed),
        // Items cut blind hold equal bytes: progress by items is progress
        // by bytes, while the rows are an estimate.
        percent_done: match (job.rows_estimated, job.items_total, job.rows_total) {
            (true, 0, _) | (false, _, 0) => 100.0,
            (true, items, _) => 100.0 * job.items_done as f64 / items as f64,
            (false, _, rows) => 100.0 * job.rows_done as f64 / rows as f64,
        },
        rows_per_s: if secs > 0.0 {
            (job.rows_done as f64 / secs).round()
        } else {
            0.0
        },
        elapsed_s: secs,
        eta_s: eta(&job, secs),
        outlook: crate::pace::Outlook::of(&job, now),
        job,
        consumers: None,
    }))
}

/// Seconds to go for a running job at its rate so far: the time per
/// settled share (items and rows settled, as `percent_done` counts them)
/// times the share left; `None` before anything settled or once the job
/// is no longer running.
fn eta(job: &JobRecord, secs: f64) -> Option<f64> {
    if !matches!(job.status, JobStatus::Running) {
        return None;
    }
    let (done, total) = if job.rows_estimated || job.rows_total == 0 {
        (job.items_done as f64, job.items_total as f64)
    } else {
        (job.rows_done as f64, job.rows_total as f64)
    };
    (done > 0.0 && total > done).then(|| (secs * (total - done) / done).round())
}

/// A duration as people read it: `3h 12m`, `4m 5s`, `12s`.
pub(crate) fn human_secs(secs: f64) -> String {
    let s = if secs.is_finite() {
        secs.max(0.0).round() as u64
    } else {
        u64::MAX
    };
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m {s}s"),
        _ => format!("{h}h {m}m"),
    }
}

/// Human-readable rendering.
pub fn render(r: &JobStatusReport) -> String {
    let j = &r.job;
    let mut s = String::new();
    let _ = writeln!(s, "job       {}", j.id);
    let _ = writeln!(s, "status    {}", j.status);
    if !j.failed_reason.is_empty() {
        let _ = writeln!(s, "why       {} ({})", j.failed_reason, j.failed_class);
    }
    let _ = writeln!(
        s,
        "pool      {} (priority {})",
        j.pool,
        if j.priority.is_empty() {
            "normal"
        } else {
            &j.priority
        }
    );
    if let Some(n) = r.consumers {
        let running = matches!(j.status, JobStatus::Planning | JobStatus::Running);
        let _ = writeln!(
            s,
            "workers   {n} consuming bf.{}.work{}",
            j.pool,
            if n == 0 && running {
                format!(
                    " — no worker serves this pool: its items wait until one does; start one with `batchfleet-worker --pool {} --data-root <the folder holding the job's files>`",
                    j.pool
                )
            } else {
                String::new()
            }
        );
    }
    use indicatif::HumanCount;
    let _ = writeln!(
        s,
        "items     {}/{} done, {} failed, {} remaining",
        HumanCount(j.items_done),
        HumanCount(j.items_total),
        HumanCount(r.items_failed),
        HumanCount(r.items_remaining)
    );
    let _ = writeln!(
        s,
        "rows      {}/{}{} settled ({:.1}%{}), {} rejected",
        HumanCount(j.rows_done),
        if j.rows_estimated { "≈" } else { "" },
        HumanCount(j.rows_total),
        r.percent_done,
        if j.rows_estimated { " by bytes" } else { "" },
        HumanCount(j.rows_rejected)
    );
    let _ = writeln!(s, "rows/s    {}", HumanCount(r.rows_per_s as u64));
    let _ = writeln!(
        s,
        "elapsed   {}{}",
        human_secs(r.elapsed_s),
        r.eta_s
            .map(|e| format!(", about {} to go at this rate", human_secs(e)))
            .unwrap_or_default()
    );
    if let Some(o) = &r.outlook {
        let _ = writeln!(s, "{}", o.render());
    }
    if !r.failures_by_class.is_empty() {
        let classes: Vec<String> = r
            .failures_by_class
            .iter()
            .map(|(c, n)| format!("{n} {c}"))
            .collect();
        let _ = writeln!(
            s,
            "failed    {} (see `batchfleet dlq list --job {}`)",
            classes.join(", "),
            j.id
        );
    }
    if r.items_redispatched > 0 {
        let _ = writeln!(
            s,
            "copies    {} item(s) published again (dead worker, straggler or lost message)",
            r.items_redispatched
        );
    }
    let _ = writeln!(s, "output    {}", j.output_dir);
    let _ = write!(s, "manifest  {}", j.manifest);
    if !r.workers_unable.is_empty() {
        let _ = write!(
            s,
            "\nworkers that could not take its items ({}):",
            r.workers_unable.len()
        );
        for u in &r.workers_unable {
            let what = if u.note.class == "disk_full" {
                "paused, output disk full"
            } else {
                "cannot run it"
            };
            let when = if u.for_s > 0.0 {
                format!("for {:.0}s more", u.for_s)
            } else {
                "until recently".to_owned()
            };
            let _ = write!(s, "\n  {:<24} {what} ({when}): {}", u.worker, u.note.reason);
        }
    }
    if !r.workers.is_empty() {
        let _ = write!(s, "\nworkers ({}):", r.workers.len());
        for w in &r.workers {
            let _ = write!(
                s,
                "\n  {:<24} {:>6} items {:>10} rows {:>3} in flight",
                w.worker, w.items, w.rows, w.in_flight
            );
        }
    }
    if !r.in_flight.is_empty() {
        let _ = write!(
            s,
            "\nin flight ({}, slowest first):\n  {:>7}  {:<24} {:>7} {:>9}  {:>13}  state",
            r.in_flight.len(),
            "item",
            "worker",
            "attempt",
            "held",
            "rows"
        );
        for f in &r.in_flight {
            let l = &f.lease;
            let state = match (f.stale, l.acked) {
                (true, _) => "STALE (no heartbeat)",
                (false, true) => "live, held by lease",
                (false, false) => "live",
            };
            let _ = write!(
                s,
                "\n  {:>7}  {:<24} {:>7} {:>8.1}s  {:>13}  {state}",
                l.seq,
                l.worker,
                l.attempt,
                f.held_ms as f64 / 1000.0,
                // A range cut blind: its rows are known once it is read.
                if l.rows == 0 {
                    format!("{}/?", l.rows_done)
                } else {
                    format!("{}/{}", l.rows_done, l.rows)
                },
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eta_is_the_time_per_settled_share_times_the_share_left() {
        let mut job = JobRecord {
            status: JobStatus::Running,
            rows_total: 1_000,
            rows_done: 250,
            items_total: 10,
            items_done: 2,
            ..JobRecord::sample("j")
        };
        // A quarter of the rows in 30 s: 90 s to go.
        assert_eq!(eta(&job, 30.0), Some(90.0));
        // Rows estimated from bytes: progress by items (2 of 10).
        job.rows_estimated = true;
        assert_eq!(eta(&job, 30.0), Some(120.0));
        job.items_done = 0;
        assert_eq!(eta(&job, 30.0), None, "nothing settled yet");
        job.items_done = 10;
        assert_eq!(eta(&job, 30.0), None, "all settled");
        job.items_done = 2;
        job.status = JobStatus::Completed;
        assert_eq!(eta(&job, 30.0), None);
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human_secs(0.4), "0s");
        assert_eq!(human_secs(59.6), "1m 0s");
        assert_eq!(human_secs(245.0), "4m 5s");
        assert_eq!(human_secs(3.0 * 3600.0 + 12.0 * 60.0 + 9.0), "3h 12m");
    }
}
