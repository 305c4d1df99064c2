//! Where a worker's work comes from: the pool's work queue (items published
//! before job queues, retries coming back from the retry tiers) and the
//! queues of the pool's active jobs (`bf.<pool>.job.<id>`, listed with
//! their weights in the job store). When several have deliveries waiting,
//! the next item is taken by weighted fair queueing: each source has a
//! virtual time that advances by `1 / weight` per item taken from it, and
//! the source with the least goes next — so over any stretch in which jobs
//! have items queued, a worker's items are divided among them in
//! proportion to their weights (`[job] priority`), and a job that has been
//! idle comes back at the current virtual time rather than with credit
//! saved up.
//!
//! # Bounded fan-out
//! A worker consumes at most `--job-queues` job queues that send it work,
//! so what it holds unacknowledged is bounded by its prefetch whatever the
//! number of active jobs: at most `prefetch` from the pool's queue and
//! `prefetch + 1` from each job queue it consumes. With no more active jobs
//! than that, it consumes them all. With more, it takes them in the order
//! of weighted rendezvous hashing of (worker, job, period): each job is
//! consumed by a share of the fleet that grows with its weight, and every
//! [`ROTATE`] each worker draws again, so that over time every job gets
//! its share of every worker.
//!
//! A subscription that sent nothing for [`IDLE`] although the worker had
//! room for more is dormant: its queue is empty, the rest of its job's
//! items in flight elsewhere. It no longer counts, and the next job in the
//! ranking whose queue has work waiting takes its place. It is not
//! cancelled: its job is likely to end, and the worker lets it go when
//! the job leaves the list (its queue is deleted a grace after that, see
//! `batchfleet_shared::retire`, so neither this worker's cancel nor its
//! consume meets the deletion: RabbitMQ answers a consume on a quorum
//! queue being deleted by closing the connection, and a cancel crossing
//! the broker's gets an answer the client no longer expects). A worker
//! subscribes only to a queue it has just read non-empty (or that of a job
//! announced in the last [`FRESH`], whose queue is being filled), so that
//! it does not gather subscriptions of jobs about to end. A queue let go (a new draw) is one
//! holding a delivery in this worker, so its job cannot end meanwhile; it
//! keeps nothing: what it had sent is handed out like any delivery, never
//! returned (a return counts against the item's delivery limit).
//!
//! Every delivery the broker sent is taken from its subscription at once
//! ([`Sources::fill`]), even while the worker has no room to start it, so
//! the worker knows which jobs it holds deliveries of that wait to start
//! ([`Sources::queued`]): its beat names them, and the coordinator never
//! takes them for lost messages.

use batchfleet_shared::broker::{Broker, BrokerError, Delivery, Subscription};
use batchfleet_shared::message::JOB_HEADER;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Weight of the pool's work queue (that of a `normal` job).
const POOL_QUEUE_WEIGHT: u32 = 2;

/// Job queues a worker consumes at once by default (`--job-queues`).
pub const DEFAULT_JOB_QUEUES: usize = 4;

/// How often a worker consuming only some of the active jobs draws again
/// which ones (each worker at its own moment within the period).
pub const ROTATE: Duration = Duration::from_secs(30);

/// A consumed job queue that sent nothing for this long, while the worker
/// could have taken more of it, is taken for empty: dormant.
pub const IDLE: Duration = Duration::from_secs(1);

/// How long a job whose queue was read empty is passed over.
pub const REST: Duration = Duration::from_secs(5);

/// Queues read (a passive declare) at most per [`Sources::follow`], looking
/// for one with work waiting.
const LOOKS: usize = 4;

/// How long after its announcement a job counts as new (its queue being
/// filled, so consumed without reading it first).
const FRESH: Duration = Duration::from_secs(10);

/// The prefetch of a job queue's subscription, for a worker whose prefetch
/// in force (items in flight at once) is `prefetch`: one more, so that a
/// job whose items fill every permit still has a delivery waiting when one
/// of them settles. Without it the job whose item just finished would have
/// nothing waiting at the moment of choice (its next delivery is still on
/// the wire) and the choice would go to the other job every time: the
/// shares would be 1:1 whatever the weights.
fn job_prefetch(prefetch: u16) -> u16 {
    prefetch.saturating_add(1)
}

/// One queue a worker consumes.
struct Source {
    /// Queue name.
    queue: String,
    /// Share weight.
    weight: u32,
    /// The subscription (`None` while stopped).
    sub: Option<Box<dyn Subscription>>,
    /// Deliveries taken from the subscription and not handed out yet, each
    /// with when it came.
    buffer: VecDeque<(Delivery, Instant)>,
    /// Virtual time of the next item taken from it.
    vtime: f64,
    /// Its subscription ended (the queue was deleted: its job ended).
    ended: bool,
    /// When it last sent a delivery (or was subscribed).
    last_sent: Instant,
}

