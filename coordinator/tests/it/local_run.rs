//! `batchfleet run --local` end to end, with RabbitMQ and Redis pointed at
//! closed ports: the job runs in one process on the in-process queues and
//! store, every row is predicted once and equal to PyTorch's, and a run
//! killed with SIGKILL resumes from its part files computing nothing twice.

use batchfleet_testkit::python::{make_job, JobGen};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Nothing listens on these: a run that needed a service would fail.
const NO_AMQP: &str = "amqp://127.0.0.1:9/%2f";
const NO_REDIS: &str = "redis://127.0.0.1:9/";

pub(crate) fn job(rows: u64, item_rows: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    make_job(
        dir.path(),
        &JobGen {
            rows,
            files: 2,
            item_rows,
            ..JobGen::default()
        },
    )
    .expect("generate job");
    dir
}

pub(crate) fn batchfleet(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_batchfleet"));
    c.env("BATCHFLEET_AMQP_URL", NO_AMQP)
        .env("BATCHFLEET_REDIS_URL", NO_REDIS)
        .env_remove("BATCHFLEET_DATA_ROOT")
        .env_remove("BATCHFLEET_DATA_ROOTS")
        .env_remove("LD_LIBRARY_PATH") // the binary must find libtorch by itself
        .current_dir(dir);
    c
}

pub(crate) fn summary(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(out.join("_summary.json")).expect("_summary.json"))
        .expect("summary is JSON")
}

fn verify(dir: &Path) {
    let v = batchfleet_testkit::verify::verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5)
        .expect("verify");
    assert!(v.ok(), "{}", v.describe());
}

