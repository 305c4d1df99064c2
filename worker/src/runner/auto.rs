//! `inference_batch_size = "auto"`: each runner finds its own mini-batch
//! size per model. It starts small and doubles while the rows/s measured at
//! the new size beat the best so far by [`GAIN`], then settles on the best;
//! it never grows past a size that ran out of memory (the mini-batch is
//! halved then, as for a fixed size, and that half becomes the ceiling),
//! nor, on a GPU, once the device's memory is [`MEMORY_FULL`] used, nor past
//! what the items' calls can fill.

use std::collections::HashMap;

/// The first size tried.
pub const START: usize = 32;
/// The largest size tried.
pub const MAX: usize = 16_384;
/// How much faster (rows/s) a doubled size must be to keep growing.
pub const GAIN: f64 = 1.05;
/// Share of a GPU's memory in use past which the size stops growing.
pub const MEMORY_FULL: f64 = 0.9;

/// One model's search for its mini-batch size on one runner.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoBatch {
    size: usize,
    /// The fastest size measured, and its rows/s.
    best: Option<(usize, f64)>,
    /// Sizes above this ran out of memory.
    ceiling: usize,
    settled: bool,
    /// The first call (libtorch's warm-up) is not measured.
    warmed: bool,
    window_rows: usize,
    window_secs: f64,
    /// The most rows one call of this window asked for.
    window_widest: usize,
}

impl Default for AutoBatch {
    fn default() -> Self {
        Self {
            size: START,
            best: None,
            ceiling: MAX,
            settled: false,
            warmed: false,
            window_rows: 0,
            window_secs: 0.0,
            window_widest: 0,
        }
    }
}

impl AutoBatch {
    /// The size the next call uses.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether the search is over.
    #[cfg(test)]
    pub fn settled(&self) -> bool {
        self.settled
    }

    /// What a call of `rows` rows at [`AutoBatch::size`] took: `secs` of
    /// model time; `oom_fit`, the size it fell back to after running out
    /// of memory; `memory_full`, the device's memory is nearly all used.
    pub fn observe(&mut self, rows: usize, secs: f64, oom_fit: Option<usize>, memory_full: bool) {
        if let Some(fit) = oom_fit {
            self.ceiling = fit.max(1);
            if self.size > self.ceiling {
                self.size = self.ceiling;
            }
            if let Some((best, _)) = self.best.filter(|(b, _)| *b > self.ceiling) {
                tracing::debug!(
                    best,
                    ceiling = self.ceiling,
                    "the fastest size ran out of memory"
                );
                self.best = None;
            }
            self.settle("out of memory");
            return;
        }
        if self.settled || rows == 0 {
            return;
        }
        if !self.warmed {
            self.warmed = true;
            return;
        }
        self.window_rows += rows;
        self.window_secs += secs;
        self.window_widest = self.window_widest.max(rows);
        // Four mini-batches' worth of rows at this size, at least.
        if self.window_rows < 4 * self.size || self.window_secs <= 0.0 {
            return;
        }
        let rate = self.window_rows as f64 / self.window_secs;
        let widest = std::mem::take(&mut self.window_widest);
        (self.window_rows, self.window_secs) = (0, 0.0);
        match self.best {
            Some((best, r)) if rate < r * GAIN => {
                self.size = best;
                self.settle("no faster");
            }
            _ => {
                self.best = Some((self.size, rate));
                let next = self.size * 2;
                if next > self.ceiling {
                    self.settle("largest size");
                } else if memory_full {
                    self.settle("device memory nearly full");
                } else if widest < next {
                    // The calls cannot fill a larger mini-batch.
                    self.settle("calls hold fewer rows");
                } else {
                    self.size = next;
                }
            }
        }
    }

    fn settle(&mut self, why: &str) {
        if !self.settled {
            self.settled = true;
            tracing::info!(
                size = self.size,
                rows_per_s = self.best.map(|b| b.1.round()),
                why,
                "inference_batch_size = \"auto\" settled"
            );
        }
    }
}

/// The searches of every model a runner has run with `"auto"`, each
/// under the key its loaded module is cached under.
#[derive(Debug, Default)]
pub struct AutoBatches(HashMap<super::torch::Key, AutoBatch>);

impl AutoBatches {
    /// The search for `model` (by file, digest, device and precision).
    pub fn of(&mut self, model: &batchfleet_shared::message::ModelRef) -> &mut AutoBatch {
        self.0.entry(super::torch::key_of(model)).or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model whose rows/s rises with the batch up to `knee`, then stays flat.
    fn secs(rows: usize, size: usize, knee: usize) -> f64 {
        let per_row = 1.0 / size.min(knee) as f64;
        rows as f64 * per_row
    }

    #[test]
    fn grows_while_faster_then_settles_on_the_fastest() {
        let mut a = AutoBatch::default();
        let mut calls = 0;
        while !a.settled() && calls < 1000 {
            let size = a.size();
            a.observe(8192, secs(8192, size, 256), None, false);
            calls += 1;
        }
        assert!(a.settled());
        assert_eq!(a.size(), 256, "the knee: 512 was no faster");
    }

    #[test]
    fn out_of_memory_caps_the_size_and_ends_the_search() {
        let mut a = AutoBatch::default();
        a.observe(8192, 1.0, None, false); // warm-up
        while a.size() < 256 {
            let size = a.size();
            a.observe(8192, secs(8192, size, 100_000), None, false);
        }
        a.observe(8192, 1.0, Some(128), false);
        assert!(a.settled());
        assert_eq!(a.size(), 128);
        a.observe(8192, 0.001, None, false);
        assert_eq!(a.size(), 128, "settled");
    }

    #[test]
    fn small_calls_and_a_full_device_stop_the_growth() {
        let mut a = AutoBatch::default();
        a.observe(500, 1.0, None, false);
        for _ in 0..20 {
            let size = a.size();
            a.observe(500, secs(500, size, 100_000), None, false);
        }
        assert!(a.settled());
        assert!(a.size() <= 500 && a.size() >= 256, "{}", a.size());
        let mut b = AutoBatch::default();
        b.observe(8192, 1.0, None, false);
        b.observe(8192, secs(8192, START, 100_000), None, true);
        assert!(b.settled());
        assert_eq!(b.size(), START);
    }
}
