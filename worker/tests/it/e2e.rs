//! A real job end to end: coordinator → RabbitMQ → two worker processes
//! (libtorch) → part files, checked row by row against PyTorch's own output.

use crate::support::{matches_golden, TestEnv};
use batchfleet_coordinator::reducer::Summary;
use batchfleet_coordinator::{run_job, RunOutcome};
use batchfleet_shared::broker::{Outgoing, PoolQueues};
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::verify::verify;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_score_every_row_exactly_once_matching_pytorch() {
    let env = TestEnv::new("e2e");
    let name = batchfleet_testkit::services::unique("e2e");
    let gen = JobGen {
        rows: 50_000,
        files: 4,
        features: 16,
        hidden: 64,
        outputs: 2,
        name: name.clone(),
        pool: env.pool.clone(),
        item_rows: 4_000,
        batch_size: 512,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        text.replace("[output]\n", "[output]\nmerge = true\n"),
    )
    .expect("manifest");

    let mut workers = vec![env.spawn_worker("w1", &[]), env.spawn_worker("w2", &[])];
    env.wait_for_consumers(2, &mut workers).await;

    let outcome = tokio::time::timeout(
        Duration::from_secs(300),
        run_job(&env.run_config(), &manifest, CancellationToken::new()),
    )
    .await
    .expect("job finished within 5 minutes")
    .expect("job ran");
    let RunOutcome::Completed {
        job_id,
        summary,
        report,
    } = outcome
    else {
        panic!("expected a completed job, got {outcome:?}");
    };

    // Every input id exactly once, every score equal to PyTorch's within 1e-5.
    let out = matches_golden(&env, 50_000);

    // _summary.json agrees with the data and the plan (4 files × 12500 rows at ≤4000 per item: 4 × 4 items).
    let on_disk: Summary =
        serde_json::from_slice(&std::fs::read(&summary).expect("summary")).expect("summary json");
    assert_eq!(on_disk, *report);
    assert_eq!(
        (on_disk.rows_total, on_disk.rows_predicted),
        (50_000, 50_000)
    );
    assert_eq!(
        (on_disk.items_total, on_disk.items_completed, on_disk.parts),
        (16, 16, 16)
    );
    assert_eq!(on_disk.status, "completed");
    assert_eq!(on_disk.workers, 2, "both workers took items");
    assert!(on_disk.rows_per_s > 0.0 && on_disk.item_latency_ms.p95 >= on_disk.item_latency_ms.p50);
    assert!(out.join("_SUCCESS").is_file());

    // The merged output: one header, then every row once, in input order
    // (input files sorted, rows as they appear), exactly the parts' rows.
    let merged = out.join("_merged/predictions.csv");
    assert_eq!(on_disk.merged.as_deref(), Some(merged.as_path()));
    let merged_text = std::fs::read_to_string(&merged).expect("merged output");
    let mut lines = merged_text.lines();
    let part0_text = std::fs::read_to_string(out.join("part-000000.csv")).expect("part 0");
    assert_eq!(
        lines.next(),
        part0_text.lines().next(),
        "the parts' header, once"
    );
    let merged_ids: Vec<&str> = lines.map(|l| l.split(',').next().expect("id")).collect();
    let mut inputs: Vec<_> = std::fs::read_dir(env.path().join("data"))
        .expect("data")
        .flatten()
        .map(|e| e.path())
        .collect();
    inputs.sort();
    let input_ids: Vec<String> = inputs
        .iter()
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .expect("input")
                .lines()
                .skip(1)
                .map(|l| l.split(',').next().expect("id").to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(input_ids.len(), 50_000);
    assert!(
        merged_ids.iter().eq(input_ids.iter()),
        "input order, every id once"
    );
    assert_eq!(
        std::fs::read_dir(out.join("_staging"))
            .expect("staging")
            .count(),
        0,
        "no temp files left"
    );

    // A duplicate delivery of a committed item is acked without recompute.
    let part0 = out.join("part-000000.csv");
    let before = std::fs::metadata(&part0)
        .expect("part 0")
        .modified()
        .expect("mtime");
    let spec = batchfleet_coordinator::manifest::load(&manifest, &[]).expect("manifest");
    let plan = batchfleet_coordinator::planner::plan(&spec).expect("plan");
    let broker = env.broker().await;
    let dup = Outgoing::work_item(&plan.items[0], 2, None);
    broker
        .publish(&PoolQueues::new(&env.pool).work(), vec![dup], 1)
        .await
        .expect("publish duplicate");
    broker.close("bye").await;

    // Drain the workers: SIGTERM → finish in-flight → exit 0. Anything left
    // unacked would return to the queue, so an empty queue afterwards proves the ack.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while env.work_queue().await.map(|(ready, _)| ready) != Some(0) {
        assert!(
            std::time::Instant::now() < deadline,
            "duplicate was never consumed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for w in &mut workers {
        let status = w.terminate(Duration::from_secs(30));
        assert!(status.success(), "worker exit {status}:\n{}", w.log_text());
        assert!(
            w.log_text().contains("worker stopped cleanly"),
            "{}",
            w.log_text()
        );
    }
    assert_eq!(
        env.work_queue().await.map(|(ready, _)| ready),
        Some(0),
        "duplicate was acked, not left unacked"
    );
    let logs: String = workers.iter().map(|w| w.log_text()).collect();
    assert!(
        logs.contains("already committed; acknowledging without recompute"),
        "{logs}"
    );
    assert_eq!(
        std::fs::metadata(&part0)
            .expect("part 0")
            .modified()
            .expect("mtime"),
        before,
        "part file untouched"
    );
    let store = env.connections().store().await.expect("redis");
    let status = batchfleet_coordinator::status::report(&store, &job_id)
        .await
        .expect("status")
        .expect("known job");
    assert_eq!(
        (
            status.job.status.as_str(),
            status.items_failed,
            status.items_remaining
        ),
        ("completed", 0, 0)
    );
    assert!(
        batchfleet_coordinator::status::render(&status)
            .contains("items     16/16 done, 0 failed, 0 remaining"),
        "{}",
        batchfleet_coordinator::status::render(&status)
    );
    let progress = store.progress(&job_id).await.expect("progress");
    assert_eq!(
        (progress.items_done, progress.rows_done),
        (16, 50_000),
        "no double count"
    );

    // The same manifest again: reported complete, nothing published.
    let again = run_job(&env.run_config(), &manifest, CancellationToken::new())
        .await
        .expect("rerun");
    assert!(
        matches!(again, RunOutcome::AlreadyCompleted { .. }),
        "{again:?}"
    );
    assert_eq!(env.work_queue().await.map(|(ready, _)| ready), Some(0));

    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_input_scores_every_record_matching_pytorch() {
    let env = TestEnv::new("jsonl");
    let gen = JobGen {
        rows: 12_000,
        files: 3,
        features: 8,
        hidden: 32,
        outputs: 2,
        name: batchfleet_testkit::services::unique("jsonl"),
        pool: env.pool.clone(),
        item_rows: 1_500,
        batch_size: 256,
        format: "jsonl".into(),
        // Some features null, scored as 0 (`[input] missing = 0`).
        missing_every: 11,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let manifest = env.path().join("job.toml");
    // A blank line and a bad record in the middle of a file: skipped and rejected.
    let file = env.path().join("data/part-01.jsonl");
    let text = std::fs::read_to_string(&file).expect("data");
    let mut lines: Vec<&str> = text.lines().collect();
    lines.insert(100, "");
    lines.insert(200, "{\"id\": \"bad\", \"f0\": \"oops\"}");
    std::fs::write(&file, lines.join("\n") + "\n").expect("data");

    let (mut workers, job_id, report) = two_workers_complete(&env, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!(
        (
            report.rows_total,
            report.rows_predicted,
            report.rows_rejected
        ),
        (12_001, 12_000, 1)
    );
    let out = matches_golden(&env, 12_000);
    let rejects = rejects_text(&out);
    // Line 201 of the file (the blank line 101 counts as a line).
    assert!(
        rejects.contains("\"line\":201")
            && rejects.contains("part-01.jsonl")
            && rejects.contains("is not a number"),
        "{rejects}"
    );
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

/// CSV as pandas users write it: `DataFrame.to_csv` with its defaults — an
/// unnamed index column, 17-digit floats and exponents, NaN as an empty
/// field — with `missing = 0`; then the same files with the index as the id
/// and the default policy, which rejects the rows with a missing value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pandas_to_csv_input_with_missing_values_matches_pytorch() {
    let env = TestEnv::new("pandas");
    let gen = JobGen {
        rows: 12_000,
        files: 3,
        features: 8,
        hidden: 32,
        outputs: 2,
        name: batchfleet_testkit::services::unique("pandas"),
        pool: env.pool.clone(),
        item_rows: 1_500,
        batch_size: 256,
        format: "pandas".into(),
        missing_every: 7,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let manifest = env.path().join("job.toml");
    let data = std::fs::read_to_string(env.path().join("data/part-00.csv")).expect("data");
    let mut lines = data.lines();
    assert!(lines.next().is_some_and(|h| h.starts_with(",id,f0,")));
    let first = lines.next().expect("a row");
    assert!(
        first.starts_with("0,r00000000,,") && first.split(',').any(|f| f.len() >= 18),
        "to_csv writes the index, NaN as empty and full-precision floats: {first}"
    );

    let (mut workers, job_id, report) = two_workers_complete(&env, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!((report.rows_predicted, report.rows_rejected), (12_000, 0));
    matches_golden(&env, 12_000);

    // The default policy: every row with a missing value is a bad row, named.
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        text.replace("missing = 0\n", "")
            .replace("dir = \"out\"", "dir = \"out-reject\"")
            .replace("id_column = \"id\"", "id_column = \"Unnamed: 0\""),
    )
    .expect("manifest");
    let (rejecting_job, report) =
        crate::support::run_to_end(&env, &manifest, Duration::from_secs(300)).await;
    assert_ne!(rejecting_job, job_id, "the policy is part of the job");
    // Every eighth feature value of every seven is missing: each row has
    // one, so every row is rejected — and a job that predicted nothing
    // fails (error budget) rather than completing with `_SUCCESS`.
    let with_missing = (0..12_000u64)
        .filter(|r| (0..8).any(|j| (r * 8 + j) % 7 == 0))
        .count() as u64;
    assert_eq!(with_missing, 12_000);
    assert_eq!(
        (report.status.as_str(), report.failed_class.as_deref()),
        ("failed", Some("budget")),
        "{report:?}"
    );
    assert!(!env.path().join("out-reject").join("_SUCCESS").exists());
    assert_eq!(
        (report.rows_predicted, report.rows_rejected),
        (12_000 - with_missing, with_missing)
    );
    let rejects = rejects_text(&env.path().join("out-reject"));
    assert!(
        rejects.contains("is empty; set [input] missing"),
        "{rejects}"
    );
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_id, &rejecting_job]).await;
}

/// CSV is cut blind at byte offsets; a quoted field with a line break in a
/// file past the planner's sample fails only the items that meet it, with
/// what to set, and the job with `quoted_newlines = true` (planned by
/// reading) scores every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quoted_line_breaks_past_the_sample_fail_their_items_with_the_fix_named() {
    let env = TestEnv::new("quoted");
    let gen = JobGen {
        rows: 2_000,
        files: 20,
        features: 8,
        hidden: 16,
        name: batchfleet_testkit::services::unique("quoted"),
        pool: env.pool.clone(),
        item_rows: 50,
        batch_size: 64,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    // A text column in every file; one value in the 19th file spans two lines.
    for f in 0..20 {
        let file = env.path().join(format!("data/part-{f:02}.csv"));
        let text = std::fs::read_to_string(&file).expect("data");
        let mut out = String::new();
        for (i, line) in text.lines().enumerate() {
            let note = match (i, f) {
                (0, _) => "note",
                (40, 18) => "\"two\nlines\"",
                _ => "plain",
            };
            out.push_str(&format!("{line},{note}\n"));
        }
        std::fs::write(&file, out).expect("data");
    }
    let manifest = env.path().join("job.toml");
    let mut workers = vec![env.spawn_worker("w1", &[]), env.spawn_worker("w2", &[])];
    env.wait_for_consumers(2, &mut workers).await;
    let (blind_job, report) =
        crate::support::run_to_end(&env, &manifest, Duration::from_secs(300)).await;
    assert_eq!(report.status, "completed_with_failures", "{report:?}");
    assert!(
        (1..=2).contains(&report.items_failed),
        "only the items holding the line break: {:?}",
        report.failed_items
    );
    assert!(report.failed_items.iter().all(|f| f.class == "poison"
        && f.reason.contains("part-18.csv")
        && f.reason.contains("set [input] quoted_newlines = true")));

    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        text.replace("id_column", "quoted_newlines = true\nid_column")
            .replace("dir = \"out\"", "dir = \"out-read\""),
    )
    .expect("manifest");
    let (read_job, report) =
        crate::support::run_to_end(&env, &manifest, Duration::from_secs(300)).await;
    assert_ne!(read_job, blind_job);
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!((report.rows_total, report.rows_predicted), (2_000, 2_000));
    let v = verify(
        &env.path().join("out-read"),
        &env.path().join("golden.csv"),
        1e-5,
    )
    .expect("verify");
    assert!(v.ok(), "{}", v.describe());
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&blind_job, &read_job]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parquet_input_scores_every_row_matching_pytorch() {
    let env = TestEnv::new("parquet");
    let gen = JobGen {
        rows: 12_000,
        files: 3,
        features: 8,
        hidden: 32,
        outputs: 2,
        name: batchfleet_testkit::services::unique("parquet"),
        pool: env.pool.clone(),
        item_rows: 1_500,
        batch_size: 256,
        // Row groups of 375 rows (a quarter of an item), mixed float64/float32
        // features, some null (scored as 0: `[input] missing = 0`).
        format: "parquet".into(),
        missing_every: 13,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    // Parquet in, Parquet out, merged.
    std::fs::write(
        &manifest,
        text.replace("[output]\n", "[output]\nmerge = true\n")
            .replace("format = \"csv\"\n", "format = \"parquet\"\n"),
    )
    .expect("manifest");

    let (mut workers, job_id, report) = two_workers_complete(&env, &manifest).await;
    assert_eq!(report.status, "completed");
    // 3 files × 4000 rows in 11 row groups each, cut into runs of ~1500 rows: 3 items per file.
    assert_eq!(
        (
            report.rows_total,
            report.rows_predicted,
            report.rows_rejected
        ),
        (12_000, 12_000, 0)
    );
    assert_eq!((report.items_total, report.items_completed), (9, 9));
    let out = matches_golden(&env, 12_000);
    assert!(out.join("part-000000.parquet").is_file());
    // The merged file lists the ids in input order: files sorted, rows as written.
    let mut ids = Vec::new();
    let columns =
        batchfleet_shared::table::read_part(&out.join("_merged/predictions.parquet"), |_, row| {
            ids.push(row[0].text())
        })
        .expect("merged output");
    assert_eq!(columns, ["id", "score_0", "score_1"]);
    let expected: Vec<String> = (0..12_000).map(|i| format!("r{i:08}")).collect();
    assert_eq!(ids, expected);
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_files_are_scored_by_a_cnn_matching_pytorch() {
    use batchfleet_testkit::python::{make_image_job, ImageGen};
    let env = TestEnv::new("images");
    let gen = ImageGen {
        images: 240,
        name: batchfleet_testkit::services::unique("images"),
        pool: env.pool.clone(),
        item_rows: 25,
        batch_size: 16,
        broken: 2,
        ..ImageGen::default()
    };
    make_image_job(env.path(), &gen).expect("generate job");
    let manifest = env.path().join("job.toml");
    let (mut workers, job_id, report) = two_workers_complete(&env, &manifest).await;
    // 242 files (2 undecodable) in ⌈242 / 25⌉ = 10 items.
    assert_eq!(
        (
            report.rows_total,
            report.rows_predicted,
            report.rows_rejected
        ),
        (242, 240, 2)
    );
    assert_eq!(report.items_total, 10);
    // Every image once, ids relative to the root, scores as PyTorch's within 1e-5.
    let out = matches_golden(&env, 240);
    let rejects = rejects_text(&out);
    assert!(
        rejects.contains("\"raw\":\"broken/bad_0.png\"")
            && rejects.contains("\"raw\":\"broken/bad_1.png\"")
            && rejects.contains("cannot decode the image"),
        "{rejects}"
    );
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_top_k_and_copied_columns_in_json_lines_output() {
    let env = TestEnv::new("labels");
    let gen = JobGen {
        rows: 6_000,
        files: 2,
        features: 8,
        hidden: 32,
        outputs: 3,
        name: batchfleet_testkit::services::unique("labels"),
        pool: env.pool.clone(),
        item_rows: 1_000,
        batch_size: 256,
        checkpoint_every: Some(1),
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    std::fs::write(env.path().join("labels.txt"), "low\nmid\nhigh\n").expect("labels");
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        text.replace(
            "dir = \"out\"\nformat = \"csv\"\n",
            "dir = \"out\"\nformat = \"jsonl\"\nlabels = \"labels.txt\"\nargmax = true\ntop_k = 2\ninclude_columns = [\"f3\"]\nmerge = true\n",
        ),
    )
    .expect("manifest");
    let (mut workers, job_id, report) = two_workers_complete(&env, &manifest).await;
    assert_eq!((report.rows_predicted, report.items_completed), (6_000, 6));
    // Scores as PyTorch's (checkpointed in segments of 256 rows, then joined).
    let out = env.path().join("out");
    let v = verify(&out, &env.path().join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    // Every row: the copied input text, the argmax class and the top two.
    let mut inputs = std::collections::HashMap::new();
    for f in ["part-00.csv", "part-01.csv"] {
        let text = std::fs::read_to_string(env.path().join("data").join(f)).expect("input");
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split(',').collect();
            inputs.insert(fields[0].to_owned(), fields[4].to_owned());
        }
    }
    let names = ["low", "mid", "high"];
    let merged =
        std::fs::read_to_string(out.join("_merged/predictions.jsonl")).expect("merged output");
    let mut rows = 0;
    for line in merged.lines() {
        let row: serde_json::Value = serde_json::from_str(line).expect("a JSON object");
        let keys: Vec<&String> = row.as_object().expect("object").keys().collect();
        assert_eq!(
            keys,
            [
                "id",
                "f3",
                "score_0",
                "score_1",
                "score_2",
                "label",
                "top1_label",
                "top1_score",
                "top2_label",
                "top2_score"
            ]
        );
        let scores: Vec<f64> = (0..3)
            .map(|k| row[format!("score_{k}")].as_f64().expect("score"))
            .collect();
        let mut order = [0usize, 1, 2];
        order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]));
        let id = row["id"].as_str().expect("id");
        assert_eq!(row["f3"], inputs[id].as_str(), "{id}");
        assert_eq!(row["label"], names[order[0]], "{line}");
        assert_eq!(
            (&row["top1_label"], &row["top2_label"]),
            (&names[order[0]].into(), &names[order[1]].into())
        );
        assert_eq!(row["top2_score"].as_f64(), Some(scores[order[1]]));
        rows += 1;
    }
    assert_eq!(rows, 6_000);
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

/// Starts two workers and runs the job of `manifest` to completion; the
/// workers (to stop), the job id and its summary.
async fn two_workers_complete(
    env: &TestEnv,
    manifest: &std::path::Path,
) -> (Vec<crate::support::Worker>, String, Summary) {
    let mut workers = vec![env.spawn_worker("w1", &[]), env.spawn_worker("w2", &[])];
    env.wait_for_consumers(2, &mut workers).await;
    let (job_id, report) =
        crate::support::run_to_end(env, manifest, Duration::from_secs(300)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    (workers, job_id, report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csv_parquet_and_image_jobs_read_from_and_write_to_s3() {
    use batchfleet_testkit::python::{make_image_job, ImageGen};
    let _turn = crate::support::s3_turn().await;
    let s3 = batchfleet_testkit::services::S3Server::start().expect("moto");
    let env = TestEnv::new("s3");
    let bucket = "batchfleet-tests";
    let prefix = batchfleet_testkit::services::unique("s3");
    // The coordinator runs in this process: point its S3 client at moto.
    s3.configure_this_process();
    let settings = s3.env();
    // Confined to the test's folder and the test's bucket, locally and in S3.
    let local_root = env.path().to_str().expect("utf-8").to_owned();
    let s3_root = format!("s3://{bucket}/{prefix}");
    let roots = ["--data-root", &local_root, "--data-root", &s3_root];
    // w2 reads its credentials from files, as from mounted secrets, and
    // they are rotated after each job (moto takes any credentials: the log
    // shows the worker read them again).
    let (key_file, secret_file) = (env.path().join("aws-key-id"), env.path().join("aws-secret"));
    let rotate = |round: &str| {
        std::fs::write(&key_file, format!("testing-{round}\n")).expect("key file");
        std::fs::write(&secret_file, format!("secret-{round}\n")).expect("secret file");
    };
    rotate("first");
    let mut from_files: Vec<(&str, String)> = settings
        .iter()
        .filter(|(k, _)| !matches!(*k, "AWS_ACCESS_KEY_ID" | "AWS_SECRET_ACCESS_KEY"))
        .cloned()
        .collect();
    from_files.push(("AWS_ACCESS_KEY_ID_FILE", key_file.display().to_string()));
    from_files.push((
        "AWS_SECRET_ACCESS_KEY_FILE",
        secret_file.display().to_string(),
    ));
    let mut workers = vec![
        env.spawn_worker_with_env("w1", &roots, &settings),
        env.spawn_worker_with_env("w2", &roots, &from_files),
    ];
    let mut cfg = env.run_config();
    cfg.data_roots = vec![env.path().to_owned(), std::path::PathBuf::from(&s3_root)];
    env.wait_for_consumers(2, &mut workers).await;

    for (format, rows) in [("csv", 6_000), ("parquet", 6_000), ("files", 60)] {
        let dir = env.path().join(format);
        let name = batchfleet_testkit::services::unique(format);
        if format == "files" {
            let gen = ImageGen {
                images: 60,
                name,
                pool: env.pool.clone(),
                item_rows: 10,
                broken: 0,
                ..ImageGen::default()
            };
            make_image_job(&dir, &gen).expect("generate job");
        } else {
            let gen = JobGen {
                rows,
                files: 2,
                features: 8,
                hidden: 16,
                name,
                pool: env.pool.clone(),
                item_rows: 1_000,
                batch_size: 256,
                format: format.into(),
                ..JobGen::default()
            };
            make_job(&dir, &gen).expect("generate job");
        }
        // The input goes to the bucket and leaves the disk: only S3 has it.
        let (local, pattern) = if format == "files" {
            ("images", "images/**/*.png")
        } else {
            (
                "data",
                if format == "csv" {
                    "data/*.csv"
                } else {
                    "data/*.parquet"
                },
            )
        };
        let url = format!("s3://{bucket}/{prefix}/{format}");
        s3.put_dir(
            bucket,
            &format!("{prefix}/{format}/{local}"),
            &dir.join(local),
        )
        .expect("upload");
        std::fs::remove_dir_all(dir.join(local)).expect("remove local input");
        let manifest = dir.join("job.toml");
        let text = std::fs::read_to_string(&manifest).expect("manifest");
        let quoted = |p: &str| format!("\"{p}\"");
        let mut text = text
            .replace(&quoted(pattern), &quoted(&format!("{url}/{pattern}")))
            .replace("root = \"images\"", &format!("root = \"{url}/images\""));
        // The CSV job writes to S3 too (merged), checkpointing there: a round trip.
        let out = if format == "csv" {
            text = text.replace(
                "dir = \"out\"\n",
                &format!("dir = \"{url}/out\"\nmerge = true\n"),
            );
            text = text.replace(
                "inference_batch_size = 256\n",
                "inference_batch_size = 256\ncheckpoint_every = 1\n",
            );
            std::path::PathBuf::from(format!("{url}/out"))
        } else {
            dir.join("out")
        };
        assert!(text.contains("s3://"), "{text}");
        std::fs::write(&manifest, text).expect("manifest");

        let (job_id, report) =
            crate::support::run_with_config_to_end(&cfg, &manifest, Duration::from_secs(300)).await;
        assert_eq!(report.status, "completed", "{format}: {report:?}");
        assert_eq!(report.rows_predicted, rows, "{format}");
        let v = verify(&out, &dir.join("golden.csv"), 1e-5).expect("verify");
        assert!(v.ok(), "{format}: {}", v.describe());
        assert_eq!(v.parts as u64, report.items_total, "{format}");
        if format == "csv" {
            use batchfleet_shared::source::fs;
            // Everything a local job leaves, as objects: parts, summary, marker, merged file.
            let names = fs::list_dir(&out).expect("list the output");
            for want in [
                "_summary.json",
                "_SUCCESS",
                "_JOB",
                "_merged",
                "part-000000.csv",
            ] {
                assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
            }
            assert!(
                !names.iter().any(|n| n == "_partial"),
                "checkpoints removed: {names:?}"
            );
            let merged = fs::read_to_string(&out.join("_merged/predictions.csv")).expect("merged");
            assert_eq!(merged.lines().count() as u64, rows + 1);
        }
        env.cleanup(&[&job_id]).await;
        rotate(format);
    }
    crate::support::stop_all(&mut workers);
    let log = workers[1].log_text();
    assert!(log.contains("item committed"), "w2 did its share:\n{log}");
    assert!(
        log.contains("S3 credential files changed: read again"),
        "w2 took up the rotated credentials:\n{log}"
    );
    assert!(
        !log.contains("testing-") && !log.contains("secret-"),
        "no credential logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_file_outside_the_validation_sample_with_another_header_fails_only_its_items() {
    let _turn = crate::support::s3_turn().await;
    let s3 = batchfleet_testkit::services::S3Server::start().expect("moto");
    let env = TestEnv::new("s3hdr");
    let bucket = "batchfleet-tests";
    let prefix = batchfleet_testkit::services::unique("s3hdr");
    s3.configure_this_process();
    let settings = s3.env();
    let s3_root = format!("s3://{bucket}/{prefix}");
    // The model and the output stay local.
    let local_root = env.path().to_str().expect("utf-8").to_owned();
    let roots = ["--data-root", &local_root, "--data-root", &s3_root];
    let mut workers = vec![env.spawn_worker_with_env("w1", &roots, &settings)];
    let mut cfg = env.run_config();
    cfg.data_roots = vec![env.path().to_owned(), std::path::PathBuf::from(&s3_root)];
    env.wait_for_consumers(1, &mut workers).await;

    // More objects than validation probes, ten rows each.
    let files = batchfleet_coordinator::manifest::SAMPLE_FILES as u32 + 6;
    let gen = JobGen {
        rows: u64::from(files) * 10,
        files,
        features: 4,
        hidden: 8,
        name: batchfleet_testkit::services::unique("s3hdr"),
        pool: env.pool.clone(),
        item_rows: 1_000,
        batch_size: 64,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let url = format!("{s3_root}/data");
    let mut names: Vec<String> = std::fs::read_dir(env.path().join("data"))
        .expect("data")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .collect();
    names.sort();
    let objects: Vec<std::path::PathBuf> =
        names.iter().map(|n| format!("{url}/{n}").into()).collect();
    let probed = batchfleet_coordinator::manifest::sample(&objects);
    let unprobed = objects
        .iter()
        .rposition(|o| !probed.contains(o))
        .expect("a file validation does not probe");
    // Its feature columns swapped: same width, so only the header tells.
    let path = env.path().join("data").join(&names[unprobed]);
    let text = std::fs::read_to_string(&path).expect("data");
    let (header, rows) = text.split_once('\n').expect("a header");
    assert!(header.starts_with("id,f0,f1,"), "{header}");
    let swapped = header.replacen("id,f0,f1,", "id,f1,f0,", 1);
    std::fs::write(&path, format!("{swapped}\n{rows}")).expect("write");
    s3.put_dir(bucket, &format!("{prefix}/data"), &env.path().join("data"))
        .expect("upload");
    std::fs::remove_dir_all(env.path().join("data")).expect("remove local input");
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    let text = text.replace("\"data/*.csv\"", &format!("\"{url}/*.csv\""));
    assert!(text.contains("s3://"), "{text}");
    std::fs::write(&manifest, text).expect("manifest");

    let (job_id, report) =
        crate::support::run_with_config_to_end(&cfg, &manifest, Duration::from_secs(300)).await;
    assert_eq!(report.status, "completed_with_failures", "{report:?}");
    assert_eq!(
        report.rows_predicted,
        u64::from(files - 1) * 10,
        "{report:?}"
    );
    assert_eq!(report.items_failed, 1, "{report:?}");
    let failure = &report.failed_items[0];
    assert_eq!(failure.class, "poison");
    assert!(
        failure.reason.contains(&format!(
            "{}: the header row differs from the job's (its column 2 is \"f1\" where the job's input files have \"f0\")",
            names[unprobed]
        )),
        "{}",
        failure.reason
    );
    env.cleanup(&[&job_id]).await;
    crate::support::stop_all(&mut workers);
}

/// Every rejects record of an output folder, as JSON text.
fn rejects_text(out: &std::path::Path) -> String {
    crate::support::rejects(out)
        .iter()
        .map(|r| r.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_returning_integers_writes_integers() {
    let env = TestEnv::new("ints");
    let gen = JobGen {
        rows: 3_000,
        files: 1,
        features: 8,
        hidden: 16,
        outputs: 2,
        name: batchfleet_testkit::services::unique("ints"),
        pool: env.pool.clone(),
        item_rows: 1_000,
        batch_size: 256,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    // classes.pt: the same model returning int64 (score > 0), as Parquet.
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        text.replace("path = \"model.pt\"", "path = \"classes.pt\"")
            .replace(
                "dir = \"out\"\nformat = \"csv\"",
                "dir = \"out\"\nformat = \"parquet\"\nmerge = true",
            ),
    )
    .expect("manifest");
    let (mut workers, job_id, report) = two_workers_complete(&env, &manifest).await;
    assert_eq!(report.rows_predicted, 3_000);
    let golden = std::fs::read_to_string(env.path().join("golden.csv")).expect("golden");
    let want: std::collections::HashMap<String, Vec<i64>> = golden
        .lines()
        .skip(1)
        .map(|l| {
            let mut f = l.split(',');
            let id = f.next().expect("id").to_owned();
            (
                id,
                f.map(|v| i64::from(v.parse::<f64>().expect("score") > 0.0))
                    .collect(),
            )
        })
        .collect();
    let mut seen = 0;
    let columns = batchfleet_shared::table::read_part(
        &env.path().join("out/_merged/predictions.parquet"),
        |_, row| {
            let got: Vec<i64> = row[1..]
                .iter()
                .map(|v| match v {
                    batchfleet_shared::table::Value::Number(n) => *n as i64,
                    other => panic!("not a number: {other:?}"),
                })
                .collect();
            assert_eq!(got, want[&row[0].text()], "{:?}", row[0]);
            seen += 1;
        },
    )
    .expect("merged output");
    assert_eq!((columns.len(), seen), (3, 3_000));
    // The Parquet columns are integers, not floats.
    let file = std::fs::File::open(env.path().join("out/part-000000.parquet")).expect("part");
    let schema = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .expect("parquet")
        .schema()
        .clone();
    assert_eq!(schema.field(1).data_type(), &arrow_schema::DataType::Int64);
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

/// One-row items: each worker deepens its prefetch from the items it
/// settles (`--prefetch 2 --prefetch-max 16`), changing its subscription
/// mid-job, and every row is still scored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_items_deepen_the_prefetch_and_every_row_is_scored_once() {
    let env = TestEnv::new("prefetch");
    let gen = JobGen {
        rows: 3_000,
        files: 1,
        features: 2,
        hidden: 4,
        outputs: 1,
        name: batchfleet_testkit::services::unique("prefetch"),
        pool: env.pool.clone(),
        item_rows: 1,
        batch_size: 1,
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    let manifest = env.path().join("job.toml");
    let args = ["--prefetch", "2", "--prefetch-max", "16"];
    let mut workers = vec![env.spawn_worker("w1", &args), env.spawn_worker("w2", &args)];
    env.wait_for_consumers(2, &mut workers).await;
    // One item per message: the prefetch counts messages, and bundles of
    // short items would divide their rate by the bundle's size (and with
    // it the depth this test looks for).
    let mut cfg = env.run_config();
    cfg.connections.bundle = 1;
    let (job_id, report) =
        crate::support::run_with_config_to_end(&cfg, &manifest, Duration::from_secs(300)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    matches_golden(&env, 3_000);
    crate::support::stop_all(&mut workers);
    let sizes: Vec<u16> = workers
        .iter()
        .flat_map(|w| {
            w.log_text()
                .lines()
                .filter(|l| l.contains("prefetch sized"))
                .filter_map(|l| {
                    l.split(" to=")
                        .nth(1)?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                })
                .collect::<Vec<u16>>()
        })
        .collect();
    assert!(
        sizes.iter().any(|&s| s > 2) && sizes.iter().all(|&s| s <= 16),
        "prefetch sizes logged: {sizes:?}"
    );
    env.cleanup(&[&job_id]).await;
}
