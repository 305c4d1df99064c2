//! The RabbitMQ implementation of [`Broker`] (lapin).
//!
//! - Work, dead and infra queues are durable quorum queues: replicated, and
//!   fsynced before a publish is confirmed, so a broker restart loses
//!   nothing. `x-delivery-limit` ([`DELIVERY_LIMIT`]) dead-letters a message
//!   returned too often through `bf.dlx` (direct) with key `P.dead`, bound to
//!   both `bf.P.dead` and `bf.P.infra`; workers publish their own dead
//!   letters straight to `bf.P.dead` (default exchange), so only what the
//!   broker dead-letters reaches `bf.P.infra`.
//! - A retry tier dead-letters an expired message through the default
//!   exchange straight back into `bf.P.work`. Messages expire only at the
//!   head of a queue, so one tier per order of magnitude bounds how long a
//!   short delay can wait behind a longer one.
//! - `bf.P.notices` is a durable fanout exchange: the coordinator announces
//!   a job's start there, and each worker hears it on a queue of its own
//!   (`bf.P.notices.<tag>`, exclusive to its connection, deleted with it), so
//!   a new job's queue is consumed at once instead of at the next look at
//!   the pool's active jobs. Announcements are not persistent: a worker that
//!   was not listening finds the job at its next look.
//! - Declarations are idempotent but their arguments must match exactly on
//!   every declare, so they exist only here ([`AmqpBroker::declare`]).
//!
//! One [`AmqpBroker`] is one connection with a confirm-mode publishing
//! channel, a channel for `basic.get`, one for passive declares, and a
//! channel of its own for each subscription, closed once the subscription
//! and every delivery it sent are gone: a `basic.consume` that fails (a
//! queue deleted between a look and the consume answers `NOT_FOUND`, which
//! closes its channel) ends only that subscription. Closing the broker
//! returns every unacknowledged delivery.

use super::{
    Acker, Broker, BrokerError, Delivery, HeaderValue, Headers, Notice, Notices, Outgoing,
    PoolQueues, Subscription, DEAD_LETTER_EXCHANGE, DELIVERY_LIMIT, RETRY_TIERS_S,
};
use crate::endpoint::{is_certificate_error, Endpoint};
use crate::secret::scrub;
use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

fn op(what: impl Into<String>) -> impl FnOnce(lapin::Error) -> BrokerError {
    let what = what.into();
    move |e| {
        let op = format!("RabbitMQ {what}");
        if connection_lost(&e) {
            // Another connection may well succeed: callers that ride out
            // outages (a job's start, a worker's session) try again.
            BrokerError::Closed(format!("{op} failed: {e}"))
        } else {
            BrokerError::Op {
                op,
                reason: e.to_string(),
            }
        }
    }
}

/// Whether `e` ended the connection for a reason of the broker's moment
/// rather than of the operation: the socket or heartbeat lost, a
/// connection the broker forced closed, or its `INTERNAL_ERROR` (a quorum
/// queue whose replicas did not start in time under load answers
/// `cluster_not_formed` so). Refusals of the operation itself (not found,
/// access refused, arguments that differ) stay [`BrokerError::Op`].
fn connection_lost(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError};
    use lapin::ErrorKind;
    match e.kind() {
        ErrorKind::IOError(_)
        | ErrorKind::RuntimeShutdownError(_)
        | ErrorKind::MissingHeartbeatError
        | ErrorKind::InvalidConnectionState(_) => true,
        ErrorKind::ProtocolError(amqp) => matches!(
            amqp.kind(),
            AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED | AMQPHardError::INTERNALERROR)
        ),
        _ => false,
    }
}

/// A RabbitMQ connection as a [`Broker`].
pub struct AmqpBroker {
    conn: Connection,
    url: String,
    publisher: Channel,
    getting: OnceCell<Channel>,
    /// The channel of passive declares, kept open between them: one round
    /// trip per count, a new channel only after a 404 closed the last.
    inspecting: tokio::sync::Mutex<Option<Channel>>,
}

