//! Group commit: the items a worker finishes while one commit is on its way
//! to Redis are committed together, in one script call per job
//! ([`JobStore::commit_group`](batchfleet_shared::store::JobStore::commit_group)),
//! each with its own answer (first commit wins stays per item).
//!
//! Before the call, the folders of the group's part files are fsynced, once
//! each: the files' bytes were made durable before they were linked into
//! place (by one filesystem sync for the files written side by side:
//! [`NameSync::Shared`](batchfleet_shared::fsutil::NameSync)), and their
//! names become durable here — so a committed item's part file survives a
//! power loss, as when each item fsynced its file and its folder, for one
//! filesystem sync and one folder fsync per group instead of two fsyncs per
//! item.
//!
//! One task per worker takes what handlers hand it: the first item that
//! arrives, and every other item already waiting, up to [`MOST`]. An item
//! alone is committed at once — groups form when items finish faster than
//! Redis answers, which is exactly when a call per item would cost most —
//! with one exception: while other items of a bundle in the group have not
//! come to their commit yet ([`Ticket`]), the group waits for them, up to
//! half a heartbeat ([`linger`]: 1 s by default). A bundle's
//! items finish moments apart (they take turns at the model), and its
//! delivery is acknowledged only once all of them are settled anyway, so
//! waiting costs the bundle nothing and commits it in one call instead of
//! one per two or three items. (A busy worker's groups fill up to [`MOST`]
//! long before; a worker that gets a core only now and then — hundreds of
//! workers on two cores in the simulated-fleet soak — would otherwise
//! commit a bundle in pieces: waiting up to 10 ms, as groups did before,
//! took 0.34–0.48 Redis requests and 0.35–0.43 syncs per item there,
//! against 0.27–0.30 and 0.23–0.27 waiting up to 1 s.) Each
//! call carries the job's work tallied since the last (model rows, items
//! started without the start script: [`WorkTally`]); a group whose call
//! fails puts it back, and each of its
//! items gets the error to settle like any failed commit.

use crate::context::{patiently, WorkTally};
use crate::error::ItemError;
use batchfleet_shared::metrics::names;
use batchfleet_shared::store::{Commit, ItemStats, Store};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;

/// Most items in one commit call.
pub const MOST: usize = 64;

/// Longest a group waits for the items of bundles still on their way to
/// their commit: half a heartbeat (`--heartbeat`), at most this. An item
/// waiting for its group stays short of the heartbeat past its turn at
/// the model that would lease it.
pub const LINGER: Duration = Duration::from_secs(1);

/// How long groups wait for bundle items on their way, for a worker whose
/// heartbeat is `heartbeat`.
pub fn linger(heartbeat: Duration) -> Duration {
    (heartbeat / 2).min(LINGER)
}

/// The items of one bundle that have not come to their commit (nor ended
/// without one) yet.
#[derive(Debug, Default)]
struct Bundle {
    left: AtomicUsize,
}

/// One bundle item's place in its [`Bundle`], given up once: when the
/// commit task takes its commit, or when its handling ends without one.
#[derive(Debug)]
struct Place {
    bundle: Arc<Bundle>,
    /// Wakes a group waiting for the bundle's items.
    changed: Arc<Notify>,
    given: AtomicBool,
}

impl Place {
    fn give(&self) {
        if !self.given.swap(true, Ordering::SeqCst) {
            self.bundle.left.fetch_sub(1, Ordering::SeqCst);
            self.changed.notify_one();
        }
    }
}

/// A bundle item's ticket: its place, given up when dropped at the latest.
#[derive(Debug)]
pub struct Ticket(Arc<Place>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.give();
    }
}

tokio::task_local! {
    /// The ticket of the bundle item this task handles.
    static TICKET: Ticket;
}

/// Runs `handling` (one bundle item's whole handling, on a task of its
/// own) holding `ticket`, given up by its commit or when it ends.
pub async fn holding<F: std::future::Future>(ticket: Ticket, handling: F) -> F::Output {
    TICKET.scope(ticket, handling).await
}

