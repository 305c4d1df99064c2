//! Where a worker's work comes from: the pool's work queue (items published
//! before job queues, retries coming back from the retry tiers) and the
//! queue of every active job of the pool (`bf.<pool>.job.<id>`, listed with
//! its weight in the job store). When several have deliveries waiting, the
//! next item is taken by weighted fair queueing: each source has a virtual
//! time that advances by `1 / weight` per item taken from it, and the
//! source with the least goes next — so over any stretch in which jobs have
//! items queued, a worker's items are divided among them in proportion to
//! their weights (`[job] priority`), and a job that has been idle comes
//! back at the current virtual time rather than with credit saved up.

use batchfleet_shared::broker::{Broker, BrokerError, Delivery, Subscription};
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// Weight of the pool's work queue (that of a `normal` job).
const POOL_QUEUE_WEIGHT: u32 = 2;

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
    /// A delivery taken from the subscription and not handed out yet.
    head: Option<Delivery>,
    /// Virtual time of the next item taken from it.
    vtime: f64,
    /// Its subscription ended (the queue was deleted: its job ended).
    ended: bool,
}

/// The subscription of a job no longer active, left for the broker to end.
struct Retiring {
    sub: Box<dyn Subscription>,
    /// When it is cancelled from here after all.
    until: std::time::Instant,
}

