//! The Redis implementation of [`JobStore`]: Lua scripts make each step
//! atomic, and lease times come from Redis's own clock (`TIME`).

use super::{
    Claim, ItemFailure, ItemStats, JobRecord, JobStatus, JobStore, Lease, Progress, Start,
    StoreError, UnableNote,
};
use crate::endpoint::{is_certificate_error, Endpoint};
use crate::secret::scrub;
use deadpool_redis::redis::{self, AsyncCommands};
use deadpool_redis::{Pool, Runtime};
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_redis::redis::aio::MultiplexedConnection;

/// A connection to one server, or to a Redis Cluster (which routes each
/// command, script and single-slot pipeline by its keys).
#[derive(Clone)]
enum AnyConn {
    Single(MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl redis::aio::ConnectionLike for AnyConn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            AnyConn::Single(c) => c.req_packed_command(cmd),
            AnyConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            AnyConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            AnyConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            AnyConn::Single(c) => c.get_db(),
            AnyConn::Cluster(c) => c.get_db(),
        }
    }
}

/// A handle on the store's shared connection. A failure that breaks the
/// connection (not a command's own error) drops it from the store, so the
/// next operation takes a checked one from the pool.
struct Conn<'a> {
    inner: AnyConn,
    generation: u64,
    shared: &'a Mutex<Shared>,
}

/// The shared connection and how many times it was replaced.
#[derive(Default)]
struct Shared {
    generation: u64,
    conn: Option<AnyConn>,
    /// The server `conn` is connected to (`host:port`), when Sentinels
    /// chose it: a connection to a primary they no longer name is dropped.
    addr: Option<String>,
}

impl Conn<'_> {
    fn check<T>(&self, result: redis::RedisResult<T>) -> redis::RedisResult<T> {
        if let Err(e) = &result {
            // READONLY: the server was turned into a replica (a failover
            // while it stayed up): the next connection asks the Sentinels
            // for the new primary.
            if e.is_io_error()
                || e.is_connection_dropped()
                || e.is_unrecoverable_error()
                || e.is_timeout()
                || e.code() == Some("READONLY")
            {
                let mut shared = self.shared.lock().expect("not poisoned");
                // A handle on an older connection leaves a newer one alone.
                if shared.generation == self.generation {
                    shared.conn = None;
                }
            }
        }
        result
    }
}

impl redis::aio::ConnectionLike for Conn<'_> {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let r = self.inner.req_packed_command(cmd).await;
            self.check(r)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let r = self
                .inner
                .req_packed_commands(pipeline, offset, count)
                .await;
            self.check(r)
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

fn cmd(op: &'static str) -> impl FnOnce(redis::RedisError) -> StoreError {
    move |e| StoreError::Command {
        op,
        reason: e.to_string(),
    }
}

/// Adds the seq to the done set; only if it was not there yet, bumps the
/// counters, adds the item's prediction histogram (`ARGV[5]`, JSON
/// `counts[column][bin]`) and stores the stats (and forgets an earlier
/// failure of the item). Either way drops the committer's lease (`ARGV[6]`):
/// a done item needs none, and [`lease_script`] writes none for it again.
/// Nothing is committed to a cancelled job (its part file, published
/// already, is committed when the job is run again). Returns 1 for the
/// winning commit, 0 otherwise.
pub const COMMIT_SCRIPT: &str = r#"
redis.call('HDEL', KEYS[6], ARGV[6])
if redis.call('HGET', KEYS[2], 'status') == 'cancelled' then
  return 0
end
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'items_done', 1)
  redis.call('HINCRBY', KEYS[2], 'rows_done', ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'rows_rejected', ARGV[4])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
  redis.call('HDEL', KEYS[4], ARGV[1])
  local h = cjson.decode(ARGV[5])
  for c = 1, #h do
    for b = 1, #h[c] do
      if h[c][b] > 0 then
        redis.call('HINCRBY', KEYS[5], (c - 1) .. ':' .. (b - 1), h[c][b])
      end
    end
  end
  return 1
end
return 0
"#;

/// Lua: Redis's clock in ms.
const NOW_LUA: &str = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n";

/// Writes a lease unless the item is already done or its job cancelled
/// (`KEYS[3]`, the job hash), its `heartbeat_ms` set
/// to Redis's clock. Returns 1 if written.
pub fn lease_script() -> String {
    format!(
        "{NOW_LUA}{}",
        r#"
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then
  return 0
end
if redis.call('HGET', KEYS[3], 'status') == 'cancelled' then
  return 0
end
local lease = cjson.decode(ARGV[3])
lease['heartbeat_ms'] = now
redis.call('HSET', KEYS[2], ARGV[2], cjson.encode(lease))
return 1
"#
    )
}

