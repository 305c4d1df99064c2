//! The model call tried before anything is published: with libtorch in the
//! coordinator (the default build), the job's model runs on two sample rows
//! the way workers will run it ([`batchfleet_worker::probe`]), so a
//! selection the model's output does not have, a `[rows, L, D]` output
//! without pooling, a `dtype` the CPU cannot run, or output names that do
//! not match the model's width are exit 2 with the setting to fix.
//!
//! The call runs in a child process (`batchfleet try-model`, the same
//! executable), never in the coordinator's own: a model that crashes
//! libtorch, or takes more memory than [`ModelTrial::Child`] allows (by
//! default [`default_memory`]), kills the child, and validation refuses the
//! job with what happened. A model that does not load there, raises on the
//! made-up rows, or has not returned within [`PROBE_LIMIT`] (or the job's
//! `item_timeout`, if shorter) only warns: the workers decide, under their
//! own timeouts. A pass is remembered on the machine ([`Remembered`]), so
//! the next job of the same model called the same way is not tried again.
//! Only `run` and `plan` try the model; `supervise`, `wait`,
//! `cancel`, `resume` and `dlq replay` handle jobs that were validated when
//! they were run ([`ModelTrial::Skip`]).

use super::{ManifestError, Problem};
use batchfleet_shared::message::TaskSpec;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long validation waits for the model's call on the sample rows at most.
pub const PROBE_LIMIT: Duration = Duration::from_secs(60);

/// The variable that names the program run as `<program> try-model`
/// (default: this `batchfleet`, or the one built beside the program that
/// links this library).
pub const PROGRAM_ENV: &str = "BATCHFLEET_TRY_MODEL_PROGRAM";

/// `abort` in this variable makes `try-model` abort instead of trying
/// the model (a crash inside libtorch, for tests).
pub const DEBUG_ENV: &str = "BATCHFLEET_DEBUG_TRY_MODEL";

/// Whether and how validation tries a job's model call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelTrial {
    /// In a child process, killed past the time limit or past `memory`
    /// bytes of resident memory (`None`: [`default_memory`] of the model).
    Child {
        /// Most resident bytes the child may use (`--validate-memory`).
        memory: Option<u64>,
    },
    /// Not tried: the job was validated when it was run.
    Skip,
}

impl Default for ModelTrial {
    fn default() -> Self {
        ModelTrial::Child { memory: None }
    }
}

/// The child's memory limit when none is given: 2 GiB, plus four times the
/// model file (weights loaded, a copy in flight, activations of two rows).
pub fn default_memory(model_bytes: u64) -> u64 {
    (2 << 30) + model_bytes.saturating_mul(4)
}

/// What the trial found.
type Tried = Result<batchfleet_worker_probe::Probed, batchfleet_worker_probe::ProbeFailure>;

#[cfg(feature = "local")]
use batchfleet_worker::probe as batchfleet_worker_probe;

#[cfg(not(feature = "local"))]
mod batchfleet_worker_probe {
    //! What the child answers, for a coordinator without libtorch (which
    //! never starts one).
    #[derive(Debug, serde::Serialize, serde::Deserialize)]
    pub struct Probed {
        pub width: usize,
        pub parts: Vec<(String, usize)>,
    }
    #[derive(Debug, serde::Deserialize)]
    pub enum ProbeFailure {
        Refused(String),
        Inconclusive(String),
    }
}

