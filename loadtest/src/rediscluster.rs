//! `batchfleet-loadtest redis-cluster`: jobs whose Redis is a Redis Cluster
//! of three masters of the run's own (loopback ports, nothing on disk,
//! joined with `redis-cli --cluster create`), every worker and the
//! coordinator given its nodes with `--redis-cluster`.
//!
//! Two jobs run one after the other. Checked for each: every row exactly
//! once and equal to PyTorch's (INV-ROWS), the counts and files (INV-ACCT,
//! INV-FILES), nothing dead-lettered; and that every key of the job sits in
//! one slot, on one master (the hash tag around its id).

use crate::chaos::Fleet;
use crate::fault;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::nodes::RedisNode;
use batchfleet_testkit::services;
use std::path::Path;
use std::time::{Duration, Instant};

/// Settings of a run.
#[derive(Debug, Clone, clap::Args)]
pub struct RedisClusterConfig {
    /// Rows in each job.
    #[arg(long, default_value_t = 100_000)]
    pub rows: u64,
    /// Workers, item size, time limit, work folder.
    #[command(flatten)]
    pub job: fault::FaultJobArgs,
}

/// What one job did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ClusterJob {
    /// Its id.
    pub job: String,
    /// The job's own duration (s).
    pub job_s: f64,
    /// The port of the master holding every key of the job.
    pub master: u16,
    /// How many keys of the job it holds.
    pub keys: usize,
}

/// The figures of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RedisClusterReport {
    /// The masters' ports.
    pub masters: Vec<u16>,
    /// Each job.
    pub jobs: Vec<ClusterJob>,
    /// Invariant violations found (empty: all hold).
    pub violations: Vec<String>,
}

/// Starts three masters and makes them one cluster.
fn start_cluster(dir: &Path) -> Result<Vec<RedisNode>> {
    let nodes = (0..3)
        .map(|i| {
            RedisNode::server(
                &dir.join(format!("redis-{i}")),
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ],
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let out = std::process::Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .context("redis-cli --cluster create")?;
    if !out.status.success() {
        bail!(
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The nodes agree on the slots a moment later: poll each.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !nodes.iter().all(|n| {
        n.cli(&["CLUSTER", "INFO"])
            .is_ok_and(|i| i.contains("cluster_state:ok"))
    }) {
        if Instant::now() > deadline {
            bail!("the cluster did not reach cluster_state:ok within 30s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(nodes)
}

/// Runs the jobs; prints and returns the figures.
pub fn run(cfg: &RedisClusterConfig) -> Result<RedisClusterReport> {
    services::ensure_local()?;
    let worker_bin = fault::sibling("batchfleet-worker")?;
    let coordinator = fault::sibling("batchfleet")?;
    let (root, _tmp) = fault::work_dir(cfg.job.dir.as_deref())?;
    let pool = services::unique("rcluster");
    let prefix = services::unique("bfrcluster");
    println!("redis-cluster: starting three Redis masters and making them a cluster");
    let nodes = start_cluster(&root.join("redis"))?;
    let mut report = RedisClusterReport {
        masters: nodes.iter().map(|n| n.port).collect(),
        ..RedisClusterReport::default()
    };
    let urls: Vec<String> = nodes.iter().map(RedisNode::url).collect();
    let redis_args = [
        "--redis-cluster".to_owned(),
        "--redis-url".to_owned(),
        urls.join(","),
    ];
    let outcome = (|| -> Result<()> {
        for name in ["first", "second"] {
            let dir = root.join(name);
            fault::fault_job(&dir, name, &pool, cfg.rows, cfg.job.item_rows, 500, 2)?;
            let mut args = fault::fault_worker_args("2m", Duration::ZERO, &root);
            args.extend(redis_args.iter().cloned());
            let mut fleet = Fleet::new(worker_bin.clone(), root.clone(), &pool, &prefix, args);
            println!(
                "redis-cluster: {name} job, {} rows, {} workers",
                cfg.rows, cfg.job.workers
            );
            fleet.start(cfg.job.workers)?;
            let coordinator_args: Vec<String> = ["--redis-prefix", &prefix]
                .into_iter()
                .map(str::to_owned)
                .chain(redis_args.iter().cloned())
                .chain(
                    ["run", "job.toml", "--no-progress"]
                        .into_iter()
                        .map(str::to_owned),
                )
                .collect();
            let mut c =
                fault::spawn_coordinator(&coordinator, &dir, &coordinator_args, "coordinator.log")?;
            let finished = fault::wait_or_kill(&mut c, cfg.job.timeout);
            fleet.stop();
            if finished != Some(true) {
                bail!(
                    "the {name} job failed on the Redis Cluster; see {}",
                    dir.join("coordinator.log").display()
                );
            }
            let v = &mut report.violations;
            let summary = fault::job_invariants(&dir, cfg.rows, v)?;
            let job = summary
                .get("job_id")
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned();
            // Where the job's keys are: one master, one slot.
            let pattern = batchfleet_shared::store::redis::job_keys_pattern(&prefix, &job);
            let mut holders = Vec::new();
            for n in &nodes {
                let keys = n.cli(&["--scan", "--pattern", &pattern])?;
                let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
                if !keys.is_empty() {
                    let slots: std::collections::BTreeSet<String> = keys
                        .iter()
                        .map(|k| n.cli(&["CLUSTER", "KEYSLOT", k]).unwrap_or_default())
                        .collect();
                    if slots.len() != 1 {
                        v.push(format!(
                            "{name}: the job's keys on {} span slots {slots:?}",
                            n.port
                        ));
                    }
                    holders.push((n.port, keys.len()));
                }
            }
            match holders.as_slice() {
                [(port, keys)] => report.jobs.push(ClusterJob {
                    job,
                    job_s: fault::job_seconds(&summary),
                    master: *port,
                    keys: *keys,
                }),
                other => v.push(format!(
                    "{name}: the job's keys are on {} masters ({other:?}), not one",
                    other.len()
                )),
            }
        }
        Ok(())
    })();
    services::delete_pool_queues(&pool);
    drop(nodes);
    outcome?;
    println!(
        "\nredis-cluster run: {} rows per job on a Redis Cluster of 3 masters ({:?})",
        cfg.rows, report.masters
    );
    for j in &report.jobs {
        println!(
            "  job {} in {:.1}s; its {} keys all in one slot on the master on {}",
            j.job, j.job_s, j.keys, j.master
        );
    }
    fault::print_verdict(
        "  ",
        &report.violations,
        "invariants INV-ROWS, INV-ACCT, INV-FILES hold for both jobs",
    );
    fault::keep_report(cfg.job.dir.as_deref(), &root, "redis-cluster.json", &report)?;
    Ok(report)
}