/// Starts holding an item in one round trip, after checking the message
/// against the job record (`ARGV[4..]`: model digest, output folder, pool,
/// model path). Writes nothing unless the answer is `started`: then the
/// lease (times from Redis's clock) and the delivery count.
pub fn start_script() -> String {
    format!(
        "{NOW_LUA}{}",
        r#"
local job = redis.call('HMGET', KEYS[5], 'status', 'model_sha256', 'output_dir', 'pool', 'items_total', 'model')
if not job[1] then
  return {'unknown'}
end
local checks = {{'pool', job[4], ARGV[6]}, {'model', job[6], ARGV[7]}, {'model_sha256', job[2], ARGV[4]}, {'output_dir', job[3], ARGV[5]}}
for _, c in ipairs(checks) do
  if c[2] ~= c[3] then
    return {'mismatch', c[1], tostring(c[2] or '')}
  end
end
if tonumber(ARGV[1]) >= (tonumber(job[5]) or 0) then
  return {'mismatch', 'items_total', tostring(job[5] or '')}
end
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then
  return {'done'}
end
if job[1] == 'failed' or job[1] == 'cancelled' then
  return {'job_failed'}
end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then
  return {'failed'}
end
if job[1] ~= 'planning' and job[1] ~= 'running' then
  return {'not_running', job[1]}
end
local lease = cjson.decode(ARGV[3])
lease['started_ms'] = now
lease['heartbeat_ms'] = now
redis.call('HSET', KEYS[2], ARGV[2], cjson.encode(lease))
redis.call('HINCRBY', KEYS[3], 'deliveries', 1)
return {'started', tostring(now)}
"#
    )
}

/// Marks a job published: `published_ms` and `items_published`, and the
/// status `running` — unless a worker failed it meanwhile (nobody can run it).
pub const PUBLISHED_SCRIPT: &str = r#"
redis.call('HSET', KEYS[1], 'published_ms', ARGV[1], 'items_published', ARGV[2])
if redis.call('HGET', KEYS[1], 'status') == 'planning' then
  redis.call('HSET', KEYS[1], 'status', 'running')
end
return 1
"#;

/// Marks a running job failed (class `cancelled`: cancelled) with why, unless it is finished or failed
/// already. Returns 1 if this call failed it.
pub const FAIL_JOB_SCRIPT: &str = r#"
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'planning' and status ~= 'running' then
  return 0
end
local to = 'failed'
if ARGV[1] == 'cancelled' then
  to = 'cancelled'
end
redis.call('HSET', KEYS[1], 'status', to, 'failed_class', ARGV[1], 'failed_reason', ARGV[2])
return 1
"#;

/// Takes or keeps the follower lease (`KEYS[1]`) for `ARGV[1]` for
/// `ARGV[2]` ms. Returns 1 if `ARGV[1]` holds it.
pub const FOLLOW_SCRIPT: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"#;

/// Gives the follower lease (`KEYS[1]`) up if `ARGV[1]` holds it.
pub const UNFOLLOW_SCRIPT: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 1
"#;

/// Claims the reduce step of the job (`KEYS[1]`, fields `reducer` and
/// `reducer_ms`) for `ARGV[1]`: refused once the job is reduced (a final
/// status with `finished_ms`), or while another's claim is younger than
/// `ARGV[2]` ms. Returns 1 if claimed.
pub fn reduce_script() -> String {
    format!(
        "{NOW_LUA}{}",
        r#"
local j = redis.call('HMGET', KEYS[1], 'status', 'finished_ms', 'reducer', 'reducer_ms')
if not j[1] then
  return 0
end
if j[1] ~= 'planning' and j[1] ~= 'running' and (tonumber(j[2]) or 0) > 0 then
  return 0
end
if j[3] and j[3] ~= '' and j[3] ~= ARGV[1] and now - (tonumber(j[4]) or 0) < tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], 'reducer', ARGV[1], 'reducer_ms', now)
return 1
"#
    )
}

/// Records a failure unless the item is already done (a late failure of a
/// duplicate delivery must not mark a committed item failed). Returns 1 if recorded.
pub const FAIL_SCRIPT: &str = r#"
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"#;

/// `value` as JSON, for a Redis field or script argument.
fn encode<T: Serialize + ?Sized>(op: &'static str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Command {
        op,
        reason: e.to_string(),
    })
}

/// The key of one part of a job's state: `P:job:{<id>}` and
/// `P:job:{<id>}:done` etc. The braces are a Redis Cluster hash tag: only
/// the id is hashed, so every key of one job lives in one slot and the
/// commit scripts, which touch several of them at once, may run on a
/// cluster.
pub fn job_scoped(prefix: &str, id: &str, suffix: &str) -> String {
    format!("{prefix}:job:{{{id}}}{suffix}")
}

/// A `SCAN` pattern for every key of the jobs whose id starts with
/// `id_stem` (`P:job:{<stem>*`).
pub fn job_keys_pattern(prefix: &str, id_stem: &str) -> String {
    format!("{prefix}:job:{{{id_stem}*")
}

/// The job id in one of its keys, and whether the key is the job's record
/// (`P:job:{<id>}`) rather than one of its parts (`P:job:{<id>}:done` …).
pub fn job_of_key<'k>(prefix: &str, key: &'k str) -> Option<(&'k str, bool)> {
    let rest = key.strip_prefix(prefix)?.strip_prefix(":job:{")?;
    let (id, after) = rest.split_once('}')?;
    Some((id, after.is_empty()))
}

/// Every key one job has, its record's first.
fn job_keys(prefix: &str, id: &str) -> [String; 12] {
    [
        "",
        ":done",
        ":stats",
        ":failed",
        ":leases",
        ":redispatched",
        ":work",
        ":hist",
        ":copies",
        ":unable",
        ":inputs",
        ":follower",
    ]
    .map(|suffix| job_scoped(prefix, id, suffix))
}

