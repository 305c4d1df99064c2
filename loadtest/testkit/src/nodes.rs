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

/// Waits until `child` (`what`, logging to `log`) listens on `port` on
/// loopback; fails at once if it exits first, naming its log.
pub fn wait_listening(
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
    /// The home folder (its `.erlang.cookie`) the node and `rabbitmqctl`
    /// share; the nodes of one cluster need the same. The node's own
    /// folder when `None`.
    pub home: Option<&'a Path>,
}

/// A RabbitMQ node of its own (own node name, ports, data and logs under a
/// folder), with one AMQP listener on loopback — plain, or TLS only — and
/// optionally its Prometheus endpoint. `guest` may log in on it. It can be
/// killed and started again with the same name, ports and data, and joined
/// to another node's cluster.
#[derive(Debug)]
pub struct RabbitNode {
    child: Option<Child>,
    dir: PathBuf,
    home: PathBuf,
    tls: bool,
    name: String,
    node_port: u16,
    dist_port: u16,
    /// Its AMQP (or AMQPS) port on 127.0.0.1.
    pub port: u16,
    /// Its `rabbitmq_prometheus` port on 127.0.0.1, when enabled.
    pub prometheus_port: Option<u16>,
}

/// The server script itself, not the Debian wrapper that switches to the
/// rabbitmq user: a test node's files are all under its folder.
fn rabbit_program(name: &str) -> PathBuf {
    let own = Path::new("/usr/lib/rabbitmq/bin").join(name);
    if own.is_file() {
        own
    } else {
        PathBuf::from(name)
    }
}

impl RabbitNode {
    /// Starts one under `dir` (10–20 s: a whole Erlang node boots).
    pub fn start(dir: &Path, opts: RabbitOptions<'_>) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let port = free_port()?;
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
        std::fs::write(dir.join("rabbitmq.conf"), conf)?;
        let plugins = if opts.prometheus {
            "[rabbitmq_prometheus].\n"
        } else {
            "[].\n"
        };
        std::fs::write(dir.join("enabled_plugins"), plugins)?;
        open_up(dir)?;
        let mut node = Self {
            child: None,
            dir: dir.to_owned(),
            home: opts.home.unwrap_or(dir).to_owned(),
            tls: opts.tls.is_some(),
            name: format!("bftest{port}@localhost"),
            node_port: free_port()?,
            dist_port: free_port()?,
            port,
            prometheus_port,
        };
        node.boot()?;
        Ok(node)
    }

    /// Starts the Erlang node and waits for its listeners.
    fn boot(&mut self) -> Result<()> {
        let log = self.dir.join("rabbitmq.out");
        let mut child = Command::new(rabbit_program("rabbitmq-server"))
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_PORT", self.node_port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", self.dir.join("rabbitmq.conf"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.dir.join("enabled_plugins"),
            )
            .env("RABBITMQ_MNESIA_BASE", self.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", self.dir.join("log"))
            .env("RABBITMQ_PID_FILE", self.dir.join("pid"))
            .env("HOME", &self.home)
            .stdout(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)?,
            ))
            .stderr(Stdio::null())
            .spawn()
            .context("rabbitmq-server (Debian package rabbitmq-server)")?;
        let listening = wait_listening(
            self.port,
            Duration::from_secs(90),
            "rabbitmq-server",
            &mut child,
            &log,
        )
        .and_then(|()| match self.prometheus_port {
            Some(p) => wait_listening(
                p,
                Duration::from_secs(30),
                "rabbitmq_prometheus",
                &mut child,
                &log,
            ),
            None => Ok(()),
        });
        self.child = Some(child);
        listening
    }

    /// Its Erlang node name (`bftest<port>@localhost`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its URL as `guest`: `amqps://` for a TLS node, else `amqp://`.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "amqps" } else { "amqp" };
        format!("{scheme}://guest:guest@localhost:{}/%2f", self.port)
    }

    /// Runs `rabbitmqctl` (or `rabbitmq-queues`, …: `tool`) against this
    /// node; what it printed, or an error with it.
    pub fn ctl(&self, tool: &str, args: &[&str]) -> Result<String> {
        let out = Command::new(rabbit_program(tool))
            .args(["-n", &self.name])
            .args(args)
            .env("HOME", &self.home)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("{tool} (Debian package rabbitmq-server)"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "{tool} -n {} {}: {}{}",
                self.name,
                args.join(" "),
                text,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(text)
    }

    /// Makes this node a member of `other`'s cluster (its own data is
    /// reset): `stop_app`, `reset`, `join_cluster`, `start_app`.
    pub fn join(&self, other: &RabbitNode) -> Result<()> {
        self.ctl("rabbitmqctl", &["stop_app"])?;
        self.ctl("rabbitmqctl", &["reset"])?;
        self.ctl("rabbitmqctl", &["join_cluster", other.name()])?;
        self.ctl("rabbitmqctl", &["start_app"])?;
        self.ctl("rabbitmqctl", &["await_startup"])?;
        Ok(())
    }

    /// Whether its Erlang node is running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The Erlang VM's process id (from the node's pid file), while it runs.
    pub fn beam_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Kills the Erlang node at once (SIGKILL: a crash, nothing flushed or
    /// handed over) and waits for it to be gone.
    pub fn kill(&mut self) {
        self.signal_and_wait("KILL", Duration::from_secs(10));
    }

    /// Starts the node again after [`RabbitNode::kill`], with its name,
    /// ports and data (a cluster member rejoins its cluster).
    pub fn restart(&mut self) -> Result<()> {
        if self.is_running() {
            bail!("{} is still running", self.name);
        }
        self.boot()
    }

    fn signal_and_wait(&mut self, sig: &str, within: Duration) {
        let pid = std::fs::read_to_string(self.dir.join("pid")).ok();
        if let Some(pid) = pid.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
            let _ = Command::new("kill")
                .args([&format!("-{sig}"), pid])
                .status();
        }
        let Some(mut child) = self.child.take() else {
            return;
        };
        let deadline = Instant::now() + within;
        // The script has no exit to await besides polling it.
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_file(self.dir.join("pid"));
    }
}

