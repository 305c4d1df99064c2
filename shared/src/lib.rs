//! Code that the batchfleet coordinator and workers must agree on.
//!
//! # Layout
//! - [`message`]: the wire format of a work item — a versioned enum encoded with
//!   rmp-serde (named fields) and the AMQP headers that travel with it.
//! - [`backend`]: where queues and job state live — RabbitMQ and Redis, or
//!   the in-process queues and store of `run --local` — chosen in one place.
//! - [`broker`]: the queue interface (`Broker`: confirmed publish, consume
//!   with ack / requeue, get, purge, counts; plain `Headers`) and the queue
//!   topology per pool, with two implementations: RabbitMQ (`broker::amqp`)
//!   and in-process queues (`broker::local`, for `run --local`).
//! - [`store`]: the job-store interface (`JobStore`: job record, start item,
//!   "first commit wins", leases, counters, histograms, failures) with two
//!   implementations: Redis (`store::redis`, atomic Lua scripts) and
//!   in-process memory (`store::local`).
//! - [`output`]: every name in a job's output folder, and its files read back.
//! - [`split`]: byte ranges of text files cut blind and aligned to record
//!   boundaries by whoever reads them.
//! - [`numbers`]: numbers in text fields, parsed as workers read CSV features.
//! - [`cuda`]: libtorch's CUDA support, loaded at start-up where a GPU can use it.
//! - `host`: this machine's name and wall clock ([`host_name`], [`now_ms`]).
//! - [`paths`]: data roots that confine every path of a job.
//! - [`metrics`]: the Prometheus exporter and every metric's name.
//! - [`columns`]: the Arrow column types a Parquet input may use.
//! - [`config`]: the command-line flags both binaries share.
//! - [`secret`]: connection URLs whose credentials never reach logs or
//!   `Debug`, and secrets read from `…_FILE` files.
//! - [`endpoint`]: a service's URL with its TLS files (CA, client
//!   certificate and key), read and checked before connecting.
//! - [`table`]: part files in each output format (CSV, JSON Lines, Parquet), written and read back.
//! - [`fsutil`]: file digests and atomic publication of output files, through
//!   directory handles that never follow a symlink under an output folder.
//! - [`shared_sync`]: one filesystem sync for the files a worker writes
//!   side by side, instead of one `fsync` each.
//! - [`model_file`]: what a model file is (TorchScript, a `state_dict`, a
//!   pickled module, a `torch.export` package), read from its zip entries.
//! - [`signing`]: the key that signs work messages (HMAC-SHA256) and checks them.
//! - [`text`]: text input: a Hugging Face `tokenizer.json` loaded and used
//!   the same way by validation and by workers.
//! - [`source`]: input locations, local files or `s3://` objects, behind one reader.
//! - [`shadow`]: a candidate model scored beside the job's (`[model.shadow]`):
//!   what each item records of the two, merged over the job.
//! - [`shutdown`]: SIGINT/SIGTERM turned into a `CancellationToken`.
//! - [`telemetry`]: tracing subscriber set-up shared by the binaries.

pub mod backend;
pub mod broker;
pub mod columns;
pub mod config;
pub mod cuda;
pub mod endpoint;
pub mod fsutil;
mod host;
pub mod message;
pub mod metrics;
pub mod model_file;
pub mod numbers;
pub mod output;
pub mod paths;
pub mod pinned;
pub mod retire;
pub mod secret;
pub mod shadow;
pub mod shared_sync;
pub mod shutdown;
pub mod signing;
pub mod source;
pub mod split;
pub mod store;
pub mod table;
pub mod telemetry;
pub mod text;

pub use host::{host_name, now_ms, process_memory};
