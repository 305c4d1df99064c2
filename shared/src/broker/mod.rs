//! The work queues: one interface ([`Broker`]) with two implementations —
//! RabbitMQ ([`amqp`], the fleet's) and in-process memory ([`local`], for
//! `batchfleet run --local`). Code outside this module holds an
//! `Arc<dyn Broker>`, plain [`Headers`] and [`Delivery`]s, and never names
//! either implementation's types.
//!
//! # Layout
//! - this file: the [`Broker`] seam, [`Delivery`], [`Headers`],
//!   [`Outgoing`] and the topology of a pool ([`PoolQueues`]).
//! - [`amqp`]: RabbitMQ through lapin.
//! - [`local`]: queues in this process's memory.
//!
//! # Topology (per pool `P`)
//! - `bf.P.work`: the queue workers consume. Each message's deliveries are
//!   counted (`x-delivery-count`); past [`DELIVERY_LIMIT`] returns it is
//!   dead-lettered by the broker itself (an item that crashes its worker
//!   cannot loop forever).
//! - `bf.P.dead`: items that failed for good, until listed and replayed.
//!   Workers publish their own dead letters here with the reason in headers.
//! - `bf.P.infra`: a copy of what the *broker* dead-lettered (delivery
//!   limit); workers consume it and record those items failed (class
//!   `infra`), so the job settles instead of waiting for them forever.
//! - `bf.P.job.<job id>`: one queue per job of the pool, declared by the
//!   coordinator when it publishes the job (with the work queue's
//!   arguments) and deleted when the job ends. Workers consume every job
//!   queue of their pool that the job store lists as active, choosing among
//!   them by weighted fair queueing (the jobs' priorities), so that jobs
//!   share the fleet instead of waiting behind each other in one queue.
//! - `bf.P.notices`: a fanout exchange on which the coordinator announces a
//!   job's start ([`Broker::announce`]); each worker listens through a queue
//!   of its own ([`Broker::notices`]) and consumes the new job's queue at
//!   once. A notice is a hint: workers also read the active jobs now and then.
//! - `bf.P.retry.<tier>` ([`RETRY_TIERS_S`]): delayed retry without blocking
//!   a worker. A failed item is published to the smallest tier that fits its
//!   delay with a per-message expiration; when it expires it goes back to
//!   `bf.P.work`.
//!
//! # Semantics both implementations keep (pinned by `shared/tests/it/broker.rs`)
//! - A publish returns once every message is confirmed stored; a message to
//!   a queue that does not exist is an error naming it, never silently lost.
//! - A delivery is settled once: acked (gone) or returned (requeued, its
//!   delivery count raised). One dropped unsettled is returned, and so is
//!   every one still unsettled when its [`Broker`] handle closes.
//! - [`Broker::get`] takes one ready message without settling it (the DLQ
//!   commands); what they do not ack returns when they drop it.

pub mod amqp;
pub mod local;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Exchange that receives dead-lettered messages of all pools (RabbitMQ).
pub const DEAD_LETTER_EXCHANGE: &str = "bf.dlx";

/// Returns a message may have before the broker dead-letters it on its own.
/// A backstop for items that kill their worker (abort, OOM kill) before it can
/// classify the failure; ordinary failures are classified by the worker first.
pub const DELIVERY_LIMIT: i64 = 20;

/// Upper bounds (seconds) of the retry tiers.
pub const RETRY_TIERS_S: [u64; 6] = [1, 5, 30, 120, 600, 3600];

/// Header the broker sets on a redelivered message: how often it was
/// returned before.
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// Errors talking to the broker. Messages never contain credentials.
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
        hint: String,
    },
    /// The broker refused the credentials; retrying will not help.
    #[error("RabbitMQ at {url} refused the login: {reason}. Check the user name and password in the AMQP URL (BATCHFLEET_AMQP_URL)")]
    Auth {
        /// Redacted URL.
        url: String,
        /// What the client library said, credentials scrubbed.
        reason: String,
    },
    /// A TLS file (`BATCHFLEET_AMQP_*_FILE`) cannot be used.
    #[error("RabbitMQ TLS settings: {0}")]
    TlsSetup(crate::endpoint::TlsSetupError),
    /// The TLS handshake refused the server's certificate.
    #[error("RabbitMQ at {url} did not pass the TLS handshake: {reason}. {hint}")]
    Untrusted {
        /// Redacted URL.
        url: String,
        /// What the TLS library said.
        reason: String,
        /// What to do about it.
        hint: String,
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
    #[error("{op} failed: {reason}")]
    Op {
        /// The operation, e.g. `queue.declare bf.default.work`.
        op: String,
        /// What the broker or client library said.
        reason: String,
    },
    /// The broker refused a publish (nack) or could not route it (return).
    #[error("the broker did not accept message {message_id}: {reason}")]
    NotConfirmed {
        /// Message id of the refused publish.
        message_id: String,
        /// nack or unroutable return.
        reason: String,
    },
    /// The handle was closed (or its connection lost).
    #[error("the broker connection is closed: {0}")]
    Closed(String),
}

