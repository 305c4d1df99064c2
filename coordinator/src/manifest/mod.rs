//! The job manifest: parsing (unknown keys are errors) and complete validation
//! against the file system before anything is published.
//!
//! Relative paths in a manifest are resolved against the manifest's folder.
//! Every problem found is reported, one line each, naming the file and field
//! and saying what to do; see `docs/manifest.md`.
//!
//! [`load`] reads and parses a manifest file; [`validate`] checks it section
//! by section, each check adding what it finds to one list, and resolves it
//! into a [`JobSpec`] only when that list stays empty.
//!
//! # Layout
//! - `schema`: the TOML types a manifest is parsed into ([`Manifest`] and
//!   one struct per section, unknown keys refused).
//! - `spec`: the validated job ([`JobSpec`], [`ItemSizing`], [`ErrorBudget`],
//!   [`OnComplete`]), the `[job]` name and pool rules, and the job id.
//! - `input`: `[input]`: globs, `s3://` listings, `files` listings and root,
//!   formats, delimiter, id and feature columns, the shared header.
//! - `preprocess`: `[preprocess]`: image size, channels, mean and std.
//! - `model`: `[model]`: the model file, its digest, the device; the
//!   tokenizer of text input (loaded, digested), `max_length`, padding.
//! - `call`: how the model is called: `[model] inputs` and `dtype`,
//!   `[output] select`, `pooling`, `normalize`, `vector`, and `forward`'s
//!   parameter names read from the archive.
//! - `dry_run`: the model call tried on two sample rows, in a child
//!   process with a time and memory limit, before anything is published.
//! - `cut`: how a CSV or JSON Lines job is cut into items: blind, from the
//!   files' sizes, or by reading every record.
//! - `policy`: `[batching]` and `[failure]`: item sizing, batch size,
//!   checkpoints, retries, timeouts, the error budget.
//! - `output`: `[output]`: folder, histogram, labels, `top_k`, column names,
//!   copied columns.
//! - `on_complete`: `[on_complete]`: the command and the webhook, with no
//!   secret in the manifest.
//! - `probes`: peeking into files: CSV headers ([`read_header`]), JSON Lines
//!   keys ([`read_jsonl_keys`]), Parquet columns ([`check_parquet_columns`]),
//!   the model file's kind (TorchScript, an AOTInductor package, or what
//!   it is mistaken for).
//! - `testing` (tests only): the fixture folder and manifests the tests share.

mod call;
mod cut;
mod dry_run;
mod input;
mod model;
mod on_complete;
mod output;
mod policy;
mod preprocess;
mod probes;
mod schema;
mod spec;
#[cfg(test)]
mod testing;

pub use dry_run::{
    child_main as try_model_main, default_memory, start_ahead as start_model_trial, ModelTrial,
    DEBUG_ENV as DEBUG_TRY_MODEL_ENV, PROBE_LIMIT,
};
pub use input::expand_columns;
pub use policy::{DEFAULT_BATCH_SIZE, DEFAULT_CHECKPOINT_EVERY, DEFAULT_ITEM_ROWS};
pub use probes::{check_parquet_columns, read_header, read_jsonl_keys, sample, SAMPLE_FILES};
pub use schema::{
    json_schema, BatchingSection, FailureSection, HistogramSection, InputFormat, InputSection,
    JobSection, Manifest, ModelSection, OnCompleteSection, OutputSection, PreprocessSection,
    Priority,
};
pub use spec::{BlindCut, Deadline, ErrorBudget, InputFile, ItemSizing, JobSpec, OnComplete};

use batchfleet_shared::message::{CsvLayout, Missing, TaskSpec, TextSpec};
use batchfleet_shared::model_file::ModelKind;
use batchfleet_shared::paths::DataRoots;
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};

/// One problem found in a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `[section] key`, or a line number for syntax errors.
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

/// A manifest that failed validation: every problem found, one per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    /// The manifest file.
    pub file: PathBuf,
    /// The problems, in manifest order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}: {}: {}", self.file.display(), p.field, p.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for ManifestError {}

/// Reads, parses and validates a manifest file. Every path it names must stay
/// under one of `data_roots` (see [`batchfleet_shared::paths`]); none given:
/// under the manifest's own folder.
pub fn load(path: &Path, data_roots: &[PathBuf]) -> Result<JobSpec, ManifestError> {
    load_with(path, data_roots, &[])
}

