//! Bundles (version 4 of the work message) against the real RabbitMQ, Redis
//! and libtorch: a job of many short items travels several items to a
//! message, each item is still started, committed and dead-lettered alone,
//! and a bundle that comes back is split into its items.

use crate::containment::{dead_items, job_in, start_waiting, summary, until, verified, Waiting};
use crate::support::{free_port, labelled, stop_all, Backend, TestEnv, Workers};
use batchfleet_coordinator::dlq::Filter;
use batchfleet_shared::broker::Outgoing;
use batchfleet_shared::message::{Envelope, InputSlice};
use batchfleet_shared::signing::SigningKey;
use std::time::Duration;

/// The sum of a worker's counter `name` over the samples labelled `how`.
fn counter(metrics: &str, name: &str, how: &str) -> u64 {
    labelled(metrics, name, "how", how)
}

crate::on_both_backends!(a_job_of_short_items_travels_in_bundles_and_every_row_is_predicted_once);

/// 256 items of 5 rows: published four to a message (the job keeps 64
/// messages), worked on two workers, each row predicted once and each item
/// started once.
async fn a_job_of_short_items_travels_in_bundles_and_every_row_is_predicted_once(backend: Backend) {
    let env = TestEnv::new("bundled");
    let mut workers = env.workers(backend, &[&[], &[]]).await;
    let manifest = job_in(&env, "job", 1_280, 5);
    let (id, report) = env.run_on(&workers, &manifest).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!(report.items_total, 256);
    assert!(verified(&env.path().join("job")).is_empty());
    assert_eq!(
        report.deliveries, report.items_total,
        "each item started once: {report:?}"
    );
    workers.stop();
    env.cleanup(&[&id]).await;
}

/// One fleet worker that holds 16 deliveries at a time (17 bundles with the
/// one waiting) and spends 50 ms on each item, with the given heartbeat
/// and lease ttl.
async fn busy_worker(env: &TestEnv, heartbeat: &str, lease_ttl: &str) -> Workers {
    let flags = [
        "--prefetch",
        "16",
        "--prefetch-max",
        "16",
        "--debug-batch-delay",
        "50ms",
        "--heartbeat",
        heartbeat,
        "--lease-ttl",
        lease_ttl,
    ];
    env.workers(Backend::Fleet, &[&flags]).await
}

/// Deliveries a busy worker holds and has not finished — the items of the
/// bundles in its prefetch, started without a lease until their first
/// heartbeat — are in neither the queue nor a lease. While the job commits
/// items they are being worked through, and none is taken for lost once
/// the queue reads empty (each was copied before: the simulated-fleet soak
/// counted 1,183 copies in 20,000 items).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_a_busy_worker_holds_are_not_taken_for_lost() {
    let env = TestEnv::new("bundle-held");
    // 256 items of 5 rows (64 bundles of 4), 50 ms each: about 13 s of
    // work for one worker that holds 17 bundles at a time and leases an
    // item only once it outlives a 5 s heartbeat. The queue reads empty
    // with about 3.4 s of work held and unleased; the lost-message grace is
    // 1 s, and the job commits an item every 50 ms.
    let manifest = job_in(&env, "job", 1_280, 5);
    let mut workers = busy_worker(&env, "5s", "30s").await;
    let (id, _) = run_without_copies(&env, &workers, &manifest).await;
    workers.stop();
    env.cleanup(&[&id]).await;
}

/// Runs the job of `manifest` (in folder `job`) on `workers` with a
/// lost-message grace of 1 s, and checks that it completed, every row
/// once, with no copy and each item started once.
async fn run_without_copies(
    env: &TestEnv,
    workers: &Workers,
    manifest: &std::path::Path,
) -> (String, batchfleet_coordinator::reducer::Summary) {
    let mut cfg = env.run_config();
    cfg.supervise.orphan_grace = Duration::from_secs(1);
    let (id, report) = env.run_on_with(workers, manifest, &cfg).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert!(verified(&env.path().join("job")).is_empty());
    assert_eq!(
        (report.items_redispatched, report.deliveries),
        (0, report.items_total),
        "no copy, each item started once: {report:?}"
    );
    (id, report)
}

