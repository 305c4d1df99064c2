//! `[on_complete]` within the operator's policy, with real processes and a
//! real HTTPS server: the command sees only its own variables, dies with
//! everything it started at its time limit, and has its stderr capped; the
//! webhook trusts the system's CA store (here `SSL_CERT_FILE`, in a child
//! test process), follows no redirect, retries with backoff, and sends
//! nothing the policy refuses.

use batchfleet_coordinator::hooks::{self, HookOutcome, HookPolicy, BASE_ENV};
use batchfleet_coordinator::manifest::OnComplete;
use batchfleet_shared::secret::SecretUrl;
use batchfleet_testkit::nodes::{TestPki, WebhookServer};
use std::path::Path;
use std::time::Duration;

async fn run(hooks: &OnComplete, policy: &HookPolicy, dir: &Path) -> HookOutcome {
    let summary = dir.join("_summary.json");
    tokio::time::timeout(
        Duration::from_secs(120),
        hooks::run(hooks, policy, "job-1", "completed", &summary, b"{}", dir),
    )
    .await
    .expect("the hooks end within their limits")
}

fn command(args: &[&str], timeout: Duration) -> OnComplete {
    OnComplete {
        command: Some(args.iter().map(|s| (*s).to_owned()).collect()),
        command_timeout: timeout,
        ..OnComplete::default()
    }
}

/// Whether a process (not a child of ours) is gone: no entry, or a zombie.
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn a_hook_command_gets_only_its_variables_dies_whole_and_keeps_a_bounded_stderr() {
    let dir = tempfile::tempdir().expect("temp dir");
    // One variable of this process that is not a base one: allowed by name.
    let ours: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
    let allowed = ours
        .iter()
        .find(|k| !BASE_ENV.contains(&k.as_str()) && k.starts_with("CARGO"))
        .expect("cargo sets CARGO_* for its tests")
        .clone();
    let policy = HookPolicy {
        command_env: vec![allowed.clone()],
        ..HookPolicy::default()
    };
    let out = run(
        &command(&["sh", "-c", "env > env.txt"], Duration::from_secs(60)),
        &policy,
        dir.path(),
    )
    .await;
    assert_eq!(out.command.expect("ran").status, "succeeded");
    let seen: Vec<String> = std::fs::read_to_string(dir.path().join("env.txt"))
        .expect("env.txt")
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_owned()))
        .collect();
    for want in [
        "BATCHFLEET_JOB_ID",
        "BATCHFLEET_JOB_STATUS",
        "BATCHFLEET_SUMMARY",
        "PATH",
        &allowed,
    ] {
        assert!(
            seen.iter().any(|k| k == want),
            "{want} missing from {seen:?}"
        );
    }
    // Nothing else of this process's environment (the shell adds its own few).
    for k in &ours {
        let expected = BASE_ENV.contains(&k.as_str()) || *k == allowed;
        let shells = ["PWD", "OLDPWD", "SHLVL", "_"].contains(&k.as_str());
        assert!(
            expected || shells || !seen.contains(k),
            "{k} leaked into the hook's environment"
        );
    }

    // At its time limit the command is killed with what it started.
    let out = run(
        &command(
            &["sh", "-c", "sleep 600 & echo $! > bg.pid; sleep 600"],
            Duration::from_secs(1),
        ),
        &policy,
        dir.path(),
    )
    .await;
    let cmd = out.command.expect("ran");
    assert_eq!(cmd.status, "timed_out");
    let bg: u32 = std::fs::read_to_string(dir.path().join("bg.pid"))
        .expect("bg.pid")
        .trim()
        .parse()
        .expect("pid");
    // A process that is not our child has no exit to await: poll it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !gone(bg) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        gone(bg),
        "the background process {bg} outlived its hook's time limit"
    );

    // 20 MB of stderr: the last line is kept, the rest dropped as it came.
    let out = run(
        &command(
            &[
                "sh",
                "-c",
                "head -c 20000000 /dev/zero | tr '\\0' x >&2; echo >&2; echo last words >&2; exit 3",
            ],
            Duration::from_secs(60),
        ),
        &policy,
        dir.path(),
    )
    .await;
    let cmd = out.command.expect("ran");
    assert_eq!((cmd.status.as_str(), cmd.exit_code), ("failed", Some(3)));
    assert_eq!(cmd.error.as_deref(), Some("last words"));
    // Something it leaves running with our stderr does not hold the hook up.
    let out = run(
        &command(
            &["sh", "-c", "(sleep 20 >&2 &); echo done >&2; exit 1"],
            Duration::from_secs(60),
        ),
        &policy,
        dir.path(),
    )
    .await;
    let cmd = out.command.expect("ran");
    assert!(cmd.duration_s < 15.0, "{cmd:?}");
    assert_eq!(cmd.error.as_deref(), Some("done"));
}

