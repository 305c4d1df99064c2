//! docker/ against the binaries: every flag and `BATCHFLEET_*` variable the
//! compose stack, the Kubernetes manifests, the images and the VM units name
//! exists in `--help`; and the worker and coordinator started as local
//! processes with the compose file's own worker command line and variable
//! names run a job end to end (the stack's wiring, without containers).

use crate::support::{stop_all, TestEnv};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn coordinator_bin() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_batchfleet-worker")).with_file_name("batchfleet")
}

fn docker_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root().join("docker")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("docker/") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if !p.extension().is_some_and(|x| x == "json" || x == "md") {
                out.push(p);
            }
        }
    }
    out
}

fn help(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .arg("--help")
        .output()
        .expect("--help");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `BATCHFLEET_*` names that are the compose file's, cloud-init's, the
/// Slurm templates' or the GPU bundle's launcher's own variables, not the
/// binaries' flags (`BATCHFLEET_CUDA` is read by every binary at start-up,
/// before its flags are parsed: `batchfleet_shared::cuda::ENV`).
const DEPLOYMENT_ONLY: &[&str] = &[
    "BATCHFLEET_LIBTORCH_DIR",
    "BATCHFLEET_PYTHON",
    batchfleet_shared::cuda::ENV,
    "BATCHFLEET_VARIANT",
    "BATCHFLEET_DATA",
    "BATCHFLEET_JOBS",
    "BATCHFLEET_RELEASE_URL",
    "BATCHFLEET_BIN",
    "BATCHFLEET_SLURM_ENV",
    "BATCHFLEET_SLURM_LOGS",
    "BATCHFLEET_SLURM_RESTARTS",
    "BATCHFLEET_SLURM_RESTART_PAUSE",
];

#[test]
fn every_flag_and_variable_named_in_docker_exists_in_the_binaries() {
    let worker = Path::new(env!("CARGO_BIN_EXE_batchfleet-worker"));
    let coordinator = coordinator_bin();
    let known = [
        help(worker, &[]),
        help(&coordinator, &[]),
        help(&coordinator, &["run"]),
        help(&coordinator, &["resume"]),
        help(&coordinator, &["supervise"]),
    ]
    .join("\n");
    let mut vars = BTreeSet::new();
    let mut flags = BTreeSet::new();
    for file in docker_files() {
        let text = std::fs::read_to_string(&file).expect("read");
        for (i, _) in text.match_indices("BATCHFLEET_") {
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || *c == '_' || c.is_ascii_digit())
                .collect();
            vars.insert((name, file.clone()));
        }
        // Flags on batchfleet command lines: compose/k8s `command:`/`args:`
        // lists, ExecStart lines, `exec …/batchfleet` invocations and the
        // Slurm templates' `"$BATCHFLEET_BIN/batchfleet…"` lines.
        let mut service = String::new();
        for line in text.lines() {
            // Compose: which service's block this line is in.
            if line.len() > 3
                && line.starts_with("  ")
                && !line.starts_with("   ")
                && line.ends_with(':')
            {
                service = line.trim().trim_end_matches(':').to_owned();
            }
            let batchfleet_service =
                matches!(service.as_str(), "worker" | "coordinator" | "supervisor");
            let ours = ((line.contains("command: [\"--")
                || line.contains("command: [\"supervise\""))
                && batchfleet_service)
                || line.contains("args: [\"run\"")
                || line.contains("args: [\"supervise\"")
                || line.contains("ExecStart=/usr/local/bin/batchfleet")
                || line.contains("/usr/local/bin/batchfleet run")
                || line.contains("\"$BATCHFLEET_BIN/batchfleet-worker\" --")
                || line.contains("\"$BATCHFLEET_BIN/batchfleet\" run");
            if !ours {
                continue;
            }
            for (i, _) in line.match_indices("--") {
                let flag: String = line[i + 2..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                    .collect();
                if !flag.is_empty() {
                    flags.insert((format!("--{flag}"), file.clone()));
                }
            }
        }
    }
    assert!(vars.len() > 10 && flags.len() > 4, "{vars:?} {flags:?}");
    // The Slurm templates' command lines are among those read.
    for (flag, template) in [
        ("--threads", "worker-gpu.sbatch"),
        ("--threads", "worker-cpu.sbatch"),
        ("--no-progress", "coordinator.sbatch"),
    ] {
        assert!(
            flags
                .iter()
                .any(|(f, p)| f == flag && p.ends_with(template)),
            "{flag} of docker/slurm/{template} not read: {flags:?}"
        );
    }
    for (var, file) in &vars {
        if DEPLOYMENT_ONLY.contains(&var.as_str()) {
            continue;
        }
        assert!(
            known.contains(&format!("env: {var}")) || known.contains(&format!("env: {var}=")),
            "{} names {var}, which no batchfleet binary reads",
            file.display()
        );
    }
    for (flag, file) in &flags {
        assert!(
            known.contains(&format!("{flag} ")) || known.contains(&format!("{flag}\n")),
            "{} uses {flag}, which no batchfleet binary takes",
            file.display()
        );
    }
}

/// The worker service's `command:` list in compose.yaml, `${VAR:-default}` resolved to the default.
fn compose_worker_command() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("docker/compose.yaml")).expect("compose");
    let worker = text
        .split("\n  worker:\n")
        .nth(1)
        .expect("a worker service");
    let line = worker
        .lines()
        .find(|l| l.trim_start().starts_with("command: ["))
        .expect("worker command");
    let list: Vec<String> = serde_json::from_str(line.trim_start().trim_start_matches("command: "))
        .expect("a JSON list");
    list.into_iter()
        .map(|a| match (a.find("${"), a.find(":-"), a.rfind('}')) {
            (Some(0), Some(d), Some(e)) => a[d + 2..e].to_owned(),
            _ => a,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_command_lines_and_variables_run_a_job_as_local_processes() {
    let env = TestEnv::new("deploy");
    let name = batchfleet_testkit::services::unique("deploy");
    batchfleet_testkit::python::make_job(
        env.path(),
        &batchfleet_testkit::python::JobGen {
            rows: 4_000,
            files: 1,
            features: 8,
            hidden: 16,
            name,
            pool: "default".into(),
            item_rows: 1_000,
            ..Default::default()
        },
    )
    .expect("generate job");
    let args = compose_worker_command();
    assert_eq!(&args[..2], ["--pool", "default"], "{args:?}");
    // The compose pool is "default": keep this test's own queues by renaming the pool
    // in the job and on the command line, everything else exactly as compose has it.
    let pool = env.pool.clone();
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest)
        .expect("manifest")
        .replace("pool = \"default\"", &format!("pool = \"{pool}\""));
    std::fs::write(&manifest, text).expect("manifest");
    let mut worker_args = args.clone();
    worker_args[1] = pool.clone();
    // The variables compose sets (x-batchfleet-env), with local values.
    let vars = [
        ("BATCHFLEET_AMQP_URL", env.amqp.url.expose().to_owned()),
        ("BATCHFLEET_REDIS_URL", env.redis.url.expose().to_owned()),
        ("BATCHFLEET_REDIS_PREFIX", env.prefix.clone()),
        ("BATCHFLEET_LOG_FORMAT", "json".to_owned()),
        ("BATCHFLEET_METRICS_PORT", "0".to_owned()),
        // compose's /data: the test's folder.
        (
            "BATCHFLEET_DATA_ROOT",
            env.path().to_str().expect("utf-8").to_owned(),
        ),
    ];
    let log = std::fs::File::create(env.path().join("compose-worker.log")).expect("log");
    let child = Command::new(env!("CARGO_BIN_EXE_batchfleet-worker"))
        .args(&worker_args)
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("LD_LIBRARY_PATH")
        .stdout(std::process::Stdio::from(log.try_clone().expect("log")))
        .stderr(std::process::Stdio::from(log))
        .spawn()
        .expect("worker");
    let mut workers = vec![crate::support::Worker {
        child,
        log: env.path().join("compose-worker.log"),
    }];
    env.wait_for_consumers(1, &mut workers).await;
    // docker compose run --rm coordinator run /jobs/job.toml
    let out = Command::new(coordinator_bin())
        .args(["run", manifest.to_str().expect("utf-8")])
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .env("BATCHFLEET_NO_PROGRESS", "true")
        .output()
        .expect("coordinator");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = batchfleet_testkit::verify::verify(
        &env.path().join("out"),
        &env.path().join("golden.csv"),
        1e-5,
    )
    .expect("verify");
    assert!(v.ok(), "{}", v.describe());
    assert!(
        workers[0].log_text().contains("\"worker consuming\"")
            || workers[0].log_text().contains("worker consuming"),
        "JSON logs as compose asks"
    );
    stop_all(&mut workers);
    let job = batchfleet_coordinator::manifest::load(&manifest, &[])
        .expect("manifest")
        .job_id;
    env.cleanup(&[&job]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_preloaded_model_and_a_bad_model_exits_1() {
    let env = TestEnv::new("ready");
    batchfleet_testkit::python::make_job(
        env.path(),
        &batchfleet_testkit::python::JobGen {
            rows: 100,
            files: 1,
            features: 4,
            hidden: 8,
            pool: env.pool.clone(),
            ..Default::default()
        },
    )
    .expect("generate job");
    let ready = env.path().join("ready");
    let model = env.path().join("model.pt");
    let mut good = env.spawn_worker(
        "ready",
        &[
            "--preload-model",
            model.to_str().expect("utf-8"),
            "--ready-file",
            ready.to_str().expect("utf-8"),
        ],
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline && matches!(good.child.try_wait(), Ok(None)),
            "never ready:\n{}",
            good.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        good.log_text().contains("model preloaded"),
        "{}",
        good.log_text()
    );
    let status = good.terminate(std::time::Duration::from_secs(30));
    assert!(status.success(), "{}", good.log_text());
    assert!(
        !ready.exists(),
        "the ready file goes when the worker drains"
    );

    let missing = env.path().join("missing.pt");
    let mut bad = env.spawn_worker(
        "unready",
        &[
            "--preload-model",
            missing.to_str().expect("utf-8"),
            "--ready-file",
            ready.to_str().expect("utf-8"),
        ],
    );
    let status = bad.child.wait().expect("wait");
    assert_eq!(status.code(), Some(1), "{}", bad.log_text());
    assert!(
        bad.log_text().contains("--preload-model") && bad.log_text().contains("missing.pt"),
        "{}",
        bad.log_text()
    );
    assert!(!ready.exists());
}

#[test]
fn the_deployment_files_give_each_part_its_identity_and_name_the_tls_settings() {
    let read = |p: &str| std::fs::read_to_string(root().join(p)).expect(p);
    let worker_help = help(Path::new(env!("CARGO_BIN_EXE_batchfleet-worker")), &[]);
    let tls_vars = [
        "BATCHFLEET_AMQP_CA_FILE",
        "BATCHFLEET_AMQP_CERT_FILE",
        "BATCHFLEET_AMQP_KEY_FILE",
        "BATCHFLEET_REDIS_CA_FILE",
        "BATCHFLEET_REDIS_CERT_FILE",
        "BATCHFLEET_REDIS_KEY_FILE",
    ];
    for var in tls_vars
        .iter()
        .chain(&["BATCHFLEET_AMQP_URL_FILE", "BATCHFLEET_REDIS_URL_FILE"])
    {
        assert!(
            worker_help.contains(&format!("env: {var}")),
            "the worker reads {var}"
        );
    }
    // Kubernetes: a Secret per identity, mounted as files the URLs are read from.
    let k8s = [
        "config.yaml",
        "secret.example.yaml",
        "worker.yaml",
        "worker-gpu.yaml",
        "coordinator.yaml",
        "keda.yaml",
    ]
    .map(|f| read(&format!("docker/k8s/{f}")))
    .join("\n");
    for name in [
        "secretName: batchfleet-worker",
        "secretName: batchfleet-coordinator",
        "name: batchfleet-monitor",
    ] {
        assert!(k8s.contains(name), "docker/k8s names {name}");
    }
    for user in [
        "batchfleet-worker:",
        "batchfleet-coordinator:",
        "batchfleet-monitor:",
    ] {
        assert!(
            k8s.contains(&format!("://{user}")),
            "the example Secrets use the {user} user"
        );
    }
    for var in tls_vars
        .iter()
        .chain(&["BATCHFLEET_AMQP_URL_FILE", "BATCHFLEET_REDIS_URL_FILE"])
    {
        assert!(k8s.contains(var), "docker/k8s names {var}");
    }
    assert!(
        !k8s.contains("batchfleet-credentials"),
        "no Secret shared by every part"
    );
    for hardening in [
        "readOnlyRootFilesystem: true",
        "allowPrivilegeEscalation: false",
        "drop: [ALL]",
        "type: RuntimeDefault",
    ] {
        for f in ["worker.yaml", "worker-gpu.yaml"] {
            assert!(
                read(&format!("docker/k8s/{f}")).contains(hardening),
                "{f}: {hardening}"
            );
        }
        assert_eq!(
            read("docker/k8s/coordinator.yaml")
                .matches(hardening)
                .count(),
            3,
            "the Job, the CronJob and the supervisor: {hardening}"
        );
    }
    // Compose: the users the broker and Redis make, the URL secrets each part reads.
    let compose = read("docker/compose.yaml");
    let rabbit = read("docker/rabbitmq/entrypoint.sh");
    let redis = read("docker/redis/entrypoint.sh");
    for user in ["batchfleet-worker", "batchfleet-coordinator"] {
        assert!(
            rabbit.contains(&format!("user {user} ")),
            "RabbitMQ user {user}"
        );
        assert!(
            redis.contains(&format!("user {user} on")),
            "Redis user {user}"
        );
    }
    assert!(rabbit.contains("user batchfleet-monitor ") && rabbit.contains("monitoring"));
    assert!(redis.contains("user default off") && !redis.contains("requirepass"));
    for (service, secret) in [
        ("worker", "worker_amqp_url"),
        ("coordinator", "coordinator_amqp_url"),
        ("supervisor", "coordinator_amqp_url"),
    ] {
        let block = compose
            .split(&format!("\n  {service}:\n"))
            .nth(1)
            .and_then(|b| b.split("\n\n").next())
            .unwrap_or_else(|| panic!("a {service} service"));
        assert!(
            block.contains(&format!("/run/secrets/{secret}")),
            "{service} reads {secret}"
        );
        assert!(
            block.contains("*batchfleet-hardening"),
            "{service} is read-only, without capabilities"
        );
    }
    assert!(compose.contains("read_only: true") && compose.contains("cap_drop: [ALL]"));
    assert!(
        compose.contains("BATCHFLEET_AMQP_CA_FILE") && compose.contains("BATCHFLEET_REDIS_CA_FILE")
    );
    assert!(
        !compose.contains("--requirepass"),
        "no Redis password on a command line"
    );
}
