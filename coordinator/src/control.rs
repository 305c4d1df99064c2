//! Job control besides running: `batchfleet plan` (what a manifest would
//! do, without publishing) and `batchfleet gc` (finished jobs' state
//! removed before its retention is up).

use crate::config::RunConfig;
use crate::dispatcher::SUCCESS_FILE;
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
    /// `--sample N`: rows predicted in this process (absent without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample: Option<SampleReport>,
    /// `[job] deadline`, resolved (RFC 3339): a duration counts from the
    /// job's first run, now for a new job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    /// With `--sample` and a deadline: workers of one core that finish the
    /// job's rows by it at the sampled rate (the estimate before the first
    /// item; once it runs, `status` has the measured one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers_for_deadline: Option<u32>,
    /// With `--sample` and `[job] worker_hour_cost`: the job's rows at the
    /// sampled rate, as worker-hours of one core times that cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_estimate: Option<f64>,
    /// `--since`: the files new, changed and reused since that job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub incremental: Option<crate::since::Incremental>,
}

/// What `plan --sample N` adds: rows read from items spread across the
/// input and predicted in this process, one CPU core, with the job's model,
/// as the job would write them; the rate one core reaches; and the time the
/// whole job would take on `workers` workers of one core each.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SampleReport {
    /// The output columns, as a CSV header.
    pub header: String,
    /// The rows, as CSV lines under that header.
    pub rows: Vec<String>,
    /// Items read for them (spread across the job's items).
    pub items: usize,
    /// Rows those items held, all read and parsed.
    pub rows_read: u64,
    /// Rows rejected while reading them (bad rows).
    pub rows_rejected: u64,
    /// Rows one core reads and parses (tokenizes) per second.
    pub read_rows_per_s: f64,
    /// Rows one core's model calls predict per second (on the CPU).
    pub model_rows_per_s: f64,
    /// Both, one after the other: rows per second per core.
    pub rows_per_s_per_core: f64,
    /// `--workers`: the fleet the time to go is for.
    pub workers: u32,
    /// The job's rows at that rate on `workers` workers of one core each (s).
    pub eta_s: f64,
}

/// `plan --sample`'s choice: how many rows, and for how many workers.
#[derive(Debug, Clone, Copy)]
pub struct SampleArgs {
    /// Rows to show.
    pub rows: usize,
    /// Workers (one core each) to give the time to go for.
    pub workers: u32,
}

/// Validates and plans the manifest at `path` — with `cfg`'s data roots and
/// overrides — without publishing or writing anything, and says whether
/// its job is new, running or done (from the store, or with no store
/// (`store` `None`, `--local`) from its output folder alone).
pub async fn plan(
    cfg: &RunConfig,
    path: &Path,
    store: Option<&Store>,
    sample: Option<SampleArgs>,
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
    let sampled = match sample {
        Some(args) => {
            let items = planned.items.clone();
            let rows = planned.rows_total;
            Some(
                tokio::task::spawn_blocking(move || sample_rows(&items, rows, args))
                    .await
                    .map_err(|e| RunError::Task {
                        what: "sampling",
                        reason: e.to_string(),
                    })??,
            )
        }
        None => None,
    };
    let record = match store {
        Some(s) => s.job(&spec.job_id).await?,
        None => None,
    };
    let now_ms = batchfleet_shared::now_ms();
    let deadline_ms = spec
        .deadline
        .map(|d| d.at_ms(record.as_ref().map_or(now_ms, |r| r.created_ms)));
    let per_core = sampled
        .as_ref()
        .map(|p| p.rows_per_s_per_core)
        .filter(|r| *r > 0.0);
    let rows_left = planned
        .rows_total
        .saturating_sub(record.as_ref().map_or(0, |r| r.rows_done));
    let workers_for_deadline = deadline_ms.zip(per_core).map(|(d, rate)| {
        let left_s = d.saturating_sub(now_ms) as f64 / 1000.0;
        let items = planned.items.len().max(1) as f64;
        if left_s <= 0.0 {
            items as u32
        } else {
            (rows_left as f64 / (rate * left_s))
                .ceil()
                .clamp(1.0, items) as u32
        }
    });
    let cost_estimate = spec
        .worker_hour_cost
        .zip(per_core)
        .map(|(c, rate)| crate::pace::cost(rows_left as f64 / rate, c));
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
        sample: sampled,
        deadline: deadline_ms.map(crate::pace::rfc3339),
        workers_for_deadline,
        cost_estimate,
        incremental: None,
    })
}

/// Items read for `plan --sample` at most: enough to spread the rows
/// across the input, few enough to answer in seconds.
const SAMPLE_ITEMS: usize = 8;

