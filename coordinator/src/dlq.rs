//! The dead-letter queue of a pool: list, replay and purge dead items.
//!
//! Dead items are taken with [`Broker::get`] without acknowledging them;
//! whatever is not replayed or purged returns to the dead queue when it is
//! dropped, so listing never loses an item. A replayed item is published to
//! the work queue (confirmed) *before* its dead copy is acknowledged.
//!
//! A replay signs what it publishes, so it first checks what it reads: a
//! dead message is replayed only if its own signature verifies with the
//! coordinator's key (as a worker checks it), or, with `--trust-unsigned`,
//! if it carries none. A forged one stays dead. `--update-model` hashes
//! only the model file the job's record names.

use crate::error::RunError;
use batchfleet_shared::broker::{Broker, BrokerError, Delivery, Outgoing, PoolQueues};
use batchfleet_shared::message::{
    Envelope, Opened, StoredTask, WorkItem, ATTEMPT_HEADER, CLASS_HEADER, DEAD_AT_HEADER,
    ERROR_HEADER, ITEM_HEADER, JOB_HEADER, WORKER_HEADER,
};
use batchfleet_shared::signing::{SigningKey, SIGNATURE_HEADER};
use batchfleet_shared::store::{ItemFailure, RecordUpdate, Store, TaskLookup};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// One dead item as stored in the dead queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadItem {
    /// Job id (empty if the message could not be decoded).
    pub job: String,
    /// Item seq, if known.
    pub item: Option<u32>,
    /// `poison`, `transient`, `timeout`, `panic`, `rejected` (a forged or
    /// impossible message, never replayed), or `infra` (dead-lettered by the
    /// broker after too many deliveries: workers died on it).
    pub class: String,
    /// Last error.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
    /// Worker that gave up (empty for `infra`).
    pub worker: String,
    /// When it was dead-lettered (ms since epoch; 0 if unknown).
    pub dead_at_ms: u64,
}

/// Which dead items a command applies to.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this job.
    pub job: Option<String>,
    /// Only this class.
    pub class: Option<String>,
    /// Only this item.
    pub item: Option<u32>,
}

impl Filter {
    /// Whether `d` is one of the items the filter names.
    pub fn matches(&self, d: &DeadItem) -> bool {
        self.job.as_ref().is_none_or(|j| *j == d.job)
            && self.class.as_ref().is_none_or(|c| *c == d.class)
            && self.item.is_none_or(|i| Some(i) == d.item)
    }
}

/// A dead message as the dead items it holds: one, or — a bundle the
/// broker dead-lettered — one per item of the bundle.
fn describe_all(msg: &Delivery) -> Vec<DeadItem> {
    let decoded = Envelope::decode(&msg.body).ok().map(Envelope::into_opened);
    let first = describe_opened(msg, decoded.as_ref());
    match decoded {
        Some(Opened::Bundle(b)) if msg.headers.int(ITEM_HEADER).is_none() => b
            .items
            .iter()
            .map(|m| DeadItem {
                item: Some(m.seq),
                ..first.clone()
            })
            .collect(),
        _ => vec![first],
    }
}

fn describe(msg: &Delivery) -> DeadItem {
    let decoded = Envelope::decode(&msg.body).ok().map(Envelope::into_opened);
    describe_opened(msg, decoded.as_ref())
}

/// [`describe`], the body decoded already (`None`: it does not decode).
fn describe_opened(msg: &Delivery, decoded: Option<&Opened>) -> DeadItem {
    let h = &msg.headers;
    let job = h
        .str(JOB_HEADER)
        .filter(|j| !j.is_empty())
        .map(str::to_owned)
        .or_else(|| decoded.map(|i| i.job_id().to_owned()))
        .unwrap_or_default();
    let item = h
        .int(ITEM_HEADER)
        .filter(|i| *i >= 0)
        .map(|i| i as u32)
        .or_else(|| decoded.map(Opened::seq));
    let text = |name| h.str(name).unwrap_or_default().to_owned();
    match h.str(CLASS_HEADER) {
        Some(class) => DeadItem {
            job,
            item,
            class: class.to_owned(),
            error: text(ERROR_HEADER),
            attempts: h.int(ATTEMPT_HEADER).unwrap_or(1).max(0) as u32,
            worker: text(WORKER_HEADER),
            dead_at_ms: h.int(DEAD_AT_HEADER).unwrap_or(0).max(0) as u64,
        },
        // No batchfleet headers: RabbitMQ itself dead-lettered it (delivery limit).
        None => {
            let deliveries = msg.delivery_count();
            DeadItem {
                job,
                item,
                class: "infra".into(),
                error: format!("dead-lettered by the broker after {deliveries} deliveries without a result: workers crashed or were killed while processing it"),
                attempts: h.int(ATTEMPT_HEADER).unwrap_or(1).max(0) as u32,
                worker: String::new(),
                dead_at_ms: 0,
            }
        }
    }
}