fn webhook(url: &str, token_env: Option<&str>, attempts: u32) -> OnComplete {
    OnComplete {
        webhook: Some(SecretUrl::new(url)),
        webhook_token_env: token_env.map(str::to_owned),
        webhook_attempts: attempts,
        ..OnComplete::default()
    }
}

const CHILD: &str = "BF_HOOKS_TEST_CHILD_PORT";

#[tokio::test]
async fn webhooks_trust_the_system_store_follow_no_redirect_and_send_nothing_refused() {
    if let Ok(port) = std::env::var(CHILD) {
        return webhook_cases(port.parse().expect("port")).await;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::make(&dir.path().join("pki")).expect("test certificates");
    let server = WebhookServer::start(dir.path(), &pki, "https://localhost:1/redirected")
        .expect("webhook server");

    // This process's store lacks the test CA: the certificate is refused
    // and nothing is delivered.
    let out = run(
        &webhook(
            &format!("https://localhost:{}/untrusted", server.port),
            None,
            1,
        ),
        &HookPolicy::default(),
        dir.path(),
    )
    .await;
    let w = out.webhook.expect("tried");
    assert_eq!(w.status, "failed");
    assert!(
        w.error
            .as_deref()
            .is_some_and(|e| e.contains("certificate") || e.contains("UnknownIssuer")),
        "{w:?}"
    );

    // The same test in a child process whose system store (SSL_CERT_FILE)
    // holds the test CA runs the cases below.
    let child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "hooks::webhooks_trust_the_system_store_follow_no_redirect_and_send_nothing_refused",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD, server.port.to_string())
        .env("SSL_CERT_FILE", &pki.ca)
        .env("BF_HOOKS_TEST_TOKEN", "t0k3n-abc")
        .output()
        .expect("run the child test");
    assert!(
        child.status.success(),
        "child: {}{}",
        String::from_utf8_lossy(&child.stdout),
        String::from_utf8_lossy(&child.stderr)
    );
    let paths: Vec<(String, Option<String>)> = server
        .requests()
        .iter()
        .map(|r| {
            (
                r["path"].as_str().unwrap_or_default().to_owned(),
                r["authorization"].as_str().map(str::to_owned),
            )
        })
        .collect();
    // The delivered one with its token, one redirect (never followed), two
    // tries of a failing one, and nothing of the refused ones.
    assert_eq!(
        paths,
        vec![
            ("/ok".to_owned(), Some("Bearer t0k3n-abc".to_owned())),
            ("/redirect".to_owned(), None),
            ("/fail".to_owned(), None),
            ("/fail".to_owned(), None),
        ]
    );
}

