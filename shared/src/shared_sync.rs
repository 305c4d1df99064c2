//! One sync for the files that finish together: the part files a worker
//! writes side by side (a bundle's items) are made durable by one
//! filesystem sync (`syncfs`) instead of one `fsync` each.
//!
//! Each write asks for a sync of its file once its bytes are written and
//! waits for one that *started* after that. The first to ask leads: it
//! waits a moment for the other writes of its bundle still on their way
//! (the items of a bundle finish moments apart; each holds a [`Coming`]
//! from [`SharedSync::expect`], and writes while [`Coming::during`] says
//! which bundle it is of; at most `linger`), then syncs the file's
//! filesystem once, and every write that asked before the sync began —
//! of any bundle — is durable with it. A leader never waits for another
//! bundle's writes, nor does a write of no bundle: a worker with bundles
//! in flight all the time does not hold each write back for the linger.
//! Writes that ask while a sync runs are covered by the next one. A file's
//! bytes are thus durable before the caller links it into place, as with
//! its own `fsync` ([`crate::fsutil::NameSync::Shared`]): the durability
//! guarantee is unchanged, only the number of syncs falls.
//!
//! Files on different filesystems go in different lanes (a sync covers one
//! filesystem). Only a local disk filesystem shares syncs (ext4, XFS,
//! Btrfs, ZFS, F2FS, an overlay on one of them): on a network or FUSE
//! mount, where `syncfs` may not reach the server, and off Linux, each
//! file keeps its own `fsync`. Where a shared sync fails, each write of
//! that batch syncs its own file instead, so an error is always the
//! file's own.
//!
//! Blocking: called from the threads that write the files.

use crate::metrics::names;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Syncs shared by the writes that finish together (see the module).
pub struct SharedSync {
    lanes: Mutex<HashMap<u64, Arc<Lane>>>,
    linger: Duration,
    /// Filesystem syncs made.
    syncs: AtomicU64,
    /// Every file syncs its own (no lane shares).
    each_file: bool,
}

/// The writes of one bundle: those on their way ([`Coming`] held) and
/// those asking for their sync now.
#[derive(Debug, Default)]
struct Bundle {
    coming: AtomicUsize,
    waiting: AtomicUsize,
}

impl Bundle {
    /// Whether every write of the bundle still on its way has asked.
    fn all_asked(&self) -> bool {
        self.coming.load(Ordering::SeqCst) <= self.waiting.load(Ordering::SeqCst)
    }
}

std::thread_local! {
    /// The bundle of the write this thread makes now ([`Coming::during`]).
    static WRITING: std::cell::RefCell<Option<Arc<Bundle>>> = const { std::cell::RefCell::new(None) };
}

/// A write on its way to [`SharedSync::sync`]: a leader of its bundle waits
/// for it (at most the linger) until it is dropped — once its sync
/// returned, or when its item ends without a write.
pub struct Coming {
    sync: Arc<SharedSync>,
    bundle: Arc<Bundle>,
}

impl Coming {
    /// Runs `write` (this write's, on this thread): the syncs it asks for
    /// are of this write's bundle.
    pub fn during<T>(&self, write: impl FnOnce() -> T) -> T {
        let before = WRITING.with(|w| w.replace(Some(self.bundle.clone())));
        let out = write();
        WRITING.with(|w| *w.borrow_mut() = before);
        out
    }
}

impl std::fmt::Debug for Coming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Coming")
    }
}

impl Drop for Coming {
    fn drop(&mut self) {
        self.bundle.coming.fetch_sub(1, Ordering::SeqCst);
        self.sync.nudge();
    }
}

impl std::fmt::Debug for SharedSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedSync")
            .field("linger", &self.linger)
            .field("syncs", &self.syncs())
            .finish_non_exhaustive()
    }
}

/// The syncs of one filesystem.
#[derive(Default)]
struct Lane {
    state: Mutex<LaneState>,
    changed: Condvar,
}

#[derive(Default)]
struct LaneState {
    /// Tickets handed out: a write's ticket is `asked` after it asked.
    asked: u64,
    /// Every ticket up to this is covered by a finished sync.
    done: u64,
    /// A write leads the next sync now (waits for the others, or syncs).
    leading: bool,
    /// Tickets up to this were in a sync that failed (or could not be
    /// made): each syncs its own file.
    own_through: u64,
    /// `syncfs` is not available on this filesystem: every write syncs its own file.
    unsupported: bool,
}

