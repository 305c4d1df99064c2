//! Shadow scoring: a candidate model (`[model.shadow]`) run beside the
//! job's model on the same parsed rows, in the same worker. The job's
//! output is the job's model's; the shadow adds what the two did
//! differently — per item, mergeable, committed with the item, so every row
//! is compared once however often items are delivered:
//!
//! - per output column: rows compared, largest and mean absolute
//!   difference, and the moments Pearson's correlation needs (merged with
//!   Chan et al.'s pairwise update, not raw sums, so a long job keeps its
//!   precision);
//! - for `argmax` / `top_k` outputs: rows whose top class agrees, and the
//!   confusion table (job's class × shadow's class);
//! - for `[output] vector`: the cosine similarity of each row's two vectors;
//! - both models' histograms over the compared rows, with the job's bins;
//! - each model's forward time;
//! - why the shadow did not run on some rows, when it did not.

use crate::message::{add_counts, HistogramSpec, ModelRef, OutputSpec};
use serde::{Deserialize, Serialize};

/// Output columns compared one by one; a model with more (logits over
/// many classes) is compared over all its values pooled as one column.
pub const MAX_COLUMNS: usize = 64;

/// Classes the confusion table covers; past this, only the agreement rate.
pub const MAX_CONFUSION_CLASSES: usize = 64;

/// What a shadow column's name ends with: `score_shadow`, `label_shadow`.
pub const COLUMN_SUFFIX: &str = "_shadow";

/// `[model.shadow]` as every item of the job carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowSpec {
    /// The candidate: its file, digest and precision; inputs, outputs and
    /// device as the job's model.
    pub model: ModelRef,
}

impl ShadowSpec {
    /// The name of the column holding the shadow's value of `column`
    /// (`[output] shadow = "columns"`).
    pub fn column_name(column: &str) -> String {
        format!("{column}{COLUMN_SUFFIX}")
    }
}

/// The running moments of one output column's pairs (job's value `x`,
/// shadow's value `y`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct Moments {
    /// Pairs counted.
    pub n: u64,
    /// Largest |x − y|.
    pub max_abs: f64,
    /// Σ |x − y|.
    pub sum_abs: f64,
    /// Mean of x.
    pub mean_x: f64,
    /// Mean of y.
    pub mean_y: f64,
    /// Σ (x − mean x)².
    pub m2_x: f64,
    /// Σ (y − mean y)².
    pub m2_y: f64,
    /// Σ (x − mean x)(y − mean y).
    pub c_xy: f64,
}

impl Moments {
    /// Adds one pair (Welford's update).
    pub fn add(&mut self, x: f64, y: f64) {
        self.n += 1;
        let n = self.n as f64;
        let d = (x - y).abs();
        self.max_abs = self.max_abs.max(d);
        self.sum_abs += d;
        let dx = x - self.mean_x;
        self.mean_x += dx / n;
        let dy = y - self.mean_y;
        self.mean_y += dy / n;
        self.m2_x += dx * (x - self.mean_x);
        self.m2_y += dy * (y - self.mean_y);
        self.c_xy += dx * (y - self.mean_y);
    }

    /// Both together (Chan et al.'s pairwise update).
    pub fn merge(&mut self, o: &Moments) {
        if o.n == 0 {
            return;
        }
        if self.n == 0 {
            *self = *o;
            return;
        }
        let (na, nb) = (self.n as f64, o.n as f64);
        let n = na + nb;
        let dx = o.mean_x - self.mean_x;
        let dy = o.mean_y - self.mean_y;
        self.m2_x += o.m2_x + dx * dx * na * nb / n;
        self.m2_y += o.m2_y + dy * dy * na * nb / n;
        self.c_xy += o.c_xy + dx * dy * na * nb / n;
        self.mean_x += dx * nb / n;
        self.mean_y += dy * nb / n;
        self.n += o.n;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.sum_abs += o.sum_abs;
    }

    /// Mean |x − y|.
    pub fn mean_abs(&self) -> f64 {
        self.sum_abs / self.n.max(1) as f64
    }

    /// Pearson's correlation of x and y; `None` when either is constant
    /// (or no pair was counted).
    pub fn pearson(&self) -> Option<f64> {
        let d = (self.m2_x * self.m2_y).sqrt();
        (self.n > 1 && d > 0.0 && d.is_finite()).then(|| (self.c_xy / d).clamp(-1.0, 1.0))
    }
}