impl BrokerError {
    /// Whether the broker could not be reached or the connection was lost
    /// (a restart, a failover that may be over in a moment).
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            BrokerError::Connect { .. } | BrokerError::Timeout { .. } | BrokerError::Closed(_)
        )
    }

    /// Whether retrying cannot help (wrong credentials, an untrusted
    /// certificate, unusable TLS files).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            BrokerError::Auth { .. } | BrokerError::TlsSetup(_) | BrokerError::Untrusted { .. }
        )
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
    /// The queue of one job's items.
    pub fn job(&self, job_id: &str) -> String {
        format!("bf.{}.job.{job_id}", self.pool)
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
    /// The pool's notice exchange (fanout): the coordinator announces a
    /// job's start there, and every worker of the pool hears it at once.
    pub fn notices(&self) -> String {
        format!("bf.{}.notices", self.pool)
    }
    /// A worker's own queue on the notice exchange (exclusive to its
    /// connection, deleted with it); `tag` tells the workers apart.
    pub fn notices_for(&self, tag: &str) -> String {
        format!("bf.{}.notices.{tag}", self.pool)
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

/// One header value: text or an integer (all batchfleet sets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValue {
    /// Text.
    Str(String),
    /// An integer (any width on the wire).
    Int(i64),
}

/// A message's headers, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(BTreeMap<String, HeaderValue>);

impl Headers {
    /// Headers from string and integer values.
    pub fn of<'a>(
        strings: impl IntoIterator<Item = (&'a str, String)>,
        ints: impl IntoIterator<Item = (&'a str, i64)>,
    ) -> Self {
        let mut h = Self::default();
        h.set(strings, ints);
        h
    }

    /// Sets string and integer values (replacing those there).
    pub fn set<'a>(
        &mut self,
        strings: impl IntoIterator<Item = (&'a str, String)>,
        ints: impl IntoIterator<Item = (&'a str, i64)>,
    ) {
        for (k, v) in strings {
            self.0.insert(k.to_owned(), HeaderValue::Str(v));
        }
        for (k, v) in ints {
            self.0.insert(k.to_owned(), HeaderValue::Int(v));
        }
    }

    /// Sets one value.
    pub fn insert(&mut self, name: &str, value: HeaderValue) {
        self.0.insert(name.to_owned(), value);
    }

    /// Removes one value.
    pub fn remove(&mut self, name: &str) -> Option<HeaderValue> {
        self.0.remove(name)
    }

    /// A text header.
    pub fn str(&self, name: &str) -> Option<&str> {
        match self.0.get(name)? {
            HeaderValue::Str(s) => Some(s),
            HeaderValue::Int(_) => None,
        }
    }

    /// An integer header.
    pub fn int(&self, name: &str) -> Option<i64> {
        match self.0.get(name)? {
            HeaderValue::Int(v) => Some(*v),
            HeaderValue::Str(_) => None,
        }
    }

    /// What [`crate::message::SETTLE_HEADER`] seals: the body's signature and
    /// the headers that change how an item is settled.
    fn settling(&self) -> String {
        let int = |name| self.int(name).map(|v| v.to_string()).unwrap_or_default();
        format!(
            "{}\0{}\0{}\0{}",
            crate::message::SETTLE_HEADER,
            self.str(crate::signing::SIGNATURE_HEADER)
                .unwrap_or_default(),
            int(crate::message::ATTEMPT_HEADER),
            int(crate::message::UNKNOWN_SINCE_HEADER),
        )
    }

    /// Seals the settling headers as they are now with `key` (nothing
    /// without one): call it last, after every header is set.
    pub fn seal_settling(&mut self, key: Option<&crate::signing::SigningKey>) {
        let Some(key) = key else {
            return;
        };
        let seal = key.sign(self.settling().as_bytes());
        self.set([(crate::message::SETTLE_HEADER, seal)], []);
    }

    /// Whether the settling headers may be believed: always without a key;
    /// with one, when none is set or their seal verifies.
    pub fn settling_trusted(&self, key: Option<&crate::signing::SigningKey>) -> bool {
        let Some(key) = key else {
            return true;
        };
        let none = self.int(crate::message::ATTEMPT_HEADER).is_none()
            && self.int(crate::message::UNKNOWN_SINCE_HEADER).is_none();
        none || self
            .str(crate::message::SETTLE_HEADER)
            .is_some_and(|seal| key.verify(self.settling().as_bytes(), seal))
    }

    /// Every header, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HeaderValue)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// These headers less those a broker adds on delivery
    /// (`x-delivery-count`, `x-death`): what a re-published copy carries.
    pub fn own(&self) -> Self {
        let mut h = self.clone();
        h.remove(DELIVERY_COUNT_HEADER);
        h.remove("x-death");
        h
    }
}

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Unique id (`<job>/<seq>`), used in errors and for deduplication by readers.
    pub message_id: String,
    /// Message type (`batchfleet.work_item.v3` and the older versions).
    pub kind: &'static str,
    /// Encoded body.
    pub body: Vec<u8>,
    /// Headers (the attempt, the signature, why it died).
    pub headers: Headers,
    /// Per-message expiration (retry delay), if any.
    pub expiration_ms: Option<u64>,
}

impl Outgoing {
    /// A work item for the work queue, at delivery attempt `attempt`, signed
    /// with `key` when one is configured (version 3 when the item names its
    /// job's stored task, else version 2).
    pub fn work_item(
        item: &crate::message::WorkItem,
        attempt: u32,
        key: Option<&crate::signing::SigningKey>,
    ) -> Self {
        let sealed = crate::message::seal(item, key);
        Self::sealed(
            format!("{}/{}", item.job_id, item.seq),
            sealed,
            attempt,
            key,
        )
    }

    /// A version 3 work item (naming its job's stored task), at delivery
    /// attempt `attempt`, signed with `key` when one is configured.
    pub fn item_ref(
        item: &crate::message::ItemRef,
        attempt: u32,
        key: Option<&crate::signing::SigningKey>,
    ) -> Self {
        let sealed = crate::message::seal_ref(item, key);
        Self::sealed(
            format!("{}/{}", item.job_id, item.seq),
            sealed,
            attempt,
            key,
        )
    }

    /// A bundle of items (version 4) at delivery attempt 1, signed with
    /// `key` when one is configured.
    pub fn bundle(
        bundle: crate::message::Bundle,
        key: Option<&crate::signing::SigningKey>,
    ) -> Self {
        let id = bundle.message_id();
        Self::sealed(id, crate::message::seal_bundle(bundle, key), 1, key)
    }

    fn sealed(
        message_id: String,
        sealed: crate::message::Sealed,
        attempt: u32,
        key: Option<&crate::signing::SigningKey>,
    ) -> Self {
        let mut headers = Headers::default();
        if let Some(signature) = sealed.signature {
            headers.set([(crate::signing::SIGNATURE_HEADER, signature)], []);
        }
        headers.set(
            [],
            [
                (crate::message::ATTEMPT_HEADER, i64::from(attempt)),
                (
                    crate::message::PUBLISHED_HEADER,
                    crate::host::now_ms() as i64,
                ),
            ],
        );
        headers.seal_settling(key);
        Self {
            message_id,
            kind: sealed.kind,
            body: sealed.body,
            headers,
            expiration_ms: None,
        }
    }
}

/// Settles one delivery; implemented by each broker.
#[async_trait::async_trait]
pub trait Acker: Send + Sync {
    /// Acknowledges: the message is gone.
    async fn ack(&self) -> Result<(), BrokerError>;
    /// Returns the message to its queue (its delivery count raised).
    async fn requeue(&self) -> Result<(), BrokerError>;
}

/// A message handed to a consumer (or taken by [`Broker::get`]), to be
/// settled once through its [`Acker`].
pub struct Delivery {
    /// The message body.
    pub body: Vec<u8>,
    /// Its headers, with `x-delivery-count` on a redelivery.
    pub headers: Headers,
    /// Message id, as published.
    pub message_id: String,
    /// This handle's number for it (for logs).
    pub tag: u64,
    /// Whether the broker delivered it before (AMQP's `redelivered` flag).
    redelivered: bool,
    acker: Arc<dyn Acker>,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("message_id", &self.message_id)
            .field("tag", &self.tag)
            .field("bytes", &self.body.len())
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// A delivery settled through `acker` (for implementations).
    pub fn new(
        body: Vec<u8>,
        headers: Headers,
        message_id: String,
        tag: u64,
        acker: Arc<dyn Acker>,
    ) -> Self {
        Self {
            body,
            headers,
            message_id,
            tag,
            redelivered: false,
            acker,
        }
    }
    /// The same delivery, flagged as delivered before (or not).
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }
    /// Whether the broker delivered the message before: its `redelivered`
    /// flag, or a delivery count above 0. A message that is not may still
    /// be a copy published anew (a retry, a hand-back, a supervisor copy).
    pub fn is_redelivery(&self) -> bool {
        self.redelivered || self.delivery_count() > 0
    }
    /// Acknowledges it.
    pub async fn ack(&self) -> Result<(), BrokerError> {
        self.acker.ack().await
    }
    /// Returns it to its queue.
    pub async fn requeue(&self) -> Result<(), BrokerError> {
        self.acker.requeue().await
    }
    /// Its acker, to settle it from elsewhere (a drop guard).
    pub fn acker(&self) -> Arc<dyn Acker> {
        self.acker.clone()
    }
    /// How often it was returned before this delivery.
    pub fn delivery_count(&self) -> i64 {
        self.headers.int(DELIVERY_COUNT_HEADER).unwrap_or(0)
    }
}

/// A job's start or end, as announced on its pool's notice exchange.
///
/// A start carries the job id and its weight among the pool's active jobs,
/// as the coordinator listed it: the body is `<job> <weight>`; a body with
/// no weight (a coordinator of an earlier version sends the id alone)
/// decodes with none, and a worker then reads the pool's active jobs to
/// learn it.
///
/// An end (the job's summary written, or the job cancelled, and the job
/// taken off the pool's active jobs) is `<job> end <ms>`, or `<job> end
/// <ms> <signature>` where the pool's messages are signed: the signature
/// covers `end <job> <ms>`, `ms` the coordinator's clock, so a notice
/// cannot be forged nor replayed past [`END_NOTICE_VALID`]. A worker
/// that hears one lets go of the job's queue and forgets its facts at
/// once, so workers need not read the active jobs nor a job's facts
/// often to learn that it ended. A worker of an earlier version reads an
/// end notice as a start without a weight: it reads the active jobs now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The job announced.
    pub job: String,
    /// Its weight among the pool's active jobs, when a start notice says.
    pub weight: Option<u32>,
    /// An end notice: when it was sent (ms since the epoch) and its
    /// signature, where the pool's messages are signed.
    pub ended: Option<(u64, Option<String>)>,
}