impl Source {
    fn new(queue: String, weight: u32, sub: Box<dyn Subscription>, vtime: f64) -> Self {
        Self {
            queue,
            weight: weight.max(1),
            sub: Some(sub),
            buffer: VecDeque::new(),
            vtime,
            ended: false,
            last_sent: Instant::now(),
        }
    }

    /// Whether it holds a delivery or sent one within [`IDLE`]: a queue
    /// that sends work. One that does not is dormant: its queue is empty,
    /// as the broker would send more otherwise (the worker never has all
    /// of a queue's prefetch in flight). A dormant subscription is kept —
    /// it ends when its job ends, or wakes when its queue gets work again
    /// (a copy of a lost item) — but no longer counts among the worker's
    /// `--job-queues`.
    fn busy(&self, now: Instant) -> bool {
        !self.buffer.is_empty() || now.duration_since(self.last_sent) < IDLE
    }

    /// Keeps what its subscription answered; the error of a lost connection.
    fn keep(&mut self, next: Option<Result<Delivery, BrokerError>>) -> Result<(), BrokerError> {
        match next {
            Some(Ok(d)) => {
                self.last_sent = Instant::now();
                self.buffer.push_back((d, self.last_sent));
            }
            Some(Err(e)) => return Err(e),
            None => self.ended = true,
        }
        Ok(())
    }

    /// Takes everything its subscription has sent, without waiting.
    async fn take_sent(&mut self) -> Result<(), BrokerError> {
        while !self.ended {
            let Some(sub) = self.sub.as_mut() else { break };
            match futures_lite::future::poll_once(sub.next()).await {
                Some(next) => self.keep(next)?,
                None => break,
            }
        }
        Ok(())
    }
}

/// The subscription of a job no longer active, left for the broker to end.
struct Retiring {
    /// Its job, and the job's queue.
    job: String,
    queue: String,
    sub: Box<dyn Subscription>,
    /// When it is cancelled from here after all.
    until: Instant,
}

/// What following the active jobs let go of.
#[derive(Default)]
pub struct LetGo {
    /// Deliveries of jobs no longer active: back to their queues.
    pub returned: Vec<Delivery>,
    /// Deliveries of queues let go while their jobs run on (a new draw):
    /// to be handled like any other.
    pub kept: Vec<Delivery>,
}

