//! `run --since` and `plan --since` with `--local` (no services): after
//! a finished job, a file added and one rewritten are scored — exactly
//! their rows —, the others are listed as reused with the folder and part
//! files holding them, and a run with nothing new publishes nothing.

use crate::local_run::{batchfleet, job, parts, summary};
use std::path::Path;

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Data rows of a CSV file.
fn rows_of(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .expect("csv")
        .lines()
        .skip(1)
        .filter(|l| !l.is_empty())
        .count() as u64
}

/// The ids in the part files of `out`.
fn ids_in(out: &Path) -> Vec<String> {
    let mut ids: Vec<String> = parts(out)
        .iter()
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .expect("part")
                .lines()
                .skip(1)
                .map(|l| l.split(',').next().unwrap_or_default().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    ids.sort();
    ids
}

fn ids_of(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("csv")
        .lines()
        .skip(1)
        .filter(|l| !l.is_empty())
        .map(|l| l.split(',').next().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn since_a_finished_job_only_new_and_changed_files_are_scored() {
    let dir = job(3_000, 500);
    let d = dir.path();
    let local = ["--local", "--workers", "1", "--threads", "1"];
    let first = batchfleet(d)
        .args(["run", "job.toml", "--json"])
        .args(local)
        .output()
        .expect("run");
    json_of(&first);
    let first_summary = summary(&d.join("out"));
    let mut files: Vec<_> = std::fs::read_dir(d.join("data"))
        .expect("data")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2);
    // Every input file says which parts hold its rows.
    let inputs = first_summary["inputs"].as_array().expect("inputs");
    assert!(inputs.iter().all(|f| f["items"].is_array()), "{inputs:?}");

    // A day later: a new file, and the second rewritten (new rows, ids 9xxxx).
    let added = d.join("data").join("zz-new.csv");
    std::fs::copy(&files[0], &added).expect("copy");
    let text = std::fs::read_to_string(&files[1]).expect("read");
    let rewritten: String = text
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                format!("{l}\n")
            } else {
                let (_, rest) = l.split_once(',').expect("id,features");
                format!("9{i:05},{rest}\n")
            }
        })
        .collect();
    std::fs::write(&files[1], rewritten).expect("rewrite");
    let day2 = ["--set", "output.dir=out-2"];

    // The same output folder as the earlier job's is refused, naming it.
    let same = batchfleet(d)
        .args(["run", "job.toml", "--since", "out"])
        .args(local)
        .output()
        .expect("run");
    assert_eq!(same.status.code(), Some(2));
    let err = String::from_utf8_lossy(&same.stderr);
    assert!(
        err.contains("[output] dir") && err.contains("--since"),
        "{err}"
    );

    let plan = json_of(
        &batchfleet(d)
            .args(["plan", "job.toml", "--local", "--json", "--since", "out"])
            .args(day2)
            .output()
            .expect("plan"),
    );
    let inc = &plan["incremental"];
    let name = |p: &Path| p.to_string_lossy().into_owned();
    let canonical = |p: &Path| name(&p.canonicalize().expect("canonical"));
    assert_eq!(inc["new"], serde_json::json!([canonical(&added)]), "{plan}");
    assert_eq!(
        inc["changed"],
        serde_json::json!([canonical(&files[1])]),
        "{plan}"
    );
    assert_eq!(inc["reused"].as_array().map(Vec::len), Some(1), "{plan}");
    let expected_rows = rows_of(&added) + rows_of(&files[1]);
    assert_eq!(plan["rows"].as_u64(), Some(expected_rows), "{plan}");

    let second = json_of(
        &batchfleet(d)
            .args(["run", "job.toml", "--json", "--since", "out"])
            .args(day2)
            .args(local)
            .output()
            .expect("run --since"),
    );
    assert_eq!(second["status"], "completed", "{second}");
    let s2 = summary(&d.join("out-2"));
    assert_eq!(s2["rows_predicted"].as_u64(), Some(expected_rows), "{s2}");
    // Exactly the rows of the new and the rewritten file were scored.
    let mut want = ids_of(&added);
    want.extend(ids_of(&files[1]));
    want.sort();
    assert_eq!(ids_in(&d.join("out-2")), want);
    // The summary says what it reused, from where, in which parts.
    let reused = &s2["incremental"]["reused"][0];
    assert_eq!(reused["path"], canonical(&files[0]), "{s2}");
    assert_eq!(reused["job_id"], first_summary["job_id"], "{s2}");
    assert_eq!(reused["output_dir"], first_summary["output_dir"], "{s2}");
    let [a, b] = [0, 1].map(|i| reused["items"][i].as_u64().expect("item range"));
    let earlier_ids: Vec<String> = (a..=b)
        .flat_map(|seq| {
            let part = d.join("out").join(format!("part-{seq:06}.csv"));
            ids_of(&part)
        })
        .collect();
    assert_eq!(
        earlier_ids,
        ids_of(&files[0]),
        "the reused parts hold its rows"
    );
    let superseded = &s2["incremental"]["superseded"][0];
    assert_eq!(superseded["path"], canonical(&files[1]), "{s2}");
    assert_eq!(s2["incremental"]["since_job"], first_summary["job_id"]);

    // Nothing changed since the second job: nothing to score, no folder.
    let third = json_of(
        &batchfleet(d)
            .args(["run", "job.toml", "--json", "--since", "out-2"])
            .args(["--set", "output.dir=out-3"])
            .args(local)
            .output()
            .expect("run --since"),
    );
    assert_eq!(third["status"], "nothing_to_score", "{third}");
    // Both earlier files are covered: one by the first job, two by the second.
    let covered: Vec<&str> = third["incremental"]["reused"]
        .as_array()
        .expect("reused")
        .iter()
        .map(|r| r["job_id"].as_str().expect("job"))
        .collect();
    assert_eq!(covered.len(), 3, "{third}");
    assert!(!d.join("out-3").exists());

    // Another model: nothing is reused, every file is scored again.
    let other = tempfile::tempdir().expect("temp dir");
    batchfleet_testkit::python::make_job(
        other.path(),
        &batchfleet_testkit::python::JobGen {
            rows: 10,
            files: 1,
            seed: 99,
            ..batchfleet_testkit::python::JobGen::default()
        },
    )
    .expect("another model");
    std::fs::copy(other.path().join("model.pt"), d.join("model.pt")).expect("new model");
    let plan = json_of(
        &batchfleet(d)
            .args(["plan", "job.toml", "--local", "--json", "--since", "out-2"])
            .args(["--set", "output.dir=out-3"])
            .output()
            .expect("plan"),
    );
    let inc = &plan["incremental"];
    assert_eq!(inc["reused"].as_array().map(Vec::len), Some(0), "{plan}");
    assert_eq!(inc["changed"].as_array().map(Vec::len), Some(3), "{plan}");
}

