//! The fleet a benchmark runs: worker processes started on a job's pool
//! ([`Fleet`], which scrapes their metrics and reads their memory), a job
//! run through `batchfleet run` to its summary ([`run_job`], timed, with
//! the coordinator's peak memory), and the CPU each part of the system used
//! per item ([`CpuSample`]).

use anyhow::{bail, Result};
use batchfleet_testkit::nodes::free_port;
use batchfleet_testkit::services;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Milliseconds of CPU (user + system) per item each part of the system used
/// during the control-plane job, and the rate they allow on this machine.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuPerItem {
    /// Each worker process.
    pub workers_ms: Vec<f64>,
    /// The coordinator (planning, publishing, monitoring, the summary).
    pub coordinator_ms: f64,
    /// The RabbitMQ node(s) on this machine.
    pub rabbitmq_ms: f64,
    /// The Redis server.
    pub redis_ms: f64,
    /// All of them.
    pub total_ms: f64,
    /// Cores × 1000 ÷ `total_ms`: items/s if every core did nothing else.
    pub ceiling_items_per_s: f64,
    /// The same for RabbitMQ and Redis alone: what no worker change can pass.
    pub services_ceiling_items_per_s: f64,
}

/// CPU seconds by part, read before and after a job.
#[derive(Debug, Clone)]
pub(crate) struct CpuSample {
    workers: Vec<f64>,
    coordinator: f64,
    rabbitmq: f64,
    redis: f64,
}

impl CpuSample {
    pub(crate) fn take(worker_pids: &[u32]) -> Self {
        Self {
            workers: worker_pids
                .iter()
                .map(|p| services::cpu_s(*p).unwrap_or(0.0))
                .collect(),
            // The coordinator is the only child waited for during the job.
            coordinator: services::ended_children_cpu_s().unwrap_or(0.0),
            rabbitmq: services::rabbitmq_cpu_s().unwrap_or(0.0),
            redis: services::redis_cpu_s().unwrap_or(0.0),
        }
    }

    /// Per item, from `self` (before) to `after`.
    pub(crate) fn per_item(&self, after: &CpuSample, items: u64, cores: usize) -> CpuPerItem {
        let ms = |a: f64, b: f64| (b - a).max(0.0) * 1000.0 / items.max(1) as f64;
        let workers_ms: Vec<f64> = self
            .workers
            .iter()
            .zip(&after.workers)
            .map(|(a, b)| ms(*a, *b))
            .collect();
        let (coordinator_ms, rabbitmq_ms, redis_ms) = (
            ms(self.coordinator, after.coordinator),
            ms(self.rabbitmq, after.rabbitmq),
            ms(self.redis, after.redis),
        );
        let total_ms = workers_ms.iter().sum::<f64>() + coordinator_ms + rabbitmq_ms + redis_ms;
        let ceiling = |ms: f64| cores as f64 * 1000.0 / ms.max(1e-9);
        CpuPerItem {
            workers_ms,
            coordinator_ms,
            rabbitmq_ms,
            redis_ms,
            total_ms,
            ceiling_items_per_s: ceiling(total_ms),
            services_ceiling_items_per_s: ceiling(rabbitmq_ms + redis_ms),
        }
    }
}

/// VmRSS or VmHWM of a process, in MiB.
fn proc_mib(pid: u32, field: &str) -> Option<f64> {
    batchfleet_shared::process_memory(Some(pid), field).map(|b| b as f64 / f64::from(1 << 20))
}

/// Worker processes of a bench or a fault run, started on a job's pool
/// with their metrics on ports of their own; stopped (killed) when dropped.
pub(crate) struct Fleet {
    children: Vec<(Child, u16)>,
}

