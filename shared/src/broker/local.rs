//! The in-process implementation of [`Broker`] (`batchfleet run --local`).
//!
//! # Design
//! One hub, [`LocalQueues`], holds every queue behind a single
//! `std::sync::Mutex` (never held across an `.await`); each
//! [`LocalQueues::handle`] is one client of it, the in-process counterpart
//! of a RabbitMQ connection. A coordinator and any number of in-process
//! workers each take their own handle and share the queues.
//!
//! - A queue is a `VecDeque` of ready messages and a [`Notify`] that is
//!   woken (`notify_waiters`) whenever something could let a waiting
//!   consumer go on: a message became ready, a delivery taken from the queue
//!   through a subscription was settled, or a handle closed.
//! - [`PoolQueues`] topology as on RabbitMQ: the work queue dead-letters a
//!   message returned more than [`DELIVERY_LIMIT`] times, a copy each to
//!   `bf.P.dead` and `bf.P.infra` (the DLX fan-out); a retry tier moves a
//!   message to the end of `bf.P.work` when its per-message expiration
//!   passes. Each expiring message has its own timer task (`tokio::spawn`,
//!   holding only a weak reference to the hub), so the move happens even if
//!   nobody calls into the hub; until then the message is ready in its retry
//!   queue (`ready_count`, `get` and `purge` see it). Expiration on any other
//!   queue is ignored.
//! - A pool's announcements ([`Broker::announce`]) go to every listener of
//!   the pool ([`Broker::notices`]), each through a bounded channel of its
//!   own; one that finds its channel full is dropped (a listener also reads
//!   the pool's active jobs now and then), as RabbitMQ would not keep it for
//!   a worker that was not listening either.
//! - A delivery (from a subscription or [`Broker::get`]) is unsettled until
//!   its [`Acker`] acks or returns it. Unsettled deliveries are kept in the
//!   hub by (handle, tag): closing the handle returns all of them, and an
//!   acker dropped unsettled returns its message (requeue semantics: to the
//!   front of its queue, delivery count raised, dead-lettered past the limit).
//! - Each live subscription is registered in the hub by queue (for
//!   [`Broker::consumer_count`]) until it is cancelled, dropped or its
//!   handle closes. [`Broker::delete`] removes a queue with its ready
//!   messages and ends its subscriptions, as RabbitMQ cancels a deleted
//!   queue's consumers; deliveries taken from it are dropped when settled.
//! - Publishing stores each message synchronously: it is "confirmed" once
//!   `publish` returns. A message to an undeclared queue is an error naming
//!   the queue, and the messages before it in the same call stay published.

use super::{
    Acker, Broker, BrokerError, Delivery, HeaderValue, Headers, Notice, Notices, Outgoing,
    PoolQueues, Subscription, DELIVERY_COUNT_HEADER, DELIVERY_LIMIT, RETRY_TIERS_S,
};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Announcements a listener may hold unread before more are dropped.
const NOTICES_HELD: usize = 64;

/// A listener to a pool's announcements.
struct LocalNotices {
    rx: tokio::sync::mpsc::Receiver<Notice>,
}

#[async_trait::async_trait]
impl Notices for LocalNotices {
    async fn next(&mut self) -> Option<Result<Notice, BrokerError>> {
        self.rx.recv().await.map(Ok)
    }
}

/// The in-process queues, shared by every handle taken from them.
///
/// Cloning shares the same queues; each [`LocalQueues::handle`] is an
/// independent client (closing one returns only what it took).
#[derive(Clone, Default)]
pub struct LocalQueues {
    hub: Arc<Hub>,
}

impl fmt::Debug for LocalQueues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.hub.lock();
        f.debug_struct("LocalQueues")
            .field("queues", &state.queues.len())
            .field("unsettled", &state.unsettled.len())
            .finish()
    }
}

impl LocalQueues {
    /// Empty queues (none declared).
    pub fn new() -> Self {
        Self::default()
    }

