//! Shared set-up: services, unique names, worker processes, cleanup.

use batchfleet_coordinator::dlq::{DeadItem, Filter};
use batchfleet_coordinator::reducer::Summary;
use batchfleet_coordinator::{Connections, RunConfig};
use batchfleet_shared::broker::Broker;
use batchfleet_shared::broker::PoolQueues;
use batchfleet_shared::endpoint::Endpoint;
use batchfleet_shared::secret::SecretUrl;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct TestEnv {
    pub amqp: Endpoint,
    pub redis: Endpoint,
    pub prefix: String,
    pub pool: String,
    pub dir: tempfile::TempDir,
}

impl TestEnv {
    pub fn new(stem: &str) -> Self {
        batchfleet_testkit::services::ensure_local().expect("RabbitMQ and Redis available");
        Self {
            amqp: Endpoint::amqp(SecretUrl::new("amqp://guest:guest@127.0.0.1:5672/%2f")),
            redis: Endpoint::redis(SecretUrl::new("redis://127.0.0.1:6379/")),
            prefix: batchfleet_testkit::services::unique(&format!("bftest-{stem}")),
            pool: batchfleet_testkit::services::unique(stem),
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn connections(&self) -> Connections {
        Connections {
            backend: batchfleet_shared::backend::Backend::Fleet {
                amqp: self.amqp.clone(),
                redis: self.redis.clone(),
                redis_prefix: self.prefix.clone(),
            },
            connect_timeout: Duration::from_secs(10),
            signing_key: None,
            retention: batchfleet_coordinator::config::DEFAULT_RETENTION,
            hooks: Default::default(),
            whole_messages: false,
            bundle: batchfleet_shared::message::DEFAULT_BUNDLE,
        }
    }

    pub fn run_config(&self) -> RunConfig {
        RunConfig {
            connections: self.connections(),
            progress: false,
            poll_interval: Duration::from_millis(100),
            publish_window: 64,
            supervise: batchfleet_coordinator::config::SuperviseConfig {
                speculate_min: Duration::from_millis(500),
                orphan_grace: Duration::from_secs(3),
                ..Default::default()
            },
            data_roots: Vec::new(),
            overrides: Vec::new(),
            trial: Default::default(),
            since: None,
        }
    }

    /// Starts a worker process on this env's pool, logging to a file.
    pub fn spawn_worker(&self, id: &str, extra: &[&str]) -> Worker {
        self.spawn_worker_with_env(id, extra, &[])
    }

    /// [`TestEnv::spawn_worker`] with extra environment variables.
    pub fn spawn_worker_with_env(
        &self,
        id: &str,
        extra: &[&str],
        envs: &[(&str, String)],
    ) -> Worker {
        let log = self.path().join(format!("{id}.log"));
        let file = std::fs::File::create(&log).expect("worker log");
        let child = Command::new(env!("CARGO_BIN_EXE_batchfleet-worker"))
            .args([
                "--pool",
                &self.pool,
                "--redis-prefix",
                &self.prefix,
                "--worker-id",
                id,
                "--threads",
                "1",
            ])
            .args(["--drain-timeout", "20s", "--outage-timeout", "60s"])
            // Confined to the env's folder (unless the test names its own
            // roots), as a production worker is to its data.
            .args(if extra.contains(&"--data-root") {
                Vec::new()
            } else {
                vec![std::ffi::OsStr::new("--data-root"), self.path().as_os_str()]
            })
            .args(extra)
            .env("BATCHFLEET_AMQP_URL", self.amqp.url.expose())
            .env("BATCHFLEET_REDIS_URL", self.redis.url.expose())
            .env_remove("LD_LIBRARY_PATH") // the binary must find libtorch by itself
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::from(file.try_clone().expect("dup log")))
            .stderr(Stdio::from(file))
            .spawn()
            .expect("spawn batchfleet-worker");
        Worker { child, log }
    }

    /// A handle on the test's RabbitMQ.
    pub async fn broker(&self) -> Arc<dyn Broker> {
        batchfleet_shared::broker::connect(&self.amqp, "batchfleet-tests", Duration::from_secs(10))
            .await
            .expect("amqp")
    }

    /// (ready messages, consumers) of the pool's queues: the messages ready
    /// in its work queue and in the queue of each of its active jobs, and
    /// the work queue's consumers (every worker of the pool); None if the
    /// work queue does not exist.
    pub async fn work_queue(&self) -> Option<(u32, u32)> {
        let broker = self.broker().await;
        let queues = PoolQueues::new(&self.pool);
        let work = queues.work();
        let mut ready = broker.ready_count(&work).await.ok().flatten();
        let consumers = broker.consumer_count(&work).await.ok().flatten();
        if let (Some(total), Ok(store)) = (ready.as_mut(), self.connections().store().await) {
            for job in store
                .active_jobs(&self.pool)
                .await
                .unwrap_or_default()
                .keys()
            {
                *total += broker
                    .ready_count(&queues.job(job))
                    .await
                    .ok()
                    .flatten()
                    .unwrap_or(0);
            }
        }
        broker.close("bye").await;
        ready.zip(consumers)
    }

    /// Waits until `n` consumers are attached to the work queue.
    pub async fn wait_for_consumers(&self, n: u32, workers: &mut [Worker]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some((_, c)) = self.work_queue().await {
                if c >= n {
                    return;
                }
            }
            for w in workers.iter_mut() {
                if let Ok(Some(status)) = w.child.try_wait() {
                    panic!("worker exited early with {status}:\n{}", w.log_text());
                }
            }
            assert!(
                Instant::now() < deadline,
                "workers did not attach within 60s"
            );
            // The broker has no "consumer attached" event for other connections; poll.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Deletes the job records now; the pool's queues go when the env is dropped.
    pub async fn cleanup(&self, job_ids: &[&str]) {
        if let Ok(store) = self.connections().store().await {
            for id in job_ids {
                let _ = store.delete_job(id).await;
                let _ = store.deactivate_job(&self.pool, id).await;
            }
        }
        // The queues of these jobs (an ended job's goes a grace after it).
        if let Ok(broker) = batchfleet_shared::broker::connect(
            &self.amqp,
            "batchfleet-tests-cleanup",
            Duration::from_secs(10),
        )
        .await
        {
            for id in job_ids {
                let _ = broker.delete(&PoolQueues::new(&self.pool).job(id)).await;
            }
            broker.close("bye").await;
        }
    }
}

impl Drop for TestEnv {
    /// Deletes every queue of the test's pool, even when the test panicked:
    /// leftover quorum queues slow the shared broker down for everyone.
    /// Its jobs' queues too: an ended job's is deleted a grace after it,
    /// by workers this test has stopped by then.
    fn drop(&mut self) {
        let (amqp, pool) = (self.amqp.clone(), self.pool.clone());
        let prefix = self.prefix.clone();
        let cleanup = std::thread::spawn(move || {
            batchfleet_testkit::services::delete_listed_job_queues(&prefix);
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(conn) = batchfleet_shared::broker::connect(
                    &amqp,
                    "batchfleet-tests-cleanup",
                    Duration::from_secs(10),
                )
                .await
                else {
                    return;
                };
                let _ = conn.delete_pool(&PoolQueues::new(&pool)).await;
                conn.close("bye").await;
            });
        });
        let _ = cleanup.join();
    }
}

