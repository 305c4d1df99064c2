//! docker/slurm/batchfleet-slurm-task's decisions, with `srun`, `scontrol`
//! and `scancel` played by scripts that record their calls: which exit
//! codes requeue the job and under which name, that a job Slurm is
//! cancelling is not requeued, that the time limit's SIGTERM reaches the
//! step through `scancel --signal=TERM`, and that exit 75 restarts the
//! program. `make slurm-test` runs the same script under a real Slurm.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

fn task_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docker/slurm/batchfleet-slurm-task")
}

/// A folder with the stand-ins on PATH and the files they share.
struct Stage {
    dir: tempfile::TempDir,
}

const SRUN: &str = r#"#!/usr/bin/env bash
echo "srun $*" >> "$CALLS"
while [ "${1#-}" != "$1" ]; do shift; done
export SLURM_PROCID=0
exec "$@"
"#;

// `scontrol requeue`: Slurm ends the whole job (the batch script and its
// step), which is this process group.
const SCONTROL: &str = r#"#!/usr/bin/env bash
echo "scontrol $*" >> "$CALLS"
case "$1" in
  show) echo "JobId=41 ArrayJobId=40 ArrayTaskId=1 JobState=$(cat "$STATE") Reason=None" ;;
  requeue) kill -KILL 0 ;;
esac
"#;

// `scancel --signal=TERM`: slurmstepd signals the step's processes.
const SCANCEL: &str = r#"#!/usr/bin/env bash
echo "scancel $*" >> "$CALLS"
kill -TERM "$(cat "$PROG_PID")"
"#;

