//! `batchfleet-loadtest chaos`: a real job on a fleet of worker processes
//! while workers are killed (-9 and SIGTERM, alternating) and restarted,
//! the coordinator is killed and resumed, RabbitMQ and Redis are
//! restarted, bad messages (garbage, unsigned, forged, impossible) are
//! injected into the work queue, and a second job on the same pool has its
//! model swapped for a `state_dict` after validation; then the invariants
//! are checked: the good job exactly, the swapped job failed at once (exit
//! 5), every bad message rejected, and no worker exited on its own. The
//! same job first runs once without faults, for the wall-time comparison.
//! The fleet signs its messages (a signing key for the run).
//!
//! Workers get an artificial per-batch delay (`--debug-batch-delay`), which
//! plays a heavier model so that the job lasts long enough for every fault
//! to land mid-job.

use crate::fault;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::services;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Settings of a chaos run.
#[derive(Debug, Clone, clap::Args)]
pub struct ChaosConfig {
    /// Rows in the job.
    #[arg(long, default_value_t = 200_000)]
    pub rows: u64,
    /// Worker processes.
    #[arg(long, default_value_t = 3, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub workers: usize,
    /// Kill a random worker this often.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub kill_every: Duration,
    /// Rows per work item.
    #[arg(long, default_value_t = 5_000)]
    pub item_rows: u64,
    /// Rows per mini-batch.
    #[arg(long, default_value_t = 500)]
    pub batch_size: u32,
    /// Mini-batches per checkpoint.
    #[arg(long, default_value_t = 2)]
    pub checkpoint_every: u32,
    /// Artificial delay per mini-batch on every worker (plays a heavier
    /// model, so the job lasts long enough for the faults).
    #[arg(long, default_value = "150ms", value_parser = humantime::parse_duration)]
    pub batch_delay: Duration,
    /// Fail if the job has not finished after this long.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Restart Redis empty (like one without persistence) instead of from
    /// a snapshot. This empties the whole local Redis.
    #[arg(long)]
    pub redis_wipe: bool,
    /// Keep data, logs and chaos.json here (default: a temporary folder).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The figures of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ChaosReport {
    /// Rows in the job.
    pub rows: u64,
    /// Items in the job.
    pub items: u64,
    /// Wall time of the fault-free run (s).
    pub baseline_s: f64,
    /// Wall time of the run under faults (s).
    pub chaos_s: f64,
    /// Workers killed with SIGKILL.
    pub worker_kill9: u32,
    /// Workers stopped with SIGTERM (drained).
    pub worker_sigterm: u32,
    /// SIGTERMed workers that exited 0.
    pub worker_sigterm_clean: u32,
    /// Coordinator kills (followed by `batchfleet resume`).
    pub coordinator_kills: u32,
    /// RabbitMQ restarts.
    pub rabbitmq_restarts: u32,
    /// Redis restarts.
    pub redis_restarts: u32,
    /// Bad messages injected into the work queue.
    pub bad_messages: u64,
    /// Of them, dead-lettered as `rejected`.
    pub bad_messages_rejected: u64,
    /// Exit code of the job whose model was swapped mid-run (5 expected).
    pub swapped_model_exit: Option<i32>,
    /// Worker processes that exited without being killed or stopped.
    pub workers_exited_on_their_own: u32,
    /// Items started beyond one per item (deliveries − items).
    pub items_redelivered: u64,
    /// Items the coordinator published again (stale lease, straggler, lost).
    pub items_redispatched: u64,
    /// Rows put through the model beyond the job's rows (wasted work).
    pub rows_recomputed: u64,
    /// Rows a redelivered item skipped thanks to its checkpoint.
    pub rows_resumed: u64,
    /// Redis was restarted empty: the work counters only cover the time after.
    pub redis_wiped: bool,
    /// Invariant violations found (empty: all hold).
    pub violations: Vec<String>,
}

/// Worker processes of one pool, each logging to `dir/<id>.log`.
pub(crate) struct Fleet {
    pub(crate) worker_bin: PathBuf,
    pub(crate) dir: PathBuf,
    pub(crate) pool: String,
    pub(crate) prefix: String,
    /// Arguments of every worker.
    pub(crate) args: Vec<String>,
    /// Arguments of the worker in each slot, after `args` (none for a slot
    /// past the end).
    pub(crate) slot_args: Vec<Vec<String>>,
    pub(crate) workers: Vec<Child>,
    pub(crate) spawned: u32,
    /// How worker ids start (default: [`Fleet::id`]'s `chaos-w`).
    stem: Option<String>,
}

