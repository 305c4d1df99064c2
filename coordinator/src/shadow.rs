//! The `shadow` section of `_summary.json`: a candidate model
//! (`[model.shadow]`) against the job's, over every row both predicted —
//! per output column the largest and mean absolute difference and Pearson's
//! correlation, the top-class agreement and confusion table for `argmax` /
//! `top_k` outputs, the cosine similarity for vectors, both histograms with
//! PSI and KS, and each model's forward time per row. Read back by
//! `batchfleet compare JOB` (see docs/rollout.md).

use crate::compare::ColumnDrift;
use crate::reducer::Distribution;
use batchfleet_shared::message::{ModelRef, OutputSpec};
use batchfleet_shared::shadow::{ShadowStats, MAX_COLUMNS};
use batchfleet_shared::store::ItemStats;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// `_summary.json`'s `shadow` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowSummary {
    /// The shadow model file.
    pub model: String,
    /// Its SHA-256.
    pub model_sha256: String,
    /// Rows both models predicted.
    pub rows_compared: u64,
    /// Rows the job's model predicted that were not compared (see `error`).
    pub rows_not_compared: u64,
    /// Each output column (all of them pooled past 64).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<ShadowColumn>,
    /// Top-class agreement (`argmax` / `top_k` outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agreement: Option<Agreement>,
    /// Cosine similarity of each row's two vectors (`[output] vector`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cosine: Option<Cosine>,
    /// The job's model's histograms over the compared rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_distribution: Option<Distribution>,
    /// The shadow's histograms over the same rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow_distribution: Option<Distribution>,
    /// Forward time per row, in microseconds.
    pub forward_us_per_row: ForwardTimes,
    /// Why some rows (or all) were not compared: the shadow raised on
    /// them, could not be loaded or run, returned other outputs, or an
    /// earlier delivery computed them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One output column of both models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowColumn {
    /// The column's name in the part files.
    pub name: String,
    /// Largest |job's value − shadow's value|.
    pub max_abs_diff: f64,
    /// Mean |job's value − shadow's value|.
    pub mean_abs_diff: f64,
    /// Pearson's correlation; absent when either model's values are constant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pearson: Option<f64>,
    /// Mean of the job's model's values.
    pub mean_main: f64,
    /// Mean of the shadow's values.
    pub mean_shadow: f64,
    /// Population stability index of the shadow's histogram against the job's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psi: Option<f64>,
    /// Kolmogorov–Smirnov distance at bin edges.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ks: Option<f64>,
}

/// Rows whose top class both models agree on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Agreement {
    /// Share of the compared rows.
    pub rate: f64,
    /// Rows.
    pub rows: u64,
    /// Rows by the job's model's class (rows of `counts`) and the shadow's
    /// (columns), for models of at most 64 classes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confusion: Option<Confusion>,
}

/// A confusion table: `counts[job's class][shadow's class]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Confusion {
    /// The classes, in order (`[output] labels`, else their indices).
    pub labels: Vec<String>,
    /// Rows per pair of classes.
    pub counts: Vec<Vec<u64>>,
}

/// Cosine similarities of the two models' vectors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Cosine {
    /// Mean over the compared rows.
    pub mean: f64,
    /// Least.
    pub min: f64,
}

/// Forward time per row of each model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ForwardTimes {
    /// The job's model.
    pub main: f64,
    /// The shadow.
    pub shadow: f64,
}

