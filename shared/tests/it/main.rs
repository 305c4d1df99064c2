//! Broker and store behaviour against the real RabbitMQ and Redis.

mod broker;
mod local_broker;
mod store;

use std::time::Duration;

pub fn amqp() -> batchfleet_shared::endpoint::Endpoint {
    batchfleet_testkit::services::ensure_local().expect("RabbitMQ and Redis available");
    batchfleet_shared::endpoint::Endpoint::amqp(batchfleet_shared::secret::SecretUrl::new(
        "amqp://127.0.0.1:5672/%2f",
    ))
}

pub async fn store(stem: &str) -> batchfleet_shared::store::Store {
    batchfleet_testkit::services::ensure_local().expect("RabbitMQ and Redis available");
    let url = batchfleet_shared::endpoint::Endpoint::redis(
        batchfleet_shared::secret::SecretUrl::new("redis://127.0.0.1:6379/"),
    );
    batchfleet_shared::store::Store::connect(
        &url,
        &batchfleet_testkit::services::unique(stem),
        Duration::from_secs(5),
    )
    .await
    .expect("redis")
}
