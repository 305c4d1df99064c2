//! Text input end to end: a corpus tokenized in the worker by a Hugging
//! Face `tokenizer.json` and embedded by a scripted TransformerEncoder
//! taking `(input_ids, attention_mask)`, checked row by row against PyTorch
//! (Python's tokenizer, the same padding) in every input and output format,
//! on worker processes and in one process; the ids against Python's.

use crate::support::{Backend, TestEnv};
use batchfleet_testkit::python::{make_text_job, TextGen};
use batchfleet_testkit::verify::verify;
use std::path::Path;

const ROWS: u32 = 1_500;

fn manifest(env: &TestEnv, format: &str, out_format: &str, extra_model: &str) -> String {
    format!(
        r#"[job]
name = "{name}"
pool = "{pool}"

[input]
format = "{format}"
paths = ["corpus.{format}"]
id_column = "id"
text_column = "text"

[model]
path = "encoder.pt"
tokenizer = "tokenizer.json"
max_length = 128
{extra_model}

[batching]
item_rows = 400
inference_batch_size = 32

[output]
dir = "out-{format}"
format = "{out_format}"
"#,
        name = batchfleet_testkit::services::unique("text"),
        pool = env.pool,
    )
}

/// The text job of `ROWS` rows (corpus, tokenizer, encoder, expected
/// embeddings) in `env`'s folder.
fn text_job(env: &TestEnv) {
    make_text_job(
        env.path(),
        &TextGen {
            rows: ROWS,
            ..TextGen::default()
        },
    )
    .expect("generate text job");
}

fn write(env: &TestEnv, file: &str, text: &str) -> std::path::PathBuf {
    let path = env.path().join(file);
    std::fs::write(&path, text).expect("write manifest");
    path
}

/// Every row's embedding equals PyTorch's within 1e-4, each row once.
fn matches_pytorch(env: &TestEnv, out: &Path, rows: usize) {
    let v = verify(out, &env.path().join("expected.csv"), 1e-4).expect("verify");
    assert!(v.ok(), "{}", v.describe());
    assert_eq!(v.output_rows, rows);
}

