//! batchfleet's data/model generation, verification and benchmarks.
//!
//! The library holds what tests share and never touches libtorch, so test
//! binaries that link it need no libtorch; the benchmarks that do run
//! libtorch live in the `batchfleet-loadtest` binary (`src/main.rs`, `src/forward.rs`).
//!
//! # Layout
//! - [`verify`]: checks a job's output folder against golden predictions
//!   (every id exactly once, every score within tolerance) — the INV-ROWS check.
//! - [`fixtures`]: small input files written from Rust (Parquet with chosen row groups).
//! - [`python`]: runs the project's Python generator (`loadtest/python/make_job.py`).
//! - [`services`]: makes sure local RabbitMQ and Redis are up; unique test names.
//! - [`nodes`]: RabbitMQ nodes and Redis servers of a test's own on free
//!   loopback ports (TLS listeners with a CA and certificates the test makes).

pub mod fixtures;
pub mod nodes;
pub mod python;
pub mod services;
pub mod verify;
