//! The Redis implementation of [`JobStore`]: Lua scripts make each step
//! atomic, and lease times come from Redis's own clock (`TIME`).
//!
//! # Layout
//! - this file: [`RedisStore`], each [`JobStore`] operation as commands or a script.
//! - [`connect`]: connections — one server, a Redis Cluster, or the primary
//!   that Sentinels name — and the one connection operations share.
//! - [`keys`]: the key layout (one hash slot per job).
//! - [`scripts`]: the Lua scripts.

mod connect;
mod keys;
mod scripts;

pub use keys::{job_keys_pattern, job_of_key, job_scoped};
pub use scripts::{
    fail_script, lease_script, reduce_script, start_script, COMMIT_SCRIPT, CRASH_SCRIPT,
    FAIL_JOB_SCRIPT, FOLLOW_SCRIPT, PUBLISHED_SCRIPT, UNFOLLOW_SCRIPT,
};

use super::{
    Claim, Commit, ItemFailure, ItemStats, JobFacts, JobRecord, JobStatus, JobStore, Lease, Pace,
    Progress, RecordUpdate, Start, StoreError, TaskLookup, UnableNote, Work,
};
use crate::endpoint::Endpoint;
use connect::{Conn, Connections};
use deadpool_redis::redis::{self, AsyncCommands};
use keys::Keys;
use scripts::Scripts;
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::time::Duration;

fn cmd(op: &'static str) -> impl FnOnce(redis::RedisError) -> StoreError {
    move |e| {
        let reason = e.to_string();
        use redis::{ErrorKind, ServerErrorKind};
        // Lost or refused connections, and the replies of a Redis that is
        // loading its data, a replica not yet promoted, a failover.
        let passing = matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
            )
        );
        if passing
            || e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_timeout()
        {
            StoreError::Unavailable { op, reason }
        } else {
            StoreError::Command { op, reason }
        }
    }
}

/// The numbers of the set bits of a Redis bitmap (bit 0 is the most
/// significant bit of the first byte, as `SETBIT` counts).
fn set_bits(bitmap: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bitmap.iter().enumerate().flat_map(|(i, byte)| {
        (0..8u32)
            .filter(move |b| byte & (0x80 >> b) != 0)
            .map(move |b| i as u32 * 8 + b)
    })
}

/// `value` as JSON, for a Redis field or script argument.
fn encode<T: Serialize + ?Sized>(op: &'static str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Command {
        op,
        reason: e.to_string(),
    })
}

/// Handle to the job state in Redis; cheap to clone.
#[derive(Clone)]
pub struct RedisStore {
    connections: Connections,
    keys: Keys,
    scripts: Scripts,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.keys.prefix())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects and checks the server answers `PING` within `timeout` (see
    /// [`Connections::open`]).
    pub async fn connect(
        endpoint: &Endpoint,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        Ok(Self {
            connections: Connections::open(endpoint, timeout).await?,
            keys: Keys::new(prefix),
            scripts: Scripts::new(),
        })
    }

    /// Key prefix in use.
    pub fn prefix(&self) -> &str {
        self.keys.prefix()
    }

    /// The connection for one operation (see [`Connections::conn`]).
    async fn conn(&self, op: &'static str) -> Result<Conn<'_>, StoreError> {
        self.connections.conn(op).await
    }

    /// The JSON values of a hash keyed by item seq, decoded, in seq order.
    async fn json_by_seq<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
        op: &'static str,
    ) -> Result<Vec<T>, StoreError> {
        let map: BTreeMap<u32, String> = self
            .scan_paged::<_, (u32, String)>("HSCAN", key, op)
            .await?;
        map.values()
            .map(|json| {
                serde_json::from_str(json).map_err(|e| StoreError::Corrupt {
                    key: key.to_owned(),
                    reason: e.to_string(),
                })
            })
            .collect()
    }
}

impl RedisStore {
    /// A whole hash (`HSCAN`: pairs) or set (`SSCAN`: members), read a page
    /// at a time (`COUNT` [`PAGE`]): a hash of a million items' stats is read
    /// in replies that each stay well within the client's response timeout,
    /// where one `HGETALL` would not. An entry the scan returns twice (the
    /// key was rehashed meanwhile) is kept once by the map or set it goes to.
    async fn scan_paged<C, T>(
        &self,
        verb: &str,
        key: &str,
        op: &'static str,
    ) -> Result<C, StoreError>
    where
        C: Default + Extend<T>,
        T: redis::FromRedisValue,
    {
        let mut c = self.conn(op).await?;
        let mut out = C::default();
        let mut cursor = 0u64;
        loop {
            let (next, page): (u64, Vec<T>) = redis::cmd(verb)
                .arg(key)
                .arg(cursor)
                .arg("COUNT")
                .arg(PAGE)
                .query_async(&mut c)
                .await
                .map_err(cmd(op))?;
            out.extend(page);
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }
}

/// Entries asked for per `HSCAN`/`SSCAN` page of a large read.
const PAGE: usize = 2_000;

/// The fields of a job record a work message is checked against
/// ([`JobFacts`]), in the order [`facts_of`] reads them.
const FACT_FIELDS: &[&str] = &[
    "status",
    "pool",
    "model",
    "model_sha256",
    "output_dir",
    "items_total",
    "orphan_grace_ms",
];

/// [`JobFacts`] from an `HMGET` of [`FACT_FIELDS`] of `key`; `None` when
/// the record has no status (no such job).
fn facts_of(key: &str, fields: Vec<Option<String>>) -> Result<Option<JobFacts>, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        key: key.to_owned(),
        reason,
    };
    let [Some(status), pool, model, sha, dir, total, grace] =
        <[Option<String>; 7]>::try_from(fields)
            .map_err(|_| corrupt("HMGET answered the wrong number of fields".into()))?
    else {
        return Ok(None);
    };
    let number = |field: &str, value: Option<String>| -> Result<u64, StoreError> {
        value.map_or(Ok(0), |v| {
            v.parse()
                .map_err(|_| corrupt(format!("field {field} is not a number: {v}")))
        })
    };
    Ok(Some(JobFacts {
        status: JobStatus::from_name(&status)
            .ok_or_else(|| corrupt(format!("unknown status {status}")))?,
        pool: pool.unwrap_or_default(),
        model: model.unwrap_or_default(),
        model_sha256: sha.unwrap_or_default(),
        output_dir: dir.unwrap_or_default(),
        items_total: number("items_total", total)?,
        orphan_grace: crate::store::grace_of(number("orphan_grace_ms", grace)?),
    }))
}

