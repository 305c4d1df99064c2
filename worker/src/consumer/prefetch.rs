//! The prefetch sized from the measured per-item time.
//!
//! A worker holds `--prefetch` deliveries at least and `--prefetch-max` at
//! most. Every [`PERIOD`] it counts the items it settled and asks for as many
//! deliveries as it settles in [`HOLD`] (rounded up to a power of two): short
//! items get a deep prefetch, so the broker round trip, the Redis calls and
//! the part file's fsync of one item overlap the work of the others (one-row
//! items: about 1,000 items/s at prefetch 2, 1,600 at 32 on the reference
//! machine, docs/performance.md); long items keep the least, so a worker never
//! sits on more than about [`HOLD`] of work that an idle worker could run.
//!
//! Quorum queues take a consumer's prefetch when it subscribes, so a new size
//! means a new subscription: the old one is cancelled, what the broker had
//! sent already is handled, and the queue is consumed again with the new size
//! (see [`resize`]). Growing takes one period; shrinking waits for two
//! periods in a row that ask for less, so a pause between jobs does not flap it.

use super::session::Session;
use batchfleet_shared::broker::Delivery;
use batchfleet_shared::metrics::names;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// How often the settled count is reviewed.
pub const PERIOD: Duration = Duration::from_secs(1);

/// How much work, in time, a worker may hold beyond what it is running.
pub const HOLD: Duration = Duration::from_millis(100);

/// The prefetch in force and the count it is sized from.
#[derive(Debug)]
pub struct Prefetch {
    least: u16,
    most: u16,
    current: u16,
    settled: Arc<AtomicU64>,
    last: (Instant, u64),
    /// Reviews in a row that asked for less than `current`.
    lower: u8,
}

impl Prefetch {
    /// Starts at `least`; `most` below `least` counts as `least` (a fixed prefetch).
    pub fn new(least: u16, most: u16) -> Self {
        let least = least.max(1);
        Self {
            least,
            most: most.max(least),
            current: least,
            settled: Arc::default(),
            last: (Instant::now(), 0),
            lower: 0,
        }
    }

    /// The prefetch in force.
    pub fn current(&self) -> u16 {
        self.current
    }

    /// Whether the prefetch can change at all.
    pub fn adapts(&self) -> bool {
        self.most > self.least
    }

    /// The counter an item's handler bumps when it settled the item with work
    /// done (committed, or found done).
    pub fn settled(&self) -> Arc<AtomicU64> {
        self.settled.clone()
    }

    /// The new prefetch, when the items settled since the last review ask
    /// for another one.
    pub fn review(&mut self, now: Instant) -> Option<u16> {
        let n = self.settled.load(Ordering::Relaxed);
        let (then, before) = std::mem::replace(&mut self.last, (now, n));
        let elapsed = now.saturating_duration_since(then);
        if !self.adapts() || elapsed.is_zero() {
            return None;
        }
        let want = wanted(n.saturating_sub(before), elapsed, self.least, self.most);
        if want > self.current {
            self.lower = 0;
            self.current = want;
            return Some(want);
        }
        if want < self.current {
            self.lower += 1;
            if self.lower >= 2 {
                self.lower = 0;
                self.current = want;
                return Some(want);
            }
        } else {
            self.lower = 0;
        }
        None
    }
}

/// The prefetch for `settled` items in `elapsed`: the items settled in
/// [`HOLD`], rounded up to a power of two, within `least..=most`.
pub fn wanted(settled: u64, elapsed: Duration, least: u16, most: u16) -> u16 {
    let per_hold = settled as f64 * HOLD.as_secs_f64() / elapsed.as_secs_f64().max(1e-9);
    let want = (per_hold.ceil().max(1.0) as u64).next_power_of_two();
    want.clamp(u64::from(least), u64::from(most.max(least))) as u16
}

/// The prefetch in force, how it is sized, and the deliveries of a
/// subscription it replaced that are still to be handled.
pub(crate) struct Sizing {
    /// The prefetch in force.
    pub(crate) prefetch: Prefetch,
    /// When to review it.
    pub(crate) next_review: Instant,
    /// When to read the pool's active jobs again.
    pub(crate) next_jobs: Instant,
    /// How often to read them, when set (a testing aid): see [`Sizing::jobs_every`].
    pub(crate) jobs_every: Option<Duration>,
    /// When to see whether an emptied job queue should give its place to
    /// another job's (while more jobs are active than queues consumed).
    pub(crate) next_follow: Instant,
    /// Deliveries of a replaced subscription, handled first, each with
    /// when it was taken over.
    pub(crate) backlog: VecDeque<(Delivery, Instant)>,
}

