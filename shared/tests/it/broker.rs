use batchfleet_shared::broker::{
    connect, declare_topology, ready_count, BrokerError, ConfirmedPublisher, Outgoing, PoolQueues,
};
use lapin::options::QueueDeleteOptions;
use lapin::types::FieldTable;
use std::time::Duration;

fn msg(id: &str) -> Outgoing {
    Outgoing {
        message_id: id.into(),
        kind: "test",
        body: id.as_bytes().to_vec(),
        headers: FieldTable::default(),
        expiration_ms: None,
    }
}

#[tokio::test]
async fn confirmed_publish_counts_only_what_the_broker_stored() {
    let conn = connect(&crate::amqp(), "shared-tests", Duration::from_secs(10))
        .await
        .expect("connect");
    let queues = PoolQueues::new(batchfleet_loadtest::services::unique("pub"));
    let publisher = ConfirmedPublisher::open(&conn).await.expect("publisher");
    declare_topology(publisher.channel(), &queues)
        .await
        .expect("declare");
    // Declaring again with the same arguments is fine (both binaries do it).
    declare_topology(publisher.channel(), &queues)
        .await
        .expect("re-declare");

    let mut seen = Vec::new();
    let n = publisher
        .publish_all(
            &queues.work(),
            (0..25).map(|i| msg(&format!("m{i}"))),
            4,
            |m| seen.push(m.message_id.clone()),
        )
        .await
        .expect("publish");
    assert_eq!(n, 25);
    assert_eq!(
        seen,
        (0..25).map(|i| format!("m{i}")).collect::<Vec<_>>(),
        "confirmed in publish order"
    );
    assert_eq!(
        ready_count(publisher.channel(), &queues.work())
            .await
            .expect("count"),
        25
    );

    // A mandatory publish to a queue that does not exist comes back: an error, not a success.
    let err = publisher
        .publish_all(
            &format!("{}-missing", queues.work()),
            [msg("lost")],
            4,
            |_| {},
        )
        .await
        .expect_err("unroutable publish must fail");
    assert!(
        matches!(err, BrokerError::NotConfirmed { ref message_id, .. } if message_id == "lost"),
        "{err}"
    );
    assert!(err.to_string().contains("returned by the broker"), "{err}");

    for q in queues.all() {
        let _ = publisher
            .channel()
            .queue_delete(q.into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "bye".into()).await;
}

#[tokio::test]
async fn unreachable_broker_is_a_clear_error() {
    let url = batchfleet_shared::secret::SecretUrl::new("amqp://user:pw-xyz@127.0.0.1:1/%2f");
    let err = connect(&url, "shared-tests", Duration::from_secs(5))
        .await
        .expect_err("nothing listens on port 1");
    let text = err.to_string();
    assert!(
        text.contains("cannot connect to RabbitMQ at amqp://user:***@127.0.0.1:1/%2f"),
        "{text}"
    );
    assert!(!text.contains("pw-xyz"), "{text}");
}