/// Takes every message of the dead queue without acknowledging it (what
/// was there when it started: taken messages stay out until dropped).
async fn take_all(broker: &dyn Broker, queue: &str) -> Result<Vec<Delivery>, BrokerError> {
    let Some(count) = broker.ready_count(queue).await? else {
        return Ok(Vec::new()); // no dead queue: nothing ever died in this pool
    };
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        match broker.get(queue).await? {
            Some(m) => out.push(m),
            None => break,
        }
    }
    Ok(out)
}

/// The whole item of a dead message: a version 3 one with its job's
/// stored task (fetched once per job and digest into `tasks`). `None`
/// (with a warning) when the task is gone from Redis: the item stays dead.
async fn whole(
    store: &Store,
    opened: Opened,
    tasks: &mut HashMap<(String, String), batchfleet_shared::message::TaskSpec>,
) -> Result<Vec<WorkItem>, RunError> {
    let r = match opened {
        Opened::Whole(item) => return Ok(vec![item]),
        Opened::Ref(r) => r,
        Opened::Bundle(b) => {
            if let Err(why) = b.check() {
                tracing::warn!(job = %b.job_id, "not replaying a malformed dead bundle ({why})");
                return Ok(Vec::new());
            }
            let mut out = Vec::with_capacity(b.items.len());
            for member in b.members() {
                out.extend(Box::pin(whole(store, Opened::Ref(member), tasks)).await?);
            }
            return Ok(out);
        }
    };
    let key = (r.job_id.clone(), r.task_sha256.clone());
    if let Some(task) = tasks.get(&key) {
        return Ok(vec![r.with_task(task.clone())]);
    }
    let why = match store.task(&r.job_id, &r.task_sha256).await? {
        TaskLookup::Found(bytes) => match StoredTask::open(&bytes, &r.task_sha256) {
            Ok(task) => {
                tasks.insert(key, task.clone());
                return Ok(vec![r.with_task(task)]);
            }
            Err(e) => e.to_string(),
        },
        TaskLookup::NotOfJob => format!("job {} stores no task {}", r.job_id, r.task_sha256),
        TaskLookup::UnknownJob => format!("no job {} in Redis", r.job_id),
    };
    tracing::warn!(job = %r.job_id, item = r.seq, "not replaying a dead item whose task cannot be read ({why}); run the job's manifest again to publish its unfinished items anew");
    Ok(Vec::new())
}

/// Lists the dead items of `pool` that match `filter`.
pub async fn list(
    broker: &dyn Broker,
    pool: &str,
    filter: &Filter,
) -> Result<Vec<DeadItem>, BrokerError> {
    let taken = take_all(broker, &PoolQueues::new(pool).dead()).await?;
    // Dropped unacknowledged: every message returns to the dead queue.
    Ok(taken
        .iter()
        .flat_map(describe_all)
        .filter(|d| filter.matches(d))
        .collect())
}

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Replayed {
    /// Items published to the work queue again, in order.
    pub items: Vec<u32>,
    /// Jobs they belong to.
    pub jobs: Vec<String>,
    /// Dead messages left dead because they could not be trusted (a
    /// signature that does not verify, none where one is required, a model
    /// path the job's record does not name), each with why.
    pub refused: Vec<String>,
}

/// Which dead messages a replay may sign and publish again.
#[derive(Debug, Clone, Copy)]
pub struct Trust<'a> {
    /// The coordinator's signing key: a dead message must carry a
    /// signature that verifies with it.
    pub key: Option<&'a SigningKey>,
    /// Also replay messages that carry no signature (a deployment without
    /// a key, or messages from before one was set). A signature that is
    /// there and does not verify is refused all the same.
    pub unsigned: bool,
}

