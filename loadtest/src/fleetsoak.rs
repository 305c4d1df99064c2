//! `batchfleet-loadtest soak --simulated <WORKERS>`: the control plane
//! under a fleet of hundreds of workers and many concurrent jobs, on the
//! real RabbitMQ and Redis of this machine.
//!
//! The workers are real ones — each a whole `batchfleet_worker::run` with
//! its own broker connection, Redis connection, model runner thread and
//! model cache — run many to a process (`sim-workers`), on a model that
//! does next to nothing, so that every item is nothing but the system's
//! own work. `--jobs` jobs of one-row items (`--items` in all) are started
//! together, each by its own `batchfleet run`.
//!
//! Before the jobs, the idle fleet is watched for `--idle`: the Redis
//! commands it makes then are its background cost. Over the jobs it
//! measures, per item: Redis commands (script-inner ones included:
//! `total_commands_processed`), Redis requests (the server's reads of
//! client sockets, `total_reads_processed`: a pipeline or a script is
//! one), Redis bytes, AMQP messages (publish, delivery and ack of each
//! message the workers took) and bytes on the broker's sockets, syncs to
//! disk, and CPU by part (the worker processes, the coordinators, RabbitMQ,
//! Redis); Redis's latency as a client sees it (a `PING` every 10 ms, its
//! p50, p99 and worst: on a machine the fleet keeps busy, mostly the wait
//! for a core) and its own time per command (`INFO latencystats`, p99 of
//! the most called, reset with `CONFIG RESETSTAT` before the jobs); spurious copies (item starts beyond one per item,
//! and items the coordinators published again); the workers' broker
//! sessions lost. Each job is then checked as every fault run checks one
//! (every row exactly once and as PyTorch computes it, the counts, the
//! files): those are the violations (exit 1). The figures are printed
//! against the targets of docs/scaling.md, and kept in `fleetsoak.json`
//! with `--dir`; a target missed is reported, not failed.

use crate::fault;
use crate::fleet::{CpuSample, Fleet};
use crate::scale::{amqp_bytes_between, amqp_socket_bytes, redis_stats, watch_amqp_sockets};
use crate::soak::SoakConfig;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::services;
use serde::Serialize;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The targets the figures are printed against (docs/scaling.md).
const TARGET_REDIS_P99_MS: f64 = 5.0;
const TARGET_BACKGROUND_PER_WORKER_S: f64 = 1.0;

/// What a simulated-fleet soak measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FleetSoakReport {
    /// Workers, and the processes they ran in.
    pub workers: usize,
    pub processes: usize,
    /// Jobs run together, and their one-row items in all.
    pub jobs: usize,
    pub items: u64,
    /// Seconds from the first coordinator's start to the last job's end.
    pub seconds: f64,
    pub items_per_s: f64,
    /// Seconds the fleet took to start (every worker consuming).
    pub start_seconds: f64,
    /// Per item, over the jobs.
    pub redis_commands_per_item: f64,
    pub redis_requests_per_item: f64,
    pub redis_bytes_per_item: f64,
    pub amqp_messages_per_item: f64,
    pub amqp_bytes_per_item: f64,
    pub syncs_per_item: f64,
    /// CPU milliseconds per item: all worker processes, the coordinators,
    /// RabbitMQ, Redis.
    pub cpu_workers_ms: f64,
    pub cpu_coordinators_ms: f64,
    pub cpu_rabbitmq_ms: f64,
    pub cpu_redis_ms: f64,
    /// Redis round trips seen by a client (`PING` every 10 ms), ms.
    pub redis_p50_ms: f64,
    pub redis_p99_ms: f64,
    pub redis_max_ms: f64,
    /// Redis's own time per command (`INFO latencystats`, reset before the
    /// jobs): the p99 of the commands the fleet called most, µs.
    pub redis_server_p99_us: Vec<(String, u64, f64)>,
    /// Item starts beyond one per item, over the jobs.
    pub spurious_starts: u64,
    /// Items the coordinators published again.
    pub redispatched: u64,
    /// Broker sessions the workers lost and opened again.
    pub broker_reconnects: u64,
    /// Redis commands per worker-second of the idle fleet.
    pub background_commands_per_worker_s: f64,
    /// Invariant violations (empty: all held).
    pub violations: Vec<String>,
}