/// The child's half: each case's outcome as recorded in `_summary.json`.
async fn webhook_cases(port: u16) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = |path: &str| format!("https://localhost:{port}{path}");
    let allowed = HookPolicy {
        token_env: vec!["BF_HOOKS_TEST_TOKEN".into()],
        ..HookPolicy::default()
    };
    let w = run(
        &webhook(&url("/ok"), Some("BF_HOOKS_TEST_TOKEN"), 3),
        &allowed,
        dir.path(),
    )
    .await
    .webhook
    .expect("sent");
    assert_eq!(
        (w.status.as_str(), w.attempts, w.http_status),
        ("delivered", 1, Some(200)),
        "{w:?}"
    );
    assert_eq!(w.target, format!("https://localhost:{port}"));

    let w = run(&webhook(&url("/redirect"), None, 3), &allowed, dir.path())
        .await
        .webhook
        .expect("sent");
    assert_eq!(
        (w.status.as_str(), w.attempts, w.http_status),
        ("failed", 1, Some(302)),
        "{w:?}"
    );
    assert!(
        w.error.as_deref().is_some_and(|e| e.contains("redirect")),
        "{w:?}"
    );

    let w = run(&webhook(&url("/fail"), None, 2), &allowed, dir.path())
        .await
        .webhook
        .expect("sent");
    assert_eq!(
        (w.status.as_str(), w.attempts, w.http_status),
        ("failed", 2, Some(503)),
        "{w:?}"
    );

    // Refused by the policy: a token variable not on the list, plain http,
    // a metadata address. Nothing reaches the server.
    let w = run(
        &webhook(&url("/ok-but-token"), Some("BF_HOOKS_TEST_TOKEN"), 1),
        &HookPolicy::default(),
        dir.path(),
    )
    .await
    .webhook
    .expect("outcome");
    assert_eq!((w.status.as_str(), w.attempts), ("refused", 0), "{w:?}");
    assert!(
        w.error
            .as_deref()
            .is_some_and(|e| e.contains("--hook-token-env")),
        "{w:?}"
    );
    for (target, flag) in [
        (
            format!("http://127.0.0.1:{port}/plain"),
            "--hook-allow-http",
        ),
        (
            "https://169.254.169.254/latest/meta-data/".to_owned(),
            "--hook-allow-link-local",
        ),
    ] {
        let w = run(&webhook(&target, None, 1), &allowed, dir.path())
            .await
            .webhook
            .expect("outcome");
        assert_eq!((w.status.as_str(), w.attempts), ("refused", 0), "{w:?}");
        assert!(
            w.error.as_deref().is_some_and(|e| e.contains(flag)),
            "{w:?}"
        );
    }
}

/// Issue: a hook command ran as the coordinator's user, so it could read
/// every secret file the coordinator reads. With `--hook-user`, run as
/// root here, the command runs as `nobody`: its own uid and group, no
/// supplementary group of the coordinator's, its own HOME, and a file only
/// the coordinator's user may read is closed to it. A coordinator that is
/// not root is refused `--hook-user` as it starts, naming the flag.
#[tokio::test]
async fn a_hook_command_runs_as_the_hook_user_and_cannot_read_the_coordinators_files() {
    use std::os::unix::fs::PermissionsExt;
    let root = rustix::process::geteuid().is_root();
    let user = hooks::HookUser::resolve("nobody");
    if !root {
        let why = user.expect_err("only root starts processes as another user");
        assert!(
            why.contains("--hook-user nobody") && why.contains("root"),
            "{why}"
        );
        return;
    }
    let user = user.expect("nobody exists");
    assert_ne!(user.uid, 0);
    assert!(hooks::HookUser::resolve("no-such-user-batchfleet")
        .expect_err("unknown")
        .contains("no such user"));
    let dir = tempfile::tempdir().expect("temp dir");
    // The folder the command runs in and writes to is open to it; the
    // secret beside it is the coordinator's alone.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let secret = dir.path().join("redis-password");
    std::fs::write(&secret, "hunter2").expect("secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let policy = HookPolicy {
        user: Some(user.clone()),
        ..HookPolicy::default()
    };
    let out = run(
        &command(
            &[
                "sh",
                "-c",
                "id -u > uid.txt; id -G > groups.txt; echo \"$HOME $USER\" > home.txt; cat redis-password > read.txt 2>&1; echo $? >> read.txt",
            ],
            Duration::from_secs(60),
        ),
        &policy,
        dir.path(),
    )
    .await;
    assert_eq!(out.command.expect("ran").status, "succeeded");
    let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).expect(name);
    assert_eq!(read("uid.txt").trim(), user.uid.to_string());
    assert_eq!(
        read("groups.txt").trim(),
        user.gid.to_string(),
        "only the user's own group, none of the coordinator's"
    );
    assert_eq!(
        read("home.txt").trim(),
        format!("{} {}", user.home.display(), user.name)
    );
    let attempt = read("read.txt");
    assert!(
        !attempt.contains("hunter2") && attempt.contains("Permission denied"),
        "{attempt}"
    );
}