#[async_trait::async_trait]
impl JobStore for RedisStore {
    fn describe(&self) -> String {
        format!("Redis (key prefix {})", self.keys.prefix())
    }

    /// Reads a job record, `None` if the job is unknown.
    async fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        let key = self.keys.job_key(id);
        let mut c = self.conn("HGETALL job").await?;
        let map: BTreeMap<String, String> = c.hgetall(&key).await.map_err(cmd("HGETALL job"))?;
        if map.is_empty() {
            return Ok(None);
        }
        JobRecord::from_fields(&key, &map).map(Some)
    }

    /// The fields a work message is checked against, in one `HMGET`: a
    /// worker reads them once in a while per job, not the whole record
    /// (which holds the manifest).
    async fn job_facts(&self, id: &str) -> Result<Option<JobFacts>, StoreError> {
        let key = self.keys.job_key(id);
        let mut c = self.conn("HMGET job").await?;
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&key)
            .arg(FACT_FIELDS)
            .query_async(&mut c)
            .await
            .map_err(cmd("HMGET job"))?;
        facts_of(&key, fields)
    }

    async fn job_pace(&self, id: &str) -> Result<Option<Pace>, StoreError> {
        let key = self.keys.job_key(id);
        let mut c = self.conn("HGET pace").await?;
        let pace: Option<String> = c.hget(&key, "pace").await.map_err(cmd("HGET pace"))?;
        match pace.as_deref() {
            None | Some("") => Ok(None),
            Some(text) => serde_json::from_str(text)
                .map(Some)
                .map_err(|e| StoreError::Corrupt {
                    key,
                    reason: format!("field pace is not a pace: {e}"),
                }),
        }
    }

    /// Writes a new job record (all fields) and lists it in `P:jobs`.
    async fn put_job(&self, job: &JobRecord) -> Result<(), StoreError> {
        let mut c = self.conn("put job").await?;
        // Two slots on a Redis Cluster, so two writes: the index first (a
        // listed job without a record is skipped by its readers).
        c.zadd::<_, _, _, ()>(self.keys.jobs_key(), &job.id, job.created_ms)
            .await
            .map_err(cmd("put job"))?;
        c.hset_multiple::<_, _, _, ()>(self.keys.job_key(&job.id), &job.to_fields())
            .await
            .map_err(cmd("put job"))
    }

    /// Sets some fields of a job record. Never use it for the done counters.
    async fn update_job(&self, id: &str, update: &RecordUpdate) -> Result<(), StoreError> {
        let mut c = self.conn("HSET job").await?;
        c.hset_multiple::<_, _, _, ()>(self.keys.job_key(id), &update.fields())
            .await
            .map_err(cmd("HSET job"))
    }

    /// Reads the counters of a job in one round trip.
    async fn progress(&self, id: &str) -> Result<Progress, StoreError> {
        let mut c = self.conn("HMGET progress").await?;
        let (vals, status, items_failed): (Vec<Option<u64>>, Option<String>, u64) = redis::pipe()
            .cmd("HMGET")
            .arg(self.keys.job_key(id))
            .arg(&[
                "items_done",
                "rows_done",
                "items_total",
                "rows_total",
                "rows_rejected",
            ])
            .hget(self.keys.job_key(id), "status")
            .hlen(self.keys.failed_key(id))
            .query_async(&mut c)
            .await
            .map_err(cmd("HMGET progress"))?;
        let v = |i: usize| vals.get(i).copied().flatten().unwrap_or(0);
        Ok(Progress {
            items_done: v(0),
            rows_done: v(1),
            items_total: v(2),
            rows_total: v(3),
            items_failed,
            rows_rejected: v(4),
            status: status.as_deref().and_then(JobStatus::from_name),
        })
    }

    /// One [`COMMIT_SCRIPT`] call for the whole group.
    async fn commit_group(
        &self,
        job: &str,
        commits: &[Commit<'_>],
        work: Work,
    ) -> Result<Vec<bool>, StoreError> {
        if commits.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = self.scripts.commit.prepare_invoke();
        invocation
            .key(self.keys.done_key(job))
            .key(self.keys.job_key(job))
            .key(self.keys.stats_key(job))
            .key(self.keys.failed_key(job))
            .key(self.keys.hist_key(job))
            .key(self.keys.leases_key(job))
            .key(self.keys.work_key(job))
            .key(self.keys.done_bits_key(job))
            .arg(work.rows)
            .arg(work.deliveries)
            // The running histogram's field: the committing worker's (a
            // worker's groups hold its own items only).
            .arg(&commits[0].stats.worker);
        for Commit {
            stats,
            histogram,
            leased,
        } in commits
        {
            invocation
                .arg(stats.seq)
                .arg(stats.rows + stats.rows_rejected)
                .arg(encode("encode stats", stats)?)
                .arg(stats.rows_rejected)
                .arg(encode("encode histogram", histogram)?)
                .arg(if *leased {
                    format!("{}@{}", stats.seq, stats.worker)
                } else {
                    String::new()
                });
        }
        let mut c = self.conn("commit items").await?;
        let won: Vec<i64> = invocation
            .invoke_async(&mut c)
            .await
            .map_err(cmd("commit items"))?;
        Ok(won.into_iter().map(|w| w == 1).collect())
    }

    /// Records that an item failed for good. Returns `false` (and records
    /// nothing) if the item is already done.
    async fn fail_item(&self, job: &str, failure: &ItemFailure) -> Result<bool, StoreError> {
        let json = encode("encode failure", failure)?;
        let mut c = self.conn("fail item").await?;
        let recorded: i64 = self
            .scripts
            .fail
            .key(self.keys.done_key(job))
            .key(self.keys.failed_key(job))
            .key(self.keys.job_key(job))
            .key(self.keys.done_bits_key(job))
            .arg(failure.seq)
            .arg(json)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("fail item"))?;
        Ok(recorded == 1)
    }

    /// Items that failed for good, in seq order.
    async fn failures(&self, job: &str) -> Result<Vec<ItemFailure>, StoreError> {
        self.json_by_seq(&self.keys.failed_key(job), "HSCAN failed")
            .await
    }

    /// Forgets recorded failures of a job (before its failed items are published again).
    async fn clear_failures(&self, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("DEL failed").await?;
        // One slot (the job's hash tag): one DEL for both.
        c.del::<_, ()>(&[self.keys.failed_key(job), self.keys.crashes_key(job)])
            .await
            .map_err(cmd("DEL failed"))
    }

    /// Forgets the failure of one item (before it is published again), and
    /// its crashes.
    async fn clear_failure(&self, job: &str, seq: u32) -> Result<(), StoreError> {
        let mut c = self.conn("HDEL failed").await?;
        redis::pipe()
            .hdel(self.keys.failed_key(job), seq)
            .ignore()
            .hdel(self.keys.crashes_key(job), seq)
            .ignore()
            .query_async::<()>(&mut c)
            .await
            .map_err(cmd("HDEL failed"))
    }

    /// Whether an item is marked done (in the job's bitmap, or in the set
    /// of a job from before it: both are read, one holds nothing).
    async fn is_done(&self, job: &str, seq: u32) -> Result<bool, StoreError> {
        let mut c = self.conn("read done").await?;
        let (set, bit): (bool, u8) = redis::pipe()
            .sismember(self.keys.done_key(job), seq)
            .getbit(self.keys.done_bits_key(job), seq as usize)
            .query_async(&mut c)
            .await
            .map_err(cmd("read done"))?;
        Ok(set || bit == 1)
    }

    /// Which of `seqs` are done (one round trip: one `SMISMEMBER` and one
    /// `BITFIELD … GET`).
    async fn done_among(&self, job: &str, seqs: &[u32]) -> Result<HashSet<u32>, StoreError> {
        if seqs.is_empty() {
            return Ok(HashSet::new());
        }
        let mut c = self.conn("read done").await?;
        let mut get = redis::cmd("BITFIELD");
        get.arg(self.keys.done_bits_key(job));
        for s in seqs {
            get.arg("GET").arg("u1").arg(format!("#{s}"));
        }
        let (set, bits): (Vec<bool>, Vec<u8>) = redis::pipe()
            .cmd("SMISMEMBER")
            .arg(self.keys.done_key(job))
            .arg(seqs)
            .add_command(get)
            .query_async(&mut c)
            .await
            .map_err(cmd("read done"))?;
        Ok(seqs
            .iter()
            .zip(set.into_iter().zip(bits))
            .filter_map(|(s, (in_set, bit))| (in_set || bit == 1).then_some(*s))
            .collect())
    }

    /// All done seqs of a job (the bitmap's set bits, and the members of
    /// the set of a job from before it).
    async fn done_items(&self, job: &str) -> Result<HashSet<u32>, StoreError> {
        // The bitmap (one bit per item: 125 KB for a million) in one reply;
        // an older job's set a page at a time.
        let bitmap: Vec<u8> = {
            let mut c = self.conn("read done").await?;
            c.get(self.keys.done_bits_key(job))
                .await
                .map_err(cmd("read done"))?
        };
        let mut done: HashSet<u32> = self
            .scan_paged::<_, u32>("SSCAN", &self.keys.done_key(job), "read done")
            .await?;
        done.extend(set_bits(&bitmap));
        Ok(done)
    }

    /// Stats of every committed item, in seq order.
    async fn item_stats(&self, job: &str) -> Result<Vec<ItemStats>, StoreError> {
        self.json_by_seq(&self.keys.stats_key(job), "HSCAN stats")
            .await
    }

    /// `HRANDFIELD <stats> n WITHVALUES`: distinct items, O(n).
    async fn sample_item_stats(&self, job: &str, n: usize) -> Result<Vec<ItemStats>, StoreError> {
        let key = self.keys.stats_key(job);
        let mut c = self.conn("HRANDFIELD stats").await?;
        let flat: Vec<String> = redis::cmd("HRANDFIELD")
            .arg(&key)
            .arg(n.max(1))
            .arg("WITHVALUES")
            .query_async(&mut c)
            .await
            .map_err(cmd("HRANDFIELD stats"))?;
        flat.chunks(2)
            .filter_map(|pair| pair.get(1))
            .map(|json| {
                serde_json::from_str(json).map_err(|e| StoreError::Corrupt {
                    key: key.clone(),
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    /// Starts holding an item (see [`start_script`]): checks the message's
    /// `claim` against the job record and, only if the job runs and the item
    /// is neither done nor failed, writes the lease (started and heartbeat
    /// at Redis's time) and counts the delivery.
    async fn start_item(
        &self,
        job: &str,
        lease: &Lease,
        claim: &Claim<'_>,
    ) -> Result<Start, StoreError> {
        let json = encode("encode lease", lease)?;
        let mut c = self.conn("start item").await?;
        let reply: Vec<String> = self
            .scripts
            .start
            .key(self.keys.done_key(job))
            .key(self.keys.leases_key(job))
            .key(self.keys.work_key(job))
            .key(self.keys.failed_key(job))
            .key(self.keys.job_key(job))
            .key(self.keys.done_bits_key(job))
            .key(self.keys.crashes_key(job))
            .key(self.keys.beats_key(job))
            .arg(lease.seq)
            .arg(lease.field())
            .arg(json)
            .arg(claim.model_sha256)
            .arg(claim.output_dir)
            .arg(claim.pool)
            .arg(claim.model)
            .arg(u8::from(claim.returned))
            .invoke_async(&mut c)
            .await
            .map_err(cmd("start item"))?;
        let corrupt = |what: &str| StoreError::Corrupt {
            key: self.keys.job_key(job),
            reason: format!("the start script answered {what}"),
        };
        let word = |i: usize| reply.get(i).cloned().unwrap_or_default();
        Ok(match word(0).as_str() {
            "started" => Start::Started {
                at_ms: word(1).parse().map_err(|_| corrupt(&word(1)))?,
                crashes: word(2).parse().map_err(|_| corrupt(&word(2)))?,
            },
            "held" => Start::Held {
                wait_ms: word(1).parse().map_err(|_| corrupt(&word(1)))?,
            },
            "crashed" => Start::Crashed {
                crashes: word(1).parse().map_err(|_| corrupt(&word(1)))?,
                workers: word(2).split_whitespace().map(str::to_owned).collect(),
            },
            "done" => Start::Done,
            "failed" => Start::FailedForGood,
            "job_failed" => Start::JobFailed,
            "unknown" => Start::UnknownJob,
            "not_running" => {
                Start::NotRunning(JobStatus::from_name(&word(1)).ok_or_else(|| corrupt(&word(1)))?)
            }
            "mismatch" => Start::Mismatch {
                field: word(1),
                recorded: word(2),
            },
            other => return Err(corrupt(other)),
        })
    }

    /// Refreshes a lease (the heartbeat; its `heartbeat_ms` is set to
    /// Redis's time). Returns `false`, writing nothing, once the item is
    /// done: the holder may stop working on it.
    async fn heartbeat(&self, job: &str, lease: &Lease, held_ms: u64) -> Result<bool, StoreError> {
        let json = encode("encode lease", lease)?;
        let mut c = self.conn("heartbeat").await?;
        let written: i64 = self
            .scripts
            .lease
            .key(self.keys.done_key(job))
            .key(self.keys.leases_key(job))
            .key(self.keys.job_key(job))
            .key(self.keys.done_bits_key(job))
            .arg(lease.seq)
            .arg(lease.field())
            .arg(json)
            .arg(held_ms)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("heartbeat"))?;
        Ok(written == 1)
    }

    /// [`beat_script`](scripts::beat_script).
    async fn beat(&self, job: &str, fields: &[String]) -> Result<(), StoreError> {
        self.beat_jobs(&[(job.to_owned(), fields.to_vec())]).await
    }

    /// One script call for every job on one server; on a Redis Cluster,
    /// whose scripts reach one slot each, one per job.
    async fn beat_jobs(&self, beats: &[(String, Vec<String>)]) -> Result<(), StoreError> {
        let beats: Vec<&(String, Vec<String>)> =
            beats.iter().filter(|(_, f)| !f.is_empty()).collect();
        let groups: Vec<&[&(String, Vec<String>)]> = if self.connections.is_cluster() {
            beats.chunks(1).collect()
        } else {
            vec![&beats[..]]
        };
        let mut c = self.conn("beat").await?;
        let mut first = None;
        for group in groups.into_iter().filter(|g| !g.is_empty()) {
            let mut call = self.scripts.beat.prepare_invoke();
            for (job, fields) in group {
                call.key(self.keys.beats_key(job))
                    .arg(fields.len())
                    .arg(fields);
            }
            // Every group is tried whatever the others did.
            if let Err(e) = call.invoke_async::<()>(&mut c).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), |e| Err(cmd("beat")(e)))
    }

    async fn beats(&self, job: &str) -> Result<BTreeMap<String, u64>, StoreError> {
        let mut c = self.conn("HGETALL beats").await?;
        let map: BTreeMap<String, String> = c
            .hgetall(self.keys.beats_key(job))
            .await
            .map_err(cmd("HGETALL beats"))?;
        Ok(map
            .into_iter()
            .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
            .collect())
    }

    /// Redis's clock (`TIME`), in ms: the one clock leases are written and judged by.
    async fn now_ms(&self) -> Result<u64, StoreError> {
        let mut c = self.conn("TIME").await?;
        let (s, us): (u64, u64) = redis::cmd("TIME")
            .query_async(&mut c)
            .await
            .map_err(cmd("TIME"))?;
        Ok(s * 1000 + us / 1000)
    }

    /// Fails a running job at once with `class` and `reason` (see
    /// [`JobRecord::failed_class`]). `false` if it was not running (finished,
    /// or failed already — the first reason stays).
    async fn fail_job(&self, job: &str, class: &str, reason: &str) -> Result<bool, StoreError> {
        let mut c = self.conn("fail job").await?;
        let failed: i64 = self
            .scripts
            .fail_job
            .key(self.keys.job_key(job))
            .arg(class)
            .arg(reason)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("fail job"))?;
        Ok(failed == 1)
    }

    /// Marks the job published (every item confirmed by the broker) and
    /// running, unless it failed meanwhile ([`PUBLISHED_SCRIPT`]).
    async fn mark_published(&self, job: &str, at_ms: u64, items: u64) -> Result<(), StoreError> {
        let mut c = self.conn("mark published").await?;
        self.scripts
            .published
            .key(self.keys.job_key(job))
            .arg(at_ms)
            .arg(items)
            .invoke_async::<i64>(&mut c)
            .await
            .map(|_| ())
            .map_err(cmd("mark published"))
    }

    /// Records that `worker` cannot take the job's items for now.
    async fn note_unable(
        &self,
        job: &str,
        worker: &str,
        note: &UnableNote,
    ) -> Result<(), StoreError> {
        let json = encode("encode unable note", note)?;
        let mut c = self.conn("HSET unable").await?;
        c.hset::<_, _, _, ()>(self.keys.unable_key(job), worker, json)
            .await
            .map_err(cmd("HSET unable"))
    }

    /// Forgets that `worker` could not take the job's items.
    async fn clear_unable(&self, job: &str, worker: &str) -> Result<(), StoreError> {
        let mut c = self.conn("HDEL unable").await?;
        c.hdel::<_, _, ()>(self.keys.unable_key(job), worker)
            .await
            .map_err(cmd("HDEL unable"))
    }

    /// Forgets every worker's note on the job (the job runs again).
    async fn clear_unable_notes(&self, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("DEL unable").await?;
        c.del::<_, ()>(self.keys.unable_key(job))
            .await
            .map_err(cmd("DEL unable"))
    }

    /// Workers that said they cannot take the job's items, by worker id.
    async fn unable(&self, job: &str) -> Result<BTreeMap<String, UnableNote>, StoreError> {
        let key = self.keys.unable_key(job);
        let mut c = self.conn("HGETALL unable").await?;
        let map: BTreeMap<String, String> = c.hgetall(&key).await.map_err(cmd("HGETALL unable"))?;
        map.into_iter()
            .map(|(w, json)| {
                serde_json::from_str(&json)
                    .map(|n| (w, n))
                    .map_err(|e| StoreError::Corrupt {
                        key: key.clone(),
                        reason: e.to_string(),
                    })
            })
            .collect()
    }

    /// Drops leases by their `<seq>@<worker>` field.
    async fn drop_leases(&self, job: &str, fields: &[String]) -> Result<(), StoreError> {
        if fields.is_empty() {
            return Ok(());
        }
        let mut c = self.conn("HDEL lease").await?;
        c.hdel::<_, _, ()>(self.keys.leases_key(job), fields)
            .await
            .map_err(cmd("HDEL lease"))
    }

    async fn crashes(&self, job: &str) -> Result<BTreeMap<u32, u32>, StoreError> {
        let mut c = self.conn("HGETALL crashes").await?;
        c.hgetall(self.keys.crashes_key(job))
            .await
            .map_err(cmd("HGETALL crashes"))
    }

    /// [`CRASH_SCRIPT`].
    async fn count_crashes(
        &self,
        job: &str,
        fields: &[String],
    ) -> Result<BTreeMap<u32, u32>, StoreError> {
        if fields.is_empty() {
            return Ok(BTreeMap::new());
        }
        let mut c = self.conn("count crashes").await?;
        let pairs: Vec<(u32, u32)> = self
            .scripts
            .crash
            .key(self.keys.leases_key(job))
            .key(self.keys.crashes_key(job))
            .arg(fields)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("count crashes"))?;
        Ok(pairs.into_iter().collect())
    }

    /// Every lease of a job, in seq order, each live until its holder's
    /// last beat has aged past its ttl (leases and beats in one request).
    async fn leases(&self, job: &str) -> Result<Vec<Lease>, StoreError> {
        let key = self.keys.leases_key(job);
        let mut c = self.conn("HGETALL leases").await?;
        let (map, beats): (BTreeMap<String, String>, BTreeMap<String, String>) = redis::pipe()
            .hgetall(&key)
            .hgetall(self.keys.beats_key(job))
            .query_async(&mut c)
            .await
            .map_err(cmd("HGETALL leases"))?;
        let mut leases = map
            .values()
            .map(|json| {
                let mut lease =
                    serde_json::from_str::<Lease>(json).map_err(|e| StoreError::Corrupt {
                        key: key.clone(),
                        reason: e.to_string(),
                    })?;
                if let Some(beat) = beats.get(&lease.holder()).and_then(|b| b.parse().ok()) {
                    lease.heartbeat_ms = lease.heartbeat_ms.max(beat);
                }
                Ok(lease)
            })
            .collect::<Result<Vec<_>, _>>()?;
        leases.sort_by(|a, b| (a.seq, &a.worker).cmp(&(b.seq, &b.worker)));
        Ok(leases)
    }

    /// The job's prediction histogram, `counts[column][bin]` (bins + 2 per column).
    async fn histogram(&self, job: &str, bins: usize) -> Result<Vec<Vec<u64>>, StoreError> {
        let key = self.keys.hist_key(job);
        let mut c = self.conn("HGETALL hist").await?;
        let map: BTreeMap<String, String> = c.hgetall(&key).await.map_err(cmd("HGETALL hist"))?;
        let corrupt = |field: &str| StoreError::Corrupt {
            key: key.clone(),
            reason: format!("unexpected field {field}"),
        };
        let mut counts: Vec<Vec<u64>> = Vec::new();
        let mut add = |col: usize, bin: usize, n: u64| {
            if counts.len() <= col {
                counts.resize(col + 1, vec![0; bins]);
            }
            counts[col][bin] += n;
        };
        for (field, value) in map {
            // A committer's running histogram (`counts[column][bin]`, JSON)…
            if let Ok(each) = serde_json::from_str::<Vec<Vec<u64>>>(&value) {
                if each.iter().any(|column| column.len() > bins) {
                    return Err(corrupt(&field));
                }
                for (col, column) in each.iter().enumerate() {
                    for (bin, &n) in column.iter().enumerate() {
                        add(col, bin, n);
                    }
                }
                continue;
            }
            // …or, from workers before it, one count per `<column>:<bin>`.
            let parsed = field
                .split_once(':')
                .and_then(|(c, b)| Some((c.parse::<usize>().ok()?, b.parse::<usize>().ok()?)));
            match (parsed.filter(|(_, b)| *b < bins), value.parse::<u64>()) {
                (Some((col, bin)), Ok(n)) => add(col, bin, n),
                _ => return Err(corrupt(&field)),
            }
        }
        Ok(counts)
    }

    /// Adds to the job's work counters: items started and rows put through
    /// the model (the work actually done, including work a fault wasted).
    /// One `HINCRBY` per counter that changes; nothing when neither does.
    async fn count_work(&self, job: &str, deliveries: u64, rows: u64) -> Result<(), StoreError> {
        if deliveries == 0 && rows == 0 {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (field, by) in [("deliveries", deliveries), ("rows_computed", rows)] {
            if by > 0 {
                pipe.hincr(self.keys.work_key(job), field, by).ignore();
            }
        }
        let mut c = self.conn("HINCRBY work").await?;
        pipe.query_async::<()>(&mut c)
            .await
            .map_err(cmd("HINCRBY work"))
    }

    /// The job's work counters: (items started, rows computed).
    async fn work(&self, job: &str) -> Result<(u64, u64), StoreError> {
        let mut c = self.conn("HMGET work").await?;
        let (d, r): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(self.keys.work_key(job))
            .arg(&["deliveries", "rows_computed"])
            .query_async(&mut c)
            .await
            .map_err(cmd("HMGET work"))?;
        Ok((d.unwrap_or(0), r.unwrap_or(0)))
    }

    /// When the coordinator last published a copy of each item (seq → ms).
    async fn redispatched(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError> {
        let mut c = self.conn("HGETALL redispatched").await?;
        c.hgetall(self.keys.redispatched_key(job))
            .await
            .map_err(cmd("HGETALL redispatched"))
    }

    /// Records that a copy of item `seq` was published at `at_ms` (Redis
    /// time); returns how many copies of it have been published in all.
    async fn mark_redispatched(&self, job: &str, seq: u32, at_ms: u64) -> Result<u64, StoreError> {
        let mut c = self.conn("HSET redispatched").await?;
        let (copies,): (u64,) = redis::pipe()
            .hset(self.keys.redispatched_key(job), seq, at_ms)
            .ignore()
            .hincr(self.keys.copies_key(job), seq, 1)
            .query_async(&mut c)
            .await
            .map_err(cmd("HSET redispatched"))?;
        Ok(copies)
    }

    /// How many copies of each item the coordinator published (seq → count).
    async fn copies(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError> {
        let mut c = self.conn("HGETALL copies").await?;
        c.hgetall(self.keys.copies_key(job))
            .await
            .map_err(cmd("HGETALL copies"))
    }

    /// Restores the descriptive fields of a job record lost with Redis's data
    /// (status, totals, settings), never the counters the commits maintain.
    async fn restore_job(&self, job: &JobRecord) -> Result<(), StoreError> {
        let fields: Vec<(&'static str, String)> = job
            .to_fields()
            .into_iter()
            .filter(|(k, _)| !matches!(*k, "items_done" | "rows_done" | "rows_rejected"))
            .collect();
        let mut c = self.conn("restore job").await?;
        // Two slots on a Redis Cluster: the index first, as in `put_job`.
        c.zadd::<_, _, _, ()>(self.keys.jobs_key(), &job.id, job.created_ms)
            .await
            .map_err(cmd("restore job"))?;
        c.hset_multiple::<_, _, _, ()>(self.keys.job_key(&job.id), &fields)
            .await
            .map_err(cmd("restore job"))
    }

    /// Most recent job ids, newest first.
    async fn recent_jobs(&self, limit: usize) -> Result<Vec<String>, StoreError> {
        let mut c = self.conn("ZREVRANGE jobs").await?;
        let stop = limit.saturating_sub(1) as isize;
        c.zrevrange(self.keys.jobs_key(), 0, stop)
            .await
            .map_err(cmd("ZREVRANGE jobs"))
    }

    /// Deletes every key of a job (tests and `purge`).
    async fn delete_job(&self, id: &str) -> Result<(), StoreError> {
        let mut c = self.conn("DEL job").await?;
        // The job's keys (one slot), then the index (another).
        c.del::<_, ()>(&self.keys.keys_of(id))
            .await
            .map_err(cmd("DEL job"))?;
        c.zrem::<_, _, ()>(self.keys.jobs_key(), id)
            .await
            .map_err(cmd("DEL job"))
    }

    /// `HSET P:job:{<id>}:inputs`, a thousand files per command.
    async fn put_inputs(&self, job: &str, inputs: &[(String, String)]) -> Result<(), StoreError> {
        let key = self.keys.inputs_key(job);
        let mut c = self.conn("HSET inputs").await?;
        let mut pipe = redis::pipe();
        for chunk in inputs.chunks(1000) {
            pipe.hset_multiple(&key, chunk).ignore();
        }
        pipe.query_async::<()>(&mut c)
            .await
            .map_err(cmd("HSET inputs"))
    }

    async fn inputs(&self, job: &str) -> Result<BTreeMap<String, String>, StoreError> {
        self.scan_paged::<_, (String, String)>("HSCAN", &self.keys.inputs_key(job), "HSCAN inputs")
            .await
    }

    /// `HSET P:job:{<id>}:tasks <sha256> <bytes>`.
    async fn put_task(
        &self,
        job: &str,
        task: &crate::message::StoredTask,
    ) -> Result<(), StoreError> {
        let mut c = self.conn("HSET tasks").await?;
        c.hset::<_, _, _, ()>(self.keys.tasks_key(job), &task.sha256, &task.bytes)
            .await
            .map_err(cmd("HSET tasks"))
    }

    /// `HGET` of the task and the job's facts (`HMGET`), in one round trip.
    async fn task_and_facts(
        &self,
        job: &str,
        sha256: &str,
    ) -> Result<(TaskLookup, Option<JobFacts>), StoreError> {
        let key = self.keys.job_key(job);
        let mut c = self.conn("HGET tasks").await?;
        let (bytes, fields): (Option<Vec<u8>>, Vec<Option<String>>) = redis::pipe()
            .hget(self.keys.tasks_key(job), sha256)
            .cmd("HMGET")
            .arg(&key)
            .arg(FACT_FIELDS)
            .query_async(&mut c)
            .await
            .map_err(cmd("HGET tasks"))?;
        let facts = facts_of(&key, fields)?;
        let task = match (bytes, &facts) {
            (_, None) => TaskLookup::UnknownJob,
            (Some(b), Some(_)) => TaskLookup::Found(b),
            (None, Some(_)) => TaskLookup::NotOfJob,
        };
        Ok((task, facts))
    }

    /// `HGET` of the task and `EXISTS` of the job record, in one round trip.
    async fn task(&self, job: &str, sha256: &str) -> Result<TaskLookup, StoreError> {
        let mut c = self.conn("HGET tasks").await?;
        let (bytes, known): (Option<Vec<u8>>, bool) = redis::pipe()
            .hget(self.keys.tasks_key(job), sha256)
            .exists(self.keys.job_key(job))
            .query_async(&mut c)
            .await
            .map_err(cmd("HGET tasks"))?;
        Ok(match (bytes, known) {
            (Some(b), true) => TaskLookup::Found(b),
            (_, false) => TaskLookup::UnknownJob,
            (None, true) => TaskLookup::NotOfJob,
        })
    }

    /// `PEXPIRE` on every key of the job, in one `MULTI`.
    async fn expire_job(&self, job: &str, ttl: std::time::Duration) -> Result<(), StoreError> {
        let ms = ttl.as_millis().clamp(1, i64::MAX as u128) as i64;
        let mut c = self.conn("PEXPIRE job").await?;
        let mut pipe = redis::pipe();
        pipe.atomic();
        for key in self.keys.state_keys(job) {
            pipe.cmd("PEXPIRE").arg(key).arg(ms).ignore();
        }
        pipe.query_async::<()>(&mut c)
            .await
            .map_err(cmd("PEXPIRE job"))
    }

    /// `PERSIST` on every key of the job, in one `MULTI`.
    async fn persist_job(&self, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("PERSIST job").await?;
        let mut pipe = redis::pipe();
        pipe.atomic();
        for key in self.keys.state_keys(job) {
            pipe.persist(key).ignore();
        }
        pipe.query_async::<()>(&mut c)
            .await
            .map_err(cmd("PERSIST job"))
    }

    async fn follow_lease(&self, job: &str, who: &str, ttl: Duration) -> Result<bool, StoreError> {
        let mut c = self.conn("follower lease").await?;
        let held: i64 = redis::Script::new(FOLLOW_SCRIPT)
            .key(self.keys.follower_key(job))
            .arg(who)
            .arg(ttl.as_millis().max(1) as u64)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("follower lease"))?;
        Ok(held == 1)
    }

    async fn release_follow(&self, job: &str, who: &str) -> Result<(), StoreError> {
        let mut c = self.conn("release follower lease").await?;
        redis::Script::new(UNFOLLOW_SCRIPT)
            .key(self.keys.follower_key(job))
            .arg(who)
            .invoke_async::<()>(&mut c)
            .await
            .map_err(cmd("release follower lease"))
    }

    async fn claim_reduce(
        &self,
        job: &str,
        who: &str,
        stale: Duration,
    ) -> Result<bool, StoreError> {
        let mut c = self.conn("claim reduce").await?;
        let won: i64 = redis::Script::new(&reduce_script())
            .key(self.keys.job_key(job))
            .arg(who)
            .arg(stale.as_millis() as u64)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("claim reduce"))?;
        Ok(won == 1)
    }

    async fn activate_job(&self, pool: &str, job: &str, weight: u32) -> Result<(), StoreError> {
        let mut c = self.conn("HSET pool jobs").await?;
        c.hset::<_, _, _, ()>(self.keys.pool_jobs_key(pool), job, weight)
            .await
            .map_err(cmd("HSET pool jobs"))
    }

    async fn forget_retired(&self, pool: &str, job: &str) -> Result<bool, StoreError> {
        let mut c = self.conn("ZREM pool retired").await?;
        let removed: u32 = c
            .zrem(self.keys.pool_retired_key(pool), job)
            .await
            .map_err(cmd("ZREM pool retired"))?;
        Ok(removed > 0)
    }

    async fn deactivate_job(&self, pool: &str, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("HDEL pool jobs").await?;
        c.hdel::<_, _, ()>(self.keys.pool_jobs_key(pool), job)
            .await
            .map_err(cmd("HDEL pool jobs"))
    }

    async fn note_retired(&self, pool: &str, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("note retired").await?;
        self.scripts
            .note_retired
            .key(self.keys.pool_retired_key(pool))
            .arg(job)
            .invoke_async::<()>(&mut c)
            .await
            .map_err(cmd("note retired"))
    }

    async fn take_retired(
        &self,
        pool: &str,
        grace: Duration,
        limit: usize,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let mut c = self.conn("take retired").await?;
        let mut got: Vec<String> = self
            .scripts
            .take_retired
            .key(self.keys.pool_retired_key(pool))
            .arg(grace.as_millis() as u64)
            .arg(limit.max(1))
            .invoke_async(&mut c)
            .await
            .map_err(cmd("take retired"))?;
        if got.is_empty() {
            return Ok(Vec::new());
        }
        let now: u64 = got.remove(0).parse().map_err(|_| StoreError::Corrupt {
            key: self.keys.pool_retired_key(pool),
            reason: "the claim's time is not a number".into(),
        })?;
        Ok(got.into_iter().map(|job| (job, now)).collect())
    }

    async fn drop_retired(&self, pool: &str, job: &str, claim: u64) -> Result<(), StoreError> {
        let mut c = self.conn("drop retired").await?;
        self.scripts
            .drop_retired
            .key(self.keys.pool_retired_key(pool))
            .arg(job)
            .arg(claim)
            .invoke_async::<()>(&mut c)
            .await
            .map_err(cmd("drop retired"))
    }

    async fn fence_sweep(&self, job: &str, ttl: Duration) -> Result<bool, StoreError> {
        let mut c = self.conn("SET sweeping").await?;
        let set: Option<String> = redis::cmd("SET")
            .arg(self.keys.sweeping_key(job))
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(ttl.as_millis().max(1) as u64)
            .query_async(&mut c)
            .await
            .map_err(cmd("SET sweeping"))?;
        Ok(set.is_some())
    }

    async fn unfence_sweep(&self, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("DEL sweeping").await?;
        c.del::<_, ()>(self.keys.sweeping_key(job))
            .await
            .map_err(cmd("DEL sweeping"))
    }

    async fn is_swept(&self, job: &str) -> Result<bool, StoreError> {
        let mut c = self.conn("EXISTS sweeping").await?;
        c.exists(self.keys.sweeping_key(job))
            .await
            .map_err(cmd("EXISTS sweeping"))
    }

    async fn active_jobs(&self, pool: &str) -> Result<BTreeMap<String, u32>, StoreError> {
        let mut c = self.conn("HGETALL pool jobs").await?;
        c.hgetall(self.keys.pool_jobs_key(pool))
            .await
            .map_err(cmd("HGETALL pool jobs"))
    }

    /// `maxmemory_policy` from `INFO memory` (managed Redis often refuses
    /// `CONFIG GET`, never `INFO`).
    async fn eviction_policy(&self) -> Result<Option<String>, StoreError> {
        let mut c = self.conn("INFO memory").await?;
        // One server answers with its text; a Redis Cluster with a map of
        // every master's text.
        let info: redis::Value = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut c)
            .await
            .map_err(cmd("INFO memory"))?;
        let texts: Vec<String> = match info {
            redis::Value::Map(nodes) => nodes
                .into_iter()
                .filter_map(|(_, text)| redis::from_redis_value(text).ok())
                .collect(),
            other => vec![
                redis::from_redis_value(other).map_err(|e| StoreError::Command {
                    op: "INFO memory",
                    reason: e.to_string(),
                })?,
            ],
        };
        let policies: Vec<String> = texts
            .iter()
            .filter_map(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("maxmemory_policy:"))
                    .map(|p| p.trim().to_owned())
            })
            .collect();
        // The first that evicts a running job's keys, if any does.
        Ok(policies
            .iter()
            .find(|p| super::evicts_job_state(p))
            .or_else(|| policies.first())
            .cloned())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_bitmap_names_its_set_bits_as_setbit_counts_them() {
        let seqs: Vec<u32> = super::set_bits(&[0b1000_0001, 0, 0b0100_0000]).collect();
        assert_eq!(seqs, [0, 7, 17]);
        assert_eq!(super::set_bits(&[]).count(), 0);
    }
}
