//! Makes sure the local RabbitMQ and Redis that tests and benchmarks use are
//! up, starting them with the documented commands when they are not.

use anyhow::{bail, Context, Result};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// RabbitMQ's AMQP port on loopback.
pub const RABBITMQ: &str = "127.0.0.1:5672";
/// Redis on loopback.
pub const REDIS: &str = "127.0.0.1:6379";

/// Whether something accepts TCP connections at `addr` (`ip:port`).
pub fn listening(addr: &str) -> bool {
    let addr: SocketAddr = addr.parse().expect("valid socket address");
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

fn wait_for(addr: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if listening(addr) {
            return true;
        }
        // Nothing to subscribe to before the port exists: poll it.
        std::thread::sleep(Duration::from_millis(250));
    }
    listening(addr)
}

fn start(addr: &str, program: &str, args: &[&str], within: Duration) -> Result<()> {
    if listening(addr) {
        return Ok(());
    }
    eprintln!("{addr} is not listening; starting {program}");
    let status = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if let Err(e) = status {
        bail!("{addr} is down and `{program}` could not be started ({e}); install it or start it by hand");
    }
    if !wait_for(addr, within) {
        bail!(
            "{program} did not start listening on {addr} within {}s",
            within.as_secs()
        );
    }
    Ok(())
}

/// How a local Redis is started: on loopback, keeping nothing on disk.
const REDIS_FLAGS: &[&str] = &[
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
];

/// Ensures RabbitMQ (5672) and Redis (6379) listen on loopback.
pub fn ensure_local() -> Result<()> {
    start(REDIS, "redis-server", REDIS_FLAGS, Duration::from_secs(20))?;
    start(
        RABBITMQ,
        "rabbitmq-server",
        &["-detached"],
        Duration::from_secs(90),
    )?;
    Ok(())
}

/// A name unique to this process and call, for queues, pools and key prefixes.
pub fn unique(stem: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{stem}-{}-{:x}-{}",
        std::process::id(),
        nanos,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// `redis-cli ARGS` on the local Redis: its output, trimmed.
pub fn redis_cli(args: &[&str]) -> Result<String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", "6379"])
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A numeric field of the local Redis's `INFO <section>`.
pub fn redis_info_fields<const N: usize>(section: &str, names: [&str; N]) -> Option<[f64; N]> {
    let info = redis_cli(&["info", section]).ok()?;
    let field = |name: &str| -> Option<f64> {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))?
            .parse()
            .ok()
    };
    let mut values = [0.0; N];
    for (v, name) in values.iter_mut().zip(names) {
        *v = field(name)?;
    }
    Some(values)
}

/// CPU seconds (user + system, all threads) the local Redis has used since it started.
pub fn redis_cpu_s() -> Option<f64> {
    let [user, sys] = redis_info_fields("cpu", ["used_cpu_user", "used_cpu_sys"])?;
    Some(user + sys)
}

/// CPU seconds (user + system) every RabbitMQ node on this machine (the
/// `beam.smp` processes) has used since it started.
pub fn rabbitmq_cpu_s() -> Option<f64> {
    let mut total = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() == "beam.smp" {
            *total.get_or_insert(0.0) += cpu_s(pid).unwrap_or(0.0);
        }
    }
    total
}

/// CPU seconds (user + system) process `pid` has used, from `/proc/<pid>/stat`.
pub fn cpu_s(pid: u32) -> Option<f64> {
    batchfleet_shared::metrics::stat_cpu_s(&format!("/proc/{pid}/stat"), false)
}

/// CPU seconds (user + system) of this process's children that have ended
/// and been waited for.
pub fn ended_children_cpu_s() -> Option<f64> {
    batchfleet_shared::metrics::stat_cpu_s("/proc/self/stat", true)
}

