//! A job's life as a coordinator drives it: run (validate, register,
//! publish, follow, reduce), submit without following, resume by id,
//! follow, cancel; and the reduce claim, by which exactly one of a job's
//! followers writes its summary, `_SUCCESS`, merged output and hooks.

use crate::config::RunConfig;
use crate::error::RunError;
use batchfleet_shared::store::Store;
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

/// How a `run` ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RunOutcome {
    /// Every item committed; the summary is written.
    Completed {
        /// Job id.
        job_id: String,
        /// Path of `_summary.json`.
        summary: PathBuf,
        /// The summary.
        report: Box<crate::reducer::Summary>,
    },
    /// The job had completed before; nothing was published.
    AlreadyCompleted {
        /// Job id.
        job_id: String,
        /// Path of `_summary.json`.
        summary: PathBuf,
    },
    /// Stopped by a signal while waiting; the fleet keeps working and
    /// running the same manifest again re-attaches.
    Interrupted {
        /// Job id.
        job_id: String,
    },
    /// `run --detach`: the items are published; nobody here follows the job.
    Detached {
        /// Job id.
        job_id: String,
        /// Items the job has.
        items: u64,
    },
}

/// Runs the job of a manifest to completion: validate, connect, plan,
/// publish, follow, summarize. Safe to run again: a completed job publishes
/// nothing, an unfinished one is resumed.
pub async fn run_job(
    cfg: &RunConfig,
    manifest_path: &Path,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let submitted_ms = batchfleet_shared::now_ms();
    let spec = cfg.load(manifest_path, &cfg.overrides)?;
    tracing::info!(job = %spec.job_id, files = spec.files.len(), "manifest valid");
    run_spec(cfg, &spec, submitted_ms, shutdown).await
}

/// `run --detach`: validates, registers and publishes the job of a
/// manifest like [`run_job`], and returns once its items are published
/// and confirmed, without following it. A `batchfleet wait`, `run` of the
/// same manifest, or `batchfleet supervise` follows and reduces it.
pub async fn submit_job(cfg: &RunConfig, manifest_path: &Path) -> Result<RunOutcome, RunError> {
    let submitted_ms = batchfleet_shared::now_ms();
    let spec = cfg.load(manifest_path, &cfg.overrides)?;
    let (_store, broker, outcome) = connect_and_dispatch(cfg, &spec, submitted_ms).await?;
    broker.close("bye").await;
    Ok(match outcome {
        crate::dispatcher::Dispatched::AlreadyCompleted { summary } => {
            RunOutcome::AlreadyCompleted {
                job_id: spec.job_id.clone(),
                summary,
            }
        }
        crate::dispatcher::Dispatched::Running { plan } => RunOutcome::Detached {
            job_id: spec.job_id.clone(),
            items: plan.items.len() as u64,
        },
    })
}

/// [`run_job`] for a manifest validated already; `submitted_ms` is when the
/// run started.
pub async fn run_spec(
    cfg: &RunConfig,
    spec: &crate::manifest::JobSpec,
    submitted_ms: u64,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let (store, broker, dispatched) = connect_and_dispatch(cfg, spec, submitted_ms).await?;
    let outcome = match dispatched {
        crate::dispatcher::Dispatched::AlreadyCompleted { summary } => {
            Ok(RunOutcome::AlreadyCompleted {
                job_id: spec.job_id.clone(),
                summary,
            })
        }
        crate::dispatcher::Dispatched::Running { plan } => {
            let mut supervisor = crate::supervisor::Supervisor::new(
                &spec.job_id,
                cfg,
                Some(std::sync::Arc::new(spec.clone())),
                Some(plan),
            );
            let me = follower_id();
            follow_with_as(cfg, &store, &spec.job_id, shutdown, &mut supervisor, &me).await
        }
    };
    broker.close("bye").await;
    outcome
}