/// How long an end notice counts after it was sent (clocks of coordinator
/// and worker apart included): an older one, heard again, is ignored.
pub const END_NOTICE_VALID: Duration = Duration::from_secs(600);

impl Notice {
    /// The announcement of `job`, listed with `weight`.
    pub fn new(job: &str, weight: u32) -> Self {
        Self {
            job: job.to_owned(),
            weight: Some(weight),
            ended: None,
        }
    }

    /// The end of `job`, sent at `now_ms`, signed with `key` when the
    /// pool's messages are.
    pub fn end(job: &str, now_ms: u64, key: Option<&crate::signing::SigningKey>) -> Self {
        let signature = key.map(|k| k.sign(end_payload(job, now_ms).as_bytes()));
        Self {
            job: job.to_owned(),
            weight: None,
            ended: Some((now_ms, signature)),
        }
    }

    /// Whether an end notice is to be trusted by a worker whose clock reads
    /// `now_ms` and that holds `key`: sent within [`END_NOTICE_VALID`] (and
    /// not from further ahead than that), and signed by `key` when there is
    /// one. A start notice is a hint that needs no trust (`true`).
    pub fn trusted(&self, now_ms: u64, key: Option<&crate::signing::SigningKey>) -> bool {
        let Some((at, signature)) = &self.ended else {
            return true;
        };
        let valid = END_NOTICE_VALID.as_millis() as u64;
        if now_ms.abs_diff(*at) > valid {
            return false;
        }
        match (key, signature) {
            (None, _) => true,
            (Some(k), Some(sig)) => k.verify(end_payload(&self.job, *at).as_bytes(), sig),
            (Some(_), None) => false,
        }
    }