/// The top class of a row (largest value; NaN never; ties keep the lower
/// index, as the `label` column does).
fn top_class(row: &[f32]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (k, v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|b| *v > row[b]) {
            best = Some(k);
        }
    }
    best
}

/// What the shadow did beside the job's model, over some rows: one item's,
/// or a whole job's ([`ShadowStats::merge`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ShadowStats {
    /// Rows both models predicted, compared.
    pub rows: u64,
    /// Rows the job's model predicted that were not compared: the shadow
    /// raised on them or could not run, or (a redelivered item) an earlier
    /// delivery computed them.
    #[serde(default)]
    pub rows_missed: u64,
    /// Each output column's moments (one pooled column past [`MAX_COLUMNS`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<Moments>,
    /// Rows whose top class agrees (`argmax` / `top_k` outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agree: Option<u64>,
    /// `(job's class, shadow's class, rows)`, for models of at most
    /// [`MAX_CONFUSION_CLASSES`] classes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub confusion: Vec<(u32, u32, u64)>,
    /// The job's model's histogram over the compared rows, `[column][bin]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hist_main: Vec<Vec<u64>>,
    /// The shadow's histogram over the compared rows, `[column][bin]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hist_shadow: Vec<Vec<u64>>,
    /// Cosine similarity of the two vectors of each row (`[output]
    /// vector`): its moments against 1 (`mean_y` is the mean similarity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cosine: Option<CosineStats>,
    /// The job's model's forward time over `timed_rows`, in nanoseconds.
    #[serde(default)]
    pub main_ns: u64,
    /// The shadow's forward time over `timed_rows`, in nanoseconds.
    #[serde(default)]
    pub shadow_ns: u64,
    /// Rows both forward times cover.
    #[serde(default)]
    pub timed_rows: u64,
    /// Why the shadow missed rows (the first reason seen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Cosine similarities of row pairs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CosineStats {
    /// Rows counted.
    pub n: u64,
    /// Σ similarity.
    pub sum: f64,
    /// Least similarity.
    pub min: f64,
}

/// One model call's outputs as the comparison reads them: `rows × width`
/// values, row-major, NaN for a row the model raised on.
#[derive(Debug, Clone, Copy)]
pub struct Outputs<'a> {
    /// The values.
    pub values: &'a [f32],
    /// Values per row.
    pub width: usize,
}

impl ShadowStats {
    /// No comparison: `rows` predicted by the job's model that the shadow
    /// did not, and why.
    pub fn missed(rows: u64, why: impl Into<String>) -> Self {
        Self {
            rows_missed: rows,
            error: Some(why.into()),
            ..Self::default()
        }
    }

    /// The comparison of `main` and `shadow` over the same rows, as the
    /// job's `[output]` writes them (its bins, `argmax` / `top_k`, vector).
    /// A row is compared when both models predicted it (no NaN in either).
    pub fn compare(main: Outputs<'_>, shadow: Outputs<'_>, output: &OutputSpec) -> Self {
        let rows = main.values.len().checked_div(main.width).unwrap_or(0);
        if main.width != shadow.width || shadow.values.len() != main.values.len() {
            return Self::missed(
                count_predicted(main) as u64,
                format!(
                    "the shadow model returns {} outputs per row and the job's model {}; only models with the same outputs compare",
                    shadow.values.len().checked_div(rows).unwrap_or(shadow.width),
                    main.width
                ),
            );
        }
        let width = main.width;
        let pooled = width > MAX_COLUMNS;
        let labelled = (output.argmax || output.top_k > 0) && output.vector.is_none();
        let vector = output.vector.is_some();
        let mut s = Self {
            columns: if vector {
                Vec::new()
            } else {
                vec![Moments::default(); if pooled { 1 } else { width }]
            },
            agree: labelled.then_some(0),
            ..Self::default()
        };
        let mut confusion = std::collections::BTreeMap::<(u32, u32), u64>::new();
        let spec: HistogramSpec = output.histogram;
        for (x, y) in main
            .values
            .chunks(width)
            .zip(shadow.values.chunks(width))
            .take(rows)
        {
            let (x_ok, y_ok) = (!x.iter().any(|v| v.is_nan()), !y.iter().any(|v| v.is_nan()));
            if !x_ok {
                continue; // the job's model did not predict it: not its output
            }
            if !y_ok {
                s.rows_missed += 1;
                s.error
                    .get_or_insert_with(|| "the shadow model raised on some rows".into());
                continue;
            }
            s.rows += 1;
            if vector {
                let c = cosine(x, y);
                let t = s.cosine.get_or_insert(CosineStats {
                    n: 0,
                    sum: 0.0,
                    min: f64::INFINITY,
                });
                t.n += 1;
                t.sum += c;
                t.min = t.min.min(c);
                continue;
            }
            for (k, (a, b)) in x.iter().zip(y).enumerate() {
                let col = if pooled { 0 } else { k };
                s.columns[col].add(f64::from(*a), f64::from(*b));
            }
            if !pooled {
                spec.add(&mut s.hist_main, x, width);
                spec.add(&mut s.hist_shadow, y, width);
            }
            if labelled {
                if let (Some(a), Some(b)) = (top_class(x), top_class(y)) {
                    if a == b {
                        *s.agree.get_or_insert(0) += 1;
                    }
                    if width <= MAX_CONFUSION_CLASSES {
                        *confusion.entry((a as u32, b as u32)).or_default() += 1;
                    }
                }
            }
        }
        s.confusion = confusion.into_iter().map(|((a, b), n)| (a, b, n)).collect();
        s
    }

