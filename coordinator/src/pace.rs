//! A job's pace against its `[job] deadline`, and what it costs at
//! `[job] worker_hour_cost`: measured by the coordinator that supervises
//! the job, every `--pace-interval` (5 s), and kept in its record (`pace`) for
//! `status`, `scale-advice` and the summary.
//!
//! The model is the fleet as it is now. The rate is rows of this job per
//! worker-second of its pool over the last minute (or longer, until a row
//! settled), with the pool shared among its jobs as it is now: every
//! figure scales the fleet, not the mix. So a job that needs twice the
//! rate needs twice the workers; when another job of the pool ends, the
//! rate rises and the need falls on its own. The job's cost counts each of
//! the pool's workers for the job's share of the pool (its priority weight
//! among the pool's active jobs) while it ran.

use batchfleet_shared::metrics::{names, JOB_LABEL};
use batchfleet_shared::store::{JobRecord, Pace, RecordUpdate, Store};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How often the pace is measured by default (`--pace-interval`).
pub const PACE_EVERY: Duration = Duration::from_secs(5);
/// The rate is measured over at least this many pace intervals.
const WINDOW_INTERVALS: u32 = 12;
/// A pace older than this is not counted in its pool's need (its
/// coordinator is gone, or stuck).
pub const FRESH_MS: u64 = 30_000;
/// How long a job with neither a deadline nor a cost goes unlooked-at.
const UNPACED_RECHECK: Duration = Duration::from_secs(60);
/// Samples kept at most (a day at [`PACE_EVERY`]).
const MAX_SAMPLES: usize = 17_280;

/// One measurement: when, the job's settled rows, the pool's
/// worker-seconds since the tracker started.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ms: u64,
    rows_done: u64,
    pool_worker_s: f64,
}

/// What the pace is measured from at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observed {
    /// Now (ms since the epoch).
    pub now_ms: u64,
    /// Rows settled.
    pub rows_done: u64,
    /// Rows planned.
    pub rows_total: u64,
    /// Items neither committed nor failed.
    pub items_left: u64,
    /// Workers consuming the pool now.
    pub workers: u32,
    /// The job's share of the pool now (0–1).
    pub share: f64,
    /// `[job] deadline` (ms since the epoch; 0: none).
    pub deadline_ms: u64,
}

/// Follows one job's pace from sample to sample.
#[derive(Debug)]
pub struct Tracker {
    /// The rate is measured over at least this much of the recent past.
    window_ms: u64,
    samples: VecDeque<Sample>,
    /// Workers and share at the last sample: they held until this one.
    last: Option<(u32, f64)>,
    pool_worker_s: f64,
    worker_s: f64,
}

impl Default for Tracker {
    fn default() -> Self {
        Self::new(PACE_EVERY, 0.0)
    }
}

impl Tracker {
    /// A tracker sampled every `every`, going on from `worker_s` already
    /// used (a job followed again, by this or another coordinator).
    pub fn new(every: Duration, worker_s: f64) -> Self {
        Self {
            window_ms: (every * WINDOW_INTERVALS).as_millis() as u64,
            samples: VecDeque::new(),
            last: None,
            pool_worker_s: 0.0,
            worker_s: worker_s.max(0.0),
        }
    }

    /// Adds a sample and says what the pace is now.
    pub fn observe(&mut self, o: Observed) -> Pace {
        // The workers seen at both ends of the interval: one that joined
        // in it was still starting (loading its model), one that left
        // drained its last items into it. Counting the fewer keeps a
        // scale-up from reading as a slower fleet (a need that rises
        // because workers were added would add more).
        if let (Some((workers, share)), Some(prev)) = (self.last, self.samples.back()) {
            let dt = o.now_ms.saturating_sub(prev.at_ms) as f64 / 1000.0;
            let workers = f64::from(workers.min(o.workers));
            let share = (share + o.share.clamp(0.0, 1.0)) / 2.0;
            self.pool_worker_s += workers * dt;
            self.worker_s += workers * dt * share;
        }
        self.last = Some((o.workers, o.share.clamp(0.0, 1.0)));
        self.samples.push_back(Sample {
            at_ms: o.now_ms,
            rows_done: o.rows_done,
            pool_worker_s: self.pool_worker_s,
        });
        if self.samples.len() > MAX_SAMPLES {
            self.samples.pop_front();
        }
        let rate = self.rate();
        let remaining = o.rows_total.saturating_sub(o.rows_done);
        let finish_ms = rate.filter(|_| o.workers > 0).map(|r| {
            let s = remaining as f64 / (r * f64::from(o.workers));
            o.now_ms.saturating_add((s * 1000.0).min(1e15) as u64)
        });
        let workers_needed = (o.deadline_ms > 0)
            .then_some(rate)
            .flatten()
            .map(|r| needed(remaining, o.items_left, r, o.deadline_ms, o.now_ms));
        let late = o.deadline_ms > 0
            && remaining > 0
            && rate.is_some()
            && finish_ms.is_none_or(|f| f > o.deadline_ms);
        Pace {
            at_ms: o.now_ms,
            workers: o.workers,
            rows_per_worker_s: rate,
            workers_needed,
            finish_ms,
            late,
            worker_s: self.worker_s,
            worker_s_to_go: rate.map(|r| remaining as f64 / r * o.share.clamp(0.0, 1.0)),
        }
    }