impl Drop for RabbitNode {
    /// Stops the Erlang VM (SIGTERM, as `rabbitmqctl stop` would) and waits
    /// for the start script to go with it.
    fn drop(&mut self) {
        self.signal_and_wait("TERM", Duration::from_secs(30));
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

/// A RabbitMQ cluster of nodes of a test's own on loopback: the first node
/// started alone, the others joined to it with `rabbitmqctl join_cluster`,
/// all sharing one Erlang cookie.
#[derive(Debug)]
pub struct RabbitCluster {
    /// Its nodes, in the order they were started.
    pub nodes: Vec<RabbitNode>,
}

/// One queue's replicas as the cluster reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueReplicas {
    /// The node leading the queue (its Raft leader).
    pub leader: String,
    /// Every member node of the queue.
    pub members: Vec<String>,
}

impl RabbitCluster {
    /// Starts `n` nodes under `dir` (side by side) and clusters them.
    pub fn start(dir: &Path, n: usize) -> Result<Self> {
        let home = dir.join("home");
        std::fs::create_dir_all(&home)?;
        let cookie = home.join(".erlang.cookie");
        let value: String = (0..20).map(|_| fastrand::uppercase()).collect();
        std::fs::write(&cookie, value)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cookie, std::fs::Permissions::from_mode(0o400))?;
        }
        let nodes = std::thread::scope(|s| {
            let started: Vec<_> = (0..n)
                .map(|i| {
                    let node_dir = dir.join(format!("node{i}"));
                    let home = home.as_path();
                    s.spawn(move || {
                        RabbitNode::start(
                            &node_dir,
                            RabbitOptions {
                                home: Some(home),
                                ..RabbitOptions::default()
                            },
                        )
                    })
                })
                .collect();
            started
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a node's start panicked")))
                })
                .collect::<Result<Vec<_>>>()
        })?;
        for node in &nodes[1..] {
            node.join(&nodes[0])?;
        }
        let mut cluster = Self { nodes };
        let running = cluster.running_nodes()?;
        if running.len() != n {
            bail!("expected {n} running nodes in the cluster, it reports {running:?}");
        }
        Ok(cluster)
    }

    /// Every node's URL as `guest`, in order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RabbitNode::url).collect()
    }

    /// Which node index has this Erlang name.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name() == name)
    }

    fn any_running(&mut self) -> Result<&RabbitNode> {
        let i = (0..self.nodes.len())
            .find(|&i| self.nodes[i].is_running())
            .context("no node of the cluster is running")?;
        Ok(&self.nodes[i])
    }

    /// The running nodes, as the cluster reports them.
    pub fn running_nodes(&mut self) -> Result<Vec<String>> {
        let text = self
            .any_running()?
            .ctl("rabbitmqctl", &["cluster_status", "--formatter", "json"])?;
        let v: serde_json::Value =
            serde_json::from_str(&text).context("rabbitmqctl cluster_status --formatter json")?;
        Ok(v.get("running_nodes")
            .and_then(serde_json::Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Every queue with its leader and members, asked of a running node
    /// (`rabbitmqctl list_queues name leader members`).
    pub fn quorum_queues(&mut self) -> Result<Vec<(String, QueueReplicas)>> {
        let text = self.any_running()?.ctl(
            "rabbitmqctl",
            &[
                "list_queues",
                "name",
                "leader",
                "members",
                "--formatter",
                "json",
            ],
        )?;
        let v: serde_json::Value =
            serde_json::from_str(&text).context("rabbitmqctl list_queues --formatter json")?;
        let names = |q: &serde_json::Value| -> Vec<String> {
            q.as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect()
        };
        let text = |q: &serde_json::Value, k: &str| {
            q.get(k)
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .map(|q| {
                (
                    text(q, "name"),
                    QueueReplicas {
                        leader: text(q, "leader"),
                        members: q.get("members").map(names).unwrap_or_default(),
                    },
                )
            })
            .collect())
    }
}

/// A plain Redis server (or Sentinel) of a run's own on a loopback port,
/// keeping nothing on disk, which can be killed and started again.
#[derive(Debug)]
pub struct RedisNode {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its folder: log, and a Sentinel's config file (which it rewrites).
    pub dir: PathBuf,
    args: Vec<String>,
    sentinel: bool,
}

impl RedisNode {
    /// Starts a server with these extra arguments (`--replicaof …`).
    pub fn server(dir: &Path, args: &[&str]) -> Result<Self> {
        Self::start(dir, args, false)
    }

    /// Starts a Sentinel (`redis-server <conf> --sentinel`, which is what
    /// the Debian package's `redis-sentinel` runs) monitoring the primary
    /// at `primary_port` under `name`: down after `down_after`, two
    /// Sentinels needed to agree.
    pub fn sentinel(
        dir: &Path,
        name: &str,
        primary_port: u16,
        down_after: Duration,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "sentinel monitor {name} 127.0.0.1 {primary_port} 2\n\
                 sentinel down-after-milliseconds {name} {}\n\
                 sentinel failover-timeout {name} 10000\n\
                 sentinel parallel-syncs {name} 1\n",
                down_after.as_millis()
            ),
        )?;
        Self::start(
            dir,
            &[conf.to_str().context("utf-8 path")?, "--sentinel"],
            true,
        )
    }

    fn start(dir: &Path, args: &[&str], sentinel: bool) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut node = Self {
            child: None,
            port: free_port()?,
            dir: dir.to_owned(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            sentinel,
        };
        node.boot()?;
        Ok(node)
    }

    fn boot(&mut self) -> Result<()> {
        let log = self.dir.join("redis.log");
        let mut cmd = Command::new("redis-server");
        if self.sentinel {
            // The config file comes first, then the mode.
            cmd.args(&self.args);
        }
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(&log);
        if !self.sentinel {
            cmd.args(["--save", "", "--appendonly", "no"])
                .args(&self.args);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("redis-server (Debian package redis-server)")?;
        wait_listening(
            self.port,
            Duration::from_secs(20),
            "redis-server",
            &mut child,
            &log,
        )?;
        self.child = Some(child);
        Ok(())
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Runs `redis-cli -p <port> <args>` and returns its output.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .context("redis-cli")?;
        if !out.status.success() {
            bail!(
                "redis-cli -p {} {}: {}",
                self.port,
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Kills it at once (SIGKILL: nothing flushed, no goodbye to replicas).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again after [`RedisNode::kill`], on the same port — empty,
    /// as a server that keeps nothing on disk comes back.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("redis on port {} is still running", self.port);
        }
        self.boot()
    }

    /// Starts it again after [`RedisNode::kill`], empty, as a replica of
    /// the server on `primary` (as a server of a failed-over primary is
    /// brought back: never as a second, empty primary).
    pub fn restart_as_replica_of(&mut self, primary: u16) -> Result<()> {
        let mut args = Vec::new();
        let mut rest = self.args.iter();
        while let Some(a) = rest.next() {
            if a == "--replicaof" {
                rest.next();
                rest.next();
            } else {
                args.push(a.clone());
            }
        }
        args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.to_string(),
        ]);
        self.args = args;
        self.restart()
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        self.kill();
    }
}
