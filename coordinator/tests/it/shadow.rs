//! `run --shadow` and `compare JOB` from the command line, with `--local`
//! (and, beside them, the JSON of `dlq list`, `dlq replay` and a failed
//! `status`):
//! the flag adds the candidate beside the manifest's model, `compare` with
//! one job reads its summary's `shadow` section (its `--max-psi` gate
//! included), and a job that ran no shadow says what to do.

use crate::local_run::{batchfleet, job, summary};

#[test]
fn run_shadow_and_compare_one_job_read_the_shadow_section() {
    let dir = job(2_000, 500);
    let d = dir.path();
    batchfleet_testkit::python::make_shadow_models(d).expect("shadow models");
    let local = ["--local", "--workers", "1", "--threads", "1"];
    let run = batchfleet(d)
        .args(["run", "job.toml", "--json", "--shadow", "candidate.pt"])
        .args(local)
        .output()
        .expect("run");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let s = summary(&d.join("out"));
    let candidate = d.join("candidate.pt").canonicalize().expect("candidate");
    assert_eq!(s["shadow"]["model"], candidate.display().to_string());
    assert_eq!(s["shadow"]["rows_compared"], 2_000);

    let compared = batchfleet(d)
        .args(["compare", "out/_summary.json", "--json"])
        .output()
        .expect("compare");
    assert!(
        compared.status.success(),
        "{}",
        String::from_utf8_lossy(&compared.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&compared.stdout).expect("json");
    assert_eq!(v["shadow"], s["shadow"]);
    assert_eq!(v["drift"][0]["name"], "score");
    let psi = v["drift"][0]["psi"].as_f64().expect("psi");
    assert_eq!(s["shadow"]["columns"][0]["psi"].as_f64(), Some(psi));
    // The candidate shifts the scores: a strict gate stops the pipeline.
    let gated = batchfleet(d)
        .args(["compare", "out/_summary.json", "--max-psi"])
        .arg(format!("{}", psi / 2.0))
        .output()
        .expect("compare");
    assert_eq!(
        gated.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&gated.stderr)
    );
    let shown = batchfleet(d)
        .args(["compare", "out/_summary.json"])
        .output()
        .expect("compare");
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("2000 rows compared") && text.contains("shadow model"),
        "{text}"
    );

    // A job with no shadow: compare with one job says what it needs.
    let plain = job(500, 500);
    let run = batchfleet(plain.path())
        .args(["run", "job.toml"])
        .args(local)
        .output()
        .expect("run");
    assert!(run.status.success());
    let alone = batchfleet(plain.path())
        .args(["compare", "out/_summary.json"])
        .output()
        .expect("compare");
    assert_eq!(alone.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&alone.stderr).contains("ran no shadow model"),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
}

/// `dlq list` and `dlq replay` print JSON with `--json` (here on a `--local`
/// job's `_dead/`): the dead item with its class and reason, and the
/// replay's outcome as `run --json` gives it.
#[test]
fn dlq_list_and_replay_print_json() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    batchfleet_testkit::python::make_job(
        d,
        &batchfleet_testkit::python::JobGen {
            rows: 400,
            files: 1,
            item_rows: 100,
            poison_rows: vec![150],
            ..batchfleet_testkit::python::JobGen::default()
        },
    )
    .expect("job");
    batchfleet_testkit::python::make_faulty_models(d, 1.0).expect("faulty models");
    let manifest = std::fs::read_to_string(d.join("job.toml"))
        .expect("manifest")
        .replace("path = \"model.pt\"", "path = \"poison.pt\"");
    std::fs::write(
        d.join("job.toml"),
        format!("{manifest}\n[failure]\nisolate_poison_rows = false\n"),
    )
    .expect("manifest");
    let run = batchfleet(d)
        .args(["run", "job.toml", "--local", "--json"])
        .output()
        .expect("run");
    assert_eq!(
        run.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let first: serde_json::Value = serde_json::from_slice(&run.stdout).expect("json");
    let listed = batchfleet(d)
        .args(["dlq", "list", "--local", "out", "--json"])
        .output()
        .expect("dlq list");
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let dead: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("json");
    let dead = dead.as_array().expect("a list");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["item"], 1);
    assert_eq!(dead[0]["class"], "poison");
    assert!(dead[0]["error"]
        .as_str()
        .is_some_and(|e| e.contains("poison sentinel")));
    // Replayed, the item meets the same row: the outcome says so, as JSON.
    let replayed = batchfleet(d)
        .args(["dlq", "replay", "--local", "out", "--json"])
        .output()
        .expect("dlq replay");
    let outcome: serde_json::Value = serde_json::from_slice(&replayed.stdout).expect("json");
    assert_eq!(outcome["status"], "completed_with_failures", "{outcome}");
    assert_eq!(outcome["exit_code"], 3);
    assert_eq!(replayed.status.code(), Some(3));
    assert_eq!(
        outcome["report"]["rows_predicted"], first["report"]["rows_predicted"],
        "{outcome}"
    );
}

/// `status --json` answers in JSON when it fails too: Redis unreachable,
/// and a job it does not know.
#[test]
fn status_json_failures_are_json() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = batchfleet(dir.path())
        .args(["status", "--json"])
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["status"], "error");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("cannot connect to Redis")),
        "{v}"
    );
    batchfleet_testkit::services::ensure_local().expect("Redis");
    let out = batchfleet(dir.path())
        .env("BATCHFLEET_REDIS_URL", "redis://127.0.0.1:6379/")
        .args(["status", "no-such-job-00000000", "--json"])
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("no job \"no-such-job-00000000\"")),
        "{v}"
    );
}