/// A dead message opened as a worker opens it, its signature checked; why
/// not when it is not to be trusted.
fn verified(msg: &Delivery, trust: Trust<'_>) -> Result<Opened, String> {
    let signature = msg.headers.str(SIGNATURE_HEADER);
    match (trust.key, signature) {
        (Some(key), Some(_)) => batchfleet_shared::message::open(&msg.body, signature, Some(key))
            .map_err(|e| {
                format!("its signature does not verify ({e}): forged, or signed with another key")
            }),
        (_, None) | (None, Some(_)) if trust.unsigned => Envelope::decode(&msg.body)
            .map(Envelope::into_opened)
            .map_err(|e| format!("it does not decode ({e})")),
        (Some(_), None) => Err(
            "it is unsigned (pass --trust-unsigned to replay unsigned messages)".into(),
        ),
        (None, _) => Err(
            "no signing key is set to check it with (set the coordinator's signing key, or pass --trust-unsigned to replay unverified messages)"
                .into(),
        ),
    }
}

/// Publishes the matching dead items of `pool` to its work queue with the
/// attempt count reset (signed with `key` when set), acknowledging each dead
/// copy only after the publish is confirmed. Their jobs are marked running
/// first, so no worker finds a replayed item's job finished. With
/// `update_model`, the model digest in each item — and in the job record —
/// is replaced by the current digest of its file (for replays after a fixed
/// model was swapped in under the same path): only the file the job's record
/// names is read, and an item naming another is refused. Rejected messages
/// (forged or impossible) are never replayed, nor any that `trust` does not
/// admit: those stay dead, each named in [`Replayed::refused`].
pub async fn replay(
    broker: &dyn Broker,
    store: &Store,
    pool: &str,
    filter: &Filter,
    update_model: bool,
    trust: Trust<'_>,
) -> Result<Replayed, RunError> {
    let queues = PoolQueues::new(pool);
    let taken = take_all(broker, &queues.dead()).await?;
    let mut digests: HashMap<String, String> = HashMap::new();
    let mut models: HashMap<String, Option<String>> = HashMap::new();
    let mut tasks = HashMap::new();
    let mut stored_anew = Vec::new();
    let mut chosen = Vec::new();
    let mut rejected = 0;
    let mut refused = Vec::new();
    for msg in &taken {
        // A dead bundle is replayed whole when any of its items matches.
        let Some(dead) = describe_all(msg).into_iter().find(|d| filter.matches(d)) else {
            continue;
        };
        if dead.class == "rejected" {
            rejected += 1;
            continue;
        }
        let name = format!(
            "item {} of job {}",
            dead.item.map_or("?".to_owned(), |i| i.to_string()),
            dead.job
        );
        let opened = match verified(msg, trust) {
            Ok(opened) => opened,
            Err(why) => {
                tracing::warn!(
                    "not replaying dead {name}: {why}; it stays dead (`dlq purge` removes it)"
                );
                refused.push(format!("{name}: {why}"));
                continue;
            }
        };
        let items = whole(store, opened, &mut tasks).await?;
        let before = chosen.len();
        for mut item in items {
            if update_model {
                // Only the model file the coordinator registered for the job.
                let recorded = match models.get(&item.job_id) {
                    Some(m) => m.clone(),
                    None => {
                        let m = store.job(&item.job_id).await?.map(|r| r.model);
                        models.insert(item.job_id.clone(), m.clone());
                        m
                    }
                };
                if recorded.as_deref() != Some(item.task.model.path.as_str()) {
                    let why = match recorded {
                        Some(m) => format!(
                            "it names model {} but job {} was run with {m}; --update-model reads only the file the job's record names",
                            item.task.model.path, item.job_id
                        ),
                        None => format!(
                            "job {} is not in Redis, so there is no recorded model to update it to",
                            item.job_id
                        ),
                    };
                    tracing::warn!("not replaying dead {name}: {why}");
                    refused.push(format!("{name}: {why}"));
                    continue;
                }
                let path = item.task.model.path.clone();
                let sha = match digests.get(&path) {
                    Some(s) => s.clone(),
                    None => {
                        let local = std::path::Path::new(&path);
                        let s = if batchfleet_shared::source::is_url(local) {
                            // The object as it is now, into this machine's cache.
                            batchfleet_shared::pinned::cache()
                                .fetch(&path)
                                .map(|(_, sha)| sha)
                        } else {
                            batchfleet_shared::fsutil::sha256_file(local)
                        }
                        .map_err(RunError::io_while(format!(
                            "read model {path} to update its digest"
                        )))?;
                        digests.insert(path.clone(), s.clone());
                        s
                    }
                };
                item.task.model.sha256 = sha;
                if item.task_sha256.is_some() {
                    // The task changed: stored under its new digest, once.
                    let stored = StoredTask::of(&item.task);
                    if !stored_anew.contains(&(item.job_id.clone(), stored.sha256.clone())) {
                        store.put_task(&item.job_id, &stored).await?;
                        stored_anew.push((item.job_id.clone(), stored.sha256.clone()));
                    }
                    item.task_sha256 = Some(stored.sha256);
                }
            }
            let dead = DeadItem {
                item: Some(item.seq),
                ..dead.clone()
            };
            chosen.push((msg, dead, item, false));
        }
        // The dead message is acknowledged after the last of its items is
        // published.
        if chosen.len() > before {
            if let Some(last) = chosen.last_mut() {
                last.3 = true;
            }
        }
    }
    if rejected > 0 {
        tracing::warn!(rejected, "rejected messages (forged or impossible) are not replayed; `batchfleet dlq purge` removes them");
    }
    let mut out = Replayed {
        refused,
        ..Replayed::default()
    };
    for (_, _, item, _) in &chosen {
        if !out.jobs.contains(&item.job_id) {
            out.jobs.push(item.job_id.clone());
        }
    }
    for job in &out.jobs {
        let sha = chosen
            .iter()
            .find(|(_, _, i, _)| &i.job_id == job)
            .map(|(_, _, i, _)| i.task.model.sha256.clone());
        // Running, and reduced again when the replayed items settle.
        let replayed = RecordUpdate::Replayed {
            model_sha256: sha.filter(|_| update_model),
        };
        store.update_job(job, &replayed).await?;
        // Running again: its state no longer expires, and its queue is back
        // among the pool's active jobs.
        store.persist_job(job).await?;
        broker.declare(&queues).await?;
        let was_retired = store.forget_retired(&queues.pool, job).await?;
        broker.declare_job(&queues, job).await?;
        let priority = store
            .job(job)
            .await?
            .map(|j| j.priority)
            .unwrap_or_default();
        let weight = crate::manifest::Priority::of_record(&priority).weight();
        crate::dispatcher::list_and_announce(store, broker, &queues, job, weight, was_retired)
            .await?;
    }
    for (msg, dead, item, last) in chosen {
        // Forget the failure first, so a fresh failure recorded by a fast
        // worker is not erased after the publish.
        store.clear_failure(&item.job_id, item.seq).await?;
        let outgoing = Outgoing::work_item(&item, 1, trust.key);
        if let Err(e) = broker
            .publish(&queues.job(&item.job_id), vec![outgoing], 1)
            .await
        {
            // Put the failure back: the dead copy stays where it is.
            let failure = ItemFailure {
                seq: item.seq,
                class: dead.class,
                reason: dead.error,
                worker: dead.worker,
                attempt: dead.attempts,
                at_ms: dead.dead_at_ms,
            };
            let _ = store.fail_item(&item.job_id, &failure).await;
            return Err(e.into());
        }
        if last {
            msg.ack().await?;
        }
        out.items.push(item.seq);
    }
    Ok(out)
}