impl Fleet {
    pub(crate) fn start(
        bin: &Path,
        dir: &Path,
        pool: &str,
        prefix: &str,
        n: usize,
        threads: usize,
    ) -> Result<Self> {
        let mut children = Vec::new();
        for i in 0..n {
            let port = free_port()?;
            let log = std::fs::File::create(dir.join(format!("worker-{i}.log")))?;
            let child = Command::new(bin)
                .args(["--pool", pool, "--redis-prefix", prefix])
                // The job (data, model, output) lives in `dir`.
                .arg("--data-root")
                .arg(dir)
                .args([
                    "--worker-id",
                    &format!("bench-{i}"),
                    "--threads",
                    &threads.to_string(),
                ])
                .args([
                    "--metrics-port",
                    &port.to_string(),
                    "--metrics-host",
                    "127.0.0.1",
                ])
                .stdout(Stdio::from(log.try_clone()?))
                .stderr(Stdio::from(log))
                .spawn()?;
            children.push((child, port));
        }
        // Workers are up once their metrics endpoints answer.
        let deadline = Instant::now() + Duration::from_secs(60);
        for (_, port) in &children {
            while ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
                .call()
                .is_err()
            {
                if Instant::now() > deadline {
                    bail!("workers did not start; see {}", dir.display());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        std::thread::sleep(Duration::from_millis(500)); // consumers attach after the endpoint
        Ok(Self { children })
    }

    /// Processes started elsewhere, each serving its metrics on its port
    /// (the simulated fleet's, many workers to a process).
    pub(crate) fn adopt(children: Vec<(Child, u16)>) -> Self {
        Self { children }
    }

    /// The processes, in start order.
    pub(crate) fn children_mut(&mut self) -> impl Iterator<Item = &mut Child> {
        self.children.iter_mut().map(|(c, _)| c)
    }

    /// Sums a metric over the workers.
    pub(crate) fn metric_sum(&self, name: &str) -> f64 {
        let mut total = 0.0;
        for (_, port) in &self.children {
            let Ok(resp) = ureq::get(&format!("http://127.0.0.1:{port}/metrics")).call() else {
                continue;
            };
            let text = resp.into_string().unwrap_or_default();
            for line in text.lines() {
                if line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']) {
                    total += line
                        .rsplit(' ')
                        .next()
                        .and_then(|v| v.parse::<f64>().ok())
                        .unwrap_or(0.0);
                }
            }
        }
        total
    }

    pub(crate) fn rss(&self, field: &str) -> Vec<f64> {
        self.children
            .iter()
            .filter_map(|(c, _)| proc_mib(c.id(), field))
            .collect()
    }

    pub(crate) fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|(c, _)| c.id()).collect()
    }

    /// SIGTERM, then waits up to `within` for each: `Err` naming each
    /// process that did not exit 0 in time.
    pub(crate) fn stop_checked(&mut self, within: Duration) -> Result<()> {
        for (c, _) in &self.children {
            crate::fault::signal(c, "TERM");
        }
        let mut bad = Vec::new();
        for (i, (c, _)) in self.children.iter_mut().enumerate() {
            match crate::fault::wait_or_kill(c, within) {
                Some(true) => {}
                Some(false) => bad.push(format!("process {i} exited with an error")),
                None => bad.push(format!("process {i} did not stop within {within:?}")),
            }
        }
        self.children.clear();
        if !bad.is_empty() {
            bail!("{}", bad.join("; "));
        }
        Ok(())
    }

    pub(crate) fn stop(&mut self) {
        for (c, _) in &self.children {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
        }
        for (c, _) in &mut self.children {
            let _ = c.wait();
        }
        self.children.clear();
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (c, _) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `batchfleet run` and returns (wall seconds from the summary, peak RSS MiB).
pub(crate) fn run_job(
    coordinator: &Path,
    manifest: &Path,
    prefix: &str,
) -> Result<(f64, f64, serde_json::Value)> {
    run_job_with(coordinator, manifest, prefix, &[], "out")
}

/// The manifest of `dir`, copied to write its output to `out` (another job).
pub(crate) fn manifest_into(dir: &Path, out: &str) -> Result<PathBuf> {
    let text = std::fs::read_to_string(dir.join("job.toml"))?;
    if !text.contains("\ndir = \"out\"\n") {
        bail!("{} has no `dir = \"out\"`", dir.join("job.toml").display());
    }
    let copy = dir.join(format!("job-{out}.toml"));
    std::fs::write(
        &copy,
        text.replace("\ndir = \"out\"\n", &format!("\ndir = \"{out}\"\n")),
    )?;
    Ok(copy)
}

/// [`run_job`] with more `run` flags, the output in `out`.
pub(crate) fn run_job_with(
    coordinator: &Path,
    manifest: &Path,
    prefix: &str,
    extra: &[String],
    out: &str,
) -> Result<(f64, f64, serde_json::Value)> {
    let log = std::fs::File::create(manifest.with_extension("log"))?;
    let mut cmd = Command::new(coordinator);
    if !extra.is_empty() {
        // Nothing listens there: a local run must not need the services.
        cmd.env("BATCHFLEET_AMQP_URL", "amqp://127.0.0.1:9/%2f")
            .env("BATCHFLEET_REDIS_URL", "redis://127.0.0.1:9/");
    }
    let mut child = cmd
        .args(["--redis-prefix", prefix, "run", "--no-progress"])
        .args(extra)
        .arg(manifest)
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()?;
    let mut peak = 0.0f64;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        peak = peak.max(proc_mib(child.id(), "VmHWM").unwrap_or(0.0));
        std::thread::sleep(Duration::from_millis(50));
    };
    if !status.success() {
        bail!(
            "the job failed; see {}",
            manifest.with_extension("log").display()
        );
    }
    let out = manifest.parent().unwrap_or(Path::new(".")).join(out);
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(
        out.join(batchfleet_shared::output::SUMMARY_FILE),
    )?)?;
    if !out.join(batchfleet_shared::output::SUCCESS_FILE).is_file() {
        bail!("no _SUCCESS in {}", out.display());
    }
    let wall = summary["duration_s"].as_f64().unwrap_or(0.0);
    Ok((wall, peak, summary))
}
