//! Follows a running job through its Redis counters until every item is
//! committed or failed for good: a progress bar on a terminal, periodic log
//! lines otherwise. Enforces the job's error budget, and lets the
//! [`Supervisor`] act on dead workers, stragglers and lost state. A Redis or
//! RabbitMQ outage only pauses it: it keeps polling until they are back.

use crate::config::RunConfig;
use crate::error::RunError;
use crate::manifest::ErrorBudget;
use crate::supervisor::Supervisor;
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::{JobStatus, Progress, Store};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How following a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Followed {
    /// Every planned item is committed or failed for good.
    AllDone,
    /// More items failed than the error budget allows; the job is marked
    /// `failed` and workers skip its remaining items.
    BudgetExceeded,
    /// The job was failed at once because nobody can run it (a worker found
    /// its model unusable, or no able worker took its items in time); its
    /// remaining items are skipped.
    JobFailed,
    /// `batchfleet cancel` stopped the job; its remaining items are skipped.
    Cancelled,
    /// A shutdown signal arrived first.
    Interrupted,
}

/// Log a plain progress line this often when no terminal shows the bar.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// Warn once when nothing was committed for this long (no workers running?).
const IDLE_WARNING: Duration = Duration::from_secs(30);

/// With nothing settled for this long, [`follow`] asks the broker whether
/// any worker consumes the job's pool.
const NO_CONSUMER_CHECK: Duration = Duration::from_secs(5);
/// A pool with no consumer for this long gets a warning.
const NO_CONSUMER_WARNING: Duration = Duration::from_secs(10);

/// Whether anyone consumes the job's pool: asked of the broker (one
/// connection, opened the first time) every [`NO_CONSUMER_CHECK`] while
/// nothing settles, warned about once the pool had no consumer for
/// [`NO_CONSUMER_WARNING`], and again after a consumer came and went.
#[derive(Default)]
struct Consumers {
    broker: Option<std::sync::Arc<dyn batchfleet_shared::broker::Broker>>,
    asked: Option<Instant>,
    none_since: Option<Instant>,
    warned: bool,
}

impl Consumers {
    async fn check(&mut self, cfg: &RunConfig, pool: &str, bar: &indicatif::ProgressBar) {
        if self.asked.is_some_and(|a| a.elapsed() < NO_CONSUMER_CHECK) {
            return;
        }
        self.asked = Some(Instant::now());
        if self.broker.is_none() {
            self.broker = cfg.connections.broker("batchfleet monitor").await.ok();
        }
        let Some(broker) = &self.broker else { return };
        let queue = batchfleet_shared::broker::PoolQueues::new(pool).work();
        match broker.consumer_count(&queue).await {
            Ok(Some(0)) => {
                let since = *self.none_since.get_or_insert_with(Instant::now);
                if !self.warned && since.elapsed() >= NO_CONSUMER_WARNING {
                    self.warned = true;
                    let msg = format!(
                        "no worker consumes pool \"{pool}\": queue {queue} has had no consumer for {}s, so the job waits until one does — start one with `batchfleet-worker --pool {pool} --data-root <the folder holding the job's files>` (or BATCHFLEET_POOL={pool})",
                        since.elapsed().as_secs()
                    );
                    if bar.is_hidden() {
                        tracing::warn!("{msg}")
                    } else {
                        bar.println(msg)
                    }
                }
            }
            Ok(_) => {
                self.none_since = None;
                self.warned = false;
            }
            Err(e) => tracing::debug!(error = %e, "could not count the pool's consumers"),
        }
    }
}

/// Items left at which [`follow`] polls every [`FAST_POLL`].
const FAST_POLL_REMAINING: u64 = 8;

/// How long [`follow`] waits before its next poll: `poll_interval`, but no
/// more than half the time the remaining items should take at the rate
/// items have settled so far (and [`FAST_POLL`] for the last few), so that
/// the end of a short job is seen within [`FAST_POLL`] of it rather than up
/// to a whole `poll_interval` later.
fn next_wait(poll_interval: Duration, remaining: u64, items_per_s: f64) -> Duration {
    let fast = poll_interval.min(FAST_POLL);
    if remaining <= FAST_POLL_REMAINING {
        return fast;
    }
    if items_per_s <= 0.0 || !items_per_s.is_finite() {
        return poll_interval;
    }
    let half_left = Duration::from_secs_f64((remaining as f64 / items_per_s / 2.0).min(3600.0));
    half_left.clamp(fast, poll_interval)
}

