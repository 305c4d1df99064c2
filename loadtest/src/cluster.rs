//! `batchfleet-loadtest cluster`: a job on a three-node RabbitMQ cluster of
//! the run's own (nodes on loopback ports with their own names and data,
//! clustered with `rabbitmqctl join_cluster`), while the node leading the
//! job's quorum queue is killed mid-job and later started again.
//!
//! The same job first runs on the healthy cluster, for the wall-time
//! comparison. Each worker gets every node's URL, its list rotated so that
//! worker *i* connects to node *i* first: one worker sits on the leader
//! when it dies and must move to another node. The node is started again
//! at 50% of the baseline's time and rejoins the cluster under the job. Checked at the end: every
//! row exactly once and equal to PyTorch's (INV-ROWS), the job's counts and
//! files (INV-ACCT, INV-FILES), nothing dead-lettered, the queue replicated
//! on every node, each worker that was on the killed node reconnected to
//! another (from its log), and no worker exited on its own.

use crate::chaos::{self, Fleet};
use crate::fault;
use anyhow::{bail, Context, Result};
use batchfleet_shared::endpoint::Endpoint;
use batchfleet_shared::secret::SecretUrl;
use batchfleet_testkit::nodes::{RabbitCluster, RabbitNode};
use batchfleet_testkit::services;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

/// Settings of a cluster run.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterConfig {
    /// RabbitMQ nodes (at least 3).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Rows in the job.
    #[arg(long, default_value_t = 200_000)]
    pub rows: u64,
    /// One-row items of a last, control-plane job on the healthy
    /// cluster, measuring the nodes' CPU per item (0: skip it).
    #[arg(long, default_value_t = 3_000)]
    pub control_items: u64,
    /// Workers, item size, time limit, work folder.
    #[command(flatten)]
    pub job: fault::FaultJobArgs,
    /// Mini-batch size and delay.
    #[command(flatten)]
    pub pace: fault::PaceArgs,
}

/// The figures of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ClusterReport {
    /// Nodes in the cluster.
    pub nodes: usize,
    /// Rows in the job.
    pub rows: u64,
    /// Items in the job.
    pub items: u64,
    /// Wall time of the job on the healthy cluster (s).
    pub baseline_s: f64,
    /// Wall time of the job with the leader killed and brought back (s).
    pub failover_s: f64,
    /// The baseline job's own duration, from its summary (s): planning to
    /// settled, without start-up and the final queue deletion.
    pub baseline_job_s: f64,
    /// The failover job's own duration, from its summary (s).
    pub failover_job_s: f64,
    /// The job's quorum queue.
    pub queue: String,
    /// Its member nodes before the kill.
    pub members: Vec<String>,
    /// The node that led it, killed.
    pub killed: String,
    /// When it was killed (s into the job).
    pub killed_at_s: f64,
    /// When the killed node was started again (s into the job).
    pub restarted_at_s: f64,
    /// When it was running and clustered again (s into the job).
    pub rejoined_at_s: f64,
    /// The queue's leader after the kill.
    pub new_leader: String,
    /// Workers connected to the killed node when it died.
    pub workers_on_killed_node: u32,
    /// Of them, those that went on consuming through another node.
    pub workers_moved: u32,
    /// Messages in the pool's dead-letter queue at the end.
    pub dead_lettered: u64,
    /// Item deliveries beyond one per item.
    pub items_redelivered: u64,
    /// Worker processes that exited without being stopped.
    pub workers_exited_on_their_own: u32,
    /// One-row items of the control-plane job on the healthy cluster.
    pub control_items: u64,
    /// Their rate (items/s, from the job's duration).
    pub control_items_per_s: f64,
    /// CPU of the cluster's nodes per item (ms), each node.
    pub control_node_ms: Vec<f64>,
    /// Invariant violations found (empty: all hold).
    pub violations: Vec<String>,
}

