//! `[model]`: the model file — a local (or shared) file under the data roots,
//! or an `s3://` object (downloaded into this machine's cache,
//! [`batchfleet_shared::pinned`]), that is a TorchScript archive (see
//! [`super::probes`]), with its SHA-256 taken and compared with the
//! manifest's when given: the digest every worker checks — and the device.

use super::probes::check_torchscript;
use super::schema::ModelSection;
use super::{resolve, Problems};
use batchfleet_shared::fsutil::sha256_file;
use batchfleet_shared::message::{FileRef, ModelRef};
use batchfleet_shared::model_file::ModelKind;
use batchfleet_shared::paths::DataRoots;
use std::path::Path;

/// The model every item runs: its absolute path, digest and device, and
/// what kind of file it is (`None` when it has problems).
pub(super) fn check(
    model: &ModelSection,
    base: &Path,
    roots: &DataRoots,
    problems: &mut Problems,
) -> (ModelRef, Option<ModelKind>) {
    let mut kind = None;
    let model_path = resolve(base, &model.path);
    let mut model_sha = String::new();
    // The file to read: the model itself, or its copy in this machine's
    // cache (with its digest) for an object in S3.
    let local = roots
        .check(&model_path)
        .map_err(|e| e.to_string())
        .and_then(|_| fetch_if_url(&model_path));
    match local.and_then(|(file, sha)| {
        let k = check_torchscript(&file).map_err(|e| named(&e, &file, &model_path))?;
        let sha = match sha {
            Some(sha) => sha,
            None => sha256_file(&file)
                .map_err(|e| format!("cannot read {}: {e}", model_path.display()))?,
        };
        Ok((k, sha))
    }) {
        Err(e) => problems.add("[model] path", e),
        Ok((k, actual)) => {
            if let Some(expected) = &model.sha256 {
                if !expected.eq_ignore_ascii_case(&actual) {
                    problems.add("[model] sha256", format!("{} has sha256 {actual} but the manifest expects {expected}; update the manifest or restore the right model file", model_path.display()));
                }
            }
            model_sha = actual;
            kind = Some(k);
        }
    }
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