pub struct Worker {
    pub child: Child,
    pub log: PathBuf,
}

impl Worker {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the worker to exit by itself (bounded); its exit status.
    pub fn terminate_when_exited(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        // A child's exit has no event to await from std: poll it.
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("wait worker") {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.terminate(Duration::from_secs(30));
        panic!(
            "worker did not exit by itself within {within:?}:\n{}",
            self.log_text()
        );
    }

    /// Sends SIGTERM (as a scale-down or a preemption does), without
    /// waiting: whether it was sent (not to a worker that exited already).
    pub fn signal_term(&self) -> bool {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Sends SIGTERM and waits for the exit status (bounded).
    pub fn terminate(&mut self, within: Duration) -> ExitStatus {
        self.signal_term();
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait worker") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "worker did not exit within {within:?} of SIGTERM:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// SIGTERMs every worker and asserts each drained and exited 0.
pub fn stop_all(workers: &mut [Worker]) {
    for w in workers {
        let status = w.terminate(Duration::from_secs(30));
        assert!(status.success(), "worker exit {status}:\n{}", w.log_text());
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs the job of `manifest` in this process until it settles (at most
/// `limit`), expecting it to end completed or with failures; its id and summary.
pub async fn run_to_end(
    env: &TestEnv,
    manifest: &Path,
    limit: Duration,
) -> (String, batchfleet_coordinator::reducer::Summary) {
    run_with_config_to_end(&env.run_config(), manifest, limit).await
}

/// [`run_to_end`] with a coordinator configuration of the test's own.
pub async fn run_with_config_to_end(
    cfg: &RunConfig,
    manifest: &Path,
    limit: Duration,
) -> (String, batchfleet_coordinator::reducer::Summary) {
    let outcome = tokio::time::timeout(
        limit,
        batchfleet_coordinator::run_job(cfg, manifest, tokio_util::sync::CancellationToken::new()),
    )
    .await
    .unwrap_or_else(|_| panic!("job settled within {limit:?}"));
    settled(outcome)
}

/// Publishes the job of `manifest` without following it (`run
/// --detach`); its id.
pub async fn submit(cfg: &RunConfig, manifest: &Path) -> String {
    match batchfleet_coordinator::submit_job(cfg, manifest)
        .await
        .expect("submit")
    {
        batchfleet_coordinator::RunOutcome::Detached { job_id, .. } => job_id,
        other => panic!("expected a published job, got {other:?}"),
    }
}

/// Follows `job` (published by another) until it settles, at most `limit`;
/// its summary.
pub async fn follow_to_end(cfg: &RunConfig, job: &str, limit: Duration) -> Summary {
    let store = cfg.connections.store().await.expect("redis");
    let followed = tokio::time::timeout(
        limit,
        batchfleet_coordinator::follow_job(
            cfg,
            &store,
            job,
            tokio_util::sync::CancellationToken::new(),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("job {job} settled within {limit:?}"));
    settled(followed).1
}

/// Checks the env's `out/` against its `golden.csv` (every id once, every
/// score within 1e-5 of PyTorch's) and its row count; the output folder.
pub fn matches_golden(env: &TestEnv, rows: usize) -> PathBuf {
    let out = env.path().join("out");
    let v = batchfleet_testkit::verify::verify(&out, &env.path().join("golden.csv"), 1e-5)
        .expect("verify");
    assert!(v.ok(), "{}", v.describe());
    assert_eq!(v.output_rows, rows);
    out
}

/// Every rejected row in an output folder's `_rejects/*.jsonl` files.
pub fn rejects(out: &Path) -> Vec<serde_json::Value> {
    let mut all = Vec::new();
    if let Ok(entries) = std::fs::read_dir(out.join("_rejects")) {
        for e in entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "jsonl"))
        {
            let text = std::fs::read_to_string(e.path()).expect("rejects file");
            all.extend(
                text.lines()
                    .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json line")),
            );
        }
    }
    all
}

/// Where a test's job runs: worker processes over the real RabbitMQ and
/// Redis, or the in-process pipelines, queues and store of `batchfleet run
/// --local`. A test body taking a `Backend` pins both to the same semantics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `batchfleet-worker` processes; the coordinator in this process.
    Fleet,
    /// `batchfleet_coordinator::local`: everything in this process.
    Local,
}

/// Runs a test body (`async fn name(backend: Backend)`) once per backend:
/// `fleet::name` and `local::name`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod fleet {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Fleet).await;
                }
            )*
        }
        mod local {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Local).await;
                }
            )*
        }
    };
}

