//! Peeking into the files a manifest names, to check them before anything is
//! published: the header row of a CSV file, the keys of a JSON Lines file's
//! first record, the schema of a Parquet file, and whether a model file is a
//! TorchScript archive. Inputs are read through
//! [`batchfleet_shared::source`], so `s3://` objects are probed the same way.

use std::path::{Path, PathBuf};

/// A streaming reader of an input file, local or `s3://`.
fn open_input(path: &Path) -> Result<Box<dyn std::io::Read + Send>, String> {
    batchfleet_shared::source::Input::open(path)
        .and_then(|i| i.reader())
        .map_err(|e| format!("cannot open: {e}"))
}

/// Files probed at once: the probes wait on storage (an S3 GET each), not
/// on the CPU.
const PROBE_THREADS: usize = 16;

/// `probe` of every file, in the files' order, several files at a time.
pub fn probe_all<T: Send>(files: &[PathBuf], probe: impl Fn(&Path) -> T + Sync) -> Vec<T> {
    let slots: Vec<std::sync::Mutex<Option<T>>> =
        files.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..PROBE_THREADS.min(files.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(f) = files.get(i) else {
                    return;
                };
                let result = probe(f);
                *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
            });
        }
    });
    slots
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .expect("every file was probed")
        })
        .collect()
}

/// Reads the header record of a CSV file.
pub fn read_header(path: &Path, delimiter: u8) -> Result<Vec<String>, String> {
    let input =
        batchfleet_shared::source::Input::open(path).map_err(|e| format!("cannot open: {e}"))?;
    match batchfleet_shared::columns::csv_header(&input, delimiter) {
        Ok(Some(header)) => Ok(header),
        Ok(None) => Err("is empty; a CSV input needs a header row naming its columns".into()),
        Err(e) => Err(format!("cannot read the header row: {e}")),
    }
}

/// Remote files whose first record validation reads at most: the rest are
/// checked by the worker that reads them (a CSV header that differs fails
/// that file's items, naming the file and the first column that differs).
pub const SAMPLE_FILES: usize = 64;

/// The files validation probes: every local file (a probe is a small read),
/// and of `s3://` objects the first half of [`SAMPLE_FILES`] and the other
/// half spread evenly over the rest, so planning costs a bounded number of
/// requests however many objects there are.
pub fn sample(files: &[PathBuf]) -> Vec<PathBuf> {
    let remote = files.iter().any(|f| batchfleet_shared::source::is_url(f));
    if !remote || files.len() <= SAMPLE_FILES {
        return files.to_vec();
    }
    let head = SAMPLE_FILES / 2;
    let rest = &files[head..];
    let spread = SAMPLE_FILES - head;
    files[..head]
        .iter()
        .chain((0..spread).map(|k| &rest[k * rest.len() / spread]))
        .cloned()
        .collect()
}

/// The keys of the first record of a JSON Lines file.
pub fn read_jsonl_keys(path: &Path) -> Result<std::collections::HashSet<String>, String> {
    use std::io::BufRead;
    let file = open_input(path)?;
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("cannot read line {}: {e}", n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        return match serde_json::from_str::<serde_json::Value>(&line) {
            Ok(serde_json::Value::Object(map)) => Ok(map.keys().cloned().collect()),
            Ok(_) => Err(format!(
                "line {} is not a JSON object; JSON Lines input holds one object per line",
                n + 1
            )),
            Err(e) => Err(format!("line {} is not valid JSON: {e}", n + 1)),
        };
    }
    Err("is empty; a JSON Lines input needs at least one record".into())
}

/// Checks that a Parquet file's schema has the id column (string or
/// integer) and every feature column (numeric), naming what is missing or
/// of the wrong type.
pub fn check_parquet_columns(
    path: &Path,
    id: &str,
    features: &[String],
    include: &[String],
) -> Result<(), String> {
    use batchfleet_shared::columns::{is_feature_type, is_id_type};
    let file =
        batchfleet_shared::source::Input::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let meta = parquet::arrow::arrow_reader::ArrowReaderMetadata::load(&file, Default::default())
        .map_err(|e| format!("is not a readable Parquet file: {e}"))?;
    let schema = meta.schema();
    let mut wrong = Vec::new();
    let mut missing = Vec::new();
    for (name, is_id) in
        std::iter::once((id, true)).chain(features.iter().map(|f| (f.as_str(), false)))
    {
        match schema.field_with_name(name) {
            Err(_) => missing.push(name),
            Ok(f) if is_id && !is_id_type(f.data_type()) => wrong.push(format!(
                "id column {name} is {} (use a string or integer column)",
                f.data_type()
            )),
            Ok(f) if !is_id && !is_feature_type(f.data_type()) => wrong.push(format!(
                "feature column {name} is {} (features must be integers or floats)",
                f.data_type()
            )),
            Ok(_) => {}
        }
    }
    missing.extend(
        include
            .iter()
            .map(String::as_str)
            .filter(|n| schema.field_with_name(n).is_err()),
    );
    if !missing.is_empty() {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        let shown = if names.len() > 12 {
            format!("{}, … {} in all", names[..10].join(", "), names.len())
        } else {
            names.join(", ")
        };
        wrong.insert(
            0,
            format!(
                "has no column {} (columns: {shown}); fix the names (they are case-sensitive)",
                missing.join(", ")
            ),
        );
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("; "))
    }
}

