use batchfleet_shared::broker::PoolQueues;
use batchfleet_shared::endpoint::Endpoint;
use batchfleet_shared::secret::SecretUrl;
use batchfleet_shared::store::Store;
use batchfleet_testkit::python::{make_job, JobGen};
use batchfleet_testkit::services::{ensure_local, unique};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

/// One small generated job (data + real TorchScript model), shared by the tests.
fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        ensure_local().expect("RabbitMQ and Redis available");
        let dir = tempfile::tempdir().expect("temp dir").keep();
        make_job(
            &dir,
            &JobGen {
                rows: 1000,
                files: 2,
                ..JobGen::default()
            },
        )
        .expect("generate job");
        dir
    })
}

struct Case {
    dir: tempfile::TempDir,
    pool: String,
    prefix: String,
}

impl Case {
    /// A manifest in its own folder pointing at the shared data and model,
    /// with a unique pool; `edit` changes its text.
    fn new(edit: impl Fn(String) -> String) -> Self {
        let fx = fixture();
        let dir = tempfile::tempdir().expect("temp dir");
        let pool = unique("cli");
        let text = std::fs::read_to_string(fx.join("job.toml"))
            .expect("job.toml")
            .replace("name = \"demo\"", &format!("name = \"{pool}\""))
            .replace("pool = \"default\"", &format!("pool = \"{pool}\""))
            .replace(
                "\"data/*.csv\"",
                &format!("\"{}/data/*.csv\"", fx.display()),
            )
            .replace(
                "path = \"model.pt\"",
                &format!("path = \"{}/model.pt\"", fx.display()),
            );
        std::fs::write(dir.path().join("job.toml"), edit(text)).expect("write manifest");
        Self {
            dir,
            prefix: unique("bftest-cli"),
            pool,
        }
    }

    fn manifest(&self) -> PathBuf {
        self.dir.path().join("job.toml")
    }

    /// Runs `batchfleet` with the shared fixture and this case's folder as data roots.
    fn run(&self, args: &[&str]) -> Output {
        let roots = format!("{}:{}", fixture().display(), self.dir.path().display());
        self.run_with_roots(args, &roots)
    }

    fn run_with_roots(&self, args: &[&str], roots: &str) -> Output {
        Command::new(env!("CARGO_BIN_EXE_batchfleet"))
            .args(["--redis-prefix", &self.prefix, "--connect-timeout", "5s"])
            .args(args)
            .env_remove("BATCHFLEET_AMQP_URL")
            .env_remove("BATCHFLEET_REDIS_URL")
            .env("BATCHFLEET_DATA_ROOT", roots)
            .output()
            .expect("run batchfleet")
    }

