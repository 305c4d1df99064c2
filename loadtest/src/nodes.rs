//! Servers of a test's own, on free loopback ports, beside the shared
//! RabbitMQ and Redis: RabbitMQ nodes (TLS listeners, the Prometheus
//! plugin), a TLS-only Redis, an HTTPS webhook receiver, with a CA and
//! certificates the test makes with `openssl` ([`TestPki`]). Each is the
//! real server (Debian's `rabbitmq-server` and `redis-server`, Python's
//! `http.server`), stopped when its handle is dropped.

use anyhow::{bail, Context, Result};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A CA, a server certificate it signed for `localhost` and `127.0.0.1`, a
/// client certificate it signed, and a second CA that signed nothing the
/// servers present (a client trusting only it must refuse them).
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server_cert: PathBuf,
    /// The server's key.
    pub server_key: PathBuf,
    /// A client certificate signed by the CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// A CA unrelated to the servers' certificates.
    pub other_ca: PathBuf,
}

impl TestPki {
    /// Makes the files under `dir` (readable by everyone: a RabbitMQ
    /// started as root may drop to its own user).
    pub fn make(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let p = |name: &str| dir.join(name);
        let ssl = |args: &[&str]| -> Result<()> {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .context("openssl (Debian package openssl) is needed to make test certificates")?;
            if !out.status.success() {
                bail!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(())
        };
        for ca in ["ca", "other-ca"] {
            ssl(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
                "-subj",
                &format!("/CN=batchfleet test {ca}"),
            ])?;
        }
        std::fs::write(
            p("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )?;
        std::fs::write(p("client.ext"), "extendedKeyUsage=clientAuth\n")?;
        for (who, cn) in [
            ("server", "localhost"),
            ("client", "batchfleet-test-client"),
        ] {
            ssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &format!("{who}.key"),
                "-out",
                &format!("{who}.csr"),
                "-subj",
                &format!("/CN={cn}"),
            ])?;
            ssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{who}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &format!("{who}.pem"),
                "-extfile",
                &format!("{who}.ext"),
            ])?;
        }
        open_up(dir)?;
        Ok(Self {
            ca: p("ca.pem"),
            server_cert: p("server.pem"),
            server_key: p("server.key"),
            client_cert: p("client.pem"),
            client_key: p("client.key"),
            other_ca: p("other-ca.pem"),
        })
    }
}

