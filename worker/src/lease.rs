//! The lease on an item a worker works on, and the heartbeat that keeps it
//! fresh in Redis. The coordinator sees what is in flight where, and
//! publishes a copy of an item whose lease goes stale (its worker died).
//!
//! Lease times are Redis's clock (the scripts set them), never this
//! machine's: a worker whose clock is off cannot make its live lease look
//! stale. A lease holder stops its heartbeat when dropped — on every path,
//! a panic included — so an abandoned item's lease goes stale and the item
//! is taken over instead of hanging its job.

use crate::context::ItemContext;
use crate::settle::Held;
use batchfleet_shared::message::WorkItem;
use batchfleet_shared::store::Lease;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The lease on an item and the heartbeat task that keeps it fresh.
pub struct LeaseGuard {
    lease: Lease,
    job: String,
    /// Rows of the item finished so far (checkpointed segments), for the heartbeat.
    pub rows_done: Arc<AtomicU64>,
    /// Rows skipped thanks to a checkpoint, for the heartbeat.
    pub rows_resumed: Arc<AtomicU64>,
    /// Cancelled when the heartbeat finds the item done elsewhere.
    pub done_elsewhere: CancellationToken,
    /// Cancelled when the item waited longer than `ack_after` without
    /// reaching the model: it goes back to the queue for another worker.
    pub waited_too_long: CancellationToken,
    /// Set once the item had its first turn at the model. Only such an item
    /// is acknowledged early, so unacknowledged items never exceed `--prefetch`.
    pub at_model: Arc<AtomicBool>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
    ctx: Arc<ItemContext>,
    released: bool,
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("job", &self.job)
            .field("seq", &self.lease.seq)
            .finish_non_exhaustive()
    }
}

impl LeaseGuard {
    /// The lease `Store::start_item` wrote for `item` at `at_ms` (Redis
    /// time), with its heartbeat started.
    pub fn new(
        item: &WorkItem,
        attempt: u32,
        at_ms: u64,
        held: Arc<Held>,
        ctx: Arc<ItemContext>,
    ) -> Self {
        let lease = lease_for(item, attempt, &ctx, at_ms);
        let rows_done = Arc::new(AtomicU64::new(0));
        let rows_resumed = Arc::new(AtomicU64::new(0));
        let done_elsewhere = CancellationToken::new();
        let waited_too_long = CancellationToken::new();
        let at_model = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let task = tokio::spawn(heartbeat_loop(Heartbeat {
            job: item.job_id.clone(),
            lease: lease.clone(),
            held,
            ctx: ctx.clone(),
            rows_done: rows_done.clone(),
            rows_resumed: rows_resumed.clone(),
            done_elsewhere: done_elsewhere.clone(),
            waited_too_long: waited_too_long.clone(),
            at_model: at_model.clone(),
            stop: stop.clone(),
        }));
        Self {
            lease,
            job: item.job_id.clone(),
            rows_done,
            rows_resumed,
            done_elsewhere,
            waited_too_long,
            at_model,
            stop,
            task: Some(task),
            ctx,
            released: false,
        }
    }

    /// Stops the heartbeat; drops the lease if `drop` (not when the item
    /// could not be handed back, so the stale lease is what makes the
    /// coordinator publish it again, and not after a commit, which dropped it).
    pub async fn finish(mut self, drop: bool) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.released = true;
        if drop {
            if let Err(e) = self.ctx.store.release(&self.job, &self.lease).await {
                tracing::warn!(error = %e, "could not drop the lease; the coordinator will ignore it once the item is settled");
            }
        }
    }
}

impl Drop for LeaseGuard {
    /// The backstop when `finish` was never reached (a panic): the heartbeat
    /// stops and the lease is dropped, so the item is not held by nobody.
    fn drop(&mut self) {
        self.stop.cancel();
        if self.released {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (store, job, lease) =
                (self.ctx.store.clone(), self.job.clone(), self.lease.clone());
            rt.spawn(async move {
                let _ = store.release(&job, &lease).await;
            });
        }
    }
}

/// The lease a worker writes for `item` (times are set by Redis).
pub fn lease_for(item: &WorkItem, attempt: u32, ctx: &ItemContext, at_ms: u64) -> Lease {
    Lease {
        seq: item.seq,
        worker: ctx.worker_id.clone(),
        attempt,
        started_ms: at_ms,
        heartbeat_ms: at_ms,
        ttl_ms: ctx.tuning.lease_ttl.as_millis() as u64,
        rows_done: 0,
        rows: item.input.rows(),
        rows_resumed: 0,
        acked: false,
    }
}

struct Heartbeat {
    job: String,
    lease: Lease,
    held: Arc<Held>,
    ctx: Arc<ItemContext>,
    rows_done: Arc<AtomicU64>,
    rows_resumed: Arc<AtomicU64>,
    done_elsewhere: CancellationToken,
    waited_too_long: CancellationToken,
    at_model: Arc<AtomicBool>,
    stop: CancellationToken,
}

async fn heartbeat_loop(hb: Heartbeat) {
    let Heartbeat {
        job,
        mut lease,
        held,
        ctx,
        rows_done,
        rows_resumed,
        done_elsewhere,
        waited_too_long,
        at_model,
        stop,
    } = hb;
    let mut tick = tokio::time::interval(ctx.tuning.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate; the lease was just written
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !held.is_settled() && held.received.elapsed() >= ctx.tuning.ack_after {
            if at_model.load(Ordering::SeqCst) {
                // From here the lease alone holds the item: if this worker dies,
                // the coordinator sees the lease go stale and publishes a copy
                // (at once when the lease says `acked`, else once the queues are
                // drained — so acking before the lease says so is safe).
                held.ack().await;
                lease.acked = true;
                tracing::info!(
                    held_s = held.received.elapsed().as_secs(),
                    "long item: acknowledged early, held by its lease"
                );
            } else if !waited_too_long.is_cancelled() {
                // Never at the model yet (another item holds it): give it to
                // a worker that is free rather than hold it unacknowledged.
                waited_too_long.cancel();
            }
        }
        lease.rows_done = rows_done.load(Ordering::Relaxed);
        lease.rows_resumed = rows_resumed.load(Ordering::Relaxed);
        match ctx.store.heartbeat(&job, &lease).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!("item committed elsewhere (a faster copy); stopping this one");
                done_elsewhere.cancel();
            }
            Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
        }
    }
}
