//! The model-archive reader (`model_file`: the kind, `forward`'s
//! parameters, the provenance) on archives torch itself wrote,
//! cut short at every length near their ends and mutated at random: it
//! parses untrusted files (a manifest names any file; a worker reads what
//! the message names), so every case must end — with a kind, never a panic
//! or a hang — and no archive without its end records passes for
//! TorchScript. A bounded, seeded mutation run: the same cases every time.

use batchfleet_shared::model_file::{forward_params, inspect_bytes, provenance, ModelKind};
use batchfleet_testkit::python::{make_job, JobGen};

/// Inspects `bytes` (and reads forward's parameters from them, as a file
/// at `scratch`), failing with the case named if either panics; the kind.
fn survives(case: &str, bytes: &[u8], scratch: &std::path::Path) -> ModelKind {
    let kind = std::panic::catch_unwind(|| inspect_bytes(bytes))
        .unwrap_or_else(|_| panic!("inspect panicked on {case}"));
    std::fs::write(scratch, bytes).expect("scratch file");
    // Any answer will do (an error, none, some parameters): it answered.
    let _ = std::panic::catch_unwind(|| forward_params(scratch))
        .unwrap_or_else(|_| panic!("forward_params panicked on {case}"));
    let _ = std::panic::catch_unwind(|| provenance(&mut std::io::Cursor::new(bytes)))
        .unwrap_or_else(|_| panic!("provenance panicked on {case}"));
    kind
}

#[test]
fn real_archives_cut_short_or_mutated_never_panic_and_lose_their_kind_when_cut() {
    let dir = tempfile::tempdir().expect("temp dir");
    make_job(
        dir.path(),
        &JobGen {
            rows: 10,
            files: 1,
            ..JobGen::default()
        },
    )
    .expect("generate a model");
    let scratch = dir.path().join("case.pt");
    let mut cases = 0u64;
    // model.pt returns floats, classes.pt wraps it (another code layout).
    for name in ["model.pt", "classes.pt"] {
        let real = std::fs::read(dir.path().join(name)).expect("model");
        assert_eq!(inspect_bytes(&real), ModelKind::TorchScript, "{name}");
        let params = forward_params(&dir.path().join(name)).expect("read");
        assert!(
            params.is_some_and(|p| !p.is_empty()),
            "{name}: forward's parameters"
        );
        // Every length within 8 KiB of either end, and every 61st between.
        let n = real.len();
        let lengths = (0..n)
            .filter(|&len| len < 8192 || n - len < 8192 || len % 61 == 0)
            .collect::<Vec<_>>();
        for len in lengths {
            let kind = survives(&format!("{name} cut at {len}"), &real[..len], &scratch);
            // The end record is in the last 22 bytes: without it, no archive.
            if n - len >= 22 {
                assert_ne!(kind, ModelKind::TorchScript, "{name} cut at {len} of {n}");
            }
            cases += 1;
        }
        // Random bytes overwritten: anywhere, and in the central directory
        // and end records (the last 4 KiB), where the offsets and counts are.
        let mut rng = fastrand::Rng::with_seed(0x6261_7463_6866);
        for round in 0..1_500 {
            let mut bytes = real.clone();
            let hits = rng.usize(1..=8);
            for _ in 0..hits {
                let at = if round % 2 == 0 {
                    rng.usize(..n)
                } else {
                    n - 1 - rng.usize(..n.min(4096))
                };
                bytes[at] = match rng.u8(..3) {
                    0 => 0,
                    1 => 0xFF,
                    _ => rng.u8(..),
                };
            }
            survives(&format!("{name} mutation {round}"), &bytes, &scratch);
            cases += 1;
        }
    }
    assert!(cases > 8_000, "{cases} cases");
}
