//! Job control besides running: `batchfleet plan` (what a manifest would
//! do, without publishing) and `batchfleet gc` (finished jobs' state
//! removed before its retention is up).

use crate::config::RunConfig;
use crate::dispatcher::{SUCCESS_FILE, SUMMARY_FILE};
use crate::error::RunError;
use crate::manifest::JobSpec;
use batchfleet_shared::store::{JobStatus, Store, StoreError};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

/// What `batchfleet plan` found: the job a manifest describes and its items.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PlanReport {
    /// The job id `run` would use.
    pub job_id: String,
    /// Job name.
    pub name: String,
    /// Pool its items go to.
    pub pool: String,
    /// `[job] priority`.
    pub priority: String,
    /// `new` (never run, or its state expired and its output folder holds
    /// no finished output), `running` (registered and not finished) or
    /// `done` (finished: `run` publishes nothing, or retries its failed
    /// items).
    pub state: String,
    /// The job's status in the store, when it has one.
    pub status: Option<String>,
    /// Items `run` would publish for a new job.
    pub items: u64,
    /// Rows over all items (an estimate when `rows_estimated`).
    pub rows: u64,
    /// `rows` is estimated from the sampled record size (files cut blind).
    pub rows_estimated: bool,
    /// Input bytes over all files.
    pub bytes: u64,
    /// Input files.
    pub files: u64,
    /// Items committed so far (a running or finished job).
    pub items_done: u64,
    /// The output folder.
    pub output_dir: String,
    /// The `--set` overrides applied.
    pub overrides: Vec<String>,
}

/// Validates and plans the manifest at `path` — with `cfg`'s data roots and
/// overrides — without publishing or writing anything, and says whether
/// its job is new, running or done (from the store, or with no store
/// (`store` `None`, `--local`) from its output folder alone).
pub async fn plan(
    cfg: &RunConfig,
    path: &Path,
    store: Option<&Store>,
) -> Result<PlanReport, RunError> {
    let spec = cfg.load(path, &cfg.overrides)?;
    let planned = {
        let spec = spec.clone();
        tokio::task::spawn_blocking(move || crate::planner::plan(&spec))
            .await
            .map_err(|e| RunError::Task {
                what: "planning",
                reason: e.to_string(),
            })??
    };
    let record = match store {
        Some(s) => s.job(&spec.job_id).await?,
        None => None,
    };
    let (state, status, items_done) = match &record {
        Some(r) => {
            let state = match r.status {
                JobStatus::Planning | JobStatus::Running => "running",
                _ => "done",
            };
            (state, Some(r.status.to_string()), r.items_done)
        }
        None if finished_output(&spec) => ("done", None, planned.items.len() as u64),
        None => ("new", None, 0),
    };
    Ok(PlanReport {
        job_id: spec.job_id.clone(),
        name: spec.name.clone(),
        pool: spec.pool.clone(),
        priority: spec.priority.as_str().into(),
        state: state.into(),
        status,
        items: planned.items.len() as u64,
        rows: planned.rows_total,
        rows_estimated: planned.rows_estimated,
        bytes: spec.fingerprints.iter().map(|f| f.size).sum(),
        files: spec.files.len() as u64,
        items_done,
        output_dir: spec.task.output.dir.clone(),
        overrides: spec.overrides.clone(),
    })
}

/// Whether the job's output folder holds its completed output already
/// (`_SUCCESS`, and a summary of this very job).
fn finished_output(spec: &JobSpec) -> bool {
    let out = spec.output_dir();
    let fs = batchfleet_shared::source::fs::read_to_string;
    batchfleet_shared::source::fs::exists(&out.join(SUCCESS_FILE)).unwrap_or(false)
        && fs(&out.join(SUMMARY_FILE))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("job_id")?.as_str().map(str::to_owned))
            .is_some_and(|id| id == spec.job_id)
}

/// `batchfleet plan` for people.
pub fn render_plan(r: &PlanReport) -> String {
    let mut s = format!(
        "job {} ({}) in pool {}, priority {}",
        r.job_id, r.state, r.pool, r.priority
    );
    if let Some(status) = &r.status {
        let _ = write!(
            s,
            ", status {status}, {}/{} items done",
            r.items_done, r.items
        );
    }
    let _ = write!(
        s,
        "\n{} items, {}{} rows, {} bytes in {} file(s)\noutput: {}",
        r.items,
        if r.rows_estimated { "about " } else { "" },
        r.rows,
        r.bytes,
        r.files,
        r.output_dir
    );
    if !r.overrides.is_empty() {
        let _ = write!(s, "\noverrides: {}", r.overrides.join(" "));
    }
    s.push_str(match r.state.as_str() {
        "new" => "\n`batchfleet run` would publish every item",
        "running" => "\n`batchfleet run` would follow it, publishing what was never published",
        _ => "\n`batchfleet run` would publish nothing (or only its failed items again)",
    });
    s
}

