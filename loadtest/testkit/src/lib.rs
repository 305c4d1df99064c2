//! What batchfleet's tests and benchmarks share. It never touches libtorch
//! and depends on no batchfleet crate but `batchfleet-shared`, so the tests
//! of every crate (and `cargo test -p batchfleet-shared`) link it without
//! building libtorch's bindings; the benchmarks and fault runs that do run
//! libtorch live in the `batchfleet-loadtest` binary (`loadtest/src/`).
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