/// `batchfleet try-model`: reads a task spec (JSON) on stdin, tries its
/// model call, and writes the outcome (JSON) on stdout.
pub fn child_main() -> std::process::ExitCode {
    use std::io::{Read, Write};
    // Dies with the coordinator that started it (killed, or out of memory),
    // rather than run on with no limit: SIGKILL when its parent goes, and
    // an exit if it is gone already.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let parent = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok());
    if parent.is_some() && rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != parent {
        return std::process::ExitCode::from(70);
    }
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        eprintln!("try-model: cannot read the task on stdin: {e}");
        return std::process::ExitCode::from(74);
    }
    if input.is_empty() {
        // Started ahead for a validation that never came to the model.
        return std::process::ExitCode::SUCCESS;
    }
    let task: TaskSpec = match serde_json::from_slice(&input) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("try-model: stdin is not a task spec: {e}");
            return std::process::ExitCode::from(65);
        }
    };
    // A crash inside libtorch, on demand, for the tests of what validation
    // makes of one.
    if std::env::var(DEBUG_ENV).is_ok_and(|v| v == "abort") {
        eprintln!("injected crash: aborting try-model ({DEBUG_ENV}=abort)");
        std::process::abort();
    }
    #[cfg(feature = "local")]
    let tried: Tried = batchfleet_worker::probe::probe(&task);
    #[cfg(not(feature = "local"))]
    let tried: Result<(), String> = Err(format!(
        "this batchfleet is built without libtorch and cannot try {}",
        task.model.path
    ));
    #[cfg(feature = "local")]
    let out = serde_json::to_vec(&Answer {
        tried,
        peak: peak_resident(std::process::id()),
    })
    .expect("the outcome serializes");
    #[cfg(not(feature = "local"))]
    let out = serde_json::to_vec(&tried).expect("the outcome serializes");
    let mut stdout = std::io::stdout().lock();
    if stdout
        .write_all(&out)
        .and_then(|()| stdout.flush())
        .is_err()
    {
        return std::process::ExitCode::from(74);
    }
    std::process::ExitCode::SUCCESS
}

/// The program to run as `<program> try-model`: [`PROGRAM_ENV`], this
/// process's executable if it is `batchfleet`, else the `batchfleet`
/// beside it or one folder up (a test or the load generator in cargo's
/// `target/<profile>/deps/`).
fn program() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(PROGRAM_ENV) {
        return Ok(p.into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    if exe.file_name().is_some_and(|n| n == "batchfleet") {
        return Ok(exe);
    }
    let here = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let found = [Some(here.as_path()), here.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join("batchfleet"))
        .find(|c| c.is_file());
    found
        .ok_or_else(|| {
            format!(
                "no batchfleet executable beside {} to try it in (build it, or name one in {PROGRAM_ENV})",
                exe.display()
            )
        })
}

/// The coordinator's environment as the child gets it: what a libtorch
/// process on the CPU reads (threads, allocators), never a service URL,
/// key or credential. (Nor can the child read them from the coordinator's
/// `/proc/<pid>/environ`: the coordinator is not dumpable.)
fn child_env() -> impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)> {
    // The cache folder too: an `s3://` model is read from the copy
    // validation downloaded (the trial has no credentials to fetch it).
    const KEEP: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LANG",
        "LC_ALL",
        "TZ",
        "TMPDIR",
        "XDG_CACHE_HOME",
        "BATCHFLEET_CACHE_DIR",
        DEBUG_ENV,
    ];
    // Thread pools and allocators only: the trial runs on the CPU.
    const PREFIXES: &[&str] = &[
        "OMP_",
        "MKL_",
        "KMP_",
        "GOMP_",
        "OPENBLAS_",
        "RUST_BACKTRACE",
    ];
    std::env::vars_os().filter(|(k, _)| {
        k.to_str()
            .is_some_and(|k| KEEP.contains(&k) || PREFIXES.iter().any(|p| k.starts_with(p)))
    })
}

/// A process's peak resident memory in bytes (`VmHWM`: the most it has
/// held, so an allocation freed between two looks is still seen).
fn peak_resident(pid: u32) -> Option<u64> {
    batchfleet_shared::process_memory(Some(pid), "VmHWM")
}

/// How long a killed child may take to go before validation stops
/// waiting for it.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// What `try-model` writes on stdout: the outcome, and the most memory
/// the process held (`VmHWM`), which the parent checks against the limit
/// (a peak between two of its looks).
#[derive(serde::Serialize, serde::Deserialize)]
struct Answer {
    tried: Tried,
    peak: Option<u64>,
}

/// The variable that tells `try-model` its parent's pid, so that it dies
/// with it.
const PARENT_ENV: &str = "BATCHFLEET_TRY_MODEL_PARENT";