/// Deliveries that wait in a worker behind a long item, while their job
/// commits nothing, are named by the worker's beat (its queued field): the
/// coordinator does not take them for lost, however long they wait —
/// neither one the worker has not started (in its buffer) nor one it has
/// started that waits for its turn at the model (not leased until then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_waiting_behind_a_long_item_are_not_taken_for_lost() {
    let env = TestEnv::new("bundle-queued");
    // Three items of one mini-batch each, 3 s per mini-batch, on a worker
    // with two permits and one model thread: one item at the model, one
    // started and waiting for it, one in the buffer (its job queue's
    // prefetch is 3). The queue reads empty at once, the job commits
    // nothing for 3 s at a time, and the lost-message grace is 1 s.
    let manifest = job_in(&env, "job", 15, 5);
    let flags = [
        "--prefetch",
        "2",
        "--prefetch-max",
        "2",
        "--debug-batch-delay",
        "3s",
        "--heartbeat",
        "200ms",
        "--lease-ttl",
        "2s",
    ];
    let mut workers = env.workers(Backend::Fleet, &[&flags]).await;
    let (id, report) = run_without_copies(&env, &workers, &manifest).await;
    assert_eq!(report.items_total, 3, "{report:?}");
    workers.stop();
    env.cleanup(&[&id]).await;
}

/// Counts, from Redis's `MONITOR` stream, the commands whose first key
/// starts with `prefix`, by command and key suffix (`HSET …:leases`), until
/// the returned sender is dropped.
async fn tap_redis(
    prefix: String,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::collections::BTreeMap<String, u64>>,
) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let mut tcp = tokio::net::TcpStream::connect("127.0.0.1:6379")
        .await
        .expect("Redis");
    tcp.write_all(b"MONITOR\r\n").await.expect("MONITOR");
    let mut lines = BufReader::new(tcp).lines();
    assert_eq!(
        lines.next_line().await.expect("reply").as_deref(),
        Some("+OK")
    );
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut counts = std::collections::BTreeMap::new();
        loop {
            let line = tokio::select! {
                l = lines.next_line() => l.expect("monitor").expect("monitor open"),
                _ = &mut stopped => return counts,
            };
            // +<time> [<db> <client>] "CMD" "key" ...
            let mut args = line.split('"').skip(1).step_by(2);
            let (Some(cmd), Some(key)) = (args.next(), args.next()) else {
                continue;
            };
            if let Some(rest) = key.strip_prefix(prefix.as_str()) {
                let suffix = rest.rsplit('}').next().unwrap_or("");
                *counts.entry(format!("{cmd} {suffix}")).or_insert(0) += 1;
            }
        }
    });
    (stop, task)
}

/// An item waiting for the model is not leased: the items of the bundles
/// a busy worker holds wait many heartbeats for their turn, and the
/// worker's one beat per job (its queued field) says it holds them, so
/// none is taken for lost; a lease is written only for an item still
/// unsettled a heartbeat after its turn at the model, and kept live by the
/// same beat. The
/// leases' ttl is shorter than the wait, so a lease written while an item
/// waited and not kept live would go stale and be counted as a crash.
/// Leased from the first heartbeat whatever they were doing, nearly every
/// item here would be (about 256 writes); written at every heartbeat,
/// about 13 an item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_waiting_for_the_model_are_not_leased_and_the_worker_s_beat_holds_them() {
    let env = TestEnv::new("bundle-beat");
    // 256 items of 5 rows (64 bundles of 4), 50 ms each; one worker holds
    // 17 bundles (68 items, 3.4 s of work) at a time; heartbeat 200 ms,
    // leases stale after 1 s (a stale lease of an unsettled item is
    // counted as a crash of it).
    let manifest = job_in(&env, "job", 1_280, 5);
    let mut workers = busy_worker(&env, "200ms", "1s").await;
    let (stop, tap) = tap_redis(format!("{}:job:", env.prefix)).await;
    let (id, report) = env.run_on(&workers, &manifest).await;
    let _ = stop.send(());
    let counts = tap.await.expect("tap");
    assert_eq!(report.status, "completed", "{report:?}");
    assert!(verified(&env.path().join("job")).is_empty());
    assert_eq!(
        (report.items_redispatched, report.deliveries),
        (0, report.items_total),
        "no lease went stale: no copy, each item started once: {report:?}"
    );
    assert_eq!(
        counts.get("HINCRBY :crashes"),
        None,
        "no lease went stale, so no crash was counted: {counts:?}"
    );
    let writes = counts.get("HSET :leases").copied().unwrap_or(0);
    let beats = counts.get("HSET :beats").copied().unwrap_or(0);
    assert!(beats > 0, "the worker beat on the job: {counts:?}");
    eprintln!(
        "lease writes: {writes} for {} items; beats: {beats}",
        report.items_total
    );
    // Each item spends 50 ms at the model and is committed moments later:
    // few are still unsettled 200 ms after their turn.
    assert!(
        writes <= report.items_total / 4,
        "{writes} lease writes for {} items: {counts:?}",
        report.items_total
    );
    workers.stop();
    env.cleanup(&[&id]).await;
}

