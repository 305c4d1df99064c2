//! The validated job: [`JobSpec`] and the parts it carries besides the
//! worker's [`TaskSpec`] ([`ItemSizing`], [`ErrorBudget`], [`OnComplete`]),
//! the `[job]` name and pool rules, and the job id — a digest of everything
//! that determines the job's output.

use super::schema::JobSection;
use super::Problems;
use batchfleet_shared::message::TaskSpec;
use batchfleet_shared::source::Fingerprint;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// How input is cut into work items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ItemSizing {
    /// About this many rows per item.
    Rows(u64),
    /// About this many input bytes per item.
    Bytes(u64),
}

/// How a CSV or JSON Lines job is cut when its files are cut blind, at
/// byte offsets from their sizes alone (no data read to plan): each range
/// owns the records that start in it, found by the worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BlindCut {
    /// Mean bytes of a record in the sample the coordinator read.
    pub bytes_per_row: f64,
    /// Bytes of the header line (CSV; 0 for JSON Lines), as sampled: all
    /// files of a job share one header.
    pub header_bytes: u64,
}

impl BlindCut {
    /// Rows of a `len`-byte file, estimated from its size.
    pub fn rows_of(&self, len: u64) -> u64 {
        (len.saturating_sub(self.header_bytes) as f64 / self.bytes_per_row).round() as u64
    }

    /// Items of a `len`-byte file: `⌈rows / item_rows⌉` of the estimated
    /// rows, or the nearest whole number of `item_bytes` ranges; at least one.
    pub fn items_of(&self, len: u64, sizing: ItemSizing) -> u64 {
        let data = len.saturating_sub(self.header_bytes);
        match sizing {
            ItemSizing::Rows(r) => self.rows_of(len).div_ceil(r.max(1)),
            ItemSizing::Bytes(b) => (data + b.max(1) / 2) / b.max(1),
        }
        .max(1)
    }
}

/// A manifest that passed validation, with every path resolved.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// Stable job id: `<name>-<first 8 hex of the content hash>`.
    pub job_id: String,
    /// Job name.
    pub name: String,
    /// Pool.
    pub pool: String,
    /// `[job] priority`: the job's share of the pool beside other jobs (not
    /// part of the job id: running the manifest again with another
    /// priority re-weights the running job).
    pub priority: super::schema::Priority,
    /// `[job] deadline` (not part of the job id, as priority).
    pub deadline: Option<Deadline>,
    /// `[job] worker_hour_cost` (not part of the job id).
    pub worker_hour_cost: Option<f64>,
    /// Manifest file.
    pub manifest_path: PathBuf,
    /// Input files, sorted, deduplicated.
    pub files: Vec<PathBuf>,
    /// Header of the input files.
    pub header: Vec<String>,
    /// Work item sizing.
    pub sizing: ItemSizing,
    /// CSV and JSON Lines: cut blind (`None`: planned by reading every
    /// record, for `[input] quoted_newlines` or a sample that has them).
    pub blind: Option<BlindCut>,
    /// What every work item of the job carries.
    pub task: TaskSpec,
    /// When the job as a whole fails.
    pub budget: ErrorBudget,
    /// What runs when the job ends.
    pub on_complete: OnComplete,
    /// Write the merged output when the job completes.
    pub merge: bool,
    /// `files` input: the folder the files' ids are relative to.
    pub root: Option<PathBuf>,
    /// What each input file is (size, modification time or ETag), in
    /// `files`' order: the job id covers them, and each item carries its
    /// files' versions for the worker to check.
    pub fingerprints: Vec<Fingerprint>,
    /// `--set` overrides applied over the manifest file, as given.
    pub overrides: Vec<String>,
    /// The manifest as validated (the file with the overrides applied), in TOML.
    pub resolved_manifest: String,
}

impl JobSpec {
    /// Output directory.
    pub fn output_dir(&self) -> &Path {
        Path::new(&self.task.output.dir)
    }

