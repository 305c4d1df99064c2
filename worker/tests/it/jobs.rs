//! Many jobs on one fleet, against the real RabbitMQ, Redis and libtorch:
//! what a job is (its inputs' fingerprints), how long its state lives
//! (retention, `gc`), and a Redis that could evict it.

use crate::support::{stop_all, TestEnv};
use batchfleet_coordinator::manifest;
use batchfleet_shared::endpoint::Endpoint;
use batchfleet_shared::secret::SecretUrl;
use batchfleet_shared::store::{JobRecord, JobStatus, Store, StoreError};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::verify::verify;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A 2,000-row job in two files of 4 items each.
fn job(env: &TestEnv) -> PathBuf {
    let gen = JobGen {
        rows: 2_000,
        files: 2,
        features: 8,
        hidden: 16,
        name: batchfleet_testkit::services::unique("lineage"),
        pool: env.pool.clone(),
        item_rows: 250,
        batch_size: 64,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    env.path().join("job.toml")
}

/// Gives `path` a later modification time, its bytes unchanged: a file
/// rewritten in place with the same length.
fn touch(path: &Path) {
    let later = std::time::SystemTime::now() + Duration::from_secs(120);
    std::fs::File::options()
        .write(true)
        .open(path)
        .expect("open input")
        .set_modified(later)
        .expect("set mtime");
}

async fn redis(env: &TestEnv) -> redis::aio::MultiplexedConnection {
    redis::Client::open(env.redis.url.expose())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis")
}

async fn pttl(c: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(c)
        .await
        .expect("PTTL")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_changed_under_a_job_fails_its_items_and_a_changed_input_is_a_new_job() {
    let env = TestEnv::new("lineage");
    let manifest = job(&env);
    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let cfg = env.run_config();

    // Validated and planned with the inputs as they are; then the first file
    // is rewritten in place (same bytes, a later time) before any item is read.
    let spec = manifest::load(&manifest, &[]).expect("manifest");
    let changed = spec.files[0].clone();
    touch(&changed);
    let run = batchfleet_coordinator::run_spec(
        &cfg,
        &spec,
        batchfleet_shared::now_ms(),
        tokio_util::sync::CancellationToken::new(),
    );
    let outcome = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .expect("settled in time")
        .expect("ran");
    let batchfleet_coordinator::RunOutcome::Completed { report, .. } = outcome else {
        panic!("expected a settled job, got {outcome:?}");
    };
    // The changed file's four items failed with the reason; the other
    // file's were predicted.
    assert_eq!(report.status, "completed_with_failures", "{report:?}");
    assert_eq!((report.items_failed, report.items_completed), (4, 4));
    for f in &report.failed_items {
        assert_eq!(f.class, "poison", "{f:?}");
        assert!(
            f.reason.contains(&*changed.to_string_lossy())
                && f.reason.contains("the input changed under the job")
                && f.reason.contains("modified "),
            "{f:?}"
        );
    }
    assert_eq!(report.rows_predicted, 1_000);
    // The summary lists each input with what it was when planned, and the
    // manifest it ran.
    assert_eq!(report.inputs.len(), 2);
    for (input, fp) in report.inputs.iter().zip(&spec.fingerprints) {
        assert_eq!(&input.fingerprint, fp);
        let len = std::fs::metadata(&input.path).expect("input").len();
        assert_eq!(input.fingerprint.size, len);
    }
    let now = batchfleet_shared::source::Input::open(&changed)
        .and_then(|i| i.fingerprint())
        .expect("fingerprint");
    assert_ne!(report.inputs[0].fingerprint.mtime_ns, now.mtime_ns);
    let resolved = report
        .resolved_manifest
        .as_ref()
        .expect("resolved manifest");
    assert_eq!(resolved["job"]["pool"], env.pool.as_str());

    // Run again: the changed input makes another job, which refuses the
    // first job's output folder, naming both.
    let again = manifest::load(&manifest, &[]).expect("manifest").job_id;
    assert_ne!(again, spec.job_id);
    let err = batchfleet_coordinator::run_job(
        &cfg,
        &manifest,
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .expect_err("another job's output folder");
    let text = err.to_string();
    assert!(
        text.contains(&spec.job_id) && text.contains(&again) && text.contains("[output] dir"),
        "{text}"
    );
    // Into a folder of its own (`--set`), the new job predicts every row
    // once, equal to PyTorch's.
    let mut cfg2 = cfg.clone();
    cfg2.overrides = vec!["output.dir=out-2".into()];
    let (new_id, report) =
        crate::support::run_with_config_to_end(&cfg2, &manifest, Duration::from_secs(180)).await;
    assert_ne!(new_id, again, "the override is part of the job");
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!(report.overrides, ["output.dir=out-2"]);
    let v = verify(
        &env.path().join("out-2"),
        &env.path().join("golden.csv"),
        1e-5,
    )
    .expect("verify");
    assert!(v.ok(), "{}", v.describe());
    stop_all(&mut workers);
    env.cleanup(&[&spec.job_id, &new_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_jobs_state_expires_after_the_retention_and_a_running_ones_never() {
    let env = TestEnv::new("retain");
    let manifest = job(&env);
    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let mut cfg = env.run_config();
    cfg.connections.retention = Duration::from_secs(3600);
    let (id, report) =
        crate::support::run_with_config_to_end(&cfg, &manifest, Duration::from_secs(180)).await;
    assert_eq!(report.status, "completed");
    let mut c = redis(&env).await;
    let key = batchfleet_shared::store::redis::job_scoped(&env.prefix, &id, "");
    // Every key of the finished job has the retention as its time to live.
    for k in [
        key.clone(),
        format!("{key}:donebits"),
        format!("{key}:stats"),
        format!("{key}:inputs"),
    ] {
        let ttl = pttl(&mut c, &k).await;
        assert!(ttl > 3_500_000 && ttl <= 3_600_000, "{k}: PTTL {ttl}");
    }
    // Run again (as `run` after a failure would): running, it is kept for good.
    let store = env.connections().store().await.expect("redis");
    store.persist_job(&id).await.expect("persist");
    assert_eq!(pttl(&mut c, &key).await, -1);
    assert_eq!(pttl(&mut c, &format!("{key}:donebits")).await, -1);
    // A short retention: the state goes, the summary stays, and `compare`
    // still reads it from the output folder.
    store
        .expire_job(&id, Duration::from_millis(50))
        .await
        .expect("expire");
    let gone = async {
        while store.job(&id).await.expect("read").is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), gone)
        .await
        .expect("the state expired");
    let exists: u32 = redis::cmd("EXISTS")
        .arg(format!("{key}:donebits"))
        .arg(format!("{key}:stats"))
        .arg(format!("{key}:inputs"))
        .query_async(&mut c)
        .await
        .expect("EXISTS");
    assert_eq!(exists, 0);
    let summary: batchfleet_coordinator::reducer::Summary = serde_json::from_slice(
        &std::fs::read(env.path().join("out/_summary.json")).expect("the summary stays"),
    )
    .expect("a summary");
    assert_eq!(summary.job_id, id);
    let listed = batchfleet_coordinator::status::jobs(&store, 20)
        .await
        .expect("jobs");
    assert!(
        listed.iter().all(|j| j.id != id),
        "an expired job is not listed"
    );
    assert!(
        store
            .recent_jobs(20)
            .await
            .unwrap()
            .iter()
            .all(|j| *j != id),
        "its listing went with it"
    );
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

fn record(id: &str, status: JobStatus, created_ms: u64, finished_ms: u64) -> JobRecord {
    JobRecord {
        name: "gc".into(),
        status,
        manifest: "/m.toml".into(),
        output_dir: format!("/out/{id}"),
        model_sha256: "00".repeat(32),
        items_total: 1,
        rows_total: 1,
        created_ms,
        published_ms: created_ms,
        finished_ms,
        items_published: 1,
        ..JobRecord::sample(id)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_removes_exactly_the_finished_jobs_older_than_the_cutoff() {
    let env = TestEnv::new("gc");
    let store = env.connections().store().await.expect("redis");
    let now = batchfleet_shared::now_ms();
    let (h, m) = (3_600_000, 60_000);
    let jobs = [
        record("old-done", JobStatus::Completed, now - 3 * h, now - 2 * h),
        record(
            "old-failures",
            JobStatus::CompletedWithFailures,
            now - 3 * h,
            now - 2 * h,
        ),
        record("old-failed", JobStatus::Failed, now - 3 * h, now - 2 * h),
        record("new-done", JobStatus::Completed, now - 3 * h, now - m),
        record("old-running", JobStatus::Running, now - 5 * h, 0),
        record("old-planning", JobStatus::Planning, now - 5 * h, 0),
    ];
    for j in &jobs {
        store.put_job(j).await.expect("put");
        store
            .commit_item(&j.id, &stats(), &[])
            .await
            .expect("commit");
    }
    let old = ["old-done", "old-failed", "old-failures"];
    // A dry run lists them and removes nothing.
    let listed = batchfleet_coordinator::control::gc(&store, Duration::from_secs(3600), true)
        .await
        .expect("gc --dry-run");
    let mut ids: Vec<&str> = listed.iter().map(|c| c.job_id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, old);
    for j in &jobs {
        assert!(store.job(&j.id).await.unwrap().is_some(), "{}", j.id);
    }
    // The real one removes every key of exactly those.
    let removed = batchfleet_coordinator::control::gc(&store, Duration::from_secs(3600), false)
        .await
        .expect("gc");
    assert_eq!(removed.len(), 3);
    for j in &jobs {
        let kept = store.job(&j.id).await.unwrap().is_some();
        assert_eq!(kept, !old.contains(&j.id.as_str()), "{}", j.id);
        assert_eq!(store.is_done(&j.id, 0).await.unwrap(), kept, "{}", j.id);
    }
    let listed: Vec<String> = batchfleet_coordinator::status::jobs(&store, 20)
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(listed.len(), 3, "{listed:?}");
    // Everything finished, at once: a running job is still never touched.
    let removed = batchfleet_coordinator::control::gc(&store, Duration::ZERO, false)
        .await
        .expect("gc");
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].job_id, "new-done");
    env.cleanup(&["old-running", "old-planning"]).await;
}

fn stats() -> batchfleet_shared::store::ItemStats {
    serde_json::from_value(serde_json::json!({
        "seq": 0, "rows": 1, "rows_rejected": 0, "worker": "w", "started_ms": 0,
        "finished_ms": 1, "attempt": 1, "recovered": false
    }))
    .expect("stats")
}

/// A Redis of the test's own on a free port, with `policy` as its
/// `maxmemory-policy`; stopped when dropped.
struct OwnRedis {
    child: std::process::Child,
    port: u16,
}

impl OwnRedis {
    fn start(policy: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--maxmemory-policy", policy])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server");
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "redis on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_job_state_is_refused_at_start() {
    let env = TestEnv::new("evict");
    let evicting = OwnRedis::start("allkeys-lru");
    let url = Endpoint::redis(SecretUrl::new(evicting.url()));
    let err = Store::connect(&url, "bf", Duration::from_secs(5))
        .await
        .expect_err("an evicting Redis is refused");
    assert!(matches!(err, StoreError::Evicts { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("maxmemory-policy allkeys-lru")
            && text.contains("CONFIG SET maxmemory-policy noeviction"),
        "{text}"
    );
    // The worker refuses it too, saying why, and exits.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_batchfleet-worker"))
        .args(["--redis-url", &evicting.url(), "--pool", &env.pool])
        .args(["--outage-timeout", "5s", "--allow-any-path"])
        .output()
        .expect("worker");
    // Final: the exit code that tells systemd and Kubernetes not to restart it.
    assert_eq!(
        out.status.code(),
        Some(i32::from(batchfleet_worker::EXIT_CONFIG))
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("maxmemory-policy allkeys-lru"), "{stderr}");
    // A volatile policy evicts only keys with a time to live (finished
    // jobs'): accepted, as noeviction is.
    for policy in ["volatile-lru", "noeviction"] {
        let fine = OwnRedis::start(policy);
        let url = Endpoint::redis(SecretUrl::new(fine.url()));
        Store::connect(&url, "bf", Duration::from_secs(5))
            .await
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
    }
}

/// A job of `rows` rows in one file, items of `item_rows`, checkpoints
/// every 2 mini-batches of 50 rows, in folder `dir`.
fn slow_job(env: &TestEnv, dir: &Path, rows: u64, item_rows: u64) -> PathBuf {
    let gen = JobGen {
        rows,
        files: 1,
        features: 8,
        hidden: 16,
        name: batchfleet_testkit::services::unique("ctl"),
        pool: env.pool.clone(),
        item_rows,
        batch_size: 50,
        checkpoint_every: Some(2),
        ..JobGen::default()
    };
    make_job(dir, &gen).expect("generate job");
    dir.join("job.toml")
}

/// Waits (polling the store, at most `limit`) until `done` holds of the job's progress.
async fn until(
    store: &Store,
    job: &str,
    limit: Duration,
    done: impl Fn(&batchfleet_shared::store::Progress) -> bool,
) -> batchfleet_shared::store::Progress {
    let wait = async {
        loop {
            if let Ok(p) = store.progress(job).await {
                if p.items_total > 0 && done(&p) {
                    return p;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(limit, wait)
        .await
        .expect("the job got there in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_stops_at_checkpoints_keeps_its_parts_and_runs_again_exactly_once() {
    let env = TestEnv::new("cancel");
    // 10 items of 400 rows; each mini-batch takes 100 ms more, so an item
    // takes about 0.8 s, a checkpoint segment (2 mini-batches) 0.2 s.
    let manifest = slow_job(&env, env.path(), 4_000, 400);
    let slow = [
        "--debug-batch-delay",
        "100ms",
        "--heartbeat",
        "200ms",
        "--prefetch",
        "1",
    ];
    let mut workers = vec![env.spawn_worker("w1", &slow), env.spawn_worker("w2", &slow)];
    env.wait_for_consumers(2, &mut workers).await;
    let cfg = env.run_config();
    let store = env.connections().store().await.expect("redis");
    let id = manifest::load(&manifest, &[]).expect("manifest").job_id;
    let follower = tokio::spawn({
        let (cfg, manifest) = (cfg.clone(), manifest.clone());
        async move {
            batchfleet_coordinator::run_job(
                &cfg,
                &manifest,
                tokio_util::sync::CancellationToken::new(),
            )
            .await
        }
    });
    // Some items committed, and one in flight past its first segment with
    // three to go (0.6 s) when its heartbeat (every 0.2 s) learns of the cancel.
    until(&store, &id, Duration::from_secs(60), |p| p.items_done >= 1).await;
    let mid_item = async {
        loop {
            let leases = store.leases(&id).await.expect("leases");
            if leases.iter().any(|l| l.rows_done == 100) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), mid_item)
        .await
        .expect("an item reached its first checkpoint");
    let cancelled = batchfleet_coordinator::cancel_job(&cfg, &store, &id, "a wrong manifest")
        .await
        .expect("cancel");
    assert!(cancelled.cancelled, "{cancelled:?}");
    assert!(
        cancelled.summary.is_none(),
        "the follower writes the summary"
    );
    let at_cancel = store.progress(&id).await.expect("progress").items_done;
    let outcome = tokio::time::timeout(Duration::from_secs(60), follower)
        .await
        .expect("the follower ended")
        .expect("joined")
        .expect("ran");
    assert_eq!(
        batchfleet_coordinator::cli::exit_code(&outcome),
        6,
        "{outcome:?}"
    );
    let batchfleet_coordinator::RunOutcome::Completed { report, .. } = &outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(report.status, "cancelled");
    assert_eq!(report.failed_reason.as_deref(), Some("a wrong manifest"));
    assert!(
        report.items_completed < 10 && report.items_skipped > 0,
        "{report:?}"
    );
    // In-flight items stop at a checkpoint: within a heartbeat and a
    // segment no lease is left, and nothing more is committed.
    let wait = async {
        while !store.leases(&id).await.expect("leases").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("in-flight items stopped within the checkpoint interval");
    let logs: String = workers.iter().map(|w| w.log_text()).collect();
    assert!(logs.contains("the item stops at this checkpoint"), "{logs}");
    let done = store.done_items(&id).await.expect("done");
    assert_eq!(done.len() as u64, at_cancel);
    assert_eq!(report.items_completed, at_cancel);
    let out = env.path().join("out");
    assert!(!out.join("_SUCCESS").exists());
    let parts = std::fs::read_dir(&out)
        .expect("out")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("part-"))
        })
        .count() as u64;
    assert!(parts >= at_cancel, "committed part files stay");
    // Cancelling again changes nothing.
    let again = batchfleet_coordinator::cancel_job(&cfg, &store, &id, "again")
        .await
        .expect("cancel");
    assert!(!again.cancelled && again.status == "cancelled", "{again:?}");

    // Run again: the same job, continued from what was committed, every row
    // exactly once and equal to PyTorch's.
    let (rerun, report) =
        crate::support::run_with_config_to_end(&cfg, &manifest, Duration::from_secs(120)).await;
    assert_eq!(rerun, id);
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!((report.items_completed, report.rows_predicted), (10, 4_000));
    let v = verify(&out, &env.path().join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

/// An HTTP server on a free port answering 200 to everything, counting requests.
fn counting_server() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut len = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; len];
            let _ = reader.read_exact(&mut body);
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    (port, count)
}

/// `batchfleet` on `env`'s services, without a progress bar.
pub(crate) fn coordinator(env: &TestEnv) -> std::process::Command {
    let mut c = std::process::Command::new(
        Path::new(env!("CARGO_BIN_EXE_batchfleet-worker")).with_file_name("batchfleet"),
    );
    c.args(["--redis-prefix", &env.prefix])
        .env("BATCHFLEET_AMQP_URL", env.amqp.url.expose())
        .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
        .env("BATCHFLEET_NO_PROGRESS", "1")
        // The test's webhook server speaks plain HTTP on loopback.
        .env("BATCHFLEET_HOOK_ALLOW_HTTP", "1");
    c
}

/// `batchfleet run MANIFEST --detach --json`, which must exit 0: the one
/// JSON object it prints.
pub(crate) fn run_detached(env: &TestEnv, manifest: &Path) -> serde_json::Value {
    let out = coordinator(env)
        .arg("run")
        .arg(manifest)
        .args(["--detach", "--json"])
        .output()
        .expect("run --detach");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Adds an `[on_complete]` that appends the job id to `hooks.log` and posts to `port`.
fn with_hooks(manifest: &Path, port: u16) {
    let mut text = std::fs::read_to_string(manifest).expect("manifest");
    text.push_str(&format!(
        "\n[on_complete]\ncommand = [\"sh\", \"-c\", \"echo $BATCHFLEET_JOB_ID >> hooks.log\"]\nwebhook = \"http://127.0.0.1:{port}/done\"\n"
    ));
    std::fs::write(manifest, text).expect("manifest");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_job_is_reduced_exactly_once_by_its_waiters_or_the_supervisor() {
    let env = TestEnv::new("detach");
    let (port, posts) = counting_server();
    let (a_dir, b_dir) = (env.path().join("a"), env.path().join("b"));
    let a = slow_job(&env, &a_dir, 2_000, 250);
    let b = slow_job(&env, &b_dir, 2_000, 250);
    with_hooks(&a, port);
    with_hooks(&b, port);
    let slow = [
        "--debug-batch-delay",
        "10ms",
        "--data-root",
        env.path().to_str().expect("utf8"),
    ];
    let mut workers = vec![env.spawn_worker("w1", &slow), env.spawn_worker("w2", &slow)];
    env.wait_for_consumers(2, &mut workers).await;

    // Detached: the job id on stdout as soon as the items are published.
    let detached = run_detached(&env, &a);
    assert_eq!(
        (detached["status"].as_str(), detached["detached"].as_bool()),
        (Some("running"), Some(true))
    );
    assert_eq!(detached["items"], 8);
    let id = detached["job_id"].as_str().expect("job id").to_owned();
    // Two processes wait for it, and a supervisor runs: one of them
    // supervises, exactly one reduces and runs the hooks.
    let wait = || {
        coordinator(&env)
            .args(["wait", &id, "--json"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("wait")
    };
    let (w1, w2) = (wait(), wait());
    let log = env.path().join("supervise.log");
    let supervisor = coordinator(&env)
        .args(["supervise", "--pool", &env.pool, "--every", "200ms"])
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("supervise");
    let mut supervisor = crate::support::Worker {
        child: supervisor,
        log,
    };
    for w in [w1, w2] {
        let out = w.wait_with_output().expect("waited");
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(
            (v["job_id"].as_str(), v["status"].as_str()),
            (Some(id.as_str()), Some("completed"))
        );
        assert_eq!(v["report"]["rows_predicted"], 2_000);
        assert_eq!(v["exit_code"], 0);
    }
    assert!(a_dir.join("out/_SUCCESS").is_file());
    let hooks = std::fs::read_to_string(a_dir.join("hooks.log")).expect("the command hook ran");
    assert_eq!(
        hooks.lines().collect::<Vec<_>>(),
        [id.as_str()],
        "exactly one command"
    );

    // A detached job nobody waits for: the supervisor finishes it.
    let out = coordinator(&env)
        .args(["run", b.to_str().expect("utf8"), "--detach"])
        .output()
        .expect("run --detach");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b_id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(b_id.starts_with("ctl-"), "{b_id}");
    let store = env.connections().store().await.expect("redis");
    let reduced = async {
        loop {
            if let Ok(Some(j)) = store.job(&b_id).await {
                if batchfleet_coordinator::is_reduced(&j) {
                    return j;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let job = tokio::time::timeout(Duration::from_secs(120), reduced)
        .await
        .expect("the supervisor reduced the job");
    assert_eq!(job.status, JobStatus::Completed);
    assert!(b_dir.join("out/_SUCCESS").is_file());
    let v = verify(&b_dir.join("out"), &b_dir.join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    let hooks = std::fs::read_to_string(b_dir.join("hooks.log")).unwrap_or_else(|e| {
        panic!(
            "the command hook ran: {e}; supervise:\n{}",
            supervisor.log_text()
        )
    });
    assert_eq!(hooks.lines().count(), 1);
    // One webhook call per job, and `wait` on a finished job reports it at once.
    let hooked = async {
        while posts.load(std::sync::atomic::Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), hooked)
        .await
        .expect("two webhooks");
    let out = coordinator(&env)
        .args(["wait", &b_id])
        .output()
        .expect("wait");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        posts.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "no hook ran twice"
    );
    assert_eq!(
        std::fs::read_to_string(b_dir.join("hooks.log"))
            .expect("log")
            .lines()
            .count(),
        1
    );
    // SIGTERM stops the supervisor cleanly.
    assert!(supervisor.terminate(Duration::from_secs(20)).success());
    stop_all(&mut workers);
    env.cleanup(&[&id, &b_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_nobody_serves_is_named_by_run_and_status() {
    let env = TestEnv::new("nobody");
    let manifest = slow_job(&env, env.path(), 200, 100);
    let mut run = coordinator(&env)
        .args(["run", manifest.to_str().expect("utf8")])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let stderr = run.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let warned = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("run said something about the pool within a minute");
        if line.contains("no worker consumes pool") {
            break line;
        }
    };
    assert!(
        warned.contains(&format!("batchfleet-worker --pool {}", env.pool))
            && warned.contains(&format!("bf.{}.work", env.pool)),
        "{warned}"
    );
    let id = manifest::load(&manifest, &[]).expect("manifest").job_id;
    let status = coordinator(&env)
        .args(["status", &id])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains(&format!("0 consuming bf.{}.work", env.pool))
            && text.contains("no worker serves this pool"),
        "{text}"
    );
    let _ = run.kill();
    let _ = run.wait();
    // A worker arrives: the job completes, and status counts it.
    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let status = coordinator(&env)
        .args(["status", &id, "--json"])
        .output()
        .expect("status");
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).expect("json");
    assert_eq!(v["consumers"], 1);
    // Without an id: the job registered last (the only one under this prefix).
    let latest = coordinator(&env)
        .args(["status", "--json"])
        .output()
        .expect("status");
    let v: serde_json::Value = serde_json::from_slice(&latest.stdout).expect("json");
    assert_eq!(v["id"], id.as_str());
    let out = coordinator(&env)
        .args(["wait", &id])
        .output()
        .expect("wait");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

/// Rows of each job committed while both ran — between the later first
/// start and the earlier last finish of their items — and that stretch's
/// length in seconds.
async fn overlap(store: &Store, a: &str, b: &str) -> ((u64, u64), f64) {
    let (sa, sb) = (
        store.item_stats(a).await.expect("stats"),
        store.item_stats(b).await.expect("stats"),
    );
    let start = |s: &[batchfleet_shared::store::ItemStats]| {
        s.iter().map(|i| i.started_ms).min().unwrap_or(0)
    };
    let end = |s: &[batchfleet_shared::store::ItemStats]| {
        s.iter().map(|i| i.finished_ms).max().unwrap_or(0)
    };
    let (from, to) = (start(&sa).max(start(&sb)), end(&sa).min(end(&sb)));
    let rows = |s: &[batchfleet_shared::store::ItemStats]| {
        s.iter()
            .filter(|i| i.finished_ms > from && i.finished_ms <= to)
            .map(|i| i.rows)
            .sum::<u64>()
    };
    (
        (rows(&sa), rows(&sb)),
        to.saturating_sub(from) as f64 / 1000.0,
    )
}

/// A job of `items` items of 200 rows in its own folder, with `priority`;
/// each item takes about 0.2 s on a worker with a 50 ms batch delay.
fn share_job(env: &TestEnv, name: &str, items: u64, priority: &str) -> PathBuf {
    let dir = env.path().join(name);
    let manifest = slow_job(env, &dir, items * 200, 200);
    let text = std::fs::read_to_string(&manifest)
        .expect("manifest")
        .replacen("[job]\n", &format!("[job]\npriority = \"{priority}\"\n"), 1);
    std::fs::write(&manifest, text).expect("manifest");
    manifest
}

/// A worker for the sharing tests: one item at a time, 50 ms per
/// mini-batch, and the flags `extra`.
fn share_worker(env: &TestEnv, id: &str, extra: &[&str]) -> crate::support::Worker {
    let mut flags = vec![
        "--debug-batch-delay",
        "50ms",
        "--prefetch",
        "1",
        "--prefetch-max",
        "1",
        "--data-root",
        env.path().to_str().expect("utf8"),
        "--debug-retired-grace",
        "1s",
    ];
    flags.extend_from_slice(extra);
    env.spawn_worker(id, &flags)
}

/// The two workers of the sharing tests.
fn share_workers(env: &TestEnv) -> Vec<crate::support::Worker> {
    vec![share_worker(env, "w1", &[]), share_worker(env, "w2", &[])]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_equal_jobs_share_the_fleet_evenly() {
    let env = TestEnv::new("share");
    let (a, b) = (
        share_job(&env, "a", 30, "normal"),
        share_job(&env, "b", 30, "normal"),
    );
    let mut workers = share_workers(&env);
    env.wait_for_consumers(2, &mut workers).await;
    let cfg = env.run_config();
    let limit = Duration::from_secs(180);
    let ((id_a, ra), (id_b, rb)) = tokio::join!(
        crate::support::run_with_config_to_end(&cfg, &a, limit),
        crate::support::run_with_config_to_end(&cfg, &b, limit)
    );
    assert_eq!(
        (ra.status.as_str(), rb.status.as_str()),
        ("completed", "completed")
    );
    let store = env.connections().store().await.expect("redis");
    let ((rows_a, rows_b), secs) = overlap(&store, &id_a, &id_b).await;
    let share = rows_a as f64 / (rows_a + rows_b).max(1) as f64;
    println!(
        "two normal jobs on 2 workers: while both ran ({secs:.1} s), A {:.0} rows/s, B {:.0} rows/s: A's share {:.0}%",
        rows_a as f64 / secs,
        rows_b as f64 / secs,
        share * 100.0
    );
    assert!(secs > 2.0, "the jobs ran side by side ({secs} s)");
    assert!(
        (0.4..=0.6).contains(&share),
        "A's share {share}: {rows_a} vs {rows_b} rows"
    );
    // Off the list at once; their queues deleted by the workers once the
    // pool has no active job and the (here 1 s) grace has passed.
    assert!(store
        .active_jobs(&env.pool)
        .await
        .expect("active")
        .is_empty());
    let broker = env.broker().await;
    let q = batchfleet_shared::broker::PoolQueues::new(&env.pool);
    crate::containment::until(
        "the ended jobs' queues deleted",
        Duration::from_secs(30),
        || async {
            broker.ready_count(&q.job(&id_a)).await.ok() == Some(None)
                && broker.ready_count(&q.job(&id_b)).await.ok() == Some(None)
        },
    )
    .await;
    broker.close("bye").await;
    stop_all(&mut workers);
    env.cleanup(&[&id_a, &id_b]).await;
}

/// A worker consumes at most `--job-queues` job queues however many jobs
/// are active, so what it holds unacknowledged stays bounded by its
/// prefetch; and it moves on from a job whose queue it finds empty: five
/// jobs on one worker that consumes two queues at a time all finish, every
/// row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_consumes_at_most_its_job_queues_and_every_job_still_finishes() {
    let env = TestEnv::new("fanout");
    let names = ["a", "b", "c", "d", "e"];
    let manifests: Vec<PathBuf> = names
        .iter()
        .map(|n| share_job(&env, n, 6, "normal"))
        .collect();
    let ids: Vec<String> = manifests
        .iter()
        .map(|m| manifest::load(m, &[]).expect("manifest").job_id)
        .collect();
    let port = crate::support::free_port();
    let flags = ["--job-queues", "2", "--metrics-port", &port];
    let mut workers = vec![share_worker(&env, "w1", &flags)];
    env.wait_for_consumers(1, &mut workers).await;
    // While the jobs run: the job queues the worker says it consumes, and
    // the deliveries of the jobs it holds unacknowledged (published, not
    // ready in their queue, not committed: a lower bound, the queue read
    // before the commits).
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    let sampler = tokio::spawn({
        let (broker, ids) = (env.broker().await, ids.clone());
        let store = env.connections().store().await.expect("redis");
        let q = batchfleet_shared::broker::PoolQueues::new(&env.pool);
        async move {
            let (mut queues, mut held) = (0u64, 0u64);
            loop {
                let url = format!("http://127.0.0.1:{port}/metrics");
                let metrics = tokio::task::spawn_blocking(move || {
                    ureq::get(&url).call().ok()?.into_string().ok()
                })
                .await
                .ok()
                .flatten()
                .unwrap_or_default();
                let consumed = metrics
                    .lines()
                    .find(|l| l.starts_with("batchfleet_worker_job_queues"))
                    .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .unwrap_or(0.0);
                queues = queues.max(consumed as u64);
                let mut now = 0;
                for id in &ids {
                    // Once all its items are published.
                    let published = store
                        .progress(id)
                        .await
                        .is_ok_and(|p| p.status == Some(JobStatus::Running));
                    if !published {
                        continue;
                    }
                    let Ok(Some(ready)) = broker.ready_count(&q.job(id)).await else {
                        continue;
                    };
                    if let Ok(p) = store.progress(id).await {
                        now += p
                            .items_total
                            .saturating_sub(p.items_done + u64::from(ready));
                    }
                }
                held = held.max(now);
                tokio::select! {
                    _ = &mut done_rx => break,
                    _ = tokio::time::sleep(Duration::from_millis(25)) => {}
                }
            }
            broker.close("bye").await;
            (queues, held)
        }
    });
    let cfg = env.run_config();
    let limit = Duration::from_secs(180);
    let runs: Vec<_> = manifests
        .iter()
        .map(|m| {
            let (cfg, m) = (cfg.clone(), m.clone());
            tokio::spawn(
                async move { crate::support::run_with_config_to_end(&cfg, &m, limit).await },
            )
        })
        .collect();
    for (run, name) in runs.into_iter().zip(names) {
        let (_, report) = run.await.expect("run");
        assert_eq!(report.status, "completed", "{name}: {report:?}");
        let dir = env.path().join(name);
        let v = verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5).expect("verify");
        assert!(v.ok(), "{name}: {}", v.describe());
    }
    let _ = done_tx.send(());
    let (queues, held) = sampler.await.expect("sampler");
    println!(
        "one worker with --job-queues 2 and --prefetch 1, five jobs: at most {queues} job queues consumed and {held} deliveries held at once"
    );
    assert_eq!(queues, 2, "job queues consumed at once, at most");
    // One item in flight, a full prefetch (2) from each of 2 queues, and
    // what a queue let go when the worker drew again had sent (2); the
    // five queues consumed at once would hold 10.
    assert!(held <= 7, "deliveries held at once: {held}");
    stop_all(&mut workers);
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.cleanup(&ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_high_priority_job_overtakes_a_long_low_priority_one() {
    let env = TestEnv::new("prio");
    let short = share_job(&env, "short", 16, "high");
    let long = share_job(&env, "long", 120, "low");
    let mut workers = share_workers(&env);
    env.wait_for_consumers(2, &mut workers).await;
    let cfg = env.run_config();
    let limit = Duration::from_secs(180);
    // The short job alone on the fleet.
    let started = std::time::Instant::now();
    let (short_id, report) = crate::support::run_with_config_to_end(&cfg, &short, limit).await;
    let alone = started.elapsed().as_secs_f64();
    assert_eq!(report.status, "completed");
    let store = env.connections().store().await.expect("redis");
    store.delete_job(&short_id).await.expect("forget it");
    std::fs::remove_dir_all(env.path().join("short/out")).expect("its output");
    // The long low-priority job, and 2 s later the short high-priority one.
    let long_run = tokio::spawn({
        let (cfg, long) = (cfg.clone(), long.clone());
        async move { crate::support::run_with_config_to_end(&cfg, &long, limit).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = std::time::Instant::now();
    let (again, report) = crate::support::run_with_config_to_end(&cfg, &short, limit).await;
    let behind = started.elapsed().as_secs_f64();
    assert_eq!(
        (again.as_str(), report.status.as_str()),
        (short_id.as_str(), "completed")
    );
    let long_id = manifest::load(&long, &[]).expect("manifest").job_id;
    let long_done = store.progress(&long_id).await.expect("progress");
    println!(
        "short high-priority job: {alone:.1} s alone on 2 workers, {behind:.1} s behind a long low-priority job ({:.2}x; the long job had {}/{} items done when it finished)",
        behind / alone,
        long_done.items_done,
        long_done.items_total
    );
    assert!(
        long_done.items_done < long_done.items_total,
        "the long job was still running"
    );
    assert!(
        behind <= 1.5 * alone,
        "{behind:.1} s behind vs {alone:.1} s alone; w1:\n{}",
        workers[0].log_text()
    );
    let (long_id2, report) = long_run.await.expect("long job");
    assert_eq!(
        (long_id2, report.status.as_str()),
        (long_id.clone(), "completed")
    );
    let v = verify(
        &env.path().join("short/out"),
        &env.path().join("short/golden.csv"),
        1e-5,
    )
    .expect("verify");
    assert!(v.ok(), "{}", v.describe());
    stop_all(&mut workers);
    env.cleanup(&[&short_id, &long_id]).await;
}

/// A worker started with neither `--data-root` nor `BATCHFLEET_DATA_ROOT`,
/// and with `BATCHFLEET_DATA_ROOTS` (the variable's earlier name) as given.
fn worker_with_legacy_roots(pool: &str, legacy: Option<&Path>) -> std::process::Output {
    let mut worker = std::process::Command::new(env!("CARGO_BIN_EXE_batchfleet-worker"));
    worker
        .args(["--pool", pool, "--connect-timeout", "1s"])
        .env_remove("BATCHFLEET_DATA_ROOT")
        .env_remove("BATCHFLEET_DATA_ROOTS")
        .env_remove("BATCHFLEET_ALLOW_ANY_PATH");
    if let Some(roots) = legacy {
        worker.env("BATCHFLEET_DATA_ROOTS", roots);
    }
    worker.output().expect("worker")
}

#[test]
fn a_worker_without_a_data_root_refuses_to_start_for_good() {
    let out = worker_with_legacy_roots("no-data-root", None);
    assert_eq!(
        out.status.code(),
        Some(i32::from(batchfleet_worker::EXIT_CONFIG))
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no --data-root") && stderr.contains("--allow-any-path"),
        "{stderr}"
    );
}

/// The variable's earlier name is still read when the new one is unset:
/// a root that does not exist, named by it alone, is the error (rather than
/// "no --data-root"), and a warning names the new variable.
#[test]
fn the_legacy_data_roots_variable_is_still_read() {
    let missing = tempfile::tempdir().expect("tmp").path().join("gone");
    let out = worker_with_legacy_roots("legacy-data-root", Some(&missing));
    assert_eq!(
        out.status.code(),
        Some(i32::from(batchfleet_worker::EXIT_CONFIG))
    );
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        all.contains("--data-root:") && all.contains("gone") && !all.contains("no --data-root"),
        "{all}"
    );
    assert!(
        all.contains("BATCHFLEET_DATA_ROOTS is read as BATCHFLEET_DATA_ROOT"),
        "{all}"
    );
}

/// Issue: the reduce claim was not renewed while the hooks and the merge
/// ran, so a reduce step longer than the claim's life was taken over and
/// ran twice, hooks included. Here the claim lives one second and the hook
/// command takes three, while a second process follows the job and asks
/// for the claim all the while: the step, and its hook, run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_reduce_keeps_its_claim_and_its_hook_runs_once() {
    let env = TestEnv::new("longreduce");
    let gen = JobGen {
        rows: 400,
        files: 1,
        features: 4,
        hidden: 8,
        name: batchfleet_testkit::services::unique("longreduce"),
        pool: env.pool.clone(),
        item_rows: 100,
        batch_size: 100,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let path = env.path().join("job.toml");
    let text = std::fs::read_to_string(&path).expect("manifest");
    std::fs::write(
        &path,
        format!("{text}\n[on_complete]\ncommand = [\"sh\", \"-c\", \"sleep 3; echo $BATCHFLEET_JOB_ID >> hooks.log\"]\ncommand_timeout = \"60s\"\n"),
    )
    .expect("hooked manifest");
    let id = manifest::load(&path, &[]).expect("manifest").job_id;
    let mut cfg = env.run_config();
    cfg.supervise.reduce_stale = Duration::from_secs(1);
    cfg.poll_interval = Duration::from_millis(100);
    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let first = {
        let (cfg, path) = (cfg.clone(), path.clone());
        tokio::spawn(async move {
            batchfleet_coordinator::run_job(&cfg, &path, tokio_util::sync::CancellationToken::new())
                .await
        })
    };
    let store = env.connections().store().await.expect("redis");
    while !matches!(store.job(&id).await, Ok(Some(_))) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = batchfleet_coordinator::follow_job(
        &cfg,
        &store,
        &id,
        tokio_util::sync::CancellationToken::new(),
    );
    let (first, second) = tokio::join!(
        async { first.await.expect("task").expect("first follower") },
        second
    );
    for outcome in [first, second.expect("second follower")] {
        assert!(
            matches!(
                outcome,
                batchfleet_coordinator::RunOutcome::Completed { .. }
            ),
            "{outcome:?}"
        );
    }
    let hooks = std::fs::read_to_string(env.path().join("hooks.log")).expect("the hook ran");
    assert_eq!(
        hooks.lines().collect::<Vec<_>>(),
        [id.as_str()],
        "the hook ran once"
    );
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

/// A coordinator started while Redis is down (a restart, a failover) gave
/// up at once ("Connection refused", exit 1), and one that lost Redis
/// while registering its job failed with "broken pipe": a job started
/// from a scheduler was lost to a restart of a second. Now `run` rides out
/// an outage of up to `--connect-timeout`, trying the start of the job
/// again as a run of the same manifest would. Here `run --detach` starts
/// against a Redis of the test's own that is down; once the coordinator
/// says it is trying again, Redis is started (empty): the job is
/// registered there and every item published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_while_redis_is_down_waits_for_it_and_publishes_the_job() {
    use batchfleet_shared::broker::PoolQueues;
    use batchfleet_testkit::nodes::RedisNode;
    let env = TestEnv::new("redis-down");
    let manifest = job(&env);
    let id = manifest::load(&manifest, &[]).expect("valid").job_id;
    let mut redis = RedisNode::server(&env.path().join("redis"), &[]).expect("redis-server");
    redis.kill();
    let log = env.path().join("coordinator.log");
    let mut run = coordinator(&env)
        .args(["--connect-timeout", "30s", "run"])
        .arg(&manifest)
        .args(["--detach", "--json"])
        .env("BATCHFLEET_REDIS_URL", redis.url())
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("run --detach");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    while !said().contains("unavailable while starting the job; trying again") {
        assert!(
            run.try_wait().expect("wait").is_none(),
            "the coordinator gave up on a Redis that is down:\n{}",
            said()
        );
        assert!(std::time::Instant::now() < deadline, "{}", said());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    redis.restart().expect("Redis back");
    let out = run.wait_with_output().expect("run --detach");
    assert_eq!(out.status.code(), Some(0), "{}", said());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        (v["job_id"].as_str(), v["items"].as_u64()),
        (Some(id.as_str()), Some(8))
    );
    let registered = redis
        .cli(&[
            "hget",
            &batchfleet_shared::store::redis::job_scoped(&env.prefix, &id, ""),
            "status",
        ])
        .expect("redis-cli");
    assert_eq!(
        registered.trim(),
        "running",
        "the job is registered in the Redis that came back"
    );
    let broker = env.broker().await;
    let queue = PoolQueues::new(&env.pool).job(&id);
    assert!(
        broker
            .ready_count(&queue)
            .await
            .expect("queue")
            .unwrap_or(0)
            >= 1,
        "its items are published"
    );
    broker.close("bye").await;
    env.cleanup(&[&id]).await;
}