impl Fleet {
    /// A fleet of no workers yet.
    pub(crate) fn new(
        worker_bin: PathBuf,
        dir: PathBuf,
        pool: &str,
        prefix: &str,
        args: Vec<String>,
    ) -> Self {
        Self {
            worker_bin,
            dir,
            pool: pool.to_owned(),
            prefix: prefix.to_owned(),
            args,
            slot_args: Vec::new(),
            workers: Vec::new(),
            spawned: 0,
            stem: None,
        }
    }

    /// The same fleet, its worker ids `<stem><slot>-<n>` (two fleets on one
    /// Redis prefix need ids of their own).
    pub(crate) fn named(mut self, stem: &str) -> Self {
        self.stem = Some(stem.to_owned());
        self
    }

    /// The log file of the worker `spawn` named `id`.
    pub(crate) fn log_of(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.log"))
    }

    /// The id of the `n`th worker started (from 1) in `slot`.
    pub(crate) fn id(slot: usize, n: u32) -> String {
        format!("chaos-w{slot}-{n}")
    }

    pub(crate) fn spawn(&mut self, slot: usize) -> Result<Child> {
        self.spawned += 1;
        let id = match &self.stem {
            Some(stem) => format!("{stem}{slot}-{}", self.spawned),
            None => Self::id(slot, self.spawned),
        };
        let log = std::fs::File::create(self.log_of(&id))?;
        Command::new(&self.worker_bin)
            .args([
                "--pool",
                &self.pool,
                "--redis-prefix",
                &self.prefix,
                "--worker-id",
                &id,
            ])
            .args(&self.args)
            .args(self.slot_args.get(slot).into_iter().flatten())
            .env("BATCHFLEET_SIGNING_KEY", fault::FAULT_KEY)
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {}", self.worker_bin.display()))
    }

    pub(crate) fn start(&mut self, n: usize) -> Result<()> {
        for slot in 0..n {
            let child = self.spawn(slot)?;
            self.workers.push(child);
        }
        Ok(())
    }

    /// SIGTERM every worker and wait for them.
    pub(crate) fn stop(&mut self) {
        for w in &self.workers {
            fault::signal(w, "TERM");
        }
        for w in &mut self.workers {
            fault::wait_or_kill(w, Duration::from_secs(40));
        }
        self.workers.clear();
    }
}

