//! Where queues and job state live: RabbitMQ and Redis (the fleet), or the
//! in-process queues and store of `batchfleet run --local`. The one place
//! that chooses: the coordinator and the worker ask a [`Backend`] for a
//! broker handle and a store, and never name either implementation.

use crate::broker::local::LocalQueues;
use crate::broker::{self, Broker, BrokerError};
use crate::endpoint::Endpoint;
use crate::store::{Store, StoreError};
use std::sync::Arc;
use std::time::Duration;

/// Where a process's queues and job state live.
// One per process (or per `--local` run), made once: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Backend {
    /// RabbitMQ and Redis.
    Fleet {
        /// RabbitMQ: URL (one per node) and TLS files.
        amqp: Endpoint,
        /// Redis: URL and TLS files.
        redis: Endpoint,
        /// Prefix of every Redis key.
        redis_prefix: String,
    },
    /// The in-process queues and store of a `--local` run, shared by its
    /// coordinator and its worker pipelines.
    Local(LocalServices),
}

/// The queues and job store of a `--local` run.
#[derive(Debug, Clone)]
pub struct LocalServices {
    /// The queues.
    pub queues: LocalQueues,
    /// The job store.
    pub store: Store,
}

impl LocalServices {
    /// Empty queues and an empty store.
    pub fn new() -> Self {
        Self {
            queues: LocalQueues::new(),
            store: Store::local(),
        }
    }
}

impl Default for LocalServices {
    fn default() -> Self {
        Self::new()
    }
}

impl Backend {
    /// A broker handle: a new RabbitMQ connection named `name` (one try,
    /// within `timeout`), or a new client of the in-process queues.
    pub async fn broker(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<Arc<dyn Broker>, BrokerError> {
        match self {
            Backend::Fleet { amqp, .. } => broker::connect(amqp, name, timeout).await,
            Backend::Local(local) => Ok(local.queues.handle()),
        }
    }

    /// The job store: a new Redis client (checked within `timeout`), or the
    /// in-process store.
    pub async fn store(&self, timeout: Duration) -> Result<Store, StoreError> {
        match self {
            Backend::Fleet {
                redis,
                redis_prefix,
                ..
            } => Store::connect(redis, redis_prefix, timeout).await,
            Backend::Local(local) => Ok(local.store.clone()),
        }
    }

    /// Whether this is the fleet (RabbitMQ and Redis).
    pub fn is_fleet(&self) -> bool {
        matches!(self, Backend::Fleet { .. })
    }

    /// `text` with the broker URL's credentials masked.
    pub fn scrub(&self, text: &str) -> String {
        match self {
            Backend::Fleet { amqp, .. } => crate::secret::scrub(text, &amqp.url),
            Backend::Local(_) => text.to_owned(),
        }
    }
}
