//! Why a job-store operation failed, and whether retrying can help.

/// Errors talking to Redis. Messages never contain credentials.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis could not be reached or refused the login.
    #[error("cannot connect to Redis at {url}: {reason}. {hint}")]
    Connect {
        /// Redacted URL.
        url: String,
        /// Client library message, credentials scrubbed.
        reason: String,
        /// What to do about it.
        hint: String,
    },
    /// Redis refused the credentials; retrying will not help.
    #[error("Redis at {url} refused the login: {reason}. Check the password in the Redis URL (BATCHFLEET_REDIS_URL)")]
    Auth {
        /// Redacted URL.
        url: String,
        /// Client library message, credentials scrubbed.
        reason: String,
    },
    /// A command could not reach Redis: the connection was lost or
    /// refused, or Redis did not answer in time (a restart, a failover).
    #[error("Redis {op} failed: {reason}")]
    Unavailable {
        /// What was being done.
        op: &'static str,
        /// Client library message.
        reason: String,
    },
    /// A command failed.
    #[error("Redis {op} failed: {reason}")]
    Command {
        /// What was being done.
        op: &'static str,
        /// Client library message.
        reason: String,
    },
    /// Redis may evict keys of a running job under memory pressure.
    #[error("Redis at {url} has maxmemory-policy {policy}, which evicts any key when memory runs short — a running job's progress, leases and done items included, which would lose or repeat work. Set it to noeviction (or a volatile-* policy, which evicts only finished jobs' state, the keys with a time to live): `CONFIG SET maxmemory-policy noeviction`, maxmemory-policy in redis.conf, or the parameter group of a managed Redis")]
    Evicts {
        /// Redacted URL.
        url: String,
        /// The policy in force.
        policy: String,
    },
    /// A TLS file (`BATCHFLEET_REDIS_*_FILE`) cannot be used.
    #[error("Redis TLS settings: {0}")]
    TlsSetup(crate::endpoint::TlsSetupError),
    /// The TLS handshake refused the server's certificate.
    #[error("Redis at {url} did not pass the TLS handshake: {reason}. {hint}")]
    Untrusted {
        /// Redacted URL.
        url: String,
        /// What the TLS library said.
        reason: String,
        /// What to do about it.
        hint: String,
    },
    /// Stored data could not be read back.
    #[error("Redis key {key} holds unexpected data: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

impl StoreError {
    /// Whether Redis could not be reached (a restart or failover that may
    /// be over in a moment), as opposed to a command it refused.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            StoreError::Connect { .. } | StoreError::Unavailable { .. }
        )
    }

    /// Whether retrying cannot help (wrong credentials).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            StoreError::Auth { .. }
                | StoreError::Evicts { .. }
                | StoreError::TlsSetup(_)
                | StoreError::Untrusted { .. }
        )
    }
}
