//! Incremental jobs: `run --since <job>` and `plan --since <job>` score
//! only the input files that are new or changed since a finished job, by
//! their fingerprints (size and modification time, or ETag), and list the
//! rest as reused — with the job and output folder whose part files hold
//! their predictions.
//!
//! The narrowed job is the manifest with its `[input] paths` set to those
//! files (an override, so `resume`, `supervise` and a rebuild after Redis
//! lost its state load the same job), written into the manifest's output
//! folder, which must not be the earlier job's. What it reused is written
//! beside its parts as `_since.json` before anything is published, and
//! copied into its `_summary.json` (`incremental`) at the end.

use crate::config::RunConfig;
use crate::error::RunError;
use crate::manifest::{InputFile, JobSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What `--since` takes, for its errors.
const SINCE_WHAT: &str =
    "a finished job to score since (`--since`: a job id, its output folder or its _summary.json)";

/// The file beside a narrowed job's parts that says what it reused.
pub const SINCE_FILE: &str = "_since.json";

/// A file an incremental job did not score: its predictions are in
/// another job's output folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reused {
    /// The file, with what it was when it was scored.
    #[serde(flatten)]
    pub file: InputFile,
    /// The job that scored it.
    pub job_id: String,
    /// Its output folder: the part files `items` names hold the rows.
    pub output_dir: String,
}

/// What an incremental job scores and reuses (`_since.json`, and the
/// summary's `incremental` section).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incremental {
    /// The finished job it follows.
    pub since_job: String,
    /// That job's output folder.
    pub since_output_dir: String,
    /// Files scored now that no earlier job scored.
    pub new: Vec<String>,
    /// Files scored now that an earlier job scored in another version:
    /// its predictions of them (`superseded`) are out of date.
    pub changed: Vec<String>,
    /// Where the out-of-date predictions of the changed files are.
    pub superseded: Vec<Reused>,
    /// Files not scored again: unchanged since the job that scored them.
    pub reused: Vec<Reused>,
}

impl Incremental {
    /// The files this job scores.
    pub fn scored(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self
            .new
            .iter()
            .chain(&self.changed)
            .map(String::as_str)
            .collect();
        all.sort_unstable();
        all
    }
}

/// Reads the summary of the finished job `which` names: a `_summary.json`
/// path, the output folder holding one, or a job id (its output folder
/// from Redis; not with `--local`). Every file it covers — the ones it
/// scored and, for an incremental job, the ones it reused — with where
/// their predictions are.
pub async fn covered(cfg: &RunConfig, which: &str, local: bool) -> Result<Previous, RunError> {
    let bad = |reason: String| RunError::NotA {
        path: PathBuf::from(which),
        what: SINCE_WHAT,
        reason,
    };
    let given = Path::new(which);
    let exists = |p: &Path| batchfleet_shared::source::fs::exists(p).unwrap_or(false);
    let in_folder = batchfleet_shared::output::summary_in(given);
    let path = if exists(&in_folder) {
        in_folder
    } else if exists(given) {
        given.to_owned()
    } else if local {
        return Err(bad(
            "no such file or folder; with --local give the earlier job's output folder or _summary.json"
                .into(),
        ));
    } else {
        let store = cfg.connections.store().await?;
        let job = store.job(which).await?.ok_or_else(|| {
            bad("no such file, folder or job in Redis (a job that finished more than --retention ago: give its output folder)".into())
        })?;
        batchfleet_shared::output::summary_in(Path::new(&job.output_dir))
    };
    let text = batchfleet_shared::source::fs::read_to_string(&path)
        .map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
    let summary: crate::reducer::Summary = serde_json::from_str(&text)
        .map_err(|e| bad(format!("{} is not a job summary: {e}", path.display())))?;
    if summary.status != "completed" {
        return Err(bad(format!(
            "job {} ended {}, not completed: its failed items hold no predictions. Replay its dead letters (`batchfleet dlq replay --job {}`) first",
            summary.job_id, summary.status, summary.job_id
        )));
    }
    if summary.inputs.is_empty() {
        return Err(bad(format!(
            "job {}'s summary lists no input files (a summary from before batchfleet recorded them)",
            summary.job_id
        )));
    }
    let mut files: BTreeMap<String, Reused> = BTreeMap::new();
    if let Some(earlier) = &summary.incremental {
        for r in &earlier.reused {
            files.insert(r.file.path.clone(), r.clone());
        }
    }
    for f in summary.inputs {
        files.insert(
            f.path.clone(),
            Reused {
                file: f,
                job_id: summary.job_id.clone(),
                output_dir: summary.output_dir.clone(),
            },
        );
    }
    Ok(Previous {
        job_id: summary.job_id,
        output_dir: summary.output_dir,
        model_sha256: summary.model_sha256,
        files,
    })
}

