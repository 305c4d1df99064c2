//! Retiring a job against the real RabbitMQ and Redis: off the list at
//! once, its queue deleted a grace later by one sweeper.

use batchfleet_shared::broker::{self, Broker, PoolQueues};
use batchfleet_shared::retire::{after_sweeps, retire, sweep, Swept, RETIRED_GRACE};
use batchfleet_testkit::services::{delete_redis_prefix, unique};
use std::sync::Arc;
use std::time::Duration;

async fn rabbit(name: &str) -> Arc<dyn Broker> {
    broker::connect(&crate::amqp(), name, Duration::from_secs(10))
        .await
        .expect("rabbitmq")
}

/// A retired job leaves its pool's active jobs at once, but its queue stays
/// for the grace: a worker that read the list just before can still
/// consume it, which gets a subscription rather than a 404 (before, the
/// queue was deleted at once, and a consume meeting the deletion could
/// close the worker's connection). A sweep within the grace deletes
/// nothing; one past it deletes the queue.
#[tokio::test]
async fn a_retired_job_s_queue_outlives_the_grace_and_no_longer() {
    let prefix = unique("bftest-retire");
    let store = crate::store_at(&prefix).await;
    let pool = unique("retire");
    let queues = PoolQueues::new(&pool);
    let coordinator = rabbit("retire-coordinator").await;
    let worker = rabbit("retire-worker").await;
    coordinator.declare(&queues).await.expect("declare");
    let job = "job-00000001";
    coordinator
        .declare_job(&queues, job)
        .await
        .expect("declare the job's queue");
    store.activate_job(&pool, job, 1).await.expect("listed");

    retire(&store, &*coordinator, &pool, job).await;
    assert!(!store
        .active_jobs(&pool)
        .await
        .expect("list")
        .contains_key(job));
    let mut late = worker
        .consume(&queues.job(job), 2)
        .await
        .expect("a consume decided before the retire still finds the queue");
    assert_eq!(
        sweep(&store, &*coordinator, &pool, RETIRED_GRACE).await,
        Swept::default(),
        "within the grace, nothing is claimed"
    );
    // Past the grace, but a worker still consumes it: left for later.
    let consumed = sweep(&store, &*coordinator, &pool, Duration::ZERO).await;
    assert_eq!((consumed.claimed, consumed.deleted), (1, 0));
    assert!(consumed.left_some());
    assert!(coordinator
        .ready_count(&queues.job(job))
        .await
        .expect("count")
        .is_some());
    late.cancel().await;
    drop(late);
    assert_eq!(
        sweep(&store, &*coordinator, &pool, RETIRED_GRACE).await,
        Swept::default(),
        "the claim moved the note on by a grace"
    );

    let done = sweep(&store, &*coordinator, &pool, Duration::ZERO).await;
    assert_eq!((done.claimed, done.deleted), (1, 1));
    assert_eq!(
        coordinator
            .ready_count(&queues.job(job))
            .await
            .expect("count"),
        None,
        "past the grace, the queue is deleted"
    );
    assert!(
        worker.is_open() && coordinator.is_open(),
        "no connection was lost"
    );
    assert_eq!(
        sweep(&store, &*coordinator, &pool, Duration::ZERO).await,
        Swept::default(),
        "a deleted queue's note is gone"
    );

    let _ = coordinator.delete_pool(&queues).await;
    coordinator.close("bye").await;
    worker.close("bye").await;
    delete_redis_prefix(&prefix);
}

/// A job run again under its id before its queue was swept keeps the
/// queue (its new run's), and when two sweepers meet, each retired queue is
/// claimed and deleted by one of them.
#[tokio::test]
async fn a_sweep_spares_a_job_run_again_and_deletes_each_queue_once() {
    let prefix = unique("bftest-retire");
    let store = crate::store_at(&prefix).await;
    let pool = unique("retire");
    let queues = PoolQueues::new(&pool);
    let b = rabbit("retire-sweep").await;
    b.declare(&queues).await.expect("declare");
    let again = "job-00000002";
    let ended: Vec<String> = (0..5).map(|i| format!("job-1000000{i}")).collect();
    for job in ended.iter().map(String::as_str).chain([again]) {
        b.declare_job(&queues, job).await.expect("declare");
        store.activate_job(&pool, job, 1).await.expect("listed");
        retire(&store, &*b, &pool, job).await;
    }
    // Run again: the note taken back, and listed.
    assert!(store.forget_retired(&pool, again).await.expect("forget"));
    assert!(!store.forget_retired(&pool, again).await.expect("forget"));
    store
        .activate_job(&pool, again, 1)
        .await
        .expect("listed again");

    // Two sweepers at once, past a (here 200 ms) grace: the first claim
    // moves the notes on by that grace, so the other finds none due.
    let grace = Duration::from_millis(200);
    tokio::time::sleep(grace + Duration::from_millis(100)).await;
    let other = rabbit("retire-sweep-2").await;
    let (one, two) = tokio::join!(
        sweep(&store, &*b, &pool, grace),
        sweep(&store, &*other, &pool, grace),
    );
    assert_eq!(
        one.claimed + two.claimed,
        ended.len(),
        "each ended job's note claimed once"
    );
    assert_eq!(one.deleted + two.deleted, ended.len());
    for job in &ended {
        assert_eq!(b.ready_count(&queues.job(job)).await.expect("count"), None);
    }
    assert!(
        b.ready_count(&queues.job(again))
            .await
            .expect("count")
            .is_some(),
        "the job run again keeps its queue"
    );

    // Retired again later, it goes at the next sweep past the grace.
    retire(&store, &*b, &pool, again).await;
    assert_eq!(sweep(&store, &*b, &pool, Duration::ZERO).await.deleted, 1);
    assert_eq!(
        b.ready_count(&queues.job(again)).await.expect("count"),
        None
    );

    let _ = b.delete_pool(&queues).await;
    b.close("bye").await;
    other.close("bye").await;
    delete_redis_prefix(&prefix);
}