// The program: its nth run exits with line n of $EXITS, or, for `wait`,
// runs until SIGTERM and then exits 0 (a drained worker).
const PROG: &str = r#"#!/usr/bin/env bash
echo $$ > "$PROG_PID"
n=$(( $(cat "$COUNT" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$COUNT"
echo "prog run $n id=$BATCHFLEET_WORKER_ID drain=$BATCHFLEET_DRAIN_TIMEOUT args=$*" >> "$CALLS"
code=$(sed -n "${n}p" "$EXITS")
if [ "$code" = wait ]; then
  trap 'echo "prog TERM" >> "$CALLS"; exit 0' TERM
  touch "$READY"
  while :; do sleep 0.05; done
fi
exit "$code"
"#;

impl Stage {
    fn new(exits: &[&str], state: &str) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).expect("bin");
        for (name, text) in [
            ("srun", SRUN),
            ("scontrol", SCONTROL),
            ("scancel", SCANCEL),
            ("prog", PROG),
        ] {
            let p = bin.join(name);
            std::fs::write(&p, text).expect("stub");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        std::fs::write(dir.path().join("exits"), exits.join("\n") + "\n").expect("exits");
        std::fs::write(dir.path().join("state"), state).expect("state");
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The task script as the batch script of array task 40_1 (job id 41).
    fn start(&self, requeue_code: &str) -> Child {
        self.start_with(requeue_code, &[])
    }

    /// [`Stage::start`] with extra environment variables.
    fn start_with(&self, requeue_code: &str, envs: &[(&str, &str)]) -> Child {
        let path = format!(
            "{}:{}",
            self.path("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Command::new(task_script())
            .arg(requeue_code)
            .arg(self.path("bin/prog"))
            .arg("--x")
            .env("PATH", path)
            .env("SLURM_JOB_ID", "41")
            .env("SLURM_ARRAY_JOB_ID", "40")
            .env("SLURM_ARRAY_TASK_ID", "1")
            .env("SLURM_SUBMIT_DIR", self.dir.path())
            .env_remove("BATCHFLEET_DRAIN_TIMEOUT")
            .env_remove("BATCHFLEET_WORKER_ID")
            .env("CALLS", self.path("calls"))
            .env("STATE", self.path("state"))
            .env("PROG_PID", self.path("prog.pid"))
            .env("COUNT", self.path("count"))
            .env("EXITS", self.path("exits"))
            .env("READY", self.path("ready"))
            // Crash restarts pause 50 ms, 100 ms, … here, not 1 s, 2 s, ….
            .env("BATCHFLEET_SLURM_RESTART_PAUSE", "0.05")
            .env_remove("BATCHFLEET_SLURM_RESTARTS")
            .envs(envs.iter().copied())
            .stdout(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .expect("batchfleet-slurm-task")
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.path("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

fn finish(mut child: Child) -> ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(Instant::now() < deadline, "the task script did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn has(calls: &[String], prefix: &str) -> bool {
    calls.iter().any(|c| c.starts_with(prefix))
}

#[test]
fn a_drained_worker_of_a_running_job_is_requeued_by_its_array_task_name() {
    let s = Stage::new(&["0"], "RUNNING");
    let status = finish(s.start("0"));
    let calls = s.calls();
    // Ended by the requeue (the stand-in kills the job as Slurm does).
    assert_eq!(status.signal(), Some(9), "{status:?} {calls:?}");
    assert!(
        has(&calls, "prog run 1 id=slurm-40_1.0.r0 drain=25s args=--x"),
        "{calls:?}"
    );
    assert!(has(&calls, "srun --kill-on-bad-exit=0"), "{calls:?}");
    assert!(has(&calls, "scontrol show job -o 40_1"), "{calls:?}");
    // 40_1, never 41 or 40 (the array's id: every task would be requeued).
    assert_eq!(
        calls.last().map(String::as_str),
        Some("scontrol requeue 40_1")
    );
}

#[test]
fn a_job_being_cancelled_is_not_requeued() {
    let s = Stage::new(&["0"], "COMPLETING");
    let status = finish(s.start("0"));
    let calls = s.calls();
    assert_eq!(status.code(), Some(0), "{calls:?}");
    assert!(has(&calls, "scontrol show job"), "{calls:?}");
    assert!(!has(&calls, "scontrol requeue"), "{calls:?}");
}

#[test]
fn a_setting_that_cannot_work_fails_the_job_without_a_requeue() {
    let s = Stage::new(&["78"], "RUNNING");
    let status = finish(s.start("0"));
    let calls = s.calls();
    assert_eq!(status.code(), Some(78), "{calls:?}");
    assert!(!has(&calls, "scontrol"), "{calls:?}");
}

#[test]
fn exit_75_starts_the_program_again_in_the_same_allocation() {
    let s = Stage::new(&["75", "0"], "COMPLETING");
    let status = finish(s.start("0"));
    let calls = s.calls();
    assert_eq!(status.code(), Some(0), "{calls:?}");
    assert!(has(&calls, "prog run 2 "), "{calls:?}");
    assert_eq!(calls.iter().filter(|c| c.starts_with("srun")).count(), 1);
}

#[test]
fn the_time_limit_signal_reaches_the_step_and_the_drained_task_is_requeued() {
    let s = Stage::new(&["wait"], "RUNNING");
    let child = s.start("0");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !s.path("ready").exists() {
        assert!(Instant::now() < deadline, "the program never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    // `--signal=B:TERM@N`: SIGTERM to the batch script alone.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = finish(child);
    let calls = s.calls();
    assert_eq!(status.signal(), Some(9), "{status:?} {calls:?}");
    let order: Vec<&str> = calls
        .iter()
        .filter(|c| !c.starts_with("srun") && !c.starts_with("prog run"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        order,
        [
            "scancel --signal=TERM 40_1",
            "prog TERM",
            "scontrol show job -o 40_1",
            "scontrol requeue 40_1"
        ],
        "{calls:?}"
    );
}

#[test]
fn the_coordinator_requeues_on_130_and_ends_on_0() {
    let done = Stage::new(&["0"], "RUNNING");
    let status = finish(done.start("130"));
    assert_eq!(status.code(), Some(0));
    assert!(!has(&done.calls(), "scontrol"), "{:?}", done.calls());

    let interrupted = Stage::new(&["130"], "RUNNING");
    let status = finish(interrupted.start("130"));
    assert_eq!(status.signal(), Some(9), "{:?}", interrupted.calls());
    assert!(has(&interrupted.calls(), "scontrol requeue 40_1"));
}

#[test]
fn a_crashing_worker_is_restarted_in_place_and_the_task_goes_on() {
    // SIGSEGV, SIGABRT, the OOM killer's SIGKILL, an exit 1: each costs a
    // restart in the same allocation, not the task.
    let s = Stage::new(&["139", "134", "137", "1", "0"], "COMPLETING");
    let status = finish(s.start("0"));
    let calls = s.calls();
    assert_eq!(status.code(), Some(0), "{calls:?}");
    assert!(has(&calls, "prog run 5 "), "{calls:?}");
    assert_eq!(
        calls.iter().filter(|c| c.starts_with("srun")).count(),
        1,
        "one step: {calls:?}"
    );
}

#[test]
fn a_worker_crashing_past_its_restart_budget_ends_the_task_with_the_crash() {
    let s = Stage::new(&["139", "139", "139", "0"], "RUNNING");
    let status = finish(s.start_with("0", &[("BATCHFLEET_SLURM_RESTARTS", "2")]));
    let calls = s.calls();
    assert_eq!(status.code(), Some(139), "{calls:?}");
    assert!(has(&calls, "prog run 3 "), "{calls:?}");
    assert!(
        !has(&calls, "prog run 4 "),
        "two restarts, no more: {calls:?}"
    );
    assert!(!has(&calls, "scontrol requeue"), "{calls:?}");
}

#[test]
fn the_coordinator_is_not_restarted_on_its_own_failures() {
    // `batchfleet run` exiting 1 (or 2, 3, 4: its verdicts) ends the task;
    // only a death by a signal would restart it.
    let s = Stage::new(&["1", "0"], "RUNNING");
    let status = finish(s.start("130"));
    let calls = s.calls();
    assert_eq!(status.code(), Some(1), "{calls:?}");
    assert!(!has(&calls, "prog run 2 "), "{calls:?}");
}