impl std::fmt::Debug for AmqpBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpBroker")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// Per list of node URLs, the node a new connection tries first: the one
/// after the node the previous connection reached, so that a process whose
/// connection was lost moves on to the next node, and the connections of
/// one process spread over the cluster.
static NEXT_NODE: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<String, usize>>> =
    std::sync::LazyLock::new(Default::default);

impl AmqpBroker {
    /// Opens a connection to the endpoint: one node, or the first of a list
    /// of nodes (`amqp://a,amqp://b,…`, a cluster) that answers, starting
    /// after the node the previous connection reached. A permanent error
    /// (credentials, certificate) ends the search at once, since every node
    /// of a cluster shares them; otherwise the error names every node's
    /// failure.
    pub async fn connect(
        endpoint: &Endpoint,
        connection_name: &str,
        timeout: Duration,
    ) -> Result<Self, BrokerError> {
        let nodes = endpoint.nodes();
        if nodes.len() <= 1 {
            return Self::connect_node(endpoint, connection_name, timeout).await;
        }
        let key = endpoint.url.expose().to_owned();
        let first = NEXT_NODE
            .lock()
            .map(|m| m.get(&key).copied().unwrap_or(0))
            .unwrap_or(0);
        let mut failures = Vec::new();
        for k in 0..nodes.len() {
            let i = (first + k) % nodes.len();
            let node = &nodes[i];
            match Self::connect_node(node, connection_name, timeout).await {
                Ok(broker) => {
                    if let Ok(mut m) = NEXT_NODE.lock() {
                        m.insert(key, (i + 1) % nodes.len());
                    }
                    tracing::debug!(node = %broker.url, "connected to a RabbitMQ node");
                    return Ok(broker);
                }
                Err(e) if e.is_permanent() => return Err(e),
                Err(e) => {
                    tracing::warn!(node = %node.url, error = %e, "RabbitMQ node not reachable; trying the next");
                    let why = match e {
                        BrokerError::Connect { reason, .. } => reason,
                        BrokerError::Timeout { secs, .. } => format!("no answer within {secs}s"),
                        other => other.to_string(),
                    };
                    failures.push(format!("{}: {why}", node.url));
                }
            }
        }
        Err(BrokerError::Connect {
            url: endpoint.url.redacted(),
            reason: format!(
                "none of its {} nodes answered ({})",
                nodes.len(),
                failures.join("; ")
            ),
            hint: "Start a node of the cluster, or fix BATCHFLEET_AMQP_URL (one URL per node, comma-separated).".into(),
        })
    }

    /// Opens a connection to one node, bounded by `timeout`, with errors
    /// that say what to do, and a publishing channel in confirm mode. An
    /// `amqps://` URL connects with TLS, trusting the system's roots and
    /// the endpoint's CA file, and presenting its client certificate when
    /// one is given.
    async fn connect_node(
        endpoint: &Endpoint,
        connection_name: &str,
        timeout: Duration,
    ) -> Result<Self, BrokerError> {
        let url = &endpoint.url;
        let tls = match endpoint.tls_material().map_err(BrokerError::TlsSetup)? {
            Some(m) => lapin::tcp::OwnedTLSConfig {
                identity: m
                    .client
                    .map(|(pem, key)| lapin::tcp::OwnedIdentity::PKCS8 { pem, key }),
                cert_chain: m
                    .ca_pem
                    .map(|pem| String::from_utf8_lossy(&pem).into_owned()),
            },
            None => lapin::tcp::OwnedTLSConfig::default(),
        };
        let props =
            ConnectionProperties::default().with_connection_name(LongString::from(connection_name));
        let builder = lapin::DefaultConnectionBuilder::new()
            .map_err(|e| connect_error(endpoint, &e))?
            .with_uri_str(url.expose().to_owned())
            .with_properties(props)
            .with_tls_config(tls);
        let conn = match tokio::time::timeout(timeout, builder.connect()).await {
            Err(_) => {
                return Err(BrokerError::Timeout {
                    url: url.redacted(),
                    secs: timeout.as_secs(),
                })
            }
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(connect_error(endpoint, &e)),
        };
        let publisher = conn.create_channel().await.map_err(op("channel.open"))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(op("confirm.select"))?;
        Ok(Self {
            conn,
            url: url.redacted(),
            publisher,
            getting: OnceCell::new(),
            inspecting: tokio::sync::Mutex::new(None),
        })
    }