/// [`load`] with `--set key=value` overrides applied over the file, each
/// as `section.key=value` where the value is TOML (`10`, `true`,
/// `'["a", "b"]'`) or, if it does not parse as TOML, a string. The
/// overrides are part of the job: they go into its id like any manifest
/// value, and the job record keeps them — but for a webhook URL, which it
/// keeps by its origin only ([`stored_override`]).
pub fn load_with(
    path: &Path,
    data_roots: &[PathBuf],
    overrides: &[String],
) -> Result<JobSpec, ManifestError> {
    load_trying(path, data_roots, overrides, ModelTrial::default())
}

/// [`load_with`], trying the model call as `trial` says: in a child
/// process within its limits, or not at all for a job that was validated
/// when it was run (`supervise`, `wait`, `cancel`, `resume`, `dlq replay`).
pub fn load_trying(
    path: &Path,
    data_roots: &[PathBuf],
    overrides: &[String],
    trial: ModelTrial,
) -> Result<JobSpec, ManifestError> {
    let fail = |field: &str, message: String| ManifestError {
        file: path.to_owned(),
        problems: vec![Problem {
            field: field.into(),
            message,
        }],
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        fail(
            "file",
            format!("cannot read the manifest: {e}; check the path"),
        )
    })?;
    let syntax = |e: toml::de::Error| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        let field = line.map_or_else(|| "toml".to_owned(), |l| format!("line {l}"));
        let msg = e.message().trim().replace('\n', " ");
        fail(
            &field,
            format!("{msg}; see docs/manifest.md for the accepted keys"),
        )
    };
    let mut table: toml::Table = toml::from_str(&text).map_err(syntax)?;
    // A webhook given with `--set` was stored by its origin only: a later
    // load (a follower, `supervise`, `resume`) leaves it out rather than
    // post to the origin.
    let given = overrides;
    let overrides: Vec<String> = given
        .iter()
        .filter(|o| !is_stored_webhook(o))
        .cloned()
        .collect();
    if overrides.len() < given.len() {
        tracing::warn!(
            "the webhook given with --set when the job was run is not stored (its path or query may hold a token): the manifest's own [on_complete] webhook applies here, if it has one"
        );
    }
    let manifest: Manifest = if overrides.is_empty() {
        // From the text, so that an error names its line.
        toml::from_str(&text).map_err(syntax)?
    } else {
        for o in &overrides {
            apply_override(&mut table, o).map_err(|m| fail(&format!("--set {o}"), m))?;
        }
        Manifest::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
            fail(
                &format!("--set {}", overrides.join(" --set ")),
                format!(
                    "with these overrides the manifest is not valid: {}; see docs/manifest.md for the accepted keys",
                    e.message().trim().replace('\n', " ")
                ),
            )
        })?
    };
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let base = if base.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        base
    };
    let roots = if data_roots.is_empty() {
        DataRoots::new(std::slice::from_ref(&base))
    } else {
        DataRoots::new(data_roots)
    }
    .map_err(|e| fail("data roots", e.to_string()))?;
    let mut spec = validate(&manifest, &base, path, &roots, trial)?;
    spec.overrides = given.iter().map(|o| stored_override(o)).collect();
    spec.resolved_manifest = toml::to_string(&shown(table)).unwrap_or_default();
    Ok(spec)
}

/// The manifest as it may be stored and shown (the job record in Redis,
/// `_summary.json`): a webhook URL keeps only its origin, since its path or
/// query may carry a token (`https://hooks.slack.com/services/T…/B…/…`).
fn shown(mut table: toml::Table) -> toml::Table {
    if let Some(toml::Value::String(url)) = table
        .get_mut("on_complete")
        .and_then(toml::Value::as_table_mut)
        .and_then(|t| t.get_mut("webhook"))
    {
        *url = format!("{}{SHOWN_URL_END}", crate::hooks::origin(url));
    }
    table
}

/// Whether a `--set` key is `on_complete.webhook`.
fn is_webhook_key(key: &str) -> bool {
    let path: Vec<&str> = key.split('.').map(str::trim).collect();
    path == ["on_complete", "webhook"]
}

/// How a stored webhook URL ends: [`shown`]'s mark, which no URL has (it
/// would be percent-encoded).
const SHOWN_URL_END: &str = "/…";