impl Sizing {
    /// How often the pool's active jobs are read: every [`LISTENING_EVERY`]
    /// while the worker hears the pool's announcements (a new job is
    /// announced: the look is then only the fallback for one missed while
    /// reconnecting, and for jobs' weights), every [`JOBS_EVERY`] while it
    /// does not.
    pub(crate) fn jobs_every(&self, listening: bool) -> Duration {
        match (self.jobs_every, listening) {
            (Some(every), _) => every,
            (None, true) => LISTENING_EVERY,
            (None, false) => JOBS_EVERY,
        }
    }
}

/// How often a worker that hears no announcements reads its pool's active
/// jobs (a new job's queue is consumed within this of its publication).
pub const JOBS_EVERY: Duration = Duration::from_secs(1);

/// How often a worker that hears the announcements reads the pool's
/// active jobs anyway: for a notice missed while it reconnected — a start,
/// or an end (the job's queue is then let go within this, within the
/// [`RETIRED_GRACE`](batchfleet_shared::retire::RETIRED_GRACE) before it
/// is deleted) — and changed weights. Each read is a Redis request per
/// worker, so this sets the idle fleet's Redis load (1/60 request per
/// worker-second).
pub const LISTENING_EVERY: Duration = Duration::from_secs(60);

/// Consumes the work queue again with `size` deliveries (quorum queues take
/// a consumer's prefetch when it subscribes): the old subscription is
/// cancelled and what it had sent already is kept, to be handled first with
/// the in-flight permits like any other delivery — none is returned to the
/// queue, which would count as a delivery against the item's limit.
pub(crate) async fn resize(
    session: &mut Session,
    permits: &Arc<Semaphore>,
    sizing: &mut Sizing,
    size: u16,
) -> Result<(), String> {
    let old = session.prefetch;
    let now = Instant::now();
    sizing
        .backlog
        .extend(session.stop_work().await?.into_iter().map(|d| (d, now)));
    session.prefetch = size;
    session.resume_work().await?;
    if size > old {
        permits.add_permits(usize::from(size - old));
    } else {
        // Taken as the items in flight finish, and never given back.
        let (permits, fewer) = (permits.clone(), u32::from(old - size));
        tokio::spawn(async move {
            if let Ok(taken) = permits.acquire_many_owned(fewer).await {
                taken.forget();
            }
        });
    }
    metrics::gauge!(names::WORKER_PREFETCH).set(f64::from(size));
    tracing::info!(
        from = old,
        to = size,
        held = sizing.backlog.len(),
        "prefetch sized from the items settled in the last second"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_items_get_a_deep_prefetch_and_long_ones_the_least() {
        let s = Duration::from_secs(1);
        // 1,000 one-row items a second: 100 in HOLD, capped at the most.
        assert_eq!(wanted(1_000, s, 2, 32), 32);
        // 50 items a second (20 ms each): 5 in HOLD, rounded up to 8.
        assert_eq!(wanted(50, s, 2, 32), 8);
        // One item every few seconds, or none: the least.
        assert_eq!(wanted(0, s, 2, 32), 2);
        assert_eq!(wanted(1, Duration::from_secs(3), 2, 32), 2);
        // A fixed prefetch stays fixed.
        assert_eq!(wanted(1_000, s, 4, 4), 4);
    }

    #[test]
    fn it_grows_at_once_and_shrinks_after_two_reviews_in_a_row() {
        let mut p = Prefetch::new(2, 32);
        let counter = p.settled();
        let t0 = p.last.0;
        counter.fetch_add(1_000, Ordering::Relaxed);
        assert_eq!(p.review(t0 + PERIOD), Some(32));
        // A quiet second (between jobs): not yet.
        assert_eq!(p.review(t0 + PERIOD * 2), None);
        counter.fetch_add(1_000, Ordering::Relaxed);
        assert_eq!(p.review(t0 + PERIOD * 3), None);
        // Two slow seconds in a row: back down.
        counter.fetch_add(1, Ordering::Relaxed);
        assert_eq!(p.review(t0 + PERIOD * 4), None);
        assert_eq!(p.review(t0 + PERIOD * 5), Some(2));
        assert_eq!(p.current(), 2);
    }

    #[test]
    fn a_fixed_prefetch_never_changes() {
        let mut p = Prefetch::new(3, 3);
        p.settled().fetch_add(10_000, Ordering::Relaxed);
        assert!(!p.adapts());
        assert_eq!(p.review(p.last.0 + PERIOD), None);
        assert_eq!(p.current(), 3);
    }
}
