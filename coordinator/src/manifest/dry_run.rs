//! The model call tried before anything is published: with libtorch in the
//! coordinator (the default build), the job's model runs on two sample rows
//! the way workers will run it ([`batchfleet_worker::probe`]), so a
//! selection the model's output does not have, a `[rows, L, D]` output
//! without pooling, a `dtype` the CPU cannot run, or output names that do
//! not match the model's width are exit 2 with the setting to fix. A model
//! that does not load here or raises on the made-up rows only warns: the
//! workers decide.

use super::{ManifestError, Problem};
use batchfleet_shared::message::TaskSpec;
use std::path::Path;

/// Tries `task`'s model call (see the module docs).
pub(super) fn check(task: &TaskSpec, manifest_path: &Path) -> Result<(), ManifestError> {
    let refuse = |field: &str, message: String| ManifestError {
        file: manifest_path.to_owned(),
        problems: vec![Problem {
            field: field.into(),
            message,
        }],
    };
    #[cfg(feature = "local")]
    {
        use batchfleet_worker::probe::{probe, ProbeFailure};
        match probe(task) {
            Ok(p) => {
                let out = &task.output;
                for (key, names) in [
                    ("[output] columns", &out.columns),
                    ("[output] labels", &out.labels),
                ] {
                    if !names.is_empty() && names.len() != p.width {
                        return Err(refuse(
                            key,
                            format!(
                                "names {} outputs but {} returns {} per row (tried on two sample rows); make them agree",
                                names.len(),
                                task.model.path,
                                p.width
                            ),
                        ));
                    }
                }
                tracing::debug!(width = p.width, parts = ?p.parts, "model call tried on sample rows");
            }
            Err(ProbeFailure::Refused(why)) => {
                let field = if why.contains("[output] select") {
                    "[output] select"
                } else if why.contains("pooling") {
                    "[output] pooling"
                } else if why.contains("dtype") {
                    "[model] dtype"
                } else {
                    "[model] path"
                };
                return Err(refuse(
                    field,
                    format!("{why} (tried on two sample rows at validation)"),
                ));
            }
            Err(ProbeFailure::Inconclusive(why)) => {
                tracing::warn!(model = %task.model.path, reason = %why, "the model call could not be tried on sample rows at validation; workers will report what it does");
            }
        }
        Ok(())
    }
    #[cfg(not(feature = "local"))]
    {
        let _ = refuse;
        tracing::info!(model = %task.model.path, "this coordinator is built without libtorch: the model call is not tried at validation (workers check it)");
        Ok(())
    }
}