/// Poll interval once only the last few items remain.
const FAST_POLL: Duration = Duration::from_millis(20);

/// How long a follower lease lasts without being renewed; it is renewed
/// every [`FOLLOW_RENEW`].
pub const FOLLOW_TTL: Duration = Duration::from_secs(10);
/// How often the follower lease is renewed (or, by a watcher, tried).
const FOLLOW_RENEW: Duration = Duration::from_secs(1);

/// Polls the job's counters every `cfg.poll_interval` (every [`FAST_POLL`]
/// for the last few items) until all items are settled. Of the processes
/// following one job, the one holding its follower lease (`me`) runs the
/// supervisor; the others watch, and take over when the lease lapses.
pub async fn follow(
    store: &Store,
    job_id: &str,
    cfg: &RunConfig,
    shutdown: CancellationToken,
    supervisor: &mut Supervisor,
    me: &str,
) -> Result<Followed, RunError> {
    let job = match store.job(job_id).await? {
        Some(job) => job,
        None => {
            // Lost with Redis's data: the supervisor rebuilds it from the files.
            supervisor.tick(store, None).await;
            store.job(job_id).await?.ok_or_else(|| {
                RunError::UnknownJob(format!(
                    "job {job_id} is not in Redis and could not be rebuilt"
                ))
            })?
        }
    };
    supervisor.remember(&job);
    let mut pacer = crate::pace::Pacer::for_job(&job);
    let budget = ErrorBudget {
        max_failed_items: job.max_failed_items,
        max_failed_percent: job.max_failed_percent,
        max_crashes: job.max_crashes,
        max_rejected_rows: job.max_rejected_rows,
        max_rejected_percent: job.max_rejected_percent,
    };
    let pool = job.pool;
    let created_ms = job.created_ms;
    let first = store.progress(job_id).await?;
    let mut outage: Option<Instant> = None;
    let bar = progress_bar(cfg.progress, first.rows_total);
    // Log lines go above the bar while it is drawn, not through it.
    let _logs_above = (!bar.is_hidden()).then(|| {
        let bar = bar.clone();
        batchfleet_shared::telemetry::logs_above(std::sync::Arc::new(move |write| {
            bar.suspend(write)
        }))
    });
    let started = Instant::now();
    let start_rows = first.rows_done;
    let start_items = first.items_done + first.items_failed;
    let mut last_change = Instant::now();
    let mut last_log = Instant::now();
    let mut last = first;
    let mut warned = false;
    let mut first_poll = true;
    let (mut holder, mut renewed) = (false, None::<Instant>);
    let mut consumers = Consumers::default();
    loop {
        // At once the first time (the supervisor sets its gauges then); near
        // the end, poll fast so the job's end is seen at once. The supervisor
        // throttles itself (`SuperviseConfig::every`), so it is asked each time.
        let remaining = last
            .items_total
            .saturating_sub(last.items_done + last.items_failed);
        let settled_since =
            (last.items_done + last.items_failed).saturating_sub(start_items) as f64;
        let wait = if std::mem::take(&mut first_poll) {
            Duration::ZERO
        } else if last.items_total > 0 {
            let items_per_s = settled_since / started.elapsed().as_secs_f64().max(1e-3);
            next_wait(cfg.poll_interval, remaining, items_per_s)
        } else {
            cfg.poll_interval
        };
        tokio::select! {
            _ = shutdown.cancelled() => {
                bar.abandon_with_message("interrupted; the workers keep going — run the same manifest again to follow the job");
                return Ok(Followed::Interrupted);
            }
            _ = tokio::time::sleep(wait) => {}
        }
        if renewed.is_none_or(|at| at.elapsed() >= FOLLOW_RENEW) {
            renewed = Some(Instant::now());
            holder = renew(store, job_id, me, holder).await;
        }
        // One read of the counters serves the check and the follower.
        let read = store.progress(job_id).await;
        if holder {
            supervisor.tick(store, read.as_ref().ok()).await;
        }
        let p = match read {
            Ok(p) if p.items_total > 0 => p,
            Ok(_) => continue, // the record is being rebuilt
            Err(e) => {
                if outage.is_none() {
                    tracing::warn!(job = %job_id, error = %e, "Redis unavailable; waiting for it to come back");
                    outage = Some(Instant::now());
                }
                continue;
            }
        };
        if let Some(since) = outage.take() {
            tracing::info!(job = %job_id, down_s = since.elapsed().as_secs(), "Redis is back");
        }
        if p != last {
            last_change = Instant::now();
        }
        let rate = (p.rows_done - start_rows.min(p.rows_done)) as f64
            / started.elapsed().as_secs_f64().max(1e-3);
        bar.set_position(p.rows_done);
        bar.set_message(items_message(&p));
        job_gauges(job_id, &pool, &p, rate, eta(&p, rate), created_ms);
        if holder {
            pacer.tick(store, cfg, job_id, &p, false).await;
        }
        if bar.is_hidden() && last_log.elapsed() >= LOG_EVERY {
            last_log = Instant::now();
            tracing::info!(job = %job_id, items_done = p.items_done, items_failed = p.items_failed, items_total = p.items_total, rows_done = p.rows_done, rows_total = p.rows_total, rows_per_s = rate.round(), eta_s = eta(&p, rate), "progress");
        }
        if !p.settled() && last_change.elapsed() >= NO_CONSUMER_CHECK {
            consumers.check(cfg, &pool, &bar).await;
        }
        if !warned && !p.settled() && last_change.elapsed() >= IDLE_WARNING {
            warned = true;
            let msg = format!(
                "no item finished in the last {}s — are workers running on pool \"{}\"? start one with `batchfleet-worker --pool {} --data-root <the folder holding the job's files>`",
                IDLE_WARNING.as_secs(), pool, pool
            );
            if bar.is_hidden() {
                tracing::warn!("{msg}")
            } else {
                bar.println(msg)
            }
        }
        last = p;
        if let Some(how) = ended(store, job_id, &pool, &p, &budget, &bar).await {
            if holder {
                // Its cost up to the end, for the summary.
                pacer.tick(store, cfg, job_id, &p, true).await;
            }
            return Ok(how);
        }
    }
}

