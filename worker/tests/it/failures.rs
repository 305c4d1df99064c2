//! Failure handling against the real RabbitMQ, Redis and libtorch: bad rows,
//! models that raise, flake or hang, the dead-letter queue and the error budget.

use crate::support::{stop_all, Backend, TestEnv};
use batchfleet_coordinator::dlq::{self, Filter};
use batchfleet_coordinator::reducer::Summary;
use batchfleet_testkit::python::{make_faulty_models, make_job, JobGen};
use batchfleet_testkit::verify::verify;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A 2000-row job (2 files, items of `item_rows`) with the faulty model variants,
/// its manifest pointing at `model` and carrying `failure` as its `[failure]` section.
fn job(
    env: &TestEnv,
    item_rows: u64,
    poison_rows: &[u64],
    hang_rows: &[u64],
    model: &str,
    failure: &str,
) -> PathBuf {
    let gen = JobGen {
        rows: 2_000,
        files: 2,
        features: 8,
        hidden: 16,
        name: batchfleet_testkit::services::unique("fail"),
        pool: env.pool.clone(),
        item_rows,
        batch_size: 64,
        poison_rows: poison_rows.to_vec(),
        hang_rows: hang_rows.to_vec(),
        ..JobGen::default()
    };
    make_job(env.path(), &gen).expect("generate job");
    make_faulty_models(env.path(), 150.0).expect("faulty models");
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest)
        .expect("manifest")
        .replace("path = \"model.pt\"", &format!("path = \"{model}\""));
    std::fs::write(&manifest, format!("{text}\n[failure]\n{failure}\n")).expect("manifest");
    manifest
}

/// Rewrites `manifest` with `from` replaced by `to`.
fn replace_in(manifest: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(manifest).expect("manifest");
    std::fs::write(manifest, text.replace(from, to)).expect("manifest");
}

async fn run(env: &TestEnv, manifest: &Path) -> (String, Summary) {
    crate::support::run_to_end(env, manifest, Duration::from_secs(180)).await
}

fn rejects(out: &Path) -> Vec<serde_json::Value> {
    crate::support::rejects(out)
}

fn id(row: u64) -> String {
    format!("r{row:08}")
}

async fn dead(env: &TestEnv, job: &str) -> Vec<dlq::DeadItem> {
    let broker = env.broker().await;
    let items = dlq::list(
        &*broker,
        &env.pool,
        &Filter {
            job: Some(job.to_owned()),
            ..Filter::default()
        },
    )
    .await
    .expect("dlq list");
    broker.close("bye").await;
    items
}