impl ShadowSummary {
    /// The section of a job whose items recorded shadow stats; `names`:
    /// the job's output columns as the part files name them.
    pub fn of(
        stats: &[ItemStats],
        model: Option<&ModelRef>,
        output: &OutputSpec,
        names: &[String],
    ) -> Option<Self> {
        let mut all = stats
            .iter()
            .fold(None, |acc, s| ShadowStats::merge(acc, s.shadow.clone()))?;
        // Items a worker without shadow support committed recorded nothing:
        // their rows count as not compared too.
        let without = stats.iter().filter(|s| s.shadow.is_none()).count();
        if without > 0 {
            all.error.get_or_insert(format!(
                "{without} items were committed by workers that do not run shadow models; upgrade the workers"
            ));
        }
        let predicted: u64 = stats.iter().map(|s| s.rows).sum();
        all.rows_missed = all.rows_missed.max(predicted.saturating_sub(all.rows));
        let width = all.columns.len();
        let name = |i: usize| -> String {
            if width == 1 && all.hist_main.is_empty() && all.columns[0].n > all.rows {
                format!("all outputs (over {MAX_COLUMNS} are pooled)")
            } else {
                crate::reducer::column_name(names, i, width)
            }
        };
        let col_names: Vec<String> = (0..width).map(name).collect();
        let main_distribution =
            Distribution::new(&output.histogram, all.hist_main.clone(), &col_names);
        let shadow_distribution =
            Distribution::new(&output.histogram, all.hist_shadow.clone(), &col_names);
        let drift: Vec<ColumnDrift> = match (&main_distribution, &shadow_distribution) {
            (Some(a), Some(b)) => crate::compare::drift(a, b).unwrap_or_default(),
            _ => Vec::new(),
        };
        let columns = all
            .columns
            .iter()
            .enumerate()
            .map(|(i, m)| ShadowColumn {
                name: col_names[i].clone(),
                max_abs_diff: m.max_abs,
                mean_abs_diff: m.mean_abs(),
                pearson: m.pearson(),
                mean_main: m.mean_x,
                mean_shadow: m.mean_y,
                psi: drift.get(i).map(|d| d.psi),
                ks: drift.get(i).map(|d| d.ks),
            })
            .collect();
        let agreement = all.agree.map(|rows| Agreement {
            rate: rows as f64 / all.rows.max(1) as f64,
            rows,
            confusion: (!all.confusion.is_empty()).then(|| {
                let classes = width.max(
                    all.confusion
                        .iter()
                        .map(|&(a, b, _)| a.max(b) as usize + 1)
                        .max()
                        .unwrap_or(0),
                );
                let mut counts = vec![vec![0u64; classes]; classes];
                for &(a, b, n) in &all.confusion {
                    counts[a as usize][b as usize] += n;
                }
                Confusion {
                    labels: (0..classes)
                        .map(|k| output.labels.get(k).cloned().unwrap_or(k.to_string()))
                        .collect(),
                    counts,
                }
            }),
        });
        let per_row = |ns: u64| ns as f64 / 1e3 / all.timed_rows.max(1) as f64;
        Some(Self {
            model: model.map(|m| m.path.clone()).unwrap_or_default(),
            model_sha256: model.map(|m| m.sha256.clone()).unwrap_or_default(),
            rows_compared: all.rows,
            rows_not_compared: all.rows_missed,
            columns,
            agreement,
            cosine: all.cosine.map(|c| Cosine {
                mean: c.sum / c.n.max(1) as f64,
                min: c.min,
            }),
            main_distribution,
            shadow_distribution,
            forward_us_per_row: ForwardTimes {
                main: per_row(all.main_ns),
                shadow: per_row(all.shadow_ns),
            },
            error: all.error,
        })
    }