    /// The fingerprint validation recorded for input file `path`.
    pub fn fingerprint(&self, path: &Path) -> Option<&Fingerprint> {
        self.files
            .binary_search_by(|f| f.as_path().cmp(path))
            .ok()
            .map(|i| &self.fingerprints[i])
    }

    /// The input files with their fingerprints, as the job record and
    /// `_summary.json` list them.
    pub fn input_files(&self) -> Vec<InputFile> {
        self.files
            .iter()
            .zip(&self.fingerprints)
            .map(|(path, fingerprint)| InputFile {
                path: path.to_string_lossy().into_owned(),
                fingerprint: fingerprint.clone(),
                items: None,
            })
            .collect()
    }
}

/// One input file of a job and what it was when the job was planned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct InputFile {
    /// Absolute path or `s3://` URL.
    pub path: String,
    /// Size and modification time (local) or ETag (S3).
    #[serde(flatten)]
    pub fingerprint: Fingerprint,
    /// The first and last item holding its rows: its predictions are in
    /// the part files of those numbers (`part-<first>` … `part-<last>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<[u32; 2]>,
}

/// The validated `[on_complete]` section.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OnComplete {
    /// Command and arguments.
    pub command: Option<Vec<String>>,
    /// Command time limit.
    pub command_timeout: std::time::Duration,
    /// Webhook URL (kept secret: it may carry a token).
    pub webhook: Option<batchfleet_shared::secret::SecretUrl>,
    /// Name of the environment variable with the bearer token.
    pub webhook_token_env: Option<String>,
    /// Name of the environment variable the webhook URL came from.
    pub webhook_url_env: Option<String>,
    /// Attempts.
    pub webhook_attempts: u32,
}

/// Error budget of a job (Azure's `error_threshold`): exceeded → job `failed`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ErrorBudget {
    /// Most items that may fail.
    pub max_failed_items: Option<u64>,
    /// Most percent of items that may fail.
    pub max_failed_percent: Option<f64>,
    /// Crashes of one item before it is dead-lettered as `crash` (0: never).
    pub max_crashes: u32,
    /// Most rows that may be rejected (bad rows, rows the model raised on).
    pub max_rejected_rows: Option<u64>,
    /// Most percent of the job's rows that may be rejected.
    pub max_rejected_percent: Option<f64>,
}

impl ErrorBudget {
    /// Whether `failed` of `total` items exceeds the budget.
    pub fn exceeded(&self, failed: u64, total: u64) -> bool {
        let by_count = self.max_failed_items.is_some_and(|max| failed > max);
        let by_share = self
            .max_failed_percent
            .is_some_and(|pct| total > 0 && (failed as f64) * 100.0 > pct * total as f64);
        by_count || by_share
    }

    /// Why the rows rejected so far break the budget, if they do: more than
    /// `max_rejected_rows`, more than `max_rejected_percent` of the job's
    /// rows, or — whatever the limits — every row of a settled job.
    pub fn rejected_too_many(&self, p: &batchfleet_shared::store::Progress) -> Option<String> {
        let rejected = p.rows_rejected;
        if let Some(max) = self.max_rejected_rows.filter(|&max| rejected > max) {
            return Some(format!(
                "{rejected} rows rejected, more than [failure] max_rejected_rows = {max}"
            ));
        }
        if let Some(pct) = self.max_rejected_percent.filter(|&pct| {
            p.rows_total > 0 && (rejected as f64) * 100.0 > pct * p.rows_total as f64
        }) {
            return Some(format!(
                "{rejected} of {} rows rejected, more than [failure] max_rejected_percent = {pct}",
                p.rows_total
            ));
        }
        (p.settled() && p.rows_done > 0 && rejected >= p.rows_done).then(|| {
            format!(
                "every row was rejected ({rejected} of {}): nothing was predicted — see _rejects/ for why (a wrong [input] layout, a model that raises on every row)",
                p.rows_done
            )
        })
    }
}