/// A signal's usual name.
fn signal_name(sig: i32) -> String {
    match sig {
        4 => "SIGILL".into(),
        6 => "SIGABRT".into(),
        7 => "SIGBUS".into(),
        8 => "SIGFPE".into(),
        9 => "SIGKILL".into(),
        11 => "SIGSEGV".into(),
        n => format!("signal {n}"),
    }
}

/// The last lines of a child's stderr, as one line.
fn tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let from = lines.len().saturating_sub(3);
    let mut t = lines[from..].join(" | ");
    if t.len() > 600 {
        let mut cut = t.len() - 600;
        while !t.is_char_boundary(cut) {
            cut += 1;
        }
        t = format!("…{}", &t[cut..]);
    }
    t
}

/// What ended the child.
enum Ended {
    /// It answered.
    Answered(Tried),
    /// Killed by validation for holding more than the limit.
    OverMemory { limit: u64, seen: u64 },
    /// Killed by validation at the time limit.
    OutOfTime(Duration),
    /// Died of a signal validation did not send.
    Signal(i32, String),
    /// Exited without an answer.
    NoAnswer(String),
}

/// Starts `program try-model`, waiting for its task on stdin.
fn spawn(program: &Path) -> Result<std::process::Child, String> {
    use std::os::unix::process::CommandExt;
    std::process::Command::new(program)
        .arg("try-model")
        .env_clear()
        .envs(child_env())
        .env(PARENT_ENV, std::process::id().to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        // A group of its own, so a kill reaches whatever it started.
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start {} try-model: {e}", program.display()))
}

/// A `try-model` process started before validation began
/// ([`start_ahead`]), already loading libtorch while the manifest is read
/// and the input sampled.
static AHEAD: std::sync::Mutex<Option<std::process::Child>> = std::sync::Mutex::new(None);

/// Starts the `try-model` process of the validation to come, so that its
/// start (a process that loads libtorch: about as long as validating a
/// manifest) overlaps validation instead of following it. `run` and `plan`
/// call it first thing; a process never given a task reads the end of its
/// input when this one exits, and exits too.
pub fn start_ahead() {
    if cfg!(not(feature = "local")) {
        return;
    }
    if let Ok(child) = program().and_then(|p| spawn(&p)) {
        *AHEAD
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(child);
    }
}

/// Runs `program try-model` on `task` (the process started ahead, if it
/// is still waiting), within `limit` and `memory` bytes.
fn run_child(
    program: &Path,
    task: &TaskSpec,
    limit: Duration,
    memory: u64,
) -> Result<Ended, String> {
    use std::io::{Read, Write};
    use std::os::unix::process::ExitStatusExt;
    let input = serde_json::to_vec(task).map_err(|e| format!("cannot encode the task: {e}"))?;
    let ahead = AHEAD
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    let mut child = match ahead {
        Some(mut c) => match c.try_wait() {
            Ok(None) => c,
            _ => spawn(program)?,
        },
        None => spawn(program)?,
    };
    let pid = child.id();
    let mut stdin = child.stdin.take().expect("piped");
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = stdout.read_to_end(&mut out);
        out
    });
    let mut stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = stderr.read_to_end(&mut out);
        out
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let kill = || {
        if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
        }
    };
    let started = std::time::Instant::now();
    let mut killed: Option<(Ended, std::time::Instant)> = None;
    let status = loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(status) => break status.map_err(|e| format!("cannot wait for try-model: {e}"))?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err("lost the try-model process".into())
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some((_, at)) = &killed {
            // Killed, and not gone: stuck in the kernel (a hung mount).
            // Its threads are left behind, not validation.
            if at.elapsed() >= KILL_GRACE {
                return Ok(killed.expect("killed").0);
            }
            continue;
        }
        if started.elapsed() >= limit {
            kill();
            killed = Some((Ended::OutOfTime(limit), std::time::Instant::now()));
        } else if let Some(seen) = peak_resident(pid).filter(|&r| r > memory) {
            kill();
            killed = Some((
                Ended::OverMemory {
                    limit: memory,
                    seen,
                },
                std::time::Instant::now(),
            ));
        }
    };
    let _ = writer.join();
    let out = reader.join().unwrap_or_default();
    let err = errors.join().unwrap_or_default();
    if let Some((k, _)) = killed {
        return Ok(k);
    }
    if let Ok(answer) = serde_json::from_slice::<Answer>(&out) {
        // A peak between two looks, seen by the child itself.
        if let Some(seen) = answer.peak.filter(|&p| p > memory) {
            return Ok(Ended::OverMemory {
                limit: memory,
                seen,
            });
        }
        return Ok(Ended::Answered(answer.tried));
    }
    Ok(match status.signal() {
        // Not sent by validation: the host's out-of-memory killer, an
        // operator; says nothing certain about the model.
        Some(9) => Ended::NoAnswer(format!("killed by SIGKILL from outside: {}", tail(&err))),
        Some(sig) => Ended::Signal(sig, tail(&err)),
        None => Ended::NoAnswer(format!("{status}: {}", tail(&err))),
    })
}

