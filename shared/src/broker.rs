//! RabbitMQ: connecting, the queue topology of a pool, and confirmed publishing.
//!
//! # Topology (per pool `P`)
//! - `bf.P.work`: durable quorum queue the workers consume. Quorum queues are
//!   replicated and fsync messages before confirming, so a broker restart loses
//!   nothing; `x-delivery-limit` bounds how often one message can be redelivered
//!   (an item that crashes its worker cannot loop forever) and dead-letters it.
//! - `bf.dlx`: direct exchange receiving dead letters from every pool.
//! - `bf.P.dead`: durable quorum queue bound to `bf.dlx` with key `P.dead`;
//!   holds items that failed for good until they are listed and replayed.
//! - `bf.P.infra`: durable quorum queue also bound to `bf.dlx` with key
//!   `P.dead`. Workers publish their own dead letters straight to `bf.P.dead`
//!   (default exchange), so only what the *broker* dead-letters (an item past
//!   `x-delivery-limit`: its workers kept dying on it) reaches this queue too;
//!   workers consume it and record those items failed (class `infra`), so the
//!   job settles instead of waiting for them forever.
//! - `bf.P.retry.<tier>` ([`RETRY_TIERS_S`]): delayed retry without blocking
//!   a worker. A failed item is re-published to the smallest tier that fits
//!   its delay with a per-message expiration; when it expires RabbitMQ
//!   dead-letters it (default exchange) straight back into `bf.P.work`.
//!   Messages expire only at the head of a queue, so one tier per order of
//!   magnitude bounds how long a short delay can wait behind a longer one.
//!
//! Declarations are idempotent but their arguments must match exactly on every
//! declare, so they exist only here and both binaries call [`declare_topology`].

use crate::secret::{scrub, SecretUrl};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use std::time::Duration;

/// Exchange that receives dead-lettered messages of all pools.
pub const DEAD_LETTER_EXCHANGE: &str = "bf.dlx";

/// Redeliveries RabbitMQ allows before dead-lettering a message on its own.
/// A backstop for items that kill their worker (abort, OOM kill) before it can
/// classify the failure; ordinary failures are classified by the worker first.
pub const DELIVERY_LIMIT: i64 = 20;

/// Upper bounds (seconds) of the retry tiers.
pub const RETRY_TIERS_S: [u64; 6] = [1, 5, 30, 120, 600, 3600];

/// Errors talking to RabbitMQ. Messages never contain credentials.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The broker could not be reached or refused the login.
    #[error("cannot connect to RabbitMQ at {url}: {reason}. {hint}")]
    Connect {
        /// Redacted URL.
        url: String,
        /// What the client library said, credentials scrubbed.
        reason: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// The broker refused the credentials; retrying will not help.
    #[error("RabbitMQ at {url} refused the login: {reason}. Check the user name and password in the AMQP URL (BATCHFLEET_AMQP_URL)")]
    Auth {
        /// Redacted URL.
        url: String,
        /// What the client library said, credentials scrubbed.
        reason: String,
    },
    /// The broker did not answer in time.
    #[error("RabbitMQ at {url} did not answer within {secs}s; check the host and port, or that the broker is not overloaded")]
    Timeout {
        /// Redacted URL.
        url: String,
        /// Seconds waited.
        secs: u64,
    },
    /// A protocol operation failed.
    #[error("RabbitMQ {op} failed: {source}")]
    Op {
        /// The operation, e.g. `queue.declare bf.default.work`.
        op: String,
        /// The client library error.
        #[source]
        source: lapin::Error,
    },
    /// The broker refused a publish (nack) or could not route it (return).
    #[error("RabbitMQ did not accept message {message_id}: {reason}")]
    NotConfirmed {
        /// Message id of the refused publish.
        message_id: String,
        /// nack or unroutable return.
        reason: String,
    },
}

impl BrokerError {
    /// Whether retrying cannot help (wrong credentials).
    pub fn is_permanent(&self) -> bool {
        matches!(self, BrokerError::Auth { .. })
    }

    /// Wraps a lapin error with the operation that failed.
    pub fn op(op: impl Into<String>) -> impl FnOnce(lapin::Error) -> BrokerError {
        let op = op.into();
        move |source| BrokerError::Op { op, source }
    }
}

/// Queue names of one pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolQueues {
    /// Pool name.
    pub pool: String,
}

