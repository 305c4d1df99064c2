//! A long-lived worker keeps a bounded number of models loaded: the
//! `--models-kept` most recently used, within `--models-memory` bytes when
//! set, the others dropped and loaded again when a job needs them.

use crate::support::{free_port, stop_all, TestEnv};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::verify::verify;
use std::time::Duration;

/// A worker's metric, summed over its samples.
fn metric(port: &str, name: &str) -> f64 {
    let text = ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .expect("scrape")
        .into_string()
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The one line of a worker's `log` that says a model was dropped from
/// its cache (fails unless there is exactly one).
fn dropped_once(log: &str) -> &str {
    let dropped: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("model dropped from the cache"))
        .collect();
    assert_eq!(dropped.len(), 1, "{log}");
    dropped[0]
}

/// A 400-row job in `env`'s folder `name` (two items), its model an MLP of
/// `features` inputs and `hidden` units: another width, another digest.
fn model_job(env: &TestEnv, name: &str, features: u32, hidden: u32) -> std::path::PathBuf {
    let dir = env.path().join(name);
    let gen = JobGen {
        rows: 400,
        files: 1,
        features,
        hidden,
        name: batchfleet_testkit::services::unique(name),
        pool: env.pool.clone(),
        item_rows: 200,
        batch_size: 100,
        ..JobGen::default()
    };
    make_job(&dir, &gen).expect("generate job");
    dir
}

/// Runs the job in `dir` to its end and checks every row against PyTorch's;
/// its id.
async fn run_verified(env: &TestEnv, dir: &std::path::Path) -> String {
    let (id, report) = crate::support::run_with_config_to_end(
        &env.run_config(),
        &dir.join("job.toml"),
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(report.status, "completed", "{}: {report:?}", dir.display());
    let v = verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}: {}", dir.display(), v.describe());
    id
}

/// Three jobs with three models on a worker that keeps two: the first
/// model is dropped when the third loads (two stay loaded), and a later job
/// of the first model loads it again, which drops the least recently used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_its_most_recently_used_models_and_drops_the_others() {
    let env = TestEnv::new("models");
    let port = free_port();
    let mut workers =
        vec![env.spawn_worker("w1", &["--models-kept", "2", "--metrics-port", &port])];
    env.wait_for_consumers(1, &mut workers).await;
    let mut ids = Vec::new();
    let mut manifests = Vec::new();
    // Three models: another hidden width each, so three digests.
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let dir = model_job(&env, name, 4, 8 + i as u32);
        ids.push(run_verified(&env, &dir).await);
        manifests.push(dir.join("job.toml"));
    }
    let loads = |port: &str| metric(port, "batchfleet_worker_model_load_seconds_count");
    assert_eq!(loads(&port), 3.0, "each model loaded once");
    assert_eq!(
        metric(&port, "batchfleet_worker_models_loaded"),
        2.0,
        "two kept"
    );
    let log = workers[0].log_text();
    assert_eq!(
        log.matches("model dropped from the cache").count(),
        1,
        "the first model went when the third came: {log}"
    );
    // The first model again, in a job of its own (another output folder):
    // loaded anew, and the second model dropped in its turn.
    let mut cfg = env.run_config();
    cfg.overrides = vec!["output.dir=out-again".into()];
    let (again, report) =
        crate::support::run_with_config_to_end(&cfg, &manifests[0], Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!(loads(&port), 4.0, "the dropped model loaded again");
    assert_eq!(metric(&port, "batchfleet_worker_models_loaded"), 2.0);
    assert_eq!(
        workers[0]
            .log_text()
            .matches("model dropped from the cache")
            .count(),
        2
    );
    ids.push(again);
    stop_all(&mut workers);
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.cleanup(&ids).await;
}

