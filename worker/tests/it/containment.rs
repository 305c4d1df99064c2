//! Containment against the real RabbitMQ, Redis and libtorch: a wrong
//! model, a bad message, a panic, a planted link, a wrong clock or a full
//! disk costs one item or one job — never a worker process, never another job.

use crate::support::{stop_all, TestEnv, Worker};
use batchfleet_coordinator::dlq::{self, DeadItem, Filter};
use batchfleet_coordinator::{run_job, RunOutcome};
use batchfleet_shared::broker::{Headers, Outgoing, PoolQueues};
use batchfleet_shared::message::{Envelope, InputSlice, WorkItem, MESSAGE_TYPE_V2};
use batchfleet_shared::signing::{SigningKey, SIGNATURE_HEADER};
use batchfleet_testkit::python::{make_job, make_wrong_models, JobGen};
use batchfleet_testkit::services::unique;
use batchfleet_testkit::verify::verify;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A job of `rows` rows in `items` items generated in `env/<sub>`, with its
/// own name; its manifest.
pub(crate) fn job_in(env: &TestEnv, sub: &str, rows: u64, item_rows: u64) -> PathBuf {
    let dir = env.path().join(sub);
    std::fs::create_dir_all(&dir).expect("job folder");
    let gen = JobGen {
        rows,
        files: 1,
        features: 8,
        hidden: 16,
        name: unique(sub),
        pool: env.pool.clone(),
        item_rows,
        batch_size: 100,
        ..JobGen::default()
    };
    make_job(&dir, &gen).expect("generate job");
    dir.join("job.toml")
}

/// INV-ROWS for the job in `dir`: every row of the golden file in the
/// outputs exactly once, with PyTorch's score; the missing rows' ids.
pub(crate) fn verified(dir: &Path) -> Vec<String> {
    let v = verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5).expect("verify");
    assert!(
        v.duplicated.is_empty() && v.unexpected.is_empty() && v.mismatched.is_empty(),
        "{}",
        v.describe()
    );
    let mut missing = v.missing.clone();
    missing.sort();
    missing
}

pub(crate) type Run = tokio::task::JoinHandle<Result<RunOutcome, batchfleet_coordinator::RunError>>;

/// Starts `batchfleet run` on `manifest` in this process (a coordinator
/// validating, publishing and following the job).
pub(crate) fn start_run(cfg: &batchfleet_coordinator::RunConfig, manifest: &Path) -> Run {
    let (cfg, manifest) = (cfg.clone(), manifest.to_owned());
    tokio::spawn(async move { run_job(&cfg, &manifest, CancellationToken::new()).await })
}

/// A job started with no worker yet: `run` publishing and following it,
/// and its queue, in which its messages wait.
pub(crate) struct Waiting {
    pub(crate) id: String,
    pub(crate) run: Run,
    pub(crate) broker: std::sync::Arc<dyn batchfleet_shared::broker::Broker>,
    pub(crate) queue: String,
}

/// Starts `batchfleet run` on `manifest` (see [`start_run`]) with no
/// worker consuming, and returns once `messages` wait in the job's queue.
pub(crate) async fn start_waiting(
    env: &TestEnv,
    cfg: &batchfleet_coordinator::RunConfig,
    manifest: &Path,
    messages: u32,
) -> Waiting {
    let id = batchfleet_coordinator::manifest::load(manifest, &[])
        .expect("manifest")
        .job_id;
    let run = start_run(cfg, manifest);
    let broker = env.broker().await;
    let queue = PoolQueues::new(&env.pool).job(&id);
    until(
        "every message published",
        Duration::from_secs(60),
        || async { broker.ready_count(&queue).await.ok().flatten() == Some(messages) },
    )
    .await;
    Waiting {
        id,
        run,
        broker,
        queue,
    }
}

/// How `run` ended, once it settled (within `within`).
async fn settled(run: Run, within: Duration) -> RunOutcome {
    tokio::time::timeout(within, run)
        .await
        .expect("settled in time")
        .expect("task")
        .expect("run")
}

/// The summary of `run`, which must have followed its job to the end.
pub(crate) async fn summary(
    run: Run,
    within: Duration,
) -> batchfleet_coordinator::reducer::Summary {
    match settled(run, within).await {
        RunOutcome::Completed { report, .. } => *report,
        other => panic!("{other:?}"),
    }
}

/// Makes the 0-based `lines` of a CSV file bad rows (one field too many).
fn add_a_field(file: &Path, lines: &[usize]) {
    let mut text: Vec<String> = std::fs::read_to_string(file)
        .expect("data")
        .lines()
        .map(str::to_owned)
        .collect();
    for &l in lines {
        text[l] = text[l].replacen(',', ",oops,", 1);
    }
    std::fs::write(file, text.join("\n") + "\n").expect("data");
}

fn alive(workers: &mut [Worker]) {
    for w in workers {
        assert!(
            matches!(w.child.try_wait(), Ok(None)),
            "a worker process exited:\n{}",
            w.log_text()
        );
    }
}

pub(crate) async fn dead_items(env: &TestEnv, filter: Filter) -> Vec<DeadItem> {
    let broker = env.broker().await;
    let items = dlq::list(&*broker, &env.pool, &filter)
        .await
        .expect("dlq list");
    broker.close("bye").await;
    items
}