    /// A new client of these queues: its own delivery tags, its own
    /// unsettled deliveries (returned when it closes).
    pub fn handle(&self) -> Arc<dyn Broker> {
        let id = self.hub.next_handle.fetch_add(1, Ordering::Relaxed);
        Arc::new(LocalBroker {
            hub: self.hub.clone(),
            me: Arc::new(HandleInner {
                id,
                open: AtomicBool::new(true),
                next_tag: AtomicU64::new(1),
            }),
        })
    }
}

#[derive(Default)]
struct Hub {
    state: Mutex<State>,
    next_handle: AtomicU64,
}

impl Hub {
    /// The state; a panic elsewhere while holding the lock leaves the queues
    /// consistent enough (every change is a single push or pop), so a
    /// poisoned lock is used as is rather than taking every handle down.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
struct State {
    queues: HashMap<String, Queue>,
    /// Deliveries taken and not yet settled, by (handle id, tag).
    unsettled: HashMap<(u64, u64), Unsettled>,
    /// Unsettled deliveries per subscription (for its prefetch bound).
    in_flight: HashMap<u64, usize>,
    /// Live subscriptions: id → (handle id, queue).
    consumers: HashMap<u64, (u64, String)>,
    /// Listeners to each pool's announcements, by pool: a bounded channel
    /// each (an announcement that finds one full is dropped: it is a hint).
    listeners: HashMap<String, Vec<tokio::sync::mpsc::Sender<Notice>>>,
    next_seq: u64,
    next_sub: u64,
}

/// What a queue does with messages beyond keeping them.
#[derive(Debug, Clone)]
enum Kind {
    /// Plain queue (dead, infra).
    Plain,
    /// A work queue: dead-letters past [`DELIVERY_LIMIT`] returns.
    Work(PoolQueues),
    /// A retry tier: expired messages go to this work queue.
    Retry { work: String },
}

struct Queue {
    kind: Kind,
    ready: VecDeque<Msg>,
    notify: Arc<Notify>,
}

impl Queue {
    fn new(kind: Kind) -> Self {
        Self {
            kind,
            ready: VecDeque::new(),
            notify: Arc::new(Notify::new()),
        }
    }
}

struct Msg {
    /// Hub-wide number, to find the message again when its timer fires.
    seq: u64,
    body: Vec<u8>,
    headers: Headers,
    message_id: String,
    /// How often it was returned to this queue.
    delivery_count: i64,
    /// When it leaves its retry queue for the work queue.
    expires_at: Option<Instant>,
}

struct Unsettled {
    queue: String,
    msg: Msg,
    /// The subscription that delivered it (`None` for a `get`).
    sub: Option<u64>,
}

/// A timer due: (retry queue, message seq, when).
type Expiry = (String, u64, Instant);

impl State {
    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Appends `msg` to `queue` (which exists) and wakes its consumers.
    fn push_back(&mut self, queue: &str, msg: Msg) {
        if let Some(q) = self.queues.get_mut(queue) {
            q.ready.push_back(msg);
            q.notify.notify_waiters();
        }
    }

    fn notify(&self, queue: &str) {
        if let Some(q) = self.queues.get(queue) {
            q.notify.notify_waiters();
        }
    }

