//! Command-line flags every batchfleet binary shares (each with a
//! `BATCHFLEET_*` environment variable), so names and defaults cannot drift.

use crate::endpoint::{Endpoint, Sentinel, TlsFiles};
use crate::secret::{read_secret_file, SecretFileError, SecretUrl};
use std::path::PathBuf;

/// Where RabbitMQ and Redis are, and how to log.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceArgs {
    /// RabbitMQ URL; amqps:// for TLS. Credentials in it are never logged.
    /// For a cluster, repeat it or give a comma-separated list, one URL per
    /// node: they are tried in the order given, and after a lost connection
    /// from the node after the lost one.
    #[arg(
        long,
        env = "BATCHFLEET_AMQP_URL",
        default_value = "amqp://127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true,
        action = clap::ArgAction::Append
    )]
    pub amqp_url: Vec<SecretUrl>,
    /// File holding the RabbitMQ URL (a mounted secret), instead of --amqp-url.
    #[arg(
        long,
        env = "BATCHFLEET_AMQP_URL_FILE",
        global = true,
        conflicts_with = "amqp_url"
    )]
    pub amqp_url_file: Option<PathBuf>,
    /// PEM CA certificate(s) to trust for amqps://, besides the system's roots.
    #[arg(long, env = "BATCHFLEET_AMQP_CA_FILE", global = true)]
    pub amqp_ca_file: Option<PathBuf>,
    /// PEM client certificate for amqps:// (with --amqp-key-file).
    #[arg(long, env = "BATCHFLEET_AMQP_CERT_FILE", global = true)]
    pub amqp_cert_file: Option<PathBuf>,
    /// PEM private key of --amqp-cert-file.
    #[arg(long, env = "BATCHFLEET_AMQP_KEY_FILE", global = true)]
    pub amqp_key_file: Option<PathBuf>,
    /// Redis URL; rediss:// for TLS. Credentials in it are never logged.
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/",
        global = true,
        hide_env_values = true
    )]
    pub redis_url: SecretUrl,
    /// File holding the Redis URL (a mounted secret), instead of --redis-url.
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_URL_FILE",
        global = true,
        conflicts_with = "redis_url"
    )]
    pub redis_url_file: Option<PathBuf>,
    /// Redis Sentinels to ask where the primary is (`host:port`, or
    /// `redis://[:password@]host:port` when they want a password), repeated
    /// or comma-separated. With them the host of --redis-url is ignored: its
    /// user, password, database and TLS settings are used on whichever
    /// server the Sentinels name (asked for every new connection, and every
    /// second whether the primary changed).
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_SENTINEL",
        global = true,
        hide_env_values = true,
        action = clap::ArgAction::Append
    )]
    pub redis_sentinel: Vec<SecretUrl>,
    /// The name the Sentinels monitor the primary under (their `sentinel
    /// monitor <name> …`).
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_MASTER",
        default_value = "mymaster",
        global = true
    )]
    pub redis_master: String,
    /// Redis is a Redis Cluster: --redis-url lists some of its nodes
    /// (`redis://h1:6379,redis://h2:6379`, credentials and TLS alike).
    #[arg(
        long,
        env = "BATCHFLEET_REDIS_CLUSTER",
        global = true,
        conflicts_with = "redis_sentinel"
    )]
    pub redis_cluster: bool,
    /// PEM CA certificate(s) to trust for rediss://, instead of the system's roots.
    #[arg(long, env = "BATCHFLEET_REDIS_CA_FILE", global = true)]
    pub redis_ca_file: Option<PathBuf>,
    /// PEM client certificate for rediss:// (with --redis-key-file).
    #[arg(long, env = "BATCHFLEET_REDIS_CERT_FILE", global = true)]
    pub redis_cert_file: Option<PathBuf>,
    /// PEM private key of --redis-cert-file.
    #[arg(long, env = "BATCHFLEET_REDIS_KEY_FILE", global = true)]
    pub redis_key_file: Option<PathBuf>,
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
    /// Log format (logs go to stderr; text is coloured only on a terminal
    /// and never under NO_COLOR).
    #[arg(long, env = "BATCHFLEET_LOG_FORMAT", value_enum, default_value_t = crate::telemetry::LogFormat::Text, global = true)]
    pub log_format: crate::telemetry::LogFormat,
    /// More log lines: -v adds debug, -vv trace. RUST_LOG, when set, takes
    /// precedence over -v and -q (e.g. RUST_LOG=info,batchfleet_worker=debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Fewer log lines: -q warnings and errors only, -qq errors only (each
    /// -q takes back one -v).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub quiet: u8,
}

impl ServiceArgs {
    /// RabbitMQ's URL (from --amqp-url or the file of --amqp-url-file) and TLS files.
    pub fn amqp(&self) -> Result<Endpoint, SecretFileError> {
        let url = url_or_file(
            &SecretUrl::join(&self.amqp_url),
            self.amqp_url_file.as_deref(),
            "BATCHFLEET_AMQP_URL_FILE",
        )?;
        Ok(Endpoint::amqp(url).with_tls(TlsFiles {
            ca_file: self.amqp_ca_file.clone(),
            cert_file: self.amqp_cert_file.clone(),
            key_file: self.amqp_key_file.clone(),
        }))
    }