/// An item waiting for its commit.
struct Pending {
    /// Its place in its bundle (none for an item alone).
    place: Option<Arc<Place>>,
    job: String,
    stats: ItemStats,
    histogram: Vec<Vec<u64>>,
    /// The folder of the item's part file, to fsync before the commit.
    folder: Option<PathBuf>,
    /// Whether the item's lease was written (see [`Commit::leased`]).
    leased: bool,
    reply: oneshot::Sender<Result<bool, ItemError>>,
}

impl Pending {
    /// Taken by the commit task: its place given up.
    fn arrived(self) -> Self {
        if let Some(place) = &self.place {
            place.give();
        }
        self
    }

    /// Whether items of its bundle are still on their way.
    fn bundle_coming(&self) -> bool {
        self.place
            .as_ref()
            .is_some_and(|p| p.bundle.left.load(Ordering::SeqCst) > 0)
    }
}

/// Hands finished items to the worker's commit task.
#[derive(Debug)]
pub struct Committer {
    to_task: mpsc::UnboundedSender<Pending>,
    changed: Arc<Notify>,
}

/// What the commit task needs.
pub struct Setup {
    /// The job store.
    pub store: Store,
    /// The model rows not yet counted.
    pub work: Arc<WorkTally>,
    /// How long a commit waits for Redis to come back.
    pub patience: Duration,
    /// Ends the waits for Redis.
    pub shutdown: CancellationToken,
    /// Longest a group waits for bundle items on their way ([`LINGER`]).
    pub linger: Duration,
}

impl Committer {
    /// Starts the commit task (it ends when the committer is dropped).
    pub fn start(setup: Setup) -> Self {
        let (to_task, from_handlers) = mpsc::unbounded_channel();
        let changed = Arc::new(Notify::new());
        tokio::spawn(run(setup, from_handlers, changed.clone()));
        Self { to_task, changed }
    }

    /// Tickets for the `n` items of a bundle about to be worked: a group
    /// with one of them waits for the others' commits (see [`holding`]).
    pub fn expect(&self, n: usize) -> Vec<Ticket> {
        let bundle = Arc::new(Bundle {
            left: AtomicUsize::new(n),
        });
        (0..n)
            .map(|_| {
                Ticket(Arc::new(Place {
                    bundle: bundle.clone(),
                    changed: self.changed.clone(),
                    given: AtomicBool::new(false),
                }))
            })
            .collect()
    }

    /// Commits one item of `job` with the others that finish meanwhile,
    /// after fsyncing `folder` (where its part file was published): whether
    /// its commit won. `leased`: whether the item's lease was written (the
    /// commit drops it).
    pub async fn commit(
        &self,
        job: &str,
        stats: ItemStats,
        histogram: Vec<Vec<u64>>,
        folder: Option<PathBuf>,
        leased: bool,
    ) -> Result<bool, ItemError> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            place: TICKET.try_with(|t| t.0.clone()).ok(),
            job: job.to_owned(),
            stats,
            histogram,
            folder,
            leased,
            reply,
        };
        let stopped = || ItemError::transient("the worker's commit task stopped");
        // Its place is given up by the commit task when it takes it (or
        // with the ticket, should the task be gone).
        self.to_task.send(pending).map_err(|_| stopped())?;
        answer.await.unwrap_or_else(|_| Err(stopped()))
    }
}