    /// Rows per pool worker-second from the newest sample back over at
    /// least its window, and further back until rows settled in it.
    fn rate(&self) -> Option<f64> {
        let newest = self.samples.back()?;
        for s in self.samples.iter().rev().skip(1) {
            let rows = newest.rows_done.saturating_sub(s.rows_done);
            let worker_s = newest.pool_worker_s - s.pool_worker_s;
            if newest.at_ms.saturating_sub(s.at_ms) >= self.window_ms && rows > 0 && worker_s > 0.0
            {
                return Some(rows as f64 / worker_s);
            }
        }
        // Less than a window so far: all of it, once rows settled.
        let first = self.samples.front()?;
        let rows = newest.rows_done.saturating_sub(first.rows_done);
        let worker_s = newest.pool_worker_s - first.pool_worker_s;
        (rows > 0 && worker_s > 0.0).then(|| rows as f64 / worker_s)
    }
}

/// Workers that finish `remaining` rows by `deadline_ms` at `rate` rows per
/// worker-second: at least one while rows remain, and no more than the
/// items left (a worker takes a whole item); with the deadline past, every
/// worker the items left can use.
fn needed(remaining: u64, items_left: u64, rate: f64, deadline_ms: u64, now_ms: u64) -> u32 {
    if remaining == 0 || items_left == 0 {
        return 0;
    }
    let cap = u32::try_from(items_left).unwrap_or(u32::MAX);
    let left_s = deadline_ms.saturating_sub(now_ms) as f64 / 1000.0;
    if left_s <= 0.0 {
        return cap;
    }
    let n = (remaining as f64 / (rate * left_s)).ceil();
    (n.min(f64::from(cap)) as u32).max(1)
}

/// The pool's need: the most any of its jobs with a fresh pace needs (the
/// fleet that finishes every one of them on time, the pool shared as now).
pub fn pool_needed<'a>(paces: impl IntoIterator<Item = &'a Pace>, now_ms: u64) -> u32 {
    paces
        .into_iter()
        .filter(|p| p.is_fresh(now_ms, FRESH_MS))
        .filter_map(|p| p.workers_needed)
        .max()
        .unwrap_or(0)
}

/// What a job's record says of its deadline and cost, for `status`,
/// `scale-advice` and `_summary.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Outlook {
    /// `[job] deadline` (RFC 3339), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    /// Seconds until it (negative once past).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_left_s: Option<f64>,
    /// When the job finishes at its measured rate with the workers it has
    /// (RFC 3339; a finished job: when it finished).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projected_finish: Option<String>,
    /// It will finish, or finished, after its deadline.
    pub late: bool,
    /// Workers consuming its pool when last measured.
    pub workers: u32,
    /// Workers its pool needs for it to finish by its deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers_needed: Option<u32>,
    /// Rows per worker-second of its pool (the pool shared as now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_per_worker_s: Option<f64>,
    /// Worker-hours it used (its share of its pool's workers).
    pub worker_hours: f64,
    /// Worker-hours it still needs at this rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_hours_to_go: Option<f64>,
    /// `[job] worker_hour_cost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_hour_cost: Option<f64>,
    /// What it cost so far (or in all, finished).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    /// What it will cost still at this rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_to_go: Option<f64>,
    /// Cost per million rows settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_million_rows: Option<f64>,
    /// When the pace was measured (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<String>,
}

