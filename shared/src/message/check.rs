//! What one work item may ask of a worker, checked before anything is read
//! or allocated for it: its ids and digests well-formed, its layout's
//! indices inside its fields, its byte range inside the file it names, its
//! sizes under the caps ([`ItemLimits`]), its model call provided for.

use super::*;

/// What one work item may ask of a worker. A message is data from the
/// network: every size a worker allocates by comes from facts (the file's
/// length, the job record) or is held under these caps, so one message can
/// never make a worker allocate without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemLimits {
    /// Input bytes one item may read (a byte range, or its files together).
    pub max_item_bytes: u64,
    /// Feature values one item may hold at once (rows × values per row; 4 bytes each).
    pub max_item_values: u64,
    /// Pixels (height × width) of the images an item's preprocessing makes.
    pub max_image_pixels: u64,
    /// Bins of the prediction histogram.
    pub max_histogram_bins: u32,
}

impl Default for ItemLimits {
    fn default() -> Self {
        Self {
            max_item_bytes: 1 << 30,
            max_item_values: 1 << 28,
            max_image_pixels: 8192 * 8192,
            max_histogram_bins: 1000,
        }
    }
}

/// Whether `id` can be a job id: `<name>-<hash>`, the name 1–64 of
/// `[A-Za-z0-9._-]` (as the manifest allows).
pub fn valid_job_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 80
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl WorkItem {
    /// Checks the message is internally consistent and within `limits`,
    /// before anything is read or allocated for it: the layout's column
    /// indices fit its field count, a byte range lies inside the file length
    /// it names and holds at most one row per byte, the model digest is a
    /// SHA-256, images have 1 or 3 channels. The reason names the field.
    pub fn check(&self, limits: &ItemLimits) -> Result<(), String> {
        let t = &self.task;
        if !valid_job_id(&self.job_id) {
            return Err(format!(
                "job id {:?} is not a batchfleet job id",
                truncated(&self.job_id)
            ));
        }
        check_model(&t.model)?;
        if t.batch_size == 0 {
            return Err("batch_size is 0".into());
        }
        if t.failure.max_attempts == 0 || t.failure.item_timeout_ms == 0 {
            return Err("the failure policy allows no attempt or no time".into());
        }
        let h = &t.output.histogram;
        if h.bins == 0
            || h.bins > limits.max_histogram_bins
            || !(h.min.is_finite() && h.max.is_finite() && h.min < h.max)
        {
            return Err(format!(
                "histogram of {} bins over [{}, {}) (at most {} bins over a finite, non-empty range)",
                h.bins, h.min, h.max, limits.max_histogram_bins
            ));
        }
        if !t.layout.fits(&self.input) {
            return Err(format!(
                "{} with a {} layout",
                match &self.input {
                    InputSlice::CsvRange(_) => "a CSV range",
                    InputSlice::JsonlRange(_) => "a JSON Lines range",
                    InputSlice::ParquetRowGroups { .. } => "Parquet row groups",
                    InputSlice::Files { .. } => "image files",
                },
                t.layout.describe()
            ));
        }
        // Text input feeds the model token ids instead of features.
        let text = t.text.as_ref();
        if let Some(x) = text {
            if x.max_length == 0 || x.max_length > MAX_TOKENS_PER_ROW {
                return Err(format!(
                    "max_length {} (1 to {MAX_TOKENS_PER_ROW} tokens per row)",
                    x.max_length
                ));
            }
            if x.column.is_empty() || x.tokenizer.path.is_empty() {
                return Err("text input with no column or no tokenizer".into());
            }
            if matches!(t.layout, Layout::Image(_)) {
                return Err("text input with an image layout".into());
            }
        }
        check_call(t)?;
        let files = match &self.input {
            InputSlice::Files { files, .. } => files.len(),
            _ => 1,
        };
        if !self.versions.is_empty() && self.versions.len() != files {
            return Err(format!(
                "{} input versions for {files} input files",
                self.versions.len()
            ));
        }
        if self.versions.iter().any(|v| v.len() > 256) {
            return Err("an input version longer than 256 bytes".into());
        }
        self.check_slice(limits)
    }

    /// The input slice against its layout and the caps: sizes, indices,
    /// image settings, and the values the item may hold.
    fn check_slice(&self, limits: &ItemLimits) -> Result<(), String> {
        let t = &self.task;
        let text = t.text.as_ref();
        let values = |rows: u64, per_row: u64| -> Result<(), String> {
            match rows.checked_mul(per_row) {
                Some(n) if n <= limits.max_item_values => Ok(()),
                _ => Err(format!(
                    "{rows} rows of {per_row} values exceed the {} values one item may hold (--max-item-values)",
                    limits.max_item_values
                )),
            }
        };
        match (&self.input, &t.layout) {
            (InputSlice::CsvRange(r), Layout::Csv(l)) => {
                check_range(r, limits)?;
                check_csv_layout(l, text)?;
                values(r.rows, l.feature_columns.len() as u64)?;
            }
            (InputSlice::JsonlRange(r), Layout::Jsonl(j)) => {
                check_range(r, limits)?;
                if j.feature_keys.is_empty() && text.is_none() {
                    return Err("the JSON Lines layout names no feature".into());
                }
                values(r.rows, j.feature_keys.len() as u64)?;
            }
            (InputSlice::ParquetRowGroups { groups, rows, .. }, Layout::Parquet(p)) => {
                if *groups == 0 || (p.feature_columns.is_empty() && text.is_none()) {
                    return Err("no row group or no feature column".into());
                }
                values(*rows, p.feature_columns.len() as u64)?;
            }
            (InputSlice::Files { files, sizes, .. }, Layout::Image(img)) => {
                if files.is_empty() || files.len() != sizes.len() {
                    return Err(format!("{} files with {} sizes", files.len(), sizes.len()));
                }
                let bytes = sizes.iter().try_fold(0u64, |a, s| a.checked_add(*s));
                if bytes.is_none_or(|b| b > limits.max_item_bytes) {
                    return Err(format!(
                        "the item's files exceed the {} bytes one item may read (--max-item-bytes)",
                        limits.max_item_bytes
                    ));
                }
                if img.channels != 1 && img.channels != 3 {
                    return Err(format!("images of {} channels (1 or 3)", img.channels));
                }
                if img.mean.len() != img.channels as usize
                    || img.std.len() != img.channels as usize
                    || img.std.iter().any(|s| !(*s > 0.0 && s.is_finite()))
                    || img.mean.iter().any(|m| !m.is_finite())
                {
                    return Err(
                        "mean and std must hold one finite value per channel, std above 0".into(),
                    );
                }
                let pixels = u64::from(img.height) * u64::from(img.width);
                if img.height == 0 || img.width == 0 || pixels > limits.max_image_pixels {
                    return Err(format!(
                        "images of {}×{} pixels (1 to {} pixels, --max-image-pixels)",
                        img.height, img.width, limits.max_image_pixels
                    ));
                }
                values(files.len() as u64, pixels * u64::from(img.channels))?;
            }
            _ => unreachable!("the layout fits the slice (checked above)"),
        }
        Ok(())
    }
}