    /// Asserts nothing reached RabbitMQ (no work queue) or Redis (no job).
    async fn assert_nothing_published(&self) {
        let url = Endpoint::amqp(SecretUrl::new("amqp://127.0.0.1:5672/%2f"));
        let conn = batchfleet_shared::broker::connect(&url, "cli-test", Duration::from_secs(5))
            .await
            .expect("amqp");
        let found = conn
            .ready_count(&PoolQueues::new(&self.pool).work())
            .await
            .expect("passive declare");
        assert!(
            found.is_none(),
            "work queue of {} exists: something was published",
            self.pool
        );
        conn.close("bye").await;
        let store = Store::connect(
            &Endpoint::redis(SecretUrl::new("redis://127.0.0.1:6379/")),
            &self.prefix,
            Duration::from_secs(5),
        )
        .await
        .expect("redis");
        assert!(
            store.recent_jobs(10).await.expect("jobs").is_empty(),
            "a job was registered"
        );
        assert!(
            !self.dir.path().join("out").exists(),
            "output folder was created"
        );
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test]
async fn invalid_manifest_exits_2_names_each_problem_and_publishes_nothing() {
    let case = Case::new(|t| {
        t.replace("id_column = \"id\"", "id_column = \"row_id\"")
            .replace("item_rows", "item_row")
    });
    let out = case.run(&["run", case.manifest().to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("job.toml: line") && err.contains("unknown field `item_row`"),
        "{err}"
    );
    assert!(err.contains("nothing was published"), "{err}");
    case.assert_nothing_published().await;

    let case = Case::new(|t| t.replace("id_column = \"id\"", "id_column = \"row_id\""));
    let out = case.run(&["run", case.manifest().to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("[input] id_column: \"row_id\" is not in the header"),
        "{}",
        stderr(&out)
    );
    case.assert_nothing_published().await;
}

#[tokio::test]
async fn a_deadline_already_past_exits_2_and_publishes_nothing() {
    let case =
        Case::new(|t| t.replacen("[job]\n", "[job]\ndeadline = \"2020-01-01T00:00:00Z\"\n", 1));
    let out = case.run(&["run", case.manifest().to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("[job] deadline: 2020-01-01T00:00:00Z is already past"),
        "{err}"
    );
    case.assert_nothing_published().await;
}

#[tokio::test]
async fn hooks_the_operator_does_not_allow_exit_2_and_publish_nothing() {
    // A manifest may not send this process's AWS key to a URL it chooses,
    // nor post the summary in clear.
    let case = Case::new(|t| {
        format!("{t}\n[on_complete]\nwebhook = \"http://hooks.example.com/done\"\nwebhook_token_env = \"AWS_SECRET_ACCESS_KEY\"\n")
    });
    let out = Command::new(env!("CARGO_BIN_EXE_batchfleet"))
        .args([
            "--redis-prefix",
            &case.prefix,
            "--connect-timeout",
            "5s",
            "run",
        ])
        .arg(case.manifest())
        .env("AWS_SECRET_ACCESS_KEY", "not-a-real-key")
        .env(
            "BATCHFLEET_DATA_ROOT",
            format!("{}:{}", fixture().display(), case.dir.path().display()),
        )
        .output()
        .expect("run batchfleet");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("[on_complete] webhook_token_env: AWS_SECRET_ACCESS_KEY is not a variable the operator lets hooks use")
            && err.contains("[on_complete] webhook: http://hooks.example.com is http://")
            && err.contains("--hook-allow-http")
            && !err.contains("not-a-real-key"),
        "{err}"
    );
    case.assert_nothing_published().await;
}

#[tokio::test]
async fn paths_outside_the_data_roots_exit_2_and_publish_nothing() {
    let case = Case::new(|t| t);
    // Only the manifest's folder: the shared data and model are elsewhere.
    let own = case.dir.path().display().to_string();
    let out = case.run_with_roots(&["run", case.manifest().to_str().expect("utf8")], &own);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("[input] paths:")
            && err.contains("part-00.csv: is outside the data roots")
            && err.contains("[model] path:")
            && err.contains("nothing was published"),
        "{err}"
    );
    case.assert_nothing_published().await;
}

#[tokio::test]
async fn missing_model_exits_2_and_publishes_nothing() {
    let case = Case::new(|t| t.replace("/model.pt\"", "/no-such-model.pt\""));
    let out = case.run(&["run", case.manifest().to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("[model] path: cannot open model") && err.contains("no-such-model.pt"),
        "{err}"
    );
    case.assert_nothing_published().await;
}

#[tokio::test]
async fn models_that_are_not_torchscript_are_each_named_exit_2_and_publish_nothing() {
    // Real files from PyTorch: the weights of the fixture's model saved the
    // three ways people mistake for TorchScript.
    static WRONG: OnceLock<()> = OnceLock::new();
    WRONG.get_or_init(|| {
        batchfleet_testkit::python::make_wrong_models(fixture()).expect("wrong models")
    });
    for (file, named) in [
        ("state_dict.pt", "is a state_dict (weights only"),
        (
            "pickled.pt",
            "is a pickled Python module (written by torch.save(model))",
        ),
        ("exported.pt2", "is a torch.export program (.pt2"),
    ] {
        let case = Case::new(|t| t.replace("/model.pt\"", &format!("/{file}\"")));
        let out = case.run(&["run", case.manifest().to_str().expect("utf8")]);
        assert_eq!(out.status.code(), Some(2), "{file}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("[model] path:")
                && err.contains(file)
                && err.contains(named)
                && err.contains("torch.jit.script(model)")
                && err.contains("torch.jit.save"),
            "{file}: {err}"
        );
        case.assert_nothing_published().await;
    }
}

#[tokio::test]
async fn unreachable_broker_exits_1_with_a_hint_and_publishes_nothing() {
    let case = Case::new(|t| t);
    let out = case.run(&[
        "--amqp-url",
        "amqp://127.0.0.1:1/%2f",
        "run",
        case.manifest().to_str().expect("utf8"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("cannot connect to RabbitMQ at amqp://127.0.0.1:1/%2f")
            && err.contains("Is RabbitMQ running?"),
        "{err}"
    );
    case.assert_nothing_published().await;
}

#[tokio::test]
async fn wrong_credentials_fail_without_leaking_the_secret() {
    let case = Case::new(|t| t);
    let out = case.run(&[
        "--amqp-url",
        "amqp://guest:hunter2-secret@127.0.0.1:5672/%2f",
        "run",
        case.manifest().to_str().expect("utf8"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let all = format!("{}{}", stderr(&out), String::from_utf8_lossy(&out.stdout));
    assert!(!all.contains("hunter2-secret"), "secret leaked: {all}");
    assert!(
        all.contains("RabbitMQ at amqp://guest:***@127.0.0.1:5672/%2f refused the login"),
        "{all}"
    );
    case.assert_nothing_published().await;

    let out = case.run(&[
        "--redis-url",
        "redis://:hunter3-secret@127.0.0.1:6379/",
        "run",
        case.manifest().to_str().expect("utf8"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let all = format!("{}{}", stderr(&out), String::from_utf8_lossy(&out.stdout));
    assert!(!all.contains("hunter3-secret"), "secret leaked: {all}");
    assert!(
        all.contains("Redis at redis://:***@127.0.0.1:6379/ refused the login"),
        "{all}"
    );
}

#[tokio::test]
async fn status_of_unknown_job_says_what_ids_look_like() {
    let case = Case::new(|t| t);
    let out = case.run(&["status", "nope-00000000"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no job \"nope-00000000\""),
        "{}",
        stderr(&out)
    );
}

#[tokio::test]
async fn a_signing_key_too_short_or_unreadable_exits_2() {
    let case = Case::new(|t| t);
    let manifest = case.manifest();
    let out = Command::new(env!("CARGO_BIN_EXE_batchfleet"))
        .args(["run", manifest.to_str().expect("utf8")])
        .env("BATCHFLEET_SIGNING_KEY", "short-key")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("use at least 16 random bytes"),
        "{}",
        stderr(&out)
    );
    assert!(
        !stderr(&out).contains("short-key"),
        "the key leaked: {}",
        stderr(&out)
    );
    let out = case.run(&[
        "--signing-key-file",
        "/nonexistent/key",
        "run",
        manifest.to_str().expect("utf8"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("cannot read the signing key file /nonexistent/key"),
        "{}",
        stderr(&out)
    );
    case.assert_nothing_published().await;
}

#[test]
fn help_lists_the_commands_and_env_vars() {
    let out = Command::new(env!("CARGO_BIN_EXE_batchfleet"))
        .arg("--help")
        .output()
        .expect("help");
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "run",
        "status",
        "BATCHFLEET_AMQP_URL",
        "BATCHFLEET_REDIS_URL",
    ] {
        assert!(text.contains(needle), "--help lacks {needle}:\n{text}");
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `batchfleet plan … --json`, parsed.
fn plan(case: &Case, extra: &[&str]) -> serde_json::Value {
    let manifest = case.manifest();
    let mut args = vec!["plan", manifest.to_str().expect("utf8"), "--json"];
    args.extend_from_slice(extra);
    let out = case.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("{e}: {}", stdout(&out)))
}

#[tokio::test]
async fn plan_sample_estimates_the_workers_a_deadline_needs_and_the_cost() {
    let case = Case::new(|t| {
        t.replacen(
            "[job]\n",
            "[job]\ndeadline = \"1h\"\nworker_hour_cost = 3.6\n",
            1,
        )
    });
    let p = plan(&case, &["--sample", "50"]);
    let rate = p["sample"]["rows_per_s_per_core"].as_f64().expect("rate");
    // A new job's duration counts from now.
    let deadline = p["deadline"].as_str().expect("deadline");
    let at = humantime::parse_rfc3339(deadline).expect("RFC 3339");
    let left = at
        .duration_since(std::time::SystemTime::now())
        .expect("ahead");
    assert!(left > Duration::from_secs(3500), "{deadline}");
    // 1000 rows in an hour: one worker of one core, at any rate above 0.3 rows/s.
    assert!(rate > 1.0, "{p}");
    assert_eq!(p["workers_for_deadline"], 1, "{p}");
    // 1000 rows at `rate` per core-second, at 3.6 per hour: 0.001 per second.
    let cost = p["cost_estimate"].as_f64().expect("cost");
    assert!((cost - 1000.0 / rate * 0.001).abs() < 1e-9, "{p}");
    // Without a deadline, neither.
    let plain = plan(&Case::new(|t| t), &["--sample", "50"]);
    assert!(plain.get("workers_for_deadline").is_none(), "{plain}");
}

#[tokio::test]
async fn plan_prints_the_job_and_items_run_then_uses_and_set_is_part_of_the_job() {
    let case = Case::new(|t| t);
    let plain = plan(&case, &[]);
    assert_eq!(plain["state"], "new", "{plain}");
    assert_eq!(
        (plain["rows"].as_u64(), plain["files"].as_u64()),
        (Some(1000), Some(2))
    );
    let bytes: u64 = std::fs::read_dir(fixture().join("data"))
        .expect("data")
        .map(|e| e.expect("entry").metadata().expect("stat").len())
        .sum();
    assert_eq!(plain["bytes"].as_u64(), Some(bytes));
    // Planning publishes nothing, registers nothing and writes nothing.
    case.assert_nothing_published().await;

    let set = [
        "--set",
        "batching.item_rows=100",
        "--set",
        "output.dir=out-100",
    ];
    let planned = plan(&case, &set);
    let id = planned["job_id"].as_str().expect("job id").to_owned();
    let items = planned["items"].as_u64().expect("items");
    assert_ne!(
        id,
        plain["job_id"].as_str().expect("id"),
        "overrides change the job"
    );
    assert_ne!(items, plain["items"].as_u64().expect("items"));
    assert_eq!(planned["overrides"][0], "batching.item_rows=100");

    // `run` uses that very job id and item count.
    let manifest = case.manifest();
    let mut args = vec![
        "run",
        manifest.to_str().expect("utf8"),
        "--local",
        "--workers",
        "2",
    ];
    args.extend_from_slice(&set);
    let out = case.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let line = stdout(&out);
    assert!(
        line.contains(&format!("job {id} completed: 1000 rows in {items} items")),
        "{line}"
    );
    let summary = case.dir.path().join("out-100/_summary.json");
    let recorded: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&summary).expect("summary")).expect("json");
    assert_eq!(recorded["overrides"][1], "output.dir=out-100");
    assert_eq!(recorded["resolved_manifest"]["batching"]["item_rows"], 100);
    assert_eq!(recorded["inputs"].as_array().map(Vec::len), Some(2));
    // Planned again, the job is done: from its output folder (Redis never
    // knew this local run), with Redis or without.
    assert_eq!(plan(&case, &set)["state"], "done");
    let mut local = set.to_vec();
    local.push("--local");
    assert_eq!(plan(&case, &local)["state"], "done");
    assert_eq!(plan(&case, &[])["state"], "new");

    // A job whose state is gone from Redis is still compared from its summary.
    let out = case.run(&["compare", &id, &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("pass the path of its _summary.json"),
        "{}",
        stderr(&out)
    );
    let s = summary.to_str().expect("utf8");
    let out = case.run(&["compare", s, s, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // A bad override is a usage error naming it.
    let out = case.run(&[
        "plan",
        manifest.to_str().expect("utf8"),
        "--set",
        "batching",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--set batching: is not key=value"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn completions_are_generated_for_each_shell() {
    for (shell, marker) in [
        ("bash", "_batchfleet()"),
        ("zsh", "#compdef batchfleet"),
        ("fish", "complete -c batchfleet"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_batchfleet"))
            .args(["completions", shell])
            .output()
            .expect("batchfleet completions");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(marker),
            "{shell}: {}",
            stderr(&out)
        );
        assert!(
            text.contains("dlq") && text.contains("hook-token-env"),
            "{shell}"
        );
    }
}