/// Checks a model file exists and is a TorchScript archive — `code/` and
/// `constants.pkl` inside — or an AOTInductor package, naming what it is
/// otherwise (a `state_dict`, a pickled module, an uncompiled `torch.export`
/// program) with the one-line fix.
pub(super) fn check_torchscript(
    path: &Path,
) -> Result<batchfleet_shared::model_file::ModelKind, String> {
    use batchfleet_shared::model_file::{inspect_file, EXPORT_FIX};
    let kind = inspect_file(path).map_err(|e| {
        format!(
            "cannot open model {}: {e}; check the path, which is relative to the manifest's folder",
            path.display()
        )
    })?;
    if kind.is_runnable() {
        warn_of_another_torch(path);
        Ok(kind)
    } else {
        Err(format!(
            "{} is {}; {EXPORT_FIX}",
            path.display(),
            kind.describe()
        ))
    }
}

/// Logs a warning when the model says it was written by a torch other than
/// the libtorch this binary runs (a `.pt2` package of another release, a
/// TorchScript format newer than it reads): the trial that follows, or the
/// workers, may then fail to load it, and this says why.
fn warn_of_another_torch(path: &Path) {
    let Some(linked) = option_env!("BATCHFLEET_LIBTORCH_VERSION") else {
        return;
    };
    if let Some(warning) = batchfleet_shared::model_file::provenance_file(path)
        .ok()
        .and_then(|p| batchfleet_shared::model_file::version_warning(&p, linked))
    {
        tracing::warn!(model = %path.display(), "{warning}");
    }
}

#[cfg(test)]
mod tests {
    use crate::manifest::testing::{problems, Fixture, GOOD};
    use std::fs;

    #[test]
    fn json_lines_input_needs_the_keys_in_every_file() {
        let fx = Fixture::new();
        let good = "{\"id\": \"1\", \"f0\": 0.1, \"f1\": 0.2, \"f2\": 0.3}\n";
        fs::write(fx.dir.path().join("data/a.jsonl"), format!("\n{good}")).unwrap();
        fs::write(fx.dir.path().join("data/b.jsonl"), good).unwrap();
        let manifest = GOOD
            .replace("format = \"csv\"", "format = \"jsonl\"")
            .replace("data/*.csv", "data/*.jsonl");
        let spec = fx.load(&manifest).unwrap();
        assert_eq!(spec.files.len(), 2);
        let layout = spec.task.layout.jsonl().expect("a JSON layout");
        assert_eq!(layout.id_key, "id");
        assert_eq!(layout.feature_keys, vec!["f0", "f1", "f2"]);
        // The same manifest as CSV is another job.
        assert_ne!(spec.job_id, fx.load(GOOD).unwrap().job_id);
        // A file whose first record lacks a key, and one that is not JSON, are each named.
        fs::write(
            fx.dir.path().join("data/b.jsonl"),
            "{\"id\": 2, \"f0\": 1}\n",
        )
        .unwrap();
        fs::write(fx.dir.path().join("data/c.jsonl"), "id,f0\n").unwrap();
        let err = problems(fx.load(&manifest));
        assert!(
            err.contains("b.jsonl has no key f1, f2")
                && err.contains("c.jsonl: line 1 is not valid JSON"),
            "{err}"
        );
    }

    #[test]
    fn parquet_input_needs_typed_columns_in_every_file() {
        use batchfleet_testkit::fixtures::{f64_column, string_column, write_parquet};
        let fx = Fixture::new();
        let one = || f64_column([Some(0.5)]);
        let write = |name: &str, cols: Vec<(&str, arrow_array::ArrayRef)>| {
            write_parquet(&fx.dir.path().join("data").join(name), cols, 10).unwrap()
        };
        let id = || string_column([Some("1")]);
        write(
            "a.parquet",
            vec![("id", id()), ("f0", one()), ("f1", one()), ("f2", one())],
        );
        write(
            "b.parquet",
            vec![
                ("f2", one()),
                ("f1", one()),
                ("f0", one()),
                ("id", id()),
                ("x", id()),
            ],
        );
        let manifest = GOOD
            .replace("format = \"csv\"", "format = \"parquet\"")
            .replace("data/*.csv", "data/*.parquet");
        let spec = fx.load(&manifest).unwrap();
        assert_eq!(spec.files.len(), 2);
        let layout = spec.task.layout.parquet().expect("a Parquet layout");
        assert_eq!(
            (layout.id_column.as_str(), layout.feature_columns.len()),
            ("id", 3)
        );
        assert!(spec.task.layout.jsonl().is_none());
        // Missing columns, a text feature and a float id are each named with the file.
        write(
            "b.parquet",
            vec![("id", one()), ("f0", id()), ("f1", one())],
        );
        fs::write(fx.dir.path().join("data/c.parquet"), "id,f0\n").unwrap();
        let err = problems(fx.load(&manifest));
        for want in [
            "b.parquet: has no column f2",
            "id column id is Float64 (use a string or integer column)",
            "feature column f0 is Utf8 (features must be integers or floats)",
            "c.parquet: is not a readable Parquet file",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
    }
}
