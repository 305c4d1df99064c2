//! Where RabbitMQ or Redis is and how to reach it: the URL (credentials
//! never printed) and, for `amqps://` / `rediss://`, the TLS files of
//! `BATCHFLEET_{AMQP,REDIS}_{CA,CERT,KEY}_FILE` — a CA bundle to trust (a
//! managed service's private CA, or one a test makes: for RabbitMQ besides
//! the system's roots, for Redis instead of them, as each client does), and
//! a client certificate and key for services that ask for one. The files are read and parsed here, once per connection attempt,
//! so a wrong path or a file that holds no certificate is named before any
//! socket is opened.

use crate::secret::SecretUrl;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::fmt;
use std::path::{Path, PathBuf};

/// Which service an endpoint is for; names its settings in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// RabbitMQ (`amqp://`, `amqps://`).
    Amqp,
    /// Redis (`redis://`, `rediss://`).
    Redis,
}

impl Service {
    /// The `BATCHFLEET_*` variable of one of this service's settings
    /// (`URL`, `CA_FILE`, `CERT_FILE`, `KEY_FILE`).
    pub fn var(self, setting: &str) -> String {
        match self {
            Service::Amqp => format!("BATCHFLEET_AMQP_{setting}"),
            Service::Redis => format!("BATCHFLEET_REDIS_{setting}"),
        }
    }

    /// The URL scheme that means TLS.
    pub fn tls_scheme(self) -> &'static str {
        match self {
            Service::Amqp => "amqps",
            Service::Redis => "rediss",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Service::Amqp => "RabbitMQ",
            Service::Redis => "Redis",
        }
    }
}

/// The TLS files of one service, as configured (paths, not yet read).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA certificates to trust (RabbitMQ: besides the system's roots;
    /// Redis: instead of them).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain), for mutual TLS.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.cert_file.is_none() && self.key_file.is_none()
    }
}

/// A service's URL and TLS files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// RabbitMQ or Redis.
    pub service: Service,
    /// The URL; credentials in it are never printed.
    pub url: SecretUrl,
    /// CA, client certificate and key for a TLS URL.
    pub tls: TlsFiles,
    /// Redis only: Sentinels that name the primary, which then replaces
    /// the URL's host (its credentials, database and TLS still apply).
    pub sentinel: Option<Sentinel>,
    /// Redis only: the URL is a comma-separated list of nodes of a Redis
    /// Cluster (some or all), not one server.
    pub cluster: bool,
}

/// Redis Sentinels and the name they monitor the primary under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sentinel {
    /// One `redis://host:port` (credentials allowed, never printed) per Sentinel.
    pub nodes: Vec<SecretUrl>,
    /// The monitored name (`sentinel monitor <name> …`).
    pub master: String,
}

impl Sentinel {
    /// Sentinels from the values of `--redis-sentinel`: each a
    /// comma-separated list of `host:port` or `redis://…` addresses.
    pub fn new(values: &[SecretUrl], master: &str) -> Self {
        let nodes = values
            .iter()
            .flat_map(SecretUrl::split)
            .flat_map(|chunk| {
                // A bare `h1:26379,h2:26379` has no scheme to split at.
                if chunk.expose().contains("://") {
                    vec![chunk]
                } else {
                    chunk
                        .expose()
                        .split(',')
                        .map(str::trim)
                        .filter(|a| !a.is_empty())
                        .map(|a| SecretUrl::new(format!("redis://{a}")))
                        .collect()
                }
            })
            .collect();
        Self {
            nodes,
            master: master.to_owned(),
        }
    }

    /// The Sentinels' addresses, passwords masked.
    pub fn describe(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(SecretUrl::redacted).collect();
        format!("Sentinels {} (primary {:?})", nodes.join(", "), self.master)
    }
}

/// TLS material read from an endpoint's files.
#[derive(Clone, Default)]
pub struct TlsMaterial {
    /// PEM text of the extra CA certificates.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM client certificate and key.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("ca", &self.ca_pem.as_ref().map(|_| "(pem)"))
            .field(
                "client",
                &self.client.as_ref().map(|_| "(certificate, key)"),
            )
            .finish()
    }
}

