//! Broker and store behaviour against the real RabbitMQ and Redis.

mod broker;
mod local_broker;
mod model_archives;
mod retire;
mod store;

use std::time::Duration;

pub fn amqp() -> batchfleet_shared::endpoint::Endpoint {
    batchfleet_testkit::services::ensure_local().expect("RabbitMQ and Redis available");
    batchfleet_shared::endpoint::Endpoint::amqp(batchfleet_shared::secret::SecretUrl::new(
        "amqp://127.0.0.1:5672/%2f",
    ))
}

pub async fn store(stem: &str) -> batchfleet_shared::store::Store {
    store_at(&batchfleet_testkit::services::unique(stem)).await
}

/// The local Redis as a store under key prefix `prefix`.
pub async fn store_at(prefix: &str) -> batchfleet_shared::store::Store {
    batchfleet_testkit::services::ensure_local().expect("RabbitMQ and Redis available");
    let url = batchfleet_shared::endpoint::Endpoint::redis(
        batchfleet_shared::secret::SecretUrl::new("redis://127.0.0.1:6379/"),
    );
    batchfleet_shared::store::Store::connect(&url, prefix, Duration::from_secs(5))
        .await
        .expect("redis")
}

/// What every broker keeps of announcements: with both pools declared and
/// nobody listening, an announcement is no error; once `listeners` listen
/// to `pool` and `other` to `elsewhere`, each hears only its own pool's
/// job (`job-1`, `job-2`) with the weight it was announced with, the first
/// it hears being one announced after it listened. The listeners' notices,
/// for checks of a broker's own.
pub async fn announcements_reach_their_pool_only(
    coordinator: &dyn batchfleet_shared::broker::Broker,
    listeners: [&dyn batchfleet_shared::broker::Broker; 2],
    other: &dyn batchfleet_shared::broker::Broker,
    pool: &batchfleet_shared::broker::PoolQueues,
    elsewhere: &batchfleet_shared::broker::PoolQueues,
) -> Vec<Box<dyn batchfleet_shared::broker::Notices>> {
    for q in [pool, elsewhere] {
        coordinator.declare(q).await.expect("declare");
    }
    use batchfleet_shared::broker::Notice;
    coordinator
        .announce(pool, &Notice::new("early", 2))
        .await
        .expect("nobody listening is fine");
    let mut heard = Vec::new();
    for w in listeners {
        heard.push(w.notices(pool).await.expect("listen"));
    }
    let mut other_heard = other.notices(elsewhere).await.expect("listen");
    coordinator
        .announce(pool, &Notice::new("job-1", 4))
        .await
        .expect("announce");
    coordinator
        .announce(elsewhere, &Notice::new("job-2", 1))
        .await
        .expect("announce");
    let soon = Duration::from_secs(10);
    for n in &mut heard {
        let job = tokio::time::timeout(soon, n.next())
            .await
            .expect("heard in time")
            .expect("still listening")
            .expect("no error");
        assert_eq!(
            job,
            Notice::new("job-1", 4),
            "the first it hears is after it listened"
        );
    }
    // Announced after the first pool's, on the same channel: were the other
    // pool's listener to hear the first, it would hear it first.
    let job = tokio::time::timeout(soon, other_heard.next())
        .await
        .expect("heard in time")
        .expect("still listening")
        .expect("no error");
    assert_eq!(job, Notice::new("job-2", 1));
    heard
}