/// One job `gc` removed (or, with `--dry-run`, would remove).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Collected {
    /// Job id.
    pub job_id: String,
    /// Its status; `expired` for a listing whose state had expired already.
    pub status: String,
    /// When it finished (ms since the epoch; 0 when expired).
    pub finished_ms: u64,
    /// Its output folder, which keeps the summary (empty when expired).
    pub output_dir: String,
}

/// Removes the state of every finished job (completed, completed with
/// failures, failed) that finished at least `older_than` ago, and the
/// listings of jobs whose state expired; with `dry_run` only says which.
/// A job still planning or running is never touched.
pub async fn gc(
    store: &Store,
    older_than: Duration,
    dry_run: bool,
) -> Result<Vec<Collected>, StoreError> {
    let now = batchfleet_shared::now_ms();
    let cutoff = now.saturating_sub(older_than.as_millis() as u64);
    let mut out = Vec::new();
    for id in store.recent_jobs(isize::MAX as usize).await? {
        let collected = match store.job(&id).await? {
            None => Collected {
                job_id: id.clone(),
                status: "expired".into(),
                finished_ms: 0,
                output_dir: String::new(),
            },
            Some(j) if finished(j.status) && j.finished_ms > 0 && j.finished_ms <= cutoff => {
                Collected {
                    job_id: id.clone(),
                    status: j.status.to_string(),
                    finished_ms: j.finished_ms,
                    output_dir: j.output_dir,
                }
            }
            Some(_) => continue,
        };
        if !dry_run {
            store.delete_job(&id).await?;
        }
        out.push(collected);
    }
    Ok(out)
}

/// Whether a job in this status is finished (nothing works on it).
fn finished(status: JobStatus) -> bool {
    matches!(
        status,
        JobStatus::Completed | JobStatus::CompletedWithFailures | JobStatus::Failed
    )
}

/// `batchfleet gc` for people.
pub fn render_gc(collected: &[Collected], dry_run: bool) -> String {
    let verb = if dry_run { "would remove" } else { "removed" };
    let mut s = format!("{verb} the state of {} job(s)", collected.len());
    for c in collected {
        let _ = write!(s, "\n  {} [{}]", c.job_id, c.status);
        if !c.output_dir.is_empty() {
            let _ = write!(s, " (summary stays in {})", c.output_dir);
        }
    }
    s
}

/// How many of the most recent jobs `supervise` looks at on each pass.
const SUPERVISE_SCAN: usize = 1000;

/// `batchfleet supervise`: follows every unfinished job of `pools` (all
/// pools when empty) that no other process follows — a `run --detach` job
/// nobody waits for, or one whose `run` was interrupted — supervising it
/// (copies of items whose worker died, stragglers, lost messages) and
/// reducing it when it settles: summary, `_SUCCESS`, merge and
/// `[on_complete]`, exactly once (the reduce claim). Looks for such jobs
/// every `every`, until `shutdown`; then it stops following, its jobs
/// untouched (another supervisor or follower takes them over).
pub async fn supervise(
    cfg: &RunConfig,
    pools: &[String],
    every: Duration,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), RunError> {
    let store = cfg.connections.store().await?;
    let me = crate::job::follower_id();
    tracing::info!(supervisor = %me, pools = ?pools, "supervising jobs nobody follows");
    let mut following: std::collections::HashMap<String, tokio::task::JoinHandle<()>> =
        std::collections::HashMap::new();
    loop {
        following.retain(|_, task| !task.is_finished());
        match store.recent_jobs(SUPERVISE_SCAN).await {
            Ok(ids) => {
                for id in ids {
                    if following.contains_key(&id) {
                        continue;
                    }
                    let Ok(Some(job)) = store.job(&id).await else {
                        continue;
                    };
                    if crate::job::is_reduced(&job)
                        || (!pools.is_empty() && !pools.contains(&job.pool))
                    {
                        continue;
                    }
                    // Taken only when nobody else holds it.
                    if !store
                        .follow_lease(&id, &me, crate::monitor::FOLLOW_TTL)
                        .await
                        .unwrap_or(false)
                    {
                        continue;
                    }
                    tracing::info!(job = %id, pool = %job.pool, "following a job nobody else follows");
                    let (cfg, store, me, token, job_id) = (
                        cfg.clone(),
                        store.clone(),
                        me.clone(),
                        shutdown.clone(),
                        id.clone(),
                    );
                    let task = tokio::spawn(async move {
                        match crate::job::follow_job_as(&cfg, &store, &job_id, token, &me).await {
                            Ok(crate::job::RunOutcome::Completed {
                                report, summary, ..
                            }) => {
                                tracing::info!(job = %job_id, status = %report.status, summary = %summary.display(), "job finished");
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(job = %job_id, error = %e, "stopped following the job")
                            }
                        }
                    });
                    following.insert(id, task);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot list jobs; trying again"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
    }
    for (_, task) in following {
        let _ = task.await;
    }
    Ok(())
}