impl PoolQueues {
    /// Names for `pool`.
    pub fn new(pool: impl Into<String>) -> Self {
        Self { pool: pool.into() }
    }
    /// The work queue workers consume.
    pub fn work(&self) -> String {
        format!("bf.{}.work", self.pool)
    }
    /// The dead-letter queue.
    pub fn dead(&self) -> String {
        format!("bf.{}.dead", self.pool)
    }
    /// Copies of what the broker itself dead-lettered (delivery limit), for
    /// workers to record as failed items.
    pub fn infra(&self) -> String {
        format!("bf.{}.infra", self.pool)
    }
    /// Every queue of the pool: work, dead, infra and the retry tiers.
    pub fn all(&self) -> Vec<String> {
        let mut names = vec![self.work(), self.dead(), self.infra()];
        names.extend(RETRY_TIERS_S.iter().map(|t| self.retry(*t)));
        names
    }
    /// The retry queue whose tier holds a delay of `delay_ms`.
    pub fn retry_for(&self, delay_ms: u64) -> String {
        let tier = RETRY_TIERS_S
            .iter()
            .copied()
            .find(|t| t * 1000 >= delay_ms)
            .unwrap_or(RETRY_TIERS_S[RETRY_TIERS_S.len() - 1]);
        self.retry(tier)
    }
    /// The retry queue of one tier.
    pub fn retry(&self, tier_s: u64) -> String {
        format!("bf.{}.retry.{tier_s}s", self.pool)
    }
    /// Routing key under which dead letters of this pool reach [`PoolQueues::dead`].
    pub fn dead_routing_key(&self) -> String {
        format!("{}.dead", self.pool)
    }
}

/// Opens a connection, bounded by `timeout`, with errors that say what to do.
pub async fn connect(
    url: &SecretUrl,
    connection_name: &str,
    timeout: Duration,
) -> Result<Connection, BrokerError> {
    let props =
        ConnectionProperties::default().with_connection_name(LongString::from(connection_name));
    let attempt = Connection::connect(url.expose(), props);
    match tokio::time::timeout(timeout, attempt).await {
        Err(_) => Err(BrokerError::Timeout {
            url: url.redacted(),
            secs: timeout.as_secs(),
        }),
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => {
            let reason = scrub(&e.to_string(), url);
            let lower = reason.to_ascii_lowercase();
            if lower.contains("access_refused") || lower.contains("auth") || lower.contains("login")
            {
                return Err(BrokerError::Auth {
                    url: url.redacted(),
                    reason,
                });
            }
            let hint = if lower.contains("refused")
                || lower.contains("resolve")
                || lower.contains("lookup")
            {
                "Is RabbitMQ running? Start it (e.g. `rabbitmq-server -detached`) or fix BATCHFLEET_AMQP_URL."
            } else {
                "Check BATCHFLEET_AMQP_URL and that RabbitMQ is healthy."
            };
            Err(BrokerError::Connect {
                url: url.redacted(),
                reason,
                hint,
            })
        }
    }
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Arguments of a work or dead queue. Quorum for durability and replication.
fn quorum_args(dead_letter_to: Option<&PoolQueues>) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), long("quorum"));
    if let Some(pool) = dead_letter_to {
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(DELIVERY_LIMIT),
        );
        args.insert("x-dead-letter-exchange".into(), long(DEAD_LETTER_EXCHANGE));
        args.insert(
            "x-dead-letter-routing-key".into(),
            long(&pool.dead_routing_key()),
        );
        // at-least-once dead-lettering: the message leaves the work queue only once
        // the dead queue confirmed it, so a dead letter cannot be lost in transit.
        args.insert("x-dead-letter-strategy".into(), long("at-least-once"));
        // required by at-least-once: publishers get a nack instead of silent drops
        // when a length limit is ever configured by policy.
        args.insert("x-overflow".into(), long("reject-publish"));
    }
    args
}

/// Arguments of a retry tier: expired messages go back to the work queue.
fn retry_args(pool: &PoolQueues) -> FieldTable {
    let mut args = quorum_args(None);
    // The default exchange ("") routes by queue name: expiry = re-delivery to work.
    args.insert("x-dead-letter-exchange".into(), long(""));
    args.insert("x-dead-letter-routing-key".into(), long(&pool.work()));
    args.insert("x-dead-letter-strategy".into(), long("at-least-once"));
    args.insert("x-overflow".into(), long("reject-publish"));
    args
}