    /// A channel for one passive declare or purge: a failed passive declare
    /// closes its channel, so it must not be one in use.
    async fn scratch(&self) -> Result<Channel, BrokerError> {
        self.conn.create_channel().await.map_err(op("channel.open"))
    }
}

fn connect_error(endpoint: &Endpoint, e: &lapin::Error) -> BrokerError {
    let url = &endpoint.url;
    let reason = scrub(&e.to_string(), url);
    let lower = reason.to_ascii_lowercase();
    if lower.contains("access_refused") || lower.contains("auth") || lower.contains("login") {
        return BrokerError::Auth {
            url: url.redacted(),
            reason,
        };
    }
    if endpoint.is_tls() && is_certificate_error(&reason) {
        return BrokerError::Untrusted {
            url: url.redacted(),
            reason,
            hint: endpoint.untrusted_hint(),
        };
    }
    let hint = endpoint.connect_hint(&reason).unwrap_or_else(|| {
        if lower.contains("refused") || lower.contains("resolve") || lower.contains("lookup") {
            "Is RabbitMQ running? Start it (e.g. `rabbitmq-server -detached`), fix BATCHFLEET_AMQP_URL, or run the job in one process with `batchfleet run --local`."
        } else {
            "Check BATCHFLEET_AMQP_URL and that RabbitMQ is healthy."
        }
        .into()
    });
    BrokerError::Connect {
        url: url.redacted(),
        reason,
        hint,
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
async fn declare_topology(channel: &Channel, queues: &PoolQueues) -> Result<(), BrokerError> {
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
        .map_err(op(format!("exchange.declare {DEAD_LETTER_EXCHANGE}")))?;
    // Same routing key for dead and infra: a direct exchange gives each bound
    // queue its copy of a broker dead letter.
    for queue in [queues.dead(), queues.infra()] {
        channel
            .queue_declare(queue.as_str().into(), durable, quorum_args(None))
            .await
            .map_err(op(format!("queue.declare {queue}")))?;
        channel
            .queue_bind(
                queue.as_str().into(),
                DEAD_LETTER_EXCHANGE.into(),
                queues.dead_routing_key().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(op(format!("queue.bind {queue}")))?;
    }
    let notices = queues.notices();
    channel
        .exchange_declare(
            notices.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(op(format!("exchange.declare {notices}")))?;
    channel
        .queue_declare(queues.work().into(), durable, quorum_args(Some(queues)))
        .await
        .map_err(op(format!("queue.declare {}", queues.work())))?;
    for tier in RETRY_TIERS_S {
        let name = queues.retry(tier);
        channel
            .queue_declare(name.as_str().into(), durable, retry_args(queues))
            .await
            .map_err(op(format!("queue.declare {name}")))?;
    }
    Ok(())
}

/// Plain headers as an AMQP table.
fn to_table(headers: &Headers) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in headers.iter() {
        let v = match v {
            HeaderValue::Str(s) => long(s),
            HeaderValue::Int(i) => AMQPValue::LongLongInt(*i),
        };
        t.insert(k.into(), v);
    }
    t
}

/// An AMQP table as plain headers: text and integers (of any width) are
/// kept; what batchfleet never sets (arrays such as `x-death`) is dropped.
fn from_table(table: Option<&FieldTable>) -> Headers {
    let mut h = Headers::default();
    for (k, v) in table.map(|t| t.inner().iter()).into_iter().flatten() {
        let v = match v {
            AMQPValue::LongString(s) => {
                HeaderValue::Str(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            AMQPValue::ShortString(s) => HeaderValue::Str(s.as_str().to_owned()),
            AMQPValue::ShortShortInt(v) => HeaderValue::Int(i64::from(*v)),
            AMQPValue::ShortShortUInt(v) => HeaderValue::Int(i64::from(*v)),
            AMQPValue::ShortInt(v) => HeaderValue::Int(i64::from(*v)),
            AMQPValue::ShortUInt(v) => HeaderValue::Int(i64::from(*v)),
            AMQPValue::LongInt(v) => HeaderValue::Int(i64::from(*v)),
            AMQPValue::LongUInt(v) => HeaderValue::Int(i64::from(*v)),
            AMQPValue::LongLongInt(v) => HeaderValue::Int(*v),
            _ => continue,
        };
        h.insert(k.as_str(), v);
    }
    h
}

fn delivery(d: lapin::message::Delivery, channel: Option<Arc<Owned>>) -> Delivery {
    let headers = from_table(d.properties.headers().as_ref());
    let message_id = d
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_owned())
        .unwrap_or_default();
    let tag = d.delivery_tag;
    let redelivered = d.redelivered;
    let acker = AmqpAcker {
        acker: d.acker,
        settled: AtomicBool::new(false),
        _channel: channel,
    };
    Delivery::new(d.data, headers, message_id, tag, Arc::new(acker)).redelivered(redelivered)
}

/// Settles a delivery once; one dropped unsettled is returned (`basic.nack`
/// with requeue) rather than held until its channel closes.
struct AmqpAcker {
    acker: lapin::Acker,
    settled: AtomicBool,
    /// The subscription's channel, open while this delivery is unsettled.
    _channel: Option<Arc<Owned>>,
}

/// A channel of one subscription, closed when the subscription and the
/// last delivery it sent are dropped (closing it earlier would return the
/// deliveries still being worked on).
struct Owned(Channel);

impl Drop for Owned {
    fn drop(&mut self) {
        if !self.0.status().connected() {
            return;
        }
        let channel = self.0.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = channel.close(200, "done".into()).await;
            });
        }
    }
}

fn requeue_options() -> BasicNackOptions {
    BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    }
}

