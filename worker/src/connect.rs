//! The worker's connections to the broker and the job store: asked of the
//! [`Backend`] and retried with capped exponential backoff up to
//! `--outage-timeout`, at start-up and after losing either (a broker or
//! Redis restart). A refusal that no retry can mend (wrong credentials, an
//! untrusted certificate) ends the wait at once.

use crate::config::WorkerConfig;
use crate::consumer::session::Session;
use backon::{ExponentialBuilder, Retryable};
use batchfleet_shared::backend::Backend;
use batchfleet_shared::broker::{BrokerError, PoolQueues};
use batchfleet_shared::store::{Store, StoreError};
use std::time::{Duration, Instant};

/// A consuming session on a new broker handle (a RabbitMQ connection named
/// after the worker, or a new client of the in-process queues). Opening it
/// is tried again like connecting: the broker may close a connection while
/// the session declares and subscribes (RabbitMQ answers `INTERNAL_ERROR`
/// to a consume on a quorum queue whose process is still starting, as when
/// hundreds of workers start together on a new pool).
pub(crate) async fn session(
    backend: &Backend,
    cfg: &WorkerConfig,
    worker_id: &str,
    queues: &PoolQueues,
    prefetch: u16,
) -> anyhow::Result<Session> {
    let name = format!("batchfleet-worker {worker_id}");
    let per_try = per_try(cfg);
    Ok(with_retry("RabbitMQ", cfg.outage(), || async {
        let broker = backend.broker(&name, per_try).await?;
        match Session::open(broker.clone(), queues, prefetch, worker_id, cfg.job_queues).await {
            Ok(mut session) => {
                if let Some(grace) = cfg.debug_retired_grace {
                    session.set_retired_grace(grace);
                }
                Ok(session)
            }
            Err(e) => {
                broker.close("trying again").await;
                Err(e)
            }
        }
    })
    .await?)
}

/// The job store: Redis, or the in-process store.
pub(crate) async fn store(backend: &Backend, cfg: &WorkerConfig) -> anyhow::Result<Store> {
    let per_try = per_try(cfg);
    Ok(with_retry("Redis", cfg.outage(), || backend.store(per_try)).await?)
}

/// How long one try may take.
fn per_try(cfg: &WorkerConfig) -> Duration {
    cfg.connect_timeout.min(Duration::from_secs(10))
}

/// Errors that make waiting pointless (wrong credentials).
trait Permanent {
    fn is_permanent(&self) -> bool;
}
impl Permanent for BrokerError {
    fn is_permanent(&self) -> bool {
        BrokerError::is_permanent(self)
    }
}
impl Permanent for StoreError {
    fn is_permanent(&self) -> bool {
        StoreError::is_permanent(self)
    }
}

/// Retries `connect` with capped exponential backoff until `budget` is spent,
/// failing at once on a permanent error.
async fn with_retry<T, E, F, Fut>(what: &str, budget: Duration, connect: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display + Permanent,
{
    let deadline = Instant::now() + budget;
    connect
        .retry(ExponentialBuilder::default().with_min_delay(Duration::from_millis(200)).with_max_delay(Duration::from_secs(5)).with_jitter().without_max_times())
        .when(|e: &E| !e.is_permanent() && Instant::now() < deadline)
        .notify(|e, wait| tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "{what} not reachable yet"))
        .await
}
