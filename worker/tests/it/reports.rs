//! What a finished job reports: the prediction distribution in _summary.json
//! (checked against PyTorch's own scores), `batchfleet compare` between two
//! jobs, the `[on_complete]` command and webhook (a real local HTTP server
//! that fails once), and `batchfleet jobs`.

use crate::support::TestEnv;
use batchfleet_coordinator::reducer::Summary;
use batchfleet_coordinator::{run_job, RunOutcome};
use batchfleet_shared::message::HistogramSpec;
use batchfleet_testkit::python::{make_job, JobGen};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A request the webhook server got: its path, `Authorization` and body.
type Posted = (String, String, String);

/// A one-route HTTP server on a free port: answers the first request 503 and
/// the next 200; sends each request's path, authorization and body down the
/// channel.
fn webhook_server() -> (u16, mpsc::Receiver<Posted>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for (n, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut len = 0;
            let mut auth = String::new();
            let mut target = String::new();
            let _ = reader.read_line(&mut target);
            // POST /path HTTP/1.1
            let path = target.split(' ').nth(1).unwrap_or("").to_owned();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                // Header names are case-insensitive; keep the value.
                if lower.starts_with("authorization:") {
                    auth = line["authorization:".len()..].trim().to_owned();
                }
            }
            let mut body = vec![0; len];
            let _ = reader.read_exact(&mut body);
            let status = if n == 0 {
                "503 Service Unavailable"
            } else {
                "200 OK"
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            let _ = tx.send((path, auth, String::from_utf8_lossy(&body).into_owned()));
        }
    });
    (port, rx)
}

fn coordinator_bin() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_batchfleet-worker")).with_file_name("batchfleet")
}

fn generate(env: &TestEnv, dir: &Path, seed: u64) -> PathBuf {
    make_job(
        dir,
        &JobGen {
            rows: 6_000,
            files: 1,
            features: 8,
            hidden: 16,
            outputs: 1,
            seed,
            name: batchfleet_testkit::services::unique("report"),
            pool: env.pool.clone(),
            item_rows: 1_000,
            batch_size: 250,
            ..JobGen::default()
        },
    )
    .expect("generate job");
    dir.join("job.toml")
}