/// Recycling, as Celery's `max_tasks_per_child`: a worker with
/// `--max-items 4` (and one item at a time) stops taking items once it has
/// handled four, and exits 75 for its supervisor to start
/// a fresh process; a worker with a `--max-rss` below what it holds exits
/// the same way before it takes anything. The job completes on the workers
/// that replace them, every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_recycles_itself_after_max_items_or_past_max_rss() {
    let env = TestEnv::new("recycle");
    let gen = JobGen {
        rows: 2_000,
        files: 1,
        features: 4,
        hidden: 8,
        name: batchfleet_testkit::services::unique("recycle"),
        pool: env.pool.clone(),
        item_rows: 100,
        batch_size: 100,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let manifest = env.path().join("job.toml");
    // A resident set below any worker's: it drains at its first look.
    let mut bloated = env.spawn_worker("bloated", &["--max-rss", "1MiB"]);
    let status = bloated.terminate_when_exited(Duration::from_secs(60));
    assert_eq!(status.code(), Some(75), "{}", bloated.log_text());
    assert!(
        bloated.log_text().contains("--max-rss"),
        "{}",
        bloated.log_text()
    );
    let mut first = vec![env.spawn_worker(
        "first",
        &["--max-items", "4", "--prefetch", "1", "--prefetch-max", "1"],
    )];
    env.wait_for_consumers(1, &mut first).await;
    let run = {
        let (cfg, manifest) = (env.run_config(), manifest.clone());
        tokio::spawn(async move {
            crate::support::run_with_config_to_end(&cfg, &manifest, Duration::from_secs(120)).await
        })
    };
    let status = first[0].terminate_when_exited(Duration::from_secs(60));
    assert_eq!(status.code(), Some(75), "{}", first[0].log_text());
    let log = first[0].log_text();
    assert_eq!(
        log.matches("item committed rows=").count(),
        4,
        "four items, then no more:\n{log}"
    );
    assert!(log.contains("recycling after 4 items"), "{log}");
    // Its successor finishes the job.
    let mut next = vec![env.spawn_worker("next", &[])];
    let (id, report) = run.await.expect("job task");
    assert_eq!(report.status, "completed", "{report:?}");
    let v = verify(
        &env.path().join("out"),
        &env.path().join("golden.csv"),
        1e-5,
    )
    .expect("verify");
    assert!(v.ok(), "{}", v.describe());
    stop_all(&mut next);
    env.cleanup(&[&id]).await;
}

/// The cache bounded by bytes as well as by count: three models of three
/// sizes on a worker that may keep eight but only as many bytes as the
/// larger pair of consecutive ones. The third load drops the first (the
/// least recently used), not the second, and the bytes the worker says it
/// holds are the two files it kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_its_models_within_models_memory() {
    let env = TestEnv::new("models-bytes");
    let dirs: Vec<_> = [("a", 64), ("b", 512), ("c", 256)]
        .into_iter()
        .map(|(name, hidden)| model_job(&env, name, 16, hidden))
        .collect();
    let size = |d: &std::path::Path| std::fs::metadata(d.join("model.pt")).expect("model").len();
    let (a, b, c) = (size(&dirs[0]), size(&dirs[1]), size(&dirs[2]));
    let bound = (a + b).max(b + c);
    assert!(a + b + c > bound);
    let port = free_port();
    let mut workers = vec![env.spawn_worker(
        "w1",
        &[
            "--models-kept",
            "8",
            "--models-memory",
            &bound.to_string(),
            "--metrics-port",
            &port,
        ],
    )];
    env.wait_for_consumers(1, &mut workers).await;
    let mut ids = Vec::new();
    for dir in &dirs {
        ids.push(run_verified(&env, dir).await);
    }
    assert_eq!(
        metric(&port, "batchfleet_worker_model_load_seconds_count"),
        3.0
    );
    assert_eq!(metric(&port, "batchfleet_worker_models_loaded"), 2.0);
    assert_eq!(
        metric(&port, "batchfleet_worker_models_loaded_bytes"),
        (b + c) as f64,
        "the second and third kept"
    );
    let log = workers[0].log_text();
    let dropped = dropped_once(&log);
    assert!(
        dropped.contains("/a/model.pt") && dropped.contains("--models-memory"),
        "{dropped}"
    );
    stop_all(&mut workers);
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.cleanup(&ids).await;
}

/// Bytes of address space a process has mapped (`VmSize`).
fn mapped(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize");
    kb << 10
}