/// Waits until `cond` holds (an event no other signal announces), up to `within`.
pub(crate) async fn until<F, Fut>(what: &str, within: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Publishes raw messages to the pool's work queue.
async fn publish(env: &TestEnv, messages: Vec<Outgoing>) {
    let broker = env.broker().await;
    let queues = PoolQueues::new(&env.pool);
    broker.declare(&queues).await.expect("topology");
    broker
        .publish(&queues.work(), messages, 64)
        .await
        .expect("publish");
    broker.close("bye").await;
}

fn raw(body: Vec<u8>, signature: Option<String>) -> Outgoing {
    Outgoing {
        message_id: "forged".into(),
        kind: MESSAGE_TYPE_V2,
        body,
        headers: Headers::of(
            signature.map(|s| (SIGNATURE_HEADER, s)),
            [("x-bf-attempt", 1)],
        ),
        expiration_ms: None,
    }
}

pub(crate) fn plan(manifest: &Path) -> Vec<WorkItem> {
    let spec = batchfleet_coordinator::manifest::load(manifest, &[]).expect("manifest");
    batchfleet_coordinator::planner::plan(&spec)
        .expect("plan")
        .items
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("proc status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_swapped_for_a_state_dict_fails_its_job_at_once_and_the_other_job_completes() {
    let env = TestEnv::new("wrongmodel");
    let good = job_in(&env, "good", 6_000, 1_000);
    let bad = job_in(&env, "bad", 6_000, 1_000);
    make_wrong_models(&env.path().join("bad")).expect("wrong models");
    // Both jobs are validated and published before any worker runs...
    let cfg = env.run_config();
    let good_run = start_run(&cfg, &good);
    let bad_run = start_run(&cfg, &bad);
    until("both jobs published", Duration::from_secs(60), || async {
        env.work_queue().await.map(|(ready, _)| ready) == Some(12)
    })
    .await;
    // ...then the second job's model file becomes the most common mistake.
    std::fs::copy(
        env.path().join("bad/state_dict.pt"),
        env.path().join("bad/model.pt"),
    )
    .expect("swap");
    let mut workers = vec![env.spawn_worker("w1", &[]), env.spawn_worker("w2", &[])];
    let started = Instant::now();
    let outcome = settled(bad_run, Duration::from_secs(60)).await;
    let failed_in = started.elapsed();
    assert_eq!(batchfleet_coordinator::cli::exit_code(&outcome), 5);
    let RunOutcome::Completed {
        report, summary, ..
    } = outcome
    else {
        panic!("{outcome:?}")
    };
    assert_eq!(report.status, "failed");
    assert_eq!(report.failed_class.as_deref(), Some("unrunnable"));
    let reason = report.failed_reason.clone().unwrap_or_default();
    assert!(
        reason.contains("model.pt")
            && reason.contains("but the job expects")
            && reason.contains("state_dict"),
        "{reason}"
    );
    assert!(
        failed_in < Duration::from_secs(30),
        "failed within seconds: {failed_in:?}"
    );
    let on_disk: serde_json::Value =
        serde_json::from_slice(&std::fs::read(summary).expect("summary")).expect("json");
    assert_eq!(on_disk["failed_reason"].as_str(), Some(reason.as_str()));
    assert!(!env.path().join("bad/out/_SUCCESS").exists());

    let outcome = settled(good_run, Duration::from_secs(120)).await;
    let RunOutcome::Completed {
        report: good_report,
        ..
    } = outcome
    else {
        panic!("{outcome:?}")
    };
    assert_eq!(good_report.status, "completed");
    assert!(
        verified(&env.path().join("good")).is_empty(),
        "every row of the good job"
    );
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&report.job_id, &good_report.job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_no_worker_can_run_fails_after_a_bounded_time_and_the_worker_goes_on() {
    let env = TestEnv::new("unable");
    let gpu = job_in(&env, "gpu", 2_000, 1_000);
    let text = std::fs::read_to_string(&gpu).expect("manifest");
    // A device no machine here has: every worker of this pool is unable.
    std::fs::write(
        &gpu,
        text.replace("device = \"cpu\"", "device = \"cuda:15\""),
    )
    .expect("manifest");
    let mut workers = vec![env.spawn_worker("w1", &["--unable-for", "2s"])];
    env.wait_for_consumers(1, &mut workers).await;
    let mut cfg = env.run_config();
    cfg.supervise.unable_timeout = Duration::from_secs(3);
    let store = env.connections().store().await.expect("redis");
    let started = Instant::now();
    let run = start_run(&cfg, &gpu);
    let id = batchfleet_coordinator::manifest::load(&gpu, &[])
        .expect("manifest")
        .job_id;
    // While it waits, `status` shows which worker cannot run the job and why.
    until("the worker's note", Duration::from_secs(30), || async {
        store
            .unable(&id)
            .await
            .expect("notes")
            .get("w1")
            .is_some_and(|n| n.class == "unable" && n.reason.contains("no such CUDA device"))
    })
    .await;
    let shown = batchfleet_coordinator::status::render(
        &batchfleet_coordinator::status::report(&store, &id)
            .await
            .expect("status")
            .expect("job"),
    );
    assert!(
        shown.contains("w1") && shown.contains("no such CUDA device"),
        "{shown}"
    );
    let outcome = settled(run, Duration::from_secs(60)).await;
    assert_eq!(batchfleet_coordinator::cli::exit_code(&outcome), 5);
    let RunOutcome::Completed { report, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(report.failed_class.as_deref(), Some("unable"));
    assert!(
        report
            .failed_reason
            .as_deref()
            .is_some_and(|r| r.contains("no worker could run") && r.contains("w1: device cuda:15")),
        "{report:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(40));
    assert_eq!(report.items_failed, 0, "no item was failed: the job was");
    // The same worker runs the next job of its pool.
    let cpu = job_in(&env, "cpu", 2_000, 1_000);
    let (id2, done) = crate::support::run_to_end(&env, &cpu, Duration::from_secs(120)).await;
    assert_eq!(done.status, "completed");
    assert!(verified(&env.path().join("cpu")).is_empty());
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&id, &id2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_messages_are_rejected_with_their_reasons_touching_nothing_and_a_real_job_completes()
{
    let env = TestEnv::new("forged");
    let key = SigningKey::new(b"0123456789abcdef-test-signing-key", "test").expect("key");
    let key_env = [(
        "BATCHFLEET_SIGNING_KEY",
        "0123456789abcdef-test-signing-key".to_owned(),
    )];
    let mut cfg = env.run_config();
    cfg.connections.signing_key = Some(key.clone());
    let mut workers = vec![env.spawn_worker_with_env(
        "w1",
        &["--unknown-job-grace", "1s", "--prefetch", "2"],
        &key_env,
    )];
    env.wait_for_consumers(1, &mut workers).await;
    // A first real job warms the worker up (libtorch, the model), for the RSS baseline.
    let warm = job_in(&env, "warm", 2_000, 1_000);
    let (warm_id, _) =
        crate::support::run_with_config_to_end(&cfg, &warm, Duration::from_secs(120)).await;
    let baseline = rss_kib(workers[0].child.id());

    let real = job_in(&env, "real", 4_000, 1_000);
    let items = plan(&real);
    let id = items[0].job_id.clone();
    let input = items[0].input.path().to_owned();
    let file_len = std::fs::metadata(&input).expect("input").len();
    let signed = |item: &WorkItem| {
        let body = Envelope::V2(item.clone()).encode();
        let sig = key.sign(&body);
        raw(body, Some(sig))
    };
    // Version 3: the item and its job's task digest, the task in Redis.
    let signed_ref = |item: &WorkItem, task_sha256: &str| {
        let mut r = item.to_ref().expect("planned items name their task");
        r.task_sha256 = task_sha256.to_owned();
        let body = Envelope::V3(r).encode();
        let sig = key.sign(&body);
        raw(body, Some(sig))
    };
    let forged = |f: &dyn Fn(&mut WorkItem)| {
        let mut item = items[1].clone();
        f(&mut item);
        item
    };
    let range = |f: &dyn Fn(&mut batchfleet_shared::message::ByteRange)| {
        forged(&|i: &mut WorkItem| {
            if let InputSlice::CsvRange(r) = &mut i.input {
                f(r)
            }
        })
    };
    let elsewhere = tempfile::tempdir().expect("elsewhere");
    std::fs::write(elsewhere.path().join("secret.csv"), "id,f0\nx,1\n").expect("secret");
    let cases: Vec<(Outgoing, &str)> = vec![
        (
            raw(
                b"\x00\x01garbage".to_vec(),
                Some(key.sign(b"\x00\x01garbage")),
            ),
            "undecodable work message",
        ),
        (
            raw(Envelope::V2(items[1].clone()).encode(), None),
            "unsigned message",
        ),
        (
            raw(
                Envelope::V2(items[1].clone()).encode(),
                Some(key.sign(b"other")),
            ),
            "bad signature",
        ),
        (
            signed(&forged(&|i| i.job_id = "nosuchjob-00000000".into())),
            "no job nosuchjob-00000000 in Redis",
        ),
        (
            signed_ref(&items[1], &"cd".repeat(32)),
            "stores no task cdcd",
        ),
        (
            signed_ref(
                &forged(&|i| i.job_id = "nosuchjob-00000001".into()),
                items[1].task_sha256.as_deref().expect("a digest"),
            ),
            "no job nosuchjob-00000001 in Redis",
        ),
        (
            signed(&range(&|r| r.end = r.file_len + 1)),
            "does not lie inside",
        ),
        (
            signed(&range(&|r| {
                r.end = file_len + (1 << 20);
                r.file_len = r.end;
            })),
            "ends past the end of",
        ),
        (signed(&range(&|r| r.rows = 1 << 40)), "rows claimed"),
        (
            signed(&forged(&|i| i.task.model.sha256 = "ab".repeat(32))),
            "names model digest abab",
        ),
        (
            signed(&range(&|r| {
                r.path = elsewhere
                    .path()
                    .join("secret.csv")
                    .to_string_lossy()
                    .into_owned()
            })),
            "refusing the item's input file",
        ),
        (
            signed(&forged(&|i| i.seq = 1_000_000)),
            "is item 1000000 but the job has 4 items",
        ),
        (
            signed(&forged(&|i| {
                if let batchfleet_shared::message::Layout::Csv(l) = &mut i.task.layout {
                    l.id_column = 99;
                }
            })),
            "index 99 is outside",
        ),
        (
            signed(&forged(&|i| {
                i.task.output.dir = env
                    .path()
                    .join("real/elsewhere")
                    .to_string_lossy()
                    .into_owned()
            })),
            "real/elsewhere but the job record says output_dir",
        ),
    ];
    let reasons: Vec<&str> = cases.iter().map(|(_, r)| *r).collect();
    let mut messages: Vec<Outgoing> = cases.into_iter().map(|(m, _)| m).collect();
    // And many messages asking for impossible sizes: none may cost memory.
    for k in 0..200u64 {
        messages.push(signed(&range(&|r| {
            r.start = 0;
            r.end = (1u64 << 40) + k;
            r.file_len = r.end;
            r.rows = 1 << 30;
        })));
    }
    let forged_count = messages.len();
    // The real job runs while the forged messages arrive in the same queue.
    let run = start_run(&cfg, &real);
    until(
        "the real job published",
        Duration::from_secs(60),
        || async {
            let store = env.connections().store().await.expect("redis");
            store.job(&id).await.ok().flatten().is_some()
        },
    )
    .await;
    publish(&env, messages).await;
    let report = summary(run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!(report.items_failed, 0);
    assert_eq!(report.deliveries, 4, "no forged copy started a real item");
    assert!(verified(&env.path().join("real")).is_empty());
    until(
        "every forged message dead-lettered",
        Duration::from_secs(60),
        || async { dead_items(&env, Filter::default()).await.len() >= forged_count },
    )
    .await;
    let dead = dead_items(&env, Filter::default()).await;
    assert_eq!(dead.len(), forged_count);
    assert!(dead.iter().all(|d| d.class == "rejected"), "{dead:?}");
    for reason in reasons {
        assert!(
            dead.iter().any(|d| d.error.contains(reason)),
            "no rejection says {reason:?}: {:?}",
            dead.iter().map(|d| &d.error).collect::<Vec<_>>()
        );
    }
    let store = env.connections().store().await.expect("redis");
    assert!(store.failures(&id).await.expect("failures").is_empty());
    for ghost in ["nosuchjob-00000000", "nosuchjob-00000001"] {
        assert!(store.job(ghost).await.expect("job").is_none());
    }
    let grown = rss_kib(workers[0].child.id()).saturating_sub(baseline);
    assert!(grown < 64 * 1024, "worker RSS grew by {grown} KiB");
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&id, &warm_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panics_in_item_handling_and_on_the_runner_settle_the_item_and_the_worker_lives() {
    let env = TestEnv::new("panics");
    let manifest = job_in(&env, "p", 4_000, 1_000);
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(&manifest, format!("{text}\n[failure]\nmax_attempts = 2\n")).expect("manifest");
    // Item 1 panics in item handling and item 2 on the runner, each on its
    // first attempt only; item 3 panics on the runner every time.
    let mut workers =
        vec![env.spawn_worker("w1", &["--debug-panic", "item:1@1,runner:2@1,runner:3"])];
    env.wait_for_consumers(1, &mut workers).await;
    let (id, report) = crate::support::run_to_end(&env, &manifest, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed_with_failures");
    assert_eq!(report.items_completed, 3);
    let failed: Vec<_> = report
        .failed_items
        .iter()
        .map(|f| (f.seq, f.class.as_str(), f.attempt))
        .collect();
    assert_eq!(failed, vec![(3, "panic", 2)]);
    assert!(
        report.failed_items[0]
            .reason
            .contains("injected panic on the model runner thread"),
        "{:?}",
        report.failed_items
    );
    let store = env.connections().store().await.expect("redis");
    let stats = store.item_stats(&id).await.expect("stats");
    let attempts: Vec<_> = stats.iter().map(|s| (s.seq, s.attempt)).collect();
    assert_eq!(
        attempts,
        vec![(0, 1), (1, 2), (2, 2)],
        "the panicked attempts were retried"
    );
    assert!(
        store.leases(&id).await.expect("leases").is_empty(),
        "every lease released"
    );
    // The rows missing are exactly item 3's: the records its byte range
    // owns, the last quarter of the file.
    let item3 = crate::support::item_ids(&manifest, 3);
    assert!((900..=1_100).contains(&item3.len()), "{}", item3.len());
    assert_eq!(item3.last().map(String::as_str), Some("r00003999"));
    assert_eq!(verified(&env.path().join("p")), item3);
    let log = workers[0].log_text();
    assert!(log.contains("injected panic in item handling"), "{log}");
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_the_broker_dead_letters_fails_as_infra_and_is_never_published_again() {
    let env = TestEnv::new("limit");
    let manifest = job_in(&env, "l", 4_000, 1_000);
    let Waiting {
        run, broker, queue, ..
    } = start_waiting(&env, &env.run_config(), &manifest, 4).await;
    // Item 0 keeps coming back unsettled — what workers dying on it look
    // like to the broker — until the delivery limit dead-letters it.
    let mut deliveries = 0;
    loop {
        let m = broker.get(&queue).await.expect("get").expect("a message");
        let item = Envelope::decode(&m.body).expect("item").into_opened();
        assert_eq!(item.seq(), 0, "the head of the queue comes back each time");
        deliveries += 1;
        m.requeue().await.expect("nack");
        if deliveries > batchfleet_shared::broker::DELIVERY_LIMIT {
            break;
        }
    }
    until(
        "dead-lettered by the broker",
        Duration::from_secs(30),
        || async { env.work_queue().await.map(|(ready, _)| ready) == Some(3) },
    )
    .await;
    broker.close("bye").await;
    let mut workers = vec![env.spawn_worker("w1", &[])];
    let report = summary(run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed_with_failures");
    let failed: Vec<_> = report
        .failed_items
        .iter()
        .map(|f| (f.seq, f.class.as_str()))
        .collect();
    assert_eq!(failed, vec![(0, "infra")]);
    assert!(report.failed_items[0]
        .reason
        .contains("dead-lettered by the broker after"));
    // Settled, not published again: no copy of it, ever.
    assert_eq!(report.items_redispatched, 0);
    let store = env.connections().store().await.expect("redis");
    assert!(store
        .copies(&report.job_id)
        .await
        .expect("copies")
        .is_empty());
    assert_eq!(report.deliveries, 3, "only the other items ran");
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&report.job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_of_one_item_on_one_worker_commit_one_part_one_rejects_file_and_one_stats() {
    let env = TestEnv::new("copies");
    let manifest = job_in(&env, "c", 2_000, 2_000);
    // Bad rows, so the item has a rejects file.
    add_a_field(&env.path().join("c/data/part-00.csv"), &[11, 500, 1999]);
    let run = start_run(&env.run_config(), &manifest);
    until("published", Duration::from_secs(60), || async {
        env.work_queue().await.map(|(ready, _)| ready) == Some(1)
    })
    .await;
    // A speculative copy keeps the item's attempt: two identical messages.
    let item = plan(&manifest).remove(0);
    publish(&env, vec![Outgoing::work_item(&item, 1, None)]).await;
    let mut workers =
        vec![env.spawn_worker("w1", &["--prefetch", "2", "--debug-batch-delay", "100ms"])];
    let report = summary(run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed");
    assert_eq!(report.deliveries, 2, "both copies ran");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !workers[0]
        .log_text()
        .contains("another copy published the item first")
    {
        assert!(Instant::now() < deadline, "{}", workers[0].log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    until(
        "the second copy settled",
        Duration::from_secs(30),
        || async {
            env.work_queue().await.map(|(ready, _)| ready) == Some(0)
                && workers[0]
                    .log_text()
                    .contains("another copy published the item first")
        },
    )
    .await;
    let log = workers[0].log_text();
    assert_eq!(log.matches("item committed rows=").count(), 1, "{log}");
    assert_eq!(
        log.matches("another copy published the item first").count(),
        1,
        "{log}"
    );
    let out = env.path().join("c/out");
    // One copy's bytes: the part holds every good row once, the rejects every bad one.
    let missing = verified(&env.path().join("c"));
    assert_eq!(missing.len(), 3);
    let rejects = crate::support::rejects(&out);
    let lines: Vec<u64> = rejects
        .iter()
        .map(|r| r["line"].as_u64().expect("line"))
        .collect();
    assert_eq!(lines, vec![12, 501, 2000]);
    let store = env.connections().store().await.expect("redis");
    let stats = store.item_stats(&report.job_id).await.expect("stats");
    assert_eq!(stats.len(), 1);
    assert_eq!((stats[0].rows, stats[0].rows_rejected), (1_997, 3));
    assert!(
        !stats[0].recovered,
        "the winner's own stats, not a loser's recount"
    );
    assert_eq!(
        std::fs::read_dir(out.join("_staging"))
            .expect("staging")
            .count(),
        0
    );
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&report.job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_planted_in_the_output_folder_are_refused_and_nothing_is_written_through_them() {
    let env = TestEnv::new("links");
    let manifest = job_in(&env, "s", 2_000, 1_000);
    add_a_field(&env.path().join("s/data/part-00.csv"), &[5]); // item 0 gets a rejects file
    let run = start_run(&env.run_config(), &manifest);
    until("published", Duration::from_secs(60), || async {
        env.work_queue().await.map(|(ready, _)| ready) == Some(2)
    })
    .await;
    // Outside every data root: what the links point at.
    let elsewhere = tempfile::tempdir().expect("elsewhere");
    std::fs::write(elsewhere.path().join("victim"), "precious\n").expect("victim");
    let out = env.path().join("s/out");
    std::os::unix::fs::symlink(elsewhere.path(), out.join("_rejects")).expect("link");
    std::os::unix::fs::symlink(elsewhere.path().join("victim"), out.join("part-000001.csv"))
        .expect("link");
    let mut workers = vec![env.spawn_worker("w1", &[])];
    let report = summary(run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed_with_failures");
    let failed: Vec<_> = report
        .failed_items
        .iter()
        .map(|f| (f.seq, f.class.as_str()))
        .collect();
    assert_eq!(failed, vec![(0, "poison"), (1, "poison")]);
    for f in &report.failed_items {
        assert!(
            f.reason.contains("symbolic link") && f.reason.contains("refusing"),
            "{f:?}"
        );
    }
    assert!(
        report.failed_items[0].reason.contains("rejects"),
        "{:?}",
        report.failed_items
    );
    assert!(report.failed_items[1].reason.contains("part-000001.csv"));
    let names: Vec<_> = std::fs::read_dir(elsewhere.path())
        .expect("elsewhere")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("victim")],
        "nothing written outside"
    );
    assert_eq!(
        std::fs::read_to_string(elsewhere.path().join("victim")).expect("victim"),
        "precious\n"
    );
    assert!(
        !out.join("part-000000.csv").exists(),
        "no half-committed item"
    );
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&report.job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_with_wrong_clocks_neither_lose_leases_nor_duplicate_work() {
    let env = TestEnv::new("clock");
    let manifest = job_in(&env, "k", 6_000, 1_000);
    // Long enough items, acknowledged early and held by their leases alone:
    // a lease judged stale would be published again at once.
    let common = [
        "--prefetch",
        "1",
        "--debug-batch-delay",
        "150ms",
        "--ack-after",
        "300ms",
        "--heartbeat",
        "200ms",
        "--lease-ttl",
        "1s",
    ];
    let ahead: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--debug-clock-offset", "60s"])
        .collect();
    let behind: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--debug-clock-offset", "-60s"])
        .collect();
    let mut workers = vec![
        env.spawn_worker("ahead", &ahead),
        env.spawn_worker("behind", &behind),
    ];
    env.wait_for_consumers(2, &mut workers).await;
    let id = batchfleet_coordinator::manifest::load(&manifest, &[])
        .expect("manifest")
        .job_id;
    let run = start_run(&env.run_config(), &manifest);
    // While it runs, every lease's times are Redis's clock, not the workers'.
    let store = env.connections().store().await.expect("redis");
    let mut seen = 0;
    while !run.is_finished() {
        let now = store.now_ms().await.expect("time");
        for l in store.leases(&id).await.unwrap_or_default() {
            seen += 1;
            assert!(
                l.heartbeat_ms.abs_diff(now) < 5_000 && l.started_ms <= now + 1_000,
                "lease of {} is off Redis's clock by {} ms: {l:?}",
                l.worker,
                l.heartbeat_ms.abs_diff(now)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen > 0, "leases were seen while the job ran");
    let RunOutcome::Completed { report, .. } = run.await.expect("task").expect("run") else {
        panic!("not completed")
    };
    assert_eq!(report.status, "completed");
    assert_eq!(report.items_redispatched, 0, "no lease was judged stale");
    assert_eq!(report.deliveries, 6, "no duplicate work");
    assert!(verified(&env.path().join("k")).is_empty());
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

/// A tmpfs mounted for the test (unmounted when dropped).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Option<Self> {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(at.to_owned()))
    }

    fn resize(&self, size: &str) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .expect("remount");
        assert!(status.success(), "remount {}", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_pauses_the_worker_and_the_job_completes_once_space_is_freed() {
    let env = TestEnv::new("diskfull");
    let manifest = job_in(&env, "d", 8_000, 1_000);
    let out = env.path().join("d/out");
    std::fs::create_dir_all(&out).expect("out");
    // A small filesystem for the output that fills after a few items; where
    // mounting is not allowed, the worker plays a full disk instead.
    let tmpfs = Tmpfs::mount(&out, "96k");
    let flag = env.path().join("disk-full");
    let mut args = vec!["--disk-full-max-pause", "1s"];
    let flag_arg = flag.to_string_lossy().into_owned();
    if tmpfs.is_none() {
        eprintln!("cannot mount a tmpfs here: playing a full disk with --debug-disk-full-while");
        std::fs::write(&flag, b"").expect("flag");
        args.extend(["--debug-disk-full-while", flag_arg.as_str()]);
    }
    let mut workers = vec![env.spawn_worker("w1", &args)];
    env.wait_for_consumers(1, &mut workers).await;
    let id = batchfleet_coordinator::manifest::load(&manifest, &[])
        .expect("manifest")
        .job_id;
    let run = start_run(&env.run_config(), &manifest);
    let store = env.connections().store().await.expect("redis");
    // The worker hits the full disk, says so, hands the item back and pauses.
    until(
        "the worker paused on a full disk",
        Duration::from_secs(60),
        || async {
            store
                .unable(&id)
                .await
                .expect("notes")
                .get("w1")
                .is_some_and(|n| {
                    n.class == "disk_full" && n.reason.contains("No space left on device")
                })
        },
    )
    .await;
    until(
        "a second pause (still full)",
        Duration::from_secs(30),
        || async {
            workers[0]
                .log_text()
                .matches("output disk full: handing the item back")
                .count()
                >= 2
        },
    )
    .await;
    let p = store.progress(&id).await.expect("progress");
    assert!(p.items_done < p.items_total, "paused mid-job: {p:?}");
    assert_eq!(p.items_failed, 0);
    // Space is freed: the job completes.
    match &tmpfs {
        Some(fs) => fs.resize("64m"),
        None => std::fs::remove_file(&flag).expect("flag"),
    }
    let report = summary(run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed");
    assert_eq!(report.items_failed, 0, "no item failed");
    assert!(report.failed_items.is_empty());
    assert!(verified(&env.path().join("d")).is_empty());
    assert!(
        workers[0]
            .log_text()
            .contains("resuming consumption after the pause"),
        "{}",
        workers[0].log_text()
    );
    alive(&mut workers);
    stop_all(&mut workers);
    drop(tmpfs);
    env.cleanup(&[&id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_acknowledged_early_still_count_against_prefetch() {
    let env = TestEnv::new("inflight");
    let manifest = job_in(&env, "f", 4_000, 1_000);
    // Items of ~1.5 s acknowledged after 200 ms: the broker would send more.
    let mut workers = vec![env.spawn_worker(
        "w1",
        &[
            "--prefetch",
            "1",
            "--debug-batch-delay",
            "150ms",
            "--ack-after",
            "200ms",
            "--heartbeat",
            "100ms",
        ],
    )];
    env.wait_for_consumers(1, &mut workers).await;
    let id = batchfleet_coordinator::manifest::load(&manifest, &[])
        .expect("manifest")
        .job_id;
    let run = start_run(&env.run_config(), &manifest);
    let store = env.connections().store().await.expect("redis");
    let (mut most, mut acked) = (0, 0);
    while !run.is_finished() {
        let leases = store.leases(&id).await.unwrap_or_default();
        let done = store.done_items(&id).await.unwrap_or_default();
        let held = leases.iter().filter(|l| !done.contains(&l.seq)).count();
        most = most.max(held);
        acked += leases.iter().filter(|l| l.acked).count();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let RunOutcome::Completed { report, .. } = run.await.expect("task").expect("run") else {
        panic!("not completed")
    };
    assert_eq!(report.status, "completed");
    assert!(acked > 0, "items were acknowledged early");
    assert_eq!(most, 1, "never more items in flight than --prefetch");
    assert_eq!(report.deliveries, 4);
    assert!(verified(&env.path().join("f")).is_empty());
    alive(&mut workers);
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

#[test]
fn testing_aids_are_hidden_from_help_and_the_signing_key_is_documented() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_batchfleet-worker"))
        .arg("--help")
        .output()
        .expect("--help");
    let help = String::from_utf8_lossy(&out.stdout);
    for hidden in [
        "--debug-panic",
        "--debug-clock-offset",
        "--debug-disk-full-while",
        "--debug-batch-delay",
    ] {
        assert!(!help.contains(hidden), "{hidden} shows in --help:\n{help}");
    }
    for shown in [
        "--signing-key-file",
        "BATCHFLEET_SIGNING_KEY",
        "--unable-for",
        "--max-item-bytes",
        "--disk-full-max-pause",
    ] {
        assert!(help.contains(shown), "{shown} is not in --help:\n{help}");
    }
}

/// `--whole-messages` (for a fleet with workers older than version 3):
/// every message the coordinator publishes carries the job's task, and the
/// job runs as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_messages_carry_the_task_in_every_message() {
    let env = TestEnv::new("whole");
    let mut cfg = env.run_config();
    cfg.connections.whole_messages = true;
    let manifest = job_in(&env, "whole", 2_000, 1_000);
    // No worker yet: the messages wait in the job's queue to be looked at.
    let Waiting {
        id,
        run,
        broker,
        queue,
    } = start_waiting(&env, &cfg, &manifest, 2).await;
    for _ in 0..2 {
        let m = broker.get(&queue).await.expect("get").expect("a message");
        match Envelope::decode(&m.body).expect("decodes") {
            Envelope::V2(item) => assert_eq!(item.job_id, id),
            other => panic!("a whole message was expected, not {other:?}"),
        }
        // Dropped unsettled: back to the queue for the worker.
    }
    let mut workers = vec![env.spawn_worker("w1", &[])];
    let report = summary(run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert!(verified(&env.path().join("whole")).is_empty());
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

/// `dlq replay` signs what it publishes, so it checks what it reads. Of
/// three dead copies of a job's items — one signed with the coordinator's
/// key, one unsigned, one signed with another key — only the first is
/// replayed; `--trust-unsigned` adds the unsigned one, never the forged
/// one; and `--update-model` reads no file but the model the job's record
/// names. What is refused stays in the dead queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_checks_each_dead_message_before_signing_it_again() {
    use batchfleet_shared::message::CLASS_HEADER;
    use batchfleet_shared::store::{JobRecord, JobStatus};
    let env = TestEnv::new("replaysign");
    let key = SigningKey::new(b"0123456789abcdef-replay-key", "test").expect("key");
    let other = SigningKey::new(b"another-secret-0123456789", "test").expect("key");
    let job = unique("replaysign");
    let item = |seq| batchfleet_coordinator::planner::sample_item(&job, seq);
    let store = env.connections().store().await.expect("redis");
    store
        .put_job(&JobRecord {
            name: "replaysign".into(),
            status: JobStatus::CompletedWithFailures,
            pool: env.pool.clone(),
            manifest: "/m.toml".into(),
            output_dir: item(0).task.output.dir.clone(),
            model: item(0).task.model.path.clone(),
            model_sha256: item(0).task.model.sha256.clone(),
            items_total: 4,
            rows_total: 4,
            published_ms: 1,
            finished_ms: 2,
            items_published: 4,
            ..JobRecord::sample(&job)
        })
        .await
        .expect("put job");
    let broker = env.broker().await;
    let queues = PoolQueues::new(&env.pool);
    broker.declare(&queues).await.expect("declare");
    let dead = |item: &WorkItem, key: Option<&SigningKey>| {
        let mut m = Outgoing::work_item(item, 1, key);
        m.headers.set([(CLASS_HEADER, "model".to_owned())], []);
        m
    };
    let mut elsewhere = item(3);
    elsewhere.task.model.path = "/etc/hostname".into();
    broker
        .publish(
            &queues.dead(),
            vec![
                dead(&item(0), Some(&key)),
                dead(&item(1), None),
                dead(&item(2), Some(&other)),
                dead(&elsewhere, Some(&key)),
            ],
            4,
        )
        .await
        .expect("publish dead items");
    let filter = Filter {
        job: Some(job.clone()),
        ..Filter::default()
    };
    let replay = |unsigned, update_model| {
        let (broker, store, filter, key) = (broker.clone(), store.clone(), filter.clone(), &key);
        let pool = env.pool.clone();
        async move {
            dlq::replay(
                &*broker,
                &store,
                &pool,
                &filter,
                update_model,
                dlq::Trust {
                    key: Some(key),
                    unsigned,
                },
            )
            .await
            .expect("replay")
        }
    };
    // What a replay leaves dead goes back to the dead queue when the replay
    // lets go of it (returned unacknowledged): wait for `n` there, counted
    // without taking them, before the next step reads the queue.
    let dead_again = |n: u32| {
        let (broker, queue) = (broker.clone(), queues.dead());
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let ready = broker.ready_count(&queue).await.expect("count");
                if ready == Some(n) {
                    return;
                }
                assert!(Instant::now() < deadline, "{ready:?} dead, {n} expected");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let first = replay(false, false).await;
    assert_eq!(first.items, [0, 3], "the signed ones: {first:?}");
    assert_eq!(first.refused.len(), 2, "{first:?}");
    assert!(
        first
            .refused
            .iter()
            .any(|r| r.contains("item 1") && r.contains("unsigned")),
        "{first:?}"
    );
    assert!(
        first
            .refused
            .iter()
            .any(|r| r.contains("item 2") && r.contains("does not verify")),
        "{first:?}"
    );
    // What was published is signed with the coordinator's key.
    let replayed = broker
        .get(&queues.job(&job))
        .await
        .expect("get")
        .expect("a replayed item");
    let opened = batchfleet_shared::message::open(
        &replayed.body,
        replayed.headers.str(SIGNATURE_HEADER),
        Some(&key),
    )
    .expect("signed with the key");
    assert_eq!(opened.seq(), 0);
    replayed.ack().await.expect("ack");
    dead_again(2).await;
    let second = replay(true, false).await;
    assert_eq!(second.items, [1], "now the unsigned one: {second:?}");
    assert_eq!(second.refused.len(), 1, "the forged one, still: {second:?}");
    // The forged one stays dead; and a signed dead item naming another
    // model than the job's is not hashed by --update-model.
    dead_again(1).await;
    broker
        .publish(&queues.dead(), vec![dead(&elsewhere, Some(&key))], 1)
        .await
        .expect("publish");
    dead_again(2).await;
    let third = replay(false, true).await;
    assert!(third.items.is_empty(), "{third:?}");
    assert!(
        third.refused.iter().any(|r| r.contains("/etc/hostname")
            && r.contains("--update-model reads only the file the job's record names")),
        "{third:?}"
    );
    // What was refused is still dead.
    dead_again(2).await;
    assert_eq!(
        dlq::list(&*broker, &env.pool, &filter)
            .await
            .expect("list")
            .len(),
        2
    );
    broker.close("bye").await;
    env.cleanup(&[job.as_str()]).await;
}

/// A job listed among the pool's active jobs whose queue is gone (say, a
/// retire that deleted the queue but could not take the job off the list)
/// costs the workers nothing: the missing queue is found by a look on the
/// inspection channel and passed over (and a `basic.consume` that met it
/// would close only a channel of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_listed_active_without_its_queue_closes_no_channel() {
    let env = TestEnv::new("noqueue");
    let store = env.connections().store().await.expect("redis");
    let ghost = "ghost-00000000";
    store
        .activate_job(&env.pool, ghost, 2)
        .await
        .expect("listed");
    // The worker looks at the active jobs every 100 ms: it tries the
    // missing queue again and again while a real job runs.
    let mut workers = vec![env.spawn_worker("w1", &["--debug-jobs-every", "100ms"])];
    env.wait_for_consumers(1, &mut workers).await;
    let manifest = job_in(&env, "real", 4_000, 500);
    let (id, report) = crate::support::run_with_config_to_end(
        &env.run_config(),
        &manifest,
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert!(verified(&env.path().join("real")).is_empty());
    assert_eq!(report.deliveries, report.items_total, "no item came back");
    alive(&mut workers);
    let log = workers[0].log_text();
    assert!(!log.contains("lost the broker"), "{log}");
    stop_all(&mut workers);
    store
        .deactivate_job(&env.pool, ghost)
        .await
        .expect("unlisted");
    env.cleanup(&[&id]).await;
}

/// Issue: the attempt and grace headers a worker acts on were not covered
/// by the signature, so whoever can publish could make a signed item
/// dead-letter on its first failure, or retry without end. With a key, a
/// worker believes them only under their seal (`x-bf-settle`). Here item 0
/// arrives signed with an attempt forged to 2 (its seal says 1), item 1 as
/// a real, sealed second attempt; the worker panics on the first attempt
/// of each: item 0 is taken for attempt 1 (it panics, and its retry
/// commits), item 1 for attempt 2 (it does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_header_counts_only_under_its_seal() {
    use batchfleet_shared::message::ATTEMPT_HEADER;
    let env = TestEnv::new("sealed");
    let secret = "0123456789abcdef-settle-seal-key";
    let key = SigningKey::new(secret.as_bytes(), "test").expect("key");
    let mut cfg = env.run_config();
    cfg.connections.signing_key = Some(key.clone());
    let manifest = job_in(&env, "job", 2_000, 1_000);
    let items = plan(&manifest);
    let waiting = start_waiting(&env, &cfg, &manifest, 2).await;
    waiting.broker.purge(&waiting.queue).await.expect("purge");
    let mut forged = Outgoing::work_item(&items[0], 1, Some(&key));
    forged.headers.set([], [(ATTEMPT_HEADER, 2)]);
    let retry = Outgoing::work_item(&items[1], 2, Some(&key));
    waiting
        .broker
        .publish(&waiting.queue, vec![forged, retry], 2)
        .await
        .expect("publish");
    let mut workers = vec![env.spawn_worker_with_env(
        "w1",
        &["--debug-panic", "item:0@1,item:1@1"],
        &[("BATCHFLEET_SIGNING_KEY", secret.to_owned())],
    )];
    let RunOutcome::Completed { report, .. } = settled(waiting.run, Duration::from_secs(120)).await
    else {
        panic!("the job settles");
    };
    assert_eq!(
        (report.status.as_str(), report.items_completed),
        ("completed", 2)
    );
    stop_all(&mut workers);
    let log = workers[0].log_text();
    let panics: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("retrying later") && l.contains("injected panic"))
        .collect();
    assert_eq!(panics.len(), 1, "{log}");
    assert!(panics[0].contains("item=0"), "{log}");
    assert!(log.contains("not sealed with the signing key"), "{log}");
    waiting.broker.close("bye").await;
    env.cleanup(&[&waiting.id]).await;
}