/// `--since <job id>` finds the job's output folder through Redis.
#[tokio::test]
async fn since_a_job_id_reads_its_summary_from_the_folder_redis_names() {
    use batchfleet_shared::endpoint::Endpoint;
    use batchfleet_shared::secret::SecretUrl;
    use batchfleet_shared::store::{JobRecord, JobStatus, Store};
    batchfleet_testkit::services::ensure_local().expect("RabbitMQ and Redis available");
    let dir = job(1_000, 500);
    let d = dir.path();
    json_of(
        &batchfleet(d)
            .args(["run", "job.toml", "--json", "--local", "--workers", "1"])
            .output()
            .expect("run"),
    );
    let first = summary(&d.join("out"));
    let id = first["job_id"].as_str().expect("id").to_owned();
    let prefix = batchfleet_testkit::services::unique("bftest-since");
    let store = Store::connect(
        &Endpoint::redis(SecretUrl::new("redis://127.0.0.1:6379/")),
        &prefix,
        std::time::Duration::from_secs(5),
    )
    .await
    .expect("redis");
    store
        .put_job(&JobRecord {
            status: JobStatus::Completed,
            output_dir: d.join("out").to_string_lossy().into_owned(),
            ..JobRecord::sample(&id)
        })
        .await
        .expect("record");
    let added = d.join("data").join("zz-new.csv");
    let first_file = std::fs::read_dir(d.join("data"))
        .expect("data")
        .map(|e| e.expect("entry").path())
        .min()
        .expect("a file");
    std::fs::copy(first_file, &added).expect("copy");
    let plan = json_of(
        &batchfleet(d)
            .env("BATCHFLEET_REDIS_URL", "redis://127.0.0.1:6379/")
            .args(["--redis-prefix", &prefix])
            .args(["plan", "job.toml", "--json", "--since", &id])
            .args(["--set", "output.dir=out-2"])
            .output()
            .expect("plan"),
    );
    assert_eq!(plan["incremental"]["since_job"], id.as_str(), "{plan}");
    assert_eq!(plan["incremental"]["new"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        plan["incremental"]["reused"].as_array().map(Vec::len),
        Some(2)
    );
    // An unknown job says what --since takes.
    let unknown = batchfleet(d)
        .env("BATCHFLEET_REDIS_URL", "redis://127.0.0.1:6379/")
        .args(["--redis-prefix", &prefix])
        .args(["plan", "job.toml", "--since", "no-such-job-00000000"])
        .output()
        .expect("plan");
    assert!(!unknown.status.success());
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        err.contains("--since") && err.contains("no such file, folder or job"),
        "{err}"
    );
    let _ = store.delete_job(&id).await;
}