impl SharedSync {
    /// A leader waits at most `linger` for the writes on their way.
    pub fn new(linger: Duration) -> Self {
        Self {
            lanes: Mutex::default(),
            linger,
            syncs: AtomicU64::new(0),
            each_file: false,
        }
    }

    /// One where every file keeps its own `fsync` (`--sync-each-file`).
    pub fn each_file() -> Self {
        Self {
            each_file: true,
            ..Self::new(Duration::ZERO)
        }
    }

    /// The `n` writes of a bundle, on their way (its items about to be
    /// worked): a sync led by one of them waits for each until its
    /// [`Coming`] is dropped.
    pub fn expect(self: &Arc<Self>, n: usize) -> Vec<Coming> {
        let bundle = Arc::new(Bundle::default());
        bundle.coming.store(n, Ordering::SeqCst);
        (0..n)
            .map(|_| Coming {
                sync: self.clone(),
                bundle: bundle.clone(),
            })
            .collect()
    }

    /// Filesystem syncs made so far (each covering every write that asked before it).
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::SeqCst)
    }

    /// Wakes the leaders: what they wait for changed. Each lane's lock is
    /// taken first, so a leader between its check and its wait is not missed.
    fn nudge(&self) {
        let lanes: Vec<Arc<Lane>> = self
            .lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for lane in lanes {
            drop(lane.state.lock().unwrap_or_else(|p| p.into_inner()));
            lane.changed.notify_all();
        }
    }

    /// Returns once `file`'s written bytes are durable: by a filesystem
    /// sync that began after this call, or by the file's own `fsync`.
    pub fn sync(&self, file: &File) -> io::Result<()> {
        let lane = self.lane(file)?;
        let mut s = lane.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.unsupported {
            drop(s);
            return crate::fsutil::sync_file(file);
        }
        s.asked += 1;
        let ticket = s.asked;
        // Counted with its ticket: a leader of its bundle sees it waiting.
        let bundle = WRITING.with(|w| w.borrow().clone());
        let _waiting = bundle.as_ref().map(|b| {
            b.waiting.fetch_add(1, Ordering::SeqCst);
            Decrement(&b.waiting)
        });
        lane.changed.notify_all();
        loop {
            if s.done >= ticket {
                let on_own = ticket <= s.own_through;
                drop(s);
                return if on_own {
                    crate::fsutil::sync_file(file)
                } else {
                    Ok(())
                };
            }
            if s.leading {
                s = lane.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            // Lead: wait a moment for the writes of its bundle still on
            // their way, then sync for every ticket handed out by then.
            s.leading = true;
            let until = Instant::now() + self.linger;
            loop {
                let now = Instant::now();
                if now >= until || bundle.as_ref().is_none_or(|b| b.all_asked()) {
                    break;
                }
                // Woken by a write that asks, or one on its way that will not.
                s = lane
                    .changed
                    .wait_timeout(s, until - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            let through = s.asked;
            drop(s);
            self.syncs.fetch_add(1, Ordering::SeqCst);
            let synced = sync_filesystem(file);
            s = lane.state.lock().unwrap_or_else(|p| p.into_inner());
            s.leading = false;
            s.done = s.done.max(through);
            match synced {
                Ok(()) => {}
                Err(e) if unsupported(&e) => {
                    s.unsupported = true;
                    s.own_through = s.own_through.max(through);
                }
                Err(_) => s.own_through = s.own_through.max(through),
            }
            lane.changed.notify_all();
        }
    }

    fn lane(&self, file: &File) -> io::Result<Arc<Lane>> {
        let dev = device(file)?;
        let mut lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lane) = lanes.get(&dev) {
            return Ok(lane.clone());
        }
        let lane = Arc::new(Lane::default());
        lane.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unsupported = self.each_file || !syncs_whole(file);
        lanes.insert(dev, lane.clone());
        Ok(lane)
    }
}

struct Decrement<'a>(&'a AtomicUsize);

impl Drop for Decrement<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(target_os = "linux")]
fn sync_filesystem(file: &File) -> io::Result<()> {
    metrics::counter!(names::SYNCS, "what" => "filesystem").increment(1);
    rustix::fs::syncfs(file).map_err(io::Error::from)
}

#[cfg(not(target_os = "linux"))]
fn sync_filesystem(_: &File) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

