//! The model call tried before anything is published: with libtorch in the
//! coordinator (the default build), the job's model runs on two sample rows
//! the way workers will run it ([`batchfleet_worker::probe`]), so a
//! selection the model's output does not have, a `[rows, L, D]` output
//! without pooling, a `dtype` the CPU cannot run, or output names that do
//! not match the model's width are exit 2 with the setting to fix. A model
//! that does not load here, raises on the made-up rows, or has not returned
//! within [`PROBE_LIMIT`] (or the job's `item_timeout`, if shorter) only
//! warns: the workers decide, under their own timeouts.

use super::{ManifestError, Problem};
use batchfleet_shared::message::TaskSpec;
use std::path::Path;

/// How long validation waits for the model's call on the sample rows at most.
pub const PROBE_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// [`batchfleet_worker::probe::probe`] on a thread of its own, waited for
/// [`PROBE_LIMIT`] or the job's `item_timeout`, whichever is shorter: a
/// model that never returns leaves that thread behind, not validation.
#[cfg(feature = "local")]
fn bounded_probe(
    task: &TaskSpec,
) -> Result<batchfleet_worker::probe::Probed, batchfleet_worker::probe::ProbeFailure> {
    use batchfleet_worker::probe::{probe, ProbeFailure};
    let limit = PROBE_LIMIT.min(std::time::Duration::from_millis(
        task.failure.item_timeout_ms,
    ));
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = task.clone();
    let spawned = std::thread::Builder::new()
        .name("model-probe".into())
        .spawn(move || {
            let _ = tx.send(probe(&owned));
        });
    if let Err(e) = spawned {
        return Err(ProbeFailure::Inconclusive(format!(
            "cannot start a thread to try it: {e}"
        )));
    }
    rx.recv_timeout(limit).unwrap_or_else(|_| {
        Err(ProbeFailure::Inconclusive(format!(
            "it did not return within {} s on two sample rows",
            limit.as_secs_f64()
        )))
    })
}

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
        use batchfleet_worker::probe::ProbeFailure;
        match bounded_probe(task) {
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
