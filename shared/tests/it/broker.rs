//! The RabbitMQ implementation of the broker interface against the real
//! broker (the in-process one: `local_broker.rs`).

use batchfleet_shared::broker::{connect, BrokerError, Headers, Outgoing, PoolQueues};
use std::time::Duration;

fn msg(id: &str) -> Outgoing {
    Outgoing {
        message_id: id.into(),
        kind: "test",
        body: id.as_bytes().to_vec(),
        headers: Headers::of([("x-test", id.to_owned())], [("x-n", 7)]),
        expiration_ms: None,
    }
}

#[tokio::test]
async fn confirmed_publish_counts_only_what_the_broker_stored() {
    let broker = connect(&crate::amqp(), "shared-tests", Duration::from_secs(10))
        .await
        .expect("connect");
    let queues = PoolQueues::new(batchfleet_testkit::services::unique("pub"));
    broker.declare(&queues).await.expect("declare");
    // Declaring again with the same arguments is fine (both binaries do it).
    broker.declare(&queues).await.expect("re-declare");

    let n = broker
        .publish(
            &queues.work(),
            (0..25).map(|i| msg(&format!("m{i}"))).collect(),
            4,
        )
        .await
        .expect("publish");
    assert_eq!(n, 25);
    assert_eq!(
        broker.ready_count(&queues.work()).await.expect("count"),
        Some(25)
    );
    assert_eq!(
        broker
            .ready_count(&format!("{}-missing", queues.work()))
            .await
            .expect("count of a missing queue"),
        None
    );
    // The missing queue's 404 closed the inspection channel: the next count
    // (and the next) opens another and answers, on the same handle.
    for _ in 0..2 {
        assert_eq!(
            broker.ready_count(&queues.work()).await.expect("count"),
            Some(25)
        );
    }
    assert_eq!(
        broker
            .consumer_count(&queues.work())
            .await
            .expect("consumers"),
        Some(0)
    );

    // Taken in order, headers intact; one dropped unsettled comes back.
    let first = broker.get(&queues.work()).await.expect("get").expect("m0");
    assert_eq!(first.body, b"m0");
    assert_eq!(first.message_id, "m0");
    assert_eq!(first.headers.str("x-test"), Some("m0"));
    assert_eq!(first.headers.int("x-n"), Some(7));
    first.ack().await.expect("ack");
    let second = broker.get(&queues.work()).await.expect("get").expect("m1");
    drop(second);
    let mut sub = broker.consume(&queues.work(), 4).await.expect("consume");
    let again = sub.next().await.expect("a delivery").expect("ok");
    assert_eq!(again.body, b"m1", "the dropped delivery came back first");
    assert_eq!(again.delivery_count(), 1, "its return was counted");
    again.ack().await.expect("ack");
    sub.cancel().await;

    // A mandatory publish to a queue that does not exist comes back: an error, not a success.
    let err = broker
        .publish(&format!("{}-missing", queues.work()), vec![msg("lost")], 4)
        .await
        .expect_err("unroutable publish must fail");
    assert!(
        matches!(err, BrokerError::NotConfirmed { ref message_id, .. } if message_id == "lost"),
        "{err}"
    );
    assert!(err.to_string().contains("returned by the broker"), "{err}");

    // The subscription's prefetched deliveries return when the handle closes.
    broker.close("reopen").await;
    let broker = connect(&crate::amqp(), "shared-tests", Duration::from_secs(10))
        .await
        .expect("connect");
    assert_eq!(broker.purge(&queues.work()).await.expect("purge"), 23);
    broker.delete_pool(&queues).await.expect("delete the pool");
    broker.close("bye").await;
}

