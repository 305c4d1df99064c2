//! `batchfleet run --local`: the coordinator and N worker pipelines in one
//! process, over the in-process queues and job store
//! ([`batchfleet_shared::broker::local`], [`batchfleet_shared::store::local`])
//! instead of RabbitMQ and Redis.
//!
//! Everything else is the fleet's own code: the same validation, planning,
//! dispatcher, supervisor, reducer and hooks, and each pipeline is
//! [`batchfleet_worker::run_on`] — reader, libtorch runner and writer —
//! consuming the same queues with the same settlement, retries and dead
//! letters. What differs:
//! - Nothing outlives the process but the output folder. Killed and run
//!   again, a job resumes from its committed part files (see
//!   `dispatcher::seed_from_outputs`): nothing is computed twice.
//! - Dead-lettered items are written to `<output>/_dead/` with their reasons
//!   (as well as listed in `_summary.json`); `batchfleet dlq list --local`
//!   reads them and `batchfleet dlq replay --local` runs them again.

use crate::config::RunConfig;
use crate::dlq::DeadItem;
use crate::error::RunError;
use crate::job::RunOutcome;
use crate::manifest::JobSpec;
#[cfg(feature = "local")]
use batchfleet_shared::backend::{Backend, LocalServices};
use batchfleet_shared::output::DEAD_DIR;
use batchfleet_shared::source::fs;
use std::path::Path;
#[cfg(feature = "local")]
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

/// How many pipelines, and how many libtorch threads each.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// Worker pipelines (each with its own model and runner thread).
    pub workers: usize,
    /// libtorch intra-op threads per pipeline.
    pub threads: usize,
    /// The settings pipeline `i` starts from: entry `i`, or (when missing) a
    /// worker's defaults and `BATCHFLEET_*` variables. The run sets the
    /// pool, the id, the threads and the data roots.
    #[cfg(feature = "local")]
    pub worker_settings: Vec<batchfleet_worker::WorkerConfig>,
}

impl LocalOptions {
    /// The given counts, with defaults filled in: one pipeline per core,
    /// and the cores shared out between the pipelines.
    pub fn resolve(workers: Option<usize>, threads: Option<usize>) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = workers
            .unwrap_or_else(|| threads.map_or(cores, |t| (cores / t.max(1)).max(1)))
            .max(1);
        let threads = threads.unwrap_or((cores / workers).max(1)).max(1);
        Self {
            workers,
            threads,
            #[cfg(feature = "local")]
            worker_settings: Vec::new(),
        }
    }
}

/// Runs the job of `manifest` in this process (see the module docs).
pub async fn run_job(
    cfg: &RunConfig,
    manifest: &Path,
    opts: LocalOptions,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let submitted_ms = batchfleet_shared::now_ms();
    let spec = cfg.load(manifest, &cfg.overrides)?;
    tracing::info!(job = %spec.job_id, files = spec.files.len(), workers = opts.workers, threads = opts.threads, "manifest valid; running it in this process");
    run_spec(cfg, &spec, opts, submitted_ms, shutdown).await
}

/// [`run_job`] in a build without local mode: an error saying so.
#[cfg(not(feature = "local"))]
pub async fn run_spec(
    _cfg: &RunConfig,
    _spec: &JobSpec,
    _opts: LocalOptions,
    _submitted_ms: u64,
    _shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    Err(RunError::NoLocalMode)
}

