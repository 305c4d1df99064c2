//! The in-process broker (`broker::local`) keeps the semantics of the
//! RabbitMQ one: prefetch, redelivery counts, the delivery limit's
//! dead-letter fan-out, retry tiers, unroutable publishes, returns on drop
//! and on close, and handles sharing queues.

use batchfleet_shared::broker::local::LocalQueues;
use batchfleet_shared::broker::{
    Broker, BrokerError, Delivery, Headers, Outgoing, PoolQueues, Subscription,
    DELIVERY_COUNT_HEADER, DELIVERY_LIMIT,
};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::timeout;

/// Upper bound for something that must happen (a safety net, not a wait).
const SOON: Duration = Duration::from_secs(5);
/// How long a negative check waits for something that must not happen.
const BRIEFLY: Duration = Duration::from_millis(20);

fn msg(id: &str) -> Outgoing {
    Outgoing {
        message_id: id.into(),
        kind: "test",
        body: id.as_bytes().to_vec(),
        headers: Headers::of([("who", format!("h-{id}"))], [("n", 7)]),
        expiration_ms: None,
    }
}

fn expiring(id: &str, ms: u64) -> Outgoing {
    Outgoing {
        expiration_ms: Some(ms),
        ..msg(id)
    }
}

async fn setup(pool: &str) -> (LocalQueues, Arc<dyn Broker>, PoolQueues) {
    let hub = LocalQueues::new();
    let b = hub.handle();
    let q = PoolQueues::new(pool);
    b.declare(&q).await.expect("declare");
    b.declare(&q).await.expect("declaring again is fine");
    (hub, b, q)
}

async fn next(sub: &mut Box<dyn Subscription>) -> Delivery {
    timeout(SOON, sub.next())
        .await
        .expect("a delivery in time")
        .expect("subscription open")
        .expect("no error")
}

async fn ready(b: &Arc<dyn Broker>, queue: &str) -> u32 {
    b.ready_count(queue)
        .await
        .expect("ready_count")
        .expect("queue exists")
}

#[tokio::test]
async fn publish_consume_and_ack() {
    let (_hub, b, q) = setup("pca").await;
    assert_eq!(b.describe(), "in-process queues");
    assert!(b.is_open());
    for name in q.all() {
        assert_eq!(ready(&b, &name).await, 0, "{name} declared empty");
    }
    let n = b
        .publish(&q.work(), vec![msg("a"), msg("b"), msg("c")], 2)
        .await
        .expect("publish");
    assert_eq!(n, 3);
    assert_eq!(b.publish(&q.work(), vec![], 2).await.expect("nothing"), 0);
    assert_eq!(ready(&b, &q.work()).await, 3);

    let mut sub = b.consume(&q.work(), 10).await.expect("consume");
    let mut tags = Vec::new();
    for id in ["a", "b", "c"] {
        let d = next(&mut sub).await;
        assert_eq!(d.message_id, id);
        assert_eq!(d.body, id.as_bytes());
        assert_eq!(d.headers.str("who"), Some(format!("h-{id}").as_str()));
        assert_eq!(d.headers.int("n"), Some(7));
        assert_eq!(d.headers.int(DELIVERY_COUNT_HEADER), None, "first delivery");
        assert_eq!(d.delivery_count(), 0);
        tags.push(d.tag);
        d.ack().await.expect("ack");
        d.ack().await.expect("a second ack is a no-op");
        d.requeue().await.expect("so is a requeue after the ack");
    }
    assert!(
        tags.windows(2).all(|w| w[0] < w[1]),
        "tags increase: {tags:?}"
    );
    assert_eq!(ready(&b, &q.work()).await, 0);
    // Acked means gone: closing the handle returns nothing.
    b.close("done").await;
    let other = _hub.handle();
    assert_eq!(ready(&other, &q.work()).await, 0);
}