/// The workers of one test: processes (fleet) or the settings of the
/// pipelines a local run starts.
pub struct Workers {
    /// Which backend.
    pub backend: Backend,
    /// The worker processes (fleet only).
    pub procs: Vec<Worker>,
    local: batchfleet_coordinator::local::LocalOptions,
}

impl Workers {
    /// Stops the worker processes, each of which must exit cleanly.
    pub fn stop(&mut self) {
        stop_all(&mut self.procs);
    }
}

impl TestEnv {
    /// One worker per entry of `flags`, with those extra flags: processes
    /// attached to the work queue (fleet), or pipelines to start (local).
    pub async fn workers(&self, backend: Backend, flags: &[&[&str]]) -> Workers {
        let mut local =
            batchfleet_coordinator::local::LocalOptions::resolve(Some(flags.len()), Some(1));
        let mut procs = Vec::new();
        match backend {
            Backend::Fleet => {
                procs = flags
                    .iter()
                    .enumerate()
                    .map(|(i, f)| self.spawn_worker(&format!("w{}", i + 1), f))
                    .collect();
                self.wait_for_consumers(flags.len() as u32, &mut procs)
                    .await;
            }
            Backend::Local => {
                local.worker_settings = flags
                    .iter()
                    .map(|f| {
                        let argv = ["batchfleet-worker", "--drain-timeout", "20s"]
                            .iter()
                            .chain(f.iter());
                        <batchfleet_worker::WorkerConfig as clap::Parser>::try_parse_from(argv)
                            .expect("valid worker flags")
                    })
                    .collect();
            }
        }
        Workers {
            backend,
            procs,
            local,
        }
    }

    /// Runs the job of `manifest` to its end on `workers`.
    pub async fn run_on(&self, workers: &Workers, manifest: &Path) -> (String, Summary) {
        self.run_on_with(workers, manifest, &self.run_config())
            .await
    }