/// A bundle's items are worked one by one: of a signed bundle whose one
/// item names a file outside the data root, only that item is rejected
/// (the supervisor publishes the real one again as a lost message), and
/// its other items are committed. A bundle that comes back (taken and
/// returned: a redelivery) is split into its items, each checked where it
/// starts. Every row ends up predicted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_item_costs_only_itself_and_a_bundle_that_comes_back_is_split() {
    let env = TestEnv::new("bundle-parts");
    let secret = "0123456789abcdef-test-signing-key";
    let key = SigningKey::new(secret.as_bytes(), "test").expect("key");
    let mut cfg = env.run_config();
    cfg.connections.signing_key = Some(key.clone());
    let manifest = job_in(&env, "job", 1_280, 5);
    // No worker yet: the 64 bundles wait in the job's queue.
    let Waiting {
        id,
        run,
        broker,
        queue,
    } = start_waiting(&env, &cfg, &manifest, 64).await;
    // One bundle comes back (taken and returned)...
    let back = broker.get(&queue).await.expect("get").expect("a bundle");
    let Ok(Envelope::V4(returned)) = Envelope::decode(&back.body) else {
        panic!("256 five-row items travel in bundles")
    };
    // ...and another is replaced by a copy with one item forged, signed.
    let taken = broker.get(&queue).await.expect("get").expect("a bundle");
    let Ok(Envelope::V4(mut forged)) = Envelope::decode(&taken.body) else {
        panic!("a bundle")
    };
    back.requeue().await.expect("return");
    taken.ack().await.expect("ack");
    assert_eq!((returned.items.len(), forged.items.len()), (4, 4));
    let elsewhere = tempfile::tempdir().expect("elsewhere");
    let outside = elsewhere.path().join("secret.csv");
    std::fs::write(&outside, "id,f0\nx,1\n").expect("secret");
    let bad_seq = forged.items[1].seq;
    if let InputSlice::CsvRange(r) = &mut forged.items[1].input {
        r.path = outside.to_string_lossy().into_owned();
    }
    broker
        .publish(
            &queue,
            vec![Outgoing::bundle(forged.clone(), Some(&key))],
            1,
        )
        .await
        .expect("publish");

    let port = free_port();
    let mut workers = vec![env.spawn_worker_with_env(
        "w1",
        &["--metrics-port", &port],
        &[("BATCHFLEET_SIGNING_KEY", secret.to_owned())],
    )];
    let report = summary(run, Duration::from_secs(180)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!(report.items_failed, 0, "a rejected message fails no item");
    assert!(verified(&env.path().join("job")).is_empty());
    // Only the forged item is dead, as a rejected message of its own.
    let dead = dead_items(
        &env,
        Filter {
            job: Some(id.clone()),
            ..Filter::default()
        },
    )
    .await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (dead[0].class.as_str(), dead[0].item),
        ("rejected", Some(bad_seq))
    );
    assert!(
        dead[0].error.contains("refusing the item's input file"),
        "{dead:?}"
    );
    let metrics = ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .expect("scrape")
        .into_string()
        .expect("text");
    let bundles = |how| counter(&metrics, "batchfleet_worker_bundles_total", how);
    assert_eq!(bundles("split"), 1, "{metrics}");
    assert_eq!(bundles("opened"), 63, "{metrics}");
    // The returned bundle's items, and the forged one's real item published
    // again, started through the start script; every other item at once.
    let starts = |how| counter(&metrics, "batchfleet_worker_item_starts_total", how);
    assert_eq!(starts("checked"), 5, "{metrics}");
    assert_eq!(starts("quick"), 251, "{metrics}");
    // A bundle's part files are made durable together: one filesystem sync
    // for the items written side by side, not an fsync each.
    let syncs = |what| labelled(&metrics, "batchfleet_syncs_total", "what", what);
    let shared = syncs("filesystem") + syncs("file");
    assert!(
        shared <= 128,
        "{shared} data syncs for 256 items in bundles of 4: {metrics}"
    );
    assert!(syncs("filesystem") > 0, "{metrics}");
    stop_all(&mut workers);
    broker.close("bye").await;
    env.cleanup(&[&id]).await;
}