    /// The message body.
    pub fn encode(&self) -> String {
        match (&self.ended, self.weight) {
            (Some((at, Some(sig))), _) => format!("{} end {at} {sig}", self.job),
            (Some((at, None)), _) => format!("{} end {at}", self.job),
            (None, Some(w)) => format!("{} {w}", self.job),
            (None, None) => self.job.clone(),
        }
    }

    /// What a body says (never an error: a notice is a hint, and a body
    /// that is neither `<job> <weight>` nor an end notice is taken as a job
    /// id alone).
    pub fn decode(body: &[u8]) -> Self {
        let body = String::from_utf8_lossy(body);
        let words: Vec<&str> = body.split(' ').collect();
        if let [job, "end", at, rest @ ..] = words.as_slice() {
            if let (false, Ok(at), 0 | 1) = (job.is_empty(), at.parse::<u64>(), rest.len()) {
                return Self {
                    job: (*job).to_owned(),
                    weight: None,
                    ended: Some((at, rest.first().map(|s| (*s).to_owned()))),
                };
            }
        }
        if let Some((job, weight)) = body.rsplit_once(' ') {
            if let (false, Ok(w)) = (job.is_empty(), weight.parse::<u32>()) {
                return Self::new(job, w);
            }
        }
        Self {
            job: body.into_owned(),
            weight: None,
            ended: None,
        }
    }
}

