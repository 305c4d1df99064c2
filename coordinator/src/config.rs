//! Settings every coordinator command shares ([`Connections`]) and those of
//! `batchfleet run` ([`RunConfig`]), built from the command line in [`crate::cli`].

use batchfleet_shared::backend::Backend;
use batchfleet_shared::broker::{Broker, BrokerError};
use batchfleet_shared::store::{Store, StoreError};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Connection settings shared by every coordinator command.
#[derive(Debug, Clone)]
pub struct Connections {
    /// RabbitMQ and Redis, or the in-process queues and store of
    /// `batchfleet run --local`.
    pub backend: Backend,
    /// How long to wait for RabbitMQ or Redis to answer before giving up.
    pub connect_timeout: Duration,
    /// Signs every published work item when set (workers holding the same
    /// key refuse anything else).
    pub signing_key: Option<batchfleet_shared::signing::SigningKey>,
    /// How long a finished job's state stays in Redis (its summary stays in
    /// the output folder for good).
    pub retention: Duration,
    /// What a job's `[on_complete]` may do.
    pub hooks: crate::hooks::HookPolicy,
    /// Publish work messages whole (version 2: the task in every message)
    /// rather than naming the job's stored task (version 3), and create new
    /// jobs with a done set rather than a bitmap, for a fleet whose workers
    /// are not all of this version yet.
    pub whole_messages: bool,
    /// Most items in one work message (`--bundle`): a job of many short
    /// items is published as bundles of consecutive items (version 4),
    /// fewer where items are long or few
    /// ([`batchfleet_shared::message::bundle_size`]); 1 publishes one item
    /// per message (version 3), for workers older than version 4.
    pub bundle: usize,
}

/// The default of `--retention` (`BATCHFLEET_RETENTION`).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

impl Connections {
    /// A work item's message as this coordinator publishes it, at delivery
    /// attempt `attempt`: signed when a key is set; version 3 unless
    /// [`Connections::whole_messages`].
    pub fn work_message(
        &self,
        item: &batchfleet_shared::message::WorkItem,
        attempt: u32,
    ) -> batchfleet_shared::broker::Outgoing {
        use batchfleet_shared::broker::Outgoing;
        let key = self.signing_key.as_ref();
        if self.whole_messages && item.task_sha256.is_some() {
            let mut whole = item.clone();
            whole.task_sha256 = None;
            return Outgoing::work_item(&whole, attempt, key);
        }
        Outgoing::work_item(item, attempt, key)
    }

    /// The messages of `items` (all of one job, whose items average
    /// `rows_per_item` rows, `job_items` in all) at attempt 1: bundles of
    /// up to [`Connections::bundle`] consecutive items where items are
    /// short, else one item per message.
    pub fn work_messages(
        &self,
        items: &[&batchfleet_shared::message::WorkItem],
        job_items: usize,
        rows_per_item: u64,
    ) -> Vec<batchfleet_shared::broker::Outgoing> {
        use batchfleet_shared::broker::Outgoing;
        use batchfleet_shared::message::{bundle_size, Bundle};
        let size = if self.whole_messages {
            1
        } else {
            bundle_size(job_items, rows_per_item, self.bundle)
        };
        if size <= 1 {
            return items.iter().map(|i| self.work_message(i, 1)).collect();
        }
        let key = self.signing_key.as_ref();
        let mut out = Vec::with_capacity(items.len().div_ceil(size));
        for chunk in items.chunks(size) {
            let refs: Option<Vec<_>> = chunk.iter().map(|i| i.to_ref()).collect();
            match refs.as_deref().and_then(Bundle::of) {
                Some(bundle) if chunk.len() > 1 => out.push(Outgoing::bundle(bundle, key)),
                // One item left over, or items that carry their task: alone.
                _ => out.extend(chunk.iter().map(|i| self.work_message(i, 1))),
            }
        }
        out
    }