/// Restarts the local Redis (fault injection for tests and the chaos run).
/// With `keep_data` it saves a snapshot on shutdown, loads it on start and
/// then deletes the snapshot file (the machine's Redis keeps nothing on disk);
/// without, the restarted Redis is empty, as one without persistence would be.
pub fn restart_redis(keep_data: bool) -> Result<()> {
    let config = |key: &str| -> Result<String> {
        let text = redis_cli(&["config", "get", key])?;
        Ok(text.lines().nth(1).unwrap_or_default().to_owned())
    };
    let dir = config("dir")?;
    let logfile = config("logfile")?;
    let _ = redis_cli(&["shutdown", if keep_data { "save" } else { "nosave" }]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while listening(REDIS) {
        if Instant::now() > deadline {
            bail!("Redis did not shut down within 20s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut args = REDIS_FLAGS.to_vec();
    if !dir.is_empty() {
        args.extend(["--dir", dir.as_str()]);
    }
    if !logfile.is_empty() {
        args.extend(["--logfile", logfile.as_str()]);
    }
    start(REDIS, "redis-server", &args, Duration::from_secs(20))?;
    // PING answers LOADING until the snapshot is in memory.
    let deadline = Instant::now() + Duration::from_secs(20);
    while redis_cli(&["ping"])? != "PONG" {
        if Instant::now() > deadline {
            bail!("Redis did not finish loading within 20s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if keep_data && !dir.is_empty() {
        let _ = std::fs::remove_file(std::path::Path::new(&dir).join("dump.rdb"));
    }
    Ok(())
}

/// Restarts the local RabbitMQ application (every connection is closed;
/// durable queues and persistent messages survive), as a broker restart does.
pub fn restart_rabbitmq() -> Result<()> {
    for step in ["stop_app", "start_app"] {
        let status = Command::new("rabbitmqctl")
            .arg(step)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("rabbitmqctl {step} failed with {status}");
        }
    }
    if !wait_for(RABBITMQ, Duration::from_secs(60)) {
        bail!("RabbitMQ did not listen again within 60s");
    }
    Ok(())
}

/// Runs `rabbitmqctl` against the local RabbitMQ (users, permissions),
/// failing with what it printed.
pub fn rabbitmqctl(args: &[&str]) -> Result<()> {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .context("rabbitmqctl (Debian package rabbitmq-server)")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl {}: {}{}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The RabbitMQ the tools use: `BATCHFLEET_AMQP_URL`, or the local one.
pub fn amqp() -> batchfleet_shared::endpoint::Endpoint {
    batchfleet_shared::endpoint::Endpoint::amqp(batchfleet_shared::secret::SecretUrl::new(
        std::env::var("BATCHFLEET_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
    ))
}

/// Runs `work` on a connection to the local RabbitMQ, on a runtime of its
/// own, and closes the connection after (best effort: nothing when the
/// broker cannot be reached).
fn on_local_broker<F, Fut>(work: F)
where
    F: FnOnce(std::sync::Arc<dyn batchfleet_shared::broker::Broker>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    rt.block_on(async {
        let Ok(conn) = batchfleet_shared::broker::connect(
            &amqp(),
            "batchfleet-tools-cleanup",
            Duration::from_secs(30),
        )
        .await
        else {
            return;
        };
        work(conn.clone()).await;
        conn.close("bye").await;
    });
}

/// Deletes every queue of a pool and its notice exchange (best effort): a
/// tool's own pool, when it is done.
pub fn delete_pool_queues(pool: &str) {
    on_local_broker(|conn| async move {
        let _ = conn
            .delete_pool(&batchfleet_shared::broker::PoolQueues::new(pool))
            .await;
    });
}

/// The queues of the jobs the local Redis lists under `prefix:` — each
/// pool's active jobs (`prefix:pool:<pool>:jobs`) and retired ones
/// (`prefix:pool:<pool>:retired`) —, as `(pool, job)`.
pub fn listed_job_queues(prefix: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(keys) = redis_cli(&["--scan", "--pattern", &format!("{prefix}:pool:*")]) else {
        return out;
    };
    for key in keys.lines() {
        let Some(rest) = key.strip_prefix(&format!("{prefix}:pool:")) else {
            continue;
        };
        let (pool, listed) = if let Some(pool) = rest.strip_suffix(":jobs") {
            (pool, redis_cli(&["hkeys", key]))
        } else if let Some(pool) = rest.strip_suffix(":retired") {
            (pool, redis_cli(&["zrange", key, "0", "-1"]))
        } else {
            continue;
        };
        for job in listed.unwrap_or_default().lines().filter(|j| !j.is_empty()) {
            out.push((pool.to_owned(), job.to_owned()));
        }
    }
    out
}

/// Deletes the queues of the jobs listed under `prefix:`
/// ([`listed_job_queues`]) from the local RabbitMQ (best effort): a retired
/// job's queue is deleted by a sweep a grace after the job, which a test or
/// tool that stops its workers at once never sees.
pub fn delete_listed_job_queues(prefix: &str) {
    let listed = listed_job_queues(prefix);
    if listed.is_empty() {
        return;
    }
    // A runtime of its own, on a thread of its own: callers may be inside
    // one already (async tests).
    let _ = std::thread::spawn(move || delete_job_queues(&listed)).join();
}

fn delete_job_queues(listed: &[(String, String)]) {
    on_local_broker(|conn| async move {
        for (pool, job) in listed {
            let _ = conn
                .delete(&batchfleet_shared::broker::PoolQueues::new(pool).job(job))
                .await;
        }
    });
}

/// Deletes every local Redis key under `prefix:` (best effort), and first
/// the queues of the jobs they list ([`delete_listed_job_queues`]).
pub fn delete_redis_prefix(prefix: &str) {
    delete_listed_job_queues(prefix);
    let Ok(keys) = redis_cli(&["--scan", "--pattern", &format!("{prefix}:*")]) else {
        return;
    };
    let keys: Vec<&str> = keys.lines().collect();
    for chunk in keys.chunks(500) {
        let mut args = vec!["del"];
        args.extend(chunk);
        let _ = redis_cli(&args);
    }
}

/// A local S3-compatible server (moto, from the project venv) on a free
/// loopback port, stopped when dropped. Tests point batchfleet at it through
/// the usual `AWS_*` settings ([`S3Server::env`]).
#[derive(Debug)]
pub struct S3Server {
    child: std::process::Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
}

impl S3Server {
    /// Starts `moto_server` and waits until it answers.
    pub fn start() -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let bin = crate::python::repo_root().join(".venv/bin/moto_server");
        let child = Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (the venv installs moto; `make venv`)",
                    bin.display()
                )
            })?;
        let server = Self {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match ureq::get(&server.endpoint).call() {
                Ok(_) | Err(ureq::Error::Status(..)) => return Ok(server),
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => bail!("moto did not answer on {}: {e}", server.endpoint),
            }
        }
    }

    /// The `AWS_*` environment that points a process at this server
    /// (moto accepts any credentials).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "testing".into()),
            ("AWS_SECRET_ACCESS_KEY", "testing".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// Points this process's S3 client (the coordinator's, when it runs
    /// in-process) at this server.
    pub fn configure_this_process(&self) {
        let settings = self.env();
        let options: Vec<(&str, &str)> = [
            ("endpoint", 0),
            ("allow_http", 1),
            ("access_key_id", 2),
            ("secret_access_key", 3),
            ("region", 4),
        ]
        .iter()
        .map(|(k, i)| (*k, settings[*i].1.as_str()))
        .collect();
        batchfleet_shared::source::set_s3_options(&options);
    }

    /// Uploads every file under `dir` to `s3://bucket/prefix/…` (creating the bucket).
    pub fn put_dir(&self, bucket: &str, prefix: &str, dir: &std::path::Path) -> Result<()> {
        let script = crate::python::repo_root().join("loadtest/python/s3_put.py");
        let status = Command::new(crate::python::interpreter())
            .arg(&script)
            .args([
                "--endpoint",
                &self.endpoint,
                "--bucket",
                bucket,
                "--prefix",
                prefix,
            ])
            .arg(dir)
            .envs(self.env())
            .stdout(Stdio::null())
            .status()
            .with_context(|| format!("running {}", script.display()))?;
        if !status.success() {
            bail!("{} failed with {status}", script.display());
        }
        Ok(())
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