/// What an end notice's signature covers.
fn end_payload(job: &str, at_ms: u64) -> String {
    format!("end {job} {at_ms}")
}

/// The jobs announced on a pool's notice exchange, as they are announced.
/// A notice is a hint that a job's queue has work: it carries no
/// instruction, and one lost (a worker reconnecting) is made up by the
/// workers' next look at the pool's active jobs.
#[async_trait::async_trait]
pub trait Notices: Send {
    /// The next notice; `None` when the broker ended the subscription;
    /// `Err` when the connection is lost. Cancel-safe.
    async fn next(&mut self) -> Option<Result<Notice, BrokerError>>;
}

/// Deliveries from one queue, at most `prefetch` unsettled at a time.
#[async_trait::async_trait]
pub trait Subscription: Send {
    /// The next delivery; `None` once cancelled (after what was sent
    /// already) or when the broker ends it; `Err` when the connection is lost.
    /// Cancel-safe: dropping the future loses nothing.
    async fn next(&mut self) -> Option<Result<Delivery, BrokerError>>;
    /// Stops new deliveries; unsettled ones stay with their holders.
    async fn cancel(&mut self);
}

/// One handle on a broker: a RabbitMQ connection, or a client of the
/// in-process queues. Deliveries taken through it and never settled return
/// to their queues when it closes.
#[async_trait::async_trait]
pub trait Broker: Send + Sync + fmt::Debug {
    /// Where the queues live, for messages.
    fn describe(&self) -> String;
    /// Declares the pool's queues (idempotent).
    async fn declare(&self, queues: &PoolQueues) -> Result<(), BrokerError>;
    /// Announces that a job of the pool started (or runs again) on the
    /// pool's notice exchange; workers listening hear it at once. Nobody
    /// listening is not an error.
    async fn announce(&self, queues: &PoolQueues, notice: &Notice) -> Result<(), BrokerError>;
    /// Listens to the pool's notice exchange (see [`Notices`]).
    async fn notices(&self, queues: &PoolQueues) -> Result<Box<dyn Notices>, BrokerError>;
    /// Deletes a pool's queues (and its notice exchange), each tried
    /// whatever the others did: tests and tools cleaning up after a pool of
    /// their own. The first failure.
    async fn delete_pool(&self, queues: &PoolQueues) -> Result<(), BrokerError> {
        delete_queues(self, queues).await.map_or(Ok(()), Err)
    }
    /// Declares the queue of job `job` of the pool ([`PoolQueues::job`]),
    /// with the work queue's delivery limit and dead-lettering (idempotent).
    async fn declare_job(&self, queues: &PoolQueues, job: &str) -> Result<(), BrokerError>;
    /// Publishes `messages` to `queue`, keeping at most `window` unconfirmed
    /// at a time; returns how many were confirmed once all are. A message
    /// the broker refuses or cannot route is an error naming it.
    async fn publish(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
        window: usize,
    ) -> Result<u64, BrokerError>;
    /// Starts consuming `queue`, at most `prefetch` unsettled deliveries.
    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Box<dyn Subscription>, BrokerError>;
    /// Takes one ready message without settling it; `None` when there is
    /// none. The queue must exist (see [`Broker::ready_count`]).
    async fn get(&self, queue: &str) -> Result<Option<Delivery>, BrokerError>;
    /// Drops every ready message of `queue`; how many.
    async fn purge(&self, queue: &str) -> Result<u32, BrokerError>;
    /// Deletes `queue` with its messages (tests and tools cleaning up a
    /// pool). By default only its ready messages are dropped.
    async fn delete(&self, queue: &str) -> Result<(), BrokerError> {
        self.purge(queue).await.map(drop)
    }
    /// Messages ready in `queue` (not counting unsettled ones); `None` when
    /// there is no such queue.
    async fn ready_count(&self, queue: &str) -> Result<Option<u32>, BrokerError>;
    /// Consumers attached to `queue` (from every handle); `None` when there
    /// is no such queue.
    async fn consumer_count(&self, queue: &str) -> Result<Option<u32>, BrokerError>;
    /// Whether the handle can still be used.
    fn is_open(&self) -> bool;
    /// Closes the handle; unsettled deliveries return to their queues.
    async fn close(&self, why: &str);
}

