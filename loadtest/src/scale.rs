//! `batchfleet-loadtest scale`: what one RabbitMQ and one Redis carry as
//! the fleet grows — the per-item costs a model for a thousand GPUs is
//! built on (docs/scaling.md).
//!
//! For each fleet size (worker processes of one libtorch thread) it runs one
//! job of one-row items with a model that does next to nothing — every
//! item is nothing but the system's own work — and then jobs of realistic
//! 10,000-row items. For each it measures, over the job:
//! - items/s (from the job's own duration);
//! - Redis commands per item and bytes per item on its wire (`INFO stats`:
//!   `total_commands_processed`, `total_net_input_bytes`,
//!   `total_net_output_bytes`);
//! - RabbitMQ messages per item (publishes, deliveries and acks: three
//!   per message the workers took, a bundle of several items counting
//!   once) and bytes per item on its wire (the broker's sockets'
//!   `bytes_sent` + `bytes_received`, from `ss -ti`, sampled through the job
//!   so that the coordinator's short-lived connections count too);
//! - CPU milliseconds per item of the workers, the coordinator, RabbitMQ
//!   and Redis, and how busy the machine's cores were.
//!
//! Where adding workers stops adding items/s (less than 20% more for twice
//! the workers) is the bend; the part that bends it is the machine's cores
//! when they are busy, otherwise the part whose CPU per item is the largest
//! share of the services'.

use crate::fleet::{manifest_into, run_job_with, CpuPerItem, CpuSample, Fleet};
use anyhow::{bail, Context, Result};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services;
use serde::Serialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Settings of a scale run.
#[derive(Debug, Clone)]
pub struct ScaleConfig {
    /// Fleet sizes (worker processes) for the one-row jobs.
    pub workers: Vec<usize>,
    /// One-row items per job.
    pub items: u64,
    /// Fleet sizes for the 10k-row jobs.
    pub realistic_workers: Vec<usize>,
    /// Items per 10k-row job.
    pub realistic_items: u64,
    /// Rows per realistic item.
    pub realistic_rows: u64,
    /// Work folder (a temporary one if `None`), kept with logs if given.
    pub dir: Option<PathBuf>,
}

/// One job of one fleet size.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Step {
    /// `one-row` or `10k-row`.
    pub kind: String,
    /// Worker processes.
    pub workers: usize,
    /// Items in the job.
    pub items: u64,
    /// Rows per item.
    pub item_rows: u64,
    /// Items per second over the job's duration.
    pub items_per_s: f64,
    /// Redis commands per item.
    pub redis_commands_per_item: f64,
    /// Bytes per item on Redis's wire (in + out).
    pub redis_bytes_per_item: f64,
    /// AMQP messages per item: publishes + deliveries + acks.
    pub amqp_messages_per_item: f64,
    /// Bytes per item on RabbitMQ's wire (in + out).
    pub amqp_bytes_per_item: f64,
    /// The workers' syncs to disk per item (file and folder fsyncs,
    /// filesystem syncs), counted by the workers; 0 from a build without
    /// the counter.
    pub syncs_per_item: f64,
    /// CPU per item by part.
    pub cpu: CpuPerItem,
    /// CPU the parts used ÷ (duration × cores).
    pub machine_busy: f64,
}

/// Everything a scale run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScaleReport {
    /// Cores on this machine.
    pub cores: usize,
    /// Every job, in the order run.
    pub steps: Vec<Step>,
    /// The fleet size from which twice the workers gave less than 20% more
    /// one-row items/s (none: the curve did not bend in the sizes run).
    pub bend_at_workers: Option<usize>,
    /// What bends it.
    pub bent_by: String,
}

/// Redis's counters from `INFO stats`.
/// The local Redis's counters a run reads before and after a job.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RedisStats {
    /// Commands run, those run inside scripts included.
    pub(crate) commands: u64,
    /// Reads of client sockets: a request, a pipeline or a script is one.
    pub(crate) reads: u64,
    /// Bytes in and out on its wire.
    pub(crate) bytes: u64,
}

