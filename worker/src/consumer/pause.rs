//! The disk-full pause: when an item finds the output disk full, the
//! worker stops consuming (the consume loop hands back what the broker had
//! sent and waits here), doubling the pause up to a cap each time the disk
//! is still full, and starts over once an item commits. Shown by
//! `batchfleet_worker_paused`.

use batchfleet_shared::metrics::names;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The disk-full pause: the worker stops consuming until `until`, doubling
/// the pause (up to a cap) each time the disk is still full, and starts
/// over once an item commits.
#[derive(Debug, Default)]
pub struct Pause {
    state: Mutex<(Option<Instant>, Duration, String)>,
    /// Woken when a pause starts, so the consume loop stops pulling at once.
    pub started: Notify,
    max: Duration,
}

impl Pause {
    /// A pause that never exceeds `max`.
    pub fn new(max: Duration) -> Self {
        Self {
            max,
            ..Self::default()
        }
    }

    /// Starts (or lengthens) a pause because of `why`; its length.
    pub fn trigger(&self, why: &str) -> Duration {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let next = if s.1.is_zero() {
            Duration::from_secs(1)
        } else {
            (s.1 * 2).min(self.max.max(Duration::from_secs(1)))
        };
        let until = Instant::now() + next;
        if s.0.is_none_or(|u| u < until) {
            s.0 = Some(until);
        }
        s.1 = next;
        s.2 = why.to_owned();
        metrics::gauge!(names::WORKER_PAUSED).set(1.0);
        self.started.notify_waiters();
        next
    }

    /// Until when (and why) the worker pauses, if it does now.
    pub fn until(&self) -> Option<(Instant, String)> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.0.filter(|u| *u > Instant::now())
            .map(|u| (u, s.2.clone()))
    }

    /// Waits until the pause that runs until `until` is over — it may grow
    /// meanwhile (an item handed back found the disk full again) — and
    /// ends it: `true`; `false` when shutdown came first.
    pub async fn wait_out(&self, until: Instant, shutdown: &CancellationToken) -> bool {
        let mut until = until;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until.into()) => {}
                _ = shutdown.cancelled() => return false,
            }
            match self.until() {
                Some((later, _)) => until = later,
                None => break,
            }
        }
        self.ended();
        true
    }

    /// The pause is over (the consume loop resumes).
    pub fn ended(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.0 = None;
        metrics::gauge!(names::WORKER_PAUSED).set(0.0);
    }

    /// An item committed: the disk takes writes again; the next pause starts short.
    pub fn reset(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.1 = Duration::ZERO;
    }
}