impl Outlook {
    /// The outlook of `job` at `now_ms`; `None` for a job with neither a
    /// deadline nor a worker-hour cost.
    pub fn of(job: &JobRecord, now_ms: u64) -> Option<Self> {
        if job.deadline_ms == 0 && job.worker_hour_cost.is_none() {
            return None;
        }
        let pace = job.pace.clone().unwrap_or_default();
        let finished = job.finished_ms > 0;
        let running = !finished && !job.status.is_final();
        let finish_ms = if finished {
            Some(job.finished_ms)
        } else {
            pace.finish_ms.filter(|_| running)
        };
        let deadline = (job.deadline_ms > 0).then_some(job.deadline_ms);
        let late = match (deadline, finished) {
            (Some(d), true) => job.finished_ms > d,
            (Some(_), false) => running && pace.late,
            (None, _) => false,
        };
        let per_hour = job.worker_hour_cost;
        let to_go = pace.worker_s_to_go.filter(|_| running);
        let cost = per_hour.map(|c| cost(pace.worker_s, c));
        Some(Self {
            deadline: deadline.map(rfc3339),
            deadline_left_s: deadline.map(|d| (d as f64 - now_ms as f64) / 1000.0),
            projected_finish: finish_ms.map(rfc3339),
            late,
            workers: pace.workers,
            workers_needed: pace
                .workers_needed
                .filter(|_| running && deadline.is_some()),
            rows_per_worker_s: pace.rows_per_worker_s,
            worker_hours: pace.worker_s / 3600.0,
            worker_hours_to_go: to_go.map(|s| s / 3600.0),
            worker_hour_cost: per_hour,
            cost,
            cost_to_go: per_hour.zip(to_go).map(|(c, s)| self::cost(s, c)),
            cost_per_million_rows: cost
                .filter(|_| job.rows_done > 0)
                .map(|c| c / job.rows_done as f64 * 1e6),
            measured_at: (pace.at_ms > 0).then(|| rfc3339(pace.at_ms)),
        })
    }

    /// For people: a few lines, each starting with its label.
    pub fn render(&self) -> String {
        let mut lines = Vec::new();
        if let Some(d) = &self.deadline {
            let left = self.deadline_left_s.unwrap_or(0.0);
            let when = if left >= 0.0 {
                format!("in {}", crate::status::human_secs(left))
            } else {
                format!("{} ago", crate::status::human_secs(-left))
            };
            lines.push(format!("deadline  {d} ({when})"));
        }
        let finish = match (&self.projected_finish, self.rows_per_worker_s) {
            (Some(f), _) => f.clone(),
            (None, None) => "not known yet (no rows settled)".into(),
            (None, Some(_)) => "never at this size (no worker)".into(),
        };
        let verdict = match (&self.deadline, self.late) {
            (None, _) => String::new(),
            (Some(_), true) => " — LATE".into(),
            (Some(_), false) => " — on time".into(),
        };
        lines.push(format!("finish    {finish}{verdict}"));
        if self.deadline.is_some() {
            let need = self
                .workers_needed
                .map_or_else(|| "not known yet".to_owned(), |n| n.to_string());
            lines.push(format!(
                "sizing    {} worker(s) now, {need} needed for the deadline",
                self.workers
            ));
        }
        let hours = format!("{:.2} worker-hours", self.worker_hours);
        lines.push(match (self.cost, self.cost_to_go) {
            (Some(c), Some(g)) => format!("cost      {c:.2} so far ({hours}), about {g:.2} to go"),
            (Some(c), None) => format!("cost      {c:.2} ({hours})"),
            (None, _) => format!("used      {hours}"),
        });
        lines.join("\n")
    }
}

/// Money for `worker_s` worker-seconds at `per_hour`.
pub fn cost(worker_s: f64, per_hour: f64) -> f64 {
    worker_s / 3600.0 * per_hour
}

/// A time (ms since the epoch) in RFC 3339, to the second.
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Measures a job's pace for the coordinator that supervises it: every
/// `--pace-interval` (and once more at the end), for a job with a deadline or
/// a worker-hour cost; writes it to the record and the gauges, and warns
/// once each time the job falls behind its deadline.
pub struct Pacer {
    tracker: Option<Tracker>,
    measured: Option<Instant>,
    unpaced_until: Option<Instant>,
    late: bool,
    consumers: Option<std::sync::Arc<dyn batchfleet_shared::broker::Broker>>,
}

impl Pacer {
    /// Nothing measured yet.
    pub fn new() -> Self {
        Self {
            tracker: None,
            measured: None,
            unpaced_until: None,
            late: false,
            consumers: None,
        }
    }