    /// Records both models' forward times over `rows`.
    pub fn timed(mut self, main_ns: u64, shadow_ns: u64, rows: u64) -> Self {
        self.main_ns += main_ns;
        self.shadow_ns += shadow_ns;
        self.timed_rows += rows;
        self
    }

    /// Both together (of two items, or two segments of one).
    pub fn merge(a: Option<Self>, b: Option<Self>) -> Option<Self> {
        let (mut a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (a, None) => return a,
            (None, b) => return b,
        };
        a.rows += b.rows;
        a.rows_missed += b.rows_missed;
        if a.columns.is_empty() {
            a.columns = b.columns;
        } else if a.columns.len() == b.columns.len() {
            for (x, y) in a.columns.iter_mut().zip(&b.columns) {
                x.merge(y);
            }
        }
        a.agree = match (a.agree, b.agree) {
            (Some(x), Some(y)) => Some(x + y),
            (x, y) => x.or(y),
        };
        let mut confusion: std::collections::BTreeMap<(u32, u32), u64> =
            a.confusion.iter().map(|&(x, y, n)| ((x, y), n)).collect();
        for &(x, y, n) in &b.confusion {
            *confusion.entry((x, y)).or_default() += n;
        }
        a.confusion = confusion.into_iter().map(|((x, y), n)| (x, y, n)).collect();
        add_counts(&mut a.hist_main, &b.hist_main);
        add_counts(&mut a.hist_shadow, &b.hist_shadow);
        a.cosine = match (a.cosine, b.cosine) {
            (Some(x), Some(y)) => Some(CosineStats {
                n: x.n + y.n,
                sum: x.sum + y.sum,
                min: x.min.min(y.min),
            }),
            (x, y) => x.or(y),
        };
        a.main_ns += b.main_ns;
        a.shadow_ns += b.shadow_ns;
        a.timed_rows += b.timed_rows;
        a.error = a.error.or(b.error);
        Some(a)
    }
}

/// Rows of `o` the model predicted (no NaN).
fn count_predicted(o: Outputs<'_>) -> usize {
    if o.width == 0 {
        return 0;
    }
    o.values
        .chunks(o.width)
        .filter(|r| !r.iter().any(|v| v.is_nan()))
        .count()
}