/// Makes a folder and everything in it readable (and the folders
/// enterable) by every user.
fn open_up(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let mode = if path.is_dir() { 0o755 } else { 0o644 };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// A free TCP port on loopback (bound, then released).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn wait_listening(
    port: u16,
    within: Duration,
    what: &str,
    child: &mut Child,
    log: &Path,
) -> Result<()> {
    let deadline = Instant::now() + within;
    // Nothing announces the port: poll it, watching the process too.
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = child.try_wait()? {
            bail!(
                "{what} exited ({status}) before listening on {port}; its log: {}",
                log.display()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{what} did not listen on {port} within {within:?}; its log: {}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// A Redis server with only a TLS listener, which asks clients for a
/// certificate signed by the test CA.
#[derive(Debug)]
pub struct TlsRedis {
    child: Child,
    /// Its TLS port on 127.0.0.1.
    pub port: u16,
}

impl TlsRedis {
    /// Starts one; its log goes to `dir/redis.log`.
    pub fn start(dir: &Path, pki: &TestPki) -> Result<Self> {
        let port = free_port()?;
        let log = dir.join(format!("redis-{port}.log"));
        let mut child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .arg("--tls-cert-file")
            .arg(&pki.server_cert)
            .arg("--tls-key-file")
            .arg(&pki.server_key)
            .arg("--tls-ca-cert-file")
            .arg(&pki.ca)
            .args([
                "--tls-auth-clients",
                "yes",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--logfile")
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("redis-server (Debian package redis-server)")?;
        wait_listening(
            port,
            Duration::from_secs(20),
            "redis-server",
            &mut child,
            &log,
        )?;
        Ok(Self { child, port })
    }

    /// Its `rediss://` URL.
    pub fn url(&self) -> String {
        format!("rediss://localhost:{}/", self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a [`RabbitNode`] serves besides AMQP.
#[derive(Debug, Clone, Copy, Default)]
pub struct RabbitOptions<'a> {
    /// Only a TLS listener, asking clients for a certificate signed by this
    /// PKI's CA (else only a plain one).
    pub tls: Option<&'a TestPki>,
    /// The `rabbitmq_prometheus` plugin on a port of its own.
    pub prometheus: bool,
}

/// A RabbitMQ node of its own (own node name, ports, data and logs under a
/// folder), with one AMQP listener on loopback — plain, or TLS only — and
/// optionally its Prometheus endpoint. `guest` may log in on it.
#[derive(Debug)]
pub struct RabbitNode {
    child: Child,
    dir: PathBuf,
    tls: bool,
    /// Its AMQP (or AMQPS) port on 127.0.0.1.
    pub port: u16,
    /// Its `rabbitmq_prometheus` port on 127.0.0.1, when enabled.
    pub prometheus_port: Option<u16>,
}

impl RabbitNode {
    /// Starts one under `dir` (10–20 s: a whole Erlang node boots).
    pub fn start(dir: &Path, opts: RabbitOptions<'_>) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let port = free_port()?;
        let node_port = free_port()?;
        let dist_port = free_port()?;
        let mut conf = String::from("loopback_users = none\n");
        match opts.tls {
            Some(pki) => conf.push_str(&format!(
                "listeners.tcp = none\n\
                 listeners.ssl.default = 127.0.0.1:{port}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_peer\n\
                 ssl_options.fail_if_no_peer_cert = true\n",
                pki.ca.display(),
                pki.server_cert.display(),
                pki.server_key.display()
            )),
            None => conf.push_str(&format!("listeners.tcp.default = 127.0.0.1:{port}\n")),
        }
        let prometheus_port = if opts.prometheus {
            let p = free_port()?;
            conf.push_str(&format!(
                "prometheus.tcp.ip = 127.0.0.1\nprometheus.tcp.port = {p}\n"
            ));
            Some(p)
        } else {
            None
        };
        let conf_file = dir.join("rabbitmq.conf");
        std::fs::write(&conf_file, conf)?;
        let plugins = if opts.prometheus {
            "[rabbitmq_prometheus].\n"
        } else {
            "[].\n"
        };
        std::fs::write(dir.join("enabled_plugins"), plugins)?;
        open_up(dir)?;
        let log = dir.join("rabbitmq.out");
        let node = format!("bftest{port}@localhost");
        // The server script itself, not the Debian wrapper that switches to
        // the rabbitmq user: the node's files are all under `dir`.
        let program = ["/usr/lib/rabbitmq/bin/rabbitmq-server", "rabbitmq-server"]
            .into_iter()
            .find(|p| Path::new(p).is_file())
            .unwrap_or("rabbitmq-server");
        let mut child = Command::new(program)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_PORT", node_port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", &conf_file)
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"))
            .env("HOME", dir)
            .stdout(Stdio::from(std::fs::File::create(&log)?))
            .stderr(Stdio::null())
            .spawn()
            .context("rabbitmq-server (Debian package rabbitmq-server)")?;
        wait_listening(
            port,
            Duration::from_secs(90),
            "rabbitmq-server",
            &mut child,
            &log,
        )?;
        if let Some(p) = prometheus_port {
            wait_listening(
                p,
                Duration::from_secs(30),
                "rabbitmq_prometheus",
                &mut child,
                &log,
            )?;
        }
        Ok(Self {
            child,
            dir: dir.to_owned(),
            tls: opts.tls.is_some(),
            port,
            prometheus_port,
        })
    }

    /// Its URL as `guest`: `amqps://` for a TLS node, else `amqp://`.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "amqps" } else { "amqp" };
        format!("{scheme}://guest:guest@localhost:{}/%2f", self.port)
    }
}

impl Drop for RabbitNode {
    /// Stops the Erlang VM (SIGTERM, as `rabbitmqctl stop` would) and waits
    /// for the start script to go with it.
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.dir.join("pid")).ok();
        if let Some(pid) = pid.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
            let _ = Command::new("kill").args(["-TERM", pid]).status();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        // The script has no exit to await besides polling it.
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTPS server recording webhook deliveries
/// (`loadtest/python/webhook_server.py`) with the test CA's server
/// certificate: `/redirect` answers 302, `/fail` 503, anything else 200.
#[derive(Debug)]
pub struct WebhookServer {
    child: Child,
    log: PathBuf,
    /// Its port on 127.0.0.1 (its certificate names `localhost` and `127.0.0.1`).
    pub port: u16,
}

impl WebhookServer {
    /// Starts one logging to `dir/webhooks-<port>.jsonl`; a `/redirect`
    /// sends clients to `redirect_to`.
    pub fn start(dir: &Path, pki: &TestPki, redirect_to: &str) -> Result<Self> {
        use std::io::BufRead;
        let log = dir.join(format!("webhooks-{}.jsonl", std::process::id()));
        let mut child = Command::new(crate::python::interpreter())
            .arg(crate::python::repo_root().join("loadtest/python/webhook_server.py"))
            .arg("--cert")
            .arg(&pki.server_cert)
            .arg("--key")
            .arg(&pki.server_key)
            .arg("--log")
            .arg(&log)
            .args(["--redirect-to", redirect_to])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("python (the project venv) for the webhook server")?;
        // The server prints its port once it accepts connections.
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            std::io::BufReader::new(out).read_line(&mut line)?;
        }
        let port = match line.trim().strip_prefix("listening ").map(str::parse) {
            Some(Ok(port)) => port,
            _ => {
                let _ = child.kill();
                bail!("the webhook server did not start (it said {line:?})");
            }
        };
        Ok(Self { child, log, port })
    }

    /// The requests it received so far, oldest first: `method`, `path`,
    /// `authorization` and body `length` of each.
    pub fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for WebhookServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