/// A passing trial remembered on this machine, so that the next job of
/// the same model called the same way (a daily re-run on new data) starts
/// no process to try it again: a file named by the digest of the model
/// (its sha256 and how it is called), the job's row layout and tokenizer,
/// the memory limit, the program that tries it and the libtorch it loads
/// (a rebuilt batchfleet, or another torch, tries again), under `$BATCHFLEET_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/batchfleet` or `~/.cache/batchfleet`. Only passes are
/// kept; a cache that cannot be read or written is no cache.
struct Remembered(PathBuf);

impl Remembered {
    fn of(task: &TaskSpec, memory: u64, program: &Path) -> Option<Self> {
        if std::env::var_os(DEBUG_ENV).is_some() {
            return None;
        }
        let dir = std::env::var_os("BATCHFLEET_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("batchfleet"))
            })
            .or_else(|| {
                std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/batchfleet"))
            })?;
        // The program that tries the model, and the libtorch it loads: a
        // rebuilt batchfleet or another torch in the environment tries again.
        let stamp = |p: &Path| {
            let meta = std::fs::metadata(p).ok()?;
            let at = meta
                .modified()
                .ok()?
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?
                .as_nanos();
            Some(format!("{}:{at}:{}", p.display(), meta.len()))
        };
        let libtorch = option_env!("BATCHFLEET_LIBTORCH_LIB")
            .and_then(|d| stamp(&Path::new(d).join("libtorch_cpu.so")));
        let key = serde_json::json!({
            "trial": 1,
            "program": stamp(program)?,
            "libtorch": libtorch,
            "model": task.model,
            "layout": task.layout,
            "text": task.text,
            "memory": memory,
        });
        let digest = batchfleet_shared::fsutil::sha256_bytes(key.to_string().as_bytes());
        Some(Self(dir.join("trials").join(format!("{digest}.json"))))
    }

    fn get(&self) -> Option<batchfleet_worker_probe::Probed> {
        serde_json::from_slice(&std::fs::read(&self.0).ok()?).ok()
    }

    fn put(&self, p: &batchfleet_worker_probe::Probed) {
        let Some(dir) = self.0.parent() else { return };
        let tmp = self.0.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, serde_json::to_vec(p).unwrap_or_default()))
            .and_then(|()| std::fs::rename(&tmp, &self.0));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::debug!(cache = %self.0.display(), error = %e, "cannot remember the model's trial");
        }
    }
}

