//! `[model]`: the model file — a local (or shared) file under the data roots
//! that is a TorchScript archive (see [`super::probes`]), with its SHA-256
//! taken and compared with the manifest's when given — and the device.

use super::probes::check_torchscript;
use super::schema::ModelSection;
use super::{resolve, Problems};
use batchfleet_shared::fsutil::sha256_file;
use batchfleet_shared::message::ModelRef;
use batchfleet_shared::paths::DataRoots;
use std::path::Path;

/// The model every item runs: its absolute path, digest and device.
pub(super) fn check(
    model: &ModelSection,
    base: &Path,
    roots: &DataRoots,
    problems: &mut Problems,
) -> ModelRef {
    let model_path = resolve(base, &model.path);
    let mut model_sha = String::new();
    let local_model = if batchfleet_shared::source::is_url(&model_path) {
        Err(batchfleet_shared::paths::PathError {
            path: model_path.clone(),
            reason:
                "is an s3:// URL; the model must be a local (or shared) file every worker can read"
                    .into(),
        })
    } else {
        roots.check(&model_path)
    };
    match local_model.map(|_| check_torchscript(&model_path)) {
        Err(e) => problems.add("[model] path", e.to_string()),
        Ok(Err(e)) => problems.add("[model] path", e),
        Ok(Ok(())) => match sha256_file(&model_path) {
            Err(e) => problems.add(
                "[model] path",
                format!("cannot read {}: {e}", model_path.display()),
            ),
            Ok(actual) => {
                if let Some(expected) = &model.sha256 {
                    if !expected.eq_ignore_ascii_case(&actual) {
                        problems.add("[model] sha256", format!("{} has sha256 {actual} but the manifest expects {expected}; update the manifest or restore the right model file", model_path.display()));
                    }
                }
                model_sha = actual;
            }
        },
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
    ModelRef {
        path: model_path.to_string_lossy().into_owned(),
        sha256: model_sha,
        device: model.device.clone(),
    }
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
                "is a torch.export package",
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