async fn text_jobs_match_pytorch_in_every_format(backend: Backend) {
    let env = TestEnv::new("text");
    text_job(&env);
    let workers = env.workers(backend, &[&[], &[]]).await;
    let mut jobs = Vec::new();
    for (format, out_format, extra) in [
        ("csv", "csv", ""),
        ("jsonl", "jsonl", "pad_to_multiple_of = 8"),
        ("parquet", "parquet", ""),
    ] {
        // JSON Lines with a token budget too: mini-batches of many short
        // rows and few long ones, the same embeddings.
        let mut text = manifest(&env, format, out_format, extra);
        if format == "jsonl" {
            text = text.replace(
                "inference_batch_size = 32\n",
                "inference_batch_size = 32\nmax_batch_tokens = 600\n",
            );
        }
        let path = write(&env, &format!("{format}.toml"), &text);
        let (job, summary) = env.run_on(&workers, &path).await;
        assert_eq!(summary.status, "completed", "{format}: {summary:?}");
        assert_eq!(
            (summary.rows_predicted, summary.rows_rejected),
            (u64::from(ROWS), 0),
            "{format}"
        );
        matches_pytorch(
            &env,
            &env.path().join(format!("out-{format}")),
            ROWS as usize,
        );
        jobs.push(job);
    }
    let mut workers = workers;
    workers.stop();
    env.cleanup(&jobs.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
}

crate::on_both_backends!(
    text_jobs_match_pytorch_in_every_format,
    a_dict_model_writes_the_selected_outputs
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_token_ids_equal_pythons_for_every_row() {
    let env = TestEnv::new("text-ids");
    make_text_job(
        env.path(),
        &TextGen {
            rows: 3_000,
            format: "jsonl".into(),
            no_expected: true,
            ..TextGen::default()
        },
    )
    .expect("generate text job");
    let encoder =
        batchfleet_shared::text::TextEncoder::load(&env.path().join("tokenizer.json"), Some(128))
            .expect("tokenizer loads");
    let corpus = std::fs::read_to_string(env.path().join("corpus.jsonl")).expect("corpus");
    let expected = std::fs::read_to_string(env.path().join("expected_ids.jsonl")).expect("ids");
    let (mut rows, mut non_ascii, mut truncated) = (0, 0, 0);
    for (line, want) in corpus.lines().zip(expected.lines()) {
        let record: serde_json::Value = serde_json::from_str(line).expect("corpus line");
        let want: serde_json::Value = serde_json::from_str(want).expect("ids line");
        assert_eq!(record["id"], want["id"]);
        let text = record["text"].as_str().expect("text");
        let want: Vec<i64> = want["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_i64().expect("id"))
            .collect();
        let mut got = Vec::new();
        encoder.encode_into(text, &mut got).expect("encodes");
        assert_eq!(got, want, "row {rows}: {text:?}");
        rows += 1;
        non_ascii += usize::from(!text.is_ascii());
        truncated += usize::from(got.len() == 128);
    }
    assert_eq!(rows, 3_000);
    assert!(
        non_ascii > 50 && truncated > 10,
        "the corpus exercises non-ASCII text ({non_ascii}) and truncation ({truncated})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_text_rows_are_rejected_with_their_lines_and_the_rest_predicted() {
    let env = TestEnv::new("text-bad");
    make_text_job(
        env.path(),
        &TextGen {
            rows: 300,
            format: "jsonl".into(),
            ..TextGen::default()
        },
    )
    .expect("generate text job");
    // Three bad records after the 300 good ones: the text missing, a number, null.
    let corpus = env.path().join("corpus.jsonl");
    let mut text = std::fs::read_to_string(&corpus).expect("corpus");
    text.push_str("{\"id\": \"bad-missing\", \"body\": \"no text key\"}\n");
    text.push_str("{\"id\": \"bad-number\", \"text\": 42}\n");
    text.push_str("{\"id\": \"bad-null\", \"text\": null}\n");
    std::fs::write(&corpus, text).expect("corpus");
    let path = write(&env, "job.toml", &manifest(&env, "jsonl", "csv", ""));
    let mut workers = env.workers(Backend::Fleet, &[&[]]).await;
    let (job, summary) = env.run_on(&workers, &path).await;
    assert_eq!(summary.status, "completed", "{summary:?}");
    assert_eq!((summary.rows_predicted, summary.rows_rejected), (300, 3));
    matches_pytorch(&env, &env.path().join("out-jsonl"), 300);
    let mut rejects = crate::support::rejects(&env.path().join("out-jsonl"));
    rejects.sort_by_key(|r| r["line"].as_u64());
    let seen: Vec<(u64, String)> = rejects
        .iter()
        .map(|r| {
            (
                r["line"].as_u64().expect("line"),
                r["reason"].as_str().expect("reason").to_owned(),
            )
        })
        .collect();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(
        seen.iter().map(|s| s.0).collect::<Vec<_>>(),
        [301, 302, 303]
    );
    assert!(seen[0].1.contains("no key \"text\""), "{seen:?}");
    assert!(seen[1].1.contains("not a string: 42"), "{seen:?}");
    assert!(seen[2].1.contains("not a string: null"), "{seen:?}");
    workers.stop();
    env.cleanup(&[&job]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_that_does_not_load_is_refused_at_validation() {
    let env = TestEnv::new("text-badtok");
    make_text_job(
        env.path(),
        &TextGen {
            rows: 50,
            format: "csv".into(),
            no_expected: true,
            ..TextGen::default()
        },
    )
    .expect("generate text job");
    std::fs::write(
        env.path().join("broken.json"),
        "{\"model\": {\"type\": \"Nope\"}}",
    )
    .expect("write");
    let text = manifest(&env, "csv", "csv", "").replace("tokenizer.json", "broken.json");
    let path = write(&env, "job.toml", &text);
    let roots = [env.path().to_owned()];
    let err = batchfleet_coordinator::manifest::load(&path, &roots)
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("[model] tokenizer:")
            && err.contains("broken.json")
            && err.contains("is not a Hugging Face tokenizer.json"),
        "{err}"
    );
    // Without a tokenizer the text column is refused, naming what to add.
    let text = manifest(&env, "csv", "csv", "").replace("tokenizer = \"tokenizer.json\"\n", "");
    let err = batchfleet_coordinator::manifest::load(&write(&env, "job2.toml", &text), &roots)
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("[input] text_column:") && err.contains("needs [model] tokenizer"),
        "{err}"
    );
}

/// Writes `dst` from PyTorch's output `src` (`id,score_0…`): the columns
/// renamed `<prefix>_<i>`, each row L2-normalised when `normalize`; returns
/// the mean norm of the rows before normalising.
fn golden(env: &TestEnv, src: &str, dst: &str, prefix: &str, normalize: bool) -> f64 {
    let text = std::fs::read_to_string(env.path().join(src)).expect("expected output");
    let mut lines = text.lines();
    let width = lines.next().expect("header").split(',').count() - 1;
    let mut out = String::from("id");
    for i in 0..width {
        out.push_str(&format!(",{prefix}_{i}"));
    }
    out.push('\n');
    let (mut norms, mut rows) = (0f64, 0usize);
    for line in lines {
        let mut fields = line.split(',');
        let id = fields.next().expect("id");
        let values: Vec<f64> = fields.map(|v| v.parse().expect("number")).collect();
        let norm = values.iter().map(|v| v * v).sum::<f64>().sqrt();
        norms += norm;
        rows += 1;
        out.push_str(id);
        for v in &values {
            let v = if normalize { v / norm.max(1e-12) } else { *v };
            out.push_str(&format!(",{v}"));
        }
        out.push('\n');
    }
    std::fs::write(env.path().join(dst), out).expect("write golden");
    norms / rows.max(1) as f64
}

fn dict_manifest(env: &TestEnv, out: &str, format: &str, output: &str) -> std::path::PathBuf {
    let text = manifest(env, "jsonl", format, "")
        .replace("dir = \"out-jsonl\"", &format!("dir = \"{out}\"\n{output}"));
    write(env, &format!("{out}.toml"), &text)
}

/// A model returning a dict of tensors (as transformers models do): the
/// selected output is written — the hidden state mean- or CLS-pooled and
/// normalised as one vector column in each format, the logits as columns,
/// several outputs side by side — every row as PyTorch computes it, and
/// the summary holds the vectors' norms. A key the dict does not have, or
/// a `[rows, L, D]` output without pooling, is refused at validation.
async fn a_dict_model_writes_the_selected_outputs(backend: Backend) {
    let env = TestEnv::new("text-dict");
    make_text_job(
        env.path(),
        &TextGen {
            rows: 600,
            format: "jsonl".into(),
            output: "dict".into(),
            ..TextGen::default()
        },
    )
    .expect("generate text job");
    golden(&env, "expected.csv", "mean.csv", "embedding", true);
    let mean_norm = golden(&env, "expected_cls.csv", "cls.csv", "embedding", false);
    golden(&env, "expected_logits.csv", "logits.csv", "score", false);
    let workers = env.workers(backend, &[&[], &[]]).await;
    let mut jobs = Vec::new();
    let vector = "vector = \"embedding\"";
    for (out, format, output, golden, normalized) in [
        (
            "mean-jsonl",
            "jsonl",
            format!("select = \"hidden\"\npooling = \"mean\"\nnormalize = true\n{vector}"),
            "mean.csv",
            true,
        ),
        (
            "mean-parquet",
            "parquet",
            format!("select = \"hidden\"\npooling = \"mean\"\nnormalize = true\n{vector}"),
            "mean.csv",
            true,
        ),
        (
            "cls-csv",
            "csv",
            format!("select = \"hidden\"\npooling = \"cls\"\n{vector}"),
            "cls.csv",
            false,
        ),
        (
            "logits",
            "csv",
            "select = \"logits\"".to_owned(),
            "logits.csv",
            false,
        ),
    ] {
        let path = dict_manifest(&env, out, format, &output);
        let (job, summary) = env.run_on(&workers, &path).await;
        assert_eq!(summary.status, "completed", "{out}: {summary:?}");
        assert_eq!(summary.rows_predicted, 600, "{out}");
        let v = verify(&env.path().join(out), &env.path().join(golden), 1e-4).expect("verify");
        assert!(v.ok(), "{out}: {}", v.describe());
        assert_eq!(v.output_rows, 600, "{out}");
        match summary.vectors {
            Some(s) if output.contains(vector) => {
                assert_eq!((s.dim, s.rows), (32, 600), "{out}");
                let want = if normalized { 1.0 } else { mean_norm };
                assert!(
                    (s.mean_norm - want).abs() < 1e-4 * want,
                    "{out}: {s:?} vs {want}"
                );
                assert!(
                    s.min_norm <= s.mean_norm && s.mean_norm <= s.max_norm,
                    "{s:?}"
                );
            }
            None if !output.contains(vector) => {
                assert!(
                    summary.predictions.is_some(),
                    "{out}: scalar outputs keep histograms"
                )
            }
            other => panic!("{out}: vectors {other:?}"),
        }
        jobs.push(job);
    }
    // A vector column's shape in each format.
    let jsonl =
        std::fs::read_to_string(env.path().join("mean-jsonl/part-000000.jsonl")).expect("part");
    let first: serde_json::Value =
        serde_json::from_str(jsonl.lines().next().expect("a row")).expect("json");
    assert_eq!(
        first["embedding"].as_array().map(Vec::len),
        Some(32),
        "{first}"
    );
    let csv = std::fs::read_to_string(env.path().join("cls-csv/part-000000.csv")).expect("part");
    assert!(
        csv.starts_with("id,embedding_0,embedding_1,"),
        "{}",
        &csv[..60]
    );
    // Two outputs side by side, named by key.
    let path = dict_manifest(&env, "both", "csv", "select = [\"logits\", \"pooled\"]");
    let (job, summary) = env.run_on(&workers, &path).await;
    assert_eq!(summary.status, "completed", "{summary:?}");
    let csv = std::fs::read_to_string(env.path().join("both/part-000000.csv")).expect("part");
    let header = csv.lines().next().expect("header");
    assert!(
        header.starts_with("id,logits_0,logits_1,logits_2,pooled_0,"),
        "{header}"
    );
    assert_eq!(header.split(',').count(), 1 + 3 + 32);
    // The summary's histograms carry the parts' names.
    let names: Vec<&str> = summary
        .predictions
        .as_ref()
        .expect("histograms")
        .columns
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names.len(), 35, "{names:?}");
    assert_eq!(names[..4], ["logits_0", "logits_1", "logits_2", "pooled_0"]);
    jobs.push(job);

    let roots = [env.path().to_owned()];
    let refused = |out: &str, output: &str| {
        let path = dict_manifest(&env, out, "csv", output);
        batchfleet_coordinator::manifest::load(&path, &roots)
            .expect_err("refused at validation")
            .to_string()
    };
    let err = refused("nope", "select = \"nope\"");
    assert!(
        err.contains("[output] select:")
            && err.contains("\"nope\" names no tensor")
            && err.contains("\"pooled\", \"hidden\", \"logits\""),
        "{err}"
    );
    assert!(!env.path().join("nope").exists(), "nothing was written");
    let err = refused("unselected", "");
    assert!(err.contains("set [output] select"), "{err}");
    let err = refused("unpooled", "select = \"hidden\"");
    assert!(
        err.contains("[output] pooling:") && err.contains("a vector per token"),
        "{err}"
    );
    let err = refused("tuple", "select = 1");
    assert!(err.contains("select = 1 names no tensor"), "{err}");
    let mut workers = workers;
    workers.stop();
    env.cleanup(&jobs.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
}

/// `[model] inputs`: a model taking `(input_ids, attention_mask,
/// token_type_ids, numeric)` gets the tokenizer's type ids and two numeric
/// columns beside the text, in every input format, each row as PyTorch
/// computes it. Parameter names that do not match forward's, and the
/// default call on a model of four parameters, are refused at validation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_inputs_feed_token_types_and_numeric_columns_beside_the_text() {
    let env = TestEnv::new("text-typed");
    make_text_job(
        env.path(),
        &TextGen {
            rows: 500,
            output: "typed".into(),
            ..TextGen::default()
        },
    )
    .expect("generate text job");
    let inputs = "inputs = [\"input_ids\", \"attention_mask\", { source = \"token_type_ids\", dtype = \"int64\" }, { name = \"numeric\", source = \"features\", dtype = \"float32\" }]";
    let with = |format: &str, inputs: &str| {
        manifest(&env, format, "csv", inputs).replace(
            "text_column = \"text\"",
            "text_column = \"text\"\nfeature_columns = [\"f0\", \"f1\"]",
        )
    };
    let mut workers = env.workers(Backend::Local, &[&[], &[]]).await;
    let mut jobs = Vec::new();
    for format in ["csv", "jsonl", "parquet"] {
        let path = write(&env, &format!("typed-{format}.toml"), &with(format, inputs));
        let (job, summary) = env.run_on(&workers, &path).await;
        assert_eq!(summary.status, "completed", "{format}: {summary:?}");
        matches_pytorch(&env, &env.path().join(format!("out-{format}")), 500);
        jobs.push(job);
    }
    let roots = [env.path().to_owned()];
    let refused = |name: &str, text: String| {
        batchfleet_coordinator::manifest::load(&write(&env, name, &text), &roots)
            .expect_err("refused at validation")
            .to_string()
    };
    let err = refused(
        "renamed.toml",
        with(
            "csv",
            &inputs.replace("name = \"numeric\"", "name = \"extra\""),
        ),
    );
    assert!(
        err.contains("[model] inputs:")
            && err.contains("input 3 is named \"extra\"")
            && err.contains("forward(input_ids, attention_mask, token_type_ids, numeric)"),
        "{err}"
    );
    let err = refused("default.toml", with("csv", ""));
    assert!(
        err.contains("but this job calls forward(input_ids, attention_mask)"),
        "{err}"
    );
    let err = refused(
        "short.toml",
        with(
            "csv",
            "inputs = [\"input_ids\", \"attention_mask\", \"token_type_ids\"]",
        ),
    );
    assert!(
        err.contains("also needs \"numeric\"") && err.contains("feature_columns"),
        "{err}"
    );
    workers.stop();
    env.cleanup(&jobs.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
}

/// `[model] dtype = "bfloat16"`: the model runs in reduced precision — its
/// outputs differ from float32's (so the setting took effect) but each row
/// points the same way (cosine ≥ 0.99 with PyTorch's float32 embedding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduced_precision_runs_the_model_in_bfloat16() {
    let env = TestEnv::new("text-bf16");
    make_text_job(
        env.path(),
        &TextGen {
            rows: 300,
            format: "csv".into(),
            ..TextGen::default()
        },
    )
    .expect("generate text job");
    let path = write(
        &env,
        "job.toml",
        &manifest(&env, "csv", "csv", "dtype = \"bfloat16\""),
    );
    let mut workers = env.workers(Backend::Local, &[&[]]).await;
    let (job, summary) = env.run_on(&workers, &path).await;
    assert_eq!(summary.status, "completed", "{summary:?}");
    let (max_diff, min_cos) = batchfleet_testkit::verify::agreement(
        &env.path().join("expected.csv"),
        &env.path().join("out-csv"),
    )
    .expect("every row predicted, once");
    assert!(
        max_diff > 1e-4,
        "bfloat16 outputs equal float32's: {max_diff}"
    );
    assert!(min_cos > 0.99, "least cosine {min_cos}");
    workers.stop();
    env.cleanup(&[&job]).await;
}

/// Issue: a tokenizer one worker cannot read (a mount not there yet)
/// failed the whole job, where a model in the same state hands the item
/// back. Here the tokenizer's path is a folder while the only worker takes
/// its first item: the worker notes it cannot run the job (`unable`) and
/// hands the item back; once the file is back, the job completes with
/// every row as PyTorch embeds it and no item failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_unreadable_on_a_worker_hands_the_item_back_and_the_job_completes() {
    use crate::containment::{start_waiting, summary, until};
    use std::time::Duration;
    let env = TestEnv::new("tok-unable");
    text_job(&env);
    let path = write(&env, "csv.toml", &manifest(&env, "csv", "csv", ""));
    // Validated and published (1,500 rows in items of 400) before any
    // worker looks at the tokenizer.
    let waiting = start_waiting(&env, &env.run_config(), &path, 4).await;
    let tokenizer = env.path().join("tokenizer.json");
    let aside = env.path().join("tokenizer.json.aside");
    std::fs::rename(&tokenizer, &aside).expect("move the tokenizer aside");
    std::fs::create_dir(&tokenizer).expect("a folder in its place");
    let mut workers = vec![env.spawn_worker("w1", &["--unable-for", "1s"])];
    let store = env.connections().store().await.expect("redis");
    until(
        "the worker noted it cannot read the tokenizer",
        Duration::from_secs(60),
        || async {
            store
                .unable(&waiting.id)
                .await
                .expect("notes")
                .get("w1")
                .is_some_and(|n| n.class == "unable" && n.reason.contains("cannot read tokenizer"))
        },
    )
    .await;
    std::fs::remove_dir(&tokenizer).expect("folder");
    std::fs::rename(&aside, &tokenizer).expect("the tokenizer back");
    let report = summary(waiting.run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!(report.rows_predicted, u64::from(ROWS), "{report:?}");
    assert_eq!(report.items_failed, 0, "{report:?}");
    matches_pytorch(&env, &env.path().join("out-csv"), ROWS as usize);
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&waiting.id]).await;
}

/// Issue: `item_timeout` bounded only the model call, so a read that never
/// returns (a file on a hung network mount) held its item, and a slot of
/// the worker, for good. Here the tokenizer, which a worker reads as part
/// of reading its first item, is swapped after validation for a FIFO no
/// one writes: opening it blocks in the kernel, as a read from a hung
/// mount does. The item fails at its 2 s `item_timeout` as `timeout`,
/// naming the read; once the file is back its retry completes the job with
/// every row as PyTorch embeds it, and the worker, with threads still
/// stuck in the kernel, stops when told to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_never_returns_times_out_and_the_item_is_retried() {
    use crate::containment::{start_waiting, summary};
    use std::time::{Duration, Instant};
    let env = TestEnv::new("stalled-read");
    text_job(&env);
    let text = manifest(&env, "csv", "csv", "")
        + "\n[failure]\nitem_timeout = \"2s\"\nmax_attempts = 6\nretry_delay = \"1s\"\n";
    let path = write(&env, "csv.toml", &text);
    let waiting = start_waiting(&env, &env.run_config(), &path, 4).await;
    let tokenizer = env.path().join("tokenizer.json");
    let aside = env.path().join("tokenizer.json.aside");
    std::fs::rename(&tokenizer, &aside).expect("move the tokenizer aside");
    let made = std::process::Command::new("mkfifo")
        .arg(&tokenizer)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let mut workers = vec![env.spawn_worker("w1", &[])];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !workers[0]
        .log_text()
        .contains("reading the item's input did not finish within item_timeout (2s)")
    {
        assert!(
            Instant::now() < deadline,
            "no read given up at item_timeout within 60 s:\n{}",
            workers[0].log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The file back (the FIFO under another name: its readers stay stuck).
    std::fs::rename(&tokenizer, env.path().join("tokenizer.fifo")).expect("fifo aside");
    std::fs::rename(&aside, &tokenizer).expect("the tokenizer back");
    let report = summary(waiting.run, Duration::from_secs(120)).await;
    assert_eq!(report.status, "completed", "{report:?}");
    assert_eq!(report.rows_predicted, u64::from(ROWS), "{report:?}");
    assert_eq!(report.items_failed, 0, "{report:?}");
    matches_pytorch(&env, &env.path().join("out-csv"), ROWS as usize);
    let log = workers[0].log_text();
    assert!(
        !log.contains("the model call did not finish"),
        "only the read stalled:\n{log}"
    );
    // Threads still blocked opening the FIFO do not hold the worker's exit.
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&waiting.id]).await;
}