/// Takes or renews the job's follower lease as `me`: whether this process
/// holds it now (on a Redis error, what it was).
async fn renew(store: &Store, job_id: &str, me: &str, holder: bool) -> bool {
    let now = store
        .follow_lease(job_id, me, FOLLOW_TTL)
        .await
        .unwrap_or(holder);
    if now != holder {
        tracing::info!(job = %job_id, supervising = now, "{}", if now { "supervising the job (its follower lease is ours)" } else { "another process supervises the job; watching it" });
    }
    now
}

/// How the job ended, if its counters `p` say it did: cancelled, failed
/// (a failure recorded, or the error budget exceeded now, which fails it),
/// or every item settled.
async fn ended(
    store: &Store,
    job_id: &str,
    pool: &str,
    p: &Progress,
    budget: &ErrorBudget,
    bar: &ProgressBar,
) -> Option<Followed> {
    if p.status == Some(JobStatus::Cancelled) {
        bar.abandon_with_message("the job was cancelled; its committed items are kept");
        tracing::warn!(job = %job_id, "the job was cancelled; its remaining items are skipped");
        return Some(Followed::Cancelled);
    }
    if p.status == Some(JobStatus::Failed) {
        let why = store
            .job(job_id)
            .await
            .ok()
            .flatten()
            .map(|j| j.failed_reason)
            .unwrap_or_default();
        bar.abandon_with_message(format!("the job failed: {why}"));
        tracing::error!(job = %job_id, reason = %why, "the job failed; its remaining items are skipped");
        return Some(Followed::JobFailed);
    }
    if budget.exceeded(p.items_failed, p.items_total) {
        let reason = format!(
                "error budget exceeded: {} of {} items failed for good (max_failed_items = {}, max_failed_percent = {})",
                p.items_failed,
                p.items_total,
                budget.max_failed_items.map_or("unset".into(), |v| v.to_string()),
                budget.max_failed_percent.map_or("unset".into(), |v| v.to_string()),
            );
        if let Err(e) = store.fail_job(job_id, "budget", &reason).await {
            tracing::warn!(error = %e, "could not mark the job failed; trying again");
            return None;
        }
        bar.abandon_with_message(format!(
            "{} items failed: error budget exceeded; remaining items are skipped",
            p.items_failed
        ));
        return Some(Followed::BudgetExceeded);
    }
    if let Some(reason) = budget.rejected_too_many(p) {
        if let Err(e) = store.fail_job(job_id, "budget", &reason).await {
            tracing::warn!(error = %e, "could not mark the job failed; trying again");
            return None;
        }
        bar.abandon_with_message(format!("{reason}; remaining items are skipped"));
        tracing::error!(job = %job_id, %reason, "failing the job: too many rows rejected");
        return Some(Followed::BudgetExceeded);
    }
    if p.settled() {
        metrics::gauge!(names::JOB_FINISHED, batchfleet_shared::metrics::JOB_LABEL => job_id.to_owned(), "pool" => pool.to_owned()).set(1.0);
        metrics::gauge!(names::JOB_ETA, batchfleet_shared::metrics::JOB_LABEL => job_id.to_owned(), "pool" => pool.to_owned())
                .set(0.0);
        bar.finish_with_message(items_message(p));
        return Some(Followed::AllDone);
    }
    None
}