#[tokio::test]
async fn prefetch_bounds_unsettled_deliveries() {
    let (_hub, b, q) = setup("prefetch").await;
    b.publish(&q.work(), vec![msg("1"), msg("2"), msg("3")], 8)
        .await
        .expect("publish");
    let mut sub = b.consume(&q.work(), 2).await.expect("consume");
    let first = next(&mut sub).await;
    let second = next(&mut sub).await;
    assert_eq!(
        (first.message_id.as_str(), second.message_id.as_str()),
        ("1", "2")
    );
    // Two unsettled: a third does not come (negative check only) ...
    assert!(
        timeout(BRIEFLY, sub.next()).await.is_err(),
        "prefetch 2 holds back a third"
    );
    // ... and the dropped wait took nothing.
    assert_eq!(ready(&b, &q.work()).await, 1);
    // Settling one frees a slot.
    first.ack().await.expect("ack");
    let third = next(&mut sub).await;
    assert_eq!(third.message_id, "3");
    assert!(timeout(BRIEFLY, sub.next()).await.is_err(), "full again");
    second.ack().await.expect("ack");
    third.ack().await.expect("ack");
    // Slots free, queue empty: still nothing.
    assert!(timeout(BRIEFLY, sub.next()).await.is_err(), "nothing ready");
    // A message published while a consumer waits reaches it.
    let waiting = tokio::spawn(async move {
        let d = next(&mut sub).await;
        d.ack().await.expect("ack");
        d.message_id
    });
    b.publish(&q.work(), vec![msg("4")], 1)
        .await
        .expect("publish");
    assert_eq!(
        timeout(SOON, waiting)
            .await
            .expect("in time")
            .expect("task"),
        "4"
    );
}

#[tokio::test]
async fn requeue_raises_the_delivery_count() {
    let (_hub, b, q) = setup("requeue").await;
    b.publish(&q.work(), vec![msg("x"), msg("y")], 8)
        .await
        .expect("publish");
    let mut sub = b.consume(&q.work(), 1).await.expect("consume");
    for count in 0..3 {
        let d = next(&mut sub).await;
        assert_eq!(d.message_id, "x", "a returned message goes to the front");
        assert_eq!(d.delivery_count(), count);
        assert_eq!(d.headers.str("who"), Some("h-x"), "own headers kept");
        d.requeue().await.expect("requeue");
        d.requeue().await.expect("a second requeue is a no-op");
    }
    let d = next(&mut sub).await;
    assert_eq!(d.headers.int(DELIVERY_COUNT_HEADER), Some(3));
    assert_eq!(d.headers.own().int(DELIVERY_COUNT_HEADER), None);
    d.ack().await.expect("ack");
    let y = next(&mut sub).await;
    assert_eq!((y.message_id.as_str(), y.delivery_count()), ("y", 0));
}

#[tokio::test]
async fn past_the_delivery_limit_a_message_goes_to_dead_and_infra() {
    let (_hub, b, q) = setup("limit").await;
    b.publish(&q.work(), vec![msg("doomed")], 1)
        .await
        .expect("publish");
    let mut sub = b.consume(&q.work(), 1).await.expect("consume");
    for returned in 0..=DELIVERY_LIMIT {
        let d = next(&mut sub).await;
        assert_eq!(d.delivery_count(), returned);
        if returned % 2 == 0 {
            d.requeue().await.expect("requeue");
        } else {
            drop(d); // dropped unsettled: returned all the same
        }
    }
    // Returned DELIVERY_LIMIT + 1 times: dead-lettered, not redelivered.
    assert!(
        timeout(BRIEFLY, sub.next()).await.is_err(),
        "not redelivered"
    );
    assert_eq!(ready(&b, &q.work()).await, 0);
    assert_eq!(ready(&b, &q.dead()).await, 1);
    assert_eq!(ready(&b, &q.infra()).await, 1);
    for queue in [q.dead(), q.infra()] {
        let d = b.get(&queue).await.expect("get").expect("a copy");
        assert_eq!(d.message_id, "doomed");
        assert_eq!(d.body, b"doomed");
        assert_eq!(d.headers.str("who"), Some("h-doomed"));
        assert_eq!(
            d.headers.int(DELIVERY_COUNT_HEADER),
            Some(DELIVERY_LIMIT + 1)
        );
        d.ack().await.expect("ack");
    }
    // Only the work queue has a limit: a dead letter can be returned freely.
    b.publish(&q.dead(), vec![msg("kept")], 1)
        .await
        .expect("publish");
    for _ in 0..=DELIVERY_LIMIT + 1 {
        let d = b.get(&q.dead()).await.expect("get").expect("still there");
        d.requeue().await.expect("requeue");
    }
    assert_eq!(ready(&b, &q.dead()).await, 1);
    assert_eq!(ready(&b, &q.infra()).await, 0);
}