    /// Redis's URL (from --redis-url or the file of --redis-url-file), TLS
    /// files, and the Sentinels to ask for the primary, if any.
    pub fn redis(&self) -> Result<Endpoint, SecretFileError> {
        let url = url_or_file(
            &self.redis_url,
            self.redis_url_file.as_deref(),
            "BATCHFLEET_REDIS_URL_FILE",
        )?;
        let endpoint = Endpoint::redis(url).with_tls(TlsFiles {
            ca_file: self.redis_ca_file.clone(),
            cert_file: self.redis_cert_file.clone(),
            key_file: self.redis_key_file.clone(),
        });
        Ok(match self.redis_sentinel.as_slice() {
            [] if self.redis_cluster => endpoint.in_cluster(),
            [] => endpoint,
            nodes => endpoint.with_sentinel(Sentinel::new(nodes, &self.redis_master)),
        })
    }

    /// The message-signing key, if one is configured (see `--signing-key-file`).
    pub fn signing_key(
        &self,
    ) -> Result<Option<crate::signing::SigningKey>, crate::signing::KeyError> {
        crate::signing::SigningKey::configured(self.signing_key_file.as_deref())
    }

    /// Installs logging as the flags say.
    pub fn init_logging(&self) {
        crate::telemetry::init(self.log_level(), self.log_format);
    }

    /// The log level -v and -q ask for: info, one step up per -v and one
    /// down per -q.
    pub fn log_level(&self) -> &'static str {
        match i16::from(self.verbose) - i16::from(self.quiet) {
            2.. => "trace",
            1 => "debug",
            0 => "info",
            -1 => "warn",
            _ => "error",
        }
    }
}

fn url_or_file(
    url: &SecretUrl,
    file: Option<&std::path::Path>,
    var: &str,
) -> Result<SecretUrl, SecretFileError> {
    match file {
        Some(path) => read_secret_file(path, var).map(SecretUrl::new),
        None => Ok(url.clone()),
    }
}

/// A size in bytes: a number, optionally followed by `K`, `M`, `G` or `T`
/// (powers of 1024; `KiB`, `KB`, `kb` … read the same).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?}: expected a size such as 8GiB, 512MiB or 1073741824"))?;
    let shift = match unit
        .trim()
        .to_ascii_lowercase()
        .trim_end_matches('b')
        .trim_end_matches('i')
    {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?}; use K, M, G or T (powers of 1024)"
            ))
        }
    };
    n.checked_mul(1 << shift)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{s:?}: must be above 0 and below 16 EiB"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn sizes_read_in_powers_of_1024() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("512mb"), Ok(512 << 20));
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("8 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        services: ServiceArgs,
    }

    fn nodes(args: &[&str]) -> Vec<String> {
        let cli = Cli::try_parse_from(std::iter::once("batchfleet").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{e}"));
        let endpoint = cli.services.amqp().unwrap_or_else(|e| panic!("{e}"));
        endpoint
            .nodes()
            .iter()
            .map(|n| n.url.expose().to_owned())
            .collect()
    }

    #[test]
    fn a_cluster_is_given_by_repeating_the_flag_or_by_a_list() {
        let a = "amqp://u:p@rmq-0:5672/%2f";
        let b = "amqp://u:p@rmq-1:5672/%2f";
        assert_eq!(nodes(&["--amqp-url", a, "--amqp-url", b]), [a, b]);
        assert_eq!(nodes(&["--amqp-url", &format!("{a},{b}")]), [a, b]);
        assert_eq!(nodes(&["--amqp-url", a]), [a]);
        // Given, the flag replaces the default instead of adding to it.
        assert_eq!(nodes(&[]).len(), 1);
    }

    #[test]
    fn sentinels_put_the_redis_endpoint_behind_them() {
        let cli = Cli::try_parse_from([
            "batchfleet",
            "--redis-url",
            "redis://app:pw@ignored:1/2",
            "--redis-sentinel",
            "127.0.0.1:26379,127.0.0.1:26380",
            "--redis-sentinel",
            "127.0.0.1:26381",
            "--redis-master",
            "bfprimary",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let endpoint = cli.services.redis().unwrap_or_else(|e| panic!("{e}"));
        let sentinel = endpoint.sentinel.expect("sentinels given");
        assert_eq!(sentinel.nodes.len(), 3);
        assert_eq!(sentinel.master, "bfprimary");
        // The URL keeps the credentials and database for the primary.
        assert_eq!(endpoint.url.expose(), "redis://app:pw@ignored:1/2");
        let plain = Cli::try_parse_from(["batchfleet"]).unwrap_or_else(|e| panic!("{e}"));
        assert!(plain
            .services
            .redis()
            .unwrap_or_else(|e| panic!("{e}"))
            .sentinel
            .is_none());
    }

    #[test]
    fn a_redis_cluster_takes_its_nodes_from_the_url_list() {
        let cli = Cli::try_parse_from([
            "batchfleet",
            "--redis-cluster",
            "--redis-url",
            "redis://:pw@10.0.0.1:6379/,redis://:pw@10.0.0.2:6379/",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let endpoint = cli.services.redis().unwrap_or_else(|e| panic!("{e}"));
        assert!(endpoint.cluster && endpoint.sentinel.is_none());
        assert_eq!(endpoint.url.split().len(), 2);
        // Sentinels and a cluster are two answers to one question.
        assert!(Cli::try_parse_from([
            "batchfleet",
            "--redis-cluster",
            "--redis-sentinel",
            "127.0.0.1:26379"
        ])
        .is_err());
    }
}
