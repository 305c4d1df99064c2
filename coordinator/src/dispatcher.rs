//! Registers a job in Redis and publishes its work items with publisher confirms.
//!
//! Order matters for resumability: the job record (with planned totals) is
//! written before the first publish, and after each confirmed chunk the
//! record's `items_published` watermark moves on. A coordinator that died
//! anywhere (planning, mid-publish, waiting) and is started again re-plans
//! identically, publishes only what was never confirmed (plus items that
//! failed for good, which a re-run retries), and leaves items already queued
//! or in flight alone: running the same manifest again never duplicates work.
//! (Up to one chunk confirmed just before a crash may be published twice;
//! the done set makes the second copy a no-op.)

use crate::config::RunConfig;
use crate::error::RunError;
use crate::manifest::JobSpec;
use crate::planner;
use batchfleet_shared::broker::{Broker, PoolQueues};
use batchfleet_shared::store::{JobStatus, RecordUpdate, Store};
use std::path::{Path, PathBuf};

pub use batchfleet_shared::output::{OWNER_FILE, SUCCESS_FILE};

/// Items encoded and published per batch of confirms (and per watermark step).
const PUBLISH_CHUNK: usize = 1024;

/// What dispatching found or did.
#[derive(Debug)]
pub enum Dispatched {
    /// The job is complete already; nothing was published.
    AlreadyCompleted {
        /// Its summary.
        summary: PathBuf,
    },
    /// Items are in the queue (now or from an earlier run).
    Running {
        /// The job's plan.
        plan: std::sync::Arc<planner::Plan>,
    },
}