/// Deletes every queue of a pool, each tried whatever the others did; the
/// first failure (what [`Broker::delete_pool`] does before a backend's own
/// extras).
pub(crate) async fn delete_queues<B: Broker + ?Sized>(
    broker: &B,
    queues: &PoolQueues,
) -> Option<BrokerError> {
    let mut first = None;
    for queue in queues.all() {
        if let Err(e) = broker.delete(&queue).await {
            first.get_or_insert(e);
        }
    }
    first
}

/// Connects to RabbitMQ at `endpoint` (see [`amqp::AmqpBroker::connect`]).
pub async fn connect(
    endpoint: &crate::endpoint::Endpoint,
    connection_name: &str,
    timeout: Duration,
) -> Result<Arc<dyn Broker>, BrokerError> {
    Ok(Arc::new(
        amqp::AmqpBroker::connect(endpoint, connection_name, timeout).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_says_its_job_and_weight_and_a_bare_id_says_no_weight() {
        let n = Notice::new("scores-ab12", 4);
        assert_eq!(n.encode(), "scores-ab12 4");
        assert_eq!(Notice::decode(n.encode().as_bytes()), n);
        // What a coordinator of an earlier version sends, and bodies that
        // are not `<job> <weight>`: a job id alone.
        for body in ["scores-ab12", "scores-ab12 x", " 4", "a b c"] {
            let d = Notice::decode(body.as_bytes());
            assert_eq!((d.job.as_str(), d.weight), (body, None), "{body:?}");
        }
    }

    #[test]
    fn an_end_notice_is_trusted_only_fresh_and_under_the_pools_key() {
        use crate::signing::SigningKey;
        let key = SigningKey::new(b"0123456789abcdef-end", "test").expect("key");
        let other = SigningKey::new(b"fedcba9876543210-end", "test").expect("key");
        let now = 1_800_000_000_000u64;
        let signed = Notice::end("scores-ab12", now, Some(&key));
        let body = signed.encode();
        assert!(
            body.starts_with(&format!("scores-ab12 end {now} ")),
            "{body}"
        );
        let heard = Notice::decode(body.as_bytes());
        assert_eq!(heard, signed);
        assert_eq!(heard.weight, None);
        assert!(heard.trusted(now + 1_000, Some(&key)));
        assert!(!heard.trusted(now, Some(&other)), "another key");
        let late = now + END_NOTICE_VALID.as_millis() as u64 + 1;
        assert!(!heard.trusted(late, Some(&key)), "replayed too late");
        assert!(!heard.trusted(now - END_NOTICE_VALID.as_millis() as u64 - 1, Some(&key)));
        // Another job, or another moment, under the same signature.
        let sig = signed
            .ended
            .as_ref()
            .and_then(|(_, s)| s.clone())
            .expect("signed");
        for forged in [
            format!("scores-ff00 end {now} {sig}"),
            format!("scores-ab12 end {} {sig}", now + 1),
        ] {
            assert!(
                !Notice::decode(forged.as_bytes()).trusted(now, Some(&key)),
                "{forged}"
            );
        }
        // Unsigned: trusted only where the pool's messages are not signed.
        let bare = Notice::decode(Notice::end("scores-ab12", now, None).encode().as_bytes());
        assert_eq!(bare.ended, Some((now, None)));
        assert!(bare.trusted(now, None));
        assert!(!bare.trusted(now, Some(&key)));
        // A start needs no trust; what is not an end notice is not one.
        assert!(Notice::new("scores-ab12", 2).trusted(0, Some(&key)));
        for body in [
            "scores-ab12 end",
            "scores-ab12 end x",
            "scores-ab12 end 5 s x",
        ] {
            assert_eq!(Notice::decode(body.as_bytes()).ended, None, "{body:?}");
        }
    }

    #[test]
    fn the_settling_headers_count_only_under_their_seal() {
        use crate::message::{ATTEMPT_HEADER, UNKNOWN_SINCE_HEADER};
        use crate::signing::{SigningKey, SIGNATURE_HEADER};
        let key = SigningKey::new(b"0123456789abcdef-seal", "test").expect("key");
        let other = SigningKey::new(b"fedcba9876543210-seal", "test").expect("key");
        let mut h = Headers::of(
            [(SIGNATURE_HEADER, key.sign(b"body"))],
            [(ATTEMPT_HEADER, 2)],
        );
        // Without a key nothing is checked; with one, nothing unsealed counts.
        assert!(h.settling_trusted(None));
        assert!(!h.settling_trusted(Some(&key)));
        h.seal_settling(Some(&key));
        assert!(h.settling_trusted(Some(&key)));
        assert!(!h.settling_trusted(Some(&other)), "another key's seal");
        // Any settling header changed after the seal, or the seal moved to
        // another body, breaks it.
        for change in [
            (ATTEMPT_HEADER, HeaderValue::Int(3)),
            (UNKNOWN_SINCE_HEADER, HeaderValue::Int(1)),
            (SIGNATURE_HEADER, HeaderValue::Str(key.sign(b"other body"))),
        ] {
            let mut t = h.clone();
            t.insert(change.0, change.1);
            assert!(!t.settling_trusted(Some(&key)), "{}", change.0);
        }
        // Other headers are free, and a message with no settling header
        // needs no seal.
        let mut t = h.clone();
        t.insert("x-bf-copy", HeaderValue::Int(1));
        assert!(t.settling_trusted(Some(&key)));
        assert!(Headers::default().settling_trusted(Some(&key)));
        // No key, no seal written.
        let mut plain = Headers::of([], [(ATTEMPT_HEADER, 1)]);
        plain.seal_settling(None);
        assert!(plain.str(crate::message::SETTLE_HEADER).is_none());
    }

    #[test]
    fn a_delay_goes_to_the_smallest_tier_that_holds_it() {
        let q = PoolQueues::new("gpu");
        assert_eq!(q.work(), "bf.gpu.work");
        assert_eq!(q.retry_for(800), "bf.gpu.retry.1s");
        assert_eq!(q.retry_for(1_001), "bf.gpu.retry.5s");
        assert_eq!(q.retry_for(99_000_000), "bf.gpu.retry.3600s");
    }

    #[test]
    fn own_headers_drop_what_the_broker_adds() {
        let h = Headers::of(
            [("x-death", "x".into()), ("a", "b".into())],
            [(DELIVERY_COUNT_HEADER, 3)],
        );
        assert_eq!(h.int(DELIVERY_COUNT_HEADER), Some(3));
        assert_eq!(h.str("a"), Some("b"));
        assert_eq!(h.int("a"), None);
        let own = h.own();
        assert_eq!(own.int(DELIVERY_COUNT_HEADER), None);
        assert_eq!(own.str("x-death"), None);
        assert_eq!(own.str("a"), Some("b"));
    }
}