/// A bundle the broker dead-letters itself (it came back past the delivery
/// limit without ever reaching a worker that could split it) fails each of
/// its items as `infra`, is listed item by item by `dlq list`, and is
/// replayed whole by `dlq replay`: the job then completes with every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bundle_the_broker_dead_letters_fails_lists_and_replays_item_by_item() {
    let env = TestEnv::new("bundle-limit");
    let manifest = job_in(&env, "job", 1_280, 5);
    let Waiting {
        id,
        run,
        broker,
        queue,
    } = start_waiting(&env, &env.run_config(), &manifest, 64).await;
    let mut deliveries = 0;
    let head = loop {
        let m = broker.get(&queue).await.expect("get").expect("a message");
        let Ok(Envelope::V4(b)) = Envelope::decode(&m.body) else {
            panic!("a bundle")
        };
        assert_eq!(
            b.first_seq(),
            0,
            "the head of the queue comes back each time"
        );
        deliveries += 1;
        m.requeue().await.expect("nack");
        if deliveries > batchfleet_shared::broker::DELIVERY_LIMIT {
            break b;
        }
    };
    until(
        "dead-lettered by the broker",
        Duration::from_secs(30),
        || async { broker.ready_count(&queue).await.ok().flatten() == Some(63) },
    )
    .await;
    let seqs: Vec<u32> = head.items.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3]);
    let mut workers = vec![env.spawn_worker("w1", &[])];
    let report = summary(run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed_with_failures", "{report:?}");
    let failed: Vec<_> = report
        .failed_items
        .iter()
        .map(|f| (f.seq, f.class.as_str()))
        .collect();
    assert_eq!(
        failed,
        seqs.iter().map(|&s| (s, "infra")).collect::<Vec<_>>()
    );
    let filter = Filter {
        job: Some(id.clone()),
        ..Filter::default()
    };
    let dead = dead_items(&env, filter.clone()).await;
    let listed: Vec<_> = dead.iter().map(|d| (d.item, d.class.as_str())).collect();
    assert_eq!(
        listed,
        seqs.iter().map(|&s| (Some(s), "infra")).collect::<Vec<_>>()
    );
    // Only item 2 is asked for: the bundle is replayed whole.
    let store = env.connections().store().await.expect("redis");
    let replayed = batchfleet_coordinator::dlq::replay(
        &*broker,
        &store,
        &env.pool,
        &Filter {
            item: Some(2),
            ..filter.clone()
        },
        false,
        batchfleet_coordinator::dlq::Trust {
            key: None,
            unsigned: true,
        },
    )
    .await
    .expect("replay");
    assert_eq!(replayed.items, seqs);
    let again =
        crate::support::follow_to_end(&env.run_config(), &id, Duration::from_secs(120)).await;
    assert_eq!(again.status, "completed", "{again:?}");
    assert!(verified(&env.path().join("job")).is_empty());
    assert!(
        dead_items(&env, filter).await.is_empty(),
        "nothing left dead"
    );
    stop_all(&mut workers);
    broker.close("bye").await;
    env.cleanup(&[&id]).await;
}