/// A subscription that cannot start closes only its own channel: the
/// subscriptions already running on the same handle carry on, and their
/// deliveries settle. (In a fleet: a job's queue deleted between a look at
/// it and the consume answers `NOT_FOUND`; here, a queue exclusive to
/// another connection answers `RESOURCE_LOCKED`, which no look beforehand
/// can foresee. Both close the channel the consume was sent on.)
#[tokio::test]
async fn a_consume_that_fails_ends_no_other_subscription() {
    use lapin::options::QueueDeclareOptions;
    let broker = connect(&crate::amqp(), "shared-tests", Duration::from_secs(10))
        .await
        .expect("connect");
    let queues = PoolQueues::new(batchfleet_testkit::services::unique("apart"));
    broker.declare(&queues).await.expect("declare");
    broker
        .publish(
            &queues.work(),
            (0..3).map(|i| msg(&format!("m{i}"))).collect(),
            4,
        )
        .await
        .expect("publish");
    let mut sub = broker.consume(&queues.work(), 1).await.expect("consume");
    let first = sub.next().await.expect("a delivery").expect("ok");

    let owner = lapin::Connection::connect(
        "amqp://127.0.0.1:5672/%2f",
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("a second connection");
    let locked = format!("{}.locked", queues.work());
    owner
        .create_channel()
        .await
        .expect("channel")
        .queue_declare(
            locked.as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("an exclusive queue");
    let err = broker
        .consume(&locked, 1)
        .await
        .err()
        .expect("a queue exclusive to another connection cannot be consumed");
    assert!(err.to_string().contains("basic.consume"), "{err}");

    // The first subscription's channel is still open: its delivery settles
    // and the next ones come.
    first.ack().await.expect("the first delivery settles");
    for want in [b"m1", b"m2"] {
        let d = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .expect("the subscription still delivers")
            .expect("a delivery")
            .expect("ok");
        assert_eq!(d.body, want);
        d.ack().await.expect("ack");
    }
    assert!(broker.is_open());
    sub.cancel().await;
    drop(sub);
    let _ = owner.close(200, "bye".into()).await;
    broker.delete_pool(&queues).await.expect("delete the pool");
    broker.close("bye").await;
}

/// Every listener of a pool hears its announcements, on connections of
/// their own, and no other pool's.
#[tokio::test]
async fn every_worker_of_a_pool_hears_a_job_announced() {
    let amqp = crate::amqp();
    let open = || connect(&amqp, "shared-tests", Duration::from_secs(10));
    let (coordinator, w1, w2, other) = (open(), open(), open(), open());
    let (coordinator, w1, w2, other) = (
        coordinator.await.expect("connect"),
        w1.await.expect("connect"),
        w2.await.expect("connect"),
        other.await.expect("connect"),
    );
    let pool = PoolQueues::new(batchfleet_testkit::services::unique("notices"));
    let elsewhere = PoolQueues::new(batchfleet_testkit::services::unique("notices-other"));
    crate::announcements_reach_their_pool_only(
        &*coordinator,
        [&*w1, &*w2],
        &*other,
        &pool,
        &elsewhere,
    )
    .await;
    for b in [w1, w2, other] {
        b.close("bye").await;
    }
    for q in [&pool, &elsewhere] {
        coordinator.delete_pool(q).await.expect("delete the pool");
    }
    coordinator.close("bye").await;
}

#[tokio::test]
async fn unreachable_broker_is_a_clear_error() {
    let url = batchfleet_shared::endpoint::Endpoint::amqp(
        batchfleet_shared::secret::SecretUrl::new("amqp://user:pw-xyz@127.0.0.1:1/%2f"),
    );
    let err = connect(&url, "shared-tests", Duration::from_secs(5))
        .await
        .expect_err("nothing listens on port 1");
    let text = err.to_string();
    assert!(
        text.contains("cannot connect to RabbitMQ at amqp://user:***@127.0.0.1:1/%2f"),
        "{text}"
    );
    assert!(text.contains("--local"), "{text}");
    assert!(!text.contains("pw-xyz"), "{text}");
}

#[tokio::test]
async fn a_node_list_that_nobody_answers_names_every_node_and_no_password() {
    // The second URL's password used to reach the error in clear.
    let url =
        batchfleet_shared::endpoint::Endpoint::amqp(batchfleet_shared::secret::SecretUrl::new(
            "amqp://one:pw-first@127.0.0.1:1/%2f, amqp://two:pw-second@127.0.0.1:2/%2f",
        ));
    let err = connect(&url, "shared-tests", Duration::from_secs(5))
        .await
        .expect_err("nothing listens on ports 1 and 2");
    let text = format!("{err} {err:?}");
    assert!(text.contains("none of its 2 nodes answered"), "{text}");
    assert!(text.contains("amqp://one:***@127.0.0.1:1/%2f"), "{text}");
    assert!(text.contains("amqp://two:***@127.0.0.1:2/%2f"), "{text}");
    assert!(
        !text.contains("pw-first") && !text.contains("pw-second"),
        "{text}"
    );
}

#[tokio::test]
async fn a_node_list_connects_to_the_node_that_answers() {
    crate::amqp();
    // The first node is down; the second is the running broker.
    let url =
        batchfleet_shared::endpoint::Endpoint::amqp(batchfleet_shared::secret::SecretUrl::new(
            "amqp://guest:guest@127.0.0.1:1/%2f,amqp://guest:guest@127.0.0.1:5672/%2f",
        ));
    for _ in 0..2 {
        // Twice: the second connection starts after the node that answered,
        // wraps round to the dead one and must still reach the live one.
        let broker = connect(&url, "shared-tests", Duration::from_secs(5))
            .await
            .expect("the second node answers");
        let shown = broker.describe();
        assert!(shown.contains("127.0.0.1:5672"), "{shown}");
        assert!(!shown.contains(":guest@"), "{shown}");
        broker.close("bye").await;
    }
}