/// The URL of an `on_complete.webhook=…` override, unquoted; `None` for
/// any other override.
fn webhook_override(o: &str) -> Option<&str> {
    let (key, value) = o.split_once('=')?;
    is_webhook_key(key).then(|| value.trim().trim_matches(|c| c == '"' || c == '\''))
}

/// An override as the job record and `_summary.json` keep it: a webhook URL
/// by its origin only (as [`shown`] keeps the manifest's), since its path
/// or query may carry a token.
fn stored_override(o: &str) -> String {
    match webhook_override(o) {
        Some(url) => format!(
            "on_complete.webhook={}{SHOWN_URL_END}",
            crate::hooks::origin(url.trim_end_matches(SHOWN_URL_END))
        ),
        None => o.to_owned(),
    }
}

/// Whether an override is a webhook as [`stored_override`] kept it.
fn is_stored_webhook(o: &str) -> bool {
    webhook_override(o).is_some_and(|url| url.ends_with(SHOWN_URL_END))
}

/// Applies one `--set section.key=value` to the manifest's table: the
/// value is read as TOML, or taken as a string when it is not TOML (so
/// `--set output.dir=out/2026-12` needs no quotes).
fn apply_override(table: &mut toml::Table, o: &str) -> Result<(), String> {
    let Some((key, value)) = o.split_once('=') else {
        return Err("is not key=value; write e.g. --set output.dir=out/2026-12".into());
    };
    let path: Vec<&str> = key.trim().split('.').map(str::trim).collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(format!(
            "\"{key}\" is not a dotted key such as output.dir or batching.item_rows"
        ));
    }
    let value = match toml::from_str::<toml::Table>(&format!("v = {value}")) {
        Ok(mut t) => t.remove("v").expect("parsed as v"),
        Err(_) => toml::Value::String(value.to_owned()),
    };
    let (last, parents) = path.split_last().expect("at least one part");
    let mut at = table;
    for (i, part) in parents.iter().enumerate() {
        let entry = at
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = entry.as_table_mut().ok_or_else(|| {
            format!(
                "{} is not a table in the manifest, so it has no key {}",
                path[..=i].join("."),
                path[i + 1]
            )
        })?;
    }
    at.insert(last.to_string(), value);
    Ok(())
}