/// Reads up to [`SAMPLE_ITEMS`] items spread across `items`, predicts their
/// first rows with the job's model in this process and keeps `args.rows`
/// of them spread across those items; times both (see [`SampleReport`]).
#[cfg(feature = "local")]
fn sample_rows(
    items: &[batchfleet_shared::message::WorkItem],
    rows_total: u64,
    args: SampleArgs,
) -> Result<SampleReport, RunError> {
    use batchfleet_worker::sample::{spread, Sampler};
    let picked = spread(items.len(), args.rows.clamp(1, SAMPLE_ITEMS));
    let per_item = args.rows.div_ceil(picked.len().max(1));
    let mut sampler = Sampler::new();
    let mut report = SampleReport {
        header: String::new(),
        rows: Vec::new(),
        items: picked.len(),
        rows_read: 0,
        rows_rejected: 0,
        read_rows_per_s: 0.0,
        model_rows_per_s: 0.0,
        rows_per_s_per_core: 0.0,
        workers: args.workers.max(1),
        eta_s: 0.0,
    };
    let (mut read_s, mut predicted, mut model_s) = (0.0, 0u64, 0.0);
    for i in picked {
        let item = &items[i];
        // At least a mini-batch predicted, for a rate worth the name.
        let cap = per_item.max(item.task.batch_size as usize);
        let p = sampler
            .item(item, per_item, cap)
            .map_err(|e| RunError::Task {
                what: "sampling the job's rows",
                reason: format!(
                    "item {} of {}: {e}",
                    item.seq,
                    item.input
                        .input_files()
                        .first()
                        .map_or_else(String::new, |p| p.display().to_string())
                ),
            })?;
        report.header = p.header;
        let room = args.rows.saturating_sub(report.rows.len());
        report.rows.extend(p.lines.into_iter().take(room));
        report.rows_read += p.rows_read as u64;
        report.rows_rejected += p.rows_rejected as u64;
        read_s += p.read_s;
        predicted += p.rows_predicted as u64;
        model_s += p.forward_s;
    }
    let rate = |rows: u64, s: f64| if s > 0.0 { rows as f64 / s } else { 0.0 };
    report.read_rows_per_s = rate(report.rows_read, read_s);
    report.model_rows_per_s = rate(predicted, model_s);
    let per_row = 1.0 / report.read_rows_per_s.max(f64::MIN_POSITIVE)
        + 1.0 / report.model_rows_per_s.max(f64::MIN_POSITIVE);
    report.rows_per_s_per_core = 1.0 / per_row;
    report.eta_s = rows_total as f64 / (report.rows_per_s_per_core * f64::from(report.workers));
    Ok(report)
}

/// Without libtorch in this build nothing can be predicted here.
#[cfg(not(feature = "local"))]
fn sample_rows(
    _items: &[batchfleet_shared::message::WorkItem],
    _rows_total: u64,
    _args: SampleArgs,
) -> Result<SampleReport, RunError> {
    Err(RunError::Task {
        what: "sampling the job's rows",
        reason: "this batchfleet is built without libtorch (--no-default-features); run `plan --sample` with the default build".into(),
    })
}

/// Whether the job's output folder holds its completed output already
/// (`_SUCCESS`, and a summary of this very job).
fn finished_output(spec: &JobSpec) -> bool {
    let out = spec.output_dir();
    let fs = batchfleet_shared::source::fs::read_to_string;
    batchfleet_shared::source::fs::exists(&out.join(SUCCESS_FILE)).unwrap_or(false)
        && fs(&batchfleet_shared::output::summary_in(out))
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
    if let Some(p) = &r.sample {
        use indicatif::HumanCount;
        let _ = write!(
            s,
            "\nsample: {} rows from {} items spread across the input, predicted here on one CPU core\n{}",
            p.rows.len(),
            p.items,
            p.header
        );
        for row in &p.rows {
            let _ = write!(s, "\n{row}");
        }
        let _ = write!(
            s,
            "\nper core: reading {} rows/s, the model {} rows/s: {} rows/s; {} rows in about {} on {} worker(s) of one core (--workers)",
            HumanCount(p.read_rows_per_s as u64),
            HumanCount(p.model_rows_per_s as u64),
            HumanCount(p.rows_per_s_per_core as u64),
            HumanCount(r.rows),
            crate::status::human_secs(p.eta_s),
            p.workers
        );
        if p.rows_rejected > 0 {
            let _ = write!(
                s,
                "\n{} of the {} rows read were rejected (bad rows)",
                p.rows_rejected, p.rows_read
            );
        }
    }
    if let Some(d) = &r.deadline {
        let _ = write!(s, "\ndeadline: {d}");
        if let Some(n) = r.workers_for_deadline {
            let _ = write!(
                s,
                "; about {n} worker(s) of one core finish it by then at the sampled rate"
            );
        }
    }
    if let Some(i) = &r.incremental {
        let _ = write!(
            s,
            "\nsince job {}: {} new and {} changed file(s) to score, {} unchanged (reused from {})",
            i.since_job,
            i.new.len(),
            i.changed.len(),
            i.reused.len(),
            i.since_output_dir
        );
    }
    if let Some(c) = r.cost_estimate {
        let _ = write!(
            s,
            "\ncost: about {c:.2} at the sampled rate (worker_hour_cost)"
        );
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
