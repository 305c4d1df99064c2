//! Test support shared by the manifest's unit tests: a folder holding two
//! CSV inputs and a TorchScript-like model, and the manifests they start from.

use super::{JobSpec, ManifestError};
use std::fs;

/// A temporary folder with `data/a.csv`, `data/b.csv` and `model.pt`.
pub(super) struct Fixture {
    pub(super) dir: tempfile::TempDir,
}

impl Fixture {
    pub(super) fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("data")).unwrap();
        fs::write(
            dir.path().join("data/a.csv"),
            "id,f0,f1,f2\n1,0.1,0.2,0.3\n",
        )
        .unwrap();
        fs::write(
            dir.path().join("data/b.csv"),
            "id,f0,f1,f2\n2,0.1,0.2,0.3\n",
        )
        .unwrap();
        fs::write(
            dir.path().join("model.pt"),
            batchfleet_shared::model_file::torchscript_like_zip(),
        )
        .unwrap();
        Self { dir }
    }
    pub(super) fn load(&self, toml: &str) -> Result<JobSpec, ManifestError> {
        self.load_with(toml, &[])
    }

    /// [`Fixture::load`] with `--set` overrides.
    pub(super) fn load_with(
        &self,
        toml: &str,
        overrides: &[&str],
    ) -> Result<JobSpec, ManifestError> {
        let path = self.dir.path().join("job.toml");
        fs::write(&path, toml).unwrap();
        let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
        super::load_with(&path, &[], &overrides)
    }
}

/// A valid CSV manifest for the fixture.
pub(super) const GOOD: &str = r#"
[job]
name = "scores"
[input]
format = "csv"
paths = ["data/*.csv"]
id_column = "id"
feature_columns = ["f0..f2"]
[model]
path = "model.pt"
[batching]
item_rows = 100
inference_batch_size = 64
[output]
dir = "out"
"#;

/// A valid `files` manifest (the images are the test's to write).
pub(super) const FILES: &str = r#"
[job]
name = "pics"
[input]
format = "files"
paths = ["img/**/*.png"]
root = "img"
[preprocess]
size = [8, 6]
mean = [0.5, 0.5, 0.5]
std = [0.25, 0.25, 0.25]
[model]
path = "model.pt"
[batching]
item_rows = 2
[output]
dir = "out"
"#;

/// The problems of a manifest that must fail, one per line.
pub(super) fn problems(r: Result<JobSpec, ManifestError>) -> String {
    r.unwrap_err().to_string()
}