/// Checks the `[job]` name and pool.
pub(super) fn check_job(job: &JobSection, problems: &mut Problems) -> Option<Deadline> {
    if !valid_name(&job.name) {
        problems.add(
            "[job] name",
            format!(
                "\"{}\" is not a valid job name; use 1-64 letters, digits, '-', '_' or '.'",
                job.name
            ),
        );
    }
    if !valid_name(&job.pool) {
        problems.add(
            "[job] pool",
            format!(
                "\"{}\" is not a valid pool name; use 1-64 letters, digits, '-', '_' or '.'",
                job.pool
            ),
        );
    }
    if let Some(cost) = job
        .worker_hour_cost
        .filter(|c| !(c.is_finite() && *c > 0.0))
    {
        problems.add(
            "[job] worker_hour_cost",
            format!("{cost} is not a cost; give what one worker costs per hour, a number above 0 (e.g. 1.20)"),
        );
    }
    let deadline = job.deadline.as_deref()?;
    match Deadline::parse(deadline) {
        Ok(d) => Some(d),
        Err(why) => {
            problems.add("[job] deadline", format!("\"{deadline}\" {why}"));
            None
        }
    }
}

/// `[job] deadline`, as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deadline {
    /// A duration from the job's first run (its registration).
    After(std::time::Duration),
    /// A time, in ms since the epoch.
    At(u64),
}