/// The queues of one worker session, with the choice among them.
pub struct Sources {
    /// The pool's work queue first, then job queues by job id.
    pool: Source,
    jobs: BTreeMap<String, Source>,
    /// Subscriptions of jobs that left the active list. Their queues are
    /// deleted a grace later ([`batchfleet_shared::retire`]), but one
    /// deleted sooner (under a running job, or by a coordinator that
    /// deletes it at once) has the broker end the subscription itself
    /// (consumer cancel notification); a cancel sent from here would cross
    /// the broker's on the wire, and an answer the client no longer
    /// expects closes the whole connection. So they are cancelled from
    /// here only if the broker has not ended them within [`RETIRE_WAIT`].
    retiring: Vec<Retiring>,
    /// Virtual time of the last item handed out.
    now: f64,
    /// The pool's active jobs as last read: job id → weight.
    active: BTreeMap<String, u32>,
    /// Job queues consumed at once, at most.
    limit: usize,
    /// The worker's id (its ranking of the jobs).
    worker: String,
    /// Jobs whose queues were taken for empty, passed over until then.
    resting: HashMap<String, Instant>,
    /// The period the worker last drew its jobs in.
    drawn: u64,
    /// Jobs announced to this worker, and when: a new job's queue is being
    /// filled, not emptied.
    announced: HashMap<String, Instant>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("pool", &self.pool.queue)
            .field("jobs", &self.jobs.keys().collect::<Vec<_>>())
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl Sources {
    /// Consumes the pool's work queue `queue` with `prefetch`, for worker
    /// `worker`, which consumes at most `limit` job queues at once.
    pub async fn open(
        broker: &Arc<dyn Broker>,
        queue: &str,
        prefetch: u16,
        worker: &str,
        limit: usize,
    ) -> Result<Self, BrokerError> {
        let sub = broker.consume(queue, prefetch).await?;
        Ok(Self {
            pool: Source::new(queue.to_owned(), POOL_QUEUE_WEIGHT, sub, 0.0),
            jobs: BTreeMap::new(),
            retiring: Vec::new(),
            now: 0.0,
            active: BTreeMap::new(),
            limit: limit.max(1),
            worker: worker.to_owned(),
            resting: HashMap::new(),
            drawn: 0,
            announced: HashMap::new(),
        })
    }

    /// Notes that job `job` was announced (it started, or runs again).
    pub fn announced(&mut self, job: &str) {
        self.announced.insert(job.to_owned(), Instant::now());
    }

    /// Notes that job `job` was announced with `weight`: it joins the
    /// active jobs as last read (until the next read, which lists it too),
    /// for [`Sources::follow`] to consume its queue.
    pub fn announced_with(&mut self, job: &str, weight: u32) {
        self.active.insert(job.to_owned(), weight);
        self.announced(job);
    }

    /// Job queues consumed now that send work (not dormant).
    pub fn sending(&self) -> usize {
        let now = Instant::now();
        self.jobs.values().filter(|s| s.busy(now)).count()
    }

    /// Notes that job `job` ended (its end notice heard): it leaves the
    /// active jobs as last read, and [`Sources::follow`] lets go of its
    /// queue. Whether it was listed.
    pub fn ended(&mut self, job: &str) -> bool {
        self.announced.remove(job);
        self.active.remove(job).is_some()
    }

    /// Whether no job is active, as last read (less those ended since).
    pub fn idle(&self) -> bool {
        self.active.is_empty()
    }

    /// Whether there are more active jobs than job queues consumed, a
    /// queue consumed of a job no longer active, or a subscription let go
    /// and not ended yet: then [`Sources::follow`] is worth calling often,
    /// to give the place of a queue gone dormant to another job's, or let
    /// an ended job's go and end its subscription.
    pub fn crowded(&self) -> bool {
        self.active.len() > self.jobs.len()
            || !self.retiring.is_empty()
            || self.jobs.keys().any(|job| !self.active.contains_key(job))
    }

    /// Whether a job of the last read of the pool's active jobs is not in
    /// `active`: it was retired since.
    pub fn leaving(&self, active: &BTreeMap<String, u32>) -> bool {
        self.active.keys().any(|job| !active.contains_key(job))
    }

    /// Follows the pool's active jobs (`active`: job id → weight, from the
    /// store), as [`Sources::follow`] does.
    pub async fn refresh(
        &mut self,
        broker: &Arc<dyn Broker>,
        active: BTreeMap<String, u32>,
        queue_of: impl Fn(&str) -> String,
        prefetch: u16,
    ) -> LetGo {
        self.active = active;
        self.follow(broker, queue_of, prefetch).await
    }

    /// Consumes the queues of the active jobs this worker should consume
    /// now (all of them, or the first `limit` in its ranking; see the
    /// module's documentation) with `prefetch`, re-weights the others, and
    /// stops consuming the rest. `queue_of` names a job's queue.
    pub async fn follow(
        &mut self,
        broker: &Arc<dyn Broker>,
        queue_of: impl Fn(&str) -> String,
        prefetch: u16,
    ) -> LetGo {
        let now = Instant::now();
        self.revive();
        let mut out = LetGo {
            returned: self.retire().await,
            kept: Vec::new(),
        };
        // Jobs that ended, or whose queue went away.
        let gone: Vec<String> = self
            .jobs
            .iter()
            .filter(|(job, s)| s.ended || !self.active.contains_key(*job))
            .map(|(job, _)| job.clone())
            .collect();
        for job in gone {
            if let Some(mut s) = self.jobs.remove(&job) {
                if s.ended {
                    // Its queue was deleted: the job ended since the
                    // active jobs were read.
                    self.active.remove(&job);
                }
                out.returned.extend(s.buffer.drain(..).map(|(d, _)| d));
                if let (Some(sub), false) = (s.sub.take(), s.ended) {
                    self.retiring.push(Retiring {
                        job: job.clone(),
                        queue: s.queue.clone(),
                        sub,
                        until: now + RETIRE_WAIT,
                    });
                }
                tracing::debug!(job = %job, "no longer consuming the job's queue");
            }
        }
        self.resting.retain(|_, until| *until > now);
        let drawn = period(&self.worker, std::time::SystemTime::now());
        let redraw = std::mem::replace(&mut self.drawn, drawn) != drawn;
        let crowded = self.active.len() > self.limit;
        let ranked = ranking(&self.active, &self.resting, &self.worker, drawn);
        let mut busy = self.jobs.values().filter(|s| s.busy(now)).count();
        if crowded {
            // More queues sending work than the worker consumes at once (a
            // dormant one woke up), or a new draw: those not among its
            // first let go — only one holding a delivery here, whose job
            // cannot end (its queue be deleted, and the broker's cancel
            // cross this one) before that delivery is handled.
            let first: Vec<&String> = ranked.iter().take(self.limit).collect();
            let over: Vec<String> = self
                .jobs
                .iter()
                .filter(|(job, s)| !s.buffer.is_empty() && !first.contains(job))
                .map(|(job, _)| job.clone())
                .collect();
            for job in over {
                if !redraw && busy <= self.limit {
                    break;
                }
                if let Some(mut s) = self.jobs.remove(&job) {
                    out.kept.extend(stop(&mut s, JOB_STOP_WAIT).await);
                    busy -= 1;
                    tracing::debug!(job = %job, "passing the job's queue on to other workers for now");
                }
            }
        }
        for (job, s) in self.jobs.iter_mut() {
            s.weight = self.active.get(job).copied().unwrap_or(1).max(1);
        }
        // Free places go to the next jobs in the ranking, and only to one
        // whose queue has work waiting (or a job just announced, whose
        // queue is being filled): a queue read empty belongs to a job whose
        // items are all in flight, which may end at any moment.
        let mut looked = 0;
        for job in ranked {
            if busy >= self.limit {
                break;
            }
            if self.jobs.contains_key(&job) {
                continue;
            }
            let queue = queue_of(&job);
            let announced = self
                .announced
                .get(&job)
                .is_some_and(|at| now.duration_since(*at) < FRESH);
            if !announced {
                if looked == LOOKS {
                    break;
                }
                looked += 1;
                if !matches!(broker.ready_count(&queue).await, Ok(Some(n)) if n > 0) {
                    self.resting.insert(job, now + REST);
                    continue;
                }
            }
            let weight = self.active.get(&job).copied().unwrap_or(1);
            match broker.consume(&queue, job_prefetch(prefetch)).await {
                Ok(sub) => {
                    tracing::debug!(job = %job, weight, "consuming the job's queue");
                    let s = Source::new(queue, weight, sub, self.now);
                    self.jobs.insert(job, s);
                    busy += 1;
                }
                // Not declared yet, or deleted already: tried again later.
                Err(e) => {
                    tracing::debug!(job = %job, error = %e, "cannot consume the job's queue");
                    self.resting.insert(job, now + REST);
                }
            }
        }
        self.announced
            .retain(|_, at| now.duration_since(*at) < FRESH);
        out
    }

    /// Takes the subscriptions of jobs that left the list and are listed
    /// again (run again under their id, their queue still there) back
    /// among the job queues, with what they sent: deliveries of the job's
    /// new run, not to be returned.
    fn revive(&mut self) {
        for r in std::mem::take(&mut self.retiring) {
            match self.active.get(&r.job) {
                Some(weight) if !self.jobs.contains_key(&r.job) => {
                    tracing::debug!(job = %r.job, "the job runs again: consuming its queue again");
                    let source = Source::new(r.queue, *weight, r.sub, self.now);
                    self.jobs.insert(r.job, source);
                }
                _ => self.retiring.push(r),
            }
        }
    }

    /// Takes what the retiring subscriptions sent (to be returned by the
    /// caller), forgets those the broker ended, and cancels those it has
    /// not ended within [`RETIRE_WAIT`].
    async fn retire(&mut self) -> Vec<Delivery> {
        let mut sent = Vec::new();
        let now = Instant::now();
        let mut kept = Vec::with_capacity(self.retiring.len());
        for mut r in std::mem::take(&mut self.retiring) {
            let ended = loop {
                match futures_lite::future::poll_once(r.sub.next()).await {
                    Some(Some(Ok(d))) => sent.push(d),
                    Some(Some(Err(_)) | None) => break true,
                    None => break false,
                }
            };
            if ended {
                continue;
            }
            if now < r.until {
                kept.push(r);
                continue;
            }
            r.sub.cancel().await;
            while let Ok(Some(Ok(d))) = tokio::time::timeout(GONE_WAIT, r.sub.next()).await {
                sent.push(d);
            }
        }
        self.retiring = kept;
        sent
    }

    /// The pool's queue, then the job queues.
    fn all(&mut self) -> impl Iterator<Item = &mut Source> {
        std::iter::once(&mut self.pool).chain(self.jobs.values_mut())
    }

    /// The next delivery, by weighted fair queueing among the sources that
    /// have one; waits for one when none has. `None` when the pool's queue
    /// ended (the broker closed the consumer). Cancel-safe: a delivery
    /// taken from a subscription is kept until handed out.
    pub async fn next(&mut self) -> Option<Result<Delivery, BrokerError>> {
        loop {
            for s in std::iter::once(&mut self.pool).chain(self.jobs.values_mut()) {
                if let Err(e) = s.take_sent().await {
                    return Some(Err(e));
                }
            }
            if self.pool.ended {
                return None;
            }
            if let Some(d) = self.take() {
                return Some(Ok(d));
            }
            if let Err(e) = self.fill().await {
                return Some(Err(e));
            }
        }
    }

    /// Waits for any subscription to send a delivery and keeps it, to be
    /// handed out by [`Sources::next`]; pending for ever when none can.
    /// `Err` when the connection is lost. Cancel-safe.
    pub async fn fill(&mut self) -> Result<(), BrokerError> {
        let waiting: Vec<Pin<Box<dyn Future<Output = (usize, _)> + Send + '_>>> = self
            .all()
            .enumerate()
            .filter(|(_, s)| !s.ended)
            .filter_map(|(i, s)| s.sub.as_mut().map(|sub| (i, sub)))
            .map(|(i, sub)| {
                Box::pin(async move { (i, sub.next().await) })
                    as Pin<Box<dyn Future<Output = _> + Send + '_>>
            })
            .collect();
        if waiting.is_empty() {
            std::future::pending::<()>().await;
        }
        let (i, next) = first(waiting).await;
        self.all()
            .nth(i)
            .expect("the source that answered")
            .keep(next)
    }

    /// Hands out the waiting delivery of the source with the least virtual time.
    fn take(&mut self) -> Option<Delivery> {
        let mut sources: Vec<&mut Source> = std::iter::once(&mut self.pool)
            .chain(self.jobs.values_mut())
            .filter(|s| !s.buffer.is_empty())
            .collect();
        let vtimes: Vec<(f64, u32)> = sources.iter().map(|s| (s.vtime, s.weight)).collect();
        let (i, vtime, now) = choose(&vtimes, self.now)?;
        self.now = now;
        sources[i].vtime = vtime;
        sources[i].buffer.pop_front().map(|(d, _)| d)
    }

    /// Adds to `out` the jobs this worker holds deliveries of here that
    /// wait to start, each with when the oldest came.
    pub fn queued(&self, out: &mut BTreeMap<String, Instant>) {
        for (job, s) in &self.jobs {
            if let Some((_, at)) = s.buffer.front() {
                note(out, job, *at);
            }
        }
        for (d, at) in &self.pool.buffer {
            if let Some(job) = self.active_job_of(d) {
                note(out, job, *at);
            }
        }
    }

    /// The active job a delivery says it belongs to ([`job_of`]); `None`
    /// for a job the store does not list active, so that a forged message
    /// id never has the worker's beat write under a job that does not run
    /// (a key nothing would expire).
    pub fn active_job_of<'a>(&self, d: &'a Delivery) -> Option<&'a str> {
        job_of(d).filter(|job| self.active.contains_key(*job))
    }

    /// Stops every subscription; the deliveries they had sent (and the
    /// ones waiting here), to be handled or returned by the caller.
    pub async fn stop(&mut self) -> Vec<Delivery> {
        for r in &mut self.retiring {
            r.until = Instant::now();
        }
        let mut sent = self.retire().await;
        sent.extend(stop(&mut self.pool, STOP_WAIT).await);
        for s in self.jobs.values_mut() {
            sent.extend(stop(s, JOB_STOP_WAIT).await);
        }
        sent
    }

    /// Consumes every queue again with `prefetch` (after [`Sources::stop`]).
    pub async fn resume(&mut self, broker: &Arc<dyn Broker>, prefetch: u16) -> Result<(), String> {
        self.pool.sub = Some(
            broker
                .consume(&self.pool.queue, prefetch)
                .await
                .map_err(|e| {
                    format!(
                        "consuming {} with prefetch {prefetch}: {e:#}",
                        self.pool.queue
                    )
                })?,
        );
        self.pool.ended = false;
        for s in self.jobs.values_mut() {
            match broker.consume(&s.queue, job_prefetch(prefetch)).await {
                Ok(sub) => {
                    s.sub = Some(sub);
                    s.last_sent = Instant::now();
                }
                // Its job ended meanwhile: dropped at the next refresh.
                Err(_) => s.ended = true,
            }
        }
        Ok(())
    }

    /// Stops consuming (draining): no new deliveries.
    pub async fn cancel(&mut self) {
        for s in std::iter::once(&mut self.pool).chain(self.jobs.values_mut()) {
            if let Some(sub) = s.sub.as_mut() {
                sub.cancel().await;
            }
        }
        for r in &mut self.retiring {
            r.sub.cancel().await;
        }
    }

    /// Deliveries taken but not handed out (returned to their queues when
    /// the worker drains).
    pub fn waiting(&mut self) -> Vec<Delivery> {
        std::iter::once(&mut self.pool)
            .chain(self.jobs.values_mut())
            .flat_map(|s| s.buffer.drain(..).map(|(d, _)| d))
            .collect()
    }
}