#[async_trait::async_trait]
impl Acker for AmqpAcker {
    async fn ack(&self) -> Result<(), BrokerError> {
        if self.settled.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.acker
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(op("basic.ack"))
    }
    async fn requeue(&self) -> Result<(), BrokerError> {
        if self.settled.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.acker
            .nack(requeue_options())
            .await
            .map(drop)
            .map_err(op("basic.nack"))
    }
}

impl Drop for AmqpAcker {
    fn drop(&mut self) {
        if self.settled.swap(true, Ordering::SeqCst) {
            return;
        }
        let acker = self.acker.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = acker.nack(requeue_options()).await;
            });
        }
    }
}

struct AmqpSubscription {
    channel: Arc<Owned>,
    consumer: lapin::Consumer,
    tag: String,
}

/// The announcements a worker hears on its own notice queue.
struct AmqpNotices {
    /// Kept open as long as the subscription.
    _channel: Channel,
    consumer: lapin::Consumer,
}

#[async_trait::async_trait]
impl Notices for AmqpNotices {
    async fn next(&mut self) -> Option<Result<Notice, BrokerError>> {
        match self.consumer.next().await? {
            Ok(d) => Some(Ok(Notice::decode(&d.data))),
            Err(e) => Some(Err(BrokerError::Closed(e.to_string()))),
        }
    }
}

#[async_trait::async_trait]
impl Subscription for AmqpSubscription {
    async fn next(&mut self) -> Option<Result<Delivery, BrokerError>> {
        match self.consumer.next().await? {
            Ok(d) => Some(Ok(delivery(d, Some(self.channel.clone())))),
            Err(e) => Some(Err(BrokerError::Closed(e.to_string()))),
        }
    }
    async fn cancel(&mut self) {
        let _ = self
            .channel
            .0
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
            .await;
    }
}

