//! `batchfleet run --local` end to end, with RabbitMQ and Redis pointed at
//! closed ports: the job runs in one process on the in-process queues and
//! store, every row is predicted once and equal to PyTorch's, and a run
//! killed with SIGKILL resumes from its part files computing nothing twice.

use batchfleet_loadtest::python::{make_job, JobGen};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Nothing listens on these: a run that needed a service would fail.
const NO_AMQP: &str = "amqp://127.0.0.1:9/%2f";
const NO_REDIS: &str = "redis://127.0.0.1:9/";

fn job(rows: u64, item_rows: u64) -> tempfile::TempDir {
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

fn batchfleet(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_batchfleet"));
    c.env("BATCHFLEET_AMQP_URL", NO_AMQP)
        .env("BATCHFLEET_REDIS_URL", NO_REDIS)
        .env_remove("BATCHFLEET_DATA_ROOTS")
        .env_remove("LD_LIBRARY_PATH") // the binary must find libtorch by itself
        .current_dir(dir);
    c
}

fn summary(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary.json"))
        .expect("summary is JSON")
}

fn verify(dir: &Path) {
    let v = batchfleet_loadtest::verify::verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5)
        .expect("verify");
    assert!(v.ok(), "{}", v.describe());
}

fn parts(out: &Path) -> Vec<PathBuf> {
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
}

#[test]
fn a_local_run_killed_mid_job_resumes_and_computes_nothing_twice() {
    let dir = job(16_000, 500);
    let out = dir.path().join("out");
    // Slow model calls, so that the kill lands mid-job.
    let mut first = batchfleet(dir.path())
        .args([
            "run",
            "job.toml",
            "--local",
            "--workers",
            "2",
            "--threads",
            "1",
            "--no-progress",
        ])
        .env("BATCHFLEET_DEBUG_BATCH_DELAY", "150ms")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn batchfleet");
    let deadline = Instant::now() + Duration::from_secs(120);
    // Part files appear as items commit; no other signal crosses the process.
    while parts(&out).len() < 4 {
        assert!(
            first.try_wait().expect("wait").is_none(),
            "the run ended before it could be killed"
        );
        assert!(Instant::now() < deadline, "no part files within 120s");
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill().expect("SIGKILL");
    first.wait().expect("reap");
    let before = parts(&out);
    assert!(before.len() < 32, "killed before the end");
    let rows_before: u64 = before
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).expect("part");
            text.lines().count() as u64 - 1 // header
        })
        .sum();

    let second = batchfleet(dir.path())
        .args(["run", "job.toml", "--local", "--no-progress"])
        .output()
        .expect("run batchfleet");
    assert_eq!(
        second.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    verify(dir.path());
    let s = summary(&out);
    assert_eq!(s["status"], "completed");
    assert_eq!(s["rows_predicted"], 16_000);
    // Every row without a part file was computed once in the second run,
    // or taken from a checkpoint segment; none with a part file was.
    let computed = s["rows_computed"].as_u64().expect("rows_computed");
    let resumed = s["rows_resumed"].as_u64().expect("rows_resumed");
    assert_eq!(
        computed + resumed,
        16_000 - rows_before,
        "the resumed run computed exactly the rows without a part file"
    );
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
        "build every binary first (`cargo test --workspace --all-targets` does)"
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