/// Runs the simulated-fleet soak; prints and returns what it measured.
pub fn run(cfg: &SoakConfig, workers: usize) -> Result<FleetSoakReport> {
    services::ensure_local()?;
    let coordinator = fault::sibling("batchfleet")?;
    let me = std::env::current_exe()?;
    let (root, _tmp) = fault::work_dir(cfg.dir.as_deref())?;
    let pool = services::unique("fleetsoak");
    let prefix = services::unique("bffleet");
    let processes = cfg.processes.clamp(1, workers);
    let jobs = cfg.jobs.max(1);
    let rows = (cfg.items / jobs as u64).max(1);
    let mut report = FleetSoakReport {
        workers,
        processes,
        jobs,
        items: rows * jobs as u64,
        ..FleetSoakReport::default()
    };
    println!(
        "soak: a simulated fleet of {workers} workers in {processes} processes, {jobs} jobs of {rows} one-row items together, in {}",
        root.display()
    );
    let template = root.join("template");
    batchfleet_testkit::python::make_job(
        &template,
        &batchfleet_testkit::python::JobGen {
            rows,
            files: 1,
            features: 16,
            hidden: 1,
            outputs: 1,
            name: "soak-template".into(),
            pool: pool.clone(),
            item_rows: 1,
            batch_size: 1,
            ..batchfleet_testkit::python::JobGen::default()
        },
    )?;
    let dirs: Vec<PathBuf> = (0..jobs)
        .map(|j| {
            let dir = root.join("jobs").join(format!("fleet-j{j}"));
            crate::soak::instance(&template, &dir, &format!("fleet-j{j}")).map(|()| dir)
        })
        .collect::<Result<_>>()?;

    let outcome = (|| -> Result<()> {
        let started = Instant::now();
        let mut fleet = start_fleet(&me, &root, &pool, &prefix, workers, processes)?;
        report.start_seconds = started.elapsed().as_secs_f64();
        println!(
            "soak: {workers} workers consuming after {:.1} s",
            report.start_seconds
        );
        report.background_commands_per_worker_s = background(cfg.idle, workers)?;
        measure(&coordinator, &prefix, &dirs, &fleet, &mut report)?;
        for dir in &dirs {
            let mut v = Vec::new();
            fault::job_invariants(dir, rows, &mut v)?;
            let name = dir.file_name().unwrap_or_default().to_string_lossy();
            report
                .violations
                .extend(v.into_iter().map(|v| format!("{name}: {v}")));
        }
        report.broker_reconnects =
            fleet.metric_sum("batchfleet_worker_broker_reconnects_total") as u64;
        fleet
            .stop_checked(Duration::from_secs(60))
            .context("stopping the simulated workers")?;
        Ok(())
    })();
    if let Err(e) = outcome {
        report.violations.push(format!("the soak stopped: {e:#}"));
    }
    services::delete_pool_queues(&pool);
    services::delete_redis_prefix(&prefix);
    print(&report);
    fault::keep_report(cfg.dir.as_deref(), &root, "fleetsoak.json", &report)?;
    Ok(report)
}