async fn run(
    setup: Setup,
    mut from_handlers: mpsc::UnboundedReceiver<Pending>,
    changed: Arc<Notify>,
) {
    while let Some(first) = from_handlers.recv().await {
        let mut group = vec![first.arrived()];
        let linger = tokio::time::Instant::now() + setup.linger;
        loop {
            while group.len() < MOST {
                match from_handlers.try_recv() {
                    Ok(more) => group.push(more.arrived()),
                    Err(_) => break,
                }
            }
            // Items of the group's bundles still to come: wait for them, a
            // while (woken by each that comes, or that ends without one).
            if group.len() >= MOST || !group.iter().any(Pending::bundle_coming) {
                break;
            }
            tokio::select! {
                more = from_handlers.recv() => match more {
                    Some(more) => group.push(more.arrived()),
                    None => break,
                },
                () = changed.notified() => {}
                () = tokio::time::sleep_until(linger) => break,
            }
        }
        metrics::histogram!(names::WORKER_COMMIT_GROUP).record(group.len() as f64);
        // One call per job, the jobs in the order their first item came.
        while !group.is_empty() {
            let job = group[0].job.clone();
            let (of_job, rest): (Vec<_>, Vec<_>) = group.into_iter().partition(|p| p.job == job);
            group = rest;
            commit_job(&setup, &job, of_job).await;
        }
    }
}

async fn commit_job(setup: &Setup, job: &str, items: Vec<Pending>) {
    if let Err(e) = sync_folders(&items).await {
        for p in items {
            let _ = p.reply.send(Err(e.clone()));
        }
        return;
    }
    let work = setup.work.take(job);
    let commits: Vec<Commit<'_>> = items
        .iter()
        .map(|p| Commit {
            stats: &p.stats,
            histogram: &p.histogram,
            leased: p.leased,
        })
        .collect();
    let result = patiently(setup.patience, &setup.shutdown, "commit", || {
        setup.store.commit_group(job, &commits, work)
    })
    .await;
    drop(commits);
    match result {
        Ok(won) => {
            for (p, w) in items
                .into_iter()
                .zip(won.into_iter().chain(std::iter::repeat(false)))
            {
                let _ = p.reply.send(Ok(w));
            }
        }
        Err(e) => {
            setup.work.add(job, work);
            for p in items {
                let _ = p.reply.send(Err(e.clone()));
            }
        }
    }
}