    /// Removes a settled delivery's trace from its subscription's count,
    /// waking the queue's consumers (a prefetch slot is free).
    fn release(&mut self, u: &Unsettled) {
        if let Some(sub) = u.sub {
            if let Some(n) = self.in_flight.get_mut(&sub) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.in_flight.remove(&sub);
                }
            }
            self.notify(&u.queue);
        }
    }

    /// Returns a delivered message to its queue: to the front, its delivery
    /// count raised; past [`DELIVERY_LIMIT`] on a work queue, a copy each to
    /// the pool's dead and infra queues instead; an expired message of a
    /// retry tier straight to the work queue.
    fn give_back(&mut self, queue: &str, mut msg: Msg, now: Instant) {
        msg.delivery_count += 1;
        let Some(kind) = self.queues.get(queue).map(|q| q.kind.clone()) else {
            return;
        };
        match kind {
            Kind::Work(pool) if msg.delivery_count > DELIVERY_LIMIT => {
                let mut headers = msg.headers;
                headers.insert(DELIVERY_COUNT_HEADER, HeaderValue::Int(msg.delivery_count));
                for target in [pool.dead(), pool.infra()] {
                    let copy = Msg {
                        seq: self.seq(),
                        body: msg.body.clone(),
                        headers: headers.clone(),
                        message_id: msg.message_id.clone(),
                        delivery_count: 0,
                        expires_at: None,
                    };
                    self.push_back(&target, copy);
                }
            }
            Kind::Retry { work } if msg.expires_at.is_some_and(|at| at <= now) => {
                // Its timer found it taken; it goes on now. (One not yet
                // expired is still awaited by its timer.)
                self.move_to_work(&work, msg);
            }
            _ => {
                if let Some(q) = self.queues.get_mut(queue) {
                    q.ready.push_front(msg);
                    q.notify.notify_waiters();
                }
            }
        }
    }

    /// An expired retry message as a new message at the end of `work`.
    fn move_to_work(&mut self, work: &str, mut msg: Msg) {
        msg.delivery_count = 0;
        msg.expires_at = None;
        self.push_back(work, msg);
    }

    /// A timer fired: moves message `seq` from retry queue `queue` to its
    /// work queue, if it is still ready there (not purged nor taken).
    fn expire(&mut self, queue: &str, seq: u64) {
        let work = match self.queues.get(queue).map(|q| &q.kind) {
            Some(Kind::Retry { work }) if self.queues.contains_key(work) => work.clone(),
            _ => return,
        };
        let msg = self.queues.get_mut(queue).and_then(|q| {
            let pos = q.ready.iter().position(|m| m.seq == seq)?;
            q.ready.remove(pos)
        });
        if let Some(msg) = msg {
            self.move_to_work(&work, msg);
        }
    }

    /// Takes the front message of `queue` as an unsettled delivery of
    /// handle `handle`.
    fn take(
        &mut self,
        hub: &Arc<Hub>,
        handle: &HandleInner,
        queue: &str,
        sub: Option<u64>,
    ) -> Option<Delivery> {
        let msg = self.queues.get_mut(queue)?.ready.pop_front()?;
        let tag = handle.next_tag.fetch_add(1, Ordering::Relaxed);
        let mut headers = msg.headers.clone();
        if msg.delivery_count > 0 {
            headers.insert(DELIVERY_COUNT_HEADER, HeaderValue::Int(msg.delivery_count));
        }
        let body = msg.body.clone();
        let message_id = msg.message_id.clone();
        let redelivered = msg.delivery_count > 0;
        if let Some(sub) = sub {
            *self.in_flight.entry(sub).or_default() += 1;
        }
        self.unsettled.insert(
            (handle.id, tag),
            Unsettled {
                queue: queue.to_owned(),
                msg,
                sub,
            },
        );
        let acker = LocalAcker {
            hub: hub.clone(),
            key: (handle.id, tag),
            settled: AtomicBool::new(false),
        };
        Some(
            Delivery::new(body, headers, message_id, tag, Arc::new(acker)).redelivered(redelivered),
        )
    }
}

/// Starts the timer that moves a retry message on when it expires. On a
/// tokio runtime a task; elsewhere (a return from a drop outside one) a
/// thread.
fn start_timer(hub: &Arc<Hub>, (queue, seq, at): Expiry) {
    let weak: Weak<Hub> = Arc::downgrade(hub);
    let fire = move || {
        if let Some(hub) = weak.upgrade() {
            hub.lock().expire(&queue, seq);
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(async move {
                tokio::time::sleep_until(at).await;
                fire();
            });
        }
        Err(_) => {
            let wait = at.saturating_duration_since(Instant::now());
            std::thread::spawn(move || {
                std::thread::sleep(wait);
                fire();
            });
        }
    }
}

struct HandleInner {
    id: u64,
    /// Written only under the hub's lock (read anywhere).
    open: AtomicBool,
    next_tag: AtomicU64,
}

/// One client of [`LocalQueues`].
struct LocalBroker {
    hub: Arc<Hub>,
    me: Arc<HandleInner>,
}

impl fmt::Debug for LocalBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBroker")
            .field("handle", &self.me.id)
            .field("open", &self.me.open.load(Ordering::Relaxed))
            .finish()
    }
}