/// Notes in `out` a delivery of `job` that came at `at`, keeping the oldest.
pub fn note(out: &mut BTreeMap<String, Instant>, job: &str, at: Instant) {
    match out.get_mut(job) {
        Some(oldest) => *oldest = (*oldest).min(at),
        None => {
            out.insert(job.to_owned(), at);
        }
    }
}

/// The job a delivery says it belongs to: its `x-bf-job` header (retries,
/// dead letters), else its message id (`<job>/<item>` or
/// `<job>/<first>+<count>`). Unsigned, so only a hint: it names the job
/// the worker's beat says it holds deliveries of, once checked against the
/// active jobs ([`Sources::active_job_of`]).
fn job_of(d: &Delivery) -> Option<&str> {
    d.headers
        .str(JOB_HEADER)
        .or_else(|| d.message_id.split_once('/').map(|(job, _)| job))
        .filter(|job| !job.is_empty())
}

/// How long [`stop`] waits for each delivery the broker had sent to come
/// out of the pool queue's stream (they are all there at once; the stream
/// ends after the broker confirms the cancel).
const STOP_WAIT: Duration = Duration::from_secs(5);
/// The same for a job queue's stream.
const JOB_STOP_WAIT: Duration = Duration::from_secs(1);
/// The same for the stream of a job no longer active, whose queue is
/// usually deleted: its stream may never end.
const GONE_WAIT: Duration = Duration::from_millis(100);
/// How long the subscription of a job no longer active is left for the
/// broker to end (should its queue be deleted at once) before it is
/// cancelled from here: well within the grace before its queue is deleted
/// ([`batchfleet_shared::retire::RETIRED_GRACE`]).
const RETIRE_WAIT: Duration = Duration::from_secs(2);