impl Deadline {
    /// A duration (`2h`, `90m`, `1h 30m`) or an RFC 3339 time
    /// (`2026-12-08T06:00:00Z`; without a zone, UTC).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Ok(d) = humantime::parse_duration(text) {
            if d.is_zero() {
                return Err("leaves no time; give a duration above 0, such as \"2h\"".into());
            }
            return Ok(Deadline::After(d));
        }
        match humantime::parse_rfc3339_weak(text) {
            Ok(t) => Ok(Deadline::At(
                t.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            )),
            Err(_) => Err("is neither a duration (\"2h\", \"90m\", \"1h 30m\") nor an RFC 3339 time (\"2026-12-08T06:00:00Z\")".into()),
        }
    }

    /// When, for a job first registered at `created_ms` (ms since the epoch).
    pub fn at_ms(self, created_ms: u64) -> u64 {
        match self {
            Deadline::After(d) => created_ms.saturating_add(d.as_millis() as u64),
            Deadline::At(ms) => ms,
        }
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `<name>-<8 hex>`: a digest of everything that determines the job's output
/// (resolved inputs and what they are — each file's size and modification
/// time or ETag —, model digest, layout, sizing, output), so the same
/// manifest over the same data maps to the same job and resumes instead of
/// starting over, and a file changed in place makes a new job.
#[allow(clippy::too_many_arguments)]
pub(super) fn job_id(
    name: &str,
    pool: &str,
    files: &[PathBuf],
    fingerprints: &[Fingerprint],
    root: Option<&Path>,
    sizing: &ItemSizing,
    blind: Option<&BlindCut>,
    task: &batchfleet_shared::message::v1::TaskSpec,
) -> String {
    let mut canonical = serde_json::json!({ "name": name, "pool": pool, "files": files, "inputs": fingerprints, "sizing": sizing, "task": task });
    // Items cut blind are other items than scanned ones of the same input.
    if let Some(b) = blind {
        canonical["cut"] = serde_json::json!({ "blind": b });
    }
    // The ids of `files` input are relative to the root (absent otherwise,
    // so other jobs keep their ids).
    if let Some(root) = root {
        canonical["root"] = serde_json::json!(root);
    }
    let digest =
        batchfleet_shared::fsutil::sha256_bytes(sorted_keys(canonical).to_string().as_bytes());
    format!("{name}-{}", &digest[..8])
}

/// `v` with every object's keys in sorted order, so its text (and a job id
/// hashed from it) does not depend on field or insertion order.
fn sorted_keys(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sorted_keys(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(sorted_keys).collect())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::testing::{Fixture, GOOD};

    #[test]
    fn job_ids_hash_keys_in_sorted_order() {
        let v = serde_json::json!({"b": 1, "a": {"d": [{"z": 1, "y": 2}], "c": 2}});
        assert_eq!(
            sorted_keys(v).to_string(),
            r#"{"a":{"c":2,"d":[{"y":2,"z":1}]},"b":1}"#
        );
    }

    #[test]
    fn same_manifest_same_job_id_and_changes_change_it() {
        let fx = Fixture::new();
        let a = fx.load(GOOD).unwrap().job_id;
        let b = fx
            .load(&GOOD.replace("\n[job]", "# a comment\n[job]"))
            .unwrap()
            .job_id;
        let c = fx
            .load(&GOOD.replace("item_rows = 100", "item_rows = 50"))
            .unwrap()
            .job_id;
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn the_job_id_covers_what_the_inputs_are_not_only_their_paths() {
        let fx = Fixture::new();
        let a = fx.load(GOOD).unwrap();
        let file = fx.dir.path().join("data/a.csv");
        assert_eq!(a.fingerprints.len(), 2);
        let recorded = a.fingerprint(&a.files[0]).unwrap().clone();
        assert_eq!(recorded.size, std::fs::metadata(&file).unwrap().len());
        assert!(recorded.mtime_ns.is_some() && recorded.etag.is_none());
        // Rewritten in place with the same bytes: another modification time.
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(later)
            .unwrap();
        let b = fx.load(GOOD).unwrap();
        assert_ne!(
            a.job_id, b.job_id,
            "a file rewritten in place is another job"
        );
        assert_ne!(a.fingerprints[0], b.fingerprints[0]);
        assert_eq!(a.fingerprints[1], b.fingerprints[1]);
        // Nothing changed since: the same job again.
        assert_eq!(fx.load(GOOD).unwrap().job_id, b.job_id);
        // Every input file is listed with what it was.
        let listed = b.input_files();
        assert_eq!(listed.len(), 2);
        assert!(listed[0].path.ends_with("data/a.csv"));
        let json = serde_json::to_value(&listed[0]).unwrap();
        assert_eq!(json["size"], recorded.size);
        assert!(json["mtime_ns"].as_u64().is_some(), "{json}");
    }

    #[test]
    fn a_deadline_is_a_duration_or_a_time_and_neither_it_nor_the_cost_changes_the_job_id() {
        let fx = Fixture::new();
        let plain = fx.load(GOOD).unwrap();
        assert_eq!((plain.deadline, plain.worker_hour_cost), (None, None));
        let with = |lines: &str| GOOD.replacen("[job]\n", &format!("[job]\n{lines}\n"), 1);
        let timed = fx
            .load(&with("deadline = \"1h 30m\"\nworker_hour_cost = 1.2"))
            .unwrap();
        assert_eq!(
            timed.deadline,
            Some(Deadline::After(std::time::Duration::from_secs(5400)))
        );
        assert_eq!(timed.deadline.unwrap().at_ms(1_000), 5_401_000);
        assert_eq!(timed.worker_hour_cost, Some(1.2));
        assert_eq!(timed.job_id, plain.job_id);
        let at = fx
            .load(&with("deadline = \"2026-12-08T06:00:00Z\""))
            .unwrap()
            .deadline
            .unwrap();
        assert_eq!(at, Deadline::At(1_796_709_600_000));
        assert_eq!(at.at_ms(1), 1_796_709_600_000);
        for (bad, field, says) in [
            (
                "deadline = \"soon\"",
                "[job] deadline",
                "neither a duration",
            ),
            ("deadline = \"0s\"", "[job] deadline", "leaves no time"),
            (
                "worker_hour_cost = -1.0",
                "[job] worker_hour_cost",
                "above 0",
            ),
            (
                "worker_hour_cost = nan",
                "[job] worker_hour_cost",
                "above 0",
            ),
        ] {
            let err = crate::manifest::testing::problems(fx.load(&with(bad)));
            assert!(err.contains(field) && err.contains(says), "{bad}: {err}");
        }
    }
}