#[tokio::test]
async fn a_retry_tier_sends_expired_messages_back_to_work() {
    // tokio's test-util (paused time) is not enabled for this crate, so the
    // short expirations here run on the real clock; the test awaits the
    // arrival in the work queue (bounded by SOON), it never sleeps.
    let (hub, b, q) = setup("retry").await;
    let retry = q.retry_for(40);

    // Until it expires, a retry message is ready in its tier.
    b.publish(&retry, vec![expiring("later", 3_600_000)], 1)
        .await
        .expect("publish");
    assert_eq!(ready(&b, &retry).await, 1);
    assert_eq!(ready(&b, &q.work()).await, 0);
    let peek = b.get(&retry).await.expect("get").expect("visible to get");
    assert_eq!(peek.message_id, "later");
    drop(peek);
    assert_eq!(ready(&b, &retry).await, 1, "returned to its tier");

    // Expiry on a work queue is ignored: it stays (checked below).
    let other = PoolQueues::new("retry-other");
    b.declare(&other).await.expect("declare");
    b.publish(&other.work(), vec![expiring("stays", 1)], 1)
        .await
        .expect("publish");

    // A short one moves to the end of work by itself, while only a waiting
    // consumer (on another handle) is there to notice.
    let worker = hub.handle();
    let mut sub = worker.consume(&q.work(), 4).await.expect("consume");
    b.publish(&retry, vec![expiring("soon", 200)], 1)
        .await
        .expect("publish");
    assert_eq!(ready(&b, &retry).await, 2);
    let d = next(&mut sub).await;
    assert_eq!(d.message_id, "soon");
    assert_eq!(d.delivery_count(), 0);
    assert_eq!(d.headers.str("who"), Some("h-soon"));
    d.ack().await.expect("ack");
    assert_eq!(ready(&b, &retry).await, 1, "the long one still waits");
    assert_eq!(
        ready(&b, &other.work()).await,
        1,
        "work queues ignore expiry"
    );

    // Purged, or taken and acked, before it expires: its timer finds
    // nothing to move (the next arrival in work is the later one).
    assert_eq!(b.purge(&retry).await.expect("purge"), 1);
    b.publish(&retry, vec![expiring("purged", 100)], 1)
        .await
        .expect("publish");
    assert_eq!(b.purge(&retry).await.expect("purge"), 1);
    b.publish(
        &retry,
        vec![expiring("taken", 100), expiring("next", 400)],
        2,
    )
    .await
    .expect("publish");
    let taken = b.get(&retry).await.expect("get").expect("taken");
    assert_eq!(taken.message_id, "taken");
    taken.ack().await.expect("ack");
    let d = next(&mut sub).await;
    assert_eq!(d.message_id, "next");
    d.ack().await.expect("ack");
    assert_eq!(ready(&b, &retry).await, 0);
    assert_eq!(ready(&b, &q.work()).await, 0);
}

#[tokio::test]
async fn an_unroutable_publish_is_an_error_naming_the_queue() {
    let (_hub, b, q) = setup("unroutable").await;
    let missing = format!("{}-missing", q.work());
    let err = b
        .publish(&missing, vec![msg("lost"), msg("also")], 4)
        .await
        .expect_err("no such queue");
    assert!(
        matches!(err, BrokerError::NotConfirmed { ref message_id, .. } if message_id == "lost"),
        "{err:?}"
    );
    assert!(err.to_string().contains(&missing), "{err}");
    assert!(err.to_string().contains("unroutable"), "{err}");
    assert_eq!(b.ready_count(&missing).await.expect("count"), None);
    assert!(b.get(&missing).await.expect("get").is_none());
    assert_eq!(b.purge(&missing).await.expect("purge"), 0);
    let err = b.consume(&missing, 1).await.err().expect("consume fails");
    assert!(matches!(err, BrokerError::Op { .. }), "{err:?}");
    assert!(err.to_string().contains(&missing), "{err}");
    // Nothing of it landed anywhere.
    for name in q.all() {
        assert_eq!(ready(&b, &name).await, 0, "{name}");
    }
}

#[tokio::test]
async fn what_get_takes_returns_when_dropped_or_the_handle_closes() {
    let (hub, b, q) = setup("get").await;
    b.publish(&q.dead(), vec![msg("d1"), msg("d2")], 4)
        .await
        .expect("publish");

    // Dropped unsettled: back at the front, counted.
    let d = b.get(&q.dead()).await.expect("get").expect("d1");
    assert_eq!(ready(&b, &q.dead()).await, 1);
    let acker = d.acker();
    drop(d);
    assert_eq!(
        ready(&b, &q.dead()).await,
        1,
        "an acker clone still holds it"
    );
    drop(acker);
    assert_eq!(ready(&b, &q.dead()).await, 2);
    let d = b.get(&q.dead()).await.expect("get").expect("d1 again");
    assert_eq!((d.message_id.as_str(), d.delivery_count()), ("d1", 1));
    d.ack().await.expect("ack");

    // Taken by a handle that closes: returned, and its acker can no longer
    // settle it.
    let dlq = hub.handle();
    let d = dlq.get(&q.dead()).await.expect("get").expect("d2");
    assert_eq!(ready(&b, &q.dead()).await, 0);
    dlq.close("listed").await;
    assert_eq!(ready(&b, &q.dead()).await, 1);
    assert!(matches!(d.ack().await, Err(BrokerError::Closed(_))));
    drop(d);
    assert_eq!(ready(&b, &q.dead()).await, 1, "not returned twice");
    let d = b.get(&q.dead()).await.expect("get").expect("d2");
    assert_eq!((d.message_id.as_str(), d.delivery_count()), ("d2", 1));
    d.ack().await.expect("ack");
    assert!(b.get(&q.dead()).await.expect("get").is_none());
}

