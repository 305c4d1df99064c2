//! Fault tests: a worker killed (-9) or terminated mid-item, a coordinator
//! killed mid-publish, RabbitMQ and Redis restarted mid-job, Redis's data
//! lost mid-job, a straggling worker, and a worker dying while it holds an
//! early-acknowledged item. Each job must still end with every row predicted
//! exactly once and every score equal to PyTorch's.
//!
//! Some of these restart the machine's RabbitMQ or Redis, so the tests of
//! this binary run one at a time (cargo runs test binaries one after another).

#[allow(dead_code)]
#[path = "../it/support.rs"]
mod support;

use batchfleet_coordinator::reducer::Summary;
use batchfleet_coordinator::{run_job, RunOutcome};
use batchfleet_shared::store::{Lease, Store};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services;
use batchfleet_testkit::verify::verify;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use support::{stop_all, Backend, TestEnv};
use tokio_util::sync::CancellationToken;

/// One fault test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Polls `cond` until it holds; panics with `what` after `within`. Used for
/// states only observable by looking (Redis contents, another process's log).
async fn wait_until<F, Fut>(what: &str, within: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Generates a job: `items` items of `item_rows` rows, mini-batches of 100,
/// checkpoints every `checkpoint_every` mini-batches.
fn job(env: &TestEnv, stem: &str, items: u64, item_rows: u64, checkpoint_every: u32) -> PathBuf {
    let gen = JobGen {
        rows: items * item_rows,
        files: 1,
        features: 8,
        hidden: 16,
        outputs: 1,
        name: services::unique(stem),
        pool: env.pool.clone(),
        item_rows,
        batch_size: 100,
        checkpoint_every: Some(checkpoint_every),
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    env.path().join("job.toml")
}

fn job_id(manifest: &Path) -> String {
    batchfleet_coordinator::manifest::load(manifest, &[])
        .expect("manifest")
        .job_id
}

/// Starts `run_job` on the manifest in the background.
fn start_job(
    env: &TestEnv,
    manifest: &Path,
) -> tokio::task::JoinHandle<Result<RunOutcome, batchfleet_coordinator::RunError>> {
    let (cfg, manifest) = (env.run_config(), manifest.to_owned());
    tokio::spawn(async move { run_job(&cfg, &manifest, CancellationToken::new()).await })
}

async fn finished(
    handle: tokio::task::JoinHandle<Result<RunOutcome, batchfleet_coordinator::RunError>>,
) -> Summary {
    let outcome = tokio::time::timeout(Duration::from_secs(240), handle)
        .await
        .expect("job finished within 4 minutes")
        .expect("job task")
        .expect("job ran");
    let RunOutcome::Completed { report, .. } = outcome else {
        panic!("expected a completed job, got {outcome:?}");
    };
    *report
}

/// Every input row exactly once, every score equal to PyTorch's; the summary agrees.
fn assert_exactly_once(env: &TestEnv, summary: &Summary) {
    let out = env.path().join("out");
    let v = verify(&out, &env.path().join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    assert_eq!(v.output_rows as u64, summary.rows_total);
    assert_eq!(summary.status, "completed");
    assert_eq!(
        (
            summary.rows_predicted,
            summary.items_completed,
            summary.items_failed
        ),
        (summary.rows_total, summary.items_total, 0),
        "counted exactly once"
    );
    assert!(out.join("_SUCCESS").is_file());
    // Nor a staged file a worker killed mid-write left: the summary clears them.
    let staged: Vec<_> = std::fs::read_dir(out.join("_staging"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(staged.is_empty(), "left in _staging/: {staged:?}");
    // The summary removes `_partial/`; a losing copy still at work when it
    // did removes its own segments, and `_partial/` with them, as it stops.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while out.join("_partial").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "checkpoints cleaned up: {:?}",
            std::fs::read_dir(out.join("_partial"))
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn leases(store: &Store, job: &str) -> Vec<Lease> {
    store.leases(job).await.unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_item_is_resumed_from_its_checkpoint_by_another() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("kill9");
    // 2 items of 3000 rows; a checkpoint every 200 rows (2 mini-batches).
    let manifest = job(&env, "kill9", 2, 3_000, 2);
    let job = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    let mut slow = env.spawn_worker(
        "slow",
        &[
            "--prefetch",
            "1",
            "--debug-batch-delay",
            "100ms",
            "--heartbeat",
            "200ms",
        ],
    );
    env.wait_for_consumers(1, std::slice::from_mut(&mut slow))
        .await;
    let run = start_job(&env, &manifest);

    wait_until(
        "the slow worker checkpoints 600 rows",
        Duration::from_secs(60),
        || async {
            leases(&store, &job)
                .await
                .iter()
                .any(|l| l.rows_done >= 600)
        },
    )
    .await;
    // `batchfleet status` shows who holds what, for how long, how far.
    let report = batchfleet_coordinator::status::report(&store, &job)
        .await
        .expect("status")
        .expect("known job");
    assert!(
        report
            .in_flight
            .iter()
            .any(|f| f.lease.worker == "slow" && !f.stale && f.lease.rows_done >= 600),
        "{report:?}"
    );
    let table = batchfleet_coordinator::status::render(&report);
    assert!(
        table.contains("in flight (1, slowest first)") && table.contains("slow"),
        "{table}"
    );
    slow.child.kill().expect("kill -9");
    let _ = slow.child.wait();
    // What a worker killed in the middle of writing a part file leaves.
    let staging = env.path().join("out").join("_staging");
    std::fs::create_dir_all(&staging).expect("staging");
    std::fs::write(
        staging.join("part-000000.csv.0123456789abcdef.tmp"),
        "id,sc",
    )
    .expect("planted");
    let mut fast = vec![env.spawn_worker("fast", &[])];

    let summary = finished(run).await;
    assert_exactly_once(&env, &summary);
    assert!(
        summary.deliveries > summary.items_total && summary.rows_computed >= summary.rows_total,
        "the killed worker's delivery and rows count as extra work: {summary:?}"
    );
    assert!(
        summary.rows_resumed >= 600,
        "the redelivered item resumed from its checkpoint: {summary:?}"
    );
    let resumed: Vec<_> = store
        .item_stats(&job)
        .await
        .expect("stats")
        .into_iter()
        .filter(|s| s.rows_resumed > 0)
        .collect();
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(resumed[0].worker, "fast");
    stop_all(&mut fast);
    env.cleanup(&[&job]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_checkpoints_the_item_returns_prefetched_ones_and_exits_0() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("sigterm");
    let manifest = job(&env, "sigterm", 3, 3_000, 2);
    let job = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    let mut slow = env.spawn_worker(
        "slow",
        &[
            "--prefetch",
            "2",
            "--debug-batch-delay",
            "100ms",
            "--heartbeat",
            "200ms",
        ],
    );
    env.wait_for_consumers(1, std::slice::from_mut(&mut slow))
        .await;
    let run = start_job(&env, &manifest);
    wait_until(
        "the slow worker checkpoints 400 rows",
        Duration::from_secs(60),
        || async {
            leases(&store, &job)
                .await
                .iter()
                .any(|l| l.rows_done >= 400)
        },
    )
    .await;

    let status = slow.terminate(Duration::from_secs(20));
    assert!(status.success(), "exit {status}:\n{}", slow.log_text());
    let log = slow.log_text();
    assert!(
        log.contains("shutdown: the item goes back to the queue with its checkpoint"),
        "{log}"
    );
    // Nothing is held any more: every unfinished item is back in the queue.
    let p = store.progress(&job).await.expect("progress");
    assert_eq!(
        env.work_queue().await.map(|(ready, _)| u64::from(ready)),
        Some(p.items_total - p.items_done),
        "{log}"
    );

    let mut fast = vec![env.spawn_worker("fast", &[])];
    let summary = finished(run).await;
    assert_exactly_once(&env, &summary);
    assert!(summary.rows_resumed >= 400, "{summary:?}");
    stop_all(&mut fast);
    env.cleanup(&[&job]).await;
}

/// A worker told to stop (SIGTERM: a scale-down, a spot preemption) and
/// killed before it drained leaves a lease marked `stopping`: its death is
/// not counted against the item. With `[failure] max_crashes = 1`, a
/// counted death would dead-letter the item as `crash`; here the next
/// worker runs it and the job completes with every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_draining_after_sigterm_is_no_crash_of_its_item() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("preempt");
    // One item of 6 mini-batches of 100 rows, 1 s each, no checkpoint before its end.
    let manifest = job(&env, "preempt", 1, 600, 100);
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(&manifest, format!("{text}\n[failure]\nmax_crashes = 1\n")).expect("manifest");
    let job = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    let mut preempted = env.spawn_worker(
        "preempted",
        &[
            "--prefetch",
            "1",
            "--debug-batch-delay",
            "1s",
            "--heartbeat",
            "200ms",
            "--lease-ttl",
            "1s",
        ],
    );
    env.wait_for_consumers(1, std::slice::from_mut(&mut preempted))
        .await;
    let run = start_job(&env, &manifest);
    wait_until("the item is leased", Duration::from_secs(60), || async {
        !leases(&store, &job).await.is_empty()
    })
    .await;
    assert!(preempted.signal_term(), "kill -TERM");
    wait_until(
        "the draining worker marks its lease stopping",
        Duration::from_secs(30),
        || async { leases(&store, &job).await.iter().any(|l| l.stopping) },
    )
    .await;
    // The grace runs out before the item ends.
    preempted.child.kill().expect("kill -9");
    let _ = preempted.child.wait();
    let mut next = vec![env.spawn_worker("next", &["--heartbeat", "200ms"])];
    let summary = finished(run).await;
    assert_exactly_once(&env, &summary);
    let crashes = store.crashes(&job).await.expect("crashes");
    assert!(
        crashes.values().all(|n| *n == 0),
        "a preempted worker is no crash: {crashes:?}"
    );
    stop_all(&mut next);
    env.cleanup(&[&job]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_mid_publish_resumes_publishing_only_the_rest() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("coordkill");
    // 2400 items of 5 rows: the first 1024-item chunk is confirmed, then the coordinator dies.
    let manifest = job(&env, "coordkill", 2_400, 5, 4);
    let job = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    let coordinator =
        Path::new(env!("CARGO_BIN_EXE_batchfleet-worker")).with_file_name("batchfleet");
    assert!(
        coordinator.is_file(),
        "{} is missing; build the workspace (cargo test --workspace)",
        coordinator.display()
    );
    let command = |args: &[&str]| {
        let mut c = std::process::Command::new(&coordinator);
        c.args(["--redis-prefix", &env.prefix])
            .args(args)
            .env("BATCHFLEET_AMQP_URL", env.amqp.url.expose())
            .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
            .env("BATCHFLEET_NO_PROGRESS", "true");
        c
    };
    let crashed = command(&["run", manifest.to_str().expect("utf-8 path")])
        .env("BATCHFLEET_DEBUG_CRASH_AFTER_PUBLISHED", "1000")
        .output()
        .expect("run coordinator");
    assert!(!crashed.status.success(), "the crash point stops it");
    let record = store
        .job(&job)
        .await
        .expect("redis")
        .expect("job registered");
    assert_eq!(
        (record.status.as_str(), record.items_published),
        ("planning", 1024)
    );
    // Five-row items travel in bundles: the queue holds messages of
    // `bundle` items each.
    let bundle = batchfleet_shared::message::bundle_size(
        2_400,
        5,
        batchfleet_shared::message::DEFAULT_BUNDLE,
    ) as u32;
    assert_eq!(bundle, 16);
    assert_eq!(env.work_queue().await.map(|(r, _)| r), Some(1024 / bundle));

    // `batchfleet resume <job>` publishes the 1376 never-confirmed items, not all 2400.
    let mut resume = command(&["resume", &job])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("resume");
    wait_until("the resumed job runs", Duration::from_secs(60), || async {
        store
            .job(&job)
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.status.as_str() == "running")
    })
    .await;
    assert_eq!(env.work_queue().await.map(|(r, _)| r), Some(2_400 / bundle));

    let mut workers = vec![env.spawn_worker("w1", &[]), env.spawn_worker("w2", &[])];
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(status) = resume.try_wait().expect("wait resume") {
            break status;
        }
        assert!(Instant::now() < deadline, "resume did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let out = resume.wait_with_output().expect("resume output");
    assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: Summary = serde_json::from_slice(
        &std::fs::read(env.path().join("out/_summary.json")).expect("summary"),
    )
    .expect("summary json");
    assert_exactly_once(&env, &summary);
    assert_eq!(env.work_queue().await.map(|(r, _)| r), Some(0));
    stop_all(&mut workers);
    env.cleanup(&[&job]).await;
}

/// Runs a 30-item job on two workers and applies `fault` once 3 items are done.
async fn survive(
    stem: &str,
    fault: impl FnOnce(&TestEnv, &Store, &str),
) -> (TestEnv, Summary, String, Vec<support::Worker>) {
    let env = TestEnv::new(stem);
    let manifest = job(&env, stem, 30, 1_000, 2);
    let job = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    let mut workers = vec![
        env.spawn_worker("w1", &["--debug-batch-delay", "10ms"]),
        env.spawn_worker("w2", &["--debug-batch-delay", "10ms"]),
    ];
    env.wait_for_consumers(2, &mut workers).await;
    let run = start_job(&env, &manifest);
    wait_until("3 items done", Duration::from_secs(60), || async {
        store.progress(&job).await.is_ok_and(|p| p.items_done >= 3)
    })
    .await;
    fault(&env, &store, &job);
    let summary = finished(run).await;
    for w in &mut workers {
        assert!(
            matches!(w.child.try_wait(), Ok(None)),
            "worker {} exited:\n{}",
            w.log.display(),
            w.log_text()
        );
    }
    (env, summary, job, workers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_and_coordinator_ride_out_a_rabbitmq_restart() {
    let _serial = SERIAL.lock().await;
    let (env, summary, job, mut workers) = survive("mqrestart", |_, _, _| {
        services::restart_rabbitmq().expect("restart RabbitMQ");
    })
    .await;
    assert_exactly_once(&env, &summary);
    // A worker still backing off when the job ended (the other one finished
    // it) reconnects on its next try: wait for that, do not race it.
    for w in &workers {
        wait_until(
            "the worker reconnects to the broker",
            Duration::from_secs(60),
            || async { w.log_text().contains("reconnected to the broker") },
        )
        .await;
    }
    stop_all(&mut workers);
    env.cleanup(&[&job]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_and_coordinator_ride_out_a_redis_restart() {
    let _serial = SERIAL.lock().await;
    let (env, summary, job, mut workers) = survive("redisrestart", |_, _, _| {
        services::restart_redis(true).expect("restart Redis");
    })
    .await;
    assert_exactly_once(&env, &summary);
    stop_all(&mut workers);
    env.cleanup(&[&job]).await;
}

/// Deletes every key of this test's prefix, as a Redis restarted empty
/// would have lost them.
fn forget_everything(env: &TestEnv) {
    let keys = std::process::Command::new("redis-cli")
        .args([
            "-h",
            "127.0.0.1",
            "--scan",
            "--pattern",
            &format!("{}:*", env.prefix),
        ])
        .output()
        .expect("redis-cli scan");
    let keys: Vec<String> = String::from_utf8_lossy(&keys.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(!keys.is_empty());
    let status = std::process::Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "del"])
        .args(&keys)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("redis-cli del");
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_redis_state_is_rebuilt_from_the_output_files() {
    let _serial = SERIAL.lock().await;
    let (env, summary, job, mut workers) =
        survive("redisflush", |env, _, _| forget_everything(env)).await;
    assert_exactly_once(&env, &summary);
    let store = env.connections().store().await.expect("redis");
    let stats = store.item_stats(&job).await.expect("stats");
    assert!(
        stats.iter().any(|s| s.worker == "rebuilt-from-files"),
        "items committed before the loss were recovered from their files"
    );
    stop_all(&mut workers);
    env.cleanup(&[&job]).await;
}

/// Redis loses everything while most of a job still sits in its queue (the
/// workers hold one item each): the rebuild puts the job back on its pool's
/// active jobs — a list Redis lost too — so the workers go on consuming its
/// queue, and the job ends with every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_redis_state_with_most_items_still_queued_is_rebuilt_and_the_job_ends() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("redisqueued");
    let manifest = job(&env, "redisqueued", 40, 100, 1);
    let job = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    // One item at a time each, and a look at the pool's active jobs every
    // 200 ms: a job missing from that list is let go of at once.
    let slow = [
        "--prefetch",
        "1",
        "--prefetch-max",
        "1",
        "--debug-batch-delay",
        "100ms",
        "--debug-jobs-every",
        "200ms",
    ];
    let mut workers = vec![env.spawn_worker("w1", &slow), env.spawn_worker("w2", &slow)];
    env.wait_for_consumers(2, &mut workers).await;
    let run = start_job(&env, &manifest);
    wait_until("3 items done", Duration::from_secs(60), || async {
        store.progress(&job).await.is_ok_and(|p| p.items_done >= 3)
    })
    .await;
    let before = store.progress(&job).await.expect("progress").items_done;
    forget_everything(&env);
    assert!(
        before < 20,
        "most of the job was still queued: {before} done"
    );
    let summary = finished(run).await;
    assert_exactly_once(&env, &summary);
    stop_all(&mut workers);
    env.cleanup(&[&job]).await;
}

/// The straggler tests' job and fleet: 8 items of 500 rows with one
/// checkpoint per mini-batch (so a losing copy stops early), a slow worker
/// that holds one item at a time, 5 mini-batches at 2 s each (10 s for its
/// item), and a fast one that does the other 7 in about one.
async fn straggler_fleet(env: &TestEnv, backend: Backend) -> (PathBuf, support::Workers) {
    let manifest = job(env, "straggler", 8, 500, 1);
    let workers = env
        .workers(
            backend,
            &[&["--prefetch", "1", "--debug-batch-delay", "2s"], &[]],
        )
        .await;
    (manifest, workers)
}

// Speculative copies on both backends, one body: `fleet::…` and `local::…`.
crate::on_both_backends! {
    a_straggler_gets_a_speculative_copy_and_the_first_commit_wins,
}

async fn a_straggler_gets_a_speculative_copy_and_the_first_commit_wins(backend: Backend) {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("straggler");
    let (manifest, mut workers) = straggler_fleet(&env, backend).await;
    let (job, summary) = env.run_on(&workers, &manifest).await;
    assert_exactly_once(&env, &summary);
    assert!(summary.items_redispatched >= 1, "{summary:?}");
    assert!(summary.deliveries > summary.items_total, "{summary:?}");
    // The straggler was committed by the fast worker: the speculative copy
    // won, and the slow original says below that it lost. (The slow worker
    // may commit the one delivery it held waiting behind the straggler: a
    // delivery a worker holds is not published again.)
    assert!(summary.workers <= 2, "{summary:?}");
    if let Some(slow) = workers.procs.first() {
        // The slow copy notices at its next checkpoint and drops its work.
        wait_until("the slow copy stops", Duration::from_secs(30), || async {
            slow.log_text()
                .contains("item committed elsewhere (a faster copy); stopping this one")
        })
        .await;
    }
    workers.stop();
    env.cleanup(&[&job]).await;
}

/// A fleet whose other workers hold work waiting to start has no spare
/// hands: the straggler of the test above gets no speculative copy while
/// another worker's beat says it holds deliveries waiting (in the 500-worker
/// soak, such copies of items that only waited their turn were 12 % of the
/// items). The other worker's beat is written here, as its queued field on
/// the job, every 300 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_speculative_copy_while_other_workers_hold_work_waiting() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("backlog");
    let (manifest, mut workers) = straggler_fleet(&env, Backend::Fleet).await;
    let id = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    let stop = CancellationToken::new();
    let beating = tokio::spawn({
        let (store, id, stop) = (store.clone(), id.clone(), stop.clone());
        async move {
            let elsewhere = batchfleet_shared::store::queued_field("busy-worker/1-2");
            while !stop.is_cancelled() {
                store
                    .beat(&id, std::slice::from_ref(&elsewhere))
                    .await
                    .expect("beat");
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_millis(300)) => {}
                }
            }
        }
    });
    let (job, summary) = env.run_on(&workers, &manifest).await;
    stop.cancel();
    beating.await.expect("beats");
    assert_exactly_once(&env, &summary);
    assert_eq!(
        (summary.items_redispatched, summary.deliveries),
        (0, summary.items_total),
        "no copy: {summary:?}"
    );
    // The straggler ran its 10 s on the slow worker.
    assert!(summary.item_latency_ms.max >= 9_000, "{summary:?}");
    workers.stop();
    env.cleanup(&[&job]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_held_by_lease_alone_is_published_again_when_its_worker_dies() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("leasedie");
    let manifest = job(&env, "leasedie", 2, 1_000, 2);
    let job = job_id(&manifest);
    let store = env.connections().store().await.expect("redis");
    let mut slow = env.spawn_worker(
        "slow",
        &[
            "--prefetch",
            "1",
            "--debug-batch-delay",
            "300ms",
            "--ack-after",
            "1s",
            "--heartbeat",
            "200ms",
            "--lease-ttl",
            "2s",
        ],
    );
    env.wait_for_consumers(1, std::slice::from_mut(&mut slow))
        .await;
    let run = start_job(&env, &manifest);
    wait_until(
        "the slow worker acks early",
        Duration::from_secs(60),
        || async {
            leases(&store, &job)
                .await
                .iter()
                .any(|l| l.acked && l.rows_done >= 200)
        },
    )
    .await;
    slow.child.kill().expect("kill -9");
    let _ = slow.child.wait();
    // The broker has nothing to redeliver for the acked item: the coordinator
    // must see the lease go stale and publish it again.
    let mut fast = vec![env.spawn_worker("fast", &[])];
    let summary = finished(run).await;
    assert_exactly_once(&env, &summary);
    assert!(summary.items_redispatched >= 1, "{summary:?}");
    assert!(summary.rows_resumed >= 200, "{summary:?}");
    stop_all(&mut fast);
    env.cleanup(&[&job]).await;
}

/// Issue: an item that kills every worker running it (a fault inside
/// libtorch, the kernel's out-of-memory killer) crash-looped a fleet whose
/// workers are restarted when they die. Here two workers, restarted under
/// their own ids whenever they die (as systemd or Kubernetes would), get a
/// job whose item 5 aborts the process that runs it. Its crashes are
/// counted in Redis; at `[failure] max_crashes` (2) the next worker
/// dead-letters it, class `crash`, without running it, and the job ends
/// with every other row exactly once. The first death, on a first delivery
/// started without a Redis write, is the one no lease records: three in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_that_kills_its_workers_is_dead_lettered_as_crash_and_the_job_goes_on() {
    use std::os::unix::process::ExitStatusExt;
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("crash");
    let manifest = job(&env, "crash", 12, 100, 1);
    let job = job_id(&manifest);
    let flags = [
        "--debug-panic",
        "abort:5",
        "--heartbeat",
        "200ms",
        "--lease-ttl",
        "1s",
        "--prefetch",
        "1",
    ];
    let ids = ["crash-a", "crash-b"];
    let mut workers: Vec<_> = ids.iter().map(|id| env.spawn_worker(id, &flags)).collect();
    env.wait_for_consumers(2, &mut workers).await;
    let run = start_job(&env, &manifest);
    let mut dead_logs = Vec::new();
    // A child's exit has no event to await from std: look every 50 ms.
    while !run.is_finished() {
        for (w, id) in workers.iter_mut().zip(ids) {
            if let Some(status) = w.child.try_wait().expect("wait worker") {
                dead_logs.push(w.log_text());
                assert_eq!(
                    status.signal(),
                    Some(6), // SIGABRT
                    "only item 5 kills a worker ({status}):\n{}",
                    w.log_text()
                );
                assert!(
                    dead_logs.len() <= 3,
                    "item 5 killed a fourth worker:\n{}",
                    dead_logs.join("\n----\n")
                );
                *w = env.spawn_worker(id, &flags);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let outcome = run.await.expect("job task").expect("job ran");
    let RunOutcome::Completed { report, .. } = outcome else {
        panic!("expected a settled job, got {outcome:?}");
    };
    assert_eq!(
        dead_logs.len(),
        3,
        "one uncounted death, then max_crashes counted ones"
    );
    assert_eq!(report.status, "completed_with_failures", "{report:?}");
    assert_eq!((report.items_completed, report.items_failed), (11, 1));
    let store = env.connections().store().await.expect("redis");
    let failures = store.failures(&job).await.expect("failures");
    assert_eq!(failures.len(), 1);
    assert_eq!((failures[0].seq, failures[0].class.as_str()), (5, "crash"));
    assert!(
        failures[0]
            .reason
            .contains("2 workers died holding the item"),
        "{failures:?}"
    );
    // Dead-lettered, so `dlq list` shows it and `dlq replay` can run it again.
    let broker = env.broker().await;
    let filter = batchfleet_coordinator::dlq::Filter {
        job: Some(job.clone()),
        ..Default::default()
    };
    let dead = batchfleet_coordinator::dlq::list(&*broker, &env.pool, &filter)
        .await
        .expect("dlq list");
    assert_eq!(
        dead.iter()
            .map(|d| (d.item, d.class.as_str()))
            .collect::<Vec<_>>(),
        [(Some(5), "crash")]
    );
    broker.close("bye").await;
    // Every other row once, and right.
    let v = verify(
        &env.path().join("out"),
        &env.path().join("golden.csv"),
        1e-5,
    )
    .expect("verify");
    assert_eq!(v.missing.len(), 100, "item 5's rows only");
    assert!(
        v.duplicated.is_empty() && v.unexpected.is_empty() && v.mismatched.is_empty(),
        "{}",
        v.describe()
    );
    stop_all(&mut workers);
    env.cleanup(&[&job]).await;
}