/// Declares the pool's work queue, retry tiers, dead-letter exchange and dead queue.
pub async fn declare_topology(channel: &Channel, queues: &PoolQueues) -> Result<(), BrokerError> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .exchange_declare(
            DEAD_LETTER_EXCHANGE.into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(BrokerError::op(format!(
            "exchange.declare {DEAD_LETTER_EXCHANGE}"
        )))?;
    channel
        .queue_declare(queues.dead().into(), durable, quorum_args(None))
        .await
        .map_err(BrokerError::op(format!("queue.declare {}", queues.dead())))?;
    channel
        .queue_bind(
            queues.dead().into(),
            DEAD_LETTER_EXCHANGE.into(),
            queues.dead_routing_key().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(BrokerError::op(format!("queue.bind {}", queues.dead())))?;
    channel
        .queue_declare(queues.infra().into(), durable, quorum_args(None))
        .await
        .map_err(BrokerError::op(format!("queue.declare {}", queues.infra())))?;
    // Same routing key as the dead queue: a direct exchange gives each bound
    // queue its copy of a broker dead letter.
    channel
        .queue_bind(
            queues.infra().into(),
            DEAD_LETTER_EXCHANGE.into(),
            queues.dead_routing_key().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(BrokerError::op(format!("queue.bind {}", queues.infra())))?;
    channel
        .queue_declare(queues.work().into(), durable, quorum_args(Some(queues)))
        .await
        .map_err(BrokerError::op(format!("queue.declare {}", queues.work())))?;
    for tier in RETRY_TIERS_S {
        let name = queues.retry(tier);
        channel
            .queue_declare(name.as_str().into(), durable, retry_args(queues))
            .await
            .map_err(BrokerError::op(format!("queue.declare {name}")))?;
    }
    Ok(())
}

/// Number of messages ready in a queue (not counting unacknowledged ones).
pub async fn ready_count(channel: &Channel, queue: &str) -> Result<u32, BrokerError> {
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(BrokerError::op(format!("queue.declare (passive) {queue}")))?;
    Ok(q.message_count())
}

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Unique id (`<job>/<seq>`), used in errors and for deduplication by readers.
    pub message_id: String,
    /// AMQP `type` property.
    pub kind: &'static str,
    /// Encoded body.
    pub body: Vec<u8>,
    /// Extra headers (e.g. the attempt).
    pub headers: FieldTable,
    /// Per-message expiration (retry delay), if any.
    pub expiration_ms: Option<u64>,
}

impl Outgoing {
    /// A work item for the work queue, at delivery attempt `attempt`, signed
    /// with `key` when one is configured.
    pub fn work_item(
        item: &crate::message::WorkItem,
        attempt: u32,
        key: Option<&crate::signing::SigningKey>,
    ) -> Self {
        let body = crate::message::Envelope::V1(item.clone()).encode();
        let mut headers = FieldTable::default();
        if let Some(key) = key {
            headers.insert(
                crate::signing::SIGNATURE_HEADER.into(),
                AMQPValue::LongString(LongString::from(key.sign(&body))),
            );
        }
        headers.insert(
            crate::message::ATTEMPT_HEADER.into(),
            AMQPValue::LongInt(attempt as i32),
        );
        headers.insert(
            crate::message::PUBLISHED_HEADER.into(),
            AMQPValue::LongLongInt(crate::now_ms() as i64),
        );
        Self {
            message_id: format!("{}/{}", item.job_id, item.seq),
            kind: crate::message::MESSAGE_TYPE_V1,
            body,
            headers,
            expiration_ms: None,
        }
    }
}

/// Publishes persistent, mandatory messages on a channel in confirm mode.
///
/// A message counts as sent only when the broker acked it *and* did not return
/// it as unroutable; a nack or a return is an error naming the message.
#[derive(Debug)]
pub struct ConfirmedPublisher {
    channel: Channel,
}

impl ConfirmedPublisher {
    /// Opens a channel on `conn` and enables publisher confirms on it.
    pub async fn open(conn: &Connection) -> Result<Self, BrokerError> {
        let channel = conn
            .create_channel()
            .await
            .map_err(BrokerError::op("channel.open"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(BrokerError::op("confirm.select"))?;
        Ok(Self { channel })
    }

    /// The underlying channel (for declarations on the same channel).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publishes `messages` to `queue` through the default exchange, keeping at
    /// most `window` unconfirmed at a time, and returns once all are confirmed.
    /// `on_confirmed` runs once per confirmed message, in publish order.
    pub async fn publish_all<I, F>(
        &self,
        queue: &str,
        messages: I,
        window: usize,
        mut on_confirmed: F,
    ) -> Result<u64, BrokerError>
    where
        I: IntoIterator<Item = Outgoing>,
        F: FnMut(&Outgoing),
    {
        let window = window.max(1);
        let mut pending = std::collections::VecDeque::with_capacity(window);
        let mut confirmed = 0u64;
        for msg in messages {
            if pending.len() >= window {
                let (m, confirm) = pending.pop_front().expect("window is non-empty");
                await_confirm(&m, confirm).await?;
                on_confirmed(&m);
                confirmed += 1;
            }
            let mut props = BasicProperties::default()
                .with_delivery_mode(2) // persistent: survives a broker restart
                .with_content_type(ShortString::from(crate::message::CONTENT_TYPE))
                .with_type(ShortString::from(msg.kind))
                .with_message_id(ShortString::from(msg.message_id.as_str()))
                .with_app_id(ShortString::from("batchfleet"))
                .with_timestamp(crate::now_ms() / 1000)
                .with_headers(msg.headers.clone());
            if let Some(ms) = msg.expiration_ms {
                props = props.with_expiration(ShortString::from(ms.to_string()));
            }
            let confirm = self
                .channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    // mandatory: an unroutable message (queue deleted) comes back
                    // as a return instead of vanishing, and we treat it as an error.
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &msg.body,
                    props,
                )
                .await
                .map_err(BrokerError::op(format!("basic.publish {}", msg.message_id)))?;
            pending.push_back((msg, confirm));
        }
        while let Some((m, confirm)) = pending.pop_front() {
            await_confirm(&m, confirm).await?;
            on_confirmed(&m);
            confirmed += 1;
        }
        Ok(confirmed)
    }
}

async fn await_confirm(
    msg: &Outgoing,
    confirm: lapin::PublisherConfirm,
) -> Result<(), BrokerError> {
    let confirmation = confirm
        .await
        .map_err(BrokerError::op(format!("confirm {}", msg.message_id)))?;
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)) => {
            Err(BrokerError::NotConfirmed {
                message_id: msg.message_id.clone(),
                reason: format!(
                    "returned by the broker: {} {}",
                    ret.reply_code, ret.reply_text
                ),
            })
        }
        Confirmation::Nack(None) => Err(BrokerError::NotConfirmed {
            message_id: msg.message_id.clone(),
            reason: "nacked by the broker".into(),
        }),
        Confirmation::NotRequested => Err(BrokerError::NotConfirmed {
            message_id: msg.message_id.clone(),
            reason: "publisher confirms are not enabled on this channel".into(),
        }),
    }
}

