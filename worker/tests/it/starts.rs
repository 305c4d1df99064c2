//! A new job's queue is consumed as soon as the job is announced, and let
//! go as soon as its end is: with the workers' timer that looks at the
//! pool's active jobs set to an hour, only the announcements on the pool's
//! notice exchange can bring them to a queue or take them away from it.

use crate::containment::{job_in, until};
use crate::support::{follow_to_end, free_port, labelled, scrape, submit, Backend, TestEnv};
use batchfleet_shared::broker::{Notice, PoolQueues, END_NOTICE_VALID};
use batchfleet_shared::signing::SigningKey;
use batchfleet_testkit::verify::verify;
use std::time::Duration;

crate::on_both_backends!(a_new_job_is_consumed_as_soon_as_it_is_announced);

async fn a_new_job_is_consumed_as_soon_as_it_is_announced(backend: Backend) {
    let env = TestEnv::new("starts");
    // Two jobs one after the other on the same workers (fleet: already
    // consuming, their one look at the active jobs made before either
    // existed; local: pipelines of each run).
    let mut workers = env.workers(backend, &[&["--debug-jobs-every", "1h"]]).await;
    let mut ids = Vec::new();
    for name in ["first", "second"] {
        let manifest = job_in(&env, name, 300, 100);
        let dir = env.path().join(name);
        let (job_id, report) = env.run_on(&workers, &manifest).await;
        assert_eq!(report.status, "completed", "{name}");
        let v = verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5).expect("verify");
        assert!(v.ok(), "{name}: {}", v.describe());
        assert_eq!(v.output_rows, 300, "{name}");
        ids.push(job_id);
    }
    workers.stop();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.cleanup(&ids).await;
}

/// A job's end is announced, signed: a worker that looks at the pool's
/// active jobs only every hour lets go of the ended job's queue at once
/// (its consumer leaves the queue, which stays for the retire grace). End
/// notices of the running job that are unsigned, signed with another key or
/// stale are refused: the worker keeps consuming its queue, and the job
/// completes. (Without end notices the worker would hold the ended job's
/// subscription until its next look, an hour later.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_job_is_let_go_at_its_signed_end_notice_and_forged_ones_are_refused() {
    let env = TestEnv::new("ends");
    let secret = "0123456789abcdef-test-end-notices";
    let key = SigningKey::new(secret.as_bytes(), "test").expect("key");
    let other = SigningKey::new(b"fedcba9876543210-another-key", "test").expect("key");
    let mut cfg = env.run_config();
    cfg.connections.signing_key = Some(key.clone());
    let port = free_port();
    let mut workers = vec![env.spawn_worker_with_env(
        "w1",
        &[
            "--metrics-port",
            &port,
            "--debug-jobs-every",
            "1h",
            "--debug-batch-delay",
            "300ms",
            "--prefetch",
            "1",
            "--prefetch-max",
            "1",
        ],
        &[("BATCHFLEET_SIGNING_KEY", secret.to_owned())],
    )];
    env.wait_for_consumers(1, &mut workers).await;
    let manifest = job_in(&env, "job", 4_000, 100);
    let dir = env.path().join("job");
    // 40 items of 0.3 s each, one at a time: at least 12 s of work.
    let job = submit(&cfg, &manifest).await;
    let broker = env.broker().await;
    let queues = PoolQueues::new(&env.pool);
    let queue = queues.job(&job);
    let consumers = || async {
        broker
            .consumer_count(&queue)
            .await
            .ok()
            .flatten()
            .unwrap_or(0)
    };
    until(
        "the worker consumes the job's queue",
        Duration::from_secs(30),
        || async { consumers().await == 1 },
    )
    .await;
    let now = batchfleet_shared::now_ms();
    let stale = now - END_NOTICE_VALID.as_millis() as u64 - 60_000;
    for forged in [
        Notice::end(&job, now, None),
        Notice::end(&job, now, Some(&other)),
        Notice::end(&job, stale, Some(&key)),
    ] {
        broker.announce(&queues, &forged).await.expect("announce");
    }
    let refused = || {
        labelled(
            &scrape(&port),
            "batchfleet_worker_notices_total",
            "kind",
            "refused",
        )
    };
    until(
        "three end notices refused",
        Duration::from_secs(30),
        || async { refused() == 3 },
    )
    .await;
    assert_eq!(
        consumers().await,
        1,
        "a refused end notice lets go of nothing"
    );
    let report = follow_to_end(&cfg, &job, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    let v = verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    assert_eq!(v.output_rows, 4_000);
    // The job's end, announced by its reducer, signed.
    until(
        "the worker lets go of the ended job's queue",
        Duration::from_secs(30),
        || async { consumers().await == 0 },
    )
    .await;
    assert!(
        broker.ready_count(&queue).await.expect("declare").is_some(),
        "the queue itself stays for the retire grace"
    );
    let metrics = scrape(&port);
    assert!(
        labelled(&metrics, "batchfleet_worker_notices_total", "kind", "end") >= 1,
        "{metrics}"
    );
    assert_eq!(refused(), 3);
    broker.close("bye").await;
    for w in &mut workers {
        w.terminate(Duration::from_secs(30));
    }
    env.cleanup(&[job.as_str()]).await;
}

/// The first delivery of an item starts without the start script (no Redis
/// request; its delivery counted with its commit) and takes a lease only
/// once it outlives a heartbeat, dated back to when the worker took it.
/// Items here take 300 ms at the model against a 100 ms heartbeat, so each
/// is leased while it runs; none is left leased at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_deliveries_start_without_a_round_trip_and_lease_only_past_a_heartbeat() {
    let env = TestEnv::new("quick");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    let workers = env
        .workers(
            Backend::Fleet,
            &[&[
                "--metrics-port",
                &port,
                "--heartbeat",
                "100ms",
                "--debug-batch-delay",
                "300ms",
            ]],
        )
        .await;
    let manifest = job_in(&env, "job", 800, 100);
    let dir = env.path().join("job");
    let store = env.connections().store().await.expect("redis");
    let watch = {
        let store = store.clone();
        tokio::spawn(async move {
            // The leases seen while the job runs (the job id is the only
            // one under this env's prefix).
            let mut seen = Vec::new();
            for _ in 0..600 {
                for id in store.recent_jobs(4).await.unwrap_or_default() {
                    seen.extend(store.leases(&id).await.unwrap_or_default());
                }
                if seen.len() >= 3 {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            seen
        })
    };
    let (job_id, report) = env.run_on(&workers, &manifest).await;
    assert_eq!(report.status, "completed");
    let v = verify(&dir.join("out"), &dir.join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    let seen = watch.await.expect("watch");
    assert!(!seen.is_empty(), "items outliving a heartbeat are leased");
    for l in &seen {
        assert!(
            l.heartbeat_ms >= l.started_ms + 80,
            "a lease written at the first heartbeat starts when the item was taken: {l:?}"
        );
    }
    assert!(store.leases(&job_id).await.expect("leases").is_empty());
    assert_eq!(
        report.deliveries, report.items_total,
        "each start counted once, with its commit: {report:?}"
    );
    let metrics = ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .expect("scrape")
        .into_string()
        .expect("text");
    let starts = |how: &str| -> u64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("batchfleet_worker_item_starts_total")
                    && l.contains(&format!("how=\"{how}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    assert_eq!(
        (starts("quick"), starts("checked")),
        (report.items_total, 0),
        "every item was a first delivery: {metrics}"
    );
    let mut workers = workers;
    workers.stop();
    env.cleanup(&[job_id.as_str()]).await;
}