fn closed() -> BrokerError {
    BrokerError::Closed("the in-process broker handle was closed".into())
}

impl LocalBroker {
    /// The state, or `Closed` once this handle is.
    fn state(&self) -> Result<MutexGuard<'_, State>, BrokerError> {
        let state = self.hub.lock();
        if self.me.open.load(Ordering::Acquire) {
            Ok(state)
        } else {
            Err(closed())
        }
    }
}

#[async_trait::async_trait]
impl Broker for LocalBroker {
    fn describe(&self) -> String {
        "in-process queues".into()
    }

    async fn declare(&self, queues: &PoolQueues) -> Result<(), BrokerError> {
        let mut state = self.state()?;
        let mut add = |name: String, kind: Kind| {
            state.queues.entry(name).or_insert_with(|| Queue::new(kind));
        };
        add(queues.dead(), Kind::Plain);
        add(queues.infra(), Kind::Plain);
        add(queues.work(), Kind::Work(queues.clone()));
        for tier in RETRY_TIERS_S {
            add(
                queues.retry(tier),
                Kind::Retry {
                    work: queues.work(),
                },
            );
        }
        Ok(())
    }

    async fn announce(&self, queues: &PoolQueues, notice: &Notice) -> Result<(), BrokerError> {
        let mut state = self.state()?;
        if let Some(listeners) = state.listeners.get_mut(&queues.pool) {
            listeners.retain(|l| !l.is_closed());
            for l in listeners.iter() {
                let _ = l.try_send(notice.clone());
            }
        }
        Ok(())
    }

    async fn notices(&self, queues: &PoolQueues) -> Result<Box<dyn Notices>, BrokerError> {
        let mut state = self.state()?;
        let (tx, rx) = tokio::sync::mpsc::channel(NOTICES_HELD);
        state
            .listeners
            .entry(queues.pool.clone())
            .or_default()
            .push(tx);
        Ok(Box::new(LocalNotices { rx }))
    }

    async fn declare_job(&self, queues: &PoolQueues, job: &str) -> Result<(), BrokerError> {
        let mut state = self.state()?;
        state
            .queues
            .entry(queues.job(job))
            .or_insert_with(|| Queue::new(Kind::Work(queues.clone())));
        Ok(())
    }

    /// Stores each message at once (in order); `window` has nothing to
    /// bound here.
    async fn publish(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
        _window: usize,
    ) -> Result<u64, BrokerError> {
        let mut timers = Vec::new();
        let result = {
            let mut state = self.state()?;
            let now = Instant::now();
            let mut stored = 0u64;
            let mut result = Ok(());
            for m in messages {
                let Some(q) = state.queues.get(queue) else {
                    result = Err(BrokerError::NotConfirmed {
                        message_id: m.message_id,
                        reason: format!("no queue {queue} (unroutable)"),
                    });
                    break;
                };
                let expires_at = match (&q.kind, m.expiration_ms) {
                    (Kind::Retry { .. }, Some(ms)) => {
                        Some(now + std::time::Duration::from_millis(ms))
                    }
                    _ => None,
                };
                let seq = state.seq();
                if let Some(at) = expires_at {
                    timers.push((queue.to_owned(), seq, at));
                }
                state.push_back(
                    queue,
                    Msg {
                        seq,
                        body: m.body,
                        headers: m.headers,
                        message_id: m.message_id,
                        delivery_count: 0,
                        expires_at,
                    },
                );
                stored += 1;
            }
            result.map(|()| stored)
        };
        // Timers start after the lock is released (stored messages, even
        // those before an error, expire as published).
        for t in timers {
            start_timer(&self.hub, t);
        }
        result
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        let mut state = self.state()?;
        let Some(q) = state.queues.get(queue) else {
            return Err(BrokerError::Op {
                op: format!("consume {queue}"),
                reason: format!("no queue {queue} in the in-process broker"),
            });
        };
        let notify = q.notify.clone();
        state.next_sub += 1;
        let id = state.next_sub;
        state.consumers.insert(id, (self.me.id, queue.to_owned()));
        Ok(Box::new(LocalSubscription {
            hub: self.hub.clone(),
            handle: self.me.clone(),
            queue: queue.to_owned(),
            notify,
            id,
            prefetch: usize::from(prefetch),
            cancelled: false,
        }))
    }