#[async_trait::async_trait]
impl Broker for AmqpBroker {
    fn describe(&self) -> String {
        format!("RabbitMQ at {}", self.url)
    }

    async fn declare(&self, queues: &PoolQueues) -> Result<(), BrokerError> {
        declare_topology(&self.publisher, queues).await
    }

    async fn declare_job(&self, queues: &PoolQueues, job: &str) -> Result<(), BrokerError> {
        let name = queues.job(job);
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        self.publisher
            .queue_declare(name.as_str().into(), durable, quorum_args(Some(queues)))
            .await
            .map(drop)
            .map_err(op(format!("queue.declare {name}")))
    }

    /// Persistent, mandatory messages on the confirm-mode channel: a message
    /// counts as sent only when the broker acked it *and* did not return it
    /// as unroutable.
    async fn publish(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
        window: usize,
    ) -> Result<u64, BrokerError> {
        let window = window.max(1);
        let mut pending: std::collections::VecDeque<(String, lapin::PublisherConfirm)> =
            std::collections::VecDeque::with_capacity(window);
        let mut confirmed = 0u64;
        for msg in messages {
            if pending.len() >= window {
                let (m, confirm) = pending.pop_front().expect("window is non-empty");
                await_confirm(&m, confirm).await?;
                confirmed += 1;
            }
            let mut props = BasicProperties::default()
                .with_delivery_mode(2) // persistent: survives a broker restart
                .with_content_type(ShortString::from(crate::message::CONTENT_TYPE))
                .with_type(ShortString::from(msg.kind))
                .with_message_id(ShortString::from(msg.message_id.as_str()))
                .with_app_id(ShortString::from("batchfleet"))
                .with_timestamp(crate::host::now_ms() / 1000)
                .with_headers(to_table(&msg.headers));
            if let Some(ms) = msg.expiration_ms {
                props = props.with_expiration(ShortString::from(ms.to_string()));
            }
            let confirm = self
                .publisher
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
                .map_err(op(format!("basic.publish {}", msg.message_id)))?;
            pending.push_back((msg.message_id, confirm));
        }
        while let Some((m, confirm)) = pending.pop_front() {
            await_confirm(&m, confirm).await?;
            confirmed += 1;
        }
        Ok(confirmed)
    }

    /// Not persistent and not mandatory: an announcement matters only to
    /// the workers listening now.
    async fn announce(&self, queues: &PoolQueues, notice: &Notice) -> Result<(), BrokerError> {
        let exchange = queues.notices();
        let confirm = self
            .publisher
            .basic_publish(
                exchange.as_str().into(),
                "".into(),
                BasicPublishOptions::default(),
                notice.encode().as_bytes(),
                BasicProperties::default().with_app_id(ShortString::from("batchfleet")),
            )
            .await
            .map_err(op(format!("basic.publish {exchange}")))?;
        match confirm
            .await
            .map_err(op(format!("publish to {exchange}")))?
        {
            Confirmation::Nack(_) => Err(BrokerError::NotConfirmed {
                message_id: format!("notice of job {}", notice.job),
                reason: "the broker refused it".into(),
            }),
            _ => Ok(()),
        }
    }

    /// A classic queue of this connection's own (whatever the vhost's
    /// default queue type: an exclusive queue cannot be a quorum queue),
    /// bound to the pool's notice exchange and consumed without acks.
    /// On a channel of its own: a refusal (a user without rights on the
    /// notice exchange) closes that channel, not those consuming work.
    async fn notices(&self, queues: &PoolQueues) -> Result<Box<dyn Notices>, BrokerError> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let channel = self.scratch().await?;
        let tag = format!(
            "{}-{}-{}",
            std::process::id(),
            crate::host::now_ms(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let queue = queues.notices_for(&tag);
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), long("classic"));
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .map_err(op(format!("queue.declare {queue}")))?;
        channel
            .queue_bind(
                queue.as_str().into(),
                queues.notices().as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(op(format!("queue.bind {queue}")))?;
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                format!("bf-notices-{tag}").as_str().into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(op(format!("basic.consume {queue}")))?;
        Ok(Box::new(AmqpNotices {
            _channel: channel,
            consumer,
        }))
    }

