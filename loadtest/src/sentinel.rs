//! `batchfleet-loadtest redis-failover`: jobs whose Redis is a primary, a
//! replica and three Sentinels of the run's own (loopback ports, nothing on
//! disk), with the primary failing under them.
//!
//! Three runs of the same job, every worker and the coordinator finding
//! the primary through the Sentinels (their `--redis-url` names a port
//! nothing listens on, so only the Sentinels can lead them to Redis):
//! - **baseline**: no fault, for the wall-time comparison;
//! - **kill**: the primary killed (`kill -9`) at 30% of the baseline's
//!   time; the Sentinels promote the replica; the old primary is started
//!   again (empty) and made a replica of the new one;
//! - **lost writes**: replication to the replica paused (its replication
//!   user switched off on the primary and its link cut), items committed on
//!   the primary only, then a failover (`SENTINEL FAILOVER`) to the replica
//!   that missed them: the new primary has lost those commits, which the
//!   coordinator must find in the output files and record again.
//!
//! Each run checks every row exactly once and equal to PyTorch's
//! (INV-ROWS), the job's counts and files (INV-ACCT, INV-FILES), nothing
//! dead-lettered and no worker exiting on its own; the lost-writes run also
//! that writes were lost and recovered from the files.

use crate::chaos::Fleet;
use crate::fault;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::nodes::RedisNode;
use batchfleet_testkit::services;
use std::path::Path;
use std::time::{Duration, Instant};

/// The name the Sentinels monitor the primary under.
const MASTER: &str = "bfprimary";
/// The replication user, which the lost-writes run switches off.
const REPL_USER: &str = "bfrepl";
const REPL_PASSWORD: &str = "bfrepl-secret";

/// Settings of a run.
#[derive(Debug, Clone, clap::Args)]
pub struct SentinelConfig {
    /// Rows in each job.
    #[arg(long, default_value_t = 100_000)]
    pub rows: u64,
    /// Workers, item size, time limit, work folder.
    #[command(flatten)]
    pub job: fault::FaultJobArgs,
    /// Mini-batch size and delay.
    #[command(flatten)]
    pub pace: fault::PaceArgs,
}

/// What one run with a fault measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FaultRun {
    /// Wall time of the coordinator process (s).
    pub wall_s: f64,
    /// The job's own duration, from its summary (s).
    pub job_s: f64,
    /// The primary's port before the fault, and after the failover.
    pub primary_before: u16,
    pub primary_after: u16,
    /// When the fault began (s into the job).
    pub fault_at_s: f64,
    /// From the fault until the Sentinels named the new primary (s).
    pub failover_s: f64,
    /// Items committed on the old primary but absent from the replica when
    /// it was promoted (lost-writes run; a lower bound: commits may still
    /// have reached the old primary until it was demoted).
    pub commits_lost: u64,
    /// Items the coordinator found in the output files but not in Redis,
    /// and recorded again (from its log).
    pub commits_recovered: u64,
    /// Item deliveries beyond one per item.
    pub items_redelivered: u64,
    /// Rows through the model beyond the job's rows (work done twice).
    pub rows_recomputed: u64,
    /// Messages in the pool's dead-letter queue at the end.
    pub dead_lettered: u64,
    /// Worker processes that exited without being stopped.
    pub workers_exited_on_their_own: u32,
}

/// The figures of the three runs.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SentinelReport {
    /// Rows in each job.
    pub rows: u64,
    /// Items in each job.
    pub items: u64,
    /// Wall time of the fault-free job (s), and its own duration.
    pub baseline_s: f64,
    pub baseline_job_s: f64,
    /// The primary killed.
    pub kill: FaultRun,
    /// Replication paused, then a failover to the replica.
    pub lost_writes: FaultRun,
    /// Invariant violations found (empty: all hold).
    pub violations: Vec<String>,
}

/// The primary, its replica and the Sentinels.
struct Topology {
    servers: Vec<RedisNode>,
    sentinels: Vec<RedisNode>,
}