/// A retire in a pool also retires its ghosts: a listed job whose record is
/// gone, and one that finished long ago (its reducer died before its own
/// retire). A running job, and one that has only just finished (its own
/// retire is coming), stay listed.
#[tokio::test]
async fn a_retire_unlists_jobs_that_ended_long_ago_or_are_gone() {
    use batchfleet_shared::retire::GHOST_AFTER;
    use batchfleet_shared::store::{JobRecord, JobStatus};
    let prefix = unique("bftest-ghost");
    let store = crate::store_at(&prefix).await;
    let pool = unique("ghost");
    let queues = PoolQueues::new(&pool);
    let b = rabbit("ghost").await;
    b.declare(&queues).await.expect("declare");
    let now = batchfleet_shared::now_ms();
    let long_ago = now - GHOST_AFTER.as_millis() as u64 - 60_000;
    let jobs = [
        ("gone", None),
        ("ended-long-ago", Some((JobStatus::Completed, long_ago))),
        ("cancelled-long-ago", Some((JobStatus::Cancelled, long_ago))),
        ("just-ended", Some((JobStatus::Completed, now))),
        ("running", Some((JobStatus::Running, 0))),
    ];
    for (job, record) in jobs {
        if let Some((status, finished_ms)) = record {
            store
                .put_job(&JobRecord {
                    status,
                    finished_ms,
                    pool: pool.clone(),
                    ..JobRecord::sample(job)
                })
                .await
                .expect("put");
        }
        b.declare_job(&queues, job).await.expect("declare");
        store.activate_job(&pool, job, 1).await.expect("listed");
    }
    let retiring = "retiring";
    b.declare_job(&queues, retiring).await.expect("declare");
    store
        .activate_job(&pool, retiring, 1)
        .await
        .expect("listed");

    retire(&store, &*b, &pool, retiring).await;
    let listed: Vec<String> = store
        .active_jobs(&pool)
        .await
        .expect("list")
        .into_keys()
        .collect();
    assert_eq!(listed, ["just-ended", "running"]);
    // The ghosts are noted retired like the job itself: their queues go at
    // a sweep past the grace.
    assert_eq!(sweep(&store, &*b, &pool, Duration::ZERO).await.deleted, 4);
    for job in ["gone", "ended-long-ago", "cancelled-long-ago", retiring] {
        assert_eq!(
            b.ready_count(&queues.job(job)).await.expect("count"),
            None,
            "{job}"
        );
    }
    for job in ["just-ended", "running"] {
        assert!(
            b.ready_count(&queues.job(job))
                .await
                .expect("count")
                .is_some(),
            "{job}"
        );
    }

    let _ = b.delete_pool(&queues).await;
    b.close("bye").await;
    delete_redis_prefix(&prefix);
}

/// A claim whose sweeper dies before it deletes the queue comes due again a
/// grace later (its note is not lost), and a run of the job listed while a
/// sweep holds its queue waits until the sweep is over before it declares
/// the queue again.
#[tokio::test]
async fn a_dead_sweeper_s_claim_comes_due_again_and_a_new_run_waits_for_a_sweep() {
    let prefix = unique("bftest-claim");
    let store = crate::store_at(&prefix).await;
    let pool = unique("claim");
    let job = "job-00000003";
    store.note_retired(&pool, job).await.expect("noted");
    let claimed = store
        .take_retired(&pool, Duration::ZERO, 8)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    // Its sweeper died here. Within a grace of the claim nobody takes it;
    // past it, the next sweep does.
    assert!(store
        .take_retired(&pool, RETIRED_GRACE, 8)
        .await
        .expect("claim")
        .is_empty());
    let again = store
        .take_retired(&pool, Duration::ZERO, 8)
        .await
        .expect("claim");
    assert_eq!(
        again.iter().map(|(j, _)| j.as_str()).collect::<Vec<_>>(),
        [job]
    );
    // A stale claim does not drop the note: only the latest does.
    store
        .drop_retired(&pool, job, again[0].1.saturating_sub(1))
        .await
        .expect("drop");
    let latest = store
        .take_retired(&pool, Duration::ZERO, 8)
        .await
        .expect("claim");
    assert_eq!(latest.len(), 1, "a stale claim left the note");
    store
        .drop_retired(&pool, job, latest[0].1)
        .await
        .expect("drop");
    assert!(store
        .take_retired(&pool, Duration::ZERO, 8)
        .await
        .expect("claim")
        .is_empty());

    // A sweep holds the queue: a new run waits for it.
    assert!(store
        .fence_sweep(job, Duration::from_secs(20))
        .await
        .expect("fence"));
    assert!(
        !store
            .fence_sweep(job, Duration::from_secs(20))
            .await
            .expect("fence"),
        "one sweep at a time"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), after_sweeps(&store, job))
            .await
            .is_err(),
        "a new run waits while a sweep holds the queue"
    );
    store.unfence_sweep(job).await.expect("unfence");
    tokio::time::timeout(Duration::from_secs(5), after_sweeps(&store, job))
        .await
        .expect("done once the sweep is over")
        .expect("store");
    delete_redis_prefix(&prefix);
}
