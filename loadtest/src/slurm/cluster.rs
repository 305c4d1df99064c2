//! The Slurm cluster of the run's own: MUNGE, slurmctld, slurmd (and
//! slurmdbd on the local MariaDB, when it answers) as this run's processes,
//! their configuration and state in its folder; the Slurm commands the run
//! uses, and what is left after the daemons are stopped.

use crate::fault;
use anyhow::{bail, Context, Result};
use batchfleet_testkit::nodes::{free_port, wait_listening};
use batchfleet_testkit::services;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(super) fn is_running(slurm: &Slurm, job: &str) -> bool {
    slurm
        .job(job)
        .map(|j| j.get("JobState").map(String::as_str) == Some("RUNNING"))
        .unwrap_or(false)
}

/// Polls `done` every 200 ms for up to `within` (Slurm's state is polled:
/// its commands are the only way to watch it).
pub(super) fn wait_for(within: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + within;
    while !done()? {
        if Instant::now() > deadline {
            bail!("gave up after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

pub(super) fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

pub(super) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Processes of the run left running: those whose command line names
/// `root` or whose working folder is under it (the daemons, slurmstepd,
/// the task scripts and the workers), this process and its parents aside.
fn processes_under(root: &Path) -> Vec<String> {
    let needle = root.display().to_string();
    let mut ours = vec![std::process::id().to_string()];
    while let Some(parent) = std::fs::read_to_string(format!("/proc/{}/stat", ours[ours.len() - 1]))
        .ok()
        .and_then(|stat| {
            let after = stat.rsplit_once(')')?.1.to_owned();
            after.split_whitespace().nth(1).map(str::to_owned)
        })
        .filter(|p| p != "0" && !ours.contains(p))
    {
        ours.push(parent);
    }
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) || ours.contains(&pid) {
            continue;
        }
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let in_root =
            std::fs::read_link(entry.path().join("cwd")).is_ok_and(|cwd| cwd.starts_with(root));
        if !cmd.trim().is_empty() && (cmd.contains(&needle) || in_root) {
            found.push(format!("{pid}: {}", cmd.trim()));
        }
    }
    found
}

/// slurmdbd on the local MariaDB (user root, no password, a database of
/// the run's own), reached on `port`, the cluster registered in it.
fn start_dbd(
    dir: &Path,
    conf: &Path,
    socket: &Path,
    port: u16,
    log: &dyn Fn(&str) -> Result<Stdio>,
) -> Result<(Daemon, String)> {
    use std::os::unix::fs::PermissionsExt;
    let db = format!("batchfleet_slurm_{}", std::process::id());
    let d = dir.display();
    // Next to slurm.conf, private to its user: slurmdbd refuses it otherwise.
    let path = dir.join("slurmdbd.conf");
    std::fs::write(
        &path,
        format!(
            "AuthType=auth/munge
AuthInfo=socket={socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=root
StorageLoc={db}
PidFile={d}/run/slurmdbd.pid
LogFile={d}/log/slurmdbd.log
",
            socket = socket.display()
        ),
    )?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let child = Command::new("slurmdbd")
        .arg("-D")
        .env("SLURM_CONF", conf)
        .stdout(log("slurmdbd.out")?)
        .stderr(log("slurmdbd.err")?)
        .spawn()
        .context("starting slurmdbd")?;
    let mut dbd = (Daemon(child), db);
    let up = wait_listening(
        port,
        Duration::from_secs(60),
        "slurmdbd",
        &mut dbd.0 .0,
        &dir.join("log/slurmdbd.log"),
    );
    let registered = up.and_then(|()| {
        let out = Command::new("sacctmgr")
            .args(["-i", "add", "cluster", "batchfleet"])
            .env("SLURM_CONF", conf)
            .output()?;
        if !out.status.success() {
            bail!(
                "sacctmgr add cluster: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    });
    if let Err(e) = registered {
        drop_database(&dbd.1);
        return Err(e.context(format!(
            "slurmdbd did not come up; see {d}/log/slurmdbd.log"
        )));
    }
    Ok(dbd)
}

/// Drops the run's accounting database (best effort: needs the `mysql` client).
fn drop_database(db: &str) {
    let _ = Command::new("mysql")
        .args([
            "-uroot",
            "-h127.0.0.1",
            "-e",
            &format!("DROP DATABASE IF EXISTS `{db}`"),
        ])
        .output();
}

/// A daemon of the run, killed if dropped before [`Slurm::stop`] stopped it
/// (a start that failed half-way leaves nothing running).
pub(super) struct Daemon(pub(super) Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A single-node Slurm cluster of the run's own.
pub(super) struct Slurm {
    conf: PathBuf,
    pub(super) version: String,
    pub(super) munged: Daemon,
    pub(super) ctld: Daemon,
    pub(super) slurmd: Daemon,
    /// slurmdbd and its database, when MariaDB answers: what `sacct` reads.
    pub(super) dbd: Option<(Daemon, String)>,
}

impl Slurm {
    /// Starts MUNGE, slurmctld and slurmd (and slurmdbd where MariaDB
    /// answers) in `dir`, and waits for the node to come up idle.
    pub(super) fn start(dir: &Path) -> Result<Self> {
        let (munged, socket) = start_munged(dir)?;
        make_gpus(dir)?;
        // Accounting (slurmdbd on the local MariaDB), for sacct.
        let dbd_port = if services::listening("127.0.0.1:3306") && which("slurmdbd").is_some() {
            Some(free_port()?)
        } else {
            None
        };
        let conf_path = write_conf(dir, &socket, dbd_port)?;
        let version =
            String::from_utf8_lossy(&Command::new("slurmctld").arg("-V").output()?.stdout)
                .trim()
                .to_owned();
        let log = |name: &str| log_file(dir, name);
        let dbd = match dbd_port {
            Some(port) => Some(start_dbd(dir, &conf_path, &socket, port, &log)?),
            None => {
                println!("slurm: no MariaDB at 127.0.0.1:3306 (or no slurmdbd): running without accounting, sacct not checked");
                None
            }
        };
        let ctld = Command::new("slurmctld")
            .args(["-D", "-i", "-f"])
            .arg(&conf_path)
            .env("SLURM_CONF", &conf_path)
            .stdout(log("slurmctld.out")?)
            .stderr(log("slurmctld.err")?)
            .spawn()
            .map(Daemon)
            .context("starting slurmctld")?;
        let slurmd = Command::new("slurmd")
            .args(["-D", "-N", "bfnode", "-f"])
            .arg(&conf_path)
            .env("SLURM_CONF", &conf_path)
            .stdout(log("slurmd.out")?)
            .stderr(log("slurmd.err")?)
            .spawn()
            .map(Daemon)
            .context("starting slurmd")?;
        let slurm = Self {
            conf: conf_path,
            version,
            munged,
            ctld,
            slurmd,
            dbd,
        };
        wait_for(Duration::from_secs(60), || {
            Ok(slurm
                .run("sinfo", &["-h", "-o", "%t"])
                .map(|s| s.trim() == "idle")
                .unwrap_or(false))
        })
        .with_context(|| format!("the node never came up idle; see {}/log", dir.display()))?;
        Ok(slurm)
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Runs a Slurm command; its stdout, or an error with its stderr.
    pub(super) fn run(&self, program: &str, args: &[&str]) -> Result<String> {
        self.output(self.command(program).args(args), program, args)
    }

    /// [`Self::run`] from the folder `dir` (sbatch's submit folder).
    pub(super) fn run_in(&self, dir: &Path, program: &str, args: &[&str]) -> Result<String> {
        self.output(
            self.command(program).args(args).current_dir(dir),
            program,
            args,
        )
    }

    fn output(&self, c: &mut Command, program: &str, args: &[&str]) -> Result<String> {
        let out = c.output().with_context(|| format!("running {program}"))?;
        if !out.status.success() {
            bail!(
                "{program} {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `scontrol show job -o JOB` as its fields (one job, or an array task).
    pub(super) fn job(&self, job: &str) -> Result<HashMap<String, String>> {
        let out = self.run("scontrol", &["show", "job", "-o", job])?;
        let line = out.lines().next().unwrap_or_default();
        Ok(line
            .split_whitespace()
            .filter_map(|f| f.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect())
    }

    /// Waits for `job` to be in `state`. A pending array's tasks have no
    /// record of their own until they are split off to start: until then
    /// `scontrol` does not know them, and that counts as not yet.
    pub(super) fn wait_state(&self, job: &str, state: &str, within: Duration) -> Result<()> {
        wait_for(within, || {
            Ok(self
                .job(job)
                .is_ok_and(|j| j.get("JobState").map(String::as_str) == Some(state)))
        })
        .with_context(|| format!("{job} never reached {state}: {:?}", self.job(job).ok()))
    }

    /// Waits for `job` to be back in the queue after a requeue.
    pub(super) fn wait_requeued(&self, job: &str, within: Duration) -> Result<()> {
        wait_for(within, || Ok(self.requeued(job, 1)))
            .with_context(|| format!("{job} was not requeued: {:?}", self.job(job).ok()))
    }

    /// Whether `job` waits in the queue after its `restarts`th requeue.
    pub(super) fn requeued(&self, job: &str, restarts: u32) -> bool {
        self.job(job).is_ok_and(|j| {
            j.get("Restarts") == Some(&restarts.to_string())
                && j.get("JobState").map(String::as_str) == Some("PENDING")
        })
    }

    /// Starts a just requeued `job` without Slurm's requeue delay
    /// (`scontrol update StartTime=now`, with `settings` besides) and waits
    /// until it runs. The delay is set when the requeue has finished (reason
    /// `BeginTime`); an update before that is overwritten, so it is made
    /// (again) whenever the job waits for its begin time. Not within 2 s of
    /// the requeue: slurmd refuses (exit 1, the job FAILED) a launch whose
    /// credential is from the second in which the previous run's was
    /// revoked — the reason for Slurm's own delay — so this is a wait on
    /// Slurm's clock, not on an event.
    pub(super) fn start_now(&self, job: &str, settings: &[&str]) -> Result<()> {
        let id = format!("JobId={job}");
        let earliest = Instant::now() + Duration::from_secs(2);
        wait_for(Duration::from_secs(90), || {
            let j = self.job(job)?;
            match (
                j.get("JobState").map(String::as_str),
                j.get("Reason").map(String::as_str),
            ) {
                (Some("RUNNING"), _) => return Ok(true),
                (Some("PENDING"), Some("BeginTime")) if Instant::now() >= earliest => {
                    self.run(
                        "scontrol",
                        &[&["update", &id], settings, &["StartTime=now"]].concat(),
                    )?;
                }
                (Some("PENDING" | "REQUEUED" | "COMPLETING" | "CONFIGURING") | None, _) => {}
                (Some(state), _) => bail!("{job} ended {state} instead of starting again"),
            }
            Ok(false)
        })
        .with_context(|| format!("{job} did not start again: {:?}", self.job(job).ok()))
    }

    /// Waits until `job` has ended (neither pending, running nor completing).
    pub(super) fn wait_gone(&self, job: &str, within: Duration) -> Result<()> {
        wait_for(within, || {
            let j = self.job(job)?;
            Ok(!matches!(
                j.get("JobState").map(String::as_str),
                Some("PENDING" | "RUNNING" | "COMPLETING" | "REQUEUED" | "CONFIGURING")
            ))
        })
        .with_context(|| format!("{job} did not end: {:?}", self.job(job).ok()))
    }

    /// Seconds `job` has run.
    pub(super) fn run_seconds(&self, job: &str) -> Result<u64> {
        let j = self.job(job)?;
        let t = j.get("RunTime").context("RunTime")?;
        let (days, hms) = t.split_once('-').unwrap_or(("0", t));
        let mut secs: u64 = days.parse::<u64>().unwrap_or(0) * 86_400;
        for part in hms.split(':') {
            secs = secs * 60 + part.parse::<u64>().unwrap_or(0);
        }
        Ok(secs)
    }

    /// Cancels whatever is left, stops slurmd, slurmctld and munged by
    /// their pids and checks that none of them, nor any process of the
    /// run's jobs, is left.
    pub(super) fn stop(&mut self, root: &Path) -> Result<()> {
        // Every job left, by its own id or its array's (a pending array's
        // tasks are listed as `ID_[0-1%1]`, which scancel does not take).
        let queued = || -> Vec<String> {
            let ids = self.run("squeue", &["-h", "-o", "%F"]).unwrap_or_default();
            let mut ids: Vec<String> = ids.split_whitespace().map(str::to_owned).collect();
            ids.sort();
            ids.dedup();
            ids
        };
        let mut left = Vec::new();
        for id in queued() {
            let _ = self.run("scancel", &[&id]);
        }
        if wait_for(Duration::from_secs(60), || Ok(queued().is_empty())).is_err() {
            left.push(format!("jobs still queued after scancel: {:?}", queued()));
        }
        let mut daemons = vec![
            ("slurmd", &mut self.slurmd.0),
            ("slurmctld", &mut self.ctld.0),
        ];
        let mut db = None;
        if let Some((daemon, name)) = self.dbd.as_mut() {
            daemons.push(("slurmdbd", &mut daemon.0));
            db = Some(name.clone());
        }
        daemons.push(("munged", &mut self.munged.0));
        for (name, child) in daemons {
            fault::signal(child, "TERM");
            if fault::wait_or_kill(child, Duration::from_secs(30)).is_none() {
                left.push(format!(
                    "{name} (pid {}) ignored SIGTERM for 30 s",
                    child.id()
                ));
            }
            if Path::new(&format!("/proc/{}", child.id())).exists()
                && std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
                    .map(|s| !s.contains(") Z "))
                    .unwrap_or(false)
            {
                left.push(format!("{name} (pid {}) still running", child.id()));
            }
        }
        if let Some(db) = db {
            drop_database(&db);
        }
        let stray = processes_under(root);
        for p in &stray {
            if let Some(pid) = p.split(':').next() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
        left.extend(stray);
        if !left.is_empty() {
            bail!("after stopping the daemons: {left:?}");
        }
        println!("slurm: the daemons stopped by their pids; no process of the run left");
        Ok(())
    }
}

/// A log file of the run's daemons, in `dir/log`.
fn log_file(dir: &Path, name: &str) -> Result<Stdio> {
    Ok(Stdio::from(std::fs::File::create(
        dir.join("log").join(name),
    )?))
}

/// munged with a key of the run's own; the daemon and its socket.
fn start_munged(dir: &Path) -> Result<(Daemon, PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    // munged refuses a socket below a folder others cannot enter (a
    // temporary folder is 0700).
    for d in [dir, dir.parent().unwrap_or(dir)] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    }
    for sub in ["state", "spool", "log", "run", "key", "dev"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    // munged wants its key private and its socket folder open to all.
    std::fs::set_permissions(dir.join("key"), std::fs::Permissions::from_mode(0o700))?;
    std::fs::set_permissions(dir.join("run"), std::fs::Permissions::from_mode(0o755))?;
    let key: Vec<u8> = (0..1024).map(|_| fastrand::u8(..)).collect();
    let key_file = dir.join("key/munge.key");
    std::fs::write(&key_file, key)?;
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o400))?;
    let socket = dir.join("run/munge.socket");
    let log = |name: &str| log_file(dir, name);
    let munged = Command::new("munged")
        .arg("--foreground")
        .arg(format!("--key-file={}", key_file.display()))
        .arg(format!("--socket={}", socket.display()))
        .arg(format!(
            "--pid-file={}",
            dir.join("run/munged.pid").display()
        ))
        .arg(format!(
            "--log-file={}",
            dir.join("log/munged.log").display()
        ))
        .arg(format!(
            "--seed-file={}",
            dir.join("key/munged.seed").display()
        ))
        .stdout(log("munged.out")?)
        .stderr(log("munged.err")?)
        .spawn()
        .map(Daemon)
        .context("starting munged")?;
    wait_for(Duration::from_secs(20), || Ok(socket.exists()))
        .context("munged did not create its socket; see its log")?;
    Ok((munged, socket))
}

/// Two GPUs played by character devices (/dev/null's numbers) in `dir/dev`.
fn make_gpus(dir: &Path) -> Result<()> {
    // Slurm
    // accepts only device files for a GPU, and numbers
    // CUDA_VISIBLE_DEVICES after them.
    for i in 0..2 {
        let dev = dir.join(format!("dev/nvidia{i}"));
        if !dev.exists() {
            let status = Command::new("mknod")
                .arg(&dev)
                .args(["c", "1", "3"])
                .status()?;
            if !status.success() {
                bail!("mknod {} failed", dev.display());
            }
        }
    }
    Ok(())
}

/// `slurm.conf` and `gres.conf` for one node of two GPUs on loopback
/// ports, accounting through slurmdbd on `dbd_port` when given.
fn write_conf(dir: &Path, socket: &Path, dbd_port: Option<u16>) -> Result<PathBuf> {
    let host = String::from_utf8(Command::new("hostname").arg("-s").output()?.stdout)?
        .trim()
        .to_owned();
    let (ctld_port, node_port) = (free_port()?, free_port()?);
    let d = dir.display();
    let accounting = match dbd_port {
        // AccountingStoragePass: the MUNGE socket to reach slurmdbd with.
        Some(port) => format!(
            "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\nAccountingStoragePort={port}\nAccountingStoragePass={}\n",
            socket.display()
        ),
        None => "AccountingStorageType=accounting_storage/none\n".to_owned(),
    };
    let conf = format!(
        "# A single-node cluster of batchfleet's Slurm run: loopback only.
ClusterName=batchfleet
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
{accounting}SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=3600
GresTypes=gpu
SlurmdParameters=config_overrides
NodeName=bfnode NodeHostname={host} NodeAddr=127.0.0.1 CPUs=16 RealMemory=64000 Gres=gpu:2 State=UNKNOWN
PartitionName=batch Nodes=bfnode Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=bfnode MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
",
        socket = socket.display(),
    );
    let conf_path = dir.join("slurm.conf");
    std::fs::write(&conf_path, conf)?;
    std::fs::write(
        dir.join("gres.conf"),
        format!("NodeName=bfnode Name=gpu File={d}/dev/nvidia[0-1]\n"),
    )?;
    Ok(conf_path)
}
