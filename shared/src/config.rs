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
    /// File holding the key that signs work messages (HMAC-SHA256 over each
    /// body); or set BATCHFLEET_SIGNING_KEY to the key itself. The
    /// coordinator signs what it publishes; a worker holding a key refuses
    /// unsigned or forged messages. Give both the same key (16+ bytes).
    #[arg(long, env = "BATCHFLEET_SIGNING_KEY_FILE", global = true)]
    pub signing_key_file: Option<std::path::PathBuf>,
    /// Log format: text or json (logs go to stderr).
    #[arg(long, env = "BATCHFLEET_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"], global = true)]
    pub log_format: String,
}

impl ServiceArgs {
    /// The message-signing key, if one is configured (see `--signing-key-file`).
    pub fn signing_key(
        &self,
    ) -> Result<Option<crate::signing::SigningKey>, crate::signing::KeyError> {
        crate::signing::SigningKey::configured(self.signing_key_file.as_deref())
    }

    /// Installs logging as the flags say.
    pub fn init_logging(&self) {
        crate::telemetry::init("info", self.log_format == "json");
    }
}