/// Connects to RabbitMQ and Redis and registers and publishes the job,
/// riding out an outage of either (a restart, a failover) for up to
/// `--connect-timeout` from its first failure: the whole step is tried
/// again, as a run of the same manifest would be — it publishes only what
/// is not done, and registers a job Redis lost anew.
pub async fn connect_and_dispatch(
    cfg: &RunConfig,
    spec: &crate::manifest::JobSpec,
    submitted_ms: u64,
) -> Result<
    (
        batchfleet_shared::store::Store,
        std::sync::Arc<dyn batchfleet_shared::broker::Broker>,
        crate::dispatcher::Dispatched,
    ),
    RunError,
> {
    // The budget counts from the first failure, not from the start: a job
    // that publishes for minutes rides out an outage late in it too.
    let mut deadline = None;
    let mut pause = std::time::Duration::from_millis(100);
    loop {
        // Boxed: the start's future nested in `run`'s is otherwise deeper
        // than the compiler lays out.
        let tried = Box::pin(async {
            let store = cfg.connections.store().await?;
            let broker = cfg
                .connections
                .broker(&format!("batchfleet coordinator {}", spec.job_id))
                .await?;
            match crate::dispatcher::dispatch(cfg, spec, &store, &*broker, submitted_ms).await {
                Ok(d) => Ok((store, broker, d)),
                Err(e) => {
                    broker.close("bye").await;
                    Err(e)
                }
            }
        })
        .await;
        match tried {
            Err(e)
                if e.is_outage()
                    && std::time::Instant::now() + pause
                        < *deadline.get_or_insert_with(|| {
                            std::time::Instant::now() + cfg.connections.connect_timeout
                        }) =>
            {
                tracing::warn!(job = %spec.job_id, error = %e, retry_in_ms = pause.as_millis() as u64, "RabbitMQ or Redis unavailable while starting the job; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

/// Resumes a job by id: runs its manifest (recorded in Redis) again, which
/// must still describe the same job.
pub async fn resume_job(
    cfg: &RunConfig,
    job_id: &str,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let store = cfg.connections.store().await?;
    let job = store.job(job_id).await?.ok_or_else(|| {
        RunError::UnknownJob(format!(
            "no job \"{job_id}\" in Redis; run its manifest with `batchfleet run <manifest>` (that also resumes it, rebuilding its progress from the output folder)"
        ))
    })?;
    let manifest = PathBuf::from(&job.manifest);
    let spec = cfg.load_known(&manifest, &job.overrides)?;
    if spec.job_id != job_id {
        return Err(RunError::ManifestMoved {
            manifest: manifest.display().to_string(),
            now: spec.job_id,
            was: job_id.to_owned(),
            changed: "the manifest, its input or its model changed",
            fix: format!("restore them to resume {job_id}"),
        });
    }
    run_spec(cfg, &spec, batchfleet_shared::now_ms(), shutdown).await
}

/// Follows a published job until it settles (or `shutdown`), then writes its summary.
pub async fn follow_job(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    follow_job_as(cfg, store, job_id, shutdown, &follower_id()).await
}

/// [`follow_job`] as follower `me` (`batchfleet supervise`, which took the
/// job's follower lease under that name before).
pub async fn follow_job_as(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    shutdown: CancellationToken,
    me: &str,
) -> Result<RunOutcome, RunError> {
    let mut supervisor = crate::supervisor::Supervisor::new(job_id, cfg, None, None);
    follow_with_as(cfg, store, job_id, shutdown, &mut supervisor, me).await
}

/// What `batchfleet cancel` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cancelled {
    /// Job id.
    pub job_id: String,
    /// Whether this call cancelled it (`false`: it was not running).
    pub cancelled: bool,
    /// Its status now.
    pub status: String,
    /// Its summary, when this call wrote it (nobody else followed the job).
    pub summary: Option<PathBuf>,
}

/// Cancels a running job: its status becomes `cancelled` and its queue is
/// purged (deleted a grace later), so its queued items are gone, workers stop in-flight ones at
/// their next checkpoint and nothing more of it is committed. When no other process follows the job, this one
/// writes its summary (status `cancelled`, no `_SUCCESS`) at once;
/// otherwise the follower does, and its `run` exits 6.
pub async fn cancel_job(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    reason: &str,
) -> Result<Cancelled, RunError> {
    let job = store.job(job_id).await?.ok_or_else(|| {
        RunError::UnknownJob(format!(
            "no job \"{job_id}\" in {}; job ids look like <name>-<hash>, as `batchfleet run` and `batchfleet jobs` print them",
            store.describe()
        ))
    })?;
    let cancelled = store.fail_job(job_id, "cancelled", reason).await?;
    if cancelled {
        // Its queued items go at once, and workers stop consuming its queue
        // (without a broker, workers skip them as they come).
        match cfg.connections.broker("batchfleet cancel").await {
            Ok(broker) => {
                crate::dispatcher::retire_job(
                    store,
                    &*broker,
                    &job.pool,
                    job_id,
                    cfg.connections.signing_key.as_ref(),
                )
                .await;
                broker.close("bye").await;
            }
            Err(e) => {
                batchfleet_shared::retire::unlist(store, &job.pool, job_id).await;
                tracing::warn!(job = %job_id, error = %e, "cancelled, but could not purge the job's queue; workers skip its items as they come");
            }
        }
    }
    let mut summary = None;
    let me = follower_id();
    if cancelled
        && store
            .follow_lease(job_id, &me, crate::monitor::FOLLOW_TTL)
            .await?
    {
        // Nobody follows it: reduce it here, once.
        if store
            .claim_reduce(job_id, &me, cfg.supervise.reduce_stale)
            .await?
        {
            let mut supervisor = crate::supervisor::Supervisor::new(job_id, cfg, None, None);
            supervisor.remember(&job);
            if let RunOutcome::Completed { summary: s, .. } =
                reduce(cfg, store, job_id, &mut supervisor, &me).await?
            {
                summary = Some(s);
            }
        }
        let _ = store.release_follow(job_id, &me).await;
    }
    let status = store
        .job(job_id)
        .await?
        .map_or_else(|| job.status.to_string(), |j| j.status.to_string());
    Ok(Cancelled {
        job_id: job_id.to_owned(),
        cancelled,
        status,
        summary,
    })
}

/// Who this process is to the store, as a follower of jobs.
pub fn follower_id() -> String {
    let host = batchfleet_shared::host_name().unwrap_or_else(|| "coordinator".into());
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{host}-{}-{n}", std::process::id())
}

async fn follow_with_as(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    shutdown: CancellationToken,
    supervisor: &mut crate::supervisor::Supervisor,
    me: &str,
) -> Result<RunOutcome, RunError> {
    let followed =
        crate::monitor::follow(store, job_id, cfg, shutdown.clone(), supervisor, me).await;
    let outcome = match followed {
        Ok(crate::monitor::Followed::Interrupted) => Ok(RunOutcome::Interrupted {
            job_id: job_id.to_owned(),
        }),
        Ok(_) => finish_followed(cfg, store, job_id, shutdown, supervisor, me).await,
        Err(e) => Err(e),
    };
    let _ = store.release_follow(job_id, me).await;
    outcome
}

/// The end of a followed job: exactly one of its followers (or a
/// `supervise` process) claims the reduce step — summary, `_SUCCESS`,
/// merge, `[on_complete]` — and the others wait for its summary.
async fn finish_followed(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    shutdown: CancellationToken,
    supervisor: &mut crate::supervisor::Supervisor,
    me: &str,
) -> Result<RunOutcome, RunError> {
    let mut told = false;
    loop {
        if store
            .claim_reduce(job_id, me, cfg.supervise.reduce_stale)
            .await?
        {
            return reduce(cfg, store, job_id, supervisor, me).await;
        }
        let job = store.job(job_id).await?;
        let output = match &job {
            Some(j) if is_reduced(j) => Some(PathBuf::from(&j.output_dir)),
            Some(_) => None,
            // Its state expired under us: the summary is what stays.
            None => supervisor.output_dir(),
        };
        if let Some(out) = output {
            let path = batchfleet_shared::output::summary_in(&out);
            let report = crate::reducer::read_summary(&path)?;
            return Ok(RunOutcome::Completed {
                job_id: job_id.to_owned(),
                summary: path,
                report: Box::new(report),
            });
        }
        if !std::mem::replace(&mut told, true) {
            tracing::info!(job = %job_id, "another process is writing the job's summary; waiting for it");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(RunOutcome::Interrupted { job_id: job_id.to_owned() }),
            _ = tokio::time::sleep(cfg.poll_interval) => {}
        }
    }
}

/// Whether a job's reduce step is done: a final status, written with its
/// finish time (the reducer's last step).
pub fn is_reduced(job: &batchfleet_shared::store::JobRecord) -> bool {
    use batchfleet_shared::store::JobStatus;
    !matches!(job.status, JobStatus::Planning | JobStatus::Running) && job.finished_ms > 0
}

/// The reduce step, by the one process that claimed it (as `me`). The
/// claim is renewed while the step runs — a merge of a large output or a
/// long `[on_complete]` command may outlast `reduce_stale` — so no other
/// process takes it over and runs the step (and its hooks) again.
async fn reduce(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    supervisor: &mut crate::supervisor::Supervisor,
    me: &str,
) -> Result<RunOutcome, RunError> {
    let stale = cfg.supervise.reduce_stale;
    let renewing = tokio::spawn({
        let (store, job, me) = (store.clone(), job_id.to_owned(), me.to_owned());
        async move {
            let mut tick = tokio::time::interval(stale / 4);
            tick.tick().await; // the first tick is now: the claim is fresh
            loop {
                tick.tick().await;
                match store.claim_reduce(&job, &me, stale).await {
                    Ok(true) => {}
                    // Reduced (the step's last write), or lost to another.
                    Ok(false) => return,
                    Err(e) => {
                        tracing::warn!(job = %job, error = %e, "could not renew the reduce claim; trying again")
                    }
                }
            }
        }
    });
    let done = reduce_claimed(cfg, store, job_id, supervisor).await;
    renewing.abort();
    done
}

async fn reduce_claimed(
    cfg: &RunConfig,
    store: &Store,
    job_id: &str,
    supervisor: &mut crate::supervisor::Supervisor,
) -> Result<RunOutcome, RunError> {
    let spec = match supervisor.spec().await {
        Ok(spec) => Some(spec),
        Err(e) => {
            tracing::warn!(job = %job_id, error = %e, "cannot validate the job's manifest again: its summary is written without its [on_complete] hooks");
            None
        }
    };
    let output = spec
        .as_ref()
        .map(|s| s.task.output.clone())
        .unwrap_or_default();
    let shadow = spec
        .as_ref()
        .and_then(|s| s.task.shadow.as_ref())
        .map(|s| s.model.clone());
    let (summary, mut report) =
        crate::reducer::finish(store, job_id, &output, shadow.as_ref()).await?;
    // Ended: its queue goes, and the pool's workers stop consuming it.
    match cfg.connections.broker("batchfleet reducer").await {
        Ok(broker) => {
            crate::dispatcher::retire_job(
                store,
                &*broker,
                &report.pool,
                job_id,
                cfg.connections.signing_key.as_ref(),
            )
            .await;
            broker.close("bye").await;
        }
        Err(e) => {
            batchfleet_shared::retire::unlist(store, &report.pool, job_id).await;
            tracing::warn!(job = %job_id, error = %e, "no broker to purge the job's queue: a later retire in the pool deletes it");
        }
    }
    if let Some(spec) = spec.filter(|s| s.on_complete != crate::manifest::OnComplete::default()) {
        let body = batchfleet_shared::source::fs::read(&summary).unwrap_or_default();
        let cwd = spec
            .manifest_path
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        report.on_complete = Some(
            crate::hooks::run(
                &spec.on_complete,
                &cfg.connections.hooks,
                job_id,
                &report.status,
                &summary,
                &body,
                &cwd,
            )
            .await,
        );
        crate::reducer::rewrite(&summary, &report)?;
    }
    // Last: followers waiting for the summary read it complete.
    crate::reducer::mark_finished(store, &report, cfg.connections.retention).await?;
    Ok(RunOutcome::Completed {
        job_id: job_id.to_owned(),
        summary,
        report: Box::new(report),
    })
}