    /// For `job` as its follower read it at the start: one with neither a
    /// deadline nor a cost is not read again for a minute (a short job is
    /// never read for its pace at all).
    pub fn for_job(job: &JobRecord) -> Self {
        let unpaced = job.deadline_ms == 0 && job.worker_hour_cost.is_none();
        Self {
            unpaced_until: unpaced.then(|| Instant::now() + UNPACED_RECHECK),
            ..Self::new()
        }
    }

    /// Measures now if `--pace-interval` has passed (or `now` is set), from
    /// the job's counters as its follower just read them.
    pub async fn tick(
        &mut self,
        store: &Store,
        cfg: &crate::config::RunConfig,
        job_id: &str,
        progress: &batchfleet_shared::store::Progress,
        now: bool,
    ) {
        let every = cfg.supervise.pace_every;
        if !now && self.measured.is_some_and(|m| m.elapsed() < every) {
            return;
        }
        self.measured = Some(Instant::now());
        if self.unpaced_until.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let job = match store.job(job_id).await {
            Ok(Some(job)) if job.deadline_ms > 0 || job.worker_hour_cost.is_some() => job,
            Ok(_) => {
                // Neither: looked at again a minute on (a run of the
                // manifest may give it a deadline), not every interval.
                self.unpaced_until = Some(Instant::now() + UNPACED_RECHECK);
                return;
            }
            Err(e) => {
                tracing::debug!(job = %job_id, error = %e, "could not read the job for its pace");
                return;
            }
        };
        let workers = self.workers(cfg, &job.pool).await;
        let (share, others) = match store.active_jobs(&job.pool).await {
            Ok(active) => {
                let total: u32 = active.values().sum();
                let mine = active.get(job_id).copied().unwrap_or(0);
                let share = if total > 0 {
                    f64::from(mine) / f64::from(total)
                } else {
                    1.0
                };
                let others: Vec<String> = active.into_keys().filter(|id| id != job_id).collect();
                (share, others)
            }
            Err(_) => (1.0, Vec::new()),
        };
        let now_ms = match store.now_ms().await {
            Ok(ms) => ms,
            Err(_) => batchfleet_shared::now_ms(),
        };
        let tracker = self.tracker.get_or_insert_with(|| {
            Tracker::new(every, job.pace.as_ref().map_or(0.0, |p| p.worker_s))
        });
        let pace = tracker.observe(Observed {
            now_ms,
            rows_done: progress.rows_done,
            rows_total: progress.rows_total,
            items_left: progress
                .items_total
                .saturating_sub(progress.items_done + progress.items_failed),
            workers,
            share,
            deadline_ms: job.deadline_ms,
        });
        if let Err(e) = store
            .update_job(job_id, &RecordUpdate::Pace(pace.clone()))
            .await
        {
            tracing::debug!(job = %job_id, error = %e, "could not record the job's pace");
        }
        let mut paces = vec![pace.clone()];
        for id in others {
            if let Ok(Some(p)) = store.job_pace(&id).await {
                paces.push(p);
            }
        }
        let pool_need = pool_needed(&paces, now_ms);
        gauges(&job, &pace, pool_need, now_ms);
        self.say_if_late(&job, &pace, pool_need);
    }

    /// Consumers of the pool's work queue (0 when the broker cannot say;
    /// a connection that failed is opened again at the next interval).
    async fn workers(&mut self, cfg: &crate::config::RunConfig, pool: &str) -> u32 {
        if self.consumers.is_none() {
            self.consumers = cfg.connections.broker("batchfleet pace").await.ok();
        }
        let Some(broker) = &self.consumers else {
            return 0;
        };
        let queue = batchfleet_shared::broker::PoolQueues::new(pool).work();
        match broker.consumer_count(&queue).await {
            Ok(n) => n.unwrap_or(0),
            Err(_) => {
                self.consumers = None;
                0
            }
        }
    }

    fn say_if_late(&mut self, job: &JobRecord, pace: &Pace, pool_need: u32) {
        if pace.late == self.late {
            return;
        }
        self.late = pace.late;
        let deadline = rfc3339(job.deadline_ms);
        if pace.late {
            let finish = pace
                .finish_ms
                .map_or_else(|| "never (no worker)".to_owned(), rfc3339);
            tracing::warn!(
                job = %job.id,
                pool = %job.pool,
                deadline = %deadline,
                projected_finish = %finish,
                workers = pace.workers,
                workers_needed = pace.workers_needed,
                pool_workers_needed = pool_need,
                "the job will miss its deadline at the fleet's current size: it would finish at {finish} with {} worker(s); the pool needs {pool_need} (batchfleet_pool_workers_needed, `batchfleet scale-advice`)",
                pace.workers
            );
        } else {
            tracing::info!(job = %job.id, deadline = %deadline, workers = pace.workers, "the job is on time for its deadline again");
        }
    }
}