pub(crate) fn parts(out: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(out)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("part-"))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_local_run_needs_no_services_and_predicts_every_row_once() {
    let dir = job(6_000, 1_000);
    let out = batchfleet(dir.path())
        .args([
            "run",
            "job.toml",
            "--local",
            "--workers",
            "2",
            "--threads",
            "1",
        ])
        .output()
        .expect("run batchfleet");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("completed: 6000 rows in 6 items"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    verify(dir.path());
    let s = summary(&dir.path().join("out"));
    assert_eq!(s["status"], "completed");
    assert_eq!(
        s["rows_computed"], 6_000,
        "every row through the model once"
    );
    assert!(dir.path().join("out/_SUCCESS").exists());
    assert!(!dir.path().join("out/_dead").exists(), "nothing died");

    // Run again: already complete, nothing computed.
    let again = batchfleet(dir.path())
        .args(["run", "job.toml", "--local"])
        .output()
        .expect("run batchfleet");
    assert_eq!(again.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("already complete"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
}

#[test]
fn a_fleet_run_never_turns_local_on_its_own() {
    let dir = job(1_000, 1_000);
    let out = batchfleet(dir.path())
        .args(["--connect-timeout", "2s", "run", "job.toml"])
        .output()
        .expect("run batchfleet");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot connect to") && err.contains("--local"),
        "the error says where and offers --local: {err}"
    );
    assert!(!dir.path().join("out").exists(), "nothing ran");
    // --workers means nothing without --local.
    let out = batchfleet(dir.path())
        .args(["run", "job.toml", "--workers", "2"])
        .output()
        .expect("run batchfleet");
    assert_eq!(out.status.code(), Some(2));
    // The workers' own settings, shared with the coordinator in deployments
    // (the Kubernetes ConfigMap), do not touch a fleet run.
    let out = batchfleet(dir.path())
        .args(["--connect-timeout", "2s", "run", "job.toml"])
        .env("BATCHFLEET_THREADS", "2")
        .output()
        .expect("run batchfleet");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Where a killed-and-resumed job runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// `batchfleet run` and two `batchfleet-worker` processes over the real
    /// RabbitMQ and Redis.
    Fleet,
    /// `batchfleet run --local`.
    Local,
}

/// The processes of one attempt at the job.
struct Attempt {
    coordinator: std::process::Child,
    workers: Vec<std::process::Child>,
}

impl Attempt {
    fn start(backend: Backend, dir: &Path, pool: &str, prefix: &str, delay: &str) -> Self {
        let bin = Path::new(env!("CARGO_BIN_EXE_batchfleet"))
            .parent()
            .expect("bin dir")
            .to_owned();
        let mut workers = Vec::new();
        let mut coordinator = batchfleet(dir);
        coordinator.args(["run", "job.toml", "--no-progress"]);
        match backend {
            Backend::Local => {
                coordinator.args(["--local", "--workers", "2", "--threads", "1"]);
            }
            Backend::Fleet => {
                let worker = bin.join("batchfleet-worker");
                assert!(
                    worker.exists(),
                    "build every binary first: `cargo build --workspace --bins` (`make test` does)"
                );
                for i in 0..2 {
                    workers.push(
                        Command::new(&worker)
                            .args(["--pool", pool, "--redis-prefix", prefix, "--threads", "1"])
                            .args(["--worker-id", &format!("w{i}"), "--data-root"])
                            .arg(dir)
                            .env("BATCHFLEET_AMQP_URL", "amqp://127.0.0.1:5672/%2f")
                            .env("BATCHFLEET_REDIS_URL", "redis://127.0.0.1:6379/")
                            .env("BATCHFLEET_DEBUG_BATCH_DELAY", delay)
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .spawn()
                            .expect("spawn batchfleet-worker"),
                    );
                }
                coordinator
                    .args(["--redis-prefix", prefix])
                    .env("BATCHFLEET_AMQP_URL", "amqp://127.0.0.1:5672/%2f")
                    .env("BATCHFLEET_REDIS_URL", "redis://127.0.0.1:6379/");
            }
        }
        let coordinator = coordinator
            .env("BATCHFLEET_DEBUG_BATCH_DELAY", delay)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn batchfleet");
        Self {
            coordinator,
            workers,
        }
    }

    /// SIGKILL to every process of the attempt.
    fn kill(mut self) {
        for p in std::iter::once(&mut self.coordinator).chain(self.workers.iter_mut()) {
            let _ = p.kill();
            let _ = p.wait();
        }
    }

    /// Waits for the coordinator's exit; then stops the workers.
    fn finish(self) -> (Option<i32>, String) {
        let Attempt {
            coordinator,
            mut workers,
        } = self;
        let out = coordinator.wait_with_output().expect("wait for batchfleet");
        for w in &mut workers {
            let _ = w.kill();
            let _ = w.wait();
        }
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// Each part file's (name, inode, modification time).
fn part_ids(out: &Path) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    use std::os::unix::fs::MetadataExt;
    let mut ids: Vec<_> = parts(out)
        .into_iter()
        .map(|p| {
            let m = std::fs::metadata(&p).expect("part");
            (p, m.ino(), m.modified().expect("mtime"))
        })
        .collect();
    ids.sort();
    ids
}

fn rows_in(parts: &[(PathBuf, u64, std::time::SystemTime)]) -> u64 {
    parts
        .iter()
        .map(|(p, ..)| std::fs::read_to_string(p).expect("part").lines().count() as u64 - 1)
        .sum()
}

/// The job is killed (SIGKILL, every process) with some items committed
/// and others in flight, then started again: it completes, every row once,
/// and no item committed before the kill is computed or written again.
fn a_job_killed_mid_way_resumes_and_computes_nothing_twice(backend: Backend) {
    if backend == Backend::Fleet {
        batchfleet_testkit::services::ensure_local().expect("RabbitMQ and Redis available");
    }
    let pool = batchfleet_testkit::services::unique("resume");
    let prefix = batchfleet_testkit::services::unique("bftest-resume");
    let dir = tempfile::tempdir().expect("temp dir");
    make_job(
        dir.path(),
        &JobGen {
            rows: 16_000,
            files: 2,
            item_rows: 500,
            pool: pool.clone(),
            ..JobGen::default()
        },
    )
    .expect("generate job");
    let out = dir.path().join("out");
    // Slow model calls, so that the kill lands mid-job.
    let first = Attempt::start(backend, dir.path(), &pool, &prefix, "150ms");
    let deadline = Instant::now() + Duration::from_secs(120);
    // Part files appear as items commit; no other signal crosses the processes.
    while parts(&out).len() < 4 {
        assert!(Instant::now() < deadline, "no part files within 120s");
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill();
    let before = part_ids(&out);
    assert!(before.len() < 32, "killed before the end");
    let rows_before = rows_in(&before);

    let (code, stderr) = Attempt::start(backend, dir.path(), &pool, &prefix, "0s").finish();
    assert_eq!(code, Some(0), "{stderr}");
    verify(dir.path());
    let s = summary(&out);
    assert_eq!(s["status"], "completed");
    assert_eq!(s["rows_predicted"], 16_000);
    let after = part_ids(&out);
    for part in &before {
        assert!(
            after.contains(part),
            "{} was written again after the kill",
            part.0.display()
        );
    }
    let computed = s["rows_computed"].as_u64().expect("rows_computed");
    let resumed = s["rows_resumed"].as_u64().expect("rows_resumed");
    match backend {
        // The in-process state died with the process: the counters are the
        // second run's. Every row without a part file was computed once in
        // it (or taken from a checkpoint segment); none with a part file was.
        Backend::Local => assert_eq!(
            computed + resumed,
            16_000 - rows_before,
            "the resumed run computed exactly the rows without a part file"
        ),
        // Redis kept counting through the kill: all the work of both runs,
        // the rows lost with the killed workers' items in flight included
        // (at most two items each: their prefetch).
        Backend::Fleet => assert!(
            computed + resumed >= 16_000 && computed <= 16_000 + 2 * 2 * 500,
            "computed {computed}, resumed {resumed}"
        ),
    }
    if backend == Backend::Fleet {
        batchfleet_testkit::services::delete_pool_queues(&pool);
        batchfleet_testkit::services::delete_redis_prefix(&prefix);
    }
}

/// Waits until the file at `log` holds `text` (a log line is the only
/// event that crosses the process).
fn logged(log: &Path, text: &str, child: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let seen = std::fs::read_to_string(log).unwrap_or_default();
        if seen.contains(text) {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("exited with {status} before logging {text:?}:\n{seen}");
        }
        assert!(Instant::now() < deadline, "never logged {text:?}:\n{seen}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn interrupt(child: &std::process::Child) {
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
}

/// Ctrl-C drains a local run (its items stop at their next checkpoint);
/// Ctrl-C again stops it at once, with exit code 130, even while a model
/// call that would last ten minutes holds the drain.
#[test]
fn a_second_ctrl_c_stops_a_draining_local_run_at_once() {
    let dir = job(2_000, 500);
    let log = dir.path().join("run.log");
    let mut run = batchfleet(dir.path())
        .args([
            "run",
            "job.toml",
            "--no-progress",
            "--local",
            "--workers",
            "1",
            "--threads",
            "1",
        ])
        .env("BATCHFLEET_DEBUG_BATCH_DELAY", "10m")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn batchfleet");
    logged(&log, "model loaded", &mut run);
    interrupt(&run);
    logged(&log, "press Ctrl-C again to stop at once", &mut run);
    assert!(run.try_wait().expect("wait").is_none(), "still draining");
    interrupt(&run);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = run.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the second Ctrl-C did not stop it"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(130));
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        text.contains("interrupted again: stopping at once"),
        "{text}"
    );
    assert!(
        parts(&dir.path().join("out")).is_empty(),
        "nothing committed"
    );
}

/// `plan --sample`: rows spread across the input, predicted in the
/// `plan` process as the job would write them — each equal to PyTorch's
/// own prediction —, with the rate one core reaches and the time to go.
#[test]
fn plan_sample_predicts_rows_across_the_input_before_anything_runs() {
    let dir = job(4_000, 500);
    let golden =
        batchfleet_testkit::verify::rows_by_id(&dir.path().join("golden.csv")).expect("golden");
    let out = batchfleet(dir.path())
        .args([
            "plan",
            "job.toml",
            "--local",
            "--sample",
            "12",
            "--workers",
            "4",
            "--json",
        ])
        .output()
        .expect("plan");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let s = &v["sample"];
    assert_eq!(s["header"], "id,score");
    let rows = s["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 12);
    let mut ids = std::collections::HashSet::new();
    for row in rows {
        let (id, score) = row
            .as_str()
            .expect("a CSV line")
            .split_once(',')
            .expect("id,score");
        let want = golden[id][0];
        let got: f64 = score.parse().expect("score");
        assert!(
            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
            "{id}: {got} != {want}"
        );
        ids.insert(id.to_owned());
    }
    assert_eq!(ids.len(), 12, "no row twice");
    // Eight items spread over the job's eight, every row of them read.
    assert_eq!(s["items"], 8);
    assert_eq!(s["rows_read"], 4_000);
    let per_core = s["rows_per_s_per_core"].as_f64().expect("rate");
    assert!(per_core > 0.0);
    let eta = s["eta_s"].as_f64().expect("eta");
    assert!(
        (eta - 4_000.0 / (per_core * 4.0)).abs() <= 1e-6 * eta.max(1.0),
        "{eta}"
    );
    assert!(!dir.path().join("out").exists(), "plan writes nothing");
    let text = batchfleet(dir.path())
        .args(["plan", "job.toml", "--local", "--sample", "3"])
        .output()
        .expect("plan");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("sample: 3 rows from 3 items") && text.contains("per core:"),
        "{text}"
    );
}

mod fleet {
    #[test]
    fn a_job_killed_mid_way_resumes_and_computes_nothing_twice() {
        super::a_job_killed_mid_way_resumes_and_computes_nothing_twice(super::Backend::Fleet);
    }
}

mod local {
    #[test]
    fn a_job_killed_mid_way_resumes_and_computes_nothing_twice() {
        super::a_job_killed_mid_way_resumes_and_computes_nothing_twice(super::Backend::Local);
    }
}

/// The repository's root (this crate's parent folder).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

#[test]
fn the_readmes_first_command_runs_with_no_services_reachable() {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let block = readme
        .split("```sh\n")
        .nth(1)
        .expect("the README's first sh block");
    let first = block.lines().next().expect("a first command");
    let command = first.split('#').next().unwrap_or_default().trim();
    assert_eq!(command, "make demo", "the README's first command");
    // `make demo` builds the release binaries, then runs .ci/demo.sh; here it
    // runs on the binaries this test run built, with nothing listening at the
    // service URLs.
    let makefile = std::fs::read_to_string(repo().join("Makefile")).expect("Makefile");
    let recipe = makefile
        .split("\ndemo:")
        .nth(1)
        .and_then(|r| r.lines().nth(1))
        .expect("a demo recipe");
    assert_eq!(recipe.trim(), ".ci/demo.sh");
    let bin = Path::new(env!("CARGO_BIN_EXE_batchfleet"))
        .parent()
        .expect("bin dir")
        .to_owned();
    assert!(
        bin.join("batchfleet-loadtest").exists(),
        "build every binary first: `cargo build --workspace --bins` (`make test` does)"
    );
    let demo = tempfile::tempdir().expect("temp dir");
    let out = Command::new(repo().join(".ci/demo.sh"))
        .env("BF_BIN", &bin)
        .env("DEMO_DIR", demo.path())
        .env("DEMO_ROWS", "20000")
        .env("BATCHFLEET_AMQP_URL", NO_AMQP)
        .env("BATCHFLEET_REDIS_URL", NO_REDIS)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run .ci/demo.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("verified: every row exactly once"),
        "{stdout}"
    );
    assert!(stdout.contains("the fleet half is skipped"), "{stdout}");
    assert_eq!(summary(&demo.path().join("out"))["rows_predicted"], 20_000);
}