async fn completed(env: &TestEnv, manifest: &Path) -> (String, PathBuf, Summary) {
    let mut cfg = env.run_config();
    // The test's webhook server speaks plain HTTP on loopback.
    cfg.connections.hooks = batchfleet_coordinator::hooks::HookPolicy {
        token_env: vec!["BF_TEST_WEBHOOK_TOKEN".into()],
        allow_http: true,
        ..Default::default()
    };
    let outcome = run_job(&cfg, manifest, CancellationToken::new())
        .await
        .expect("job ran");
    let RunOutcome::Completed {
        job_id,
        summary,
        report,
    } = outcome
    else {
        panic!("expected a completed job, got {outcome:?}");
    };
    (job_id, summary, *report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summary_distribution_compare_hooks_and_job_list() {
    let env = TestEnv::new("report");
    let (a_dir, b_dir) = (env.path().join("a"), env.path().join("b"));
    let a = generate(&env, &a_dir, 7);
    let b = generate(&env, &b_dir, 8);
    let (port, bodies) = webhook_server();
    let mut text = std::fs::read_to_string(&a).expect("manifest");
    text.push_str(&format!(
        "\n[on_complete]\ncommand = [\"sh\", \"-c\", \"echo $BATCHFLEET_JOB_STATUS $BATCHFLEET_JOB_ID > hook.out; test -f $BATCHFLEET_SUMMARY\"]\nwebhook = \"http://127.0.0.1:{port}/hooks/batch\"\nwebhook_token_env = \"BF_TEST_WEBHOOK_TOKEN\"\nwebhook_attempts = 3\n"
    ));
    std::fs::write(&a, text).expect("manifest");
    std::env::set_var("BF_TEST_WEBHOOK_TOKEN", "s3cret-token");

    let mut workers = vec![env.spawn_worker("w1", &[]), env.spawn_worker("w2", &[])];
    env.wait_for_consumers(2, &mut workers).await;
    let (job_a, summary_a, report_a) = completed(&env, &a).await;
    let (job_b, summary_b, _) = completed(&env, &b).await;

    // The distribution in _summary.json is the histogram of PyTorch's own scores.
    let dist = report_a
        .predictions
        .clone()
        .expect("a prediction histogram");
    let spec = HistogramSpec::default();
    let mut want: Vec<Vec<u64>> = Vec::new();
    let mut golden = csv::Reader::from_path(a_dir.join("golden.csv")).expect("golden");
    for rec in golden.records() {
        let rec = rec.expect("golden row");
        let v: f32 = rec[1].parse().expect("score");
        spec.add(&mut want, &[v], 1);
    }
    assert_eq!(dist.columns.len(), 1);
    assert_eq!(dist.columns[0].rows, 6_000);
    assert_eq!(
        dist.columns[0].counts, want[0],
        "bins of [0, 1) in 20, plus below and above"
    );

    // The hooks ran: the command saw the status, the webhook got the summary
    // with the bearer token on the second attempt, and _summary.json says so.
    assert_eq!(
        std::fs::read_to_string(a_dir.join("hook.out"))
            .expect("hook output")
            .trim(),
        format!("completed {job_a}")
    );
    let (_, auth1, _) = bodies
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("first POST");
    let (_, auth2, body) = bodies
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("second POST");
    assert_eq!(
        (auth1.as_str(), auth2.as_str()),
        ("Bearer s3cret-token", "Bearer s3cret-token")
    );
    let posted: Summary = serde_json::from_str(&body).expect("the webhook got summary JSON");
    assert_eq!(posted.job_id, job_a);
    let on_disk: Summary =
        serde_json::from_slice(&std::fs::read(&summary_a).expect("summary")).expect("json");
    let hooks = on_disk.on_complete.expect("hook outcome recorded");
    let webhook = hooks.webhook.expect("webhook outcome");
    assert_eq!(
        (
            webhook.status.as_str(),
            webhook.attempts,
            webhook.http_status
        ),
        ("delivered", 2, Some(200))
    );
    assert_eq!(
        webhook.target,
        format!("http://127.0.0.1:{port}"),
        "no path in the record"
    );
    assert_eq!(hooks.command.expect("command outcome").status, "succeeded");
    assert!(!std::fs::read_to_string(&summary_a)
        .expect("summary")
        .contains("s3cret"));

    // compare: a job against itself does not drift; two different models do.
    let compare = |x: &Path, y: &Path, extra: &[&str]| {
        std::process::Command::new(coordinator_bin())
            .args(["--redis-prefix", &env.prefix, "compare"])
            .arg(x)
            .arg(y)
            .args(extra)
            .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
            .output()
            .expect("batchfleet compare")
    };
    let same = compare(&summary_a, &summary_a, &["--json"]);
    assert!(
        same.status.success(),
        "{}",
        String::from_utf8_lossy(&same.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&same.stdout).expect("json");
    assert_eq!(v["drift"][0]["psi"].as_f64(), Some(0.0));
    let diff = compare(&summary_a, &summary_b, &["--max-psi", "0.0001"]);
    let out = String::from_utf8_lossy(&diff.stdout);
    assert!(
        out.contains("PSI") && out.contains("KS") && out.contains(&job_b),
        "{out}"
    );
    assert_eq!(
        diff.status.code(),
        Some(7),
        "different models drift past a tiny PSI gate, with the gate's own exit code: {out}"
    );
    // By job id, through Redis.
    let by_id = compare(Path::new(&job_a), Path::new(&job_b), &[]);
    assert!(
        by_id.status.success(),
        "{}",
        String::from_utf8_lossy(&by_id.stderr)
    );

    // `batchfleet jobs` lists both, newest first.
    let jobs = std::process::Command::new(coordinator_bin())
        .args(["--redis-prefix", &env.prefix, "jobs", "--json"])
        .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
        .output()
        .expect("batchfleet jobs");
    let list: serde_json::Value = serde_json::from_slice(&jobs.stdout).expect("json");
    let ids: Vec<&str> = list
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|j| j["id"].as_str())
        .collect();
    assert_eq!(ids, vec![job_b.as_str(), job_a.as_str()]);

    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_a, &job_b]).await;
}