/// Runs the baseline and the chaos run; prints and returns the figures.
pub fn run(cfg: &ChaosConfig) -> Result<ChaosReport> {
    services::ensure_local()?;
    let worker_bin = fault::sibling("batchfleet-worker")?;
    let coordinator = fault::sibling("batchfleet")?;
    let (root, _tmp) = fault::work_dir(cfg.dir.as_deref())?;
    let pool = services::unique("chaos");
    let prefix = services::unique("bfchaos");
    let mut report = ChaosReport {
        redis_wiped: cfg.redis_wipe,
        rows: cfg.rows,
        items: cfg.rows.div_ceil(cfg.item_rows),
        ..ChaosReport::default()
    };
    let mut worker_args = fault::fault_worker_args("3m", cfg.batch_delay, &root);
    // Items of a job Redis forgot (restarted empty) wait this long for the
    // coordinator to restore it.
    worker_args.extend(["--unknown-job-grace".to_owned(), "3s".to_owned()]);

    let outcome = (|| -> Result<()> {
        // The same data twice (same seed), as two jobs.
        for name in ["baseline", "chaos", "swapped"] {
            fault::fault_job(
                &root.join(name),
                name,
                &pool,
                cfg.rows,
                cfg.item_rows,
                cfg.batch_size,
                cfg.checkpoint_every,
            )?;
        }
        // Workers killed at random are not items that kill them, but a
        // crash counter cannot tell the two apart: a long item running on
        // two workers that chaos kills -9 would be dead-lettered as `crash`
        // (docs/failures.md). The crashes are still counted, and an item
        // with one still runs alone; none is given up.
        for name in ["baseline", "chaos", "swapped"] {
            let manifest = root.join(name).join("job.toml");
            let text = std::fs::read_to_string(&manifest)?;
            std::fs::write(&manifest, format!("{text}\n[failure]\nmax_crashes = 0\n"))?;
        }
        // The second job's model is swapped for a state_dict once it is published.
        batchfleet_testkit::python::make_wrong_models(&root.join("swapped"))?;
        let coordinator_cmd = |dir: &Path, args: &[&str], log: &str| {
            chaos_coordinator(&coordinator, &prefix, dir, args, log)
        };
        let mut fleet = Fleet::new(
            worker_bin.clone(),
            root.clone(),
            &pool,
            &prefix,
            worker_args.clone(),
        );

        // Baseline: no faults.
        let shape = (cfg.rows, cfg.workers, cfg.timeout);
        report.baseline_s = baseline("chaos", shape, &mut fleet, &root, |dir, log| {
            chaos_coordinator(&coordinator, &prefix, dir, &["run", "job.toml"], log)
        })?;

        // Under faults. First a second job on the same pool, validated and
        // published, whose model file is then replaced by a state_dict: its
        // items wait in the queue ahead of the chaos job's.
        let mut swapped = publish_swapped(&coordinator, &prefix, &root.join("swapped"))?;
        let dir = root.join("chaos");
        fleet.start(cfg.workers)?;
        let started = Instant::now();
        let mut coord = coordinator_cmd(&dir, &["run", "job.toml"], "coordinator-1.log")?;
        let base = report.baseline_s;
        let mut next_kill = started + cfg.kill_every;
        let mut kill9 = true;
        let mut rng = fastrand::Rng::with_seed(u64::from(std::process::id()));
        let (mut coord_done, mut mq_done, mut redis_done) = (false, false, false);
        let mut bad_done = false;
        let finished = loop {
            if let Some(status) = coord.try_wait()? {
                break status.success();
            }
            let t = started.elapsed();
            if t > cfg.timeout {
                let _ = coord.kill();
                fleet.stop();
                bail!(
                    "the job did not finish within {:?} under faults",
                    cfg.timeout
                );
            }
            let at = |fraction: f64| t.as_secs_f64() >= base * fraction;
            if !bad_done && at(0.3) {
                bad_done = true;
                report.bad_messages = inject_bad_messages(&pool, &dir)?;
                println!(
                    "chaos: {:>5.1}s injected {} bad messages into the work queue",
                    t.as_secs_f64(),
                    report.bad_messages
                );
            } else if !coord_done && at(0.2) {
                coord_done = true;
                let _ = coord.kill();
                let _ = coord.wait();
                let job = job_id(&prefix)?;
                println!(
                    "chaos: {:>5.1}s killed the coordinator (-9); `batchfleet resume {job}`",
                    t.as_secs_f64()
                );
                coord = coordinator_cmd(&dir, &["resume", &job], "coordinator-2.log")?;
                report.coordinator_kills += 1;
            } else if !mq_done && at(0.4) {
                mq_done = true;
                println!("chaos: {:>5.1}s restarting RabbitMQ", t.as_secs_f64());
                services::restart_rabbitmq()?;
                report.rabbitmq_restarts += 1;
            } else if !redis_done && at(0.6) {
                redis_done = true;
                println!(
                    "chaos: {:>5.1}s restarting Redis ({})",
                    t.as_secs_f64(),
                    if cfg.redis_wipe {
                        "empty"
                    } else {
                        "from a snapshot"
                    }
                );
                services::restart_redis(!cfg.redis_wipe)?;
                report.redis_restarts += 1;
            } else if Instant::now() >= next_kill {
                next_kill = Instant::now() + cfg.kill_every;
                let slot = rng.usize(..fleet.workers.len());
                kill_worker(&mut fleet, slot, kill9, t, &mut report)?;
                kill9 = !kill9;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        report.chaos_s = started.elapsed().as_secs_f64();
        // The swapped job fails at once, whatever else happens.
        report.swapped_model_exit =
            match fault::wait_or_kill(&mut swapped, Duration::from_secs(120)) {
                None => None,
                Some(_) => swapped.try_wait()?.and_then(|s| s.code()),
            };
        await_bad_messages(&pool, report.bad_messages)?;
        // No worker may have exited on its own (every exit is one of ours).
        for w in &mut fleet.workers {
            if w.try_wait()?.is_some() {
                report.workers_exited_on_their_own += 1;
            }
        }
        fleet.stop();
        if !finished {
            bail!("the coordinator failed under faults; see {}", dir.display());
        }
        check(&dir, &pool, &mut report)?;
        Ok(())
    })();
    cleanup(&pool, &prefix);
    outcome?;
    print(&report);
    fault::keep_report(cfg.dir.as_deref(), &root, "chaos.json", &report)?;
    Ok(report)
}

/// The job of `root/baseline` on `workers` workers of `fleet`, no faults,
/// its coordinator started by `coordinator_cmd` (in a folder, with a log
/// file): its wall time (s). `run` names the fault run in what it prints.
pub(crate) fn baseline(
    run: &str,
    (rows, workers, timeout): (u64, usize, Duration),
    fleet: &mut Fleet,
    root: &Path,
    coordinator_cmd: impl FnOnce(&Path, &str) -> Result<Child>,
) -> Result<f64> {
    println!("{run}: baseline run, {rows} rows, {workers} workers, no faults");
    let base_dir = root.join("baseline");
    fleet.start(workers)?;
    let started = Instant::now();
    let mut c = coordinator_cmd(&base_dir, "coordinator.log")?;
    let ok = fault::wait_or_kill(&mut c, timeout);
    let took = started.elapsed().as_secs_f64();
    fleet.stop();
    if ok != Some(true) {
        bail!(
            "the baseline job failed; see {}",
            base_dir.join("coordinator.log").display()
        );
    }
    println!("{run}: baseline took {took:.1}s");
    Ok(took)
}

/// `batchfleet --redis-prefix PREFIX ARGS… --no-progress --speculate-after
/// 4` in `dir`, logging to `log` there.
fn chaos_coordinator(
    coordinator: &Path,
    prefix: &str,
    dir: &Path,
    args: &[&str],
    log: &str,
) -> Result<Child> {
    let args: Vec<String> = ["--redis-prefix", prefix]
        .into_iter()
        .chain(args.iter().copied())
        .chain(["--no-progress", "--speculate-after", "4"])
        .map(str::to_owned)
        .collect();
    fault::spawn_coordinator(coordinator, dir, &args, log)
}

/// A second job on the pool, validated and published, whose model file is
/// then replaced by a state_dict: its items wait in the queue ahead of the
/// chaos job's. Its coordinator.
fn publish_swapped(coordinator: &Path, prefix: &str, dir: &Path) -> Result<Child> {
    let mut swapped = chaos_coordinator(
        coordinator,
        prefix,
        dir,
        &["run", "job.toml"],
        "coordinator.log",
    )?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !published(prefix, "swapped-")? {
        if Instant::now() > deadline || swapped.try_wait()?.is_some() {
            bail!("the second job was not published; see {}", dir.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::copy(dir.join("state_dict.pt"), dir.join("model.pt"))?;
    println!("chaos: a second job on the pool is published; its model is now a state_dict");
    Ok(swapped)
}

/// Stops worker `slot` at `t` into the run — `kill -9`, or SIGTERM and a
/// wait for its drain — and starts another in its place.
fn kill_worker(
    fleet: &mut Fleet,
    slot: usize,
    kill9: bool,
    t: Duration,
    report: &mut ChaosReport,
) -> Result<()> {
    let w = &mut fleet.workers[slot];
    if kill9 {
        let _ = w.kill();
        let _ = w.wait();
        report.worker_kill9 += 1;
        println!(
            "chaos: {:>5.1}s worker {slot}: kill -9, restarted",
            t.as_secs_f64()
        );
    } else {
        fault::signal(w, "TERM");
        let clean = fault::wait_or_kill(w, Duration::from_secs(30)) == Some(true);
        report.worker_sigterm += 1;
        report.worker_sigterm_clean += u32::from(clean);
        println!(
            "chaos: {:>5.1}s worker {slot}: SIGTERM, {}, restarted",
            t.as_secs_f64(),
            if clean {
                "drained and exited 0"
            } else {
                "did NOT exit cleanly"
            }
        );
    }
    fleet.workers[slot] = fleet.spawn(slot)?;
    Ok(())
}

/// Bad messages queued behind the job's items are settled by the fleet
/// after it (an unknown job's after its grace): waits (up to a minute) for
/// every queue of the pool but the dead one to be empty and `bad` messages
/// in the dead one.
fn await_bad_messages(pool: &str, bad: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let dead = batchfleet_shared::broker::PoolQueues::new(pool).dead();
    while Instant::now() < deadline {
        let depths = fault::queue_depths(&services::amqp(), pool)?;
        let (dead_n, others): (u32, u32) =
            depths.iter().fold(
                (0, 0),
                |(d, o), (q, n)| {
                    if *q == dead {
                        (d + n, o)
                    } else {
                        (d, o + n)
                    }
                },
            );
        if others == 0 && u64::from(dead_n) >= bad {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Whether a job whose id starts with `stem` is registered and published
/// (status `running`) under `prefix`.
pub(crate) fn published(prefix: &str, stem: &str) -> Result<bool> {
    Ok(!running_jobs(prefix, stem)?.is_empty())
}

/// The jobs whose id starts with `stem` and whose record says `running`
/// under `prefix`.
pub(crate) fn running_jobs(prefix: &str, stem: &str) -> Result<Vec<String>> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "--scan", "--pattern"])
        .arg(batchfleet_shared::store::redis::job_keys_pattern(
            prefix, stem,
        ))
        .output()
        .context("running redis-cli")?;
    let mut running = Vec::new();
    for key in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((id, true)) = batchfleet_shared::store::redis::job_of_key(prefix, key) else {
            continue; // a job's sub-key, not its record
        };
        let status = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "hget", key, "status"])
            .output()
            .context("running redis-cli")?;
        if String::from_utf8_lossy(&status.stdout).trim() == "running" {
            running.push(id.to_owned());
        }
    }
    Ok(running)
}

/// Publishes bad messages to the pool's work queue — garbage, a real item
/// unsigned, a real item with a wrong signature, and signed items that are
/// impossible (a byte range past the end of the file, a huge row count, an
/// unknown job, another model digest) — and returns how many.
fn inject_bad_messages(pool: &str, job_dir: &Path) -> Result<u64> {
    use batchfleet_shared::broker::{Headers, Outgoing, PoolQueues};
    use batchfleet_shared::message::{Envelope, InputSlice, MESSAGE_TYPE_V2};
    let item = first_item(job_dir)?;
    let key = batchfleet_shared::signing::SigningKey::new(fault::FAULT_KEY.as_bytes(), "chaos")?;
    let raw = |body: Vec<u8>, sig: Option<String>| Outgoing {
        message_id: "chaos-bad".into(),
        kind: MESSAGE_TYPE_V2,
        body,
        headers: Headers::of(
            sig.map(|s| (batchfleet_shared::signing::SIGNATURE_HEADER, s)),
            [],
        ),
        expiration_ms: None,
    };
    let signed = |i: &batchfleet_shared::message::WorkItem| {
        let body = Envelope::V2(i.clone()).encode();
        let sig = key.sign(&body);
        raw(body, Some(sig))
    };
    let mut messages = vec![
        raw(b"\x00chaos garbage".to_vec(), None),
        raw(Envelope::V2(item.clone()).encode(), None),
        raw(
            Envelope::V2(item.clone()).encode(),
            Some(key.sign(b"not this body")),
        ),
    ];
    let mut far = item.clone();
    if let InputSlice::CsvRange(r) = &mut far.input {
        r.end = r.file_len + (1 << 20);
        r.file_len = r.end;
    }
    messages.push(signed(&far));
    let mut huge = item.clone();
    if let InputSlice::CsvRange(r) = &mut huge.input {
        r.rows = 1 << 40;
    }
    messages.push(signed(&huge));
    let mut unknown = item.clone();
    unknown.job_id = "chaos-unknown-00000000".into();
    messages.push(signed(&unknown));
    let mut digest = item.clone();
    digest.task.model.sha256 = "ab".repeat(32);
    messages.push(signed(&digest));
    let n = messages.len() as u64;
    fault::on_broker(
        &services::amqp(),
        "batchfleet-chaos-bad-messages",
        |conn| async move {
            conn.publish(&PoolQueues::new(pool).work(), messages, 16)
                .await?;
            Ok(n)
        },
    )
}

/// The first work item of the job in `dir`, planned as the coordinator plans it.
pub(crate) fn first_item(dir: &Path) -> Result<batchfleet_shared::message::WorkItem> {
    let spec = batchfleet_coordinator::manifest::load(&dir.join("job.toml"), &[])?;
    let mut plan = batchfleet_coordinator::planner::plan(&spec)?;
    if plan.items.is_empty() {
        bail!("the job in {} has no items", dir.display());
    }
    Ok(plan.items.swap_remove(0))
}

/// The id of the chaos job under `prefix` (keys `<prefix>:job:<id>[:…]`).
fn job_id(prefix: &str) -> Result<String> {
    let out = Command::new("redis-cli")
        .args([
            "-h",
            "127.0.0.1",
            "--scan",
            "--pattern",
            &batchfleet_shared::store::redis::job_keys_pattern(prefix, "chaos-"),
        ])
        .output()
        .context("running redis-cli")?;
    let keys = String::from_utf8_lossy(&out.stdout);
    let mut ids: Vec<&str> = keys
        .lines()
        .filter_map(|k| batchfleet_shared::store::redis::job_of_key(prefix, k))
        .map(|(id, _)| id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    match ids.as_slice() {
        [id] => Ok((*id).to_owned()),
        other => bail!("expected one chaos job under {prefix}, found {other:?}"),
    }
}

/// INV-ROWS, INV-ACCT and INV-FILES on the finished chaos job.
fn check(dir: &Path, pool: &str, report: &mut ChaosReport) -> Result<()> {
    let summary = fault::job_invariants(dir, report.rows, &mut report.violations)?;
    let num = |k: &str| fault::summary_u64(&summary, k);
    report.items_redelivered = num("deliveries").saturating_sub(num("items_total"));
    report.items_redispatched = num("items_redispatched");
    report.rows_recomputed = num("rows_computed").saturating_sub(num("rows_total"));
    report.rows_resumed = num("rows_resumed");
    let v = &mut report.violations;
    let dead_queue = batchfleet_shared::broker::PoolQueues::new(pool).dead();
    for (queue, ready) in fault::queue_depths(&services::amqp(), pool)? {
        if queue == dead_queue {
            report.bad_messages_rejected = ready.into();
            continue;
        }
        if ready > 0 {
            v.push(format!("INV-ACCT: {queue} still holds {ready} message(s)"));
        }
    }
    // INV-CONTAIN: every bad message rejected (and nothing else dead), the
    // swapped job failed at once, and no worker exited on its own.
    if report.bad_messages_rejected != report.bad_messages {
        v.push(format!(
            "INV-CONTAIN: {} bad messages injected but the dead queue holds {}",
            report.bad_messages, report.bad_messages_rejected
        ));
    }
    if report.swapped_model_exit != Some(5) {
        v.push(format!(
            "INV-CONTAIN: the job whose model was swapped exited {:?}, not 5 (failed at once)",
            report.swapped_model_exit
        ));
    }
    if report.workers_exited_on_their_own > 0 {
        v.push(format!(
            "INV-CONTAIN: {} worker(s) exited on their own",
            report.workers_exited_on_their_own
        ));
    }
    Ok(())
}

/// Deletes the run's queues and Redis keys.
fn cleanup(pool: &str, prefix: &str) {
    services::delete_pool_queues(pool);
    services::delete_redis_prefix(prefix);
}

fn print(r: &ChaosReport) {
    println!("\nchaos run: {} rows in {} items", r.rows, r.items);
    println!(
        "  faults     {} kill -9, {} SIGTERM ({} drained cleanly), {} coordinator kill, {} RabbitMQ restart, {} Redis restart",
        r.worker_kill9, r.worker_sigterm, r.worker_sigterm_clean, r.coordinator_kills, r.rabbitmq_restarts, r.redis_restarts
    );
    println!(
        "  redone     {} item deliveries beyond one per item, {} items published again by the coordinator",
        r.items_redelivered, r.items_redispatched
    );
    println!(
        "  rows       {} recomputed ({:.1}% of the job), {} skipped thanks to checkpoints",
        r.rows_recomputed,
        100.0 * r.rows_recomputed as f64 / r.rows.max(1) as f64,
        r.rows_resumed
    );
    if r.redis_wiped {
        println!(
            "  (Redis was restarted empty: the work counters above only cover the time after it)"
        );
    }
    println!(
        "  wall time  {:.1}s under faults vs {:.1}s without (×{:.2})",
        r.chaos_s,
        r.baseline_s,
        r.chaos_s / r.baseline_s.max(1e-9)
    );
    println!(
        "  contained  {} bad messages injected, {} rejected; the job whose model was swapped exited {}; {} worker(s) exited on their own",
        r.bad_messages,
        r.bad_messages_rejected,
        r.swapped_model_exit.map_or("-".into(), |c| c.to_string()),
        r.workers_exited_on_their_own
    );
    fault::print_verdict(
        "  ",
        &r.violations,
        "invariants INV-ROWS, INV-ACCT, INV-FILES, INV-CONTAIN hold",
    );
}