/// Fsyncs each folder the items' part files were published in, once.
async fn sync_folders(items: &[Pending]) -> Result<(), ItemError> {
    let folders: BTreeSet<PathBuf> = items.iter().filter_map(|p| p.folder.clone()).collect();
    if folders.is_empty() {
        return Ok(());
    }
    crate::error::blocking(move || {
        for folder in &folders {
            batchfleet_shared::fsutil::sync_folder(folder).map_err(|e| {
                ItemError::output_io(format!("cannot fsync {}", folder.display()), &e)
            })?;
        }
        Ok(())
    })
    .await?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(seq: u32, worker: &str) -> ItemStats {
        ItemStats {
            seq,
            rows: 10,
            rows_rejected: 0,
            worker: worker.into(),
            started_ms: 1,
            finished_ms: 2,
            attempt: 1,
            recovered: false,
            rows_resumed: 0,
            vector: None,
            shadow: None,
        }
    }

    fn committer(store: &Store, work: &Arc<WorkTally>) -> Committer {
        committer_lingering(store, work, LINGER)
    }

    fn committer_lingering(store: &Store, work: &Arc<WorkTally>, linger: Duration) -> Committer {
        Committer::start(Setup {
            store: store.clone(),
            work: work.clone(),
            patience: Duration::from_secs(1),
            shutdown: CancellationToken::new(),
            linger,
        })
    }

    #[tokio::test]
    async fn items_finishing_together_each_get_their_own_answer_and_the_tally_goes_once() {
        let (store, work) = (Store::local(), Arc::new(WorkTally::default()));
        for job in ["a", "b"] {
            store
                .put_job(&batchfleet_shared::store::JobRecord::sample(job))
                .await
                .unwrap();
        }
        let c = committer(&store, &work);
        work.add_rows("a", 5);
        work.add_delivery("a");
        let dir = tempfile::tempdir().unwrap();
        let folder = || Some(dir.path().to_path_buf());
        let (a0, a1, b0, a0_again) = tokio::join!(
            c.commit("a", stats(0, "w"), vec![vec![1]], folder(), false),
            c.commit("a", stats(1, "w"), vec![vec![1]], folder(), true),
            c.commit("b", stats(0, "w"), vec![vec![1]], None, false),
            c.commit("a", stats(0, "w2"), vec![vec![1]], folder(), true),
        );
        assert_eq!(
            [a0.unwrap(), a1.unwrap(), b0.unwrap(), a0_again.unwrap()],
            [true, true, true, false],
            "first commit wins, per item and job"
        );
        assert_eq!(store.work("a").await.unwrap(), (1, 5));
        assert!(work.take("a").is_empty(), "sent with the commit");
        assert_eq!(store.histogram("a", 1).await.unwrap(), vec![vec![2]]);
    }

    #[tokio::test]
    async fn a_group_waits_for_the_items_of_a_bundle_still_on_their_way() {
        let (store, work) = (Store::local(), Arc::new(WorkTally::default()));
        store
            .put_job(&batchfleet_shared::store::JobRecord::sample("a"))
            .await
            .unwrap();
        // Waits as long as it takes: the first item is answered only once
        // the second came.
        let hour = Duration::from_secs(3600);
        let c = Arc::new(committer_lingering(&store, &work, hour));
        let mut tickets = c.expect(3);
        let commit = |seq: u32, ticket: Ticket| {
            let c = c.clone();
            tokio::spawn(holding(ticket, async move {
                c.commit("a", stats(seq, "w"), Vec::new(), None, false)
                    .await
            }))
        };
        let (first_sent, sent) = oneshot::channel();
        let first = {
            let c = c.clone();
            let ticket = tickets.pop().unwrap();
            tokio::spawn(holding(ticket, async move {
                let answer = c.commit("a", stats(0, "w"), Vec::new(), None, false);
                tokio::pin!(answer);
                // Polled once: handed to the commit task.
                let early = futures_lite::future::poll_once(&mut answer).await;
                let _ = first_sent.send(early.is_some());
                answer.await
            }))
        };
        assert!(!sent.await.unwrap(), "not answered at once");
        // The third item ends without a commit (a failure): its ticket goes.
        drop(tickets.pop());
        // Long enough for a commit that did not wait to be answered.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !first.is_finished(),
            "the group waits for the bundle's item still on its way"
        );
        let second = commit(1, tickets.pop().unwrap());
        let within = Duration::from_secs(60);
        let both = tokio::time::timeout(within, async { (first.await, second.await) })
            .await
            .expect("both answered once the second came");
        assert!(both.0.unwrap().unwrap() && both.1.unwrap().unwrap());
        // Nothing on its way: an item alone is committed at once, and so
        // is one whose bundle has no other item left, however long another
        // bundle's item takes to come.
        let alone = c.commit("a", stats(2, "w"), Vec::new(), None, false);
        assert!(tokio::time::timeout(within, alone)
            .await
            .expect("at once")
            .unwrap());
        let _another_on_its_way = c.expect(2);
        let own = commit(3, c.expect(1).pop().unwrap());
        assert!(tokio::time::timeout(within, own)
            .await
            .expect("not held for another bundle's item")
            .unwrap()
            .unwrap());
    }

    #[tokio::test]
    async fn a_folder_that_cannot_be_synced_fails_its_items_and_commits_nothing() {
        let (store, work) = (Store::local(), Arc::new(WorkTally::default()));
        let c = committer(&store, &work);
        work.add_rows("a", 3);
        let gone = Some(PathBuf::from("/nonexistent-batchfleet-folder"));
        let e = c
            .commit("a", stats(0, "w"), Vec::new(), gone, true)
            .await
            .unwrap_err();
        assert!(e.message.contains("cannot fsync"), "{e}");
        assert!(!store.is_done("a", 0).await.unwrap());
        assert_eq!(
            work.take("a").rows,
            3,
            "the tally waits for a commit that lands"
        );
    }
}
