//! The worker's wall clock and its testing aids (flags hidden from
//! `--help`, all off by default): faults a test cannot cause on demand for
//! real — a panic on a chosen item, a worker killed by its item, a full
//! disk, a clock that is wrong.

use crate::error::{FailureClass, ItemError};

/// The worker's wall clock (for stats and headers; never for leases, which
/// use Redis's). A debug offset plays a machine whose clock is wrong.
#[derive(Debug, Clone, Copy, Default)]
pub struct Clock {
    /// Milliseconds added to the system clock (may be negative).
    pub offset_ms: i64,
}

impl Clock {
    /// Now, in ms since the epoch, as this worker sees it.
    pub fn now_ms(&self) -> u64 {
        batchfleet_shared::now_ms().saturating_add_signed(self.offset_ms)
    }
}

/// Testing aids, hidden from `--help`: panics on chosen items, a full disk.
#[derive(Debug, Clone, Default)]
pub struct DebugHooks {
    /// Panic in item handling for these (seq, attempt — 0 for every attempt).
    pub panic_in_item: Vec<(u32, u32)>,
    /// Panic on the runner thread for these (seq, attempt — 0 for every attempt).
    pub panic_on_runner: Vec<(u32, u32)>,
    /// Abort the process as these reach the model (seq, attempt — 0 for
    /// every attempt): an item that kills its worker.
    pub abort_at_model: Vec<(u32, u32)>,
    /// While this file exists, writing output fails as a full disk would.
    pub disk_full_while: Option<std::path::PathBuf>,
}

impl DebugHooks {
    fn hits(list: &[(u32, u32)], seq: u32, attempt: u32) -> bool {
        list.iter()
            .any(|(s, a)| *s == seq && (*a == 0 || *a == attempt))
    }

    /// Whether item handling should panic for this item and attempt.
    pub fn panic_in_item(&self, seq: u32, attempt: u32) -> bool {
        Self::hits(&self.panic_in_item, seq, attempt)
    }

    /// Whether the runner should panic for this item and attempt.
    pub fn panic_on_runner(&self, seq: u32, attempt: u32) -> bool {
        Self::hits(&self.panic_on_runner, seq, attempt)
    }

    /// Aborts the process (SIGABRT) if this item and attempt should kill
    /// its worker.
    pub fn abort_at_model(&self, seq: u32, attempt: u32) {
        if Self::hits(&self.abort_at_model, seq, attempt) {
            eprintln!("injected crash: aborting the worker at item {seq} (--debug-panic abort)");
            std::process::abort();
        }
    }

    /// A full disk when one is being played now (writing `dest` fails).
    pub fn check_disk(&self, dest: &std::path::Path) -> Result<(), ItemError> {
        if self.disk_full_while.as_ref().is_some_and(|p| p.exists()) {
            return Err(ItemError::new(
                FailureClass::DiskFull,
                format!(
                    "cannot write {}: No space left on device (played by --debug-disk-full-while)",
                    dest.display()
                ),
            ));
        }
        Ok(())
    }
}