/// Starts `workers` workers in `processes` processes and waits until every
/// one consumes (its ready file).
fn start_fleet(
    me: &Path,
    root: &Path,
    pool: &str,
    prefix: &str,
    workers: usize,
    processes: usize,
) -> Result<Fleet> {
    let ready = root.join("ready");
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs)?;
    let mut children = Vec::new();
    for p in 0..processes {
        // Workers spread evenly; the first processes take the remainder.
        let count = workers / processes + usize::from(p < workers % processes);
        let port = batchfleet_testkit::nodes::free_port()?;
        let log = std::fs::File::create(logs.join(format!("sim-{p}.log")))?;
        let child = Command::new(me)
            .args(["sim-workers", "--count", &count.to_string()])
            .args(["--id-prefix", &format!("sim{p}")])
            .arg("--ready-dir")
            .arg(&ready)
            .args(["--", "--pool", pool, "--redis-prefix", prefix])
            .args(["--threads", "1", "--metrics-host", "127.0.0.1"])
            .args(["--metrics-port", &port.to_string()])
            .arg("--data-root")
            .arg(root)
            .env("BATCHFLEET_SIGNING_KEY", fault::FAULT_KEY)
            // One line per item from hundreds of workers is the log's
            // cost, not the control plane's.
            .env("RUST_LOG", "warn")
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .context("starting sim-workers")?;
        children.push((child, port));
    }
    let mut fleet = Fleet::adopt(children);
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let up = std::fs::read_dir(&ready).map_or(0, Iterator::count);
        if up >= workers {
            return Ok(fleet);
        }
        for (i, c) in fleet.children_mut().enumerate() {
            if let Some(status) = c.try_wait()? {
                bail!(
                    "simulated worker process {i} exited ({status}) with {up} of {workers} workers up; see {}",
                    logs.join(format!("sim-{i}.log")).display()
                );
            }
        }
        if Instant::now() > deadline {
            bail!(
                "{up} of {workers} workers consuming after 180 s; see {}",
                logs.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Redis commands per worker-second while the fleet has no work.
fn background(idle: Duration, workers: usize) -> Result<f64> {
    let before = redis_stats()?;
    let t = Instant::now();
    std::thread::sleep(idle);
    let after = redis_stats()?;
    let secs = t.elapsed().as_secs_f64();
    // Less the INFO that read `after`.
    let commands = after
        .commands
        .saturating_sub(before.commands)
        .saturating_sub(1) as f64;
    Ok(commands / (workers as f64 * secs.max(1e-9)))
}

/// Runs every job at once, measuring; fills the report's figures.
fn measure(
    coordinator: &Path,
    prefix: &str,
    dirs: &[PathBuf],
    fleet: &Fleet,
    report: &mut FleetSoakReport,
) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpu_before = CpuSample::take(&fleet.pids());
    // Redis's per-command latency percentiles count from here (its other
    // counters are read as differences).
    services::redis_cli(&["config", "resetstat"])?;
    let redis_before = redis_stats()?;
    let sockets_before = amqp_socket_bytes();
    let messages_before = fleet.metric_sum("batchfleet_worker_messages_received_total");
    let syncs_before = fleet.metric_sum("batchfleet_syncs_total");
    let done = AtomicBool::new(false);
    let started = Instant::now();
    let (ended, sockets_seen, probe) = std::thread::scope(|s| {
        let sockets = s.spawn(|| watch_amqp_sockets(&done));
        let probe = s.spawn(|| ping_probe(&done));
        let ended = run_jobs(coordinator, prefix, dirs);
        done.store(true, Ordering::SeqCst);
        (
            ended,
            sockets.join().unwrap_or_default(),
            probe
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the probe panicked"))),
        )
    });
    let seconds = started.elapsed().as_secs_f64();
    let cpu_after = CpuSample::take(&fleet.pids());
    let redis_after = redis_stats()?;
    let summaries = ended?;
    let pings = probe?;
    let items = report.items as f64;
    let per = |x: f64| x / items.max(1.0);
    report.seconds = seconds;
    report.items_per_s = items / seconds.max(1e-9);
    // The probe's PINGs and this run's two INFOs are not the fleet's.
    let probe_count = pings.len() as f64;
    let delta = |after: u64, before: u64| after.saturating_sub(before) as f64;
    report.redis_commands_per_item =
        per(delta(redis_after.commands, redis_before.commands) - probe_count - 1.0);
    report.redis_requests_per_item =
        per(delta(redis_after.reads, redis_before.reads) - probe_count - 1.0);
    report.redis_bytes_per_item = per(delta(redis_after.bytes, redis_before.bytes));
    let messages = fleet.metric_sum("batchfleet_worker_messages_received_total") - messages_before;
    report.amqp_messages_per_item = per(3.0 * messages);
    report.amqp_bytes_per_item = per(amqp_bytes_between(&sockets_before, &sockets_seen) as f64);
    report.syncs_per_item = per(fleet.metric_sum("batchfleet_syncs_total") - syncs_before);
    let cpu = cpu_before.per_item(&cpu_after, report.items, cores);
    report.cpu_workers_ms = cpu.workers_ms.iter().sum();
    report.cpu_coordinators_ms = cpu.coordinator_ms;
    report.cpu_rabbitmq_ms = cpu.rabbitmq_ms;
    report.cpu_redis_ms = cpu.redis_ms;
    report.redis_server_p99_us = server_latency(3)?;
    let (p50, p99, max) = percentiles(pings);
    (
        report.redis_p50_ms,
        report.redis_p99_ms,
        report.redis_max_ms,
    ) = (p50, p99, max);
    for summary in &summaries {
        let num = |k: &str| fault::summary_u64(summary, k);
        report.spurious_starts += num("deliveries").saturating_sub(num("items_total"));
        report.redispatched += num("items_redispatched");
    }
    Ok(())
}

/// Starts every job's `batchfleet run` at once and waits for all: their
/// summaries, or an error naming the jobs that failed.
fn run_jobs(coordinator: &Path, prefix: &str, dirs: &[PathBuf]) -> Result<Vec<serde_json::Value>> {
    let args: Vec<String> = ["--redis-prefix", prefix, "run", "job.toml", "--no-progress"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let mut children = Vec::new();
    for dir in dirs {
        children.push(fault::spawn_coordinator(
            coordinator,
            dir,
            &args,
            "coordinator.log",
        )?);
    }
    // A job of this run takes minutes at most; an hour is a hang.
    let deadline = Instant::now() + Duration::from_secs(3600);
    let mut running: Vec<usize> = (0..children.len()).collect();
    let mut failed = None;
    while !running.is_empty() && failed.is_none() {
        let mut still = Vec::new();
        for i in running {
            match children[i].try_wait()? {
                Some(status) if status.success() => {}
                Some(status) => {
                    failed = Some(format!(
                        "a job's coordinator exited ({status}); see {}",
                        dirs[i].join("coordinator.log").display()
                    ));
                }
                None => still.push(i),
            }
        }
        running = still;
        if Instant::now() > deadline {
            failed = Some("jobs still running after an hour".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Some(why) = failed {
        // The others would run on without a fleet to check them against.
        for child in &mut children {
            let _ = child.kill();
            let _ = child.wait();
        }
        bail!("{why}");
    }
    dirs.iter().map(|d| fault::read_summary(d)).collect()
}

/// A `PING` to the local Redis every 10 ms until `done`: each round trip, ms.
fn ping_probe(done: &AtomicBool) -> Result<Vec<f64>> {
    let mut conn = std::net::TcpStream::connect("127.0.0.1:6379").context("the Redis probe")?;
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut took = Vec::new();
    let mut reply = [0u8; 7];
    while !done.load(Ordering::SeqCst) {
        let t = Instant::now();
        conn.write_all(b"PING\r\n")?;
        conn.read_exact(&mut reply)?;
        if &reply != b"+PONG\r\n" {
            bail!("the Redis probe read {:?}", String::from_utf8_lossy(&reply));
        }
        took.push(t.elapsed().as_secs_f64() * 1000.0);
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(took)
}

/// The `top` commands by calls since the last `CONFIG RESETSTAT`, each
/// with its calls and its p99 in µs (`INFO latencystats`, Redis ≥ 7).
fn server_latency(top: usize) -> Result<Vec<(String, u64, f64)>> {
    let calls = services::redis_cli(&["info", "commandstats"])?;
    let latency = services::redis_cli(&["info", "latencystats"])?;
    let mut commands: Vec<(String, u64, f64)> = calls
        .lines()
        .filter_map(|l| {
            let (name, stats) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let n = stats
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            let p99 = latency
                .lines()
                .find_map(|l| {
                    l.trim()
                        .strip_prefix(&format!("latency_percentiles_usec_{name}:"))
                })
                .and_then(|v| v.split(',').find_map(|f| f.strip_prefix("p99=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or(f64::NAN);
            (name != "info" && name != "config" && name != "ping")
                .then(|| (name.to_owned(), n, p99))
        })
        .collect();
    commands.sort_by_key(|c| std::cmp::Reverse(c.1));
    commands.truncate(top);
    Ok(commands)
}

/// p50, p99 and the largest of `xs`.
fn percentiles(mut xs: Vec<f64>) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    xs.sort_by(f64::total_cmp);
    let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), xs[xs.len() - 1])
}

fn print(r: &FleetSoakReport) {
    let mark = |met: bool| if met { "met" } else { "MISSED" };
    println!(
        "\nsoak (simulated fleet): {} workers in {} processes, {} jobs, {} one-row items in {:.1} s: {:.0} items/s",
        r.workers, r.processes, r.jobs, r.items, r.seconds, r.items_per_s
    );
    println!("  per item (target):");
    println!(
        "    Redis commands, script-inner included: {:.2} (≤ 3: {})",
        r.redis_commands_per_item,
        mark(r.redis_commands_per_item <= 3.0)
    );
    println!(
        "    Redis requests: {:.3} (≤ 0.2: {})",
        r.redis_requests_per_item,
        mark(r.redis_requests_per_item <= 0.2)
    );
    println!("    Redis bytes: {:.0}", r.redis_bytes_per_item);
    println!(
        "    AMQP messages: {:.2} (≤ 0.5: {}); bytes on the wire: {:.0} (≤ 300: {})",
        r.amqp_messages_per_item,
        mark(r.amqp_messages_per_item <= 0.5),
        r.amqp_bytes_per_item,
        mark(r.amqp_bytes_per_item <= 300.0)
    );
    println!(
        "    syncs: {:.3} (≤ 0.25: {})",
        r.syncs_per_item,
        mark(r.syncs_per_item <= 0.25)
    );
    println!(
        "    CPU ms: workers {:.3}, coordinators {:.3}, RabbitMQ {:.3}, Redis {:.3}",
        r.cpu_workers_ms, r.cpu_coordinators_ms, r.cpu_rabbitmq_ms, r.cpu_redis_ms
    );
    println!(
        "  Redis round trip (PING every 10 ms): p50 {:.2} ms, p99 {:.2} ms (< {TARGET_REDIS_P99_MS}: {}), worst {:.1} ms",
        r.redis_p50_ms,
        r.redis_p99_ms,
        mark(r.redis_p99_ms < TARGET_REDIS_P99_MS),
        r.redis_max_ms
    );
    let server: Vec<String> = r
        .redis_server_p99_us
        .iter()
        .map(|(name, calls, p99)| format!("{name} {p99:.0} µs ({calls} calls)"))
        .collect();
    println!(
        "  Redis's own time per command, p99 (the most called): {}",
        server.join(", ")
    );
    println!(
        "  spurious copies: {} item starts beyond one per item, {} items published again (0: {})",
        r.spurious_starts,
        r.redispatched,
        mark(r.spurious_starts == 0 && r.redispatched == 0)
    );
    println!(
        "  broker sessions lost: {} (0: {})",
        r.broker_reconnects,
        mark(r.broker_reconnects == 0)
    );
    println!(
        "  idle fleet: {:.3} Redis commands per worker-second (≤ {TARGET_BACKGROUND_PER_WORKER_S}: {}); the fleet took {:.1} s to start",
        r.background_commands_per_worker_s,
        mark(r.background_commands_per_worker_s <= TARGET_BACKGROUND_PER_WORKER_S),
        r.start_seconds
    );
    fault::print_verdict(
        "  ",
        &r.violations,
        "every row of every job exactly once, the counts and the files hold",
    );
}