/// [`run_job`] for a manifest validated already.
#[cfg(feature = "local")]
pub async fn run_spec(
    cfg: &RunConfig,
    spec: &JobSpec,
    opts: LocalOptions,
    submitted_ms: u64,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let services = LocalServices::new();
    let mut cfg = cfg.clone();
    cfg.connections.backend = Backend::Local(services.clone());
    let roots = if cfg.data_roots.is_empty() {
        vec![spec
            .manifest_path
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)]
    } else {
        cfg.data_roots.clone()
    };
    let stop = CancellationToken::new();
    let mut workers = tokio::task::JoinSet::new();
    for i in 0..opts.workers {
        let wcfg = worker_config(spec, i, &opts, &roots)?;
        let backend = Backend::Local(services.clone());
        workers.spawn(batchfleet_worker::run_on(wcfg, backend, stop.clone()));
    }
    let outcome = tokio::select! {
        outcome = crate::job::run_spec(&cfg, spec, submitted_ms, shutdown) => outcome,
        why = all_ended(&mut workers) => Err(RunError::LocalWorkers(format!(
            "every local worker pipeline stopped before the job ended: {why}"
        ))),
    };
    stop.cancel();
    while let Some(ended) = workers.join_next().await {
        match ended {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "a local worker pipeline failed")
            }
            Err(e) => tracing::warn!(error = %e, "a local worker pipeline panicked"),
        }
    }
    if matches!(outcome, Ok(RunOutcome::Completed { .. })) {
        // The job settled: checkpoint segments a slower copy wrote while the
        // pipelines drained belong to items committed elsewhere, and so do
        // its staged files.
        batchfleet_shared::output::remove_leftovers(spec.output_dir());
    }
    // Only a settled run knows every dead item: an interrupted or failed
    // one adds its own and keeps the earlier run's.
    let settled = matches!(outcome, Ok(RunOutcome::Completed { .. }));
    if let Err(e) = write_dead(spec, &services, settled).await {
        tracing::warn!(error = %e, "could not write the dead-lettered items to {DEAD_DIR}/");
    }
    outcome
}

/// The settings of pipeline `i` (see [`LocalOptions::worker_settings`]).
#[cfg(feature = "local")]
fn worker_config(
    spec: &JobSpec,
    i: usize,
    opts: &LocalOptions,
    roots: &[PathBuf],
) -> Result<batchfleet_worker::WorkerConfig, RunError> {
    let base = match opts.worker_settings.get(i) {
        Some(cfg) => cfg.clone(),
        None => batchfleet_worker::WorkerConfig::from_env()
            .map_err(|e| RunError::LocalWorkers(format!("local worker settings: {e}")))?,
    };
    Ok(base.for_pipeline(&spec.pool, i, opts.threads, roots))
}

/// Waits until every pipeline has ended; what the last one said.
#[cfg(feature = "local")]
async fn all_ended(
    workers: &mut tokio::task::JoinSet<anyhow::Result<batchfleet_worker::Exit>>,
) -> String {
    let mut last = "no pipeline started".to_owned();
    while let Some(ended) = workers.join_next().await {
        last = match ended {
            Ok(Ok(exit)) => format!("{exit:?}"),
            Ok(Err(e)) => format!("{e:#}"),
            Err(e) => e.to_string(),
        };
    }
    last
}

/// A dead item's file name in `_dead/`.
#[cfg(feature = "local")]
fn dead_file(d: &DeadItem, n: usize) -> String {
    match d.item {
        Some(seq) => format!("item-{seq:06}.json"),
        None => format!("message-{}-{n:06}.json", d.dead_at_ms),
    }
}

/// Writes the items now in the dead queue to `<output>/_dead/`; when the
/// run `settled`, also removes those of an earlier run (computed since, or
/// dead again and written anew).
#[cfg(feature = "local")]
async fn write_dead(
    spec: &JobSpec,
    services: &LocalServices,
    settled: bool,
) -> Result<(), RunError> {
    let broker = services.queues.handle();
    let dead = crate::dlq::list(&*broker, &spec.pool, &crate::dlq::Filter::default()).await?;
    broker.close("listed").await;
    let dir = spec.output_dir().join(DEAD_DIR);
    let io = |what: &str, p: &Path, e: std::io::Error| {
        RunError::io(format!("{what} {}", p.display()), e)
    };
    let keep: Vec<String> = dead
        .iter()
        .enumerate()
        .map(|(n, d)| dead_file(d, n))
        .collect();
    match fs::list_dir(&dir) {
        Ok(names) if settled => {
            for name in names
                .iter()
                .filter(|n| n.ends_with(".json") && !keep.contains(n))
            {
                let p = dir.join(name);
                fs::remove_file(&p).map_err(|e| io("remove", &p, e))?;
            }
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("list", &dir, e)),
    }
    if dead.is_empty() {
        return Ok(());
    }
    fs::create_dir_all(&dir).map_err(|e| io("create", &dir, e))?;
    for (d, name) in dead.iter().zip(&keep) {
        let p = dir.join(name);
        let body = serde_json::to_vec_pretty(d).expect("a dead item serializes");
        batchfleet_shared::fsutil::publish_atomically(&p, true, |w| {
            std::io::Write::write_all(w, &body)
        })
        .map_err(|e| io("write", &p, e))?;
    }
    tracing::warn!(items = dead.len(), dir = %dir.display(), "dead-lettered items written");
    Ok(())
}