    /// The section as `batchfleet compare JOB` prints it.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "shadow {}: {} rows compared, {} not compared",
            self.model, self.rows_compared, self.rows_not_compared
        );
        if let Some(e) = &self.error {
            let _ = writeln!(s, "  not compared because: {e}");
        }
        let f = self.forward_us_per_row;
        let _ = writeln!(
            s,
            "  forward per row: job's model {:.1} µs, shadow {:.1} µs ({:.2}×)",
            f.main,
            f.shadow,
            f.shadow / f.main.max(f64::MIN_POSITIVE)
        );
        if !self.columns.is_empty() {
            let _ = writeln!(
                s,
                "  {:<24} {:>12} {:>12} {:>9}",
                "column", "max |diff|", "mean |diff|", "pearson"
            );
            for c in &self.columns {
                let r = c.pearson.map_or("-".into(), |r| format!("{r:.5}"));
                let _ = writeln!(
                    s,
                    "  {:<24} {:>12.6} {:>12.6} {:>9}",
                    c.name, c.max_abs_diff, c.mean_abs_diff, r
                );
            }
        }
        if let Some(a) = &self.agreement {
            let _ = writeln!(
                s,
                "  top class agrees on {} rows ({:.2} %)",
                a.rows,
                a.rate * 100.0
            );
            if let Some(c) = &a.confusion {
                let _ = writeln!(s, "  confusion (rows: job's model, columns: shadow):");
                let _ = write!(s, "  {:>12}", "");
                for l in &c.labels {
                    let _ = write!(s, " {l:>8.8}");
                }
                let _ = writeln!(s);
                for (l, row) in c.labels.iter().zip(&c.counts) {
                    let _ = write!(s, "  {l:>12.12}");
                    for n in row {
                        let _ = write!(s, " {n:>8}");
                    }
                    let _ = writeln!(s);
                }
            }
        }
        if let Some(c) = self.cosine {
            let _ = writeln!(
                s,
                "  cosine similarity: mean {:.6}, least {:.6}",
                c.mean, c.min
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfleet_shared::shadow::Outputs;

    fn item(seq: u32, shadow: ShadowStats) -> ItemStats {
        ItemStats {
            seq,
            rows: 0,
            rows_rejected: 0,
            worker: "w".into(),
            started_ms: 0,
            finished_ms: 0,
            attempt: 1,
            recovered: false,
            rows_resumed: 0,
            vector: None,
            shadow: Some(shadow),
        }
    }

    #[test]
    fn items_merge_into_named_columns_a_confusion_table_and_times_per_row() {
        let output = OutputSpec {
            argmax: true,
            labels: vec!["cat".into(), "dog".into()],
            ..OutputSpec::default()
        };
        let compare = |x: &[f32], y: &[f32]| {
            ShadowStats::compare(
                Outputs {
                    values: x,
                    width: 2,
                },
                Outputs {
                    values: y,
                    width: 2,
                },
                &output,
            )
        };
        let stats = [
            item(
                0,
                compare(&[0.9, 0.1, 0.2, 0.8], &[0.8, 0.2, 0.6, 0.4]).timed(4_000, 8_000, 2),
            ),
            item(1, compare(&[0.3, 0.7], &[0.1, 0.9]).timed(2_000, 4_000, 1)),
            item(2, ShadowStats::missed(3, "cannot load")),
        ];
        let model = ModelRef::plain("/m/candidate.pt", "ab", "cpu");
        let names = ["cat_score".to_owned(), "dog_score".to_owned()];
        let s = ShadowSummary::of(&stats, Some(&model), &output, &names).unwrap();
        assert_eq!((s.rows_compared, s.rows_not_compared), (3, 3));
        assert_eq!(s.columns[1].name, "dog_score");
        assert!((s.columns[0].max_abs_diff - 0.4).abs() < 1e-6);
        let a = s.agreement.as_ref().unwrap();
        assert_eq!(a.rows, 2);
        let c = a.confusion.as_ref().unwrap();
        assert_eq!(c.labels, ["cat", "dog"]);
        assert_eq!(c.counts, vec![vec![1, 0], vec![1, 1]]);
        assert_eq!(s.forward_us_per_row.main, 2.0);
        assert_eq!(s.forward_us_per_row.shadow, 4.0);
        assert_eq!(s.error.as_deref(), Some("cannot load"));
        assert!(s.columns[0].psi.is_some());
        let shown = s.render();
        assert!(
            shown.contains("3 rows compared") && shown.contains("(66.67 %)"),
            "{shown}"
        );
        // A job without a shadow has no section.
        let mut plain = stats[0].clone();
        plain.shadow = None;
        assert!(ShadowSummary::of(&[plain.clone()], None, &output, &names).is_none());
        // An item an older worker committed (no shadow stats): its rows are
        // not compared, and the section says why.
        plain.rows = 40;
        let mut mixed = stats.to_vec();
        mixed[0].rows = 2;
        mixed[1].rows = 1;
        mixed[2].rows = 3;
        mixed.push(plain);
        let s = ShadowSummary::of(&mixed, None, &output, &names).unwrap();
        assert_eq!((s.rows_compared, s.rows_not_compared), (3, 43));
        assert_eq!(s.error.as_deref(), Some("cannot load"));
    }
}
