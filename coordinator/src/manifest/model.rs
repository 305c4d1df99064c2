//! `[model]`: the model file — a local (or shared) file under the data roots,
//! or an `s3://` object (downloaded into this machine's cache,
//! [`batchfleet_shared::pinned`]), that is a TorchScript archive (see
//! [`super::probes`]), with its SHA-256 taken and compared with the
//! manifest's when given: the digest every worker checks — and the device;
//! and `[model.shadow]`, the candidate run beside it, checked the same way.

use super::probes::check_torchscript;
use super::schema::{Manifest, ModelSection};
use super::{resolve, Problems};
use batchfleet_shared::fsutil::sha256_file;
use batchfleet_shared::message::{FileRef, ModelRef};
use batchfleet_shared::model_file::ModelKind;
use batchfleet_shared::paths::DataRoots;
use batchfleet_shared::shadow::ShadowSpec;
use std::path::Path;

/// The model every item runs: its absolute path, digest and device, and
/// what kind of file it is (`None` when it has problems).
pub(super) fn check(
    model: &ModelSection,
    base: &Path,
    roots: &DataRoots,
    problems: &mut Problems,
) -> (ModelRef, Option<ModelKind>) {
    let model_path = resolve(base, &model.path);
    let (model_sha, kind) = match file(&model_path, model.sha256.as_deref(), roots) {
        Ok((sha, kind)) => (sha, Some(kind)),
        Err((field, e)) => {
            problems.add(&format!("[model] {field}"), e);
            (String::new(), None)
        }
    };
    if !valid_device(&model.device) {
        problems.add(
            "[model] device",
            format!(
                "\"{}\" is not a device; use \"cpu\", \"cuda\" or \"cuda:N\"",
                model.device
            ),
        );
    }
    (
        ModelRef::plain(
            model_path.to_string_lossy(),
            model_sha,
            model.device.clone(),
        ),
        kind,
    )
}

/// A model file under the data roots (or in S3): its digest, checked
/// against `expected` when given, and its kind; else the field at fault
/// (`path` or `sha256`) and why.
fn file(
    model_path: &Path,
    expected: Option<&str>,
    roots: &DataRoots,
) -> Result<(String, ModelKind), (&'static str, String)> {
    // The file to read: the model itself, or its copy in this machine's
    // cache (with its digest) for an object in S3.
    let (kind, actual) = roots
        .check(model_path)
        .map_err(|e| e.to_string())
        .and_then(|_| fetch_if_url(model_path))
        .and_then(|(file, sha)| {
            let k = check_torchscript(&file).map_err(|e| named(&e, &file, model_path))?;
            let sha = match sha {
                Some(sha) => sha,
                None => sha256_file(&file)
                    .map_err(|e| format!("cannot read {}: {e}", model_path.display()))?,
            };
            Ok((k, sha))
        })
        .map_err(|e| ("path", e))?;
    if let Some(expected) = expected {
        if !expected.eq_ignore_ascii_case(&actual) {
            return Err(("sha256", format!("{} has sha256 {actual} but the manifest expects {expected}; update the manifest or restore the right model file", model_path.display())));
        }
    }
    Ok((actual, kind))
}

/// `[model.shadow]` and `[output] shadow`: the candidate model run beside
/// `main` on the same rows — its file checked as the job's model's is, its
/// call as the job's model's but in its own `dtype` (as saved when unset).
pub(super) fn shadow(
    m: &Manifest,
    base: &Path,
    roots: &DataRoots,
    main: &ModelRef,
    problems: &mut Problems,
) -> Option<ShadowSpec> {
    let Some(section) = &m.model.shadow else {
        if m.output.shadow.is_some() {
            problems.add(
                "[output] shadow",
                "needs a shadow model: add [model.shadow] path = \"…\" (or run --shadow <model>), or remove it".into(),
            );
        }
        return None;
    };
    let path = resolve(base, &section.path);
    let (sha256, kind) = match file(&path, section.sha256.as_deref(), roots) {
        Ok(found) => found,
        Err((field, e)) => {
            problems.add(&format!("[model.shadow] {field}"), e);
            return None;
        }
    };
    let dtype = super::call::precision("[model.shadow] dtype", section.dtype.as_deref(), problems);
    if dtype.is_some() && kind == ModelKind::AotiPackage {
        problems.add("[model.shadow] dtype", "does not apply to an AOTInductor package, which runs in the precision it was compiled in; remove dtype".into());
    }
    Some(ShadowSpec {
        model: ModelRef {
            path: path.to_string_lossy().into_owned(),
            sha256,
            dtype,
            ..main.clone()
        },
    })
}

