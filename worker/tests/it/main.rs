//! Worker integration tests against the real RabbitMQ, Redis and libtorch.
//! Each test uses its own pool, Redis prefix and temp folder, and cleans up.

mod bundles;
mod containment;
mod deploy;
mod e2e;
mod failures;
mod formats;
mod jobs;
mod models;
mod privilege;
mod remote_models;
mod reports;
mod shadow;
mod slurm_task;
mod starts;
mod support;
mod text;
mod tls;