/// Whether `syncfs` on the file's filesystem is known to make every file's
/// written bytes durable: local disk filesystems whose `sync_fs` writes and
/// waits for all their dirty data (ext4, XFS, Btrfs, ZFS, F2FS), an overlay
/// (it syncs its upper filesystem) and tmpfs (nothing to make durable).
/// Elsewhere — NFS, Lustre, FUSE mounts, whose `syncfs` may not reach the
/// server — each file keeps its own `fsync`.
#[cfg(target_os = "linux")]
fn syncs_whole(file: &File) -> bool {
    const KNOWN: [u64; 7] = [
        0xEF53,      // ext2/3/4
        0x5846_5342, // XFS
        0x9123_683E, // Btrfs
        0x2FC1_2FC1, // ZFS
        0xF2F5_2010, // F2FS
        0x794C_7630, // overlayfs
        0x0102_1994, // tmpfs
    ];
    rustix::fs::fstatfs(file).is_ok_and(|s| KNOWN.contains(&(s.f_type as u64)))
}

#[cfg(not(target_os = "linux"))]
fn syncs_whole(_: &File) -> bool {
    false
}

fn unsupported(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::Unsupported
        || e.raw_os_error() == Some(rustix::io::Errno::NOSYS.raw_os_error())
}

#[cfg(unix)]
fn device(file: &File) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(file.metadata()?.dev())
}

#[cfg(not(unix))]
fn device(_: &File) -> io::Result<u64> {
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn written(dir: &std::path::Path, name: &str) -> File {
        let mut f = File::create(dir.join(name)).unwrap();
        f.write_all(b"bytes").unwrap();
        f
    }

    #[test]
    fn writes_that_finish_together_share_one_sync() {
        let dir = tempfile::tempdir().unwrap();
        // Eight writes on their way: the first to ask waits for the others
        // (as long as it takes here), then one sync covers all eight.
        let shared = Arc::new(SharedSync::new(Duration::from_secs(3600)));
        let coming = shared.expect(8);
        let handles: Vec<_> = coming
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let (shared, dir) = (shared.clone(), dir.path().to_owned());
                std::thread::spawn(move || {
                    let synced = c.during(|| shared.sync(&written(&dir, &format!("f{i}"))));
                    drop(c);
                    synced
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
        assert_eq!(shared.syncs(), 1, "one sync for the eight");
    }

    #[test]
    fn a_write_that_will_not_come_is_not_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(SharedSync::new(Duration::from_secs(3600)));
        let mut coming = shared.expect(2);
        let second = coming.pop().unwrap();
        let first = coming.pop().unwrap();
        let waiter = {
            let (shared, dir) = (shared.clone(), dir.path().to_owned());
            let bundle = first.bundle.clone();
            let waiter = std::thread::spawn(move || {
                let synced = first.during(|| shared.sync(&written(&dir, "first")));
                drop(first);
                synced
            });
            while bundle.waiting.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            waiter
        };
        // The second item ends without a write: the first's sync goes ahead
        // (without the wake-up, it would wait the hour).
        drop(second);
        waiter.join().unwrap().unwrap();
        assert_eq!(shared.syncs(), 1);
    }

    #[test]
    fn a_write_alone_is_synced_at_once_and_each_later_write_by_a_sync_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing on its way: no wait, however long the linger.
        let shared = SharedSync::new(Duration::from_secs(3600));
        let f = written(dir.path(), "alone");
        shared.sync(&f).unwrap();
        shared.sync(&f).unwrap();
        assert_eq!(
            shared.syncs(),
            2,
            "a sync that began before a write does not cover it"
        );
    }

    #[test]
    fn a_leader_waits_for_its_own_bundle_only() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(SharedSync::new(Duration::from_secs(3600)));
        // Another bundle with a write on its way that never comes (it
        // would hold this one's sync for the hour), and a write of no
        // bundle: neither waits.
        let _other = shared.expect(1);
        let mine = shared.expect(1).pop().unwrap();
        mine.during(|| shared.sync(&written(dir.path(), "mine")))
            .unwrap();
        drop(mine);
        shared.sync(&written(dir.path(), "alone")).unwrap();
        assert_eq!(shared.syncs(), 2);
    }

    #[test]
    fn each_file_keeps_its_own_fsync_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let shared = SharedSync::each_file();
        shared.sync(&written(dir.path(), "own")).unwrap();
        assert_eq!(shared.syncs(), 0, "no filesystem sync");
    }
}
