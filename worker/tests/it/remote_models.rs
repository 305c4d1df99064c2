//! A model named by `s3://` URL, against a local S3 server (moto): pinned at
//! validation, downloaded once per worker into its cache, read from the
//! cache after a restart, downloaded again when the cached copy is damaged,
//! handed back by a worker that cannot read it, and failing the job when
//! the object changed after validation — the containment rules of a local
//! model file.

use crate::support::{TestEnv, Worker};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services::{unique, S3Server};
use batchfleet_testkit::verify::verify;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(180);

/// The files of a worker's cache folder (digests).
fn cached(cache: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(cache.join("sha256"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Uploads `file` as `s3://bucket/key` (through a folder of its own).
fn put(s3: &S3Server, bucket: &str, key: &str, file: &Path) {
    let (folder, name) = key.rsplit_once('/').expect("a key with a folder");
    let stage = tempfile::tempdir().expect("stage");
    std::fs::copy(file, stage.path().join(name)).expect("stage the file");
    s3.put_dir(bucket, folder, stage.path()).expect("upload");
}

/// Waits until `worker`'s log holds `text`.
async fn logged(worker: &mut Worker, text: &str) {
    let deadline = Instant::now() + LIMIT;
    while !worker.log_text().contains(text) {
        assert!(
            Instant::now() < deadline,
            "never logged {text:?}:\n{}",
            worker.log_text()
        );
        if let Ok(Some(status)) = worker.child.try_wait() {
            panic!("worker exited with {status}:\n{}", worker.log_text());
        }
        // A log line is the event; no notification crosses the process.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_in_s3_is_pinned_downloaded_once_per_worker_and_contained() {
    let _turn = crate::support::s3_turn().await;
    let s3 = S3Server::start().expect("moto");
    let env = TestEnv::new("s3model");
    let bucket = "batchfleet-tests";
    let prefix = unique("s3model");
    // The coordinator validates in this process: its S3 client and cache.
    s3.configure_this_process();
    batchfleet_shared::pinned::configure(Some(env.path().join("cache-coordinator")), None);
    let settings = s3.env();
    let s3_root = format!("s3://{bucket}/{prefix}");
    let local_root = env.path().to_str().expect("utf-8").to_owned();
    let gen = JobGen {
        rows: 4_000,
        files: 2,
        features: 8,
        hidden: 16,
        name: unique("s3model"),
        pool: env.pool.clone(),
        item_rows: 500,
        batch_size: 256,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    // The model goes to the bucket and leaves the disk: only S3 has it.
    let model = env.path().join("model.pt");
    let sha = batchfleet_shared::fsutil::sha256_file(&model).expect("hash");
    let url = format!("{s3_root}/models/model.pt");
    put(&s3, bucket, &format!("{prefix}/models/model.pt"), &model);
    let kept = env.path().join("model.keep");
    std::fs::rename(&model, &kept).expect("move the model away");
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    let text = text.replace("path = \"model.pt\"", &format!("path = \"{url}\""));
    assert!(text.contains(&url), "{text}");
    std::fs::write(&manifest, text).expect("manifest");

    let cache = |w: &str| env.path().join(format!("cache-{w}"));
    let spawn = |w: &str, settings: &[(&str, String)]| {
        let dir = cache(w);
        let dir = dir.to_str().expect("utf-8");
        env.spawn_worker_with_env(
            w,
            &[
                "--data-root",
                &local_root,
                "--data-root",
                &s3_root,
                "--cache-dir",
                dir,
                "--unable-for",
                "2s",
            ],
            settings,
        )
    };
    let mut cfg = env.run_config();
    cfg.data_roots = vec![env.path().to_owned(), PathBuf::from(&s3_root)];
    let with_out = |out: &str| {
        let mut c = cfg.clone();
        c.overrides = vec![format!("output.dir={out}")];
        c
    };
    let check = |out: &str, report: &batchfleet_coordinator::reducer::Summary| {
        assert_eq!(report.status, "completed", "{out}: {report:?}");
        let v =
            verify(&env.path().join(out), &env.path().join("golden.csv"), 1e-5).expect("verify");
        assert!(v.ok(), "{out}: {}", v.describe());
        assert_eq!(v.output_rows, 4_000, "{out}");
    };

    // 1. Two workers: each downloads the model once, keeps it under its digest.
    let mut workers = vec![spawn("w1", &settings), spawn("w2", &settings)];
    env.wait_for_consumers(2, &mut workers).await;
    let (job1, report) = crate::support::run_with_config_to_end(&cfg, &manifest, LIMIT).await;
    check("out", &report);
    assert_eq!(report.model_sha256, sha, "the digest pinned at validation");
    let mut downloads = 0;
    for w in &workers {
        let log = w.log_text();
        let n = log.matches("downloaded into the cache").count();
        assert!(n <= 1, "one download per worker at most:\n{log}");
        downloads += n;
        if log.contains("item committed") {
            assert_eq!(n, 1, "a worker that ran items downloaded the model:\n{log}");
        }
    }
    assert!(downloads >= 1);
    for w in ["w1", "w2"] {
        let files = cached(&cache(w));
        assert!(files.is_empty() || files == [sha.clone()], "{w}: {files:?}");
    }
    crate::support::stop_all(&mut workers);

    // 2. Restarted, a worker that downloaded the model loads it from its
    // cache: no download.
    let again = if cached(&cache("w1")).is_empty() {
        "w2"
    } else {
        "w1"
    };
    assert_eq!(cached(&cache(again)), std::slice::from_ref(&sha));
    let mut workers = vec![spawn(again, &settings)];
    env.wait_for_consumers(1, &mut workers).await;
    let (job2, report) =
        crate::support::run_with_config_to_end(&with_out("out2"), &manifest, LIMIT).await;
    check("out2", &report);
    let log = workers[0].log_text();
    assert!(log.contains("model loaded"), "{log}");
    assert!(
        !log.contains("downloaded into the cache"),
        "read from the cache:\n{log}"
    );
    crate::support::stop_all(&mut workers);

    // 3. A damaged cached copy is not loaded: it is downloaded again.
    let copy = cache(again).join("sha256").join(&sha);
    std::fs::write(&copy, b"not the model").expect("damage");
    let mut workers = vec![spawn(again, &settings)];
    env.wait_for_consumers(1, &mut workers).await;
    let (job3, report) =
        crate::support::run_with_config_to_end(&with_out("out3"), &manifest, LIMIT).await;
    check("out3", &report);
    let log = workers[0].log_text();
    assert!(log.contains("does not hash to its name"), "{log}");
    assert_eq!(log.matches("downloaded into the cache").count(), 1, "{log}");
    assert_eq!(
        std::fs::read(&copy).expect("cached"),
        std::fs::read(&kept).expect("model")
    );
    crate::support::stop_all(&mut workers);

    // 4. A worker that cannot read the object (its S3 endpoint has no such
    // bucket) hands the items back; another completes the job.
    let elsewhere = S3Server::start().expect("a second moto");
    let blind: Vec<(&str, String)> = elsewhere.env();
    let mut workers = vec![spawn("blind", &blind)];
    env.wait_for_consumers(1, &mut workers).await;
    let job4 = crate::support::submit(&with_out("out4"), &manifest).await;
    logged(
        &mut workers[0],
        &format!("cannot read model {url} on this worker"),
    )
    .await;
    workers.push(spawn(again, &settings));
    let report = crate::support::follow_to_end(&cfg, &job4, LIMIT).await;
    check("out4", &report);
    assert!(cached(&cache("blind")).is_empty());
    crate::support::stop_all(&mut workers);

    // 5. The object changed after validation pinned it: the job fails
    // (unrunnable), as for a local model file rewritten in place.
    let url_b = format!("{s3_root}/models-b/model.pt");
    put(&s3, bucket, &format!("{prefix}/models-b/model.pt"), &kept);
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    let manifest_b = env.path().join("job-b.toml");
    std::fs::write(&manifest_b, text.replace(&url, &url_b)).expect("manifest b");
    let job5 = crate::support::submit(&with_out("out5"), &manifest_b).await;
    put(
        &s3,
        bucket,
        &format!("{prefix}/models-b/model.pt"),
        &env.path().join("classes.pt"),
    );
    let mut workers = vec![spawn("late", &settings)];
    let report = crate::support::follow_to_end(&cfg, &job5, LIMIT).await;
    assert_eq!(report.status, "failed", "{report:?}");
    assert_eq!(
        report.failed_class.as_deref(),
        Some("unrunnable"),
        "{report:?}"
    );
    let reason = report.failed_reason.clone().unwrap_or_default();
    assert!(
        reason.contains(&url_b) && reason.contains("sha256"),
        "{reason}"
    );
    assert!(
        cached(&cache("late")).is_empty(),
        "a changed object is not kept"
    );
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job1, &job2, &job3, &job4, &job5]).await;
}
