//! Retiring a job against the real RabbitMQ and Redis: off the list at
//! once, its queue deleted a grace later by one sweeper.

use batchfleet_shared::broker::{self, Broker, PoolQueues};
use batchfleet_shared::retire::{retire, sweep, RETIRED_GRACE};
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
    late.cancel().await;
    drop(late);
    assert_eq!(
        sweep(&store, &*coordinator, &pool, RETIRED_GRACE).await,
        0,
        "within the grace, nothing is deleted"
    );
    assert!(coordinator
        .ready_count(&queues.job(job))
        .await
        .expect("count")
        .is_some());

    assert_eq!(sweep(&store, &*coordinator, &pool, Duration::ZERO).await, 1);
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
        0,
        "a note is taken once"
    );

    let _ = coordinator.delete_pool(&queues).await;
    coordinator.close("bye").await;
    worker.close("bye").await;
    delete_redis_prefix(&prefix);
}

/// A job run again under its id before its queue was swept keeps the
/// queue (its new run's), and when two sweepers meet, each retired queue is
/// deleted by one of them.
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
    // Run again: listed, and the note taken back.
    store
        .activate_job(&pool, again, 1)
        .await
        .expect("listed again");

    let other = rabbit("retire-sweep-2").await;
    let (one, two) = tokio::join!(
        sweep(&store, &*b, &pool, Duration::ZERO),
        sweep(&store, &*other, &pool, Duration::ZERO),
    );
    assert_eq!(
        one + two,
        ended.len(),
        "each ended job's queue deleted once"
    );
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
    assert_eq!(sweep(&store, &*b, &pool, Duration::ZERO).await, 1);
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
    assert_eq!(sweep(&store, &*b, &pool, Duration::ZERO).await, 4);
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