/// A TLS setting that cannot be used; retrying cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsSetupError {
    /// A file could not be read or holds nothing usable.
    #[error("{var} = {path}: {reason}")]
    File {
        /// The setting's variable.
        var: String,
        /// The file.
        path: String,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// TLS files were given for a URL that is not a TLS one.
    #[error("{var} is set but the {service} URL ({url}) is not {scheme}://; use {scheme}:// to connect with TLS, or unset {var}")]
    NotTls {
        /// The first TLS setting given.
        var: String,
        /// `RabbitMQ` or `Redis`.
        service: &'static str,
        /// Redacted URL.
        url: String,
        /// The TLS scheme.
        scheme: &'static str,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error("{given} is set but {missing} is not; a client certificate needs both")]
    Half {
        /// The one that is set.
        given: String,
        /// The one that is not.
        missing: String,
    },
}

impl Endpoint {
    /// RabbitMQ at `url`, with no TLS files.
    pub fn amqp(url: SecretUrl) -> Self {
        Self {
            service: Service::Amqp,
            url,
            tls: TlsFiles::default(),
            sentinel: None,
            cluster: false,
        }
    }

    /// Redis at `url`, with no TLS files.
    pub fn redis(url: SecretUrl) -> Self {
        Self {
            service: Service::Redis,
            url,
            tls: TlsFiles::default(),
            sentinel: None,
            cluster: false,
        }
    }

    /// The same endpoint, its URL a list of a Redis Cluster's nodes.
    pub fn in_cluster(mut self) -> Self {
        self.cluster = true;
        self
    }

    /// The same endpoint, its primary found through these Sentinels.
    pub fn with_sentinel(mut self, sentinel: Sentinel) -> Self {
        self.sentinel = Some(sentinel);
        self
    }

    /// The same endpoint with these TLS files.
    pub fn with_tls(mut self, tls: TlsFiles) -> Self {
        self.tls = tls;
        self
    }

    /// One endpoint per URL of a comma-separated list (the nodes of a
    /// cluster), each with the same TLS files; one for a single URL.
    pub fn nodes(&self) -> Vec<Endpoint> {
        self.url
            .split()
            .into_iter()
            .map(|url| Endpoint {
                service: self.service,
                url,
                tls: self.tls.clone(),
                sentinel: self.sentinel.clone(),
                cluster: self.cluster,
            })
            .collect()
    }

    /// Whether the URL asks for TLS (`amqps://`, `rediss://`).
    pub fn is_tls(&self) -> bool {
        let scheme = self.service.tls_scheme();
        self.url
            .expose()
            .get(..scheme.len() + 3)
            .is_some_and(|head| head.eq_ignore_ascii_case(&format!("{scheme}://")))
    }

    /// Reads and checks the TLS files: `None` when none is set. Every file
    /// must parse (a CA file holds at least one certificate, a key file a
    /// private key); the client certificate and key come as a pair.
    pub fn tls_material(&self) -> Result<Option<TlsMaterial>, TlsSetupError> {
        let t = &self.tls;
        if t.is_empty() {
            return Ok(None);
        }
        let var = |s: &str| self.service.var(s);
        if !self.is_tls() {
            let first = if t.ca_file.is_some() {
                "CA_FILE"
            } else if t.cert_file.is_some() {
                "CERT_FILE"
            } else {
                "KEY_FILE"
            };
            return Err(TlsSetupError::NotTls {
                var: var(first),
                service: self.service.name(),
                url: self.url.redacted(),
                scheme: self.service.tls_scheme(),
            });
        }
        let ca_pem = match &t.ca_file {
            Some(path) => {
                let pem = read(path, &var("CA_FILE"))?;
                let certs = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| {
                        bad(path, &var("CA_FILE"), format!("not PEM certificates: {e}"))
                    })?;
                if certs.is_empty() {
                    return Err(bad(
                        path,
                        &var("CA_FILE"),
                        "holds no PEM certificate (-----BEGIN CERTIFICATE-----); give the CA certificate that signed the server's".into(),
                    ));
                }
                Some(pem)
            }
            None => None,
        };
        let client = match (&t.cert_file, &t.key_file) {
            (Some(cert), Some(key)) => {
                let cert_pem = read(cert, &var("CERT_FILE"))?;
                let n = CertificateDer::pem_slice_iter(&cert_pem)
                    .filter(Result::is_ok)
                    .count();
                if n == 0 {
                    return Err(bad(
                        cert,
                        &var("CERT_FILE"),
                        "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
                    ));
                }
                let key_pem = read(key, &var("KEY_FILE"))?;
                // The parse error could quote key bytes: name only the file.
                if PrivateKeyDer::from_pem_slice(&key_pem).is_err() {
                    return Err(bad(
                        key,
                        &var("KEY_FILE"),
                        "holds no PEM private key (PKCS#8, PKCS#1 or SEC1); an encrypted key must be decrypted first".into(),
                    ));
                }
                Some((cert_pem, key_pem))
            }
            (Some(_), None) => {
                return Err(TlsSetupError::Half {
                    given: var("CERT_FILE"),
                    missing: var("KEY_FILE"),
                })
            }
            (None, Some(_)) => {
                return Err(TlsSetupError::Half {
                    given: var("KEY_FILE"),
                    missing: var("CERT_FILE"),
                })
            }
            (None, None) => None,
        };
        Ok(Some(TlsMaterial { ca_pem, client }))
    }

    /// A hint more precise than "is it running?" for a failed connection,
    /// when the URL or the error text shows what is wrong.
    pub fn connect_hint(&self, reason: &str) -> Option<String> {
        let lower = reason.to_ascii_lowercase();
        if self.url.password_has_reserved() {
            return Some(format!(
                "The password in {} holds '/', '?', '#' or '@', which a URL must percent-encode (%2F, %3F, %23, %40)",
                self.service.var("URL")
            ));
        }
        // A plain RabbitMQ answers a TLS hello with garbage; a plain Redis
        // waits for a command and never answers it.
        let plain_answer = [
            "corrupt message",
            "invalidcontenttype",
            "wrong version number",
        ];
        let plain = plain_answer.iter().any(|k| lower.contains(k))
            || (self.service == Service::Redis && lower.contains("timed out"));
        if self.is_tls() && plain {
            return Some(format!(
                "Does that port speak TLS? Point {}:// at the server's TLS listener ({})",
                self.service.tls_scheme(),
                match self.service {
                    Service::Amqp => "5671 by default",
                    Service::Redis => "its tls-port",
                }
            ));
        }
        None
    }

    /// What to do when the server's certificate was not accepted.
    pub fn untrusted_hint(&self) -> String {
        format!(
            "The server's certificate was not accepted: set {} to the CA certificate that signed it, and check that the host in the URL is one the certificate names",
            self.service.var("CA_FILE")
        )
    }
}

