//! Connections to Redis: one server through a pool, a Redis Cluster, or
//! the primary that Redis Sentinels name (asked again for every new
//! connection, and watched so that a connection to a primary they no
//! longer name is dropped). Every operation of a store shares one
//! multiplexed connection, replaced only after it failed.

use crate::endpoint::{is_certificate_error, Endpoint, TlsMaterial};
use crate::secret::scrub;
use crate::store::error::StoreError;
use deadpool_redis::redis;
use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::{Pool, Runtime};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
pub(super) struct Conn<'a> {
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
                    let conn = primary
                        .get_multiplexed_async_connection_with_config(&answer(*timeout))
                        .await?;
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
            b = b.set_client_to_redis_certificates(certificates(m.clone()));
        }
    }
    b.build()
}

/// Where a store's connections come from, and the one its operations share.
#[derive(Clone)]
pub(super) struct Connections {
    source: Source,
    shared: Arc<Mutex<Shared>>,
}

impl Connections {
    /// Whether this is a Redis Cluster (a script reaches one slot only).
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.source, Source::Cluster(_))
    }

    /// Connects and checks the server answers `PING` within `timeout`. A
    /// `rediss://` URL connects with TLS, trusting the endpoint's CA file
    /// (or, without one, the system's roots), and presenting its client
    /// certificate when one is given.
    pub(super) async fn open(endpoint: &Endpoint, timeout: Duration) -> Result<Self, StoreError> {
        let failed = |reason: String| connect_error(endpoint, reason);
        // The TLS client runs on the process-wide rustls provider: ring, as
        // for RabbitMQ and S3 (an error only means one is installed already).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tls = endpoint.tls_material().map_err(StoreError::TlsSetup)?;
        let source = source(endpoint, tls, timeout).map_err(failed)?;
        let ping = async {
            let (mut conn, _) = source.connection().await.map_err(failed)?;
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map_err(|e| failed(e.to_string()))
        };
        match tokio::time::timeout(timeout, ping).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(failed(format!("no answer within {}s", timeout.as_secs()))),
        }
        let shared = Arc::default();
        if let (Source::Sentinel { client, .. }, Some(sentinel)) = (&source, &endpoint.sentinel) {
            watch_primary(
                client.clone(),
                sentinel.master.clone(),
                Arc::downgrade(&shared),
            );
        }
        Ok(Self { source, shared })
    }

    /// The connection for one operation. Every operation shares one
    /// multiplexed connection: concurrent commands (the items a worker has in
    /// flight, their heartbeats) are pipelined on its socket, and none pays
    /// the `UNWATCH`+`PING` round trip the pool makes on each checkout. The
    /// pool is asked again, and its check made, only after the shared
    /// connection failed (Redis restarted, the network dropped it).
    pub(super) async fn conn(&self, op: &'static str) -> Result<Conn<'_>, StoreError> {
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
            .map_err(|reason| StoreError::Unavailable { op, reason })?;
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
}

/// Where connections to `endpoint` come from.
fn source(
    endpoint: &Endpoint,
    tls: Option<TlsMaterial>,
    timeout: Duration,
) -> Result<Source, String> {
    let url = &endpoint.url;
    if let Some(sentinel) = &endpoint.sentinel {
        let client =
            sentinel_client(endpoint, sentinel, tls.as_ref()).map_err(|e| e.to_string())?;
        return Ok(Source::Sentinel {
            client: Arc::new(tokio::sync::Mutex::new(client)),
            timeout,
        });
    }
    if endpoint.cluster {
        let nodes: Vec<String> = url.split().iter().map(|u| u.expose().to_owned()).collect();
        let mut b = redis::cluster::ClusterClientBuilder::new(nodes)
            .connection_timeout(answer_within(timeout))
            .response_timeout(answer_within(timeout));
        if let Some(m) = tls {
            b = b.certs(certificates(m));
        }
        return Ok(Source::Cluster(Box::new(
            b.build().map_err(|e| e.to_string())?,
        )));
    }
    let client = match tls {
        Some(m) => redis::Client::build_with_tls(url.expose(), certificates(m)),
        None => redis::Client::open(url.expose()),
    }
    .map_err(|e| e.to_string())?;
    let manager = deadpool_redis::Manager::new_with_config(
        client.get_connection_info().clone(),
        answer(timeout),
    )
    .map_err(|e| e.to_string())?;
    let mut pool_cfg = deadpool_redis::PoolConfig::new(16);
    pool_cfg.timeouts.wait = Some(timeout);
    pool_cfg.timeouts.create = Some(timeout);
    pool_cfg.timeouts.recycle = Some(timeout);
    let pool = Pool::builder(manager)
        .config(pool_cfg)
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Source::Pool(pool))
}

/// Longest a connection waits for Redis to answer one request, or to
/// accept a connection.
const MOST_PATIENT: Duration = Duration::from_secs(10);

/// How long a request waits for Redis's answer: the process's
/// `--connect-timeout`, at most [`MOST_PATIENT`]. (The client's own default,
/// half a second, failed a coordinator's job start on a host busy enough
/// that an answer took longer, though Redis itself answered in
/// microseconds; past this a request fails as Redis unavailable, and the
/// caller's retries through outages take over.)
fn answer_within(timeout: Duration) -> Duration {
    timeout.min(MOST_PATIENT)
}

/// [`answer_within`] as a connection's settings.
fn answer(timeout: Duration) -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(answer_within(timeout)))
        .set_response_timeout(Some(answer_within(timeout)))
}

/// The redis client's form of the endpoint's TLS files.
fn certificates(m: TlsMaterial) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: m
            .client
            .map(|(client_cert, client_key)| redis::ClientTlsConfig {
                client_cert,
                client_key,
            }),
        root_cert: m.ca_pem,
    }
}

/// A failure to connect to `endpoint`, credentials scrubbed, classed (login
/// refused, certificate not trusted, unreachable) with what to do about it.
fn connect_error(endpoint: &Endpoint, reason: String) -> StoreError {
    let url = &endpoint.url;
    // Through Sentinels, the URL's host is not where Redis is.
    let shown = endpoint
        .sentinel
        .as_ref()
        .map_or_else(|| url.redacted(), |s| s.describe());
    let mut reason = scrub(&reason, url);
    if let Some(s) = &endpoint.sentinel {
        for node in &s.nodes {
            reason = scrub(&reason, node);
        }
    }
    let lower = reason.to_ascii_lowercase();
    if lower.contains("auth") || lower.contains("password") || lower.contains("noperm") {
        return StoreError::Auth { url: shown, reason };
    }
    if endpoint.is_tls() && is_certificate_error(&reason) {
        return StoreError::Untrusted {
            url: shown,
            reason,
            hint: endpoint.untrusted_hint(),
        };
    }
    let hint = match &endpoint.sentinel {
        Some(s) => format!("Are the Sentinels running, and do they monitor a primary named {:?}? Check BATCHFLEET_REDIS_SENTINEL and BATCHFLEET_REDIS_MASTER.", s.master),
        None => endpoint.connect_hint(&reason).unwrap_or_else(|| "Is Redis running? Start it (e.g. `redis-server --daemonize yes`), fix BATCHFLEET_REDIS_URL, or run the job in one process with `batchfleet run --local`.".into()),
    };
    StoreError::Connect {
        url: shown,
        reason,
        hint,
    }
}