/// Where a fresh connection comes from.
#[derive(Clone)]
enum Source {
    /// One server, through a pool that checks a connection on checkout.
    Pool(Pool),
    /// A Redis Cluster, from some of its nodes.
    Cluster(Box<redis::cluster::ClusterClient>),
    /// The primary the Sentinels name, asked again for every connection:
    /// after a failover the next connection reaches the new primary.
    Sentinel {
        client: Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>,
        timeout: Duration,
    },
}

impl Source {
    /// A fresh connection, and for a primary found through Sentinels its
    /// address.
    async fn connection(&self) -> Result<(AnyConn, Option<String>), String> {
        match self {
            Source::Pool(pool) => Ok((
                AnyConn::Single((*pool.get().await.map_err(|e| e.to_string())?).clone()),
                None,
            )),
            Source::Cluster(client) => Ok((
                AnyConn::Cluster(
                    client
                        .get_async_connection()
                        .await
                        .map_err(|e| e.to_string())?,
                ),
                None,
            )),
            Source::Sentinel { client, timeout } => {
                let connect = async {
                    let primary = client.lock().await.async_get_client().await?;
                    let addr = primary.get_connection_info().addr().to_string();
                    let conn = primary.get_multiplexed_async_connection().await?;
                    Ok::<_, redis::RedisError>((AnyConn::Single(conn), Some(addr)))
                };
                match tokio::time::timeout(*timeout, connect).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!(
                        "no primary reachable through the Sentinels within {}s",
                        timeout.as_secs()
                    )),
                }
            }
        }
    }
}

/// Asks the Sentinels every second which server is the primary, and drops
/// the shared connection when it is another than the one it reaches: after
/// a failover the old primary may take writes for seconds until the
/// Sentinels demote it (on a manual failover, until their next look at it),
/// and what it takes then is lost. Stops with the store.
fn watch_primary(
    client: Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>,
    master: String,
    shared: std::sync::Weak<Mutex<Shared>>,
) {
    tokio::spawn(async move {
        let mut sentinel: Option<MultiplexedConnection> = None;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            if sentinel.is_none() {
                let Ok(c) = client.lock().await.async_get_sentinel_client().await else {
                    continue;
                };
                sentinel = c.get_multiplexed_async_connection().await.ok();
            }
            let Some(conn) = sentinel.as_mut() else {
                continue;
            };
            let named: Option<(String, u16)> = match redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&master)
                .query_async(conn)
                .await
            {
                Ok(named) => named,
                Err(_) => {
                    sentinel = None;
                    continue;
                }
            };
            let Some((host, port)) = named else { continue };
            let now = format!("{host}:{port}");
            let mut s = shared.lock().expect("not poisoned");
            if let Some(addr) = s.addr.as_deref().filter(|a| *a != now) {
                tracing::warn!(from = %addr, to = %now, "the Sentinels name another Redis primary; reconnecting to it");
                s.conn = None;
                s.addr = None;
            }
        }
    });
}

/// A client that asks the endpoint's Sentinels for the primary and connects
/// to it with the URL's user, password, database and TLS settings.
fn sentinel_client(
    endpoint: &Endpoint,
    sentinel: &crate::endpoint::Sentinel,
    tls: Option<&crate::endpoint::TlsMaterial>,
) -> redis::RedisResult<redis::sentinel::SentinelClient> {
    use redis::IntoConnectionInfo;
    let data = endpoint.url.expose().into_connection_info()?;
    let mut addrs = Vec::new();
    let mut sentinel_auth: Option<(Option<String>, String)> = None;
    for node in &sentinel.nodes {
        let info = node.expose().into_connection_info()?;
        addrs.push(info.addr().clone());
        let r = info.redis_settings();
        if let (None, Some(pw)) = (&sentinel_auth, r.password()) {
            sentinel_auth = Some((r.username().map(str::to_owned), pw.to_owned()));
        }
    }
    let mut b = redis::sentinel::SentinelClientBuilder::new(
        addrs,
        &sentinel.master,
        redis::sentinel::SentinelServerType::Master,
    )?
    .set_client_to_redis_db(data.redis_settings().db());
    if let Some(user) = data.redis_settings().username() {
        b = b.set_client_to_redis_username(user);
    }
    if let Some(pw) = data.redis_settings().password() {
        b = b.set_client_to_redis_password(pw);
    }
    if let Some((user, pw)) = sentinel_auth {
        if let Some(user) = user {
            b = b.set_client_to_sentinel_username(user);
        }
        b = b.set_client_to_sentinel_password(pw);
    }
    if endpoint.is_tls() {
        b = b.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
        if let Some(m) = tls {
            b = b.set_client_to_redis_certificates(redis::TlsCertificates {
                client_tls: m.client.clone().map(|(client_cert, client_key)| {
                    redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }
                }),
                root_cert: m.ca_pem.clone(),
            });
        }
    }
    b.build()
}