/// Issue: an `[on_complete]` command runs as the coordinator's user, so it
/// could read `/proc/<coordinator>/environ` (the broker and Redis URLs,
/// with their passwords) and there was no switch to turn commands off.
/// Here the coordinator runs as `nobody`, as a deployment's would run as a
/// service user, with a Redis password in its environment; the job's hook
/// command, the same user, reads its parent's environment and finds it
/// closed (the coordinator is not dumpable). And `--hooks webhook` refuses
/// a manifest with a command before anything is published, `--hooks none`
/// one with a webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_commands_cannot_read_the_coordinator_and_the_operator_decides_which_run() {
    use std::os::unix::fs::PermissionsExt;
    let env = TestEnv::new("hookenv");
    let dir = env.path().join("job");
    let manifest = generate(&env, &dir, 3);
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        format!(
            "{text}\n[on_complete]\ncommand = [\"sh\", \"-c\", \"cat /proc/$PPID/environ > environ.txt; echo $? > rc.txt\"]\n"
        ),
    )
    .expect("hooked manifest");
    // Everything the coordinator touches is open to `nobody`.
    for entry in walk(env.path()) {
        let mode = if entry.is_dir() { 0o777 } else { 0o666 };
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let secret = "redis://:hook-env-secret@127.0.0.1:6379";
    let coordinator = |hooks: &str| {
        let mut c = std::process::Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(coordinator_bin())
            .args(["run", "--local", "--hooks", hooks, "--data-root"])
            .arg(env.path())
            .arg(&manifest)
            .env("BATCHFLEET_REDIS_URL", secret)
            .env("HOME", env.path())
            .current_dir(env.path());
        c
    };
    // Commands off: the manifest is refused, nothing runs.
    let out = coordinator("webhook").output().expect("setpriv batchfleet");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("[on_complete] command") && stderr.contains("--hooks webhook"),
        "{stderr}"
    );
    assert!(!dir.join("out").join("_summary.json").exists());
    assert!(!dir.join("rc.txt").exists());
    // Commands on: the job runs and so does its command, which cannot read
    // the coordinator's environment.
    let out = coordinator("all").output().expect("setpriv batchfleet");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rc = std::fs::read_to_string(dir.join("rc.txt")).expect("the hook command ran");
    assert_ne!(
        rc.trim(),
        "0",
        "the hook read the coordinator's environment"
    );
    let leaked = std::fs::read(dir.join("environ.txt")).unwrap_or_default();
    assert!(
        !String::from_utf8_lossy(&leaked).contains("hook-env-secret"),
        "the coordinator's Redis password reached the hook"
    );
    // Hooks off: a webhook is refused too.
    std::fs::write(
        &manifest,
        format!("{text}\n[on_complete]\nwebhook = \"https://hooks.example.com/done\"\n"),
    )
    .expect("webhook manifest");
    let out = coordinator("none").output().expect("setpriv batchfleet");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("[on_complete] webhook") && stderr.contains("--hooks none"),
        "{stderr}"
    );
}

/// Every file and folder under `root`, `root` included.
fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.to_owned()];
    let mut i = 0;
    while i < out.len() {
        if out[i].is_dir() {
            let children: Vec<PathBuf> = std::fs::read_dir(&out[i])
                .expect("read_dir")
                .flatten()
                .map(|e| e.path())
                .collect();
            out.extend(children);
        }
        i += 1;
    }
    out
}

/// Every value Redis holds under `prefix`, each key with its values, as text.
async fn everything_under(env: &TestEnv, prefix: &str) -> Vec<(String, String)> {
    let mut c = redis::Client::open(env.redis.url.expose())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut c)
        .await
        .expect("KEYS");
    let mut out = Vec::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut c)
            .await
            .expect("TYPE");
        let (cmd, args): (&str, &[&str]) = match kind.as_str() {
            "string" => ("GET", &[]),
            "hash" => ("HGETALL", &[]),
            "set" => ("SMEMBERS", &[]),
            "list" => ("LRANGE", &["0", "-1"]),
            "zset" => ("ZRANGE", &["0", "-1", "WITHSCORES"]),
            _ => continue,
        };
        let values: redis::Value = redis::cmd(cmd)
            .arg(&key)
            .arg(args)
            .query_async(&mut c)
            .await
            .expect("read");
        out.push((key, format!("{values:?}")));
    }
    out
}

/// A webhook URL given with `--set` may carry a token in its path: the
/// hook posts to the whole URL, and neither the job record in Redis nor
/// `_summary.json` keeps more than its origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_given_with_set_is_posted_to_and_stored_nowhere() {
    let env = TestEnv::new("hookset");
    let manifest = generate(&env, &env.path().join("a"), 9);
    let (port, posts) = webhook_server();
    let mut workers = vec![env.spawn_worker("w1", &[])];
    env.wait_for_consumers(1, &mut workers).await;
    let mut cfg = env.run_config();
    cfg.connections.hooks = batchfleet_coordinator::hooks::HookPolicy {
        allow_http: true,
        ..Default::default()
    };
    cfg.overrides = vec![format!(
        "on_complete.webhook=http://127.0.0.1:{port}/hooks/s3cr3t-path"
    )];
    let outcome = run_job(&cfg, &manifest, CancellationToken::new())
        .await
        .expect("job ran");
    let RunOutcome::Completed {
        job_id, summary, ..
    } = outcome
    else {
        panic!("expected a completed job, got {outcome:?}");
    };
    // Posted to the whole URL: refused once, then delivered.
    for _ in 0..2 {
        let (path, _, _) = posts
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("a POST");
        assert_eq!(path, "/hooks/s3cr3t-path");
    }
    let text = std::fs::read_to_string(&summary).expect("summary");
    assert!(!text.contains("s3cr3t"), "{text}");
    assert!(
        text.contains(&format!("on_complete.webhook=http://127.0.0.1:{port}/…")),
        "the override is kept by its origin: {text}"
    );
    let stored = everything_under(&env, &env.prefix).await;
    assert!(
        stored.iter().any(|(key, _)| key.contains(&job_id)),
        "the job's keys are read: {stored:?}"
    );
    for (key, values) in &stored {
        assert!(!values.contains("s3cr3t"), "{key}: {values}");
    }
    crate::support::stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}
