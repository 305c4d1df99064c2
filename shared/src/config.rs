//! Command-line flags every batchfleet binary shares (each with a
//! `BATCHFLEET_*` environment variable), so names and defaults cannot drift.

use crate::secret::SecretUrl;

/// Where RabbitMQ and Redis are, and how to log.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceArgs {
    /// RabbitMQ URL. Credentials in it are never logged.
    #[arg(
        long,
        env = "BATCHFLEET_AMQP_URL",
        default_value = "amqp://127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true
    )]
    pub amqp_url: SecretUrl,
    /// Redis URL. Credentials in it are never logged.
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/",
        global = true,
        hide_env_values = true
    )]
    pub redis_url: SecretUrl,
    /// Prefix of every Redis key batchfleet writes; coordinator and workers must agree.
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_PREFIX",
        default_value = "bf",
        global = true
    )]
    pub redis_prefix: String,
    /// Log format: text or json (logs go to stderr).
    #[arg(long, env = "BATCHFLEET_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"], global = true)]
    pub log_format: String,
}

impl ServiceArgs {
    /// Installs logging as the flags say.
    pub fn init_logging(&self) {
        crate::telemetry::init("info", self.log_format == "json");
    }
}