    async fn get(&self, queue: &str) -> Result<Option<Delivery>, BrokerError> {
        let mut state = self.state()?;
        Ok(state.take(&self.hub, &self.me, queue, None))
    }

    async fn purge(&self, queue: &str) -> Result<u32, BrokerError> {
        let mut state = self.state()?;
        Ok(state.queues.get_mut(queue).map_or(0, |q| {
            let n = q.ready.len();
            q.ready.clear();
            u32::try_from(n).unwrap_or(u32::MAX)
        }))
    }

    async fn ready_count(&self, queue: &str) -> Result<Option<u32>, BrokerError> {
        let state = self.state()?;
        Ok(state
            .queues
            .get(queue)
            .map(|q| u32::try_from(q.ready.len()).unwrap_or(u32::MAX)))
    }

    async fn consumer_count(&self, queue: &str) -> Result<Option<u32>, BrokerError> {
        let state = self.state()?;
        if !state.queues.contains_key(queue) {
            return Ok(None);
        }
        let n = state.consumers.values().filter(|(_, q)| q == queue).count();
        Ok(Some(u32::try_from(n).unwrap_or(u32::MAX)))
    }

    /// Removes `queue` and its ready messages; its subscriptions end, a
    /// publish to it is unroutable, and a delivery taken from it is dropped
    /// when settled. Deleting a queue that does not exist does nothing.
    async fn delete(&self, queue: &str) -> Result<(), BrokerError> {
        let mut state = self.state()?;
        if let Some(q) = state.queues.remove(queue) {
            state.consumers.retain(|_, (_, name)| name != queue);
            q.notify.notify_waiters();
        }
        Ok(())
    }

    fn is_open(&self) -> bool {
        self.me.open.load(Ordering::Acquire)
    }

    /// Returns every delivery this handle took and did not settle (in the
    /// order they were taken, at the front of their queues) and ends its
    /// subscriptions. Closing again does nothing.
    async fn close(&self, why: &str) {
        let mut state = self.hub.lock();
        if !self.me.open.swap(false, Ordering::AcqRel) {
            return;
        }
        tracing::debug!(handle = self.me.id, why, "in-process broker handle closed");
        let me = self.me.id;
        state.consumers.retain(|_, (handle, _)| *handle != me);
        let mut mine: Vec<u64> = state
            .unsettled
            .keys()
            .filter(|(h, _)| *h == self.me.id)
            .map(|(_, tag)| *tag)
            .collect();
        // Last taken first: each goes to the front, so they end up in order.
        mine.sort_unstable_by(|a, b| b.cmp(a));
        let now = Instant::now();
        for tag in mine {
            if let Some(u) = state.unsettled.remove(&(self.me.id, tag)) {
                state.release(&u);
                state.give_back(&u.queue, u.msg, now);
            }
        }
        // Its subscriptions, waiting on any queue, see the handle closed.
        for q in state.queues.values() {
            q.notify.notify_waiters();
        }
    }
}

/// Settles one delivery; returns it when dropped unsettled.
struct LocalAcker {
    hub: Arc<Hub>,
    key: (u64, u64),
    settled: AtomicBool,
}

impl LocalAcker {
    /// Settles once: `requeue` returns the message, else it is gone. A second
    /// settlement does nothing; one after the handle closed (which returned
    /// the message already) is an error.
    fn settle(&self, requeue: bool) -> Result<(), BrokerError> {
        if self.settled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let mut state = self.hub.lock();
        let Some(u) = state.unsettled.remove(&self.key) else {
            return Err(closed());
        };
        state.release(&u);
        if requeue {
            state.give_back(&u.queue, u.msg, Instant::now());
        }
        Ok(())
    }
}

impl Drop for LocalAcker {
    fn drop(&mut self) {
        // Unsettled: back to its queue, as when a RabbitMQ channel closes.
        let _ = self.settle(true);
    }
}

#[async_trait::async_trait]
impl Acker for LocalAcker {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.settle(false)
    }
    async fn requeue(&self) -> Result<(), BrokerError> {
        self.settle(true)
    }
}