    /// Every queue, then the exchange, each tried whatever the others did;
    /// the first failure.
    async fn delete_pool(&self, queues: &PoolQueues) -> Result<(), BrokerError> {
        let mut first = super::delete_queues(self, queues).await;
        let exchange = queues.notices();
        let deleted = async {
            let channel = self.scratch().await?;
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await
                .map_err(op(format!("exchange.delete {exchange}")))?;
            let _ = channel.close(200, "deleted".into()).await;
            Ok::<_, BrokerError>(())
        };
        if let Err(e) = deleted.await {
            first.get_or_insert(e);
        }
        first.map_or(Ok(()), Err)
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        // A channel of its own: a `basic.consume` that fails (404 for a
        // queue deleted since it was looked at) closes only this one.
        let channel = Arc::new(Owned(
            self.conn
                .create_channel()
                .await
                .map_err(op("channel.open"))?,
        ));
        // Per consumer (not global): each subscription gets `prefetch`.
        channel
            .0
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(op("basic.qos"))?;
        let tag = format!(
            "bf-{}-{}-{}",
            std::process::id(),
            crate::host::now_ms(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let consumer = channel
            .0
            .basic_consume(
                queue.into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(op(format!("basic.consume {queue}")))?;
        Ok(Box::new(AmqpSubscription {
            channel,
            consumer,
            tag,
        }))
    }

    async fn get(&self, queue: &str) -> Result<Option<Delivery>, BrokerError> {
        let channel = self
            .getting
            .get_or_try_init(|| async {
                self.conn.create_channel().await.map_err(op("channel.open"))
            })
            .await?;
        let got = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .map_err(op(format!("basic.get {queue}")))?;
        Ok(got.map(|m| delivery(m.delivery, None)))
    }

    async fn purge(&self, queue: &str) -> Result<u32, BrokerError> {
        if self.ready_count(queue).await?.is_none() {
            return Ok(0);
        }
        let channel = self.scratch().await?;
        let n = channel
            .queue_purge(queue.into(), QueuePurgeOptions::default())
            .await
            .map_err(op(format!("queue.purge {queue}")))?;
        let _ = channel.close(200, "purged".into()).await;
        Ok(n)
    }

    async fn delete(&self, queue: &str) -> Result<(), BrokerError> {
        let channel = self.scratch().await?;
        channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await
            .map_err(op(format!("queue.delete {queue}")))?;
        let _ = channel.close(200, "deleted".into()).await;
        Ok(())
    }

    async fn ready_count(&self, queue: &str) -> Result<Option<u32>, BrokerError> {
        Ok(self.inspect(queue).await?.map(|q| q.message_count()))
    }

    async fn consumer_count(&self, queue: &str) -> Result<Option<u32>, BrokerError> {
        Ok(self.inspect(queue).await?.map(|q| q.consumer_count()))
    }

    fn is_open(&self) -> bool {
        self.conn.status().connected() && self.publisher.status().connected()
    }

    async fn close(&self, why: &str) {
        // Closing the connection returns every unacknowledged delivery at
        // once, the subscriptions' channels' included.
        if let Some(channel) = self.getting.get() {
            let _ = channel.close(200, why.into()).await;
        }
        if let Some(channel) = self.inspecting.lock().await.take() {
            let _ = channel.close(200, why.into()).await;
        }
        let _ = self.publisher.close(200, why.into()).await;
        let _ = self.conn.close(200, why.into()).await;
    }
}

impl AmqpBroker {
    /// A passive declare: the queue's counts, `None` when it does not exist.
    /// On the inspection channel, kept open: a supervisor counting queues
    /// every second opens no channel while they exist.
    async fn inspect(&self, queue: &str) -> Result<Option<lapin::Queue>, BrokerError> {
        let mut slot = self.inspecting.lock().await;
        let channel = match slot.as_ref() {
            Some(c) if c.status().connected() => c.clone(),
            _ => {
                let c = self.scratch().await?;
                *slot = Some(c.clone());
                c
            }
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
        {
            Ok(q) => Ok(Some(q)),
            // The broker closes the channel on a failed passive declare:
            // the next inspection opens another.
            Err(e) => {
                *slot = None;
                let text = e.to_string();
                if text.contains("NOT_FOUND") || text.contains("404") {
                    Ok(None)
                } else {
                    Err(BrokerError::Op {
                        op: format!("RabbitMQ queue.declare (passive) {queue}"),
                        reason: text,
                    })
                }
            }
        }
    }
}

async fn await_confirm(
    message_id: &str,
    confirm: lapin::PublisherConfirm,
) -> Result<(), BrokerError> {
    let confirmation = confirm.await.map_err(op(format!("confirm {message_id}")))?;
    let refused = |reason: String| BrokerError::NotConfirmed {
        message_id: message_id.to_owned(),
        reason,
    };
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)) => Err(refused(format!(
            "returned by the broker: {} {}",
            ret.reply_code, ret.reply_text
        ))),
        Confirmation::Nack(None) => Err(refused("nacked by the broker".into())),
        Confirmation::NotRequested => Err(refused(
            "publisher confirms are not enabled on this channel".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn amqp(code: u16, text: &str) -> lapin::Error {
        let e = lapin::protocol::AMQPError::from_id(code, text.into()).expect("a known reply code");
        lapin::ErrorKind::ProtocolError(e).into()
    }

    /// What closed the connection for the broker's moment is an outage
    /// (tried again by a job's start and a worker's session); what refuses
    /// the operation itself is not, and is reported as it is.
    #[test]
    fn a_broker_that_could_not_do_it_now_is_told_from_one_that_refuses_it() {
        let declare = "queue.declare bf.p.job.j";
        let lost = [
            // A quorum queue whose replicas did not start in time (load).
            amqp(
                541,
                "INTERNAL_ERROR - Cannot declare quorum queue 'bf.p.job.j': cluster_not_formed",
            ),
            amqp(
                320,
                "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'",
            ),
            lapin::ErrorKind::MissingHeartbeatError.into(),
            lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
        ];
        for e in lost {
            let text = e.to_string();
            let err = op(declare)(e);
            assert!(err.is_unavailable(), "{text}: {err:?}");
            assert!(err.to_string().contains(declare), "{err}");
        }
        let refused = [
            amqp(404, "NOT_FOUND - no queue 'bf.p.job.j' in vhost '/'"),
            amqp(406, "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'"),
            amqp(403, "ACCESS_REFUSED - access to queue 'bf.p.job.j' refused"),
        ];
        for e in refused {
            let err = op(declare)(e);
            assert!(matches!(err, BrokerError::Op { .. }), "{err:?}");
            assert!(!err.is_unavailable());
        }
    }

    #[test]
    fn work_queue_dead_letters_into_its_pool() {
        let q = PoolQueues::new("gpu");
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
    fn headers_of_any_integer_width_read_back_and_arrays_are_dropped() {
        let mut t = FieldTable::default();
        t.insert("a".into(), AMQPValue::LongInt(3));
        t.insert("b".into(), AMQPValue::ShortShortUInt(4));
        t.insert("c".into(), long("5"));
        t.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        let h = from_table(Some(&t));
        assert_eq!(h.int("a"), Some(3));
        assert_eq!(h.int("b"), Some(4));
        assert_eq!(h.str("c"), Some("5"));
        assert_eq!(h.iter().count(), 3);
        assert_eq!(from_table(Some(&to_table(&h))), h);
    }
}