pub(crate) fn redis_stats() -> Result<RedisStats> {
    let [commands, reads, input, output] = services::redis_info_fields(
        "stats",
        [
            "total_commands_processed",
            "total_reads_processed",
            "total_net_input_bytes",
            "total_net_output_bytes",
        ],
    )
    .context("redis-cli INFO stats")?;
    Ok(RedisStats {
        commands: commands as u64,
        reads: reads as u64,
        bytes: (input + output) as u64,
    })
}

/// Bytes sent + received so far by each established socket of the local
/// broker's port 5672, by the peer's address.
pub(crate) fn amqp_socket_bytes() -> HashMap<String, u64> {
    let Ok(out) = Command::new("ss")
        .args(["-tinH", "state", "established", "( sport = :5672 )"])
        .output()
    else {
        return HashMap::new();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut by_peer = HashMap::new();
    let mut peer: Option<String> = None;
    for line in text.lines() {
        // A socket's line names the addresses; the next line holds its
        // counters.
        let fields: Vec<&str> = line.split_whitespace().collect();
        if line.contains(":5672") && fields.len() >= 4 {
            peer = fields
                .iter()
                .rev()
                .find(|f| f.contains(':'))
                .map(|p| (*p).to_owned());
            continue;
        }
        let counter = |name: &str| -> u64 {
            fields
                .iter()
                .find_map(|f| f.strip_prefix(name))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        if let Some(p) = peer.take() {
            by_peer.insert(p, counter("bytes_sent:") + counter("bytes_received:"));
        }
    }
    by_peer
}

/// The largest byte count seen on each broker socket, looked at every
/// 200 ms until `done` and once after: a connection that closes between two
/// looks loses at most one interval.
pub(crate) fn watch_amqp_sockets(done: &AtomicBool) -> HashMap<String, u64> {
    let mut seen: HashMap<String, u64> = HashMap::new();
    let mut look = || {
        for (peer, bytes) in amqp_socket_bytes() {
            let e = seen.entry(peer).or_default();
            *e = (*e).max(bytes);
        }
    };
    while !done.load(Ordering::SeqCst) {
        look();
        std::thread::sleep(Duration::from_millis(200));
    }
    look();
    seen
}

/// Bytes the broker's sockets carried from `before` to `seen`.
pub(crate) fn amqp_bytes_between(
    before: &HashMap<String, u64>,
    seen: &HashMap<String, u64>,
) -> u64 {
    seen.iter()
        .map(|(peer, after)| after.saturating_sub(before.get(peer).copied().unwrap_or(0)))
        .sum()
}

/// Runs the steps; prints and returns the figures.
pub fn run(cfg: &ScaleConfig) -> Result<ScaleReport> {
    services::ensure_local()?;
    let worker_bin = crate::fault::sibling("batchfleet-worker")?;
    let coordinator = crate::fault::sibling("batchfleet")?;
    let (root, _tmp) = crate::fault::work_dir(cfg.dir.as_deref())?;
    let prefix = services::unique("bfscale");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = ScaleReport {
        cores,
        ..ScaleReport::default()
    };
    let outcome = (|| -> Result<()> {
        let kinds = [
            ("one-row", cfg.items, 1, 1, &cfg.workers),
            (
                "10k-row",
                cfg.realistic_items,
                cfg.realistic_rows,
                64,
                &cfg.realistic_workers,
            ),
        ];
        for (kind, items, item_rows, hidden, sizes) in kinds {
            if items == 0 || sizes.is_empty() {
                continue;
            }
            let dir = root.join(kind);
            let pool = services::unique("scale");
            make_job(
                &dir,
                &JobGen {
                    rows: items * item_rows,
                    files: 1,
                    features: 16,
                    hidden,
                    outputs: 1,
                    name: format!("scale-{kind}"),
                    pool: pool.clone(),
                    item_rows,
                    batch_size: item_rows.min(10_000) as u32,
                    ..JobGen::default()
                },
            )?;
            for &w in sizes.iter() {
                println!("scale [{kind}] {items} items on {w} worker(s)…");
                let step = measure(
                    &worker_bin,
                    &coordinator,
                    &dir,
                    &pool,
                    &prefix,
                    kind,
                    w,
                    items,
                    item_rows,
                    cores,
                )?;
                println!(
                    "scale [{kind}] {w:>2} workers: {:>7.0} items/s, Redis {:.1} cmds and {:.0} B per item, AMQP {:.1} msgs and {:.0} B per item, {:.2} syncs per item, machine {:.0}% busy",
                    step.items_per_s,
                    step.redis_commands_per_item,
                    step.redis_bytes_per_item,
                    step.amqp_messages_per_item,
                    step.amqp_bytes_per_item,
                    step.syncs_per_item,
                    step.machine_busy * 100.0
                );
                report.steps.push(step);
            }
            services::delete_pool_queues(&pool);
        }
        Ok(())
    })();
    services::delete_redis_prefix(&prefix);
    outcome?;
    let (bend, by) = bend(&report.steps);
    report.bend_at_workers = bend;
    report.bent_by = by;
    print(&report);
    crate::fault::keep_report(cfg.dir.as_deref(), &root, "scale.json", &report)?;
    Ok(report)
}

/// One job on a fresh fleet of `workers`.
#[allow(clippy::too_many_arguments)]
fn measure(
    worker_bin: &Path,
    coordinator: &Path,
    dir: &Path,
    pool: &str,
    prefix: &str,
    kind: &str,
    workers: usize,
    items: u64,
    item_rows: u64,
    cores: usize,
) -> Result<Step> {
    // Each step writes its own output: another job on the same data.
    let out = format!("out-{workers}");
    let manifest = manifest_into(dir, &out)?;
    let mut fleet = Fleet::start(worker_bin, dir, pool, prefix, workers, 1)?;
    let cpu_before = CpuSample::take(&fleet.pids());
    let redis_before = redis_stats()?;
    let sockets_before = amqp_socket_bytes();
    let done = AtomicBool::new(false);
    let (job, sockets_seen) = std::thread::scope(|s| {
        let sampler = s.spawn(|| watch_amqp_sockets(&done));
        let job = run_job_with(coordinator, &manifest, prefix, &[], &out);
        done.store(true, Ordering::SeqCst);
        (job, sampler.join().unwrap_or_default())
    });
    let cpu_after = CpuSample::take(&fleet.pids());
    let redis_after = redis_stats()?;
    let fleet_messages = fleet.metric_sum("batchfleet_worker_messages_received_total");
    let fleet_syncs = fleet.metric_sum("batchfleet_syncs_total");
    fleet.stop();
    let (wall, _, summary) = job?;
    // Items cut blind may be a few more than rows ÷ item rows.
    let items = summary["items_total"].as_u64().unwrap_or(items);
    if summary["items_completed"].as_u64() != Some(items) {
        bail!(
            "the {kind} job on {workers} workers committed {:?} of {items} items",
            summary["items_completed"]
        );
    }
    let per = |x: f64| x / items.max(1) as f64;
    let amqp_bytes = amqp_bytes_between(&sockets_before, &sockets_seen);
    let num = |k: &str| summary[k].as_u64().unwrap_or(0) as f64;
    // Each message taken published once, delivered once, acknowledged
    // once (a bundle of several items is one message); a build without
    // the counter published, delivered and acknowledged each item.
    let received = fleet_messages;
    let messages = if received > 0.0 {
        3.0 * received
    } else {
        num("items_total") + num("items_redispatched") + 2.0 * num("deliveries")
    };
    let cpu = cpu_before.per_item(&cpu_after, items, cores);
    let machine_busy = cpu.total_ms * items as f64 / 1000.0 / (wall.max(1e-9) * cores as f64);
    Ok(Step {
        kind: kind.to_owned(),
        workers,
        items,
        item_rows,
        items_per_s: items as f64 / wall.max(1e-9),
        redis_commands_per_item: per(
            redis_after.commands.saturating_sub(redis_before.commands) as f64
        ),
        redis_bytes_per_item: per(redis_after.bytes.saturating_sub(redis_before.bytes) as f64),
        amqp_messages_per_item: per(messages),
        amqp_bytes_per_item: per(amqp_bytes as f64),
        syncs_per_item: per(fleet_syncs),
        cpu,
        machine_busy,
    })
}

/// Where twice the workers stopped giving 20% more one-row items/s, and
/// what bends the curve there.
fn bend(steps: &[Step]) -> (Option<usize>, String) {
    let one: Vec<&Step> = steps.iter().filter(|s| s.kind == "one-row").collect();
    let Some(at) = one.windows(2).find_map(|w| {
        let gain = w[1].items_per_s / w[0].items_per_s.max(1e-9);
        let more = w[1].workers as f64 / w[0].workers.max(1) as f64;
        (gain < 1.0 + 0.2 * more.log2()).then_some(w[0])
    }) else {
        return (None, "nothing in the sizes run".into());
    };
    let c = &at.cpu;
    let workers_ms: f64 = c.workers_ms.iter().sum();
    let parts = [
        ("the workers", workers_ms),
        ("the coordinator", c.coordinator_ms),
        ("RabbitMQ", c.rabbitmq_ms),
        ("Redis", c.redis_ms),
    ];
    let shares: Vec<String> = parts
        .iter()
        .map(|(n, ms)| format!("{n} {:.0}%", 100.0 * ms / c.total_ms.max(1e-9)))
        .collect();
    let (top, _) =
        parts.iter().skip(1).fold(
            ("", 0.0f64),
            |(n0, m0), (n, m)| if *m > m0 { (n, *m) } else { (n0, m0) },
        );
    let by = if at.machine_busy > 0.85 {
        format!(
            "the machine's {} cores ({:.0}% busy at {} workers; CPU per item: {}); of the central parts, {top} costs the most",
            (c.ceiling_items_per_s * c.total_ms / 1000.0).round(),
            at.machine_busy * 100.0,
            at.workers,
            shares.join(", ")
        )
    } else {
        format!(
            "{top} ({:.0}% busy machine at {} workers; CPU per item: {})",
            at.machine_busy * 100.0,
            at.workers,
            shares.join(", ")
        )
    };
    (Some(at.workers), by)
}

fn print(r: &ScaleReport) {
    println!(
        "\nscale run on {} cores (one libtorch thread per worker)",
        r.cores
    );
    println!(
        "  {:<8} {:>7} {:>9} {:>10} {:>9} {:>10} {:>9} {:>6} {:>12} {:>10} {:>10} {:>6}",
        "items",
        "workers",
        "items/s",
        "Redis cmd",
        "Redis B",
        "AMQP msgs",
        "AMQP B",
        "syncs",
        "workers ms",
        "coord ms",
        "RMQ ms",
        "Redis ms"
    );
    for s in &r.steps {
        println!(
            "  {:<8} {:>7} {:>9.0} {:>10.1} {:>9.0} {:>10.1} {:>9.0} {:>6.2} {:>12.2} {:>10.3} {:>10.3} {:>6.3}   busy {:.0}%",
            s.kind,
            s.workers,
            s.items_per_s,
            s.redis_commands_per_item,
            s.redis_bytes_per_item,
            s.amqp_messages_per_item,
            s.amqp_bytes_per_item,
            s.syncs_per_item,
            s.cpu.workers_ms.iter().sum::<f64>(),
            s.cpu.coordinator_ms,
            s.cpu.rabbitmq_ms,
            s.cpu.redis_ms,
            s.machine_busy * 100.0
        );
    }
    match r.bend_at_workers {
        Some(w) => println!("  the one-row curve bends after {w} workers: {}", r.bent_by),
        None => println!("  the one-row curve did not bend in the sizes run"),
    }
    // The fastest one-row step is the least disturbed by sharing the cores.
    if let Some(s) = r
        .steps
        .iter()
        .filter(|s| s.kind == "one-row")
        .max_by(|a, b| a.items_per_s.total_cmp(&b.items_per_s))
    {
        println!(
            "  per core, alone: Redis {:.0} items/s, RabbitMQ {:.0} items/s, the coordinator {:.0} items/s (1000 ÷ their CPU ms per item at {} workers, the fastest one-row step)",
            1000.0 / s.cpu.redis_ms.max(1e-9),
            1000.0 / s.cpu.rabbitmq_ms.max(1e-9),
            1000.0 / s.cpu.coordinator_ms.max(1e-9),
            s.workers
        );
    }
}