/// Claims the output folder for `job_id`, refusing one that holds another job's output.
pub fn claim_output_dir(dir: &Path, job_id: &str) -> Result<bool, RunError> {
    let owner = dir.join(OWNER_FILE);
    match batchfleet_shared::source::fs::read_to_string(&owner) {
        Ok(existing) if existing.trim() == job_id => {
            batchfleet_shared::output::adopt_legacy_layout(dir);
            return Ok(true);
        }
        Ok(existing) => {
            return Err(RunError::Manifest(crate::manifest::ManifestError {
                file: dir.to_owned(),
                problems: vec![crate::manifest::Problem {
                    field: "[output] dir".into(),
                    message: format!(
                        "holds the output of job {} (see {}), and this manifest describes job {job_id}: its settings, its model or its input files changed since (a file rewritten in place changes the job too, and `batchfleet plan` shows the new id); point [output] dir at a new folder (`--set output.dir=…`), or remove the old output",
                        existing.trim(),
                        owner.display()
                    ),
                }],
            }))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(RunError::io(format!("read {}", owner.display()), e)),
    }
    let has_parts = batchfleet_shared::source::fs::list_dir(dir)
        .map_err(RunError::io_while(format!("list {}", dir.display())))?
        .iter()
        .any(|name| name.starts_with("part-"));
    if has_parts {
        return Err(RunError::Manifest(crate::manifest::ManifestError {
            file: dir.to_owned(),
            problems: vec![crate::manifest::Problem {
                field: "[output] dir".into(),
                message: "already holds part files of unknown origin; point [output] dir at an empty or new folder".into(),
            }],
        }));
    }
    batchfleet_shared::source::fs::create_dir_all(dir).map_err(RunError::io_while(format!(
        "create output folder {}",
        dir.display()
    )))?;
    batchfleet_shared::fsutil::publish_atomically(&dir.join(OWNER_FILE), true, |w| {
        use std::io::Write;
        writeln!(w, "{job_id}")
    })
    .map_err(RunError::io_while(format!("write {}", owner.display())))?;
    Ok(false)
}

/// A new job whose `[job] deadline` is a time already past is refused
/// before anything is written (a job run again keeps it: it is followed
/// to its end, late).
fn refuse_past_deadline(spec: &JobSpec, now_ms: u64) -> Result<(), RunError> {
    match spec.deadline {
        Some(crate::manifest::Deadline::At(at)) if at <= now_ms => {
            Err(RunError::Manifest(crate::manifest::ManifestError {
                file: spec.manifest_path.clone(),
                problems: vec![crate::manifest::Problem {
                    field: "[job] deadline".into(),
                    message: format!(
                        "{} is already past; give a later time, or a duration such as \"2h\"",
                        crate::pace::rfc3339(at)
                    ),
                }],
            }))
        }
        _ => Ok(()),
    }
}

/// Registers the job (or finds it) and publishes every item not yet done.
/// `submitted_ms` (when `batchfleet run` started) becomes the job's start time.
pub async fn dispatch(
    cfg: &RunConfig,
    spec: &JobSpec,
    store: &Store,
    broker: &dyn Broker,
    submitted_ms: u64,
) -> Result<Dispatched, RunError> {
    let out = spec.output_dir();
    let summary = batchfleet_shared::output::summary_in(out);
    let existing = store.job(&spec.job_id).await?;
    if existing
        .as_ref()
        .is_some_and(|j| j.status == JobStatus::Completed)
    {
        tracing::info!(job = %spec.job_id, "job already completed; nothing to publish");
        return Ok(Dispatched::AlreadyCompleted { summary });
    }
    if existing.is_none()
        && batchfleet_shared::source::fs::exists(&out.join(SUCCESS_FILE)).unwrap_or(false)
        && summary_job_id(&summary).as_deref() == Some(spec.job_id.as_str())
    {
        tracing::info!(job = %spec.job_id, "output folder holds this job's completed output; nothing to publish");
        return Ok(Dispatched::AlreadyCompleted { summary });
    }
    if existing.is_none() {
        refuse_past_deadline(spec, submitted_ms)?;
    }
    let ours_already = claim_output_dir(out, &spec.job_id)?;
    if let Some(incremental) = &cfg.since {
        crate::since::write(out, incremental)?;
    }

    let plan = planner::plan(spec)?;
    tracing::info!(job = %spec.job_id, items = plan.items.len(), rows = plan.rows_total, "planned");
    // Items below the watermark are in the queue or in flight already; the
    // ones that failed for good (or were skipped by a failed job) are not.
    let mut watermark = 0u64;
    let mut again = std::collections::HashSet::new();
    let created_ms = existing.as_ref().map_or(submitted_ms, |j| j.created_ms);
    match existing {
        Some(job) => {
            if job.items_total != plan.items.len() as u64 || job.rows_total != plan.rows_total {
                return Err(RunError::InputChanged {
                    job: spec.job_id.clone(),
                    planned_items: job.items_total,
                    planned_rows: job.rows_total,
                    items: plan.items.len() as u64,
                    rows: plan.rows_total,
                });
            }
            tracing::info!(job = %spec.job_id, done = job.items_done, published = job.items_published, "resuming job");
            // Running again: its state must not expire under it.
            store.persist_job(&spec.job_id).await?;
            // A failed or cancelled job's queued items were skipped: every
            // item not done is published again.
            if !matches!(job.status, JobStatus::Failed | JobStatus::Cancelled) {
                watermark = job.items_published;
            }
            again.extend(store.failures(&spec.job_id).await?.iter().map(|f| f.seq));
            // Items that failed before are published again below; forget the
            // old verdicts so they do not count as settled.
            store.clear_failures(&spec.job_id).await?;
            store.clear_unable_notes(&spec.job_id).await?;
            // Only the status (and whether to merge, which the manifest may
            // have changed): the done counters belong to the workers' commits.
            store
                // A new run of the job: it is reduced again.
                .update_job(
                    &spec.job_id,
                    &RecordUpdate::Rerun {
                        merge: spec.merge,
                        max_crashes: spec.budget.max_crashes,
                        orphan_grace_ms: batchfleet_shared::store::grace_ms(
                            cfg.supervise.orphan_grace,
                        ),
                    },
                )
                .await?;
        }
        None => {
            let mut record = crate::record::job_record(spec, &plan, submitted_ms);
            // Workers before the bitmap done set know only the set.
            record.done_bits = !cfg.connections.whole_messages;
            // How long this coordinator trusts a worker's word that it holds
            // the job's deliveries: workers say it again every half of it.
            record.orphan_grace_ms = batchfleet_shared::store::grace_ms(cfg.supervise.orphan_grace);
            store.put_job(&record).await?;
            store
                .put_inputs(&spec.job_id, &crate::record::input_fields(spec, &plan))
                .await?;
            if ours_already {
                seed_from_outputs(spec, &plan, store).await?;
            }
        }
    }

    // Stored once per job (again on a resume: a newer coordinator may
    // encode it another way): the messages name it by digest.
    store.put_task(&spec.job_id, &plan.task).await?;
    let done = store.done_items(&spec.job_id).await?;
    let queues = PoolQueues::new(&spec.pool);
    broker.declare(&queues).await?;
    // The job's own queue, listed among the pool's active jobs with its
    // weight: workers share their time among the active jobs by weight.
    // (Run again, the queue of its last run is no longer to be deleted.)
    let was_retired = store.forget_retired(&spec.pool, &spec.job_id).await?;
    broker.declare_job(&queues, &spec.job_id).await?;
    store
        .update_job(
            &spec.job_id,
            &RecordUpdate::Priority(spec.priority.as_str().to_owned()),
        )
        .await?;
    // As the manifest says now; a duration counts from the job's first run.
    store
        .update_job(
            &spec.job_id,
            &RecordUpdate::Deadline {
                deadline_ms: spec.deadline.map_or(0, |d| d.at_ms(created_ms)),
                worker_hour_cost: spec.worker_hour_cost,
            },
        )
        .await?;
    // The pool's workers hear of the job now and consume its queue while
    // its items are published.
    list_and_announce(
        store,
        broker,
        &queues,
        &spec.job_id,
        spec.priority.weight(),
        was_retired,
    )
    .await?;
    let job_queue = queues.job(&spec.job_id);
    // Encoded a chunk at a time: bounded memory for jobs of millions of items.
    let mut published = 0;
    let mut end = 0u64;
    let job_items = plan.items.len();
    let rows_per_item = plan.rows_total / (job_items.max(1) as u64);
    for chunk in plan.items.chunks(PUBLISH_CHUNK) {
        end += chunk.len() as u64;
        let todo: Vec<_> = chunk
            .iter()
            .filter(|item| {
                !done.contains(&item.seq)
                    && (u64::from(item.seq) >= watermark || again.contains(&item.seq))
            })
            .collect();
        if todo.is_empty() {
            continue;
        }
        let messages = cfg
            .connections
            .work_messages(&todo, job_items, rows_per_item);
        broker
            .publish(&job_queue, messages, cfg.publish_window)
            .await?;
        published += todo.len() as u64;
        if end > watermark {
            store
                .update_job(&spec.job_id, &RecordUpdate::Published(end))
                .await?;
        }
        crash_point(published);
    }
    tracing::info!(job = %spec.job_id, published, skipped_done = done.len(), already_queued = watermark, queue = %job_queue, priority = spec.priority.as_str(), "items published and confirmed");
    // Running now — unless a worker found meanwhile that nobody can run it.
    store
        .mark_published(
            &spec.job_id,
            batchfleet_shared::now_ms(),
            plan.items.len() as u64,
        )
        .await?;
    Ok(Dispatched::Running {
        plan: std::sync::Arc::new(plan),
    })
}

/// A job the store does not know whose output folder it owns already (a
/// `--local` run killed and run again, or a store that lost its data while
/// no coordinator was running): the items whose part files are there are
/// committed from the files — the output folder is the source of truth —
/// so that they are not published, let alone computed, again.
async fn seed_from_outputs(
    spec: &JobSpec,
    plan: &planner::Plan,
    store: &Store,
) -> Result<(), RunError> {
    let found = crate::record::scan_job_outputs(spec, plan, |_| true, false).await?;
    let committed = crate::record::commit_found(store, &spec.job_id, &found).await?;
    if committed > 0 {
        tracing::info!(job = %spec.job_id, items = committed, "resuming from the output folder: these items are committed there already");
    }
    Ok(())
}

/// Testing aid: `BATCHFLEET_DEBUG_CRASH_AFTER_PUBLISHED=N` kills the
/// coordinator (abort, as a crash would) once N items are confirmed, to
/// exercise a resume from mid-publish.
fn crash_point(published: u64) {
    let limit = std::env::var("BATCHFLEET_DEBUG_CRASH_AFTER_PUBLISHED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    if limit.is_some_and(|n| published >= n) {
        eprintln!("crash point reached after {published} published items (BATCHFLEET_DEBUG_CRASH_AFTER_PUBLISHED)");
        std::process::abort();
    }
}

/// Lists job `job` (its queue declared) among its pool's active jobs with
/// `weight`, and announces it with that weight. `was_retired`: the job took
/// its retired note back
/// ([`batchfleet_shared::store::JobStore::forget_retired`]), so once listed
/// it waits until no sweep holds its queue and declares the queue again — a
/// sweep that read the active jobs before the job was listed may have
/// deleted it. (A job with no note has no sweep that could delete its
/// queue.) For a run, a replay and a rebuild alike.
pub(crate) async fn list_and_announce(
    store: &Store,
    broker: &dyn Broker,
    queues: &PoolQueues,
    job: &str,
    weight: u32,
    was_retired: bool,
) -> Result<(), RunError> {
    store.activate_job(&queues.pool, job, weight).await?;
    if was_retired {
        batchfleet_shared::retire::after_sweeps(store, job).await?;
        broker.declare_job(queues, job).await?;
    }
    announce(broker, queues, job, weight).await;
    Ok(())
}

/// Announces job `job` to the pool's workers (see [`Broker::announce`]),
/// with the `weight` it is listed with among the pool's active jobs: a
/// worker that hears it consumes the job's queue at once, without reading
/// the list. Best effort: a worker that does not hear it finds the job at
/// its next look at the pool's active jobs, within seconds.
async fn announce(broker: &dyn Broker, queues: &PoolQueues, job: &str, weight: u32) {
    let notice = batchfleet_shared::broker::Notice::new(job, weight);
    if let Err(e) = broker.announce(queues, &notice).await {
        tracing::warn!(job, error = %e, "could not announce the job; workers find it at their next look at the pool's active jobs");
    }
}

/// The job ended (summary written) or was cancelled: off the pool's active
/// jobs, its queue deleted a grace later with whatever is left in it
/// (copies of items that are settled) — see [`batchfleet_shared::retire`];
/// then its end announced to the pool's workers (signed with `key` where
/// the pool's messages are), which let go of its queue and forget its
/// facts at once instead of at their next look. Best effort: a worker that
/// does not hear it learns the same from its next look at the pool's
/// active jobs.
pub async fn retire_job(
    store: &Store,
    broker: &dyn Broker,
    pool: &str,
    job: &str,
    key: Option<&batchfleet_shared::signing::SigningKey>,
) {
    batchfleet_shared::retire::retire(store, broker, pool, job).await;
    let notice = batchfleet_shared::broker::Notice::end(job, batchfleet_shared::now_ms(), key);
    if let Err(e) = broker.announce(&PoolQueues::new(pool), &notice).await {
        tracing::debug!(job, error = %e, "could not announce the job's end; workers learn it at their next look at the pool's active jobs");
    }
}

fn summary_job_id(path: &Path) -> Option<String> {
    let text = batchfleet_shared::source::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("job_id")?.as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_shared::endpoint::Endpoint;
    use batchfleet_shared::secret::SecretUrl;
    use batchfleet_testkit::services::{
        amqp, delete_redis_prefix, ensure_local, redis_cli, unique,
    };
    use std::time::Duration;

    async fn store(url: &str, prefix: &str) -> Store {
        Store::connect(
            &Endpoint::redis(SecretUrl::new(url)),
            prefix,
            Duration::from_secs(10),
        )
        .await
        .expect("redis")
    }

    /// A job that cannot be taken off its pool's active jobs keeps its
    /// queue: workers consume the queues of the jobs listed active, and a
    /// listed job without its queue would only send them looking for it.
    /// Here Redis refuses the `HDEL` (a user whose ACL denies it); a retire
    /// that can take the job off the list then notes it retired, and a
    /// sweep deletes the queue.
    #[tokio::test]
    async fn retire_job_deletes_a_queue_only_once_its_job_is_off_the_list() {
        ensure_local().expect("RabbitMQ and Redis available");
        let pool = unique("retire");
        let prefix = unique("bftest-retire");
        let user = unique("bf-no-hdel");
        let job = "job-00000000";
        redis_cli(&[
            "ACL",
            "SETUSER",
            &user,
            "on",
            ">pw-retire",
            "~*",
            "&*",
            "+@all",
            "-hdel",
        ])
        .expect("ACL SETUSER");
        let full = store("redis://127.0.0.1:6379", &prefix).await;
        let limited = store(&format!("redis://{user}:pw-retire@127.0.0.1:6379"), &prefix).await;
        let broker =
            batchfleet_shared::broker::connect(&amqp(), "retire-test", Duration::from_secs(10))
                .await
                .expect("rabbitmq");
        let queues = PoolQueues::new(&pool);
        broker.declare(&queues).await.expect("declare");
        broker
            .declare_job(&queues, job)
            .await
            .expect("declare the job's queue");
        full.activate_job(&pool, job, 1).await.expect("listed");

        retire_job(&limited, &*broker, &pool, job, None).await;
        assert!(
            full.active_jobs(&pool)
                .await
                .expect("list")
                .contains_key(job),
            "the HDEL was refused: still listed"
        );
        assert!(
            broker
                .ready_count(&queues.job(job))
                .await
                .expect("count")
                .is_some(),
            "a job still listed keeps its queue"
        );

        retire_job(&full, &*broker, &pool, job, None).await;
        assert!(!full
            .active_jobs(&pool)
            .await
            .expect("list")
            .contains_key(job));
        assert!(
            broker
                .ready_count(&queues.job(job))
                .await
                .expect("count")
                .is_some(),
            "off the list, its queue stays for the grace"
        );
        batchfleet_shared::retire::sweep(&full, &*broker, &pool, Duration::ZERO).await;
        assert_eq!(
            broker.ready_count(&queues.job(job)).await.expect("count"),
            None,
            "noted retired, its queue is deleted by a sweep past the grace"
        );
        let _ = redis_cli(&["ACL", "DELUSER", &user]);
        let _ = broker.delete_pool(&queues).await;
        broker.close("bye").await;
        delete_redis_prefix(&prefix);
    }
}