/// Validates a parsed manifest; `base` is the folder relative paths start from.
///
/// The sections are checked one after another — `[job]`, the `[input]`
/// files, `[preprocess]`, the `[input]` columns, `[model]`, `[batching]`,
/// `[failure]`, `[output]`, `[on_complete]` — each adding what it finds to
/// one list, so the problems always come in that order.
pub fn validate(
    m: &Manifest,
    base: &Path,
    manifest_path: &Path,
    roots: &DataRoots,
    trial: ModelTrial,
) -> Result<JobSpec, ManifestError> {
    let mut problems = Problems::default();
    let deadline = spec::check_job(&m.job, &mut problems);
    let inputs = input::files(m, base, roots, &mut problems);
    let image = preprocess::check(m, &mut problems);
    let layout = input::layout(m, &inputs.files, &mut problems);
    let (model, kind) = model::check(&m.model, base, roots, &mut problems);
    let tokenizer = model::tokenizer(
        &m.model,
        m.input.text_column.is_some(),
        base,
        roots,
        &mut problems,
    );
    let text = m.input.text_column.is_some() && m.model.tokenizer.is_some();
    let provided = call::Provided {
        text,
        features: !m.input.feature_columns.is_empty(),
        pixels: m.input.format == schema::InputFormat::Files,
    };
    let model_inputs = call::inputs(m, provided, &mut problems);
    let dtype = call::dtype(m, &mut problems);
    if dtype.is_some() && kind == Some(ModelKind::AotiPackage) {
        problems.add(
            "[model] dtype",
            "does not apply to an AOTInductor package, which runs in the precision it was compiled in; compile the package from the model in that precision, or remove dtype".into(),
        );
    }
    let outputs = call::outputs(m, text, &mut problems);
    // A package carries no TorchScript code to read parameter names from.
    if kind == Some(ModelKind::TorchScript) {
        if let Some(file) = batchfleet_shared::pinned::local_file(&model.path, &model.sha256) {
            call::check_parameters(&file, &model_inputs, text, &mut problems);
        }
    }
    let model = batchfleet_shared::message::ModelRef {
        inputs: model_inputs,
        dtype,
        select: outputs.select,
        pooling: outputs.pooling,
        normalize: outputs.normalize,
        tf32: m.model.tf32,
        ..model
    };
    let shadow = model::shadow(m, base, roots, &model, &mut problems);
    let batching = policy::batching(&m.batching, m.input.text_column.is_some(), &mut problems);
    let blind = cut::blind_cut(m, &inputs.files, &mut problems);
    let (failure, budget) = policy::failure(&m.failure, &mut problems);
    let output = output::check(m, base, roots, &inputs.files, &layout, &mut problems);
    let on_complete = on_complete::check(&m.on_complete, &mut problems);
    if !problems.0.is_empty() {
        return Err(ManifestError {
            file: manifest_path.to_owned(),
            problems: problems.0,
        });
    }

    // Built in version 1's shape first: the job id hashes it, so a job keeps
    // its id across the wire format's change (see `message::v1`).
    let task_v1 = batchfleet_shared::message::v1::TaskSpec {
        model,
        csv: CsvLayout {
            delimiter: layout.delimiter,
            fields: layout.header.len() as u32,
            id_column: layout.id_index,
            feature_columns: layout.feature_indices,
            include_columns: output.include_indices,
            // Only the layout of the job's format carries it.
            missing: if m.input.format == schema::InputFormat::Csv {
                layout.missing
            } else {
                Missing::Reject
            },
            header: Vec::new(),
        },
        batch_size: batching.batch_size,
        auto_batch: batching.auto_batch,
        output: output.spec,
        failure,
        checkpoint_rows: batching.checkpoint_rows,
        jsonl: layout.jsonl,
        parquet: layout.parquet,
        image,
        text: match (&layout.text, tokenizer) {
            (Some(column), Some(t)) => Some(TextSpec {
                column: column.clone(),
                csv_field: layout.text_index,
                tokenizer: t.file,
                max_length: t.max_length,
                pad_to_multiple_of: t.pad_to_multiple_of,
                max_batch_tokens: batching.max_batch_tokens,
            }),
            _ => None,
        },
        shadow,
    };
    let input::Files {
        files,
        fingerprints,
        root,
    } = inputs;
    let job_id = spec::job_id(
        &m.job.name,
        &m.job.pool,
        &files,
        &fingerprints,
        root.as_deref(),
        &batching.sizing,
        blind.as_ref(),
        &task_v1,
    );
    let mut task = TaskSpec::from(task_v1);
    // Workers check each file's header against the one validation read.
    if let batchfleet_shared::message::Layout::Csv(csv) = &mut task.layout {
        csv.header = layout.header.clone();
    }
    dry_run::check(&task, manifest_path, trial)?;
    Ok(JobSpec {
        job_id,
        name: m.job.name.clone(),
        pool: m.job.pool.clone(),
        priority: m.job.priority,
        deadline,
        worker_hour_cost: m.job.worker_hour_cost,
        manifest_path: std::path::absolute(manifest_path)
            .unwrap_or_else(|_| manifest_path.to_owned()),
        files,
        header: layout.header,
        sizing: batching.sizing,
        blind,
        task,
        budget,
        on_complete,
        merge: m.output.merge,
        root,
        fingerprints,
        overrides: Vec::new(),
        resolved_manifest: String::new(),
    })
}

/// The problems found so far, in the order the checks found them; every
/// section check adds to the one list [`validate`] keeps.
#[derive(Debug, Default)]
struct Problems(Vec<Problem>);

impl Problems {
    /// Adds a problem with `field` (`[section] key`).
    fn add(&mut self, field: &str, message: String) {
        self.0.push(Problem {
            field: field.into(),
            message,
        });
    }
}

/// `p` as an absolute path, relative ones from `base`; `s3://` URLs as they are.
fn resolve(base: &Path, p: &str) -> PathBuf {
    if p.starts_with(batchfleet_shared::source::S3_SCHEME) {
        return PathBuf::from(p);
    }
    let p = Path::new(p);
    let joined = if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    };
    std::path::absolute(&joined).unwrap_or(joined)
}

#[cfg(test)]
mod tests {
    use super::testing::{problems, Fixture, GOOD};
    use super::*;
    use std::fs;