/// Removes dead items: the whole dead queue, or only a job's items. Returns how many.
pub async fn purge(broker: &dyn Broker, pool: &str, job: Option<&str>) -> Result<u64, BrokerError> {
    let queue = PoolQueues::new(pool).dead();
    Ok(match job {
        None => u64::from(broker.purge(&queue).await?),
        Some(job) => {
            let mut n = 0;
            for msg in take_all(broker, &queue).await? {
                if describe(&msg).job == job {
                    msg.ack().await?;
                    n += 1;
                }
            }
            n
        }
    })
}

/// A table for people.
pub fn render(items: &[DeadItem]) -> String {
    use std::fmt::Write;
    let mut s = format!(
        "{:<28} {:>6} {:<10} {:>8} {:<20} {:<24} error\n",
        "job", "item", "class", "attempts", "worker", "dead at (UTC)"
    );
    for d in items {
        let at = if d.dead_at_ms == 0 {
            "-".to_owned()
        } else {
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(d.dead_at_ms),
            )
            .to_string()
        };
        let item = d.item.map_or("-".to_owned(), |i| i.to_string());
        let error: String = d.error.chars().take(160).collect();
        let _ = writeln!(
            s,
            "{:<28} {:>6} {:<10} {:>8} {:<20} {:<24} {}",
            d.job, item, d.class, d.attempts, d.worker, at, error
        );
    }
    let _ = write!(s, "{} dead item(s)", items.len());
    s
}