impl std::fmt::Debug for Pacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pacer")
            .field("tracker", &self.tracker)
            .field("late", &self.late)
            .finish_non_exhaustive()
    }
}

impl Default for Pacer {
    fn default() -> Self {
        Self::new()
    }
}

fn gauges(job: &JobRecord, pace: &Pace, pool_need: u32, now_ms: u64) {
    let jl = [(JOB_LABEL, job.id.clone()), ("pool", job.pool.clone())];
    metrics::gauge!(names::POOL_WORKERS_NEEDED, "pool" => job.pool.clone())
        .set(f64::from(pool_need));
    if job.deadline_ms > 0 {
        metrics::gauge!(names::JOB_WORKERS_NEEDED, &jl)
            .set(f64::from(pace.workers_needed.unwrap_or(0)));
        metrics::gauge!(names::JOB_DEADLINE_LATE, &jl).set(if pace.late { 1.0 } else { 0.0 });
        metrics::gauge!(names::JOB_DEADLINE_SECONDS_LEFT, &jl)
            .set(job.deadline_ms.saturating_sub(now_ms) as f64 / 1000.0);
    }
    metrics::gauge!(names::JOB_WORKER_SECONDS, &jl).set(pace.worker_s);
    if let Some(per_hour) = job.worker_hour_cost {
        metrics::gauge!(names::JOB_COST, &jl).set(cost(pace.worker_s, per_hour));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: u64, rows_done: u64, workers: u32) -> Observed {
        Observed {
            now_ms: 1_000_000 + s * 1000,
            rows_done,
            rows_total: 100_000,
            items_left: 100,
            workers,
            share: 1.0,
            deadline_ms: 1_000_000 + 1_000 * 1000,
        }
    }

    #[test]
    fn the_need_is_the_remaining_rows_over_the_rate_per_worker_and_the_time_left() {
        let mut t = Tracker::default();
        assert_eq!(t.observe(at(0, 0, 2)).rows_per_worker_s, None);
        // Two workers, 20 rows/s in all: 10 rows per worker-second.
        let p = t.observe(at(10, 200, 2));
        assert_eq!(p.rows_per_worker_s, Some(10.0));
        // 99,800 rows in 990 s at 10 per worker-second: 10.08, so 11 workers.
        assert_eq!(p.workers_needed, Some(11));
        assert!(p.late, "two workers finish after the deadline");
        assert_eq!(p.finish_ms, Some(1_010_000 + 4_990_000));
        assert!((p.worker_s - 20.0).abs() < 1e-9);
        assert_eq!(p.worker_s_to_go, Some(9_980.0));
    }

    #[test]
    fn the_need_rises_when_workers_go_and_falls_when_they_come() {
        let mut t = Tracker::default();
        t.observe(at(0, 0, 10));
        // Ten workers at 10 rows per worker-second: on time.
        let on_time = t.observe(at(100, 10_000, 10));
        assert!(!on_time.late);
        // Eight of them left: the same rate per worker, less done per second.
        let mut s = 100;
        let mut rows = 10_000;
        let mut short = on_time.clone();
        for _ in 0..20 {
            s += 10;
            rows += 200;
            short = t.observe(at(s, rows, 2));
        }
        assert_eq!(short.rows_per_worker_s, Some(10.0));
        assert!(short.late);
        let need = short.workers_needed.unwrap();
        assert!(need > on_time.workers_needed.unwrap(), "{short:?}");
        // Twenty workers: the need falls.
        let mut more = short;
        for _ in 0..20 {
            s += 10;
            rows += 2_000;
            more = t.observe(at(s, rows, 20));
        }
        assert!(more.workers_needed.unwrap() < need, "{more:?}");
        assert!(!more.late);
    }

    #[test]
    fn the_rate_reaches_back_until_rows_settled_and_shares_count_in_the_cost() {
        let mut t = Tracker::new(PACE_EVERY, 100.0);
        let half = |s, rows| Observed {
            share: 0.5,
            ..at(s, rows, 4)
        };
        t.observe(half(0, 0));
        t.observe(half(60, 600));
        // A long item: nothing settles for two minutes; the rate stays.
        t.observe(half(120, 600));
        let p = t.observe(half(180, 600));
        assert_eq!(p.rows_per_worker_s, Some(600.0 / (4.0 * 180.0)));
        // 180 s × 4 workers × half the pool, on top of the 100 before.
        assert!((p.worker_s - (100.0 + 360.0)).abs() < 1e-9, "{p:?}");
    }

    #[test]
    fn no_deadline_needs_nothing_a_past_one_every_item_and_no_rate_is_not_late() {
        let mut t = Tracker::default();
        let no_deadline = |s, rows| Observed {
            deadline_ms: 0,
            ..at(s, rows, 1)
        };
        t.observe(no_deadline(0, 0));
        let p = t.observe(no_deadline(10, 100));
        assert_eq!((p.workers_needed, p.late), (None, false));
        assert_eq!(needed(1_000, 7, 1.0, 5, 10), 7);
        assert_eq!(needed(0, 7, 1.0, 5_000, 10), 0);
        assert_eq!(needed(1, 7, 1_000.0, 100_000, 10), 1);
        let mut idle = Tracker::default();
        idle.observe(at(0, 0, 0));
        let p = idle.observe(at(30, 0, 0));
        assert_eq!(
            (p.rows_per_worker_s, p.late, p.finish_ms),
            (None, false, None)
        );
    }

    #[test]
    fn the_pool_needs_the_most_any_fresh_pace_needs() {
        let pace = |at_ms, n| Pace {
            at_ms,
            workers_needed: Some(n),
            ..Pace::default()
        };
        let now = 100_000;
        let paces = [
            pace(now, 3),
            pace(now - 5_000, 7),
            pace(now - FRESH_MS - 1, 50),
        ];
        assert_eq!(pool_needed(&paces, now), 7);
        assert_eq!(pool_needed(&[], now), 0);
        assert!((cost(1800.0, 1.2) - 0.6).abs() < 1e-12);
    }

    #[test]
    fn the_outlook_of_a_running_and_a_finished_job() {
        let pace = Pace {
            at_ms: 1_000_000,
            workers: 2,
            rows_per_worker_s: Some(10.0),
            workers_needed: Some(5),
            finish_ms: Some(9_000_000),
            late: true,
            worker_s: 7_200.0,
            worker_s_to_go: Some(3_600.0),
        };
        let running = JobRecord {
            status: batchfleet_shared::store::JobStatus::Running,
            deadline_ms: 5_000_000,
            worker_hour_cost: Some(1.5),
            rows_done: 2_000_000,
            pace: Some(pace),
            ..JobRecord::sample("j-1")
        };
        let o = Outlook::of(&running, 1_000_000).expect("an outlook");
        assert_eq!(o.deadline_left_s, Some(4_000.0));
        assert!(o.late);
        assert_eq!(o.workers_needed, Some(5));
        assert_eq!((o.cost, o.cost_to_go), (Some(3.0), Some(1.5)));
        assert_eq!(o.cost_per_million_rows, Some(1.5));
        let text = o.render();
        assert!(text.contains("LATE") && text.contains("5 needed"), "{text}");
        // Finished before its deadline: on time, nothing more to go or need.
        let done = JobRecord {
            status: batchfleet_shared::store::JobStatus::Completed,
            finished_ms: 4_000_000,
            ..running.clone()
        };
        let o = Outlook::of(&done, 4_000_000).expect("an outlook");
        assert!(!o.late);
        assert_eq!((o.workers_needed, o.cost_to_go), (None, None));
        assert_eq!(
            o.projected_finish.as_deref(),
            Some(rfc3339(4_000_000).as_str())
        );
        // Neither a deadline nor a cost: no outlook.
        let plain = JobRecord {
            deadline_ms: 0,
            worker_hour_cost: None,
            ..running
        };
        assert!(Outlook::of(&plain, 1).is_none());
    }

    #[test]
    fn workers_that_just_joined_do_not_read_as_a_slower_fleet() {
        let mut t = Tracker::default();
        t.observe(at(0, 0, 2));
        let before = t.observe(at(10, 200, 2));
        // Eight more joined in the last interval, still loading their model:
        // the same two produced its rows.
        let joined = t.observe(at(15, 300, 10));
        assert_eq!(joined.rows_per_worker_s, before.rows_per_worker_s);
        assert!(joined.workers_needed <= before.workers_needed, "{joined:?}");
    }
}