fn read(path: &Path, var: &str) -> Result<Vec<u8>, TlsSetupError> {
    std::fs::read(path).map_err(|e| bad(path, var, format!("cannot read it: {e}")))
}

fn bad(path: &Path, var: &str, reason: String) -> TlsSetupError {
    TlsSetupError::File {
        var: var.to_owned(),
        path: path.display().to_string(),
        reason,
    }
}

/// Whether a client library's error text says a TLS handshake failed over
/// the peer's certificate (rather than the network or the login).
pub fn is_certificate_error(reason: &str) -> bool {
    let lower = reason.to_ascii_lowercase();
    [
        "certificate",
        "unknownissuer",
        "unknown issuer",
        "handshake",
        "notvalidforname",
        "badsignature",
    ]
    .iter()
    .any(|k| lower.contains(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    // A throwaway self-signed certificate (it protects nothing).
    const CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBczCCARmgAwIBAgIUM7CFDoXOsVCZK8AWf8Y4nDCGgPYwCgYIKoZIzj0EAwIw
DzENMAsGA1UEAwwEdGVzdDAeFw0yNjEyMDMxOTQxNDFaFw0zNjExMzAxOTQxNDFa
MA8xDTALBgNVBAMMBHRlc3QwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAATenzQk
yJmRunUw2iia0NSoCgw6e+ySc6tk3Z/6F9EhI1wS/GOzmyOCcJXwGInOf7fMMce4
YfQPnvaZmkTNsSg8o1MwUTAdBgNVHQ4EFgQUAa8XJ5qy9cA+oBRcNyHhvBVJo+4w
HwYDVR0jBBgwFoAUAa8XJ5qy9cA+oBRcNyHhvBVJo+4wDwYDVR0TAQH/BAUwAwEB
/zAKBggqhkjOPQQDAgNIADBFAiASPhSAezU2CYycFe15YFc8T6+/H/PMGrcFBCJT
G8OXIwIhAKJS737MtpQulhg3N8/Kz9B3iSRtJIJMUlGBe4awtZ2d
-----END CERTIFICATE-----
";

    fn files(dir: &Path, ca: Option<&str>, cert: Option<&str>, key: Option<&str>) -> TlsFiles {
        let put = |name: &str, text: Option<&str>| {
            text.map(|t| {
                let p = dir.join(name);
                std::fs::write(&p, t).unwrap_or_else(|e| panic!("{e}"));
                p
            })
        };
        TlsFiles {
            ca_file: put("ca.pem", ca),
            cert_file: put("cert.pem", cert),
            key_file: put("key.pem", key),
        }
    }

    #[test]
    fn tls_files_are_checked_before_connecting() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let ep = |url: &str, tls| Endpoint::redis(SecretUrl::new(url)).with_tls(tls);

        // No files: nothing to read, whatever the scheme.
        let none = ep("rediss://h:6380", TlsFiles::default());
        assert!(none.is_tls());
        assert!(none.tls_material().map(|m| m.is_none()).unwrap_or(false));

        // Files with a plain URL: named, with the scheme to use, password hidden.
        let err = ep(
            "redis://:pw-zz@h",
            files(dir.path(), Some(CERT), None, None),
        )
        .tls_material()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(
            err.contains("BATCHFLEET_REDIS_CA_FILE is set") && err.contains("rediss://"),
            "{err}"
        );
        assert!(!err.contains("pw-zz"), "{err}");

        // A CA file with no certificate in it.
        let err = ep("rediss://h", files(dir.path(), Some("hello\n"), None, None))
            .tls_material()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("BATCHFLEET_REDIS_CA_FILE") && err.contains("no PEM certificate"),
            "{err}"
        );

        // A missing file is named with its variable.
        let missing = TlsFiles {
            ca_file: Some(dir.path().join("nope.pem")),
            ..Default::default()
        };
        let err = Endpoint::amqp(SecretUrl::new("amqps://h"))
            .with_tls(missing)
            .tls_material()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("BATCHFLEET_AMQP_CA_FILE")
                && err.contains("nope.pem")
                && err.contains("cannot read"),
            "{err}"
        );

        // A certificate without its key.
        let err = ep("rediss://h", files(dir.path(), None, Some(CERT), None))
            .tls_material()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("BATCHFLEET_REDIS_CERT_FILE is set but BATCHFLEET_REDIS_KEY_FILE is not"),
            "{err}"
        );

        // A key file that holds a certificate: refused without quoting it.
        let err = ep(
            "rediss://h",
            files(dir.path(), None, Some(CERT), Some(CERT)),
        )
        .tls_material()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(
            err.contains("BATCHFLEET_REDIS_KEY_FILE") && err.contains("no PEM private key"),
            "{err}"
        );
        assert!(!err.contains("MIIB"), "{err}");

        // A CA that parses is kept.
        let ok = ep("REDISS://h", files(dir.path(), Some(CERT), None, None))
            .tls_material()
            .ok()
            .flatten();
        assert!(ok.is_some_and(|m| m.ca_pem.is_some() && m.client.is_none()));
    }

    #[test]
    fn connect_hints_name_a_raw_password_and_a_plain_port() {
        let ep = Endpoint::amqp(SecretUrl::new("amqp://u:a/b@h:1/%2f"));
        let hint = ep.connect_hint("invalid port number").unwrap_or_default();
        assert!(
            hint.contains("BATCHFLEET_AMQP_URL") && hint.contains("%2F"),
            "{hint}"
        );
        assert!(!hint.contains("a/b"), "{hint}");
        let ep = Endpoint::amqp(SecretUrl::new("amqps://u:p@h:5672/%2f"));
        let hint = ep
            .connect_hint("received corrupt message of type InvalidContentType")
            .unwrap_or_default();
        assert!(hint.contains("5671"), "{hint}");
        let ep = Endpoint::redis(SecretUrl::new("rediss://h:6379"));
        assert!(ep
            .connect_hint("timed out")
            .is_some_and(|h| h.contains("tls-port")));
        assert_eq!(
            Endpoint::redis(SecretUrl::new("redis://h:6379")).connect_hint("timed out"),
            None
        );
    }

    #[test]
    fn certificate_errors_are_told_from_others() {
        assert!(is_certificate_error(
            "invalid peer certificate: UnknownIssuer"
        ));
        assert!(!is_certificate_error("Connection refused (os error 111)"));
    }

    #[test]
    fn sentinels_are_read_bare_or_as_urls_and_never_shown_with_passwords() {
        let given = [
            SecretUrl::new("10.0.0.1:26379, 10.0.0.2:26379"),
            SecretUrl::new("redis://:s3nt-pw@10.0.0.3:26379,redis://10.0.0.4:26379"),
        ];
        let s = Sentinel::new(&given, "bf");
        let urls: Vec<&str> = s.nodes.iter().map(SecretUrl::expose).collect();
        assert_eq!(
            urls,
            [
                "redis://10.0.0.1:26379",
                "redis://10.0.0.2:26379",
                "redis://:s3nt-pw@10.0.0.3:26379",
                "redis://10.0.0.4:26379"
            ]
        );
        assert_eq!(s.master, "bf");
        let shown = format!("{} {s:?}", s.describe());
        assert!(!shown.contains("s3nt-pw"), "{shown}");
        assert!(shown.contains("10.0.0.3:26379"), "{shown}");
    }
}