/// Reads a string header from a message's headers.
pub fn str_header(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// A header table from string and integer values.
pub fn headers<'a>(
    strings: impl IntoIterator<Item = (&'a str, String)>,
    ints: impl IntoIterator<Item = (&'a str, i64)>,
) -> FieldTable {
    let mut t = FieldTable::default();
    set_headers(&mut t, strings, ints);
    t
}

/// Sets string and integer values in a header table (replacing those there).
pub fn set_headers<'a>(
    t: &mut FieldTable,
    strings: impl IntoIterator<Item = (&'a str, String)>,
    ints: impl IntoIterator<Item = (&'a str, i64)>,
) {
    for (k, v) in strings {
        t.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    }
    for (k, v) in ints {
        t.insert(k.into(), AMQPValue::LongLongInt(v));
    }
}

/// Reads an integer header (any AMQP integer type) from a message's headers.
pub fn int_header(headers: Option<&FieldTable>, name: &str) -> Option<i64> {
    let value = headers?.inner().get(name)?;
    match value {
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_queue_dead_letters_into_its_pool() {
        let q = PoolQueues::new("gpu");
        assert_eq!(q.work(), "bf.gpu.work");
        assert_eq!(q.dead(), "bf.gpu.dead");
        let args = quorum_args(Some(&q));
        let inner = args.inner();
        assert_eq!(
            inner.get("x-dead-letter-routing-key"),
            Some(&long("gpu.dead"))
        );
        assert_eq!(
            inner.get("x-delivery-limit"),
            Some(&AMQPValue::LongLongInt(DELIVERY_LIMIT))
        );
        assert!(quorum_args(None)
            .inner()
            .get("x-dead-letter-exchange")
            .is_none());
    }

    #[test]
    fn int_header_reads_any_integer_width() {
        let mut t = FieldTable::default();
        t.insert("a".into(), AMQPValue::LongInt(3));
        t.insert("b".into(), AMQPValue::ShortShortUInt(4));
        t.insert("c".into(), long("5"));
        assert_eq!(int_header(Some(&t), "a"), Some(3));
        assert_eq!(int_header(Some(&t), "b"), Some(4));
        assert_eq!(int_header(Some(&t), "c"), None);
        assert_eq!(int_header(None, "a"), None);
    }
}