/// Runs the baseline and the failover run; prints and returns the figures.
pub fn run(cfg: &ClusterConfig) -> Result<ClusterReport> {
    if cfg.nodes < 3 {
        bail!("--nodes must be at least 3: a quorum queue survives the loss of its leader only with a majority left");
    }
    services::ensure_local()?;
    let worker_bin = fault::sibling("batchfleet-worker")?;
    let coordinator = fault::sibling("batchfleet")?;
    let (root, _tmp) = fault::work_dir(cfg.job.dir.as_deref())?;
    let pool = services::unique("cluster");
    let prefix = services::unique("bfcluster");
    let mut report = ClusterReport {
        nodes: cfg.nodes,
        rows: cfg.rows,
        items: cfg.rows.div_ceil(cfg.job.item_rows),
        ..ClusterReport::default()
    };
    println!(
        "cluster: starting {} RabbitMQ nodes and clustering them",
        cfg.nodes
    );
    let started = Instant::now();
    let mut cluster = RabbitCluster::start(&root.join("rabbitmq"), cfg.nodes)?;
    let urls = cluster.urls();
    println!(
        "cluster: {} nodes running after {:.0}s ({})",
        cfg.nodes,
        started.elapsed().as_secs_f64(),
        cluster
            .nodes
            .iter()
            .map(|n| n.name().to_owned())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let outcome = run_jobs(
        cfg,
        &mut cluster,
        &urls,
        &root,
        &pool,
        &prefix,
        &worker_bin,
        &coordinator,
        &mut report,
    );
    services::delete_redis_prefix(&prefix);
    drop(cluster);
    outcome?;
    print(&report);
    fault::keep_report(cfg.job.dir.as_deref(), &root, "cluster.json", &report)?;
    Ok(report)
}

#[allow(clippy::too_many_arguments)]
fn run_jobs(
    cfg: &ClusterConfig,
    cluster: &mut RabbitCluster,
    urls: &[String],
    root: &Path,
    pool: &str,
    prefix: &str,
    worker_bin: &Path,
    coordinator: &Path,
    report: &mut ClusterReport,
) -> Result<()> {
    for name in ["baseline", "failover"] {
        fault::fault_job(
            &root.join(name),
            name,
            pool,
            cfg.rows,
            cfg.job.item_rows,
            cfg.pace.batch_size,
            2,
        )?;
    }
    let list = urls.join(",");
    let args = fault::fault_worker_args("2m", cfg.pace.batch_delay, root);
    let mut fleet = Fleet::new(worker_bin.to_owned(), root.to_owned(), pool, prefix, args);
    // Worker i is given the nodes starting from node i.
    fleet.slot_args = (0..cfg.job.workers)
        .map(|i| {
            let n = urls.len();
            let rotated: Vec<&str> = (0..n).map(|k| urls[(i + k) % n].as_str()).collect();
            vec!["--amqp-url".to_owned(), rotated.join(",")]
        })
        .collect();
    let coordinator_cmd = |dir: &Path, log: &str| -> Result<Child> {
        let args: Vec<String> = ["--redis-prefix", prefix, "--amqp-url", &list]
            .into_iter()
            .chain(["run", "job.toml", "--no-progress"])
            .map(str::to_owned)
            .collect();
        fault::spawn_coordinator(coordinator, dir, &args, log)
    };

    // The healthy cluster.
    let shape = (cfg.rows, cfg.job.workers, cfg.job.timeout);
    report.baseline_s = chaos::baseline("cluster", shape, &mut fleet, root, coordinator_cmd)?;

    // The leader killed at 30% of the baseline's time, back at 50%.
    let dir = root.join("failover");
    let first_worker = fleet.spawned + 1;
    fleet.start(cfg.job.workers)?;
    let started = Instant::now();
    let mut c = coordinator_cmd(&dir, "coordinator.log")?;
    let job_queue = format!("bf.{pool}.job.");
    // The faults run on a thread of their own (rabbitmqctl and a node's
    // start take seconds), so the job's wall time is read the moment the
    // coordinator exits.
    let baseline_s = report.baseline_s;
    let done = std::sync::atomic::AtomicBool::new(false);
    let (finished, faults) = std::thread::scope(|s| {
        let faults = s.spawn(|| fault_schedule(cluster, &job_queue, baseline_s, started, &done));
        let finished = fault::wait_or_kill(&mut c, cfg.job.timeout);
        report.failover_s = started.elapsed().as_secs_f64();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        (finished, faults.join())
    });
    let faults = match faults {
        Ok(f) => f,
        Err(_) => bail!("the fault thread panicked"),
    };
    let killed = match faults {
        Ok(f) => {
            report.queue = f.queue;
            report.members = f.members;
            report.killed = f.killed;
            report.killed_at_s = f.killed_at_s;
            report.new_leader = f.new_leader;
            report.restarted_at_s = f.restarted_at_s;
            report.rejoined_at_s = f.rejoined_at_s;
            f.node
        }
        Err(e) => {
            fleet.stop();
            return Err(e);
        }
    };
    for w in &mut fleet.workers {
        if w.try_wait()?.is_some() {
            report.workers_exited_on_their_own += 1;
        }
    }
    fleet.stop();
    match finished {
        Some(true) => {}
        Some(false) => bail!(
            "the job failed with the leader killed; see {}",
            dir.join("coordinator.log").display()
        ),
        None => bail!(
            "the job did not finish within {:?} with the leader killed",
            cfg.job.timeout
        ),
    }
    let Some(killed) = killed else {
        bail!("the job finished before the leader was killed; give it more rows or a longer --batch-delay");
    };

    moved_workers(cfg, cluster, &fleet, killed, first_worker, report);
    check(cfg, root, &dir, pool, &list, report)?;
    if cfg.control_items > 0 {
        control_job(
            cfg,
            cluster,
            &mut fleet,
            root,
            pool,
            prefix,
            coordinator,
            report,
        )?;
    }
    Ok(())
}

/// Which workers were on the killed node (the first node they consumed
/// through, from their logs), and how many went on through another.
fn moved_workers(
    cfg: &ClusterConfig,
    cluster: &RabbitCluster,
    fleet: &Fleet,
    killed: usize,
    first_worker: u32,
    report: &mut ClusterReport,
) {
    let killed_port = cluster.nodes[killed].port;
    for slot in 0..cfg.job.workers {
        let id = Fleet::id(slot, first_worker + slot as u32);
        let log = std::fs::read_to_string(fleet.log_of(&id)).unwrap_or_default();
        let ports: Vec<u16> = log
            .lines()
            .filter(|l| l.contains("worker consuming"))
            .filter_map(node_port)
            .collect();
        if ports.first() == Some(&killed_port) {
            report.workers_on_killed_node += 1;
            if ports.iter().skip(1).any(|&p| p != killed_port) {
                report.workers_moved += 1;
            }
        }
    }
}

/// INV-ROWS, INV-ACCT, INV-FILES of the job in `dir`; nothing
/// dead-lettered; the queue replicated; the workers on the killed node moved
/// and none exited on its own.
fn check(
    cfg: &ClusterConfig,
    root: &Path,
    dir: &Path,
    pool: &str,
    list: &str,
    report: &mut ClusterReport,
) -> Result<()> {
    let v = &mut report.violations;
    let summary = fault::job_invariants(dir, cfg.rows, v)?;
    report.failover_job_s = fault::job_seconds(&summary);
    report.baseline_job_s = fault::job_seconds(&fault::read_summary(&root.join("baseline"))?);
    report.items_redelivered = fault::summary_u64(&summary, "deliveries")
        .saturating_sub(fault::summary_u64(&summary, "items_total"));
    let endpoint = Endpoint::amqp(SecretUrl::new(list.to_owned()));
    let dead = batchfleet_shared::broker::PoolQueues::new(pool).dead();
    for (queue, ready) in fault::queue_depths(&endpoint, pool)? {
        if queue == dead {
            report.dead_lettered = ready.into();
        } else if ready > 0 {
            v.push(format!("INV-ACCT: {queue} still holds {ready} message(s)"));
        }
    }
    if report.dead_lettered > 0 {
        v.push(format!(
            "INV-ACCT: {} item(s) dead-lettered",
            report.dead_lettered
        ));
    }
    let expected = cfg.nodes.min(3);
    if report.members.len() < expected {
        v.push(format!(
            "{} was replicated on {} node(s) ({:?}), not {expected}",
            report.queue,
            report.members.len(),
            report.members
        ));
    }
    if report.workers_on_killed_node == 0 {
        v.push("no worker was connected to the killed leader (each worker's first node comes from its rotated list)".into());
    }
    if report.workers_moved < report.workers_on_killed_node {
        v.push(format!(
            "{} worker(s) were on the killed node but only {} went on through another",
            report.workers_on_killed_node, report.workers_moved
        ));
    }
    if report.workers_exited_on_their_own > 0 {
        v.push(format!(
            "{} worker(s) exited on their own",
            report.workers_exited_on_their_own
        ));
    }
    Ok(())
}

/// One-row items with a tiny model through 2 workers on the healthy
/// cluster: what the cluster's nodes spend per item (the leader of the
/// job's queue and its two followers), for docs/scaling.md.
#[allow(clippy::too_many_arguments)]
fn control_job(
    cfg: &ClusterConfig,
    cluster: &mut RabbitCluster,
    fleet: &mut Fleet,
    root: &Path,
    pool: &str,
    prefix: &str,
    coordinator: &Path,
    report: &mut ClusterReport,
) -> Result<()> {
    let dir = root.join("control");
    batchfleet_testkit::python::make_job(
        &dir,
        &batchfleet_testkit::python::JobGen {
            rows: cfg.control_items,
            files: 1,
            features: 1,
            hidden: 1,
            outputs: 1,
            name: format!("control-{}", std::process::id()),
            pool: pool.to_owned(),
            item_rows: 1,
            batch_size: 1,
            ..batchfleet_testkit::python::JobGen::default()
        },
    )?;
    println!(
        "cluster: control-plane job, {} one-row items, 2 workers, healthy cluster",
        cfg.control_items
    );
    // No artificial delay here: the items are the system's own work.
    if let Some(i) = fleet.args.iter().position(|a| a == "--debug-batch-delay") {
        fleet.args.drain(i..(i + 2).min(fleet.args.len()));
    }
    fleet.start(2)?;
    let pids: Vec<Option<u32>> = cluster.nodes.iter().map(RabbitNode::beam_pid).collect();
    let cpu = |pids: &[Option<u32>]| -> Vec<f64> {
        pids.iter()
            .map(|p| p.and_then(services::cpu_s).unwrap_or(0.0))
            .collect()
    };
    let before = cpu(&pids);
    let args: Vec<String> = [
        "--redis-prefix",
        prefix,
        "--amqp-url",
        &cluster.urls().join(","),
    ]
    .into_iter()
    .chain(["run", "job.toml", "--no-progress"])
    .map(str::to_owned)
    .collect();
    let mut c = fault::spawn_coordinator(coordinator, &dir, &args, "coordinator.log")?;
    let ok = fault::wait_or_kill(&mut c, cfg.job.timeout);
    let after = cpu(&pids);
    fleet.stop();
    if ok != Some(true) {
        bail!(
            "the control-plane job failed; see {}",
            dir.join("coordinator.log").display()
        );
    }
    let summary = fault::read_summary(&dir)?;
    let items = fault::summary_u64(&summary, "items_total").max(1);
    report.control_items = items;
    report.control_items_per_s = items as f64 / fault::job_seconds(&summary).max(1e-9);
    report.control_node_ms = before
        .iter()
        .zip(&after)
        .map(|(b, a)| (a - b).max(0.0) * 1000.0 / items as f64)
        .collect();
    Ok(())
}

/// What the fault thread did.
#[derive(Debug, Default)]
struct Faults {
    /// The index of the node killed, if the job ran long enough.
    node: Option<usize>,
    queue: String,
    members: Vec<String>,
    killed: String,
    killed_at_s: f64,
    new_leader: String,
    restarted_at_s: f64,
    rejoined_at_s: f64,
}

/// Kills the node leading the job's queue at 30% of the baseline's time and
/// starts it again at 50% (at once if the job ends first, so the cluster
/// is whole again), unless `done` is set before the kill.
fn fault_schedule(
    cluster: &mut RabbitCluster,
    job_queue: &str,
    baseline_s: f64,
    started: Instant,
    done: &std::sync::atomic::AtomicBool,
) -> Result<Faults> {
    let is_done = || done.load(std::sync::atomic::Ordering::SeqCst);
    let mut f = Faults::default();
    if !fault::wait_until(0.3 * baseline_s, started, done) {
        return Ok(f);
    }
    let t = started.elapsed().as_secs_f64();
    let Some((queue, replicas)) = cluster
        .quorum_queues()?
        .into_iter()
        .find(|(q, _)| q.starts_with(job_queue))
    else {
        bail!("no queue {job_queue}* on the cluster {t:.1}s into the job");
    };
    let leader = cluster.index_of(&replicas.leader).with_context(|| {
        format!(
            "{queue} is led by {:?}, not a node of the run",
            replicas.leader
        )
    })?;
    cluster.nodes[leader].kill();
    f.killed_at_s = started.elapsed().as_secs_f64();
    println!(
        "cluster: {:>5.1}s killed {} (-9), the leader of {queue} (members: {})",
        f.killed_at_s,
        replicas.leader,
        replicas.members.join(", ")
    );
    f.node = Some(leader);
    f.queue = queue;
    f.members = replicas.members;
    f.killed = replicas.leader;
    // Who took over, asked of the surviving nodes until a new leader is
    // elected (the job's queue is gone once the job has finished).
    // (A queue whose leader is down may be missing from the listing until
    // one is elected: ask again, until it is time to restart the node.)
    while !is_done()
        && f.new_leader.is_empty()
        && started.elapsed().as_secs_f64() < 0.5 * baseline_s
    {
        match cluster
            .quorum_queues()?
            .into_iter()
            .find(|(q, _)| *q == f.queue)
        {
            Some((_, r)) if !r.leader.is_empty() && r.leader != f.killed => f.new_leader = r.leader,
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    fault::wait_until(0.5 * baseline_s, started, done);
    f.restarted_at_s = started.elapsed().as_secs_f64();
    cluster.nodes[leader].restart()?;
    f.rejoined_at_s = started.elapsed().as_secs_f64();
    if f.new_leader.is_empty() {
        // Leadership does not move back by itself: who leads now took over.
        if let Some((_, r)) = cluster
            .quorum_queues()?
            .into_iter()
            .find(|(q, _)| *q == f.queue)
        {
            f.new_leader = r.leader;
        }
    }
    println!(
        "cluster: {:>5.1}s {} started at {:.1}s is running again (the queue was led by {} meanwhile){}",
        f.rejoined_at_s,
        f.killed,
        f.restarted_at_s,
        f.new_leader,
        if is_done() { ", after the job ended" } else { "" }
    );
    Ok(f)
}

/// The port of the node named in a worker's "worker consuming" log line
/// (`… broker=RabbitMQ at amqp://guest:***@localhost:PORT/…`).
fn node_port(line: &str) -> Option<u16> {
    let at = line.find("@localhost:")? + "@localhost:".len();
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

fn print(r: &ClusterReport) {
    println!(
        "\ncluster run: {} rows in {} items on {} RabbitMQ nodes",
        r.rows, r.items, r.nodes
    );
    println!(
        "  fault      {} (leader of {}) killed at {:.1}s, started again at {:.1}s (running at {:.1}s); new leader {}",
        r.killed, r.queue, r.killed_at_s, r.restarted_at_s, r.rejoined_at_s, r.new_leader
    );
    println!("  replicas   {}", r.members.join(", "));
    println!(
        "  workers    {} on the killed node, {} went on through another node; {} exited on their own",
        r.workers_on_killed_node, r.workers_moved, r.workers_exited_on_their_own
    );
    println!(
        "  redone     {} item deliveries beyond one per item; {} dead-lettered",
        r.items_redelivered, r.dead_lettered
    );
    println!(
        "  wall time  {:.1}s with the failover vs {:.1}s without (×{:.2}); the job itself {:.1}s vs {:.1}s (×{:.2})",
        r.failover_s,
        r.baseline_s,
        r.failover_s / r.baseline_s.max(1e-9),
        r.failover_job_s,
        r.baseline_job_s,
        r.failover_job_s / r.baseline_job_s.max(1e-9)
    );
    if r.control_items > 0 {
        println!(
            "  control    {} one-row items at {:.0} items/s; RabbitMQ CPU per item on each node {} ms (sum {:.3} ms)",
            r.control_items,
            r.control_items_per_s,
            r.control_node_ms
                .iter()
                .map(|m| format!("{m:.3}"))
                .collect::<Vec<_>>()
                .join(" / "),
            r.control_node_ms.iter().sum::<f64>()
        );
    }
    fault::print_verdict(
        "  ",
        &r.violations,
        "invariants INV-ROWS, INV-ACCT, INV-FILES hold; nothing dead-lettered",
    );
}
