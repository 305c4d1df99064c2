//! `batchfleet compare`: the prediction distributions of two jobs side by
//! side, with drift statistics — the check before a new model version on a
//! dataset becomes the default.
//!
//! - **PSI** (population stability index): Σ (b − a) · ln(b / a) over the
//!   bins' shares (each share floored at 1e-4 so empty bins stay finite).
//!   Rule of thumb: < 0.1 no real change, 0.1–0.25 moderate, > 0.25 large.
//! - **KS distance**: the largest gap between the two cumulative
//!   distributions, at bin edges (so a lower bound of the exact statistic).

use crate::reducer::{ColumnDistribution, Distribution, Summary};
use serde::Serialize;
use std::fmt::Write;

/// Drift of one output column.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ColumnDrift {
    /// Column name.
    pub name: String,
    /// Population stability index.
    pub psi: f64,
    /// Kolmogorov–Smirnov distance at bin edges.
    pub ks: f64,
    /// Rows counted in job A and job B.
    pub rows: (u64, u64),
}

/// Compares two distributions with the same bins.
pub fn drift(a: &Distribution, b: &Distribution) -> Result<Vec<ColumnDrift>, String> {
    if (a.min, a.max, a.bins) != (b.min, b.max, b.bins) {
        return Err(format!(
            "the jobs use different histogram bins ([{}, {}) in {} vs [{}, {}) in {}); give both manifests the same [output] histogram",
            a.min, a.max, a.bins, b.min, b.max, b.bins
        ));
    }
    if a.columns.len() != b.columns.len() {
        return Err(format!(
            "the models have {} and {} outputs; only jobs with the same outputs compare",
            a.columns.len(),
            b.columns.len()
        ));
    }
    Ok(a.columns
        .iter()
        .zip(&b.columns)
        .map(|(x, y)| column_drift(x, y))
        .collect())
}

fn shares(c: &ColumnDistribution) -> Vec<f64> {
    let total = c.rows.max(1) as f64;
    c.counts.iter().map(|n| *n as f64 / total).collect()
}

fn column_drift(a: &ColumnDistribution, b: &ColumnDistribution) -> ColumnDrift {
    const FLOOR: f64 = 1e-4;
    let (pa, pb) = (shares(a), shares(b));
    let psi = pa
        .iter()
        .zip(&pb)
        .map(|(x, y)| {
            let (x, y) = (x.max(FLOOR), y.max(FLOOR));
            (y - x) * (y / x).ln()
        })
        .sum();
    let (mut ca, mut cb, mut ks) = (0.0, 0.0, 0.0f64);
    for (x, y) in pa.iter().zip(&pb) {
        ca += x;
        cb += y;
        ks = ks.max((ca - cb).abs());
    }
    ColumnDrift {
        name: a.name.clone(),
        psi,
        ks,
        rows: (a.rows, b.rows),
    }
}

/// The two jobs as [`render`] heads them: id, model and rows predicted.
pub fn heads(a: &Summary, b: &Summary) -> [String; 2] {
    [a, b].map(|j| {
        format!(
            "{}  model {} ({} rows)",
            j.job_id, j.model, j.rows_predicted
        )
    })
}

/// The two distributions (headed A and B by `heads`) and their drift as a table.
pub fn render(
    heads: &[String; 2],
    da: &Distribution,
    db: &Distribution,
    drift: &[ColumnDrift],
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "A  {}", heads[0]);
    let _ = writeln!(s, "B  {}", heads[1]);
    let w = (da.max - da.min) / f64::from(da.bins);
    for ((ca, cb), d) in da.columns.iter().zip(&db.columns).zip(drift) {
        let _ = writeln!(
            s,
            "\n{}: PSI {:.4} ({}), KS {:.4}",
            d.name,
            d.psi,
            verdict(d.psi),
            d.ks
        );
        let _ = writeln!(s, "  {:<21} {:>8} {:>8}", "bin", "A %", "B %");
        let (pa, pb) = (shares(ca), shares(cb));
        for (i, (x, y)) in pa.iter().zip(&pb).enumerate() {
            let label = if i == 0 {
                format!("< {}", da.min)
            } else if i == pa.len() - 1 {
                format!(">= {}", da.max)
            } else {
                let lo = da.min + w * (i - 1) as f64;
                format!("[{:.4}, {:.4})", lo, lo + w)
            };
            if *x == 0.0 && *y == 0.0 && (i == 0 || i == pa.len() - 1) {
                continue;
            }
            let _ = writeln!(
                s,
                "  {label:<21} {:>7.2}% {:>7.2}%  {}",
                x * 100.0,
                y * 100.0,
                bars(*x, *y)
            );
        }
    }
    s
}

/// What a PSI value usually means.
pub fn verdict(psi: f64) -> &'static str {
    if psi < 0.1 {
        "no significant shift"
    } else if psi < 0.25 {
        "moderate shift"
    } else {
        "large shift"
    }
}

fn bars(a: f64, b: f64) -> String {
    let n = |x: f64| ((x * 40.0).round() as usize).min(40);
    format!("{:<40}|{}", "#".repeat(n(a)), "#".repeat(n(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dist(counts: Vec<u64>) -> Distribution {
        Distribution {
            min: 0.0,
            max: 1.0,
            bins: (counts.len() - 2) as u32,
            columns: vec![ColumnDistribution {
                name: "score".into(),
                rows: counts.iter().sum(),
                counts,
            }],
        }
    }

    #[test]
    fn identical_distributions_do_not_drift() {
        let a = dist(vec![0, 10, 20, 30, 0]);
        let d = drift(&a, &a).unwrap();
        assert!(d[0].psi.abs() < 1e-12 && d[0].ks.abs() < 1e-12, "{d:?}");
    }

    #[test]
    fn a_shifted_distribution_has_the_textbook_psi_and_ks() {
        // Shares 0.5/0.5 vs 0.25/0.75: PSI = 0.25·ln 0.5 … computed by hand.
        let a = dist(vec![0, 50, 50, 0]);
        let b = dist(vec![0, 25, 75, 0]);
        let d = drift(&a, &b).unwrap();
        let expected = (0.25 - 0.5) * (0.25f64 / 0.5).ln() + (0.75 - 0.5) * (0.75f64 / 0.5).ln();
        assert!((d[0].psi - expected).abs() < 1e-9, "{d:?}");
        assert!((d[0].ks - 0.25).abs() < 1e-12);
        assert_eq!(verdict(d[0].psi), "large shift");
    }

    #[test]
    fn different_bins_are_refused() {
        let a = dist(vec![0, 1, 1, 0]);
        let b = dist(vec![0, 1, 1, 1, 0]);
        assert!(drift(&a, &b)
            .unwrap_err()
            .contains("different histogram bins"));
    }
}