    /// [`TestEnv::run_on`] with a coordinator configuration of the test's own.
    pub async fn run_on_with(
        &self,
        workers: &Workers,
        manifest: &Path,
        cfg: &RunConfig,
    ) -> (String, Summary) {
        let limit = Duration::from_secs(180);
        match workers.backend {
            Backend::Fleet => run_with_config_to_end(cfg, manifest, limit).await,
            Backend::Local => settled(
                tokio::time::timeout(
                    limit,
                    batchfleet_coordinator::local::run_job(
                        cfg,
                        manifest,
                        workers.local.clone(),
                        tokio_util::sync::CancellationToken::new(),
                    ),
                )
                .await
                .unwrap_or_else(|_| panic!("job settled within {limit:?}")),
            ),
        }
    }

    /// The dead items of `job`: its pool's dead queue (fleet), or the
    /// `_dead/` folder a local run wrote.
    pub async fn dead_on(&self, workers: &Workers, job: &str, filter: Filter) -> Vec<DeadItem> {
        let filter = Filter {
            job: Some(job.to_owned()),
            ..filter
        };
        match workers.backend {
            Backend::Fleet => {
                let broker = self.broker().await;
                let items = batchfleet_coordinator::dlq::list(&*broker, &self.pool, &filter)
                    .await
                    .expect("dlq list");
                broker.close("bye").await;
                items
            }
            Backend::Local => batchfleet_coordinator::local::list_dead(&self.path().join("out"))
                .expect("dlq list --local")
                .into_iter()
                .filter(|d| filter.matches(d))
                .collect(),
        }
    }

    /// Replays the dead items of `job` (with the model as it is now when
    /// `update_model`) and follows the job to its end again.
    pub async fn replay_on(&self, workers: &Workers, job: &str, update_model: bool) -> Summary {
        let limit = Duration::from_secs(120);
        let token = tokio_util::sync::CancellationToken::new;
        match workers.backend {
            Backend::Fleet => {
                let broker = self.broker().await;
                let store = self.connections().store().await.expect("redis");
                let filter = Filter {
                    job: Some(job.to_owned()),
                    ..Filter::default()
                };
                batchfleet_coordinator::dlq::replay(
                    &*broker,
                    &store,
                    &self.pool,
                    &filter,
                    update_model,
                    batchfleet_coordinator::dlq::Trust {
                        key: None,
                        unsigned: true,
                    },
                )
                .await
                .expect("replay");
                broker.close("bye").await;
                follow_to_end(&self.run_config(), job, limit).await
            }
            Backend::Local => {
                let replayed = tokio::time::timeout(
                    limit,
                    batchfleet_coordinator::local::replay(
                        &self.run_config(),
                        &self.path().join("out"),
                        workers.local.clone(),
                        update_model,
                        token(),
                    ),
                )
                .await
                .unwrap_or_else(|_| panic!("replay settled within {limit:?}"));
                settled(replayed).1
            }
        }
    }
}

fn settled(
    outcome: Result<batchfleet_coordinator::RunOutcome, batchfleet_coordinator::RunError>,
) -> (String, Summary) {
    match outcome.expect("job ran") {
        batchfleet_coordinator::RunOutcome::Completed { job_id, report, .. } => (job_id, *report),
        other => panic!("expected a settled job, got {other:?}"),
    }
}

/// The ids (first field) of the CSV records item `seq` of the manifest's
/// job holds, as the planner cuts it and its reader reads it.
pub fn item_ids(manifest: &Path, seq: usize) -> Vec<String> {
    use batchfleet_shared::message::InputSlice;
    let spec = batchfleet_coordinator::manifest::load(manifest, &[]).expect("manifest");
    let plan = batchfleet_coordinator::planner::plan(&spec).expect("plan");
    let InputSlice::CsvRange(r) = &plan.items[seq].input else {
        panic!("item {seq} is not a CSV range")
    };
    let input = batchfleet_shared::source::Input::open(Path::new(&r.path)).expect("input");
    let bytes = if r.align {
        batchfleet_shared::split::align(&input, r, true)
            .expect("align")
            .bytes
    } else {
        input.read_range(r.start..r.end).expect("read")
    };
    csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(bytes.as_slice())
        .records()
        .map(|rec| rec.expect("a record")[0].to_owned())
        .collect()
}

/// Held by a test that points this process's S3 client at its own S3
/// server: the client's endpoint is process-wide, so such tests take turns.
pub async fn s3_turn() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// A TCP port free on 127.0.0.1 now (for a worker's `--metrics-port`).
pub fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string()
}

/// The sum of a worker's counter `name` over the samples whose label
/// `label` is `value`, in the text of its metrics endpoint.
pub fn labelled(metrics: &str, name: &str, label: &str, value: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("{label}=\"{value}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The text of the metrics endpoint on `port` of this machine.
pub fn scrape(port: &str) -> String {
    ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .expect("scrape")
        .into_string()
        .expect("text")
}