/// The job's gauges for Prometheus.
fn job_gauges(job: &str, pool: &str, p: &Progress, rate: f64, eta_s: u64, created_ms: u64) {
    let l = |state: &'static str| {
        [
            (batchfleet_shared::metrics::JOB_LABEL, job.to_owned()),
            ("pool", pool.to_owned()),
            ("state", state.to_owned()),
        ]
    };
    metrics::gauge!(names::JOB_ITEMS, &l("planned")).set(p.items_total as f64);
    metrics::gauge!(names::JOB_ITEMS, &l("done")).set(p.items_done as f64);
    metrics::gauge!(names::JOB_ITEMS, &l("failed")).set(p.items_failed as f64);
    metrics::gauge!(names::JOB_ROWS, &l("planned")).set(p.rows_total as f64);
    metrics::gauge!(names::JOB_ROWS, &l("done")).set(p.rows_done as f64);
    let jl = [
        (batchfleet_shared::metrics::JOB_LABEL, job.to_owned()),
        ("pool", pool.to_owned()),
    ];
    metrics::gauge!(names::JOB_ROWS_PER_SECOND, &jl).set(rate);
    metrics::gauge!(names::JOB_ETA, &jl).set(eta_s as f64);
    metrics::gauge!(names::JOB_FINISHED, &jl).set(0.0);
    let secs = batchfleet_shared::now_ms().saturating_sub(created_ms) as f64 / 1000.0;
    metrics::gauge!(names::JOB_DURATION, &jl).set(secs);
}

fn items_message(p: &Progress) -> String {
    if p.items_failed > 0 {
        format!(
            "items {}/{} ({} failed)",
            p.items_done, p.items_total, p.items_failed
        )
    } else {
        format!("items {}/{}", p.items_done, p.items_total)
    }
}

fn eta(p: &Progress, rows_per_s: f64) -> u64 {
    if rows_per_s <= 0.0 {
        return 0;
    }
    ((p.rows_total.saturating_sub(p.rows_done)) as f64 / rows_per_s).ceil() as u64
}

fn progress_bar(enabled: bool, total_rows: u64) -> ProgressBar {
    // indicatif hides a stderr bar by itself when stderr is not a terminal.
    let target = if enabled {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total_rows), target);
    let style = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {human_pos}/{human_len} rows  {per_sec}  ETA {eta}  {msg}")
        .expect("progress template is valid");
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_is_remaining_rows_over_rate() {
        let p = Progress {
            items_done: 1,
            rows_done: 100,
            items_total: 4,
            rows_total: 400,
            items_failed: 0,
            rows_rejected: 0,
            status: None,
        };
        assert_eq!(eta(&p, 100.0), 3);
        assert_eq!(eta(&p, 0.0), 0);
    }

    #[test]
    fn polls_sooner_as_the_end_of_the_job_nears() {
        let every = Duration::from_millis(250);
        // Far from the end, or no rate yet: the configured interval.
        assert_eq!(next_wait(every, 10_000, 100.0), every);
        assert_eq!(next_wait(every, 100, 0.0), every);
        // 30 items at 100 items/s: 0.3 s left, so poll again in 0.15 s.
        assert_eq!(next_wait(every, 30, 100.0), Duration::from_millis(150));
        // Almost there: the fast poll, never less.
        assert_eq!(next_wait(every, 9, 1_000.0), FAST_POLL);
        assert_eq!(next_wait(every, 3, 0.0), FAST_POLL);
        // A configured interval shorter than the fast poll is kept.
        let short = Duration::from_millis(5);
        assert_eq!(next_wait(short, 3, 0.0), short);
        assert_eq!(next_wait(short, 10_000, 1.0), short);
    }
}