/// The local file holding `path`: itself, or for a URL its copy downloaded
/// into this machine's cache, with the digest taken on the way.
fn fetch_if_url(path: &Path) -> Result<(std::path::PathBuf, Option<String>), String> {
    if !batchfleet_shared::source::is_url(path) {
        return Ok((path.to_owned(), None));
    }
    let url = path.to_string_lossy();
    batchfleet_shared::pinned::cache()
        .fetch(&url)
        .map(|(file, sha)| (file, Some(sha)))
        .map_err(|e| format!("cannot read {url}: {e}; check the URL, and that this machine has the credentials (AWS_* variables) to read it"))
}

/// A message about the local file `file`, naming `path` (the URL it is a
/// copy of) instead.
fn named(message: &str, file: &Path, path: &Path) -> String {
    message.replace(&file.display().to_string(), &path.display().to_string())
}

/// `[model] tokenizer`, `max_length` and `pad_to_multiple_of`: the tokenizer
/// file under the data roots, loaded as workers will load it (a file that
/// does not load is a problem naming why), with its digest.
pub(super) struct Tokenizer {
    /// The file and its digest.
    pub(super) file: FileRef,
    /// Tokens per row at most.
    pub(super) max_length: u32,
    /// Padded lengths rounded up to a multiple of this (0: not rounded).
    pub(super) pad_to_multiple_of: u32,
}

/// Checks the tokenizer settings; `None` when the job has no tokenizer (or
/// it has problems, which are added).
pub(super) fn tokenizer(
    model: &ModelSection,
    text_column: bool,
    base: &Path,
    roots: &DataRoots,
    problems: &mut Problems,
) -> Option<Tokenizer> {
    let Some(path) = &model.tokenizer else {
        for (key, set) in [
            ("max_length", model.max_length.is_some()),
            ("pad_to_multiple_of", model.pad_to_multiple_of.is_some()),
        ] {
            if set {
                problems.add(
                    &format!("[model] {key}"),
                    "applies to text input; set [model] tokenizer and [input] text_column, or remove it".into(),
                );
            }
        }
        return None;
    };
    if !text_column {
        problems.add(
            "[model] tokenizer",
            "needs [input] text_column: name the string column the tokenizer reads".into(),
        );
    }
    let most = batchfleet_shared::message::MAX_TOKENS_PER_ROW;
    if model.max_length == Some(0) || model.max_length.is_some_and(|m| m > most) {
        problems.add(
            "[model] max_length",
            format!("must be 1 to {most} tokens per row, e.g. 512"),
        );
    }
    if model.pad_to_multiple_of == Some(0) {
        problems.add(
            "[model] pad_to_multiple_of",
            "is 0; give a length such as 8, or remove it".into(),
        );
    }
    let resolved = resolve(base, path);
    if let Err(e) = roots.check(&resolved) {
        problems.add("[model] tokenizer", e.to_string());
        return None;
    }
    let file = match fetch_if_url(&resolved) {
        Ok((file, _)) => file,
        Err(e) => {
            problems.add("[model] tokenizer", e);
            return None;
        }
    };
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) => {
            problems.add(
                "[model] tokenizer",
                format!("cannot read {}: {e}; check the path", resolved.display()),
            );
            return None;
        }
    };
    let max_length = model.max_length.filter(|m| *m > 0);
    if let Err(e) = batchfleet_shared::text::TextEncoder::from_bytes(&bytes, max_length) {
        problems.add(
            "[model] tokenizer",
            format!("{} {e}; save it with tokenizer.save(\"tokenizer.json\") (Python's tokenizers) or take the tokenizer.json of a transformers model folder", resolved.display()),
        );
        return None;
    }
    Some(Tokenizer {
        file: FileRef {
            path: resolved.to_string_lossy().into_owned(),
            sha256: batchfleet_shared::fsutil::sha256_bytes(&bytes),
        },
        max_length: max_length
            .or_else(|| batchfleet_shared::text::TextEncoder::file_max_length(&bytes))
            .unwrap_or(batchfleet_shared::text::DEFAULT_MAX_LENGTH),
        pad_to_multiple_of: model.pad_to_multiple_of.unwrap_or(0),
    })
}