#[tokio::test]
async fn close_returns_unsettled_deliveries_and_ends_subscriptions() {
    let (hub, b, q) = setup("close").await;
    b.publish(&q.work(), vec![msg("1"), msg("2"), msg("3")], 4)
        .await
        .expect("publish");
    let worker = hub.handle();
    let mut sub = worker.consume(&q.work(), 8).await.expect("consume");
    let one = next(&mut sub).await;
    let two = next(&mut sub).await;
    let three = next(&mut sub).await;
    three.ack().await.expect("ack");
    // Another subscription of the same handle waits on an empty queue.
    let mut idle = worker.consume(&q.infra(), 1).await.expect("consume");
    let waiting = tokio::spawn(async move { idle.next().await.is_none() });

    worker.close("shutdown").await;
    assert!(!worker.is_open());
    assert!(b.is_open(), "other handles are unaffected");
    assert!(
        timeout(SOON, waiting).await.expect("woken").expect("task"),
        "a waiting next() ends with None"
    );
    assert!(sub.next().await.is_none(), "subscriptions end");
    // Both unsettled deliveries are back, in order, counted; the acked one is gone.
    assert_eq!(ready(&b, &q.work()).await, 2);
    for (d, id) in [(&one, "1"), (&two, "2")] {
        assert!(matches!(d.ack().await, Err(BrokerError::Closed(_))));
        let again = b.get(&q.work()).await.expect("get").expect("returned");
        assert_eq!((again.message_id.as_str(), again.delivery_count()), (id, 1));
        again.ack().await.expect("ack");
    }
    // Every later call on the closed handle fails.
    assert!(matches!(
        worker.publish(&q.work(), vec![msg("4")], 1).await,
        Err(BrokerError::Closed(_))
    ));
    assert!(matches!(
        worker.declare(&q).await,
        Err(BrokerError::Closed(_))
    ));
    assert!(matches!(
        worker.consume(&q.work(), 1).await,
        Err(BrokerError::Closed(_))
    ));
    assert!(matches!(
        worker.get(&q.work()).await,
        Err(BrokerError::Closed(_))
    ));
    assert!(matches!(
        worker.purge(&q.work()).await,
        Err(BrokerError::Closed(_))
    ));
    assert!(matches!(
        worker.ready_count(&q.work()).await,
        Err(BrokerError::Closed(_))
    ));
    worker.close("again").await;
    assert_eq!(ready(&b, &q.work()).await, 0);
}

#[tokio::test]
async fn cancel_ends_a_subscription_and_leaves_messages_ready() {
    let (_hub, b, q) = setup("cancel").await;
    let mut sub = b.consume(&q.work(), 1).await.expect("consume");
    sub.cancel().await;
    b.publish(&q.work(), vec![msg("m")], 1)
        .await
        .expect("publish");
    assert!(sub.next().await.is_none());
    assert_eq!(ready(&b, &q.work()).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_share_queues_and_competing_consumers_get_each_message_once() {
    let hub = LocalQueues::new();
    let coordinator = hub.handle();
    let q = PoolQueues::new("share");
    coordinator.declare(&q).await.expect("declare");
    let workers: Vec<Arc<dyn Broker>> = (0..2).map(|_| hub.handle()).collect();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        let mut sub = w.consume(&q.work(), 3).await.expect("consume");
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let mut got = 0usize;
            while let Some(d) = sub.next().await {
                let d = d.expect("delivery");
                assert_eq!(d.delivery_count(), 0, "never redelivered");
                d.ack().await.expect("ack");
                got += 1;
                let _ = tx.send((i, d.message_id.clone()));
            }
            got
        }));
    }
    drop(tx);
    let ids: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    let n = coordinator
        .publish(&q.work(), ids.iter().map(|id| msg(id)).collect(), 16)
        .await
        .expect("publish");
    assert_eq!(n, 200);
    let mut seen = BTreeSet::new();
    for _ in 0..200 {
        let (_, id) = timeout(SOON, rx.recv())
            .await
            .expect("in time")
            .expect("workers running");
        assert!(seen.insert(id.clone()), "{id} delivered twice");
    }
    assert_eq!(seen, ids.iter().cloned().collect::<BTreeSet<_>>());
    assert_eq!(ready(&coordinator, &q.work()).await, 0);
    for w in &workers {
        w.close("done").await;
    }
    let mut total = 0;
    for t in tasks {
        total += timeout(SOON, t)
            .await
            .expect("ends on close")
            .expect("task");
    }
    assert_eq!(total, 200);
    assert!(rx.recv().await.is_none(), "nothing more");
    assert!(coordinator.is_open());
}