/// Handle to the job state in Redis; cheap to clone.
#[derive(Clone)]
pub struct RedisStore {
    source: Source,
    /// The connection every operation shares (see [`RedisStore::conn`]).
    shared: Arc<Mutex<Shared>>,
    prefix: String,
    commit: redis::Script,
    fail: redis::Script,
    lease: redis::Script,
    start: redis::Script,
    fail_job: redis::Script,
    published: redis::Script,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects and checks the server answers `PING` within `timeout`. A
    /// `rediss://` URL connects with TLS, trusting the endpoint's CA file
    /// (or, without one, the system's roots), and presenting its client
    /// certificate when one is given.
    pub async fn connect(
        endpoint: &Endpoint,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let url = &endpoint.url;
        // Through Sentinels, the URL's host is not where Redis is.
        let shown = endpoint
            .sentinel
            .as_ref()
            .map_or_else(|| url.redacted(), |s| s.describe());
        let connect_err = |reason: String| {
            let mut reason = scrub(&reason, url);
            if let Some(s) = &endpoint.sentinel {
                for node in &s.nodes {
                    reason = scrub(&reason, node);
                }
            }
            let lower = reason.to_ascii_lowercase();
            if lower.contains("auth") || lower.contains("password") || lower.contains("noperm") {
                return StoreError::Auth {
                    url: shown.clone(),
                    reason,
                };
            }
            if endpoint.is_tls() && is_certificate_error(&reason) {
                return StoreError::Untrusted {
                    url: shown.clone(),
                    reason,
                    hint: endpoint.untrusted_hint(),
                };
            }
            let hint = match &endpoint.sentinel {
                Some(s) => format!("Are the Sentinels running, and do they monitor a primary named {:?}? Check BATCHFLEET_REDIS_SENTINEL and BATCHFLEET_REDIS_MASTER.", s.master),
                None => endpoint.connect_hint(&reason).unwrap_or_else(|| "Is Redis running? Start it (e.g. `redis-server --daemonize yes`), fix BATCHFLEET_REDIS_URL, or run the job in one process with `batchfleet run --local`.".into()),
            };
            StoreError::Connect {
                url: shown.clone(),
                reason,
                hint,
            }
        };
        // The TLS client runs on the process-wide rustls provider: ring, as
        // for RabbitMQ and S3 (an error only means one is installed already).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tls = endpoint.tls_material().map_err(StoreError::TlsSetup)?;
        let source = match &endpoint.sentinel {
            Some(sentinel) => Source::Sentinel {
                client: Arc::new(tokio::sync::Mutex::new(
                    sentinel_client(endpoint, sentinel, tls.as_ref())
                        .map_err(|e| connect_err(e.to_string()))?,
                )),
                timeout,
            },
            None if endpoint.cluster => {
                let nodes: Vec<String> =
                    url.split().iter().map(|u| u.expose().to_owned()).collect();
                let mut b = redis::cluster::ClusterClientBuilder::new(nodes)
                    .connection_timeout(timeout)
                    .response_timeout(timeout);
                if let Some(m) = tls {
                    b = b.certs(redis::TlsCertificates {
                        client_tls: m.client.map(|(client_cert, client_key)| {
                            redis::ClientTlsConfig {
                                client_cert,
                                client_key,
                            }
                        }),
                        root_cert: m.ca_pem,
                    });
                }
                Source::Cluster(Box::new(b.build().map_err(|e| connect_err(e.to_string()))?))
            }
            None => {
                let client = match tls {
                    Some(m) => redis::Client::build_with_tls(
                        url.expose(),
                        redis::TlsCertificates {
                            client_tls: m.client.map(|(client_cert, client_key)| {
                                redis::ClientTlsConfig {
                                    client_cert,
                                    client_key,
                                }
                            }),
                            root_cert: m.ca_pem,
                        },
                    ),
                    None => redis::Client::open(url.expose()),
                }
                .map_err(|e| connect_err(e.to_string()))?;
                let manager = deadpool_redis::Manager::new(client.get_connection_info().clone())
                    .map_err(|e| connect_err(e.to_string()))?;
                let mut pool_cfg = deadpool_redis::PoolConfig::new(16);
                pool_cfg.timeouts.wait = Some(timeout);
                pool_cfg.timeouts.create = Some(timeout);
                pool_cfg.timeouts.recycle = Some(timeout);
                let pool = Pool::builder(manager)
                    .config(pool_cfg)
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(|e| connect_err(e.to_string()))?;
                Source::Pool(pool)
            }
        };
        let store = Self {
            source,
            shared: Arc::default(),
            prefix: prefix.to_owned(),
            commit: redis::Script::new(COMMIT_SCRIPT),
            fail: redis::Script::new(FAIL_SCRIPT),
            lease: redis::Script::new(&lease_script()),
            start: redis::Script::new(&start_script()),
            fail_job: redis::Script::new(FAIL_JOB_SCRIPT),
            published: redis::Script::new(PUBLISHED_SCRIPT),
        };
        let ping = async {
            let (mut conn, _) = store.source.connection().await.map_err(connect_err)?;
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map_err(|e| connect_err(e.to_string()))
        };
        match tokio::time::timeout(timeout, ping).await {
            Ok(Ok(_)) => {
                if let (Source::Sentinel { client, .. }, Some(sentinel)) =
                    (&store.source, &endpoint.sentinel)
                {
                    watch_primary(
                        client.clone(),
                        sentinel.master.clone(),
                        Arc::downgrade(&store.shared),
                    );
                }
                Ok(store)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(connect_err(format!(
                "no answer within {}s",
                timeout.as_secs()
            ))),
        }
    }

    /// Key prefix in use.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn job_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, "")
    }
    fn done_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":done")
    }
    fn stats_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":stats")
    }
    fn failed_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":failed")
    }
    fn leases_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":leases")
    }
    fn redispatched_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":redispatched")
    }
    fn hist_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":hist")
    }
    fn work_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":work")
    }
    fn copies_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":copies")
    }
    fn unable_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":unable")
    }
    fn inputs_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":inputs")
    }
    fn follower_key(&self, id: &str) -> String {
        job_scoped(&self.prefix, id, ":follower")
    }
    fn jobs_key(&self) -> String {
        format!("{}:jobs", self.prefix)
    }
    fn pool_jobs_key(&self, pool: &str) -> String {
        format!("{}:pool:{pool}:jobs", self.prefix)
    }

    /// Every key of a job's state: what expires with it and is kept when it
    /// runs again (not its follower lease, which has a time to live of its
    /// own that neither may change).
    fn state_keys(&self, id: &str) -> [String; 11] {
        let [state @ .., _follower] = self.keys_of(id);
        state
    }

    /// Every key one job has.
    fn keys_of(&self, id: &str) -> [String; 12] {
        job_keys(&self.prefix, id)
    }

    /// The connection for one operation. Every operation shares one
    /// multiplexed connection: concurrent commands (the items a worker has in
    /// flight, their heartbeats) are pipelined on its socket, and none pays
    /// the `UNWATCH`+`PING` round trip the pool makes on each checkout. The
    /// pool is asked again, and its check made, only after the shared
    /// connection failed (Redis restarted, the network dropped it).
    async fn conn(&self, op: &'static str) -> Result<Conn<'_>, StoreError> {
        {
            let shared = self.shared.lock().expect("not poisoned");
            if let Some(conn) = &shared.conn {
                return Ok(Conn {
                    inner: conn.clone(),
                    generation: shared.generation,
                    shared: &self.shared,
                });
            }
        }
        let (fresh, addr) = self
            .source
            .connection()
            .await
            .map_err(|reason| StoreError::Command { op, reason })?;
        let mut shared = self.shared.lock().expect("not poisoned");
        shared.generation += 1;
        let generation = shared.generation;
        shared.conn = Some(fresh.clone());
        shared.addr = addr;
        Ok(Conn {
            inner: fresh,
            generation,
            shared: &self.shared,
        })
    }

    /// The JSON values of a hash keyed by item seq, decoded, in seq order.
    async fn json_by_seq<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
        op: &'static str,
    ) -> Result<Vec<T>, StoreError> {
        let mut c = self.conn(op).await?;
        let map: BTreeMap<u32, String> = c.hgetall(key).await.map_err(cmd(op))?;
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

#[async_trait::async_trait]
impl JobStore for RedisStore {
    fn describe(&self) -> String {
        format!("Redis (key prefix {})", self.prefix)
    }

    /// Reads a job record, `None` if the job is unknown.
    async fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        let key = self.job_key(id);
        let mut c = self.conn("HGETALL job").await?;
        let map: BTreeMap<String, String> = c.hgetall(&key).await.map_err(cmd("HGETALL job"))?;
        if map.is_empty() {
            return Ok(None);
        }
        JobRecord::from_fields(&key, &map).map(Some)
    }

    /// Writes a new job record (all fields) and lists it in `P:jobs`.
    async fn put_job(&self, job: &JobRecord) -> Result<(), StoreError> {
        let mut c = self.conn("put job").await?;
        // Two slots on a Redis Cluster, so two writes: the index first (a
        // listed job without a record is skipped by its readers).
        c.zadd::<_, _, _, ()>(self.jobs_key(), &job.id, job.created_ms)
            .await
            .map_err(cmd("put job"))?;
        c.hset_multiple::<_, _, _, ()>(self.job_key(&job.id), &job.to_fields())
            .await
            .map_err(cmd("put job"))
    }

    /// Sets some fields of a job record. Never use it for the done counters.
    async fn set_job_fields(&self, id: &str, fields: &[(&str, String)]) -> Result<(), StoreError> {
        let mut c = self.conn("HSET job").await?;
        c.hset_multiple::<_, _, _, ()>(self.job_key(id), fields)
            .await
            .map_err(cmd("HSET job"))
    }

    /// Reads the counters of a job in one round trip.
    async fn progress(&self, id: &str) -> Result<Progress, StoreError> {
        let mut c = self.conn("HMGET progress").await?;
        let (vals, status, items_failed): (Vec<Option<u64>>, Option<String>, u64) = redis::pipe()
            .cmd("HMGET")
            .arg(self.job_key(id))
            .arg(&["items_done", "rows_done", "items_total", "rows_total"])
            .hget(self.job_key(id), "status")
            .hlen(self.failed_key(id))
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
            status: status.as_deref().and_then(JobStatus::parse),
        })
    }

    /// Marks an item done and adds its prediction histogram (`counts[column][bin]`),
    /// and drops the lease of `stats.worker` on it.
    /// Returns `true` if this call won (first commit), `false` if the item
    /// had already been committed by someone else (nothing is added then).
    async fn commit_item(
        &self,
        job: &str,
        stats: &ItemStats,
        histogram: &[Vec<u64>],
    ) -> Result<bool, StoreError> {
        let hist = encode("encode histogram", histogram)?;
        let json = encode("encode stats", stats)?;
        let mut c = self.conn("commit item").await?;
        let won: i64 = self
            .commit
            .key(self.done_key(job))
            .key(self.job_key(job))
            .key(self.stats_key(job))
            .key(self.failed_key(job))
            .key(self.hist_key(job))
            .key(self.leases_key(job))
            .arg(stats.seq)
            .arg(stats.rows + stats.rows_rejected)
            .arg(json)
            .arg(stats.rows_rejected)
            .arg(hist)
            .arg(format!("{}@{}", stats.seq, stats.worker))
            .invoke_async(&mut c)
            .await
            .map_err(cmd("commit item"))?;
        Ok(won == 1)
    }

    /// Records that an item failed for good. Returns `false` (and records
    /// nothing) if the item is already done.
    async fn fail_item(&self, job: &str, failure: &ItemFailure) -> Result<bool, StoreError> {
        let json = encode("encode failure", failure)?;
        let mut c = self.conn("fail item").await?;
        let recorded: i64 = self
            .fail
            .key(self.done_key(job))
            .key(self.failed_key(job))
            .arg(failure.seq)
            .arg(json)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("fail item"))?;
        Ok(recorded == 1)
    }

    /// Items that failed for good, in seq order.
    async fn failures(&self, job: &str) -> Result<Vec<ItemFailure>, StoreError> {
        self.json_by_seq(&self.failed_key(job), "HGETALL failed")
            .await
    }

    /// Forgets recorded failures of a job (before its failed items are published again).
    async fn clear_failures(&self, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("DEL failed").await?;
        c.del::<_, ()>(self.failed_key(job))
            .await
            .map_err(cmd("DEL failed"))
    }

    /// Forgets the failure of one item (before it is published again).
    async fn clear_failure(&self, job: &str, seq: u32) -> Result<(), StoreError> {
        let mut c = self.conn("HDEL failed").await?;
        c.hdel::<_, _, ()>(self.failed_key(job), seq)
            .await
            .map_err(cmd("HDEL failed"))
    }

    /// Whether an item is marked done.
    async fn is_done(&self, job: &str, seq: u32) -> Result<bool, StoreError> {
        let mut c = self.conn("SISMEMBER done").await?;
        c.sismember(self.done_key(job), seq)
            .await
            .map_err(cmd("SISMEMBER done"))
    }

    /// Which of `seqs` are done (one round trip).
    async fn done_among(&self, job: &str, seqs: &[u32]) -> Result<HashSet<u32>, StoreError> {
        if seqs.is_empty() {
            return Ok(HashSet::new());
        }
        let mut c = self.conn("SISMEMBER done").await?;
        let mut pipe = redis::pipe();
        for s in seqs {
            pipe.sismember(self.done_key(job), s);
        }
        let flags: Vec<bool> = pipe
            .query_async(&mut c)
            .await
            .map_err(cmd("SISMEMBER done"))?;
        Ok(seqs
            .iter()
            .zip(flags)
            .filter_map(|(s, d)| d.then_some(*s))
            .collect())
    }

    /// All done seqs of a job.
    async fn done_items(&self, job: &str) -> Result<HashSet<u32>, StoreError> {
        let mut c = self.conn("SMEMBERS done").await?;
        c.smembers(self.done_key(job))
            .await
            .map_err(cmd("SMEMBERS done"))
    }

    /// Stats of every committed item, in seq order.
    async fn item_stats(&self, job: &str) -> Result<Vec<ItemStats>, StoreError> {
        self.json_by_seq(&self.stats_key(job), "HGETALL stats")
            .await
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
            .start
            .key(self.done_key(job))
            .key(self.leases_key(job))
            .key(self.work_key(job))
            .key(self.failed_key(job))
            .key(self.job_key(job))
            .arg(lease.seq)
            .arg(lease.field())
            .arg(json)
            .arg(claim.model_sha256)
            .arg(claim.output_dir)
            .arg(claim.pool)
            .arg(claim.model)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("start item"))?;
        let corrupt = |what: &str| StoreError::Corrupt {
            key: self.job_key(job),
            reason: format!("the start script answered {what}"),
        };
        let word = |i: usize| reply.get(i).cloned().unwrap_or_default();
        Ok(match word(0).as_str() {
            "started" => Start::Started {
                at_ms: word(1).parse().map_err(|_| corrupt(&word(1)))?,
            },
            "done" => Start::Done,
            "failed" => Start::FailedForGood,
            "job_failed" => Start::JobFailed,
            "unknown" => Start::UnknownJob,
            "not_running" => {
                Start::NotRunning(JobStatus::parse(&word(1)).ok_or_else(|| corrupt(&word(1)))?)
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
    async fn heartbeat(&self, job: &str, lease: &Lease) -> Result<bool, StoreError> {
        let json = encode("encode lease", lease)?;
        let mut c = self.conn("heartbeat").await?;
        let written: i64 = self
            .lease
            .key(self.done_key(job))
            .key(self.leases_key(job))
            .key(self.job_key(job))
            .arg(lease.seq)
            .arg(lease.field())
            .arg(json)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("heartbeat"))?;
        Ok(written == 1)
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
            .fail_job
            .key(self.job_key(job))
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
        self.published
            .key(self.job_key(job))
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
        c.hset::<_, _, _, ()>(self.unable_key(job), worker, json)
            .await
            .map_err(cmd("HSET unable"))
    }

    /// Forgets that `worker` could not take the job's items.
    async fn clear_unable(&self, job: &str, worker: &str) -> Result<(), StoreError> {
        let mut c = self.conn("HDEL unable").await?;
        c.hdel::<_, _, ()>(self.unable_key(job), worker)
            .await
            .map_err(cmd("HDEL unable"))
    }

    /// Forgets every worker's note on the job (the job runs again).
    async fn clear_unable_notes(&self, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("DEL unable").await?;
        c.del::<_, ()>(self.unable_key(job))
            .await
            .map_err(cmd("DEL unable"))
    }

    /// Workers that said they cannot take the job's items, by worker id.
    async fn unable(&self, job: &str) -> Result<BTreeMap<String, UnableNote>, StoreError> {
        let key = self.unable_key(job);
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
        c.hdel::<_, _, ()>(self.leases_key(job), fields)
            .await
            .map_err(cmd("HDEL lease"))
    }

    /// Every lease of a job, in seq order.
    async fn leases(&self, job: &str) -> Result<Vec<Lease>, StoreError> {
        let key = self.leases_key(job);
        let mut c = self.conn("HGETALL leases").await?;
        let map: BTreeMap<String, String> = c.hgetall(&key).await.map_err(cmd("HGETALL leases"))?;
        let mut leases = map
            .values()
            .map(|json| {
                serde_json::from_str::<Lease>(json).map_err(|e| StoreError::Corrupt {
                    key: key.clone(),
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        leases.sort_by(|a, b| (a.seq, &a.worker).cmp(&(b.seq, &b.worker)));
        Ok(leases)
    }

    /// The job's prediction histogram, `counts[column][bin]` (bins + 2 per column).
    async fn histogram(&self, job: &str, bins: usize) -> Result<Vec<Vec<u64>>, StoreError> {
        let key = self.hist_key(job);
        let mut c = self.conn("HGETALL hist").await?;
        let map: BTreeMap<String, u64> = c.hgetall(&key).await.map_err(cmd("HGETALL hist"))?;
        let mut counts: Vec<Vec<u64>> = Vec::new();
        for (field, n) in map {
            let parsed = field
                .split_once(':')
                .and_then(|(c, b)| Some((c.parse::<usize>().ok()?, b.parse::<usize>().ok()?)));
            let Some((col, bin)) = parsed.filter(|(_, b)| *b < bins) else {
                return Err(StoreError::Corrupt {
                    key,
                    reason: format!("unexpected field {field}"),
                });
            };
            if counts.len() <= col {
                counts.resize(col + 1, vec![0; bins]);
            }
            counts[col][bin] = n;
        }
        Ok(counts)
    }

    /// Adds to the job's work counters: items started and rows put through
    /// the model (the work actually done, including work a fault wasted).
    async fn count_work(&self, job: &str, deliveries: u64, rows: u64) -> Result<(), StoreError> {
        let mut c = self.conn("HINCRBY work").await?;
        redis::pipe()
            .hincr(self.work_key(job), "deliveries", deliveries)
            .ignore()
            .hincr(self.work_key(job), "rows_computed", rows)
            .ignore()
            .query_async::<()>(&mut c)
            .await
            .map_err(cmd("HINCRBY work"))
    }

    /// The job's work counters: (items started, rows computed).
    async fn work(&self, job: &str) -> Result<(u64, u64), StoreError> {
        let mut c = self.conn("HMGET work").await?;
        let (d, r): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(self.work_key(job))
            .arg(&["deliveries", "rows_computed"])
            .query_async(&mut c)
            .await
            .map_err(cmd("HMGET work"))?;
        Ok((d.unwrap_or(0), r.unwrap_or(0)))
    }

    /// When the coordinator last published a copy of each item (seq → ms).
    async fn redispatched(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError> {
        let mut c = self.conn("HGETALL redispatched").await?;
        c.hgetall(self.redispatched_key(job))
            .await
            .map_err(cmd("HGETALL redispatched"))
    }

    /// Records that a copy of item `seq` was published at `at_ms` (Redis
    /// time); returns how many copies of it have been published in all.
    async fn mark_redispatched(&self, job: &str, seq: u32, at_ms: u64) -> Result<u64, StoreError> {
        let mut c = self.conn("HSET redispatched").await?;
        let (copies,): (u64,) = redis::pipe()
            .hset(self.redispatched_key(job), seq, at_ms)
            .ignore()
            .hincr(self.copies_key(job), seq, 1)
            .query_async(&mut c)
            .await
            .map_err(cmd("HSET redispatched"))?;
        Ok(copies)
    }

    /// How many copies of each item the coordinator published (seq → count).
    async fn copies(&self, job: &str) -> Result<BTreeMap<u32, u64>, StoreError> {
        let mut c = self.conn("HGETALL copies").await?;
        c.hgetall(self.copies_key(job))
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
        c.zadd::<_, _, _, ()>(self.jobs_key(), &job.id, job.created_ms)
            .await
            .map_err(cmd("restore job"))?;
        c.hset_multiple::<_, _, _, ()>(self.job_key(&job.id), &fields)
            .await
            .map_err(cmd("restore job"))
    }

    /// Most recent job ids, newest first.
    async fn recent_jobs(&self, limit: usize) -> Result<Vec<String>, StoreError> {
        let mut c = self.conn("ZREVRANGE jobs").await?;
        let stop = limit.saturating_sub(1) as isize;
        c.zrevrange(self.jobs_key(), 0, stop)
            .await
            .map_err(cmd("ZREVRANGE jobs"))
    }

    /// Deletes every key of a job (tests and `purge`).
    async fn delete_job(&self, id: &str) -> Result<(), StoreError> {
        let mut c = self.conn("DEL job").await?;
        // The job's keys (one slot), then the index (another).
        c.del::<_, ()>(&self.keys_of(id))
            .await
            .map_err(cmd("DEL job"))?;
        c.zrem::<_, _, ()>(self.jobs_key(), id)
            .await
            .map_err(cmd("DEL job"))
    }

    /// `HSET P:job:{<id>}:inputs`, a thousand files per command.
    async fn put_inputs(&self, job: &str, inputs: &[(String, String)]) -> Result<(), StoreError> {
        let key = self.inputs_key(job);
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
        let mut c = self.conn("HGETALL inputs").await?;
        c.hgetall(self.inputs_key(job))
            .await
            .map_err(cmd("HGETALL inputs"))
    }

    /// `PEXPIRE` on every key of the job, in one `MULTI`.
    async fn expire_job(&self, job: &str, ttl: std::time::Duration) -> Result<(), StoreError> {
        let ms = ttl.as_millis().clamp(1, i64::MAX as u128) as i64;
        let mut c = self.conn("PEXPIRE job").await?;
        let mut pipe = redis::pipe();
        pipe.atomic();
        for key in self.state_keys(job) {
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
        for key in self.state_keys(job) {
            pipe.persist(key).ignore();
        }
        pipe.query_async::<()>(&mut c)
            .await
            .map_err(cmd("PERSIST job"))
    }

    async fn follow_lease(&self, job: &str, who: &str, ttl: Duration) -> Result<bool, StoreError> {
        let mut c = self.conn("follower lease").await?;
        let held: i64 = redis::Script::new(FOLLOW_SCRIPT)
            .key(self.follower_key(job))
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
            .key(self.follower_key(job))
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
            .key(self.job_key(job))
            .arg(who)
            .arg(stale.as_millis() as u64)
            .invoke_async(&mut c)
            .await
            .map_err(cmd("claim reduce"))?;
        Ok(won == 1)
    }

    async fn activate_job(&self, pool: &str, job: &str, weight: u32) -> Result<(), StoreError> {
        let mut c = self.conn("HSET pool jobs").await?;
        c.hset::<_, _, _, ()>(self.pool_jobs_key(pool), job, weight)
            .await
            .map_err(cmd("HSET pool jobs"))
    }

    async fn deactivate_job(&self, pool: &str, job: &str) -> Result<(), StoreError> {
        let mut c = self.conn("HDEL pool jobs").await?;
        c.hdel::<_, _, ()>(self.pool_jobs_key(pool), job)
            .await
            .map_err(cmd("HDEL pool jobs"))
    }

    async fn active_jobs(&self, pool: &str) -> Result<BTreeMap<String, u32>, StoreError> {
        let mut c = self.conn("HGETALL pool jobs").await?;
        c.hgetall(self.pool_jobs_key(pool))
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
    use super::*;

    /// The Redis Cluster slot of a key: CRC16/XMODEM of its hash tag (the
    /// text between the first `{` and the next `}`, when not empty) or of
    /// the whole key, modulo 16384 — as the cluster specification defines.
    fn slot(key: &str) -> u16 {
        let bytes = key.as_bytes();
        let hashed = match key.find('{') {
            Some(open) => match key[open + 1..].find('}') {
                Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
                _ => bytes,
            },
            None => bytes,
        };
        let mut crc: u16 = 0;
        for &b in hashed {
            crc ^= u16::from(b) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }

    #[test]
    fn the_slot_function_matches_the_cluster_specification() {
        // The specification's check value: CRC16("123456789") = 0x31C3.
        assert_eq!(slot("123456789"), 0x31C3); // below 16384: the slot is the CRC
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        // An empty tag does not count: the whole key is hashed.
        assert_ne!(slot("foo{}{bar}"), slot("bar"));
        assert_ne!(slot("foo{}{bar}"), slot(""));
    }

    #[test]
    fn every_key_of_one_job_hashes_to_one_slot() {
        for (prefix, id) in [
            ("bf", "20261204-120000-a1b2c3"),
            ("batchfleet:prod", "j-1"),
            ("t", "x"),
        ] {
            let keys = job_keys(prefix, id);
            assert_eq!(keys.len(), 12);
            let first = slot(&keys[0]);
            for k in &keys {
                assert!(k.starts_with(&format!("{prefix}:job:{{{id}}}")), "{k}");
                assert_eq!(slot(k), first, "{k} is in another slot than {}", keys[0]);
            }
            // The slot is the id's: two jobs spread over the cluster.
            assert_eq!(first, slot(id));
        }
        // Each key names its job, and only the first is the record.
        let keys = job_keys("bf", "j-1");
        assert_eq!(job_of_key("bf", &keys[0]), Some(("j-1", true)));
        assert!(keys[1..]
            .iter()
            .all(|k| job_of_key("bf", k) == Some(("j-1", false))));
        assert_eq!(job_of_key("other", &keys[0]), None);
        assert_eq!(job_keys_pattern("bf", "j-"), "bf:job:{j-*");
        let a = job_keys("bf", "job-a");
        let b = job_keys("bf", "job-b");
        assert_ne!(slot(&a[0]), slot(&b[0]));
        // Keys differ per part, so no two parts collide.
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), a.len());
    }
}