fn valid_device(d: &str) -> bool {
    d == "cpu"
        || d == "cuda"
        || d.strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use crate::manifest::testing::{problems, Fixture, GOOD};
    use std::fs;

    #[test]
    fn a_shadow_model_is_checked_as_the_job_model_and_inherits_its_call() {
        let fx = Fixture::new();
        fs::copy(
            fx.dir.path().join("model.pt"),
            fx.dir.path().join("cand.pt"),
        )
        .unwrap();
        let with = |extra: &str| format!("{GOOD}{extra}");
        let spec = fx
            .load_with(
                &with("[model.shadow]\npath = \"cand.pt\"\ndtype = \"bfloat16\"\n"),
                &["output.shadow=\"columns\""],
            )
            .unwrap();
        let shadow = spec.task.shadow.as_ref().expect("shadow");
        assert!(shadow.model.path.ends_with("cand.pt"));
        assert_eq!(shadow.model.sha256, spec.task.model.sha256);
        assert_eq!(
            shadow.model.dtype,
            Some(batchfleet_shared::message::Precision::Bfloat16)
        );
        assert_eq!(shadow.model.device, spec.task.model.device);
        assert!(spec.task.output.shadow_columns);
        // A shadow is part of the job: another id.
        assert_ne!(spec.job_id, fx.load(GOOD).unwrap().job_id);
        let err = problems(fx.load(&with(
            "[model.shadow]\npath = \"missing.pt\"\nsha256 = \"00\"\n",
        )));
        assert!(
            err.contains("[model.shadow] path:") && err.contains("missing.pt"),
            "{err}"
        );
        let err = problems(fx.load(&with(
            "[model.shadow]\npath = \"cand.pt\"\nsha256 = \"00\"\n",
        )));
        assert!(err.contains("[model.shadow] sha256:"), "{err}");
        let err = problems(fx.load(&with(
            "[model.shadow]\npath = \"cand.pt\"\ndtype = \"float8\"\n",
        )));
        assert!(err.contains("[model.shadow] dtype:"), "{err}");
        let err = problems(fx.load_with(GOOD, &["output.shadow=\"stats\""]));
        assert!(
            err.contains("[output] shadow:") && err.contains("[model.shadow]"),
            "{err}"
        );
    }

    #[test]
    fn sha_mismatch_and_not_torchscript() {
        let fx = Fixture::new();
        let err = problems(fx.load(&GOOD.replace(
            "path = \"model.pt\"",
            "path = \"model.pt\"\nsha256 = \"00\"",
        )));
        assert!(
            err.contains("[model] sha256:") && err.contains("expects 00"),
            "{err}"
        );
        fs::write(fx.dir.path().join("model.pt"), b"not a zip").unwrap();
        let err = problems(fx.load(GOOD));
        assert!(err.contains("is not a TorchScript file"), "{err}");
        // The files PyTorch users mistake for TorchScript are each named, with the fix.
        use batchfleet_shared::model_file::stored_zip;
        for (bytes, named) in [
            (
                stored_zip(&[
                    ("m/data.pkl", b"\x80\x02ccollections\nOrderedDict\n"),
                    ("m/data/0", b"w"),
                ]),
                "is a state_dict",
            ),
            (
                stored_zip(&[
                    ("m/data.pkl", b"\x80\x02c__main__\nNet\n_modules"),
                    ("m/data/0", b"w"),
                ]),
                "is a pickled Python module",
            ),
            (
                stored_zip(&[("m/archive_format", b"pt2"), ("m/models/model.json", b"{}")]),
                "is a torch.export program",
            ),
        ] {
            fs::write(fx.dir.path().join("model.pt"), bytes).unwrap();
            let err = problems(fx.load(GOOD));
            assert!(
                err.contains(named) && err.contains("torch.jit.save"),
                "{err}"
            );
        }
    }
}