#[tokio::test]
async fn consumers_are_counted_across_handles_until_cancelled_dropped_or_closed() {
    let (hub, b, q) = setup("consumers").await;
    assert_eq!(b.consumer_count(&q.work()).await.expect("count"), Some(0));
    assert_eq!(
        b.consumer_count("bf.nowhere.work").await.expect("count"),
        None
    );
    let (w1, w2) = (hub.handle(), hub.handle());
    let mut s1 = w1.consume(&q.work(), 1).await.expect("consume");
    let s2 = w1.consume(&q.work(), 1).await.expect("consume");
    let _s3 = w2.consume(&q.work(), 1).await.expect("consume");
    let _other = w2.consume(&q.dead(), 1).await.expect("consume");
    assert_eq!(b.consumer_count(&q.work()).await.expect("count"), Some(3));
    assert_eq!(b.consumer_count(&q.dead()).await.expect("count"), Some(1));
    s1.cancel().await;
    assert_eq!(b.consumer_count(&q.work()).await.expect("count"), Some(2));
    drop(s2);
    assert_eq!(b.consumer_count(&q.work()).await.expect("count"), Some(1));
    w2.close("bye").await;
    assert_eq!(b.consumer_count(&q.work()).await.expect("count"), Some(0));
    assert_eq!(b.consumer_count(&q.dead()).await.expect("count"), Some(0));
    assert!(matches!(
        w2.consumer_count(&q.work()).await,
        Err(BrokerError::Closed(_))
    ));
}

#[tokio::test]
async fn delete_removes_a_queue_and_ends_its_subscriptions() {
    let (hub, b, q) = setup("delete").await;
    b.publish(&q.work(), vec![msg("taken"), msg("ready")], 2)
        .await
        .expect("publish");
    let worker = hub.handle();
    let mut sub = worker.consume(&q.work(), 1).await.expect("consume");
    let taken = next(&mut sub).await;
    // Prefetch 1 is used up: this next() waits until the delete ends it.
    let waiting = tokio::spawn(async move { sub.next().await.is_none() });
    b.delete(&q.work()).await.expect("delete");
    assert!(timeout(SOON, waiting).await.expect("woken").expect("task"));
    assert_eq!(b.ready_count(&q.work()).await.expect("count"), None);
    assert_eq!(b.consumer_count(&q.work()).await.expect("count"), None);
    let err = b
        .publish(&q.work(), vec![msg("late")], 1)
        .await
        .expect_err("unroutable");
    assert!(err.to_string().contains(&q.work()), "{err}");
    // A delivery from the deleted queue has nowhere to return to.
    taken.requeue().await.expect("requeue");
    b.delete(&q.work()).await.expect("deleting again is fine");
    // Declared again: empty, and other queues of the pool are untouched.
    b.declare(&q).await.expect("declare");
    assert_eq!(ready(&b, &q.work()).await, 0);
    assert_eq!(ready(&b, &q.dead()).await, 0);
}

#[tokio::test]
async fn every_listener_of_a_pool_hears_a_job_announced_and_no_other_pools() {
    let (hub, coordinator, pool) = setup("notices").await;
    let elsewhere = PoolQueues::new("notices-other");
    let (w1, w2, other) = (hub.handle(), hub.handle(), hub.handle());
    let mut heard = crate::announcements_reach_their_pool_only(
        &*coordinator,
        [&*w1, &*w2],
        &*other,
        &pool,
        &elsewhere,
    )
    .await;
    assert!(
        timeout(BRIEFLY, heard[0].next()).await.is_err(),
        "nothing more was announced to the pool"
    );
    // A closed handle announces nothing.
    coordinator.close("bye").await;
    assert!(coordinator
        .announce(&pool, &batchfleet_shared::broker::Notice::new("late", 2))
        .await
        .is_err());
}