impl Topology {
    fn start(dir: &Path) -> Result<Self> {
        let auth = ["--masteruser", REPL_USER, "--masterauth", REPL_PASSWORD];
        let primary = RedisNode::server(&dir.join("redis-0"), &auth)?;
        let port = primary.port.to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &port];
        replica_args.extend(auth);
        let replica = RedisNode::server(&dir.join("redis-1"), &replica_args)?;
        let servers = vec![primary, replica];
        for s in &servers {
            add_repl_user(s)?;
        }
        let sentinels = (0..3)
            .map(|i| {
                RedisNode::sentinel(
                    &dir.join(format!("sentinel-{i}")),
                    MASTER,
                    servers[0].port,
                    Duration::from_millis(3000),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let t = Self { servers, sentinels };
        t.wait_healthy(Duration::from_secs(60))?;
        Ok(t)
    }

    /// `host:port` of every Sentinel, comma-separated.
    fn sentinel_list(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The primary's port as the first Sentinel that answers names it.
    fn primary_port(&self) -> Result<u16> {
        for s in &self.sentinels {
            if let Ok(out) = s.cli(&["SENTINEL", "get-master-addr-by-name", MASTER]) {
                if let Some(port) = out.lines().nth(1).and_then(|p| p.trim().parse().ok()) {
                    return Ok(port);
                }
            }
        }
        bail!("no Sentinel names the primary {MASTER}")
    }

    fn server(&mut self, port: u16) -> Result<&mut RedisNode> {
        self.servers
            .iter_mut()
            .find(|s| s.port == port)
            .with_context(|| format!("no server of the run on port {port}"))
    }

    /// Until every Sentinel names the same primary, knows the other two
    /// Sentinels and one replica, and the replica is in sync.
    fn wait_healthy(&self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        // Sentinels gossip every 2 s and announce nothing to a client: poll.
        while Instant::now() < deadline {
            match self.health() {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        bail!("the Redis primary, replica and Sentinels did not settle within {within:?}: {last}")
    }

    fn health(&self) -> Result<()> {
        let mut primaries = Vec::new();
        for s in &self.sentinels {
            let out = s.cli(&["SENTINEL", "get-master-addr-by-name", MASTER])?;
            primaries.push(out.lines().nth(1).unwrap_or_default().to_owned());
            let master = s.cli(&["SENTINEL", "master", MASTER])?;
            let field = |name: &str| -> String {
                let lines: Vec<&str> = master.lines().collect();
                lines
                    .iter()
                    .position(|l| *l == name)
                    .and_then(|i| lines.get(i + 1))
                    .map(|v| (*v).to_owned())
                    .unwrap_or_default()
            };
            if field("num-other-sentinels") != "2" || field("num-slaves") != "1" {
                bail!(
                    "Sentinel {} sees {} other Sentinels and {} replicas",
                    s.port,
                    field("num-other-sentinels"),
                    field("num-slaves")
                );
            }
            if field("flags") != "master" {
                bail!("Sentinel {} flags the primary {}", s.port, field("flags"));
            }
        }
        primaries.dedup();
        let [primary] = primaries.as_slice() else {
            bail!("the Sentinels disagree on the primary: {primaries:?}");
        };
        let port: u16 = primary.parse().context("primary port")?;
        let info = self
            .servers
            .iter()
            .find(|s| s.port == port)
            .context("the primary is not a server of the run")?
            .cli(&["INFO", "replication"])?;
        if !info
            .lines()
            .any(|l| l.starts_with("slave0:") && l.contains("state=online"))
        {
            bail!("the replica is not in sync yet");
        }
        Ok(())
    }
}

/// The replication user on a server (ACLs are not replicated, and a
/// restarted server keeps nothing).
fn add_repl_user(server: &RedisNode) -> Result<()> {
    server.cli(&[
        "ACL",
        "SETUSER",
        REPL_USER,
        "on",
        &format!(">{REPL_PASSWORD}"),
        "+@all",
        "~*",
        "&*",
    ])?;
    Ok(())
}

/// A job's `items_done` on one server (0 when it has no record there).
fn items_done(server: &RedisNode, prefix: &str, job: &str) -> u64 {
    let key = batchfleet_shared::store::redis::job_scoped(prefix, job, "");
    server
        .cli(&["HGET", &key, "items_done"])
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The id of the one job whose id starts with `stem` under `prefix` on a
/// server.
fn job_id(server: &RedisNode, prefix: &str, stem: &str) -> Result<String> {
    let pattern = batchfleet_shared::store::redis::job_keys_pattern(prefix, stem);
    let keys = server.cli(&["--scan", "--pattern", &pattern])?;
    let ids: Vec<&str> = keys
        .lines()
        .filter_map(|k| batchfleet_shared::store::redis::job_of_key(prefix, k))
        .filter_map(|(id, record)| record.then_some(id))
        .collect();
    match ids.as_slice() {
        [id] => Ok((*id).to_owned()),
        other => bail!("expected one job {stem}* under {prefix}, found {other:?}"),
    }
}

/// Runs the three jobs; prints and returns the figures.
pub fn run(cfg: &SentinelConfig) -> Result<SentinelReport> {
    services::ensure_local()?;
    let worker_bin = fault::sibling("batchfleet-worker")?;
    let coordinator = fault::sibling("batchfleet")?;
    let (root, _tmp) = fault::work_dir(cfg.job.dir.as_deref())?;
    let pool = services::unique("sentinel");
    let prefix = services::unique("bfsentinel");
    println!("redis-failover: starting a Redis primary, a replica and three Sentinels");
    let started = Instant::now();
    let mut topo = Topology::start(&root.join("redis"))?;
    println!(
        "redis-failover: primary on {}, replica in sync, Sentinels {} agree after {:.0}s",
        topo.primary_port()?,
        topo.sentinel_list(),
        started.elapsed().as_secs_f64()
    );
    let mut report = SentinelReport {
        rows: cfg.rows,
        items: cfg.rows.div_ceil(cfg.job.item_rows),
        ..SentinelReport::default()
    };
    let outcome = run_jobs(
        cfg,
        &mut topo,
        &root,
        &pool,
        &prefix,
        &worker_bin,
        &coordinator,
        &mut report,
    );
    services::delete_pool_queues(&pool);
    drop(topo);
    outcome?;
    print(&report);
    fault::keep_report(
        cfg.job.dir.as_deref(),
        &root,
        "redis-failover.json",
        &report,
    )?;
    Ok(report)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Kill,
    LostWrites,
}

/// The invariants of run `name`'s job in `dir` (INV-ROWS, INV-ACCT,
/// INV-FILES, nothing dead-lettered, no worker exited on its own), its
/// figures read from its summary and the coordinator's log.
fn check_run(
    cfg: &SentinelConfig,
    dir: &Path,
    pool: &str,
    name: &str,
    run: &mut FaultRun,
    v: &mut Vec<String>,
) -> Result<()> {
    let before = v.len();
    let summary = fault::job_invariants(dir, cfg.rows, v)?;
    for msg in v.iter_mut().skip(before) {
        *msg = format!("{name}: {msg}");
    }
    run.job_s = fault::job_seconds(&summary);
    let num = |k: &str| fault::summary_u64(&summary, k);
    run.items_redelivered = num("deliveries").saturating_sub(num("items_total"));
    run.rows_recomputed = num("rows_computed").saturating_sub(num("rows_total"));
    let dead = batchfleet_shared::broker::PoolQueues::new(pool).dead();
    for (queue, ready) in fault::queue_depths(&services::amqp(), pool)? {
        if queue == dead {
            run.dead_lettered = ready.into();
        }
    }
    run.commits_recovered = recovered_in_log(&dir.join("coordinator.log"));
    if run.dead_lettered > 0 {
        v.push(format!(
            "{name}: {} item(s) dead-lettered",
            run.dead_lettered
        ));
    }
    if run.workers_exited_on_their_own > 0 {
        v.push(format!(
            "{name}: {} worker(s) exited on their own",
            run.workers_exited_on_their_own
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_jobs(
    cfg: &SentinelConfig,
    topo: &mut Topology,
    root: &Path,
    pool: &str,
    prefix: &str,
    worker_bin: &Path,
    coordinator: &Path,
    report: &mut SentinelReport,
) -> Result<()> {
    for (name, fault) in [
        ("baseline", Fault::None),
        ("kill", Fault::Kill),
        ("lost-writes", Fault::LostWrites),
    ] {
        let dir = root.join(name);
        fault::fault_job(
            &dir,
            name,
            pool,
            cfg.rows,
            cfg.job.item_rows,
            cfg.pace.batch_size,
            2,
        )?;
        // Only the Sentinels know where Redis is: nothing listens on port 1.
        let redis_args = [
            "--redis-url".to_owned(),
            "redis://127.0.0.1:1/".to_owned(),
            "--redis-sentinel".to_owned(),
            topo.sentinel_list(),
            "--redis-master".to_owned(),
            MASTER.to_owned(),
        ];
        let mut args = fault::fault_worker_args("2m", cfg.pace.batch_delay, root);
        args.extend(redis_args.iter().cloned());
        let mut fleet = Fleet::new(worker_bin.to_owned(), root.to_owned(), pool, prefix, args);
        println!(
            "redis-failover: {name} run, {} rows, {} workers",
            cfg.rows, cfg.job.workers
        );
        fleet.start(cfg.job.workers)?;
        let started = Instant::now();
        let coordinator_args: Vec<String> = ["--redis-prefix", prefix]
            .into_iter()
            .map(str::to_owned)
            .chain(redis_args.iter().cloned())
            .chain(
                ["run", "job.toml", "--no-progress", "--orphan-grace", "3s"]
                    .into_iter()
                    .map(str::to_owned),
            )
            .collect();
        let mut c =
            fault::spawn_coordinator(coordinator, &dir, &coordinator_args, "coordinator.log")?;
        let done = std::sync::atomic::AtomicBool::new(false);
        let baseline_s = report.baseline_s;
        let (finished, wall_s, faults) = std::thread::scope(|s| {
            let faults = s.spawn(|| match fault {
                Fault::None => Ok(FaultRun::default()),
                Fault::Kill => kill_primary(topo, baseline_s, started, &done),
                Fault::LostWrites => lose_writes(topo, prefix, baseline_s, started, &done),
            });
            let finished = fault::wait_or_kill(&mut c, cfg.job.timeout);
            let wall_s = started.elapsed().as_secs_f64();
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            (finished, wall_s, faults.join())
        });
        let mut run = match faults {
            Ok(Ok(run)) => run,
            Ok(Err(e)) => {
                fleet.stop();
                return Err(e.context(format!("the {name} run's fault")));
            }
            Err(_) => {
                fleet.stop();
                bail!("the fault thread panicked");
            }
        };
        run.wall_s = wall_s;
        for w in &mut fleet.workers {
            if w.try_wait()?.is_some() {
                run.workers_exited_on_their_own += 1;
            }
        }
        fleet.stop();
        match finished {
            Some(true) => {}
            Some(false) => bail!(
                "the {name} job failed; see {}",
                dir.join("coordinator.log").display()
            ),
            None => bail!("the {name} job did not finish within {:?}", cfg.job.timeout),
        }
        check_run(cfg, &dir, pool, name, &mut run, &mut report.violations)?;
        let v = &mut report.violations;
        match fault {
            Fault::None => {
                report.baseline_s = run.wall_s;
                report.baseline_job_s = run.job_s;
            }
            Fault::Kill | Fault::LostWrites => {
                if run.primary_after == 0 || run.primary_after == run.primary_before {
                    v.push(format!(
                        "{name}: the job ended before the primary failed over; give it more rows or a longer --batch-delay"
                    ));
                }
                if fault == Fault::LostWrites {
                    if run.commits_lost == 0 {
                        v.push(
                            "lost-writes: the promoted replica had every commit; no write was lost"
                                .into(),
                        );
                    }
                    if run.commits_recovered < run.commits_lost {
                        v.push(format!(
                            "lost-writes: {} commit(s) were lost but {} recovered from the files",
                            run.commits_lost, run.commits_recovered
                        ));
                    }
                }
                // Whole again for the next run: the old primary a replica.
                topo.wait_healthy(Duration::from_secs(60))?;
                if fault == Fault::Kill {
                    report.kill = run;
                } else {
                    report.lost_writes = run;
                }
            }
        }
        println!("redis-failover: {name} run took {wall_s:.1}s");
    }
    Ok(())
}

/// Polls the Sentinels until they name a primary other than `old`.
fn await_new_primary(topo: &Topology, old: u16, within: Duration) -> Result<u16> {
    let deadline = Instant::now() + within;
    // Sentinels publish +switch-master on a channel; polling is simpler here.
    while Instant::now() < deadline {
        if let Ok(port) = topo.primary_port() {
            if port != old {
                return Ok(port);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("the Sentinels did not promote a new primary within {within:?}")
}

/// Kills the primary at 30% of the baseline's time, waits for the
/// Sentinels to promote the replica, then starts the old primary again,
/// empty, as a replica of the new one.
fn kill_primary(
    topo: &mut Topology,
    baseline_s: f64,
    started: Instant,
    done: &std::sync::atomic::AtomicBool,
) -> Result<FaultRun> {
    let mut run = FaultRun::default();
    if !fault::wait_until(0.3 * baseline_s, started, done) {
        return Ok(run);
    }
    run.primary_before = topo.primary_port()?;
    topo.server(run.primary_before)?.kill();
    run.fault_at_s = started.elapsed().as_secs_f64();
    println!(
        "redis-failover: {:>5.1}s killed the primary on {} (-9)",
        run.fault_at_s, run.primary_before
    );
    run.primary_after = await_new_primary(topo, run.primary_before, Duration::from_secs(60))?;
    run.failover_s = started.elapsed().as_secs_f64() - run.fault_at_s;
    println!(
        "redis-failover: {:>5.1}s the Sentinels promoted {}",
        started.elapsed().as_secs_f64(),
        run.primary_after
    );
    let new = run.primary_after;
    let old = topo.server(run.primary_before)?;
    old.restart_as_replica_of(new)?;
    add_repl_user(old)?;
    println!(
        "redis-failover: {:>5.1}s started {} again, empty, as a replica of the new primary",
        started.elapsed().as_secs_f64(),
        run.primary_before
    );
    Ok(run)
}

/// At 30% of the baseline's time: cuts replication (the replication user
/// switched off on the primary, the replica's link killed), lets at least
/// three items commit on the primary alone, then fails over to the replica
/// that missed them (`SENTINEL FAILOVER`).
fn lose_writes(
    topo: &mut Topology,
    prefix: &str,
    baseline_s: f64,
    started: Instant,
    done: &std::sync::atomic::AtomicBool,
) -> Result<FaultRun> {
    let mut run = FaultRun::default();
    if !fault::wait_until(0.3 * baseline_s, started, done) {
        return Ok(run);
    }
    run.primary_before = topo.primary_port()?;
    let replica_port = topo
        .servers
        .iter()
        .map(|s| s.port)
        .find(|p| *p != run.primary_before)
        .context("no replica")?;
    let primary = topo
        .servers
        .iter()
        .find(|s| s.port == run.primary_before)
        .context("no primary")?;
    let replica = topo
        .servers
        .iter()
        .find(|s| s.port == replica_port)
        .context("no replica")?;
    let job = job_id(primary, prefix, "lost-writes-")?;
    primary.cli(&["ACL", "SETUSER", REPL_USER, "off"])?;
    // Best effort: switching the user off may have cut the link already.
    let _ = primary.cli(&["CLIENT", "KILL", "USER", REPL_USER]);
    run.fault_at_s = started.elapsed().as_secs_f64();
    let at_cut = items_done(primary, prefix, &job);
    println!(
        "redis-failover: {:>5.1}s replication to {replica_port} cut at {at_cut} items done",
        run.fault_at_s
    );
    // Commits the replica will never see.
    let deadline = Instant::now() + Duration::from_secs(5);
    while items_done(primary, prefix, &job) < at_cut + 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let on_primary = items_done(primary, prefix, &job);
    let on_replica = items_done(replica, prefix, &job);
    run.commits_lost = on_primary.saturating_sub(on_replica);
    topo.sentinels[0].cli(&["SENTINEL", "FAILOVER", MASTER])?;
    println!(
        "redis-failover: {:>5.1}s failing over to {replica_port}: {on_primary} items done on the primary, {on_replica} on the replica",
        started.elapsed().as_secs_f64()
    );
    run.primary_after = await_new_primary(topo, run.primary_before, Duration::from_secs(60))?;
    run.failover_s = started.elapsed().as_secs_f64() - run.fault_at_s;
    // The old primary, now a replica, may take the user back.
    topo.server(run.primary_before)?
        .cli(&["ACL", "SETUSER", REPL_USER, "on"])?;
    println!(
        "redis-failover: {:>5.1}s the Sentinels promoted {}",
        started.elapsed().as_secs_f64(),
        run.primary_after
    );
    Ok(run)
}

/// Items the coordinator says it recorded again from their part files.
fn recovered_in_log(log: &Path) -> u64 {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains("items committed in the output folder but unknown to Redis"))
        .filter_map(|l| {
            let list = l.split("items=[").nth(1)?.split(']').next()?;
            Some(list.split(',').filter(|s| !s.trim().is_empty()).count() as u64)
        })
        .sum()
}

fn print(r: &SentinelReport) {
    println!(
        "\nredis-failover run: {} rows in {} items, Redis primary + replica + 3 Sentinels",
        r.rows, r.items
    );
    for (name, f) in [("kill", &r.kill), ("lost-writes", &r.lost_writes)] {
        println!(
            "  {name:<11} primary {} -> {} ({:.1}s after the fault at {:.1}s); {} commit(s) lost, {} recovered from files; {} deliveries and {} rows redone; {} dead-lettered",
            f.primary_before,
            f.primary_after,
            f.failover_s,
            f.fault_at_s,
            f.commits_lost,
            f.commits_recovered,
            f.items_redelivered,
            f.rows_recomputed,
            f.dead_lettered
        );
        println!(
            "  {:<11} wall time {:.1}s vs {:.1}s without (×{:.2}); the job itself {:.1}s vs {:.1}s",
            "",
            f.wall_s,
            r.baseline_s,
            f.wall_s / r.baseline_s.max(1e-9),
            f.job_s,
            r.baseline_job_s
        );
    }
    fault::print_verdict(
        "  ",
        &r.violations,
        "invariants INV-ROWS, INV-ACCT, INV-FILES hold in every run; nothing dead-lettered",
    );
}