/// INV-ROWS with rejects: every golden id is in the outputs or the rejects, once.
fn assert_outputs(env: &TestEnv, rejected_ids: &[String]) {
    let out = env.path().join("out");
    let v = verify(&out, &env.path().join("golden.csv"), 1e-5).expect("verify");
    assert!(
        v.duplicated.is_empty() && v.unexpected.is_empty() && v.mismatched.is_empty(),
        "{}",
        v.describe()
    );
    let mut missing = v.missing.clone();
    missing.sort();
    let mut want = rejected_ids.to_vec();
    want.sort();
    assert_eq!(
        missing, want,
        "the rows missing from the outputs are exactly the rejected ones"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_are_rejected_with_file_line_and_reason_and_the_rest_predicted() {
    let env = TestEnv::new("badrow");
    let manifest = job(&env, 500, &[], &[], "model.pt", "on_bad_row = \"reject\"");
    // Break two rows of the second file: a non-number (file line 4) and a short row (line 10).
    let file = env.path().join("data/part-01.csv");
    let mut lines: Vec<String> = std::fs::read_to_string(&file)
        .expect("data")
        .lines()
        .map(str::to_owned)
        .collect();
    let mut f: Vec<&str> = lines[3].split(',').collect();
    f[2] = "oops";
    lines[3] = f.join(",");
    lines[9] = lines[9].split(',').take(3).collect::<Vec<_>>().join(",");
    std::fs::write(&file, lines.join("\n") + "\n").expect("write");

    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let (job_id, report) = run(&env, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!(
        (
            report.rows_predicted,
            report.rows_rejected,
            report.items_failed
        ),
        (1998, 2, 0)
    );
    assert!(env.path().join("out/_SUCCESS").exists());
    let rej = rejects(&env.path().join("out"));
    assert_eq!(rej.len(), 2);
    assert_eq!(rej[0]["line"], 4);
    assert!(
        rej[0]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("field 3 is not a number: \"oops\""),
        "{rej:?}"
    );
    assert!(
        rej[0]["raw"]
            .as_str()
            .unwrap_or_default()
            .starts_with("r00001002,"),
        "{rej:?}"
    );
    assert!(rej[0]["file"]
        .as_str()
        .unwrap_or_default()
        .ends_with("part-01.csv"));
    assert_eq!(rej[1]["line"], 10);
    assert!(
        rej[1]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("expected 9 fields, found 3"),
        "{rej:?}"
    );
    assert_outputs(&env, &[id(1002), id(1008)]);
    assert!(dead(&env, &job_id).await.is_empty());
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_item_mode_dead_letters_the_item_with_its_reason() {
    let env = TestEnv::new("failitem");
    let manifest = job(
        &env,
        500,
        &[],
        &[],
        "model.pt",
        "on_bad_row = \"fail_item\"",
    );
    let file = env.path().join("data/part-01.csv");
    let mut lines: Vec<String> = std::fs::read_to_string(&file)
        .expect("data")
        .lines()
        .map(str::to_owned)
        .collect();
    let mut f: Vec<&str> = lines[3].split(',').collect();
    f[2] = "oops";
    lines[3] = f.join(",");
    std::fs::write(&file, lines.join("\n") + "\n").expect("write");

    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let (job_id, report) = run(&env, &manifest).await;
    assert_eq!(report.status, "completed_with_failures");
    assert_eq!(
        (
            report.items_total,
            report.items_completed,
            report.items_failed
        ),
        (4, 3, 1)
    );
    let failure = &report.failed_items[0];
    assert_eq!((failure.seq, failure.class.as_str()), (2, "poison"));
    assert!(
        failure
            .reason
            .contains("part-01.csv line 4: field 3 is not a number: \"oops\""),
        "{}",
        failure.reason
    );
    assert!(
        !env.path().join("out/_SUCCESS").exists(),
        "no _SUCCESS for a job with failures"
    );
    let item = crate::support::item_ids(&manifest, 2);
    assert!(item.contains(&id(1002)) && (450..=550).contains(&item.len()));
    assert_outputs(&env, &item);

    let dead = dead(&env, &job_id).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (
            dead[0].item,
            dead[0].class.as_str(),
            dead[0].attempts,
            dead[0].worker.as_str()
        ),
        (Some(2), "poison", 1, "w1")
    );
    assert!(
        dead[0].error.contains("field 3 is not a number"),
        "{:?}",
        dead[0]
    );
    assert!(dead[0].dead_at_ms > 0);

    // Purging the job's dead items empties the dead queue for good.
    let broker = env.broker().await;
    assert_eq!(
        dlq::purge(&*broker, &env.pool, Some(&job_id))
            .await
            .expect("purge"),
        1
    );
    assert!(dlq::list(&*broker, &env.pool, &Filter::default())
        .await
        .expect("list")
        .is_empty());
    broker.close("bye").await;
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

// Failure handling on both backends, one body each: the in-process queues
// and store of `--local` keep RabbitMQ's and Redis's semantics.
crate::on_both_backends! {
    rows_the_model_raises_on_are_isolated_and_rejected_alone,
    poisoned_items_are_dead_lettered_then_replayed_after_a_model_fix,
    transient_failures_are_retried_later_until_the_item_succeeds,
    a_hung_item_times_out_is_dead_lettered_and_the_rest_completes,
    rejected_rows_have_a_budget_and_a_job_of_only_rejects_fails,
}

/// Issue: rejected rows counted against no budget, so a job whose every row
/// was rejected ended `completed`, with `_SUCCESS`. Now three rejected rows
/// break `max_rejected_rows = 2`, and a job whose 2,000 rows are all bad
/// fails (class `budget`) with no limit set.
async fn rejected_rows_have_a_budget_and_a_job_of_only_rejects_fails(backend: Backend) {
    let env = TestEnv::new("rejbudget");
    let manifest = job(
        &env,
        500,
        &[3, 777, 1501],
        &[],
        "poison.pt",
        "max_rejected_rows = 2",
    );
    let mut workers = env.workers(backend, &[&[], &[]]).await;
    let (first, report) = env.run_on(&workers, &manifest).await;
    assert_eq!(report.status, "failed", "{report:?}");
    assert_eq!(report.failed_class.as_deref(), Some("budget"));
    assert!(
        report
            .failed_reason
            .as_deref()
            .is_some_and(|r| r.contains("max_rejected_rows = 2")),
        "{report:?}"
    );
    assert!(!env.path().join("out").join("_SUCCESS").exists());
    // Every row bad: a feature that is not a number in each.
    let env2 = TestEnv::new("rejall");
    let manifest = job(&env2, 500, &[], &[], "model.pt", "on_bad_row = \"reject\"");
    for file in std::fs::read_dir(env2.path().join("data"))
        .expect("data")
        .flatten()
    {
        let text = std::fs::read_to_string(file.path()).expect("csv");
        let mut lines = text.lines();
        let mut bad = vec![lines.next().expect("header").to_owned()];
        bad.extend(lines.map(|l| {
            let (id, rest) = l.split_once(',').expect("id,features");
            let (_, others) = rest.split_once(',').expect("two features or more");
            format!("{id},not-a-number,{others}")
        }));
        std::fs::write(file.path(), bad.join("\n") + "\n").expect("rewrite");
    }
    workers.stop();
    let mut workers = env2.workers(backend, &[&[], &[]]).await;
    let (second, report) = env2.run_on(&workers, &manifest).await;
    assert_eq!(report.status, "failed", "{report:?}");
    assert_eq!(report.failed_class.as_deref(), Some("budget"));
    assert!(
        report
            .failed_reason
            .as_deref()
            .is_some_and(|r| r.contains("every row was rejected")),
        "{report:?}"
    );
    assert_eq!((report.rows_predicted, report.rows_rejected), (0, 2_000));
    assert!(!env2.path().join("out").join("_SUCCESS").exists());
    workers.stop();
    env.cleanup(&[&first]).await;
    env2.cleanup(&[&second]).await;
}

async fn rows_the_model_raises_on_are_isolated_and_rejected_alone(backend: Backend) {
    let env = TestEnv::new("isolate");
    let poison = [3, 777, 1501];
    let manifest = job(
        &env,
        500,
        &poison,
        &[],
        "poison.pt",
        "isolate_poison_rows = true",
    );
    let mut workers = env.workers(backend, &[&[], &[]]).await;
    let (job_id, report) = env.run_on(&workers, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!(
        (
            report.rows_predicted,
            report.rows_rejected,
            report.items_failed
        ),
        (1997, 3, 0)
    );
    let rej = rejects(&env.path().join("out"));
    let mut ids: Vec<String> = rej
        .iter()
        .map(|r| {
            r["raw"]
                .as_str()
                .unwrap_or_default()
                .split(',')
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    ids.sort();
    assert_eq!(ids, poison.iter().map(|r| id(*r)).collect::<Vec<_>>());
    assert!(
        rej.iter().all(|r| r["stage"] == "model"
            && r["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("poison sentinel")),
        "{rej:?}"
    );
    assert_outputs(&env, &ids);
    assert!(env
        .dead_on(&workers, &job_id, Filter::default())
        .await
        .is_empty());
    workers.stop();
    env.cleanup(&[&job_id]).await;
}

async fn poisoned_items_are_dead_lettered_then_replayed_after_a_model_fix(backend: Backend) {
    let env = TestEnv::new("replay");
    let manifest = job(
        &env,
        250,
        &[10, 1300],
        &[],
        "poison.pt",
        "isolate_poison_rows = false",
    );
    replace_in(&manifest, "[output]\n", "[output]\nmerge = true\n");
    let mut workers = env.workers(backend, &[&[], &[]]).await;
    let (job_id, report) = env.run_on(&workers, &manifest).await;
    assert_eq!(report.status, "completed_with_failures");
    assert_eq!((report.items_total, report.items_failed), (8, 2));
    // No merged output while items are missing: it would pass for complete.
    let merged = env.path().join("out/_merged/predictions.csv");
    assert!(report.merged.is_none() && !merged.exists());

    // INV-DLQ: the dead items are exactly the poisoned ones (rows 10 and 1300 → items 0 and 5).
    let dead_items = env.dead_on(&workers, &job_id, Filter::default()).await;
    let mut seqs: Vec<u32> = dead_items.iter().filter_map(|d| d.item).collect();
    seqs.sort();
    assert_eq!(seqs, vec![0, 5]);
    assert!(
        dead_items
            .iter()
            .all(|d| d.class == "poison" && d.error.contains("poison sentinel")),
        "{dead_items:?}"
    );
    let timeouts = Filter {
        class: Some("timeout".into()),
        ..Filter::default()
    };
    assert!(
        env.dead_on(&workers, &job_id, timeouts).await.is_empty(),
        "class filter applies"
    );

    // Fix the model in place (same path, new content) and replay with the new digest.
    std::fs::copy(env.path().join("model.pt"), env.path().join("poison.pt")).expect("swap model");
    let report = env.replay_on(&workers, &job_id, true).await;
    assert_eq!(report.status, "completed");
    assert_eq!(
        (
            report.items_completed,
            report.items_failed,
            report.rows_predicted
        ),
        (8, 0, 2000)
    );
    // Completed by the replay: now the merged output is written, every row once.
    assert_eq!(report.merged.as_deref(), Some(merged.as_path()));
    let rows = std::fs::read_to_string(&merged)
        .expect("merged")
        .lines()
        .count();
    assert_eq!(rows, 2001, "header and 2000 rows");
    assert!(env.path().join("out/_SUCCESS").exists());
    assert_outputs(&env, &[]);
    let left = env.dead_on(&workers, &job_id, Filter::default()).await;
    assert!(left.is_empty(), "{left:?}");
    if backend == Backend::Fleet {
        assert_eq!(env.work_queue().await.map(|(ready, _)| ready), Some(0));
    }
    workers.stop();
    env.cleanup(&[&job_id]).await;
}

async fn transient_failures_are_retried_later_until_the_item_succeeds(backend: Backend) {
    let env = TestEnv::new("flaky");
    let manifest = job(
        &env,
        500,
        &[],
        &[],
        "flaky.pt",
        "transient_errors = [\"flaky backend\"]\nretry_delay = \"300ms\"\nmax_attempts = 3",
    );
    let mut workers = env.workers(backend, &[&[]]).await;
    let (job_id, report) = env.run_on(&workers, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!((report.items_completed, report.items_failed), (4, 0));
    assert_outputs(&env, &[]);
    // The model fails its first two calls: two deliveries failed and came
    // back (through a retry tier) as attempt 2.
    assert_eq!(report.deliveries, 6, "{report:?}");
    assert!(env
        .dead_on(&workers, &job_id, Filter::default())
        .await
        .is_empty());
    if let Some(w) = workers.procs.first() {
        let log = w.log_text();
        assert!(
            log.contains("retrying later") && log.contains("next_attempt=2"),
            "{log}"
        );
    }
    workers.stop();
    env.cleanup(&[&job_id]).await;
}

async fn a_hung_item_times_out_is_dead_lettered_and_the_rest_completes(backend: Backend) {
    let env = TestEnv::new("hang");
    let manifest = job(
        &env,
        500,
        &[],
        &[1234],
        "hang.pt",
        "item_timeout = \"1s\"\nmax_attempts = 2\nretry_delay = \"100ms\"",
    );
    let mut workers = env.workers(backend, &[&[]]).await;
    // No speculative copy of the hung item: on a loaded machine the other
    // items can all finish while it hangs, and the supervisor would then
    // rightly copy a first attempt older than `speculate_min` (the harness's
    // 500 ms), adding deliveries this test counts.
    let mut cfg = env.run_config();
    cfg.supervise.speculate_min = Duration::from_secs(60);
    let (job_id, report) = env.run_on_with(&workers, &manifest, &cfg).await;
    assert_eq!(report.status, "completed_with_failures");
    assert_eq!((report.items_completed, report.items_failed), (3, 1));
    let f = &report.failed_items[0];
    assert_eq!(
        (f.seq, f.class.as_str(), f.attempt),
        (2, "timeout", 2),
        "{f:?}"
    );
    let item = crate::support::item_ids(&manifest, 2);
    assert!(item.contains(&id(1234)) && (450..=550).contains(&item.len()));
    assert_outputs(&env, &item);
    let dead = env.dead_on(&workers, &job_id, Filter::default()).await;
    assert_eq!((dead.len(), dead[0].class.as_str()), (1, "timeout"));
    // Waiting behind the hung call is not model time: the other items
    // committed on their first delivery, the hung one took two.
    assert_eq!(report.deliveries, 5, "{report:?}");
    if backend == Backend::Fleet {
        // The worker stayed healthy: still consuming, and drains cleanly.
        assert_eq!(
            env.work_queue().await.map(|(_, consumers)| consumers),
            Some(1),
            "{}",
            workers.procs[0].log_text()
        );
    }
    workers.stop();
    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_retries_the_mini_batch_at_half_size() {
    let env = TestEnv::new("oom");
    // Mini-batches of 64 rows; the model "runs out of memory" above 16 rows.
    let manifest = job(&env, 500, &[], &[], "oom.pt", "");
    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let (job_id, report) = run(&env, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!(
        (
            report.rows_predicted,
            report.rows_rejected,
            report.items_failed
        ),
        (2000, 0, 0)
    );
    assert_outputs(&env, &[]);
    assert!(
        workers[0]
            .log_text()
            .contains("out of memory; retrying the mini-batch in halves"),
        "{}",
        workers[0].log_text()
    );
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

/// `inference_batch_size = "auto"`: the worker's search never grows past a
/// size that ran out of memory (the model fails above 16 rows: it settles
/// on 16), and on a model with no limit it settles on a size its calls can
/// fill; every row is predicted either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_batches_settle_below_out_of_memory_and_within_the_calls() {
    let env = TestEnv::new("auto-batch");
    let auto = |model: &str, item_rows: u64| {
        let manifest = job(&env, item_rows, &[], &[], model, "");
        let text = std::fs::read_to_string(&manifest).expect("manifest");
        let text = text.replace(
            "inference_batch_size = 64",
            "inference_batch_size = \"auto\"",
        );
        assert!(text.contains("\"auto\""), "{text}");
        std::fs::write(&manifest, text).expect("manifest");
        manifest
    };
    let settled = |log: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains("settled"))
            .map(str::to_owned)
            .collect()
    };
    // Out of memory above 16 rows: the first call (32 rows) halves, and 16
    // is the size from then on.
    let manifest = auto("oom.pt", 500);
    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let (job_id, report) = run(&env, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!((report.rows_predicted, report.rows_rejected), (2000, 0));
    assert_outputs(&env, &[]);
    let log = workers[0].log_text();
    let lines = settled(&log);
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains("size=16") && lines[0].contains("out of memory"),
        "{}",
        lines[0]
    );
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;

    // No limit, items of 200 rows: it grows while faster, and never past
    // what a call of 200 rows fills.
    let env = TestEnv::new("auto-batch-grow");
    let manifest = {
        let gen = JobGen {
            rows: 4_000,
            files: 2,
            features: 8,
            hidden: 16,
            name: batchfleet_testkit::services::unique("auto"),
            pool: env.pool.clone(),
            item_rows: 200,
            batch_size: 64,
            ..JobGen::default()
        };
        make_job(env.path(), &gen).expect("generate job");
        let manifest = env.path().join("job.toml");
        let text = std::fs::read_to_string(&manifest)
            .expect("manifest")
            .replace(
                "inference_batch_size = 64",
                "inference_batch_size = \"auto\"",
            );
        std::fs::write(&manifest, text).expect("manifest");
        manifest
    };
    let mut workers = vec![env.spawn_worker("w1", &["--prefetch", "1", "--prefetch-max", "1"])];
    env.wait_for_consumers(1, &mut workers).await;
    let (job_id, report) = run(&env, &manifest).await;
    assert_eq!(report.status, "completed");
    assert_eq!(report.rows_predicted, 4000);
    crate::support::matches_golden(&env, 4000);
    let log = workers[0].log_text();
    let lines = settled(&log);
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        ["size=32 ", "size=64 ", "size=128 "]
            .iter()
            .any(|s| lines[0].contains(s)),
        "{}",
        lines[0]
    );
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn item_timeout_counts_model_time_not_waiting_for_a_turn() {
    let env = TestEnv::new("turns");
    // Four items of 500 rows = 8 mini-batches of 50 ms each: 400 ms of model
    // time per item, but all four are held at once and take turns at one
    // runner, so the last commits about 1.6 s after it started — past the
    // 1 s item_timeout, which counts model time only.
    let manifest = job(
        &env,
        500,
        &[],
        &[],
        "model.pt",
        "item_timeout = \"1s\"\nmax_attempts = 1",
    );
    let mut workers =
        vec![env.spawn_worker("w1", &["--prefetch", "4", "--debug-batch-delay", "50ms"])];
    env.wait_for_consumers(1, &mut workers).await;
    let (job_id, report) = run(&env, &manifest).await;
    let log = workers[0].log_text();
    assert_eq!(report.status, "completed", "{log}");
    assert_eq!((report.items_completed, report.items_failed), (4, 0));
    assert_outputs(&env, &[]);
    let store = env.connections().store().await.expect("redis");
    let stats = store.item_stats(&job_id).await.expect("stats");
    // They really were held together: the last one took longer than the timeout.
    assert!(stats.iter().all(|s| s.attempt == 1), "{stats:?}");
    let slowest = stats.iter().map(|s| s.latency_ms()).max();
    assert!(slowest > Some(1_000), "{stats:?}\n{log}");
    assert!(!log.contains("abandoned"), "{log}");
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_whose_paths_leave_the_roots_are_rejected_and_their_items_given_up_after_bounded_copies(
) {
    let env = TestEnv::new("roots");
    // The coordinator accepts the job (everything is under the manifest's
    // folder), but this worker's only root is the data folder: the model and
    // the output folder are outside it, so it refuses every message.
    let manifest = job(&env, 500, &[], &[], "model.pt", "max_attempts = 3");
    let data = env.path().join("data");
    let mut workers = vec![env.spawn_worker("w1", &["--data-root", data.to_str().expect("utf-8")])];
    env.wait_for_consumers(1, &mut workers).await;
    let mut cfg = env.run_config();
    cfg.supervise.orphan_grace = Duration::from_millis(500);
    let (job_id, report) =
        crate::support::run_with_config_to_end(&cfg, &manifest, Duration::from_secs(180)).await;
    // Each item: refused (no item state touched), so nowhere to be found;
    // published again up to MAX_COPIES times, then given up as `infra`.
    assert_eq!((report.items_completed, report.items_failed), (0, 4));
    for f in &report.failed_items {
        assert_eq!(f.class, "infra", "{f:?}");
        assert!(f.reason.contains("published again 5 times"), "{f:?}");
    }
    let store = env.connections().store().await.expect("redis");
    let copies = store.copies(&job_id).await.expect("copies");
    assert_eq!(
        copies.values().copied().collect::<Vec<_>>(),
        vec![batchfleet_coordinator::MAX_COPIES; 4],
        "copies are bounded"
    );
    let dead = dead(&env, &job_id).await;
    assert_eq!(
        dead.len() as u64,
        4 * (1 + batchfleet_coordinator::MAX_COPIES),
        "every copy was refused, once"
    );
    for d in &dead {
        assert_eq!(d.class.as_str(), "rejected", "{d:?}");
        assert!(
            d.error.contains("refusing the item's model")
                && d.error.contains("model.pt: is outside the data roots")
                && d.error.contains(&format!(
                    "this worker's data roots: {}",
                    std::fs::canonicalize(&data).expect("data").display()
                )),
            "{d:?}"
        );
    }
    let parts = std::fs::read_dir(env.path().join("out"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("part-"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(parts, 0, "nothing written outside the roots");
    assert_eq!(
        store.work(&job_id).await.expect("work").0,
        0,
        "no item was ever started"
    );
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exceeding_the_error_budget_fails_the_job_and_skips_the_rest() {
    let env = TestEnv::new("budget");
    // 20 items of 100 rows; items 0, 1 and 2 are poisoned; each call takes ~150 ms.
    let manifest = job(
        &env,
        100,
        &[0, 100, 200],
        &[],
        "slow.pt",
        "isolate_poison_rows = false\nmax_failed_items = 1",
    );
    let mut workers =
        vec![env.spawn_worker("w1", &["--prefetch", "1", "--debug-retired-grace", "1s"])];
    env.wait_for_consumers(1, &mut workers).await;
    let (job_id, report) = run(&env, &manifest).await;
    assert_eq!(report.status, "failed");
    assert_eq!(report.failed_class.as_deref(), Some("budget"));
    assert!(
        report.failed_reason.as_deref().is_some_and(
            |r| r.contains("error budget exceeded") && r.contains("max_failed_items = 1")
        ),
        "{report:?}"
    );
    assert!(report.items_failed >= 2, "{report:?}");
    assert_eq!(
        report.items_completed + report.items_failed + report.items_skipped,
        20
    );
    assert!(
        report.items_skipped > 0,
        "remaining items are skipped: {report:?}"
    );
    assert!(!env.path().join("out/_SUCCESS").exists());
    // What was left in the job's queue went with the job (purged); what
    // the worker had taken already is acked without being computed.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while env.work_queue().await.map(|(ready, _)| ready) != Some(0) {
        assert!(std::time::Instant::now() < deadline, "queue never drained");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The queue itself is deleted by the worker once the pool has no
    // active job and the (here 1 s) grace has passed.
    let broker = env.broker().await;
    let queue = batchfleet_shared::broker::PoolQueues::new(&env.pool).job(&job_id);
    crate::containment::until(
        "the ended job's queue deleted",
        Duration::from_secs(30),
        || async { broker.ready_count(&queue).await.ok() == Some(None) },
    )
    .await;
    broker.close("bye").await;
    stop_all(&mut workers);
    let store = env.connections().store().await.expect("redis");
    let p = store.progress(&job_id).await.expect("progress");
    let parts = std::fs::read_dir(env.path().join("out"))
        .expect("out")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("part-"))
        .count() as u64;
    assert_eq!(parts, p.items_done, "skipped items wrote nothing");
    assert!(
        p.items_done + p.items_failed < 20,
        "some items were skipped, not computed"
    );
    env.cleanup(&[&job_id]).await;
}

#[tokio::test]
async fn a_worker_with_wrong_credentials_fails_fast_without_leaking_them() {
    let env = TestEnv::new("creds");
    let started = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_batchfleet-worker"))
        .args([
            "--pool",
            &env.pool,
            "--outage-timeout",
            "60s",
            "--data-root",
        ])
        .arg(env.path())
        .env(
            "BATCHFLEET_AMQP_URL",
            "amqp://guest:not-the-password-42@127.0.0.1:5672/%2f",
        )
        .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
        .output()
        .expect("run worker");
    // Final: a restart cannot mend wrong credentials.
    assert_eq!(
        out.status.code(),
        Some(i32::from(batchfleet_worker::EXIT_CONFIG))
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "gave up at once instead of retrying for 60s"
    );
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!all.contains("not-the-password-42"), "{all}");
    assert!(all.contains("refused the login"), "{all}");
}

#[tokio::test]
async fn the_broker_dead_letters_an_item_that_keeps_coming_back_unsettled() {
    let env = TestEnv::new("deliverylimit");
    let broker = env.broker().await;
    let queues = batchfleet_shared::broker::PoolQueues::new(&env.pool);
    broker.declare(&queues).await.expect("topology");
    let body = batchfleet_shared::message::Envelope::V2(
        batchfleet_coordinator::planner::sample_item("crashy-job", 7),
    )
    .encode();
    let msg = batchfleet_shared::broker::Outgoing {
        message_id: "crashy-job/7".into(),
        kind: "test",
        body,
        headers: Default::default(),
        expiration_ms: None,
    };
    broker
        .publish(&queues.work(), vec![msg], 1)
        .await
        .expect("publish");
    // Each get + requeue is what a worker dying mid-item looks like to the broker.
    let mut deliveries = 0;
    while let Some(m) = broker.get(&queues.work()).await.expect("get") {
        deliveries += 1;
        m.requeue().await.expect("nack");
        assert!(deliveries <= 100, "the delivery limit never tripped");
    }
    assert_eq!(
        deliveries,
        batchfleet_shared::broker::DELIVERY_LIMIT as usize + 1
    );
    // Dead-lettering happens after the last return, asynchronously: wait for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let dead = loop {
        let dead = dlq::list(&*broker, &env.pool, &Filter::default())
            .await
            .expect("list");
        if !dead.is_empty() || std::time::Instant::now() > deadline {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].job.as_str(), dead[0].item, dead[0].class.as_str()),
        ("crashy-job", Some(7), "infra")
    );
    assert!(
        dead[0].error.contains("workers crashed or were killed"),
        "{:?}",
        dead[0]
    );
    broker.close("bye").await;
    env.cleanup(&[]).await;
}

/// A model that does not return in time on any input does not hang
/// validation: the call tried on two sample rows is given up at the job's
/// `item_timeout` (2 s here; the model spins about 20 s per call), and the
/// manifest stands — workers decide under their own timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_never_returns_does_not_hang_validation() {
    let env = TestEnv::new("stuck-probe");
    let manifest = job(&env, 1_000, &[], &[], "stuck.pt", "item_timeout = \"2s\"");
    let roots = [env.path().to_owned()];
    let started = std::time::Instant::now();
    let spec = batchfleet_coordinator::manifest::load(&manifest, &roots).expect("valid");
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(15),
        "validation waited {waited:?} for a model that spins about 20 s"
    );
    assert!(spec.task.model.path.ends_with("stuck.pt"));
}

/// Issue: validation ran the model in the coordinator's own process, so a
/// model that takes all the memory on two rows took it from the
/// coordinator. Now the call runs in a child process with a memory limit:
/// `hungry.pt` takes 2.5 GiB on exactly the two sample rows, over the
/// default limit for its small file (2 GiB plus four times the file), and
/// the job is refused naming the limit and how to raise it; with the limit
/// raised, the same manifest is valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_over_the_memory_limit_at_validation_is_refused_and_the_limit_can_be_raised() {
    use batchfleet_coordinator::manifest::{load_trying, ModelTrial};
    let env = TestEnv::new("hungry-probe");
    let manifest = job(&env, 1_000, &[], &[], "hungry.pt", "");
    let roots = [env.path().to_owned()];
    let err = load_trying(&manifest, &roots, &[], ModelTrial::default())
        .expect_err("over the default limit")
        .to_string();
    assert!(
        err.contains("[model] path") && err.contains("MiB of memory on two sample rows"),
        "{err}"
    );
    assert!(err.contains("--validate-memory"), "{err}");
    let raised = ModelTrial::Child {
        memory: Some(6 << 30),
    };
    let spec = load_trying(&manifest, &roots, &[], raised).expect("valid with 6 GiB");
    assert!(spec.task.model.path.ends_with("hungry.pt"));
}

/// Issue: `supervise`, `wait` and `cancel` loaded each job's model in
/// their own process to validate its manifest again, so one model that
/// crashes libtorch took down the supervision of every job. The trial now
/// runs in a child process, and only for a new job: `run` refuses a model
/// that kills that process (exit 2, the signal named, nothing published),
/// while a `wait` in which any trial would crash the same way still
/// reduces an already running job and runs its `[on_complete]` command,
/// which it skips when the manifest cannot be validated again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_crashes_its_trial_is_refused_by_run_and_never_tried_by_wait() {
    use batchfleet_coordinator::manifest::DEBUG_TRY_MODEL_ENV as CRASH;
    let env = TestEnv::new("crash-probe");
    let manifest = job(&env, 500, &[], &[], "model.pt", "");
    let mut text = std::fs::read_to_string(&manifest).expect("manifest");
    text.push_str(
        "\n[on_complete]\ncommand = [\"sh\", \"-c\", \"echo $BATCHFLEET_JOB_ID >> hooks.log\"]\n",
    );
    std::fs::write(&manifest, text).expect("manifest");
    let path = manifest.to_str().expect("utf8");

    let refused = crate::jobs::coordinator(&env)
        .args(["run", path, "--detach", "--json"])
        .env(CRASH, "abort")
        .output()
        .expect("run");
    // With --json the error is the JSON object on stdout.
    let said = String::from_utf8_lossy(&refused.stdout);
    assert_eq!(refused.status.code(), Some(2), "{said}");
    assert!(
        said.contains("killed the process that tried it") && said.contains("SIGABRT"),
        "{said}"
    );
    assert!(!env.path().join("out").exists(), "nothing ran: {said}");

    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let detached = crate::jobs::run_detached(&env, &manifest);
    let id = detached["job_id"].as_str().expect("job id").to_owned();
    let waited = crate::jobs::coordinator(&env)
        .args(["wait", &id, "--json"])
        .env(CRASH, "abort")
        .output()
        .expect("wait");
    let stderr = String::from_utf8_lossy(&waited.stderr);
    assert_eq!(waited.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&waited.stdout).expect("JSON");
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["report"]["rows_predicted"], 2_000, "{v}");
    let hooks = std::fs::read_to_string(env.path().join("hooks.log"))
        .unwrap_or_else(|e| panic!("the command hook did not run ({e}): {stderr}"));
    assert_eq!(hooks.trim(), id);
    stop_all(&mut workers);
    env.cleanup(&[&id]).await;
}

/// A file system of its own (an ext4 image on a loop device) mounted at
/// `at`, which `fsfreeze` can freeze: every write to it then blocks in the
/// kernel until it is thawed, as a write to a hung network mount does.
/// Dropped: thawed and unmounted, whatever the test did.
struct FreezableFs {
    at: PathBuf,
    frozen: bool,
}

impl FreezableFs {
    /// `None` where this process may not mount one (not root, or a
    /// container without loop devices), saying why.
    fn mount(at: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        if std::fs::metadata("/proc/self").map(|m| m.uid()).ok() != Some(0) {
            eprintln!("skipped: mounting a file system to freeze needs root");
            return None;
        }
        let image = at.with_extension("img");
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(64 << 20))
            .expect("image");
        std::fs::create_dir_all(at).expect("mount point");
        sh("mkfs.ext4", &["-q".as_ref(), image.as_os_str()]);
        let mounted = std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(at)
            .output()
            .expect("mount");
        if !mounted.status.success() {
            eprintln!(
                "skipped: no loop device to mount a file system on here ({})",
                String::from_utf8_lossy(&mounted.stderr).trim()
            );
            return None;
        }
        Some(Self {
            at: at.to_owned(),
            frozen: false,
        })
    }

    fn freeze(&mut self, frozen: bool) {
        let how = if frozen { "--freeze" } else { "--unfreeze" };
        sh("fsfreeze", &[how.as_ref(), self.at.as_os_str()]);
        self.frozen = frozen;
    }
}

impl Drop for FreezableFs {
    fn drop(&mut self) {
        if self.frozen {
            let _ = std::process::Command::new("fsfreeze")
                .arg("--unfreeze")
                .arg(&self.at)
                .status();
        }
        // Lazily: a worker still stopping may hold a file open there.
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.at)
            .status();
    }
}

fn sh(program: &str, args: &[&std::ffi::OsStr]) {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue: `item_timeout` bounded only the model call, so a write that never
/// returns (an output folder on a hung network mount) held its item, and a
/// slot of the worker, for good. Here the output folder is on a file system
/// of its own, frozen once the job is published and before any worker
/// starts: every item's write blocks in the kernel. Each fails at its 1 s
/// `item_timeout` as `timeout`, naming the write, and is retried; once the
/// file system is thawed, the retries (and the late writes, which publish
/// the same part files a speculative copy would) complete the job with
/// every row exactly once, and the worker stops when told to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_never_returns_times_out_and_the_item_is_retried() {
    use crate::containment::{start_waiting, summary, until};
    let env = TestEnv::new("stalled-write");
    let Some(mut fs) = FreezableFs::mount(&env.path().join("outfs")) else {
        return;
    };
    let manifest = job(
        &env,
        500,
        &[],
        &[],
        "model.pt",
        "item_timeout = \"1s\"\nmax_attempts = 8\nretry_delay = \"300ms\"",
    );
    replace_in(&manifest, "dir = \"out\"", "dir = \"outfs/out\"");
    let mut cfg = env.run_config();
    cfg.supervise.speculate_min = Duration::from_secs(60);
    let waiting = start_waiting(&env, &cfg, &manifest, 4).await;
    fs.freeze(true);
    let mut workers = vec![env.spawn_worker("w1", &[])];
    until(
        "a write given up at item_timeout",
        Duration::from_secs(60),
        || async {
            workers[0]
                .log_text()
                .contains("writing the item's output did not finish within item_timeout (1s)")
        },
    )
    .await;
    fs.freeze(false);
    let report = summary(waiting.run, Duration::from_secs(120)).await;
    let log = workers[0].log_text();
    assert_eq!(report.status, "completed", "{report:?}\n{log}");
    assert_eq!(
        (report.rows_predicted, report.items_failed),
        (2000, 0),
        "{report:?}"
    );
    assert!(report.deliveries > 4, "a write was retried: {report:?}");
    let out = env.path().join("outfs/out");
    let v = verify(&out, &env.path().join("golden.csv"), 1e-5).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    assert!(
        !log.contains("the model call did not finish"),
        "only the write stalled:\n{log}"
    );
    stop_all(&mut workers);
    env.cleanup(&[&waiting.id]).await;
}