/// Cancels one subscription: its waiting deliveries and what the broker
/// had sent, which come out of the stream before its end (waiting at most
/// `wait` for each; nothing for a stream that ended).
async fn stop(s: &mut Source, wait: Duration) -> Vec<Delivery> {
    let mut sent: Vec<Delivery> = s.buffer.drain(..).map(|(d, _)| d).collect();
    if let Some(mut sub) = s.sub.take() {
        if s.ended {
            return sent;
        }
        sub.cancel().await;
        while let Ok(Some(Ok(d))) = tokio::time::timeout(wait, sub.next()).await {
            sent.push(d);
        }
    }
    sent
}

/// The period of worker `worker`'s ranking at `at`: it changes every
/// [`ROTATE`], at a moment of the period that depends on the worker, so
/// that a fleet's workers do not all draw again together.
fn period(worker: &str, at: std::time::SystemTime) -> u64 {
    let secs = at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let every = ROTATE.as_secs().max(1);
    (secs + hash(&(worker, "phase")) % every) / every
}

fn hash(value: &impl Hash) -> u64 {
    // SipHash with fixed keys: the same ranking in every process.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The jobs among `active` (id → weight) in the order worker `worker`
/// takes them in `period`: weighted rendezvous hashing, where a job of
/// weight `w` ranks by `-ln(u) / w` with `u` uniform in (0, 1) drawn from
/// (worker, job, period) — the chance that a job is a worker's first is its
/// weight's share of the total — and the `resting` ones last.
fn ranking(
    active: &BTreeMap<String, u32>,
    resting: &HashMap<String, Instant>,
    worker: &str,
    period: u64,
) -> Vec<String> {
    let mut ranked: Vec<(bool, f64, &String)> = active
        .iter()
        .map(|(job, weight)| {
            let u = (hash(&(worker, job.as_str(), period)) >> 11) as f64 + 0.5;
            let u = u / (1u64 << 53) as f64;
            let key = -u.ln() / f64::from((*weight).max(1));
            (resting.contains_key(job), key, job)
        })
        .collect();
    ranked.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    ranked.into_iter().map(|(_, _, job)| job.clone()).collect()
}

/// Weighted fair queueing's choice among sources with an item waiting,
/// given as (virtual time, weight): the one whose next item starts first
/// (a source idle for a while starts at `now`, with no credit saved up).
/// Returns its position, its virtual time after the item, and the new `now`.
fn choose(sources: &[(f64, u32)], now: f64) -> Option<(usize, f64, f64)> {
    let (i, start) = sources
        .iter()
        .enumerate()
        .map(|(i, (vtime, _))| (i, vtime.max(now)))
        .min_by(|a, b| a.1.total_cmp(&b.1))?;
    Some((i, start + 1.0 / f64::from(sources[i].1.max(1)), start))
}

/// The output of whichever future finishes first, with its position.
async fn first<T>(futures: Vec<Pin<Box<dyn Future<Output = T> + Send + '_>>>) -> T {
    let mut futures = futures;
    std::future::poll_fn(move |cx| {
        for f in futures.iter_mut() {
            if let std::task::Poll::Ready(v) = f.as_mut().poll(cx) {
                return std::task::Poll::Ready(v);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order in which sources of these weights, all with items
    /// waiting, are served by [`choose`].
    fn order(weights: &[u32], n: usize) -> Vec<usize> {
        let mut sources: Vec<(f64, u32)> = weights.iter().map(|w| (0.0, *w)).collect();
        let mut now = 0.0;
        let mut out = Vec::new();
        for _ in 0..n {
            let (i, vtime, next) = choose(&sources, now).expect("sources");
            sources[i].0 = vtime;
            now = next;
            out.push(i);
        }
        out
    }

    #[test]
    fn items_are_shared_in_proportion_to_the_weights() {
        let served = order(&[4, 1], 50);
        let high = served.iter().filter(|&&i| i == 0).count();
        assert_eq!(high, 40, "{served:?}");
        let served = order(&[2, 2], 50);
        assert_eq!(served.iter().filter(|&&i| i == 0).count(), 25);
        // Never more than one item of the light source in a row of five.
        let served = order(&[4, 1], 20);
        assert!(
            served.windows(2).all(|w| !(w[0] == 1 && w[1] == 1)),
            "{served:?}"
        );
        // A source idle for a while comes back at the current time: no
        // burst of saved-up credit.
        let mut sources = vec![(0.0, 2), (0.0, 2)];
        let mut now = 0.0;
        for _ in 0..10 {
            let (_, vtime, next) = choose(&sources[..1], now).expect("one");
            sources[0].0 = vtime;
            now = next;
        }
        let mut served = Vec::new();
        for _ in 0..6 {
            let (i, vtime, next) = choose(&sources, now).expect("two");
            sources[i].0 = vtime;
            now = next;
            served.push(i);
        }
        assert_eq!(served.iter().filter(|&&i| i == 1).count(), 3, "{served:?}");
    }

    fn active(weights: &[(&str, u32)]) -> BTreeMap<String, u32> {
        weights.iter().map(|(j, w)| ((*j).to_owned(), *w)).collect()
    }

    /// A worker's first `n` jobs.
    fn first(
        active: &BTreeMap<String, u32>,
        resting: &HashMap<String, Instant>,
        n: usize,
        worker: &str,
        period: u64,
    ) -> Vec<String> {
        let mut first: Vec<String> = ranking(active, resting, worker, period)
            .into_iter()
            .take(n)
            .collect();
        first.sort();
        first
    }

    #[test]
    fn a_worker_ranks_every_job_the_same_within_a_period_and_otherwise_in_others() {
        let many = active(&[("a", 2), ("b", 2), ("c", 2), ("d", 2), ("e", 2), ("f", 2)]);
        let none = HashMap::new();
        let ranked = ranking(&many, &none, "w", 0);
        assert_eq!(ranked.len(), 6);
        assert_eq!(ranking(&many, &none, "w", 0), ranked);
        // Over periods, every job is among a worker's first four.
        let seen: std::collections::BTreeSet<String> = (0..20)
            .flat_map(|p| first(&many, &none, 4, "w", p))
            .collect();
        assert_eq!(seen.len(), 6, "{seen:?}");
    }

    #[test]
    fn a_heavier_job_is_first_for_more_of_the_fleet_and_a_resting_one_comes_last() {
        let jobs = active(&[("high", 8), ("n1", 2), ("n2", 2), ("n3", 2), ("n4", 2)]);
        let none = HashMap::new();
        let workers: Vec<String> = (0..2_000).map(|n| format!("worker-{n}")).collect();
        let share = |job: &str| {
            workers
                .iter()
                .filter(|w| ranking(&jobs, &none, w, 7)[0] == job)
                .count() as f64
                / workers.len() as f64
        };
        // A job is a worker's first for its weight's share of the fleet:
        // 8/16 and 2/16.
        assert!((share("high") - 0.5).abs() < 0.05, "{}", share("high"));
        for n in ["n1", "n2", "n3", "n4"] {
            assert!((share(n) - 0.125).abs() < 0.03, "{n}: {}", share(n));
        }
        let later = Instant::now() + REST;
        let resting: HashMap<String, Instant> = ["high", "n1", "n2"]
            .iter()
            .map(|j| ((*j).to_owned(), later))
            .collect();
        assert_eq!(first(&jobs, &resting, 2, "w", 0), vec!["n3", "n4"]);
        let ranked = ranking(&jobs, &resting, "w", 0);
        assert_eq!(ranked.len(), 5);
        assert!(
            ranked[2..].iter().all(|j| resting.contains_key(j)),
            "{ranked:?}"
        );
    }

    #[test]
    fn workers_draw_again_at_moments_of_their_own() {
        let t = |s: u64| std::time::UNIX_EPOCH + Duration::from_secs(s);
        let every = ROTATE.as_secs();
        // A worker's period changes once every ROTATE ...
        let changes = (0..every * 10)
            .filter(|s| period("w", t(*s)) != period("w", t(s + 1)))
            .count();
        assert_eq!(changes, 10);
        // ... and not at the same second for every worker.
        let moments: std::collections::BTreeSet<u64> = (0..50)
            .map(|n| {
                let w = format!("worker-{n}");
                (0..every)
                    .find(|s| period(&w, t(*s)) != period(&w, t(s + 1)))
                    .expect("a change within one period")
            })
            .collect();
        assert!(moments.len() > 10, "{moments:?}");
    }

    #[tokio::test]
    async fn the_beat_names_only_active_jobs_a_waiting_delivery_says_it_belongs_to() {
        use batchfleet_shared::broker::{Headers, Outgoing, PoolQueues};
        let queues = PoolQueues::new("p");
        let broker = batchfleet_shared::broker::local::LocalQueues::new().handle();
        broker.declare(&queues).await.expect("declare");
        let message = |id: &str| Outgoing {
            message_id: id.to_owned(),
            kind: batchfleet_shared::message::MESSAGE_TYPE_V3,
            body: Vec::new(),
            headers: Headers::default(),
            expiration_ms: None,
        };
        let ids = ["running-1/3", "forged-9/4+16", "no-job-named"];
        broker
            .publish(
                &queues.work(),
                ids.iter().map(|id| message(id)).collect(),
                8,
            )
            .await
            .expect("publish");
        let mut sources = Sources::open(&broker, &queues.work(), 8, "w", 4)
            .await
            .expect("consume");
        let active: BTreeMap<String, u32> = [("running-1".to_owned(), 2)].into();
        sources
            .refresh(&broker, active, |job| queues.job(job), 8)
            .await;
        sources.pool.take_sent().await.expect("taken");
        assert_eq!(sources.pool.buffer.len(), 3);
        let mut queued = BTreeMap::new();
        sources.queued(&mut queued);
        assert_eq!(queued.keys().collect::<Vec<_>>(), ["running-1"]);
    }

    /// Pool `p` of in-process queues with job `j`'s queue declared, and
    /// worker `w`'s sources on it (prefetch 8, at most 4 job queues).
    async fn with_job_j() -> (
        batchfleet_shared::broker::PoolQueues,
        Arc<dyn Broker>,
        Sources,
    ) {
        let queues = batchfleet_shared::broker::PoolQueues::new("p");
        let broker = batchfleet_shared::broker::local::LocalQueues::new().handle();
        broker.declare(&queues).await.expect("declare");
        broker.declare_job(&queues, "j").await.expect("declare");
        let sources = Sources::open(&broker, &queues.work(), 8, "w", 4)
            .await
            .expect("consume");
        (queues, broker, sources)
    }

    /// A job that leaves the list and comes back (run again under its id,
    /// before its queue is deleted) gets its subscription back with what it
    /// sent meanwhile: the new run's deliveries are handed out, not
    /// returned to the queue (which would count against their delivery
    /// limit and hold them back until the subscription is cancelled).
    #[tokio::test]
    async fn a_job_run_again_takes_its_letting_go_subscription_back() {
        use batchfleet_shared::broker::{Headers, Outgoing};
        let (queues, broker, mut sources) = with_job_j().await;
        let listed: BTreeMap<String, u32> = [("j".to_owned(), 1)].into();
        sources.announced("j");
        let first = sources
            .refresh(&broker, listed.clone(), |job| queues.job(job), 8)
            .await;
        assert!(sources.jobs.contains_key("j"), "consumed");
        assert!(first.returned.is_empty());
        // Retired: let go (its subscription kept a moment, for the broker
        // to end).
        let left = sources
            .refresh(&broker, BTreeMap::new(), |job| queues.job(job), 8)
            .await;
        assert!(left.returned.is_empty());
        assert!(!sources.jobs.contains_key("j") && sources.retiring.len() == 1);
        // Run again: its items published, and the job listed again.
        let ids = ["j/0", "j/1"];
        let items = ids
            .iter()
            .map(|id| Outgoing {
                message_id: (*id).to_owned(),
                kind: batchfleet_shared::message::MESSAGE_TYPE_V3,
                body: Vec::new(),
                headers: Headers::default(),
                expiration_ms: None,
            })
            .collect();
        broker
            .publish(&queues.job("j"), items, 8)
            .await
            .expect("publish");
        let again = sources
            .refresh(&broker, listed, |job| queues.job(job), 8)
            .await;
        assert!(
            again.returned.is_empty(),
            "{} of the new run's deliveries returned",
            again.returned.len()
        );
        assert!(sources.retiring.is_empty() && sources.jobs.contains_key("j"));
        let mut got = Vec::new();
        for _ in ids {
            let d = tokio::time::timeout(Duration::from_secs(5), sources.next())
                .await
                .expect("handed out")
                .expect("open")
                .expect("delivery");
            got.push(d.message_id.clone());
        }
        got.sort();
        assert_eq!(got, ids);
    }

    /// A job announced with its weight is consumed at the next follow, with
    /// no read of the active jobs (nothing here can read them), and kept
    /// by the next read that lists it; a job the next read does not list
    /// is let go.
    #[tokio::test]
    async fn a_job_announced_with_its_weight_is_consumed_without_reading_the_list() {
        let (queues, broker, mut sources) = with_job_j().await;
        assert!(!sources.crowded());
        sources.announced_with("j", 4);
        assert!(sources.crowded(), "an active job not consumed yet");
        let first = sources.follow(&broker, |job| queues.job(job), 8).await;
        assert!(first.returned.is_empty() && first.kept.is_empty());
        assert_eq!(sources.jobs.get("j").map(|s| s.weight), Some(4));
        let listed: BTreeMap<String, u32> = [("j".to_owned(), 4)].into();
        assert!(!sources.leaving(&listed));
        sources
            .refresh(&broker, listed, |job| queues.job(job), 8)
            .await;
        assert!(sources.jobs.contains_key("j"), "kept");
        sources
            .refresh(&broker, BTreeMap::new(), |job| queues.job(job), 8)
            .await;
        assert!(!sources.jobs.contains_key("j"), "let go once not listed");
    }
}
