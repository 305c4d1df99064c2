//! `batchfleet` command-line tests against the real RabbitMQ and Redis:
//! bad input gets a clear error, the documented exit code, and publishes nothing.

mod cli;
mod local;
