//! `run --shadow` and `compare JOB` from the command line, with `--local`:
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