/// The model's digest is a SHA-256 in hex, its device one a worker knows.
fn check_model(model: &ModelRef) -> Result<(), String> {
    let sha = &model.sha256;
    if sha.len() != 64
        || !sha
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        return Err(format!(
            "model sha256 {:?} is not a SHA-256 in hex",
            truncated(sha)
        ));
    }
    let device_ok = model.device == "cpu"
        || model.device == "cuda"
        || model
            .device
            .strip_prefix("cuda:")
            .is_some_and(|n| n.len() <= 3 && n.parse::<u16>().is_ok());
    if !device_ok {
        return Err(format!(
            "device {:?} is not cpu, cuda or cuda:N",
            truncated(&model.device)
        ));
    }
    Ok(())
}

/// Arguments a model's `forward` may be given, and outputs one item may select.
pub const MAX_MODEL_INPUTS: usize = 16;
/// See [`MAX_MODEL_INPUTS`].
pub const MAX_SELECTED_OUTPUTS: usize = 64;

/// The model's call: each input has a source the task provides, and the
/// selected outputs and names are few and short.
fn check_call(t: &TaskSpec) -> Result<(), String> {
    let m = &t.model;
    if m.inputs.len() > MAX_MODEL_INPUTS || m.select.len() > MAX_SELECTED_OUTPUTS {
        return Err(format!(
            "{} model inputs and {} selected outputs (at most {MAX_MODEL_INPUTS} and {MAX_SELECTED_OUTPUTS})",
            m.inputs.len(),
            m.select.len()
        ));
    }
    let image = matches!(t.layout, Layout::Image(_));
    let features = match &t.layout {
        Layout::Csv(l) => !l.feature_columns.is_empty(),
        Layout::Jsonl(j) => !j.feature_keys.is_empty(),
        Layout::Parquet(p) => !p.feature_columns.is_empty(),
        Layout::Image(_) => false,
    };
    for input in &m.inputs {
        if input.name.is_empty() || input.name.len() > 256 {
            return Err("a model input with an empty or over-long name".into());
        }
        let provided = match input.source {
            s if s.is_token() => t.text.is_some(),
            InputSource::Pixels => image,
            _ => features,
        };
        if !provided {
            return Err(format!(
                "model input {:?} takes {}, which this task does not provide",
                truncated(&input.name),
                input.source.as_str()
            ));
        }
    }
    let long_name = |n: &str| n.is_empty() || n.len() > 256;
    if m.select
        .iter()
        .any(|s| matches!(s, Selector::Name(n) if long_name(n)))
        || t.output.vector.as_deref().is_some_and(long_name)
    {
        return Err("an output name that is empty or over-long".into());
    }
    Ok(())
}

