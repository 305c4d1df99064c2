//! Text input end to end: a corpus tokenized in the worker by a Hugging
//! Face `tokenizer.json` and embedded by a scripted TransformerEncoder
//! taking `(input_ids, attention_mask)`, checked row by row against PyTorch
//! (Python's tokenizer, the same padding) in every input and output format,
//! on worker processes and in one process; the ids against Python's.

use crate::support::{Backend, TestEnv};
use batchfleet_loadtest::python::{make_text_job, TextGen};
use batchfleet_loadtest::verify::verify;
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
        name = batchfleet_loadtest::services::unique("text"),
        pool = env.pool,
    )
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
    make_text_job(
        env.path(),
        &TextGen {
            rows: ROWS,
            ..TextGen::default()
        },
    )
    .expect("generate text job");
    let workers = env.workers(backend, &[&[], &[]]).await;
    let mut jobs = Vec::new();
    for (format, out_format, extra) in [
        ("csv", "csv", ""),
        ("jsonl", "jsonl", "pad_to_multiple_of = 8"),
        ("parquet", "parquet", ""),
    ] {
        let path = write(
            &env,
            &format!("{format}.toml"),
            &manifest(&env, format, out_format, extra),
        );
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

crate::on_both_backends!(text_jobs_match_pytorch_in_every_format);

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