/// Tries `task`'s model call in a child process (see the module docs):
/// `Err` refuses the job (field, message); what says nothing certain
/// about the model only warns.
fn trial(
    task: &TaskSpec,
    memory: Option<u64>,
) -> Result<Option<batchfleet_worker_probe::Probed>, (&'static str, String)> {
    use batchfleet_worker_probe::ProbeFailure;
    let limit = PROBE_LIMIT.min(Duration::from_millis(task.failure.item_timeout_ms));
    let model = &task.model.path;
    let size = batchfleet_shared::pinned::local_file(model, &task.model.sha256)
        .and_then(|f| std::fs::metadata(f).ok())
        .map_or(0, |m| m.len());
    let memory = memory.unwrap_or_else(|| default_memory(size));
    let warn = |why: String| {
        tracing::warn!(model = %model, reason = %why, "the model call could not be tried on sample rows at validation; workers will report what it does");
        Ok(None)
    };
    let program = match program() {
        Ok(p) => p,
        Err(why) => return warn(why),
    };
    let remembered = Remembered::of(task, memory, &program);
    if let Some(p) = remembered.as_ref().and_then(Remembered::get) {
        // Nothing to try: let a process started ahead for it go.
        if let Some(mut ahead) = AHEAD
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            let _ = ahead.kill();
            let _ = ahead.wait();
        }
        tracing::debug!(model = %model, "the same model call passed its trial before: not tried again");
        return Ok(Some(p));
    }
    let ended = match run_child(&program, task, limit, memory) {
        Ok(e) => e,
        Err(why) => return warn(why),
    };
    match ended {
        Ended::Answered(Ok(p)) => {
            if let Some(r) = &remembered {
                r.put(&p);
            }
            Ok(Some(p))
        }
        Ended::Answered(Err(ProbeFailure::Refused(why))) => {
            let field = if why.contains("[output] select") {
                "[output] select"
            } else if why.contains("pooling") {
                "[output] pooling"
            } else if why.contains("dtype") {
                "[model] dtype"
            } else {
                "[model] path"
            };
            Err((field, format!("{why} (tried on two sample rows at validation)")))
        }
        Ended::Answered(Err(ProbeFailure::Inconclusive(why))) => warn(why),
        Ended::OutOfTime(limit) => warn(format!(
            "it did not return within {} s on two sample rows",
            limit.as_secs_f64()
        )),
        Ended::OverMemory { limit, seen } => Err((
            "[model] path",
            format!(
                "{model} took more than {} MiB of memory on two sample rows ({} MiB when stopped); workers would need at least that for each model they hold. If the model needs it, raise the limit with `--validate-memory` (BATCHFLEET_VALIDATE_MEMORY)",
                limit >> 20,
                seen >> 20
            ),
        )),
        Ended::Signal(sig, stderr) => Err((
            "[model] path",
            format!(
                "{model} killed the process that tried it on two sample rows ({}{}); a worker running it would die the same way. Check the model outside batchfleet (load it with torch.jit.load and call it), or export it again",
                signal_name(sig),
                if stderr.is_empty() { String::new() } else { format!(": {stderr}") }
            ),
        )),
        Ended::NoAnswer(why) => warn(format!("try-model gave no answer ({why})")),
    }
}

/// Tries `task`'s model call as `trial` says (see the module docs).
pub(super) fn check(
    task: &TaskSpec,
    manifest_path: &Path,
    trial_mode: ModelTrial,
) -> Result<(), ManifestError> {
    let refuse = |field: &str, message: String| ManifestError {
        file: manifest_path.to_owned(),
        problems: vec![Problem {
            field: field.into(),
            message,
        }],
    };
    let memory = match trial_mode {
        ModelTrial::Skip => return Ok(()),
        ModelTrial::Child { memory } => memory,
    };
    if cfg!(not(feature = "local")) {
        tracing::info!(model = %task.model.path, "this coordinator is built without libtorch: the model call is not tried at validation (workers check it)");
        return Ok(());
    }
    let Some(p) = trial(task, memory).map_err(|(field, message)| refuse(field, message))? else {
        return Ok(());
    };
    let out = &task.output;
    for (key, names) in [
        ("[output] columns", &out.columns),
        ("[output] labels", &out.labels),
    ] {
        if !names.is_empty() && names.len() != p.width {
            return Err(refuse(
                key,
                format!(
                    "names {} outputs but {} returns {} per row (tried on two sample rows); make them agree",
                    names.len(),
                    task.model.path,
                    p.width
                ),
            ));
        }
    }
    tracing::debug!(width = p.width, parts = ?p.parts, "model call tried on sample rows");
    Ok(())
}