/// The dead items a `--local` run wrote to `<output>/_dead/`, in file order.
pub fn list_dead(output: &Path) -> Result<Vec<DeadItem>, RunError> {
    let dir = output.join(DEAD_DIR);
    let mut names = match fs::list_dir(&dir) {
        Ok(names) => names,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(RunError::io(format!("list {}", dir.display()), e)),
    };
    names.sort();
    names
        .into_iter()
        .filter(|n| n.ends_with(".json"))
        .map(|name| {
            let p = dir.join(&name);
            let bytes =
                fs::read(&p).map_err(RunError::io_while(format!("read {}", p.display())))?;
            serde_json::from_slice(&bytes).map_err(|e| RunError::NotA {
                path: p.clone(),
                what: "a dead item",
                reason: e.to_string(),
            })
        })
        .collect()
}

/// Runs the dead items of the `--local` job whose output folder is `output`
/// again, in this process: its manifest (named in `_summary.json`) is run
/// with the items committed in the folder taken as done, so only the dead
/// (and any missing) items are computed. With `update_model`, a model file
/// changed since (a fixed one swapped in under the same path) is accepted:
/// the job keeps its id and records the new digest.
pub async fn replay(
    cfg: &RunConfig,
    output: &Path,
    opts: LocalOptions,
    update_model: bool,
    shutdown: CancellationToken,
) -> Result<RunOutcome, RunError> {
    let summary_path = batchfleet_shared::output::summary_in(output);
    let summary = crate::reducer::read_summary(&summary_path).map_err(|e| {
        // What the folder was meant to be.
        RunError::NotA {
            path: output.to_owned(),
            what: "the output folder of a finished `batchfleet run --local` (what `dlq replay --local` takes)",
            reason: e.to_string(),
        }
    })?;
    let dead = list_dead(output)?;
    if dead.is_empty() {
        tracing::info!(output = %output.display(), "no dead items to replay");
    }
    let mut spec = cfg.load_known(Path::new(&summary.manifest), &summary.overrides)?;
    if spec.job_id != summary.job_id {
        if !update_model {
            return Err(RunError::ManifestMoved {
                manifest: summary.manifest,
                now: spec.job_id,
                was: summary.job_id,
                changed: "its input, settings or model changed",
                fix: "restore them, or pass --update-model if only the model file was fixed".into(),
            });
        }
        tracing::warn!(job = %summary.job_id, sha256 = %spec.task.model.sha256, "replaying with the model file as it is now");
        // A model this job never ran: tried as a new job's would be.
        spec = cfg.load(Path::new(&summary.manifest), &summary.overrides)?;
        spec.job_id = summary.job_id.clone();
    }
    run_spec(cfg, &spec, opts, batchfleet_shared::now_ms(), shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_share_the_cores_between_pipelines() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let d = LocalOptions::resolve(None, None);
        assert_eq!(d.workers, cores);
        assert_eq!(d.threads, 1);
        let pick = |w, t| {
            let o = LocalOptions::resolve(w, t);
            (o.workers, o.threads)
        };
        assert_eq!(pick(Some(3), Some(2)), (3, 2));
        assert_eq!(pick(Some(0), Some(0)), (1, 1));
        let one = LocalOptions::resolve(Some(1), None);
        assert_eq!(one.threads, cores);
    }
}
