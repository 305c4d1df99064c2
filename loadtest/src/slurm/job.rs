//! The Slurm run's job and what it meets while it runs, phase by phase:
//! the site installed as an operator would (binaries, secrets as files, one
//! environment file), the GPU workers and the coordinator submitted, a
//! time limit cut, a preemption by signal, the fleet grown by a second
//! array, a worker killed (SIGKILL) and restarted in place, a preemption by
//! Slurm for a higher-priority job, and the job's
//! end as Slurm, `batchfleet status` and `sacct` record it.

use super::check::{consuming, consuming_runs, count_parts, cpu_worker_log, log_time};
use super::cluster::{is_running, wait_for, Slurm};
use super::{SlurmConfig, SlurmReport};
use crate::fault;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::python::repo_root;
use batchfleet_testkit::services;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The item of the crashing-item job that kills every worker that runs it.
const CRASH_SEQ: u64 = 2;

/// Where the job runs and what its phases share.
pub(super) struct JobRun<'a> {
    cfg: &'a SlurmConfig,
    slurm: &'a Slurm,
    root: &'a Path,
    /// The job's folder (its data, manifest and `out/`).
    pub(super) job_dir: PathBuf,
    /// The task scripts' and workers' logs.
    pub(super) logs: PathBuf,
    templates: PathBuf,
    /// What the environment file sets (the commands' settings).
    env: Vec<(&'static str, String)>,
    /// The two GPU worker tasks.
    pub(super) tasks: [String; 2],
    /// The coordinator's Slurm job.
    coordinator: String,
    /// The second array that grows the fleet.
    scale: String,
}

