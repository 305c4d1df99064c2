//! A bundle (version 4 of the work message): several items of one job in
//! one delivery, each handled as the version 3 message it stands for.
//!
//! A first delivery of a bundle is opened into its members. Each member
//! becomes a delivery of its own — its body the member sealed as version 3
//! (signed with this worker's key, when it holds one), its headers the
//! bundle's — and is handled as one beside the others: its own
//! checks, start, part file, commit, retry, hand-back or dead letter, so a
//! bad member costs only itself. The members' deliveries settle a shared
//! [`Parts`], which acknowledges the bundle once every member is settled,
//! or returns it to the queue when any member was returned (a worker
//! stopping, a commit that could not be made). The members' commits are
//! grouped: the commit task waits for the members still on their way
//! (up to [`group::LINGER`]), so a bundle is mostly one Redis call.
//!
//! A bundle that comes back — a worker died holding it, or a member was
//! returned — is not worked as a bundle again: it is split into its
//! members, each published alone (confirmed) with the copy header, so each
//! goes through the start script, which skips the members already done,
//! and an item that kills workers costs only itself.

use super::group;
use super::held::Held;
use super::settle::{reject, Handled};
use crate::context::ItemContext;
use batchfleet_shared::broker::{Acker, BrokerError, Delivery, Outgoing};
use batchfleet_shared::message::{seal_ref, Bundle, COPY_HEADER};
use batchfleet_shared::metrics::names;
use batchfleet_shared::signing::SIGNATURE_HEADER;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Semaphore;

/// The bundle's delivery, settled once all its members are.
struct Parts {
    held: Arc<Held>,
    /// Members not settled yet.
    left: AtomicUsize,
    /// Whether a member was returned (the bundle goes back to the queue).
    returned: AtomicBool,
}

impl Parts {
    async fn settle_one(&self, returned: bool) {
        if returned {
            self.returned.store(true, Ordering::SeqCst);
        }
        if self.left.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        if self.returned.load(Ordering::SeqCst) {
            // Back as a bundle; the next delivery splits it, and the
            // members done by then are skipped by the start script.
            self.held
                .requeue("a member of the bundle was returned")
                .await;
        } else {
            self.held.ack().await;
        }
    }
}

/// Settles one member of a bundle (once: a member's [`Held`] settles its
/// delivery at most once).
struct Member(Arc<Parts>);

#[async_trait::async_trait]
impl Acker for Member {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.0.settle_one(false).await;
        Ok(())
    }
    async fn requeue(&self) -> Result<(), BrokerError> {
        self.0.settle_one(true).await;
        Ok(())
    }
}

/// Works a bundle's members, or splits a bundle that came back; the
/// members' outcomes folded into one (the first that is not a success).
pub async fn handle(held: Arc<Held>, bundle: Bundle, ctx: Arc<ItemContext>) -> Handled {
    if let Err(why) = bundle.check() {
        let reason = format!("malformed bundle: {why}");
        return reject(&held, None, &reason, "bundle", &ctx).await;
    }
    let attempt = held.attempt();
    if attempt > 1 || held.delivery.is_redelivery() || held.headers().int(COPY_HEADER).is_some() {
        return split(&held, &bundle, attempt, &ctx).await;
    }
    let n = bundle.items.len();
    metrics::counter!(names::WORKER_BUNDLES, "how" => "opened").increment(1);
    let parts = Arc::new(Parts {
        held: held.clone(),
        left: AtomicUsize::new(n),
        returned: AtomicBool::new(false),
    });
    let key = ctx.guard.key.as_ref();
    let permits = Arc::new(Semaphore::new(n));
    let mut tasks = Vec::with_capacity(n);
    // Their part files are made durable by one sync, and their commits go
    // in one group, as far as they finish together.
    let mut tickets = ctx.committer.expect(n);
    let mut coming = ctx.data_sync.expect(n);
    for member in bundle.members() {
        let sealed = seal_ref(&member, key);
        let mut headers = held.own_headers();
        headers.remove(SIGNATURE_HEADER);
        if let Some(signature) = sealed.signature {
            headers.set([(SIGNATURE_HEADER, signature)], []);
        }
        headers.seal_settling(key);
        let delivery = Delivery::new(
            sealed.body,
            headers,
            format!("{}/{}", member.job_id, member.seq),
            held.delivery.tag,
            Arc::new(Member(parts.clone())),
        );
        let permit = permits
            .clone()
            .try_acquire_owned()
            .expect("one permit per member");
        let ticket = tickets.pop().expect("one ticket per member");
        let write = coming.pop().expect("one per member");
        tasks.push(tokio::spawn(group::holding(
            ticket,
            super::writing(write, super::member(delivery, ctx.clone(), permit)),
        )));
    }
    let mut outcome = Handled::Committed;
    for task in tasks {
        // A member's task that died settles its delivery by its backstop
        // (returned), and the bundle with it.
        let one = task.await.unwrap_or(Handled::Released);
        if !matches!(outcome, Handled::Committed | Handled::AlreadyDone) {
            continue;
        }
        outcome = one;
    }
    outcome
}

/// Publishes each member of a bundle that came back alone, as a copy
/// (checked against the done set where it starts), then acknowledges the
/// bundle; returns it to the queue when a publish fails.
async fn split(held: &Held, bundle: &Bundle, attempt: u32, ctx: &ItemContext) -> Handled {
    let key = ctx.guard.key.as_ref();
    let messages: Vec<Outgoing> = bundle
        .members()
        .map(|member| {
            let mut msg = Outgoing::item_ref(&member, attempt, key);
            msg.headers.set([], [(COPY_HEADER, 1)]);
            msg
        })
        .collect();
    let n = messages.len();
    let broker = ctx.broker();
    let published = match broker
        .publish(&ctx.queues.job(&bundle.job_id), messages.clone(), n)
        .await
    {
        Err(BrokerError::NotConfirmed { .. }) => {
            broker.publish(&ctx.queues.work(), messages, n).await
        }
        other => other,
    };
    match published {
        Ok(_) => {
            tracing::info!(job = %bundle.job_id, first = bundle.first_seq(), items = n, "a bundle came back: published its items one by one");
            metrics::counter!(names::WORKER_BUNDLES, "how" => "split").increment(1);
            held.ack().await;
            Handled::HandedBack
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not split a bundle that came back; returning it to the queue");
            held.requeue("splitting failed").await;
            Handled::Released
        }
    }
}
