//! Settings every coordinator command shares ([`Connections`]) and those of
//! `batchfleet run` ([`RunConfig`]), built from the command line in [`crate::cli`].

use crate::supervisor;
use batchfleet_shared::broker::{self, BrokerError};
use batchfleet_shared::secret::SecretUrl;
use batchfleet_shared::store::{Store, StoreError};
use std::path::PathBuf;
use std::time::Duration;

/// Connection settings shared by every coordinator command.
#[derive(Debug, Clone)]
pub struct Connections {
    /// RabbitMQ URL.
    pub amqp_url: SecretUrl,
    /// Redis URL.
    pub redis_url: SecretUrl,
    /// Prefix of every Redis key.
    pub redis_prefix: String,
    /// How long to wait for RabbitMQ or Redis to answer before giving up.
    pub connect_timeout: Duration,
    /// Signs every published work item when set (workers holding the same
    /// key refuse anything else).
    pub signing_key: Option<batchfleet_shared::signing::SigningKey>,
}

impl Connections {
    /// Connects to Redis.
    pub async fn store(&self) -> Result<Store, StoreError> {
        Store::connect(&self.redis_url, &self.redis_prefix, self.connect_timeout).await
    }

    /// Connects to RabbitMQ.
    pub async fn broker(&self, name: &str) -> Result<lapin::Connection, BrokerError> {
        broker::connect(&self.amqp_url, name, self.connect_timeout).await
    }
}

/// Settings of `batchfleet run`.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Broker and store.
    pub connections: Connections,
    /// Draw a progress bar on a terminal.
    pub progress: bool,
    /// How often progress is read from Redis.
    pub poll_interval: Duration,
    /// Unconfirmed publishes allowed in flight.
    pub publish_window: usize,
    /// Stragglers, dead workers and lost items.
    pub supervise: supervisor::SuperviseConfig,
    /// Folders every path of a job must stay under; empty: the manifest's folder.
    pub data_roots: Vec<PathBuf>,
}