    #[test]
    fn good_manifest_resolves_paths_and_columns() {
        let fx = Fixture::new();
        let spec = fx.load(GOOD).unwrap();
        assert_eq!(spec.files.len(), 2);
        assert!(spec.files[0].ends_with("data/a.csv"));
        assert_eq!(
            spec.task
                .layout
                .csv()
                .expect("a CSV layout")
                .feature_columns,
            vec![1, 2, 3]
        );
        assert_eq!(spec.task.layout.csv().expect("a CSV layout").fields, 4);
        assert_eq!(spec.sizing, ItemSizing::Rows(100));
        assert!(spec.job_id.starts_with("scores-") && spec.job_id.len() == "scores-".len() + 8);
        assert_eq!(spec.task.model.sha256.len(), 64);
        assert!(Path::new(&spec.task.output.dir).is_absolute());
    }

    #[test]
    fn paths_must_stay_under_the_data_roots() {
        let fx = Fixture::new();
        let elsewhere = tempfile::tempdir().unwrap();
        let far = elsewhere.path().join("far.csv");
        fs::write(&far, "id,f0,f1,f2\n3,0.1,0.2,0.3\n").unwrap();
        fs::write(
            elsewhere.path().join("m.pt"),
            batchfleet_shared::model_file::torchscript_like_zip(),
        )
        .unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), fx.dir.path().join("link")).unwrap();
        // By default the manifest's folder is the root: an absolute path
        // elsewhere, a symlink out of it and `..` are each refused.
        let bad = GOOD
            .replace(
                "\"data/*.csv\"",
                &format!("\"data/*.csv\", \"{}\"", far.display()),
            )
            .replace("path = \"model.pt\"", "path = \"link/m.pt\"")
            .replace("dir = \"out\"", "dir = \"data/../../out\"");
        let err = problems(fx.load(&bad));
        assert!(
            err.contains("[input] paths:")
                && err.contains("far.csv: is outside the data roots")
                && err.contains("[model] path:")
                && err.contains("link/m.pt: is outside the data roots")
                && err.contains("(it resolves to")
                && err.contains("[output] dir:")
                && err.contains("contains `..`"),
            "{err}"
        );
        // Naming both folders as roots lets the same files in (not `..`).
        let path = fx.dir.path().join("job.toml");
        let roots = [fx.dir.path().to_owned(), elsewhere.path().to_owned()];
        let ok = bad.replace("dir = \"data/../../out\"", "dir = \"out\"");
        fs::write(&path, &ok).unwrap();
        let spec = load(&path, &roots).unwrap();
        assert_eq!(spec.files.len(), 3);
        // A root that does not exist is an error of its own.
        let err = load(&path, &[fx.dir.path().join("nope")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data roots:") && err.contains("cannot use it as a data root"),
            "{err}"
        );
    }

    #[test]
    fn set_overrides_manifest_values_and_the_job_id() {
        let fx = Fixture::new();
        let plain = fx.load(GOOD).unwrap();
        let set = fx
            .load_with(GOOD, &["output.dir=out/2026-12", "batching.item_rows=50"])
            .unwrap();
        assert!(
            set.task.output.dir.ends_with("out/2026-12"),
            "{}",
            set.task.output.dir
        );
        assert_eq!(set.sizing, ItemSizing::Rows(50));
        assert_ne!(plain.job_id, set.job_id, "overrides are part of the job");
        assert_eq!(
            set.overrides,
            ["output.dir=out/2026-12", "batching.item_rows=50"]
        );
        // The resolved manifest is the file with the overrides applied.
        let resolved: toml::Table = toml::from_str(&set.resolved_manifest).unwrap();
        assert_eq!(resolved["output"]["dir"].as_str(), Some("out/2026-12"));
        assert_eq!(resolved["batching"]["item_rows"].as_integer(), Some(50));
        // The same overrides again: the same job.
        let again = fx
            .load_with(GOOD, &["output.dir=out/2026-12", "batching.item_rows=50"])
            .unwrap();
        assert_eq!(again.job_id, set.job_id);
        // A TOML array replaces a list; a new key goes into its section.
        let listed = fx
            .load_with(GOOD, &[r#"input.paths=["data/a.csv"]"#, "job.pool=night"])
            .unwrap();
        assert_eq!(listed.files.len(), 1);
        assert_eq!(listed.pool, "night");
    }

    #[test]
    fn a_webhook_url_is_stored_and_shown_by_its_origin_only() {
        let fx = Fixture::new();
        let spec = fx
            .load_with(
                &format!("{GOOD}\n[on_complete]\nwebhook = \"https://hooks.example.com/services/T0/B1/s3cr3tpath\"\n"),
                &[],
            )
            .unwrap();
        assert!(
            !spec.resolved_manifest.contains("s3cr3tpath"),
            "{}",
            spec.resolved_manifest
        );
        let resolved: toml::Table = toml::from_str(&spec.resolved_manifest).unwrap();
        assert_eq!(
            resolved["on_complete"]["webhook"].as_str(),
            Some("https://hooks.example.com/…")
        );
        // The hook itself still has the whole URL.
        assert!(spec
            .on_complete
            .webhook
            .as_ref()
            .is_some_and(|u| u.expose().ends_with("s3cr3tpath")));
    }

    #[test]
    fn a_webhook_given_with_set_is_stored_by_its_origin_and_left_out_when_loaded_again() {
        let fx = Fixture::new();
        let secret = "https://hooks.example.com/services/T0/B1/s3cr3tpath";
        for given in [
            format!("on_complete.webhook={secret}"),
            format!("on_complete.webhook=\"{secret}\""),
            format!(" on_complete . webhook = '{secret}'"),
        ] {
            let spec = fx
                .load_with(GOOD, &[given.as_str(), "batching.item_rows=50"])
                .unwrap();
            // The hook has the whole URL; nothing stored or shown does.
            assert!(spec
                .on_complete
                .webhook
                .as_ref()
                .is_some_and(|u| u.expose().ends_with("B1/s3cr3tpath")));
            assert_eq!(
                spec.overrides,
                [
                    "on_complete.webhook=https://hooks.example.com/…",
                    "batching.item_rows=50"
                ],
                "{given}"
            );
            assert!(!spec.resolved_manifest.contains("s3cr3t"));
            // Loaded again from what was stored (a follower, resume): the
            // same job, the other overrides applied, the webhook left out
            // (the manifest has none) rather than posted to the origin.
            let stored: Vec<&str> = spec.overrides.iter().map(String::as_str).collect();
            let again = fx.load_with(GOOD, &stored).unwrap();
            assert_eq!(again.job_id, spec.job_id);
            assert_eq!(again.sizing, ItemSizing::Rows(50));
            assert!(again.on_complete.webhook.is_none());
            assert_eq!(again.overrides, spec.overrides);
        }
    }

    #[test]
    fn bad_overrides_name_the_override() {
        let fx = Fixture::new();
        let err = problems(fx.load_with(GOOD, &["output.dir"]));
        assert!(err.contains("--set output.dir: is not key=value"), "{err}");
        let err = problems(fx.load_with(GOOD, &["output.dir.x=1"]));
        assert!(
            err.contains("--set output.dir.x=1: output.dir is not a table"),
            "{err}"
        );
        let err = problems(fx.load_with(GOOD, &["batching.item_row=5"]));
        assert!(
            err.contains("--set batching.item_row=5") && err.contains("item_row"),
            "{err}"
        );
        // Values are checked as the file's are.
        let err = problems(fx.load_with(GOOD, &["batching.item_rows=0"]));
        assert!(err.contains("[batching] item_rows"), "{err}");
    }

    #[test]
    fn unknown_key_is_an_error_with_line() {
        let fx = Fixture::new();
        let err = problems(fx.load(&GOOD.replace("item_rows = 100", "item_row = 100")));
        assert!(
            err.contains("job.toml: line 12: unknown field `item_row`"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1);
    }

    #[test]
    fn empty_glob_missing_columns_and_model_each_reported() {
        let fx = Fixture::new();
        let bad = GOOD
            .replace("\"data/*.csv\"", "\"data/*.csv\", \"nope/*.csv\"")
            .replace("\"f0..f2\"", "\"f0..f3\"")
            .replace("id_column = \"id\"", "id_column = \"key\"")
            .replace("model.pt", "missing.pt");
        let err = problems(fx.load(&bad));
        assert!(
            err.contains("[input] paths: \"nope/*.csv\" matches no file"),
            "{err}"
        );
        assert!(
            err.contains("[input] id_column: \"key\" is not in the header"),
            "{err}"
        );
        assert!(
            err.contains("[input] feature_columns: not in the header of") && err.contains("f3"),
            "{err}"
        );
        assert!(
            err.contains("[model] path: cannot open model") && err.contains("missing.pt"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 4, "{err}");
    }
}