/// The queues of one worker session, with the choice among them.
pub struct Sources {
    /// The pool's work queue first, then job queues by job id.
    pool: Source,
    jobs: BTreeMap<String, Source>,
    /// Subscriptions of jobs that left the active list: their queue is
    /// about to be deleted, and the broker ends the subscription itself
    /// (consumer cancel notification). A cancel sent from here would cross
    /// the broker's on the wire, and an answer the client no longer
    /// expects closes the whole connection; so they are cancelled from
    /// here only if the broker has not ended them within [`RETIRE_WAIT`].
    retiring: Vec<Retiring>,
    /// Virtual time of the last item handed out.
    now: f64,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("pool", &self.pool.queue)
            .field("jobs", &self.jobs.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Sources {
    /// Consumes the pool's work queue `queue` with `prefetch`.
    pub async fn open(
        broker: &Arc<dyn Broker>,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self, BrokerError> {
        let sub = broker.consume(queue, prefetch).await?;
        Ok(Self {
            pool: Source {
                queue: queue.to_owned(),
                weight: POOL_QUEUE_WEIGHT,
                sub: Some(sub),
                head: None,
                vtime: 0.0,
                ended: false,
            },
            jobs: BTreeMap::new(),
            retiring: Vec::new(),
            now: 0.0,
        })
    }

    /// Job queues consumed now.
    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Follows the pool's active jobs (`active`: job id → weight, from the
    /// store; `queue_of` names a job's queue): consumes the queues of new
    /// ones with `prefetch`, re-weights the others, and stops consuming
    /// those no longer active (or whose queue went away). Returns the
    /// deliveries the stopped ones had sent, which the caller returns to
    /// their queues.
    pub async fn refresh(
        &mut self,
        broker: &Arc<dyn Broker>,
        active: &BTreeMap<String, u32>,
        queue_of: impl Fn(&str) -> String,
        prefetch: u16,
    ) -> Vec<Delivery> {
        let mut returned = self.retire().await;
        let gone: Vec<String> = self
            .jobs
            .iter()
            .filter(|(job, s)| s.ended || !active.contains_key(*job))
            .map(|(job, _)| job.clone())
            .collect();
        for job in gone {
            if let Some(mut s) = self.jobs.remove(&job) {
                returned.extend(s.head.take());
                if let (Some(sub), false) = (s.sub.take(), s.ended) {
                    self.retiring.push(Retiring {
                        sub,
                        until: std::time::Instant::now() + RETIRE_WAIT,
                    });
                }
                tracing::debug!(job = %job, "no longer consuming the job's queue");
            }
        }
        for (job, &weight) in active {
            if let Some(s) = self.jobs.get_mut(job) {
                s.weight = weight.max(1);
                continue;
            }
            let queue = queue_of(job);
            match broker.consume(&queue, job_prefetch(prefetch)).await {
                Ok(sub) => {
                    tracing::debug!(job = %job, weight, "consuming the job's queue");
                    self.jobs.insert(
                        job.clone(),
                        Source {
                            queue,
                            weight: weight.max(1),
                            sub: Some(sub),
                            head: None,
                            vtime: self.now,
                            ended: false,
                        },
                    );
                }
                // Not declared yet, or deleted already: tried again next time.
                Err(e) => tracing::debug!(job = %job, error = %e, "cannot consume the job's queue"),
            }
        }
        returned
    }

    /// Takes what the retiring subscriptions sent (to be returned by the
    /// caller), forgets those the broker ended, and cancels those it has
    /// not ended within [`RETIRE_WAIT`].
    async fn retire(&mut self) -> Vec<Delivery> {
        let mut sent = Vec::new();
        let now = std::time::Instant::now();
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

    /// The next delivery, by weighted fair queueing among the sources that
    /// have one; waits for one when none has. `None` when the pool's queue
    /// ended (the broker closed the consumer). Cancel-safe: a delivery
    /// taken from a subscription is kept until handed out.
    pub async fn next(&mut self) -> Option<Result<Delivery, BrokerError>> {
        loop {
            // Take what is there without waiting.
            for s in std::iter::once(&mut self.pool).chain(self.jobs.values_mut()) {
                if s.head.is_some() || s.ended {
                    continue;
                }
                let Some(sub) = s.sub.as_mut() else { continue };
                if let Some(next) = futures_lite::future::poll_once(sub.next()).await {
                    match next {
                        Some(Ok(d)) => s.head = Some(d),
                        Some(Err(e)) => return Some(Err(e)),
                        None => s.ended = true,
                    }
                }
            }
            if self.pool.ended {
                return None;
            }
            if let Some(d) = self.take() {
                return Some(Ok(d));
            }
            // Nothing anywhere: wait for the first source to send something.
            let waiting: Vec<Pin<Box<dyn Future<Output = (usize, _)> + Send + '_>>> =
                std::iter::once(&mut self.pool)
                    .chain(self.jobs.values_mut())
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
            let s = std::iter::once(&mut self.pool)
                .chain(self.jobs.values_mut())
                .nth(i)
                .expect("the source that answered");
            match next {
                Some(Ok(d)) => s.head = Some(d),
                Some(Err(e)) => return Some(Err(e)),
                None => s.ended = true,
            }
        }
    }

    /// Hands out the waiting delivery of the source with the least virtual time.
    fn take(&mut self) -> Option<Delivery> {
        let mut sources: Vec<&mut Source> = std::iter::once(&mut self.pool)
            .chain(self.jobs.values_mut())
            .filter(|s| s.head.is_some())
            .collect();
        let vtimes: Vec<(f64, u32)> = sources.iter().map(|s| (s.vtime, s.weight)).collect();
        let (i, vtime, now) = choose(&vtimes, self.now)?;
        self.now = now;
        sources[i].vtime = vtime;
        sources[i].head.take()
    }

    /// Stops every subscription; the deliveries they had sent (and the
    /// ones waiting here), to be handled or returned by the caller.
    pub async fn stop(&mut self) -> Vec<Delivery> {
        for r in &mut self.retiring {
            r.until = std::time::Instant::now();
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
                Ok(sub) => s.sub = Some(sub),
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
            .filter_map(|s| s.head.take())
            .collect()
    }
}

/// How long [`stop`] waits for each delivery the broker had sent to come
/// out of the pool queue's stream (they are all there at once; the stream
/// ends after the broker confirms the cancel).
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// The same for a job queue's stream.
const JOB_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// The same for the stream of a job no longer active, whose queue is
/// usually deleted: its stream may never end.
const GONE_WAIT: std::time::Duration = std::time::Duration::from_millis(100);
/// How long the subscription of a job no longer active is left for the
/// broker to end (the coordinator deletes the queue moments after it takes
/// the job off the active list) before it is cancelled from here.
const RETIRE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Cancels one subscription: its waiting delivery and what the broker had
/// sent already, which come out of the stream before its end (waiting at
/// most `wait` for each; nothing for a stream that ended).
async fn stop(s: &mut Source, wait: std::time::Duration) -> Vec<Delivery> {
    let mut sent: Vec<Delivery> = s.head.take().into_iter().collect();
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
}