/// Cosine similarity of two vectors (0 when either is all zeros).
fn cosine(x: &[f32], y: &[f32]) -> f64 {
    let (mut xy, mut xx, mut yy) = (0f64, 0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        let (a, b) = (f64::from(*a), f64::from(*b));
        xy += a * b;
        xx += a * a;
        yy += b * b;
    }
    let d = (xx * yy).sqrt();
    if d > 0.0 {
        (xy / d).clamp(-1.0, 1.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(values: &[f32], width: usize) -> Outputs<'_> {
        Outputs { values, width }
    }

    #[test]
    fn moments_merged_in_pieces_equal_the_moments_of_all_pairs() {
        let pairs: Vec<(f64, f64)> = (0..1000)
            .map(|i| {
                let x = (i as f64 * 0.37).sin() * 1e3 + 1e6;
                (x, 0.5 * x + (i as f64 * 1.3).cos())
            })
            .collect();
        let mut whole = Moments::default();
        pairs.iter().for_each(|&(x, y)| whole.add(x, y));
        let mut merged = Moments::default();
        for chunk in pairs.chunks(137) {
            let mut m = Moments::default();
            chunk.iter().for_each(|&(x, y)| m.add(x, y));
            merged.merge(&m);
        }
        assert_eq!(merged.n, 1000);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
        assert!(close(merged.m2_x, whole.m2_x) && close(merged.c_xy, whole.c_xy));
        // Pearson by the textbook formula over the same pairs.
        let n = pairs.len() as f64;
        let (mx, my) = (
            pairs.iter().map(|p| p.0).sum::<f64>() / n,
            pairs.iter().map(|p| p.1).sum::<f64>() / n,
        );
        let sxy: f64 = pairs.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let sxx: f64 = pairs.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let syy: f64 = pairs.iter().map(|p| (p.1 - my).powi(2)).sum();
        let r = sxy / (sxx * syy).sqrt();
        assert!((merged.pearson().unwrap() - r).abs() < 1e-12, "{r}");
        let max = pairs.iter().map(|p| (p.0 - p.1).abs()).fold(0.0, f64::max);
        assert_eq!(merged.max_abs, max);
    }

    #[test]
    fn rows_either_model_failed_are_not_compared_and_top_classes_are_tallied() {
        let spec = OutputSpec {
            argmax: true,
            ..OutputSpec::default()
        };
        // Four rows of two classes; the job's model failed row 1, the shadow row 2.
        let main = [0.9, 0.1, f32::NAN, f32::NAN, 0.2, 0.8, 0.3, 0.7];
        let shadow = [0.6, 0.4, 0.5, 0.5, f32::NAN, f32::NAN, 0.8, 0.2];
        let s = ShadowStats::compare(out(&main, 2), out(&shadow, 2), &spec);
        assert_eq!((s.rows, s.rows_missed), (2, 1));
        assert_eq!(s.agree, Some(1));
        assert_eq!(s.confusion, vec![(0, 0, 1), (1, 0, 1)]);
        assert!((s.columns[0].max_abs - 0.5).abs() < 1e-6);
        assert!((s.columns[0].mean_abs() - 0.4).abs() < 1e-6);
        assert_eq!(s.hist_main[0].iter().sum::<u64>(), 2);
        assert!(s.error.unwrap().contains("raised"));
    }

    #[test]
    fn different_widths_are_not_compared_and_say_why() {
        let s = ShadowStats::compare(
            out(&[1.0, 2.0], 1),
            out(&[1.0, 2.0, 3.0, 4.0], 2),
            &OutputSpec::default(),
        );
        assert_eq!((s.rows, s.rows_missed), (0, 2));
        assert!(s.error.unwrap().contains("2 outputs per row"));
    }

    #[test]
    fn many_outputs_pool_into_one_column_and_vectors_compare_by_cosine() {
        let w = MAX_COLUMNS + 1;
        let main = vec![1.0f32; w * 3];
        let shadow = vec![2.0f32; w * 3];
        let s = ShadowStats::compare(out(&main, w), out(&shadow, w), &OutputSpec::default());
        assert_eq!(s.columns.len(), 1);
        assert_eq!(s.columns[0].n, 3 * w as u64);
        assert!(s.hist_main.is_empty());
        let spec = OutputSpec {
            vector: Some("embedding".into()),
            ..OutputSpec::default()
        };
        let s = ShadowStats::compare(
            out(&[1.0, 0.0, 0.0, 1.0], 2),
            out(&[1.0, 1.0, 0.0, 1.0], 2),
            &spec,
        );
        let c = s.cosine.unwrap();
        assert_eq!(c.n, 2);
        assert!((c.min - 0.5f64.sqrt()).abs() < 1e-9 && (c.sum - 1.0 - 0.5f64.sqrt()).abs() < 1e-9);
    }

    #[test]
    fn merged_items_add_up() {
        let spec = OutputSpec {
            argmax: true,
            ..OutputSpec::default()
        };
        let a =
            ShadowStats::compare(out(&[0.9, 0.1], 2), out(&[0.1, 0.9], 2), &spec).timed(10, 30, 1);
        let b =
            ShadowStats::compare(out(&[0.2, 0.8], 2), out(&[0.1, 0.9], 2), &spec).timed(20, 60, 1);
        let m = ShadowStats::merge(Some(a), Some(b)).unwrap();
        assert_eq!(
            (m.rows, m.agree, m.main_ns, m.shadow_ns, m.timed_rows),
            (2, Some(1), 30, 90, 2)
        );
        assert_eq!(m.confusion, vec![(0, 1, 1), (1, 1, 1)]);
        let missed =
            ShadowStats::merge(Some(m.clone()), Some(ShadowStats::missed(5, "cannot load")));
        assert_eq!(missed.unwrap().rows_missed, 5);
    }
}