fn truncated(s: &str) -> String {
    s.chars().take(80).collect()
}

fn check_range(r: &ByteRange, limits: &ItemLimits) -> Result<(), String> {
    if r.start > r.end || r.end > r.file_len {
        return Err(format!(
            "byte range {}..{} does not lie inside the {} bytes of {}",
            r.start, r.end, r.file_len, r.path
        ));
    }
    if r.end - r.start > limits.max_item_bytes {
        return Err(format!(
            "byte range {}..{} of {} exceeds the {} bytes one item may read (--max-item-bytes)",
            r.start, r.end, r.path, limits.max_item_bytes
        ));
    }
    if r.rows > r.end - r.start {
        return Err(format!(
            "{} rows claimed in the {} bytes {}..{} of {}",
            r.rows,
            r.end - r.start,
            r.start,
            r.end,
            r.path
        ));
    }
    Ok(())
}

/// Tokens one row of text input may have at most (`max_length`).
pub const MAX_TOKENS_PER_ROW: u32 = 1 << 16;

fn check_csv_layout(l: &CsvLayout, text: Option<&TextSpec>) -> Result<(), String> {
    let outside = std::iter::once(l.id_column)
        .chain(l.feature_columns.iter().copied())
        .chain(l.include_columns.iter().copied())
        .chain(text.map(|t| t.csv_field))
        .find(|c| *c >= l.fields);
    if let Some(c) = outside {
        return Err(format!(
            "CSV column index {c} is outside the {} fields of the layout",
            l.fields
        ));
    }
    if l.feature_columns.is_empty() && text.is_none() {
        return Err("the CSV layout names no feature column".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::sample_item;
    use super::*;

    #[test]
    fn sane_items_pass_and_each_impossible_field_is_named() {
        let limits = ItemLimits::default();
        assert_eq!(sample_item().check(&limits), Ok(()));
        let refused = |f: &dyn Fn(&mut WorkItem), what: &str| {
            let mut item = sample_item();
            f(&mut item);
            let err = item.check(&limits).expect_err(what);
            assert!(err.contains(what), "{what}: {err}");
        };
        let csv = |f: fn(&mut CsvLayout)| {
            move |i: &mut WorkItem| {
                if let Layout::Csv(l) = &mut i.task.layout {
                    f(l);
                }
            }
        };
        refused(
            &csv(|l| l.id_column = 99),
            "index 99 is outside the 18 fields",
        );
        refused(&csv(|l| l.include_columns = vec![40]), "index 40");
        refused(
            &|i| {
                i.task.layout = Layout::Jsonl(JsonLayout {
                    id_key: "id".into(),
                    feature_keys: vec!["a".into()],
                    include_keys: Vec::new(),
                    missing: Default::default(),
                })
            },
            "a CSV range with a JSON Lines layout",
        );
        refused(
            &|i| {
                if let InputSlice::CsvRange(r) = &mut i.input {
                    r.end = 1 << 40;
                }
            },
            "does not lie inside the 8192 bytes",
        );
        refused(
            &|i| {
                if let InputSlice::CsvRange(r) = &mut i.input {
                    r.rows = 1 << 50;
                }
            },
            "rows claimed",
        );
        refused(
            &|i| i.task.model.sha256 = "é".repeat(32),
            "is not a SHA-256",
        );
        refused(
            &|i| i.job_id = "../../etc".into(),
            "is not a batchfleet job id",
        );
        refused(&|i| i.task.output.histogram.bins = 1 << 30, "bins");
        refused(&|i| i.task.model.device = "tpu".into(), "device");
        refused(
            &|i| {
                i.input = InputSlice::ParquetRowGroups {
                    path: "/d.parquet".into(),
                    first_group: 0,
                    groups: 1,
                    first_row: 0,
                    rows: u64::MAX / 2,
                    file_len: 10,
                };
                i.task.layout = Layout::Parquet(ParquetLayout {
                    id_column: "id".into(),
                    feature_columns: vec!["a".into(), "b".into()],
                    include_columns: Vec::new(),
                    missing: Default::default(),
                });
            },
            "exceed the 268435456 values",
        );
        let image = |channels: u32, side: u32| {
            move |i: &mut WorkItem| {
                i.input = InputSlice::Files {
                    root: "/d".into(),
                    files: vec!["a.png".into()],
                    sizes: vec![10],
                    first_index: 0,
                };
                i.task.layout = Layout::Image(ImageSpec {
                    height: side,
                    width: side,
                    channels,
                    mean: vec![0.0; channels as usize],
                    std: vec![1.0; channels as usize],
                });
            }
        };
        let mut ok = sample_item();
        image(3, 224)(&mut ok);
        assert_eq!(ok.check(&limits), Ok(()));
        refused(&image(4, 224), "4 channels");
        refused(&image(3, 100_000), "pixels");
    }
}