/// The finished job `--since` names, and every file it covers.
#[derive(Debug, Clone)]
pub struct Previous {
    /// Its id.
    pub job_id: String,
    /// Its output folder.
    pub output_dir: String,
    /// Its model's digest: another model's predictions are not reused.
    pub model_sha256: String,
    /// The files it scored or reused, with where their predictions are.
    pub files: BTreeMap<String, Reused>,
}

/// Splits the full job `spec` against what the earlier job covered.
pub fn split(spec: &JobSpec, previous: &Previous) -> Incremental {
    // Another model: every file is scored again, none reused.
    let same_model = spec.task.model.sha256 == previous.model_sha256;
    let covered = &previous.files;
    let mut out = Incremental {
        since_job: previous.job_id.clone(),
        since_output_dir: previous.output_dir.clone(),
        new: Vec::new(),
        changed: Vec::new(),
        superseded: Vec::new(),
        reused: Vec::new(),
    };
    for f in spec.input_files() {
        match covered.get(&f.path) {
            None => out.new.push(f.path),
            Some(r) if same_model && r.file.fingerprint == f.fingerprint => {
                out.reused.push(r.clone())
            }
            Some(r) => {
                out.changed.push(f.path);
                out.superseded.push(r.clone());
            }
        }
    }
    out
}

/// The `--set` that narrows the manifest to `files`: `[input] paths` set
/// to each one, its glob characters escaped.
pub fn paths_override(files: &[&str]) -> String {
    let quoted: Vec<String> = files
        .iter()
        .map(|f| {
            let escaped = if f.starts_with("s3://") {
                (*f).to_owned()
            } else {
                glob::Pattern::escape(f)
            };
            toml::Value::String(escaped).to_string()
        })
        .collect();
    format!("input.paths=[{}]", quoted.join(", "))
}

/// What `--since` makes of a manifest: a narrowed run, or nothing to do.
#[derive(Debug)]
pub enum Narrowed {
    /// Every file is unchanged since: nothing to score.
    Nothing(Incremental),
    /// Run the manifest with this override; what it reuses.
    Run {
        /// `input.paths=[…]`.
        set: String,
        /// New, changed and reused files.
        incremental: Incremental,
    },
}

/// Narrows the manifest at `manifest` (with `cfg`'s overrides) to the
/// files new or changed since the job `since` names.
pub async fn narrow(
    cfg: &RunConfig,
    manifest: &Path,
    since: &str,
    local: bool,
) -> Result<Narrowed, RunError> {
    // Validated again, model and all, when the narrowed job runs.
    let full = cfg.load_known(manifest, &cfg.overrides)?;
    let previous = covered(cfg, since, local).await?;
    let job = &previous.job_id;
    if Path::new(&previous.output_dir) == full.output_dir() {
        return Err(RunError::Manifest(crate::manifest::ManifestError {
            file: manifest.to_owned(),
            problems: vec![crate::manifest::Problem {
                field: "[output] dir".into(),
                message: format!(
                    "is the output folder of job {job}, which --since follows; give this run a folder of its own (`--set output.dir=…`, e.g. one per day)"
                ),
            }],
        }));
    }
    if full.task.model.sha256 != previous.model_sha256 {
        tracing::warn!(since = %job, "the model changed since job {job} (another sha256): every file is scored again, none reused");
    }
    let incremental = split(&full, &previous);
    if incremental.new.is_empty() && incremental.changed.is_empty() {
        return Ok(Narrowed::Nothing(incremental));
    }
    Ok(Narrowed::Run {
        set: paths_override(&incremental.scored()),
        incremental,
    })
}

/// Writes `_since.json` into the (claimed) output folder `dir`.
pub fn write(dir: &Path, incremental: &Incremental) -> Result<(), RunError> {
    let path = dir.join(SINCE_FILE);
    batchfleet_shared::fsutil::publish_atomically(&path, true, |w| {
        serde_json::to_writer_pretty(&mut *w, incremental).map_err(std::io::Error::other)
    })
    .map(|_| ())
    .map_err(RunError::io_while(format!("write {}", path.display())))
}

/// `_since.json` in `dir`, if the job there is an incremental one.
pub fn read(dir: &Path) -> Option<Incremental> {
    let text = batchfleet_shared::source::fs::read_to_string(&dir.join(SINCE_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paths_override_escapes_glob_characters_and_quotes_for_toml() {
        let set = paths_override(&["/data/a[1].csv", "/data/it's \"b\".csv", "s3://bkt/c.csv"]);
        let (key, value) = set.split_once('=').unwrap();
        assert_eq!(key, "input.paths");
        let parsed: toml::Value = toml::from_str(&format!("v = {value}")).unwrap();
        let list: Vec<&str> = parsed["v"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(list[0], "/data/a[[]1[]].csv");
        assert!(glob::Pattern::new(list[0])
            .unwrap()
            .matches("/data/a[1].csv"));
        assert_eq!(list[1], "/data/it's \"b\".csv");
        assert_eq!(list[2], "s3://bkt/c.csv");
    }
}