/// Issue: a model load that ran out of memory was classed like any load
/// error: the job of a healthy model failed (`unrunnable`) because other
/// models filled the worker. Here a worker holds model A (256 MiB of
/// weights) and is then held to 3.5 × 256 MiB of address space more
/// (`prlimit`, as a cgroup or a smaller GPU would hold it): loading model
/// B, which takes about four times its size at its peak (the file read,
/// and libtorch's copies of it), runs out there with A loaded. The worker
/// drops A, loads B again, and B's job completes with every row as
/// PyTorch predicts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_out_of_memory_drops_the_other_models_and_loads_again() {
    const MIB: u32 = 256;
    let env = TestEnv::new("models-oom");
    let dirs: Vec<_> = [("a", 1.0), ("b", 2.0)]
        .into_iter()
        .map(|(name, fill)| {
            let dir = model_job(&env, name, 16, 32);
            batchfleet_testkit::python::make_heavy_model(&dir, MIB, fill).expect("heavy model");
            dir
        })
        .collect();
    // One malloc arena: threads started later reserve no arena of their own
    // inside the limit.
    let mut workers = vec![env.spawn_worker_with_env(
        "w1",
        &["--models-kept", "4"],
        &[("MALLOC_ARENA_MAX", "1".to_owned())],
    )];
    env.wait_for_consumers(1, &mut workers).await;
    let a = run_verified(&env, &dirs[0]).await;
    let pid = workers[0].child.id();
    let limit = mapped(pid) + (u64::from(MIB) << 20) * 7 / 2;
    let set = std::process::Command::new("prlimit")
        .arg("--pid")
        .arg(pid.to_string())
        .arg(format!("--as={limit}:{limit}"))
        .status()
        .expect("prlimit");
    assert!(set.success(), "prlimit --as on the worker");
    let b = run_verified(&env, &dirs[1]).await;
    let log = workers[0].log_text();
    assert!(
        log.contains("out of memory loading the model; dropping the other models and trying again"),
        "the first load of B ran out of memory:\n{log}"
    );
    let dropped = dropped_once(&log);
    assert!(
        dropped.contains("/a/model.pt") && dropped.contains("out of memory loading another"),
        "{dropped}"
    );
    stop_all(&mut workers);
    env.cleanup(&[&a, &b]).await;
}

/// Issue: the model cache was keyed by the model file alone, so a worker
/// that had run a model as saved was handed that module again for a job
/// asking for it in another precision (or on another device). Here one
/// worker runs the same file as saved (float32), then in bfloat16, then as
/// saved again: the bfloat16 job gets a module of its own (its scores
/// differ from float32's, though close), and the float32 module stays
/// cached for the third job (two loads in all, every float32 row exact).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_in_another_precision_is_loaded_apart_and_the_first_stays_cached() {
    let env = TestEnv::new("models-dtype");
    let dir = model_job(&env, "m", 16, 64);
    let text = std::fs::read_to_string(dir.join("job.toml")).expect("manifest");
    let variant = |name: &str, out: &str, dtype: &str| {
        let path = dir.join(format!("{name}.toml"));
        let changed = text
            .replace("dir = \"out\"", &format!("dir = \"{out}\""))
            .replace("device = \"cpu\"", &format!("device = \"cpu\"{dtype}"));
        std::fs::write(&path, changed).expect("manifest");
        path
    };
    let bf16 = variant("bf16", "out-bf16", "\ndtype = \"bfloat16\"");
    let again = variant("again", "out-again", "");
    let port = free_port();
    let mut workers =
        vec![env.spawn_worker("w1", &["--models-kept", "4", "--metrics-port", &port])];
    env.wait_for_consumers(1, &mut workers).await;
    let mut ids = vec![run_verified(&env, &dir).await];
    for (manifest, out) in [(&bf16, "out-bf16"), (&again, "out-again")] {
        let (id, report) = crate::support::run_with_config_to_end(
            &env.run_config(),
            manifest,
            Duration::from_secs(120),
        )
        .await;
        assert_eq!(report.status, "completed", "{report:?}");
        ids.push(id);
        let v = verify(&dir.join(out), &dir.join("golden.csv"), 0.5).expect("verify");
        assert!(v.ok(), "{out}: {}", v.describe());
        if out == "out-bf16" {
            assert!(
                v.max_abs_diff > 1e-4,
                "bfloat16 scores equal float32's ({}): the cached float32 module ran",
                v.max_abs_diff
            );
        } else {
            assert!(v.max_abs_diff < 1e-5, "{out}: {}", v.describe());
        }
    }
    assert_eq!(
        metric(&port, "batchfleet_worker_model_load_seconds_count"),
        2.0,
        "float32 loaded once, bfloat16 once"
    );
    assert_eq!(metric(&port, "batchfleet_worker_models_loaded"), 2.0);
    stop_all(&mut workers);
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.cleanup(&ids).await;
}