    /// Connects to Redis (or hands out the in-process store).
    pub async fn store(&self) -> Result<Store, StoreError> {
        self.backend.store(self.connect_timeout).await
    }

    /// Connects to RabbitMQ as `name` (or opens a handle on the in-process queues).
    pub async fn broker(&self, name: &str) -> Result<Arc<dyn Broker>, BrokerError> {
        self.backend.broker(name, self.connect_timeout).await
    }
}

impl RunConfig {
    /// Reads and validates a manifest (see [`crate::manifest::load_with`])
    /// under this run's data roots, and checks its `[on_complete]` against
    /// the operator's [`crate::hooks::HookPolicy`]: a refused hook refuses
    /// the job before anything is published.
    pub fn load(
        &self,
        path: &std::path::Path,
        overrides: &[String],
    ) -> Result<crate::manifest::JobSpec, crate::manifest::ManifestError> {
        self.load_trying(path, overrides, self.trial)
    }

    /// [`RunConfig::load`] for a job validated when it was run (`resume`,
    /// `dlq replay`): its model is not tried again.
    pub fn load_known(
        &self,
        path: &std::path::Path,
        overrides: &[String],
    ) -> Result<crate::manifest::JobSpec, crate::manifest::ManifestError> {
        self.load_trying(path, overrides, crate::manifest::ModelTrial::Skip)
    }

    fn load_trying(
        &self,
        path: &std::path::Path,
        overrides: &[String],
        trial: crate::manifest::ModelTrial,
    ) -> Result<crate::manifest::JobSpec, crate::manifest::ManifestError> {
        let spec = crate::manifest::load_trying(path, &self.data_roots, overrides, trial)?;
        let problems: Vec<_> = self
            .connections
            .hooks
            .problems(&spec.on_complete)
            .into_iter()
            .map(|(field, message)| crate::manifest::Problem {
                field: field.into(),
                message,
            })
            .collect();
        if problems.is_empty() {
            Ok(spec)
        } else {
            Err(crate::manifest::ManifestError {
                file: path.to_owned(),
                problems,
            })
        }
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
    pub supervise: SuperviseConfig,
    /// Folders every path of a job must stay under; empty: the manifest's folder.
    pub data_roots: Vec<PathBuf>,
    /// `--set key=value` overrides applied over the manifest file.
    pub overrides: Vec<String>,
    /// How a new job's model call is tried at validation (`--validate-memory`).
    pub trial: crate::manifest::ModelTrial,
    /// `run --since`: what the narrowed job scores and reuses, written to
    /// its output folder (`_since.json`) once the folder is claimed.
    pub since: Option<std::sync::Arc<crate::since::Incremental>>,
}

/// Straggler and orphan settings.
#[derive(Debug, Clone)]
pub struct SuperviseConfig {
    /// Speculate on an item held this many times the median item time (0 = never).
    pub speculate_after: f64,
    /// Never speculate on an item held less than this.
    pub speculate_min: Duration,
    /// An item neither queued nor leased for this long is published again.
    pub orphan_grace: Duration,
    /// How often the fleet is checked.
    pub every: Duration,
    /// Fail the job when workers cannot run it and nothing was committed for this long.
    pub unable_timeout: Duration,
    /// A reduce claim not renewed for this long, on a job still unfinished,
    /// is taken over: its reducer died mid-way. The reducer renews it four
    /// times as often while it writes the summary, merges and runs hooks.
    pub reduce_stale: Duration,
    /// How often a job with a deadline or a worker-hour cost has its pace
    /// measured (its rate is taken over at least twelve of these).
    pub pace_every: Duration,
}

impl Default for SuperviseConfig {
    fn default() -> Self {
        Self {
            speculate_after: 3.0,
            speculate_min: Duration::from_secs(2),
            orphan_grace: Duration::from_secs(10),
            every: Duration::from_secs(1),
            unable_timeout: Duration::from_secs(300),
            reduce_stale: Duration::from_secs(120),
            pace_every: crate::pace::PACE_EVERY,
        }
    }
}
