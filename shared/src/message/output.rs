//! Where an item's predictions go and how they are written: the output
//! folder and format, the names of the output columns, labels, vectors, the
//! prediction histogram's bins, and each item's part file name.

use serde::{Deserialize, Serialize};

/// Output format of part files.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// Comma-separated values with a header row.
    #[default]
    Csv,
    /// JSON Lines: one object per row, keys in column order.
    Jsonl,
    /// Apache Parquet.
    Parquet,
}

impl OutputFormat {
    /// Parses the lower-case name (`csv`, `jsonl`, `parquet`).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "csv" => Some(OutputFormat::Csv),
            "jsonl" => Some(OutputFormat::Jsonl),
            "parquet" => Some(OutputFormat::Parquet),
            _ => None,
        }
    }

    /// The lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            OutputFormat::Csv => "csv",
            OutputFormat::Jsonl => "jsonl",
            OutputFormat::Parquet => "parquet",
        }
    }

    /// File extension of a part file (the name).
    pub fn extension(self) -> &'static str {
        self.as_str()
    }

    /// The format whose part files have this extension.
    pub fn from_extension(ext: &str) -> Option<Self> {
        Self::parse(ext)
    }
}

/// Where predictions go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct OutputSpec {
    /// Absolute output directory of the job.
    pub dir: String,
    /// Part file format.
    pub format: OutputFormat,
    /// Bins of the prediction histogram recorded per output column.
    #[serde(default)]
    pub histogram: HistogramSpec,
    /// Names of the model's output columns; empty: `score` or `score_0 …`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<String>,
    /// Class names, one per model output, for `argmax` and `top_k`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// Add a `label` column: the class of the largest output.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub argmax: bool,
    /// Add `top1_label, top1_score, …` for the `top_k` largest outputs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub top_k: u32,
    /// Leave out the raw output columns (keep only labels).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drop_scores: bool,
    /// Input columns copied next to the id, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_columns: Vec<String>,
    /// Write the model's `[rows, D]` output as one vector column of this
    /// name (`[output] vector`): a fixed-size list of `float32` in Parquet,
    /// a JSON array in JSON Lines, `<name>_0 … <name>_{D-1}` in CSV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vector: Option<String>,
    /// `[output] shadow = "columns"`: after the job's own columns, each
    /// written again from the shadow model (`[model.shadow]`) as
    /// `<name>_shadow`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shadow_columns: bool,
}

/// For serde: a zero count is left out of the encoding.
pub(super) fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Equal-width bins over `[min, max)` for the distribution of a model
/// output, plus one bin below and one above.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HistogramSpec {
    /// Lower edge of the first bin.
    pub min: f64,
    /// Upper edge of the last bin.
    pub max: f64,
    /// Bins between `min` and `max`.
    pub bins: u32,
}

impl Default for HistogramSpec {
    fn default() -> Self {
        Self {
            min: 0.0,
            max: 1.0,
            bins: 20,
        }
    }
}

impl HistogramSpec {
    /// Index in a counts vector of `bins + 2` (0 = below `min`, `bins + 1` =
    /// at or above `max`); `None` for NaN.
    pub fn index(&self, v: f64) -> Option<usize> {
        if v.is_nan() {
            return None;
        }
        if v < self.min {
            return Some(0);
        }
        if v >= self.max {
            return Some(self.bins as usize + 1);
        }
        let w = (self.max - self.min) / f64::from(self.bins);
        Some((((v - self.min) / w) as usize).min(self.bins as usize - 1) + 1)
    }

    /// Adds row-major values of `width` columns to `counts` (one vector per column).
    pub fn add(&self, counts: &mut Vec<Vec<u64>>, values: &[f32], width: usize) {
        if width == 0 {
            return;
        }
        if counts.len() < width {
            counts.resize(width, vec![0; self.bins as usize + 2]);
        }
        for row in values.chunks(width) {
            for (c, v) in row.iter().enumerate() {
                if let Some(i) = self.index(f64::from(*v)) {
                    counts[c][i] += 1;
                }
            }
        }
    }
}

/// Adds the histogram counts `part` into `into` (`[column][bin]`), column
/// by column; columns `into` lacks are added.
pub fn add_counts(into: &mut Vec<Vec<u64>>, part: &[Vec<u64>]) {
    for (c, col) in part.iter().enumerate() {
        if into.len() <= c {
            into.push(vec![0; col.len()]);
        }
        for (b, n) in col.iter().enumerate() {
            if let Some(slot) = into[c].get_mut(b) {
                *slot += n;
            }
        }
    }
}

impl OutputSpec {
    /// File name of the part file for item `seq`.
    pub fn part_name(&self, seq: u32) -> String {
        part_file_name(seq, self.format)
    }

    /// Names of `width` model outputs: `[output] columns`, else `score` or
    /// `score_0 … score_{width-1}`.
    pub fn score_names(&self, width: usize) -> Vec<String> {
        self.output_names(width, &[])
    }

    /// Names of `width` model outputs made of several selected tensors
    /// (`parts`: each one's column prefix and width, see `[output]
    /// select`): `[output] columns` when given; for several parts `<prefix>`
    /// (width 1) or `<prefix>_<i>`; else `score` or `score_0 … score_{width-1}`.
    pub fn output_names(&self, width: usize, parts: &[(String, usize)]) -> Vec<String> {
        if !self.columns.is_empty() {
            self.columns.clone()
        } else if parts.len() > 1 {
            let mut names = Vec::with_capacity(width);
            for (prefix, w) in parts {
                if *w == 1 {
                    names.push(prefix.clone());
                } else {
                    names.extend((0..*w).map(|i| format!("{prefix}_{i}")));
                }
            }
            names
        } else if width == 1 {
            vec!["score".into()]
        } else {
            (0..width).map(|i| format!("score_{i}")).collect()
        }
    }

    /// Whether a part file column holds a raw model output (what the
    /// prediction histogram counts): anything but the id, copied input
    /// columns, the label columns and the shadow model's columns.
    pub fn is_score_column(&self, name: &str) -> bool {
        let shadow = self.shadow_columns && name.ends_with(crate::shadow::COLUMN_SUFFIX);
        !shadow
            && name != "id"
            && name != "label"
            && !self.include_columns.iter().any(|c| c == name)
            && !(name.starts_with("top") && (name.ends_with("_label") || name.ends_with("_score")))
    }
}

/// `part-000042.csv`: the committed output of one item.
pub fn part_file_name(seq: u32, format: OutputFormat) -> String {
    format!("part-{seq:06}.{}", format.extension())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_sort_in_item_order() {
        assert_eq!(part_file_name(42, OutputFormat::Csv), "part-000042.csv");
        assert!(part_file_name(9, OutputFormat::Csv) < part_file_name(10, OutputFormat::Csv));
    }
}