impl<'a> JobRun<'a> {
    /// Installs the site under `root` and generates the job.
    pub(super) fn install(
        cfg: &'a SlurmConfig,
        slurm: &'a Slurm,
        root: &'a Path,
        pool: &str,
        prefix: &str,
        (worker_bin, coordinator_bin): (&Path, &Path),
    ) -> Result<Self> {
        let job_dir = root.join("job");
        fault::fault_job(
            &job_dir,
            "slurm",
            pool,
            cfg.rows,
            cfg.item_rows,
            cfg.batch_size,
            2,
        )?;
        // What a site installs on its shared file system: the binaries and the
        // task script in one bin/, the secrets as files, one environment file.
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin)?;
        let templates = repo_root().join("docker/slurm");
        for (name, target) in [
            ("batchfleet", coordinator_bin.to_owned()),
            ("batchfleet-worker", worker_bin.to_owned()),
            (
                "batchfleet-slurm-task",
                templates.join("batchfleet-slurm-task"),
            ),
        ] {
            let link = bin.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&target, &link)?;
        }
        let secrets = root.join("secrets");
        std::fs::create_dir_all(&secrets)?;
        let secret = |name: &str, value: &str| -> Result<PathBuf> {
            use std::os::unix::fs::PermissionsExt;
            let path = secrets.join(name);
            std::fs::write(&path, value)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400))?;
            Ok(path)
        };
        let amqp = secret("amqp-url", services::amqp().url.expose())?;
        let redis = secret("redis-url", "redis://127.0.0.1:6379/")?;
        let key = secret("signing-key", fault::FAULT_KEY)?;
        let env = vec![
            ("BATCHFLEET_BIN", bin.display().to_string()),
            ("BATCHFLEET_DATA_ROOT", root.display().to_string()),
            ("BATCHFLEET_AMQP_URL_FILE", amqp.display().to_string()),
            ("BATCHFLEET_REDIS_URL_FILE", redis.display().to_string()),
            ("BATCHFLEET_SIGNING_KEY_FILE", key.display().to_string()),
            ("BATCHFLEET_POOL", pool.to_owned()),
            ("BATCHFLEET_REDIS_PREFIX", prefix.to_owned()),
            // A fault run's worker settings (fault::fault_worker_args).
            ("BATCHFLEET_PREFETCH", "1".to_owned()),
            ("BATCHFLEET_HEARTBEAT", "1s".to_owned()),
            ("BATCHFLEET_LEASE_TTL", "6s".to_owned()),
            ("BATCHFLEET_OUTAGE_TIMEOUT", "2m".to_owned()),
            (
                "BATCHFLEET_DEBUG_BATCH_DELAY",
                format!("{}ms", cfg.batch_delay.as_millis()),
            ),
        ];
        let env_text: String = env.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        std::fs::write(root.join("batchfleet.env"), env_text)?;
        let logs = root.join("logs");
        std::fs::create_dir_all(&logs)?;
        Ok(Self {
            cfg,
            slurm,
            root,
            job_dir,
            logs,
            templates,
            env,
            tasks: Default::default(),
            coordinator: String::new(),
            scale: String::new(),
        })
    }

    /// Runs every phase to the job's end, recording what it saw.
    pub(super) fn run(&mut self, coordinator_bin: &Path, report: &mut SlurmReport) -> Result<()> {
        let job_started = self.submit(report)?;
        let (cut, cut_at) = self.cut_time_limit(report)?;
        self.preempt_by_signal(report)?;
        self.grow(report)?;
        self.crash_a_worker(report)?;
        self.time_limited_back(cut, cut_at, report)?;
        self.preempt_by_priority(report)?;
        self.end(job_started, report)?;
        self.status(coordinator_bin, report)?;
        self.slurm.run("scancel", &[&self.scale])?;
        if self.slurm.dbd.is_some() {
            self.accounting(report)?;
        }
        for t in [format!("{}_0", self.scale), format!("{}_1", self.scale)] {
            self.slurm.wait_gone(&t, Duration::from_secs(60))?;
        }
        self.crashing_item(coordinator_bin, report)
    }

    /// A job of its own, on a pool of its own, whose item [`CRASH_SEQ`]
    /// kills every worker that runs it (`--debug-panic abort:2`: the worker
    /// aborts, exit 134), through a two-task array of `worker-cpu.sbatch`:
    /// the task script restarts each dead worker in its allocation, the item
    /// is recorded failed (class `crash`) once `max_crashes` (2) workers
    /// died holding it, and the job ends without it while both tasks still
    /// run. (When the task script restarted only on exit 75, each crash
    /// ended its task FAILED, and an item that kills its worker emptied an
    /// array smaller than the queue's delivery limit: the job hung.)
    fn crashing_item(&self, coordinator_bin: &Path, report: &mut SlurmReport) -> Result<()> {
        let dir = self.root.join("crashjob");
        let pool = services::unique("slurmcrash");
        let rows = 1_000;
        fault::fault_job(&dir, "slurmcrash", &pool, rows, 100, 50, 2)?;
        let mut env: Vec<(&str, String)> = self
            .env
            .iter()
            .map(|(k, v)| match *k {
                "BATCHFLEET_POOL" => (*k, pool.clone()),
                "BATCHFLEET_DEBUG_BATCH_DELAY" => (*k, "50ms".to_owned()),
                _ => (*k, v.clone()),
            })
            .collect();
        env.push(("BATCHFLEET_DEBUG_PANIC", format!("abort:{CRASH_SEQ}")));
        // Logs of their own: the first job's checks read every log in logs/.
        let logs = self.root.join("crashlogs");
        std::fs::create_dir_all(&logs)?;
        env.push(("BATCHFLEET_SLURM_LOGS", logs.display().to_string()));
        let env_file = self.root.join("crash.env");
        let env_text: String = env.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        std::fs::write(&env_file, env_text)?;
        let array = self.sbatch(&[
            "--array=0-1",
            "--cpus-per-task=1",
            &format!("--output={}/%x-%A_%a.out", logs.display()),
            &format!("--export=ALL,BATCHFLEET_SLURM_ENV={}", env_file.display()),
            &self.template("worker-cpu.sbatch")?,
        ])?;
        report.crash_job = array.clone();
        let tasks = [format!("{array}_0"), format!("{array}_1")];
        for t in &tasks {
            self.slurm
                .wait_state(t, "RUNNING", Duration::from_secs(60))?;
        }
        wait_for(Duration::from_secs(60), || {
            Ok(tasks.iter().all(|t| consuming_runs(&logs, t) >= 1))
        })
        .context("the crashing job's workers never consumed")?;
        println!(
            "slurm: crashing-item job's workers {array} (worker-cpu.sbatch, 2 tasks) consuming"
        );
        let log = std::fs::File::create(dir.join("coordinator.log"))?;
        let mut run = Command::new(coordinator_bin)
            .args(["run", "job.toml", "--no-progress"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .current_dir(&dir)
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .context("starting the crashing job's coordinator")?;
        let deadline = Instant::now() + Duration::from_secs(300);
        let exit = loop {
            if let Some(status) = run.try_wait()? {
                break status.code();
            }
            if Instant::now() > deadline {
                let _ = run.kill();
                let _ = run.wait();
                report.violations.push(format!(
                    "crashing item: the job did not end within 5 minutes; see {}",
                    dir.join("coordinator.log").display()
                ));
                break None;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        report.crash_job_exit = exit;
        for t in &tasks {
            let state = self
                .slurm
                .job(t)?
                .get("JobState")
                .cloned()
                .unwrap_or_default();
            if state != "RUNNING" {
                report.violations.push(format!(
                    "crashing item: task {t} is {state} once the job ended; RUNNING expected (its crashed workers restarted in place)"
                ));
            }
            report.crash_task_states.push(format!("{t} {state}"));
        }
        let texts: Vec<String> = tasks.iter().map(|t| cpu_worker_log(&logs, t)).collect();
        report.crash_restarts = texts
            .iter()
            .flat_map(|l| l.lines())
            .filter(|l| l.contains("(a crash:"))
            .count() as u32;
        if report.crash_restarts < 2 {
            report.violations.push(format!(
                "crashing item: {} worker crashes restarted in place; at least 2 (max_crashes) expected",
                report.crash_restarts
            ));
        }
        if texts.iter().any(|l| l.contains("ending the task")) {
            report
                .violations
                .push("crashing item: a task ended on its crashes".to_owned());
        }
        let mut v = Vec::new();
        fault::crash_job_invariants(&dir, rows, CRASH_SEQ, exit, &mut v)?;
        report
            .violations
            .extend(v.into_iter().map(|e| format!("crashing item: {e}")));
        println!(
            "slurm: crashing-item job ended (exit {exit:?}): {} workers died on item {CRASH_SEQ} and were restarted in place; tasks {}",
            report.crash_restarts,
            report.crash_task_states.join(", ")
        );
        self.slurm.run("scancel", &[&array])?;
        for t in &tasks {
            self.slurm.wait_gone(t, Duration::from_secs(60))?;
        }
        services::delete_pool_queues(&pool);
        Ok(())
    }

    /// `sbatch --parsable ARGS` from the run's folder: the job id.
    fn sbatch(&self, args: &[&str]) -> Result<String> {
        let out = self
            .slurm
            .run_in(self.root, "sbatch", &[&["--parsable"], args].concat())?;
        Ok(out.trim().split(';').next().unwrap_or_default().to_owned())
    }

    fn template(&self, name: &str) -> Result<String> {
        Ok(self
            .templates
            .join(name)
            .to_str()
            .context("template path")?
            .to_owned())
    }

    /// Fails unless the coordinator's job still runs: a fault that came
    /// after the job's end tested nothing.
    fn running(&self, what: &str) -> Result<()> {
        let state = self.slurm.job(&self.coordinator)?;
        if state.get("JobState").map(String::as_str) != Some("RUNNING") {
            bail!("the job ended before {what}; give it more rows or a longer --batch-delay");
        }
        Ok(())
    }

    /// Waits until the worker of `task` consumes in its run after
    /// `restarts` requeues (or the job ended).
    fn back(&self, task: &str, restarts: u32) -> Result<()> {
        wait_for(Duration::from_secs(60), || {
            Ok(consuming(&self.logs, task, restarts) || !is_running(self.slurm, &self.coordinator))
        })
    }

    /// Part files committed so far.
    fn committed(&self) -> u64 {
        count_parts(&self.job_dir.join("out"))
    }

    /// Two GPU workers, then the coordinator once they run; when it started.
    fn submit(&mut self, report: &mut SlurmReport) -> Result<Instant> {
        let gpu = self.template("worker-gpu.sbatch")?;
        let workers = self.sbatch(&["--array=0-1", "--cpus-per-task=2", &gpu])?;
        report.worker_job = workers.clone();
        self.tasks = [format!("{workers}_0"), format!("{workers}_1")];
        println!("slurm: workers {workers} (worker-gpu.sbatch, 2 tasks)");
        for t in &self.tasks {
            self.slurm
                .wait_state(t, "RUNNING", Duration::from_secs(60))?;
        }
        let manifest = self.job_dir.join("job.toml");
        let coordinator = self.sbatch(&[
            &format!("--dependency=after:{workers}"),
            &self.template("coordinator.sbatch")?,
            manifest.to_str().context("manifest path")?,
            &workers,
        ])?;
        report.coordinator_job = coordinator.clone();
        self.coordinator = coordinator;
        self.slurm
            .wait_state(&self.coordinator, "RUNNING", Duration::from_secs(60))?;
        println!(
            "slurm: coordinator {} (coordinator.sbatch, --dependency=after:{workers}) running",
            self.coordinator
        );
        Ok(Instant::now())
    }

    /// Task 0 reaches its time limit: its limit cut to end 100–160 s from
    /// now, more than the template's 60 s signal offset plus Slurm's 30 s
    /// check interval, so the TERM comes at a check within about a minute
    /// and the drain ends well before the limit. When it was cut.
    fn cut_time_limit(&self, report: &mut SlurmReport) -> Result<(Instant, std::time::SystemTime)> {
        let limited = &self.tasks[0];
        let elapsed = self.slurm.run_seconds(limited)?;
        let minutes = (elapsed + 100).div_ceil(60);
        let cut = (Instant::now(), std::time::SystemTime::now());
        self.slurm.run(
            "scontrol",
            &[
                "update",
                &format!("JobId={limited}"),
                &format!("TimeLimit={minutes}"),
            ],
        )?;
        report.time_limited_task = limited.clone();
        println!("slurm: {limited}'s time limit cut to {minutes} min ({elapsed}s run so far)");
        Ok(cut)
    }

    /// Task 1 preempted with `scancel --signal=TERM` once a tenth of the
    /// items are in; drained, requeued, and started again.
    fn preempt_by_signal(&self, report: &mut SlurmReport) -> Result<()> {
        wait_for(self.cfg.timeout, || {
            Ok(self.committed() * 10 >= report.items || !is_running(self.slurm, &self.coordinator))
        })?;
        self.running("the preemption")?;
        let preempted = &self.tasks[1];
        report.preempted_task = preempted.clone();
        report.preempted_at_items = self.committed();
        let signalled = Instant::now();
        self.slurm.run("scancel", &["--signal=TERM", preempted])?;
        println!(
            "slurm: {preempted} preempted (scancel --signal=TERM) at {} of {} items",
            report.preempted_at_items, report.items
        );
        self.slurm
            .wait_requeued(preempted, Duration::from_secs(90))?;
        report.preempt_requeued_after_s = signalled.elapsed().as_secs_f64();
        self.slurm.start_now(preempted, &[])?;
        self.back(preempted, 1)?;
        self.running("the preempted task came back")?;
        println!(
            "slurm: {preempted} drained and was requeued {:.1}s after the signal, running again",
            report.preempt_requeued_after_s
        );
        Ok(())
    }

    /// More workers: a second array, one task at a time, then two.
    fn grow(&mut self, report: &mut SlurmReport) -> Result<()> {
        let cpu = self.template("worker-cpu.sbatch")?;
        let scale = self.sbatch(&["--array=0-1%1", "--cpus-per-task=1", &cpu])?;
        report.scale_job = scale.clone();
        self.slurm
            .wait_state(&format!("{scale}_0"), "RUNNING", Duration::from_secs(60))?;
        self.slurm.run(
            "scontrol",
            &["update", &format!("JobId={scale}"), "ArrayTaskThrottle=2"],
        )?;
        self.slurm
            .wait_state(&format!("{scale}_1"), "RUNNING", Duration::from_secs(60))?;
        self.running("the fleet grew")?;
        report.scaled_tasks_running = 2;
        println!("slurm: fleet grown by {scale} (worker-cpu.sbatch, %1 then ArrayTaskThrottle=2)");
        self.scale = scale;
        Ok(())
    }

    /// The worker of the second array's first task (worker-cpu.sbatch),
    /// consuming, killed with SIGKILL, as the kernel's OOM killer kills
    /// (a SIGSEGV sent from outside does not do: the Rust runtime's handler
    /// takes it for a stack overflow check and returns): the task script
    /// restarts it in the same
    /// allocation, the task is neither requeued nor failed, and what the
    /// worker held goes back to the queue.
    fn crash_a_worker(&self, report: &mut SlurmReport) -> Result<()> {
        let task = format!("{}_0", self.scale);
        wait_for(Duration::from_secs(60), || {
            Ok(consuming_runs(&self.logs, &task) >= 1)
        })
        .with_context(|| format!("{task}'s worker never consumed"))?;
        let pid = self.worker_pid(&task)?;
        let before = consuming_runs(&self.logs, &task);
        let crashed = Instant::now();
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        wait_for(Duration::from_secs(60), || {
            Ok(consuming_runs(&self.logs, &task) > before
                || !is_running(self.slurm, &self.coordinator))
        })?;
        self.running("the crashed worker came back")?;
        report.crashed_task = task.clone();
        report.crash_restarted_after_s = crashed.elapsed().as_secs_f64();
        println!(
            "slurm: {task}'s worker killed with SIGKILL (as the OOM killer does); restarted in the same allocation and consuming {:.1}s later",
            report.crash_restarted_after_s
        );
        Ok(())
    }

    /// The pid of the `batchfleet-worker` process of `task` (`scontrol
    /// listpids`: the node is this machine).
    fn worker_pid(&self, task: &str) -> Result<u32> {
        let job = self.slurm.job(task)?;
        let id = job.get("JobId").context("the task's JobId")?.clone();
        let mut found = None;
        wait_for(Duration::from_secs(30), || {
            let out = self.slurm.run("scontrol", &["listpids", &id])?;
            found = out
                .lines()
                .filter_map(|l| l.split_whitespace().next()?.parse::<u32>().ok())
                .find(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|c| c.trim_end() == "batchfleet-work")
                });
            Ok(found.is_some())
        })
        .with_context(|| {
            format!("no batchfleet-worker process in {task} (scontrol listpids {id})")
        })?;
        found.context("worker pid")
    }

    /// The time-limited task: signalled, drained, requeued; started again
    /// without the cut limit.
    fn time_limited_back(
        &self,
        cut: Instant,
        cut_at: std::time::SystemTime,
        report: &mut SlurmReport,
    ) -> Result<()> {
        let limited = &self.tasks[0];
        self.slurm
            .wait_requeued(limited, Duration::from_secs(180))?;
        report.time_limited_requeued_after_s = cut.elapsed().as_secs_f64();
        self.slurm.start_now(limited, &["TimeLimit=UNLIMITED"])?;
        self.back(limited, 1)?;
        self.running("the time-limited task came back")?;
        let batch_log =
            std::fs::read_to_string(self.logs.join(format!("batchfleet-worker-{limited}.out")))
                .unwrap_or_default();
        report.time_signal_after_s = batch_log
            .lines()
            .find(|l| l.contains("SIGTERM for job"))
            .and_then(log_time)
            .and_then(|at| at.duration_since(cut_at).ok())
            .map_or(-1.0, |d| d.as_secs_f64());
        println!(
            "slurm: {limited} signalled {:.0}s after its limit was cut, requeued after {:.0}s, running again",
            report.time_signal_after_s, report.time_limited_requeued_after_s
        );
        Ok(())
    }

    /// A real preemption: a job of the higher-priority partition wants a
    /// GPU while both are taken; Slurm (PreemptMode=REQUEUE) signals one
    /// GPU task, which drains, and requeues it itself.
    fn preempt_by_priority(&self, report: &mut SlurmReport) -> Result<()> {
        let urgent = self.sbatch(&[
            "--partition=urgent",
            "--gpus=1",
            "--job-name=urgent",
            "--output=logs/urgent-%j.out",
            "--wrap=echo urgent job on GPU $CUDA_VISIBLE_DEVICES",
        ])?;
        let preempted_at = Instant::now();
        let mut by_slurm = None;
        wait_for(Duration::from_secs(90), || {
            by_slurm = self
                .tasks
                .iter()
                .find(|t| self.slurm.requeued(t, 2))
                .cloned();
            Ok(by_slurm.is_some() || !is_running(self.slurm, &self.coordinator))
        })
        .with_context(|| {
            format!(
                "no GPU task was preempted for {urgent}: {:?}",
                self.tasks
                    .iter()
                    .map(|t| self.slurm.job(t).ok())
                    .collect::<Vec<_>>()
            )
        })?;
        self.running("the preemption by a higher-priority job")?;
        let by_slurm = by_slurm.context("preempted task")?;
        report.priority_preempted_task = by_slurm.clone();
        report.priority_requeued_after_s = preempted_at.elapsed().as_secs_f64();
        self.slurm.wait_gone(&urgent, Duration::from_secs(60))?;
        report.urgent_state = self
            .slurm
            .job(&urgent)?
            .get("JobState")
            .cloned()
            .unwrap_or_default();
        self.slurm.start_now(&by_slurm, &[])?;
        self.back(&by_slurm, 2)?;
        self.running("the task preempted by Slurm came back")?;
        println!(
            "slurm: {by_slurm} preempted by {urgent} (partition urgent), requeued by Slurm after {:.1}s, running again",
            report.priority_requeued_after_s
        );
        Ok(())
    }

    /// The job's end: the coordinator exits, its template cancels the
    /// workers; their states as Slurm ends them.
    fn end(&self, job_started: Instant, report: &mut SlurmReport) -> Result<()> {
        let left = self.cfg.timeout.saturating_sub(job_started.elapsed());
        self.slurm.wait_gone(&self.coordinator, left)?;
        report.job_s = job_started.elapsed().as_secs_f64();
        let c = self.slurm.job(&self.coordinator)?;
        report.coordinator_state = format!(
            "{} {}",
            c.get("JobState").cloned().unwrap_or_default(),
            c.get("ExitCode").cloned().unwrap_or_default()
        );
        for t in &self.tasks {
            self.slurm.wait_gone(t, Duration::from_secs(60))?;
            let j = self.slurm.job(t)?;
            report.worker_states.push(format!(
                "{t} {} restarts={}",
                j.get("JobState").cloned().unwrap_or_default(),
                j.get("Restarts").cloned().unwrap_or_default()
            ));
        }
        Ok(())
    }

    /// What `batchfleet status` says of the workers: each Slurm task and
    /// run by its id.
    fn status(&self, coordinator_bin: &Path, report: &mut SlurmReport) -> Result<()> {
        let owner = self
            .job_dir
            .join("out")
            .join(batchfleet_shared::output::OWNER_FILE);
        let job_id = std::fs::read_to_string(owner)?;
        let status = Command::new(coordinator_bin)
            .args(["status", job_id.trim(), "--json"])
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()?;
        let status: serde_json::Value =
            serde_json::from_slice(&status.stdout).with_context(|| {
                format!(
                    "batchfleet status: {}",
                    String::from_utf8_lossy(&status.stderr)
                )
            })?;
        for w in status["workers"].as_array().into_iter().flatten() {
            report.status_workers.push((
                w["worker"].as_str().unwrap_or_default().to_owned(),
                w["items"].as_u64().unwrap_or(0),
            ));
        }
        report.status_workers.sort();
        Ok(())
    }

    /// Slurm's own record: `sacct --duplicates` of the jobs, once it shows
    /// each job's last run (slurmctld hands records to slurmdbd as jobs
    /// end; an earlier, requeued run does not count).
    fn accounting(&self, report: &mut SlurmReport) -> Result<()> {
        report.accounting = true;
        let workers = &report.worker_job;
        let jobs = format!("{workers},{},{}", self.coordinator, self.scale);
        let mut sacct = Vec::new();
        wait_for(Duration::from_secs(60), || {
            sacct = self
                .slurm
                .run(
                    "sacct",
                    &[
                        "-j",
                        &jobs,
                        "--duplicates",
                        "--parsable2",
                        "--noheader",
                        "--format=JobID,State,ExitCode",
                    ],
                )?
                .lines()
                .map(str::to_owned)
                .collect();
            let ended = |job: &str| {
                sacct.iter().any(|l| {
                    l.starts_with(&format!("{job}|"))
                        && !l.contains("|RUNNING|")
                        && !l.contains("|PENDING|")
                        && !l.contains("|REQUEUED|")
                        && !l.contains("|PREEMPTED|")
                })
            };
            Ok(ended(&self.coordinator)
                && self.tasks.iter().all(|t| ended(t))
                && ended(&format!("{}_0", self.scale))
                && ended(&format!("{}_1", self.scale)))
        })
        .with_context(|| format!("sacct never showed the jobs' ends: {sacct:?}"))?;
        report.sacct = sacct;
        Ok(())
    }
}