/// Deliveries from one in-process queue.
struct LocalSubscription {
    hub: Arc<Hub>,
    handle: Arc<HandleInner>,
    queue: String,
    notify: Arc<Notify>,
    id: u64,
    /// Most unsettled deliveries at a time; 0 for no bound (as in AMQP).
    prefetch: usize,
    cancelled: bool,
}

#[async_trait::async_trait]
impl Subscription for LocalSubscription {
    /// Waits for a ready message and a free prefetch slot, then takes the
    /// message without awaiting anything after: dropping the future before
    /// it resolves takes nothing.
    async fn next(&mut self) -> Option<Result<Delivery, BrokerError>> {
        loop {
            // Registered before the check, so a wake-up between the check
            // and the await is not missed.
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.hub.lock();
                // The queue deleted (even if declared again since): ended.
                let same_queue = state
                    .queues
                    .get(&self.queue)
                    .is_some_and(|q| Arc::ptr_eq(&q.notify, &self.notify));
                if self.cancelled || !self.handle.open.load(Ordering::Acquire) || !same_queue {
                    state.consumers.remove(&self.id);
                    return None;
                }
                let used = state.in_flight.get(&self.id).copied().unwrap_or(0);
                if self.prefetch == 0 || used < self.prefetch {
                    if let Some(d) = state.take(&self.hub, &self.handle, &self.queue, Some(self.id))
                    {
                        return Some(Ok(d));
                    }
                }
            }
            notified.await;
        }
    }

    async fn cancel(&mut self) {
        self.cancelled = true;
        self.hub.lock().consumers.remove(&self.id);
    }
}

impl Drop for LocalSubscription {
    fn drop(&mut self) {
        self.hub.lock().consumers.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(id: &str) -> Outgoing {
        Outgoing {
            message_id: id.into(),
            kind: "test",
            body: id.as_bytes().to_vec(),
            headers: Headers::default(),
            expiration_ms: None,
        }
    }

    #[tokio::test]
    async fn close_returns_unsettled_deliveries_in_their_order() {
        let hub = LocalQueues::new();
        let b = hub.handle();
        let q = PoolQueues::new("unit");
        b.declare(&q).await.expect("declare");
        b.publish(&q.work(), vec![msg("a"), msg("b"), msg("c")], 8)
            .await
            .expect("publish");
        let a = b.get(&q.work()).await.expect("get").expect("a");
        let bb = b.get(&q.work()).await.expect("get").expect("b");
        assert_eq!((a.tag, bb.tag), (1, 2));
        b.close("test").await;
        {
            let state = hub.hub.lock();
            let order: Vec<(&str, i64)> = state.queues[&q.work()]
                .ready
                .iter()
                .map(|m| (m.message_id.as_str(), m.delivery_count))
                .collect();
            assert_eq!(order, [("a", 1), ("b", 1), ("c", 0)]);
            assert!(state.unsettled.is_empty());
        }
        // Settling after the close is an error, and a second one a no-op.
        assert!(matches!(a.ack().await, Err(BrokerError::Closed(_))));
        assert!(a.ack().await.is_ok());
    }

    #[tokio::test]
    async fn an_expired_retry_message_taken_and_returned_goes_to_work() {
        let hub = LocalQueues::new();
        let b = hub.handle();
        let q = PoolQueues::new("unit");
        b.declare(&q).await.expect("declare");
        let retry = q.retry(1);
        b.publish(&retry, vec![msg("r")], 1).await.expect("publish");
        let d = b.get(&retry).await.expect("get").expect("r");
        // Expire it while it is taken: its timer finds nothing to move.
        {
            let mut state = hub.hub.lock();
            let u = state.unsettled.values_mut().next().expect("unsettled");
            u.msg.expires_at = Some(Instant::now());
        }
        d.requeue().await.expect("requeue");
        assert_eq!(b.ready_count(&retry).await.expect("count"), Some(0));
        assert_eq!(b.ready_count(&q.work()).await.expect("count"), Some(1));
        let w = b.get(&q.work()).await.expect("get").expect("moved");
        assert_eq!(w.delivery_count(), 0, "a new message in work");
    }
}
