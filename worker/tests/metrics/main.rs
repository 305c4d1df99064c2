//! A real job on two workers, over a RabbitMQ node of the test's own with
//! the `rabbitmq_prometheus` plugin, while a real Prometheus scrapes the
//! workers, the coordinator and the broker with a default scrape config (no
//! `honor_labels`, as under the Prometheus Operator); then every query of
//! the Grafana dashboard is evaluated against that Prometheus and must
//! return data, and the key figures must agree with _summary.json. Every
//! batchfleet metric has its HELP text, and a worker drops a finished job's
//! series after `--metrics-idle-timeout` while keeping its own.
//!
//! A job with a `[job] deadline`, its coordinator a `batchfleet run`
//! process of its own: `batchfleet_pool_workers_needed`, scraped by a real
//! Prometheus, rises when workers leave and falls when more come, and
//! `status`, `scale-advice` and `_summary.json` say the same.
//!
//! Needs the `prometheus` binary (Debian package `prometheus`; `make test`
//! installs it). The coordinator runs in this process with its metrics
//! endpoint, so this test has a binary of its own.

#[allow(dead_code)]
#[path = "../it/support.rs"]
mod support;

use batchfleet_coordinator::{run_job, RunOutcome};
use batchfleet_shared::endpoint::Endpoint;
use batchfleet_shared::metrics::names;
use batchfleet_shared::metrics::MetricsArgs;
use batchfleet_shared::secret::SecretUrl;
use batchfleet_testkit::nodes::{RabbitNode, RabbitOptions};
use batchfleet_testkit::python::{make_job, JobGen};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{stop_all, TestEnv};
use tokio_util::sync::CancellationToken;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

struct Prometheus {
    child: Child,
    base: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Scrapes batchfleet's `targets` as Prometheus does by default, and
    /// the broker's plugin as docker/prometheus/prometheus.yml does.
    fn start(dir: &std::path::Path, targets: &[u16], rabbitmq: u16) -> Self {
        let port = free_port();
        let config = dir.join("prometheus.yml");
        let targets: Vec<String> = targets
            .iter()
            .map(|p| format!("\"127.0.0.1:{p}\""))
            .collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: batchfleet\n    static_configs:\n      - targets: [{}]\n  - job_name: rabbitmq\n    static_configs:\n      - targets: [\"127.0.0.1:{rabbitmq}\"]\n  - job_name: rabbitmq-queues\n    metrics_path: /metrics/detailed\n    params:\n      family: [queue_coarse_metrics]\n    static_configs:\n      - targets: [\"127.0.0.1:{rabbitmq}\"]\n",
                targets.join(", ")
            ),
        )
        .expect("prometheus config");
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start prometheus (Debian package `prometheus`; `make test` installs it)");
        let p = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while ureq::get(&format!("{}/-/ready", p.base)).call().is_err() {
            assert!(Instant::now() < deadline, "prometheus did not become ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// Instant query; the result vector.
    fn query(&self, q: &str) -> Result<Vec<serde_json::Value>, String> {
        let resp = ureq::get(&format!("{}/api/v1/query", self.base))
            .query("query", q)
            .call()
            .map_err(|e| format!("{q}: {e}"))?;
        let v: serde_json::Value = resp.into_json().map_err(|e| e.to_string())?;
        if v["status"] != "success" {
            return Err(format!("{q}: {v}"));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The value of a query that returns one series.
    fn scalar(&self, q: &str) -> Option<f64> {
        let r = self.query(q).ok()?;
        r.first()?["value"][1].as_str()?.parse().ok()
    }
}

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docker/grafana/dashboards/batchfleet.json"
    ))
    .expect("dashboard");
    serde_json::from_str(&text).expect("json")
}

fn dashboard_queries() -> Vec<String> {
    dashboard()["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("expr").to_owned())
        .collect()
}

/// A worker's `/metrics` text.
fn scrape(port: u16) -> String {
    ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_and_agrees_with_the_summary() {
    let mut env = TestEnv::new("metrics");
    let broker = RabbitNode::start(
        &env.path().join("rabbit"),
        RabbitOptions {
            prometheus: true,
            ..RabbitOptions::default()
        },
    )
    .expect("a RabbitMQ node with rabbitmq_prometheus");
    env.amqp = Endpoint::amqp(SecretUrl::new(broker.url()));
    let name = batchfleet_testkit::services::unique("metrics");
    make_job(
        env.path(),
        &JobGen {
            rows: 20_000,
            files: 2,
            features: 8,
            hidden: 16,
            outputs: 1,
            name,
            pool: env.pool.clone(),
            // 200 short items: published in bundles (three to a message),
            // so the bundle panel has data too.
            item_rows: 100,
            batch_size: 50,
            ..JobGen::default()
        },
    )
    .expect("generate job");
    let manifest = env.path().join("job.toml");
    let (w1, w2, coord) = (free_port(), free_port(), free_port());
    let prom = Prometheus::start(
        env.path(),
        &[w1, w2, coord],
        broker.prometheus_port.expect("plugin port"),
    );

    let mut workers = vec![
        env.spawn_worker(
            "w1",
            &[
                "--metrics-port",
                &w1.to_string(),
                "--metrics-host",
                "127.0.0.1",
            ],
        ),
        env.spawn_worker(
            "w2",
            &[
                "--metrics-port",
                &w2.to_string(),
                "--metrics-host",
                "127.0.0.1",
            ],
        ),
    ];
    env.wait_for_consumers(2, &mut workers).await;
    batchfleet_shared::metrics::install(
        &MetricsArgs {
            metrics_port: coord,
            metrics_host: "127.0.0.1".parse().expect("ip"),
            metrics_idle_timeout: Duration::from_secs(600),
        },
        "coordinator",
        &[],
        &[],
    )
    .expect("coordinator metrics");
    let outcome = run_job(&env.run_config(), &manifest, CancellationToken::new())
        .await
        .expect("job ran");
    let RunOutcome::Completed { job_id, report, .. } = outcome else {
        panic!("expected a completed job, got {outcome:?}");
    };

    // Wait until Prometheus has scraped the final figures.
    // The batch job's label is batch_job; `job` stays the scrape job's.
    let rows_q = format!(
        "sum(batchfleet_worker_rows_processed_total{{job=\"batchfleet\",batch_job=\"{job_id}\"}})"
    );
    let finished_q = format!("batchfleet_coordinator_job_finished{{batch_job=\"{job_id}\"}}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while prom.scalar(&rows_q) != Some(report.rows_predicted as f64)
        || prom.scalar(&finished_q) != Some(1.0)
    {
        assert!(
            Instant::now() < deadline,
            "Prometheus never saw the final figures: rows {:?}, finished {:?}",
            prom.scalar(&rows_q),
            prom.scalar(&finished_q)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Rates need two samples inside their window.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut empty = Vec::new();
    let queries = dashboard_queries();
    for q in &queries {
        let q = q
            .replace("$__rate_interval", "1m")
            .replace("$__range", "5m")
            .replace("$job", ".+")
            .replace("$pool", ".+");
        // Text input's tokenizing time has no data on this numeric job, nor
        // the GPU queries without a GPU; their queries must still be ones
        // Prometheus answers.
        // Nor the deadline panel on a job without one (the deadline test
        // below evaluates it).
        let may_be_empty = [
            names::WORKER_TOKENIZE,
            names::WORKER_GPU_MEMORY,
            names::WORKER_GPU_UTILIZATION,
            names::POOL_WORKERS_NEEDED,
            names::JOB_WORKERS_NEEDED,
            names::JOB_DEADLINE_LATE,
            names::JOB_DEADLINE_SECONDS_LEFT,
            names::JOB_WORKER_SECONDS,
            names::JOB_COST,
        ]
        .iter()
        .any(|n| q.contains(n));
        match prom.query(&q) {
            Ok(r) if !r.is_empty() || may_be_empty => {}
            Ok(_) => empty.push(format!("no data: {q}")),
            Err(e) => empty.push(format!("error: {e}")),
        }
    }
    assert!(
        empty.is_empty(),
        "{} of {} dashboard queries failed:\n{}",
        empty.len(),
        queries.len(),
        empty.join("\n")
    );

    // No GPU here: its panel says so rather than drawing a made-up 0.
    let gpu_panel = dashboard()["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .find(|p| p["title"] == "GPU memory")
        .cloned()
        .expect("GPU panel");
    assert_eq!(gpu_panel["fieldConfig"]["defaults"]["noValue"], "no GPU");
    assert!(!gpu_panel.to_string().contains("vector(0)"));
    assert!(prom
        .query(names::WORKER_GPU_MEMORY)
        .expect("query")
        .is_empty());
    // The broker's own figures: the job's queue is gone, the work and dead
    // queues of the pool are there, and messages went through it.
    let dead = format!(
        "rabbitmq_detailed_queue_messages_ready{{queue=\"bf.{}.dead\"}}",
        env.pool
    );
    assert_eq!(prom.scalar(&dead), Some(0.0), "{dead}");
    let received = prom
        .scalar("sum(rabbitmq_global_messages_received_total)")
        .expect("publishes counted");
    // The items travelled in bundles: fewer messages than items, each one
    // the workers took published through the broker first.
    let taken = prom
        .scalar("sum(batchfleet_worker_messages_received_total)")
        .expect("messages taken counted");
    assert!(
        taken > 0.0 && taken < report.items_total as f64,
        "{taken} messages for {} items",
        report.items_total
    );
    assert!(received >= taken, "{received} received, {taken} taken");
    // Nothing arrives renamed to exported_job.
    assert!(prom
        .query("{exported_job!=\"\"}")
        .expect("query")
        .is_empty());

    // Key figures agree with _summary.json.
    let job = format!("batch_job=\"{job_id}\"");
    assert_eq!(prom.scalar(&rows_q), Some(20_000.0));
    assert_eq!(
        prom.scalar(&format!(
            "batchfleet_coordinator_job_items{{{job},state=\"done\"}}"
        )),
        Some(report.items_completed as f64)
    );
    assert_eq!(
        prom.scalar(&format!(
            "batchfleet_coordinator_job_rows{{{job},state=\"done\"}}"
        )),
        Some(report.rows_total as f64)
    );
    assert_eq!(
        prom.scalar(&format!(
            "sum(batchfleet_worker_items_completed_total{{{job}}})"
        )),
        Some(report.items_completed as f64)
    );
    assert_eq!(prom.scalar("sum(batchfleet_worker_up)"), Some(2.0));
    let forward_calls = prom
        .scalar("sum(batchfleet_worker_inference_seconds_count)")
        .expect("inference histogram");
    assert!(
        forward_calls >= 40.0,
        "20000 rows in mini-batches of 500: {forward_calls}"
    );

    // Every batchfleet family a worker exports has its HELP text, and the
    // standard process metrics are there.
    let text = scrape(w1);
    for line in text.lines().filter(|l| l.starts_with("batchfleet_")) {
        let family = line
            .split(['{', ' '])
            .next()
            .unwrap_or_default()
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        assert!(
            text.contains(&format!("# HELP {family} ")),
            "{family} has no HELP"
        );
    }
    for standard in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
    ] {
        assert!(
            text.contains(&format!("\n{standard}{{")),
            "{standard} missing"
        );
    }
    stop_all(&mut workers);

    // A worker drops a finished job's series after its idle timeout and
    // keeps its own: a short job on a worker whose timeout is 10 s.
    let w3 = free_port();
    let dir = env.path().join("short");
    make_job(
        &dir,
        &JobGen {
            rows: 1_000,
            files: 1,
            features: 8,
            hidden: 16,
            outputs: 1,
            name: batchfleet_testkit::services::unique("idle"),
            pool: env.pool.clone(),
            item_rows: 500,
            batch_size: 500,
            ..JobGen::default()
        },
    )
    .expect("generate job");
    let mut short = vec![env.spawn_worker(
        "w3",
        &[
            "--metrics-port",
            &w3.to_string(),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-idle-timeout",
            "10s",
        ],
    )];
    env.wait_for_consumers(1, &mut short).await;
    let RunOutcome::Completed {
        job_id: short_id, ..
    } = run_job(
        &env.run_config(),
        &dir.join("job.toml"),
        CancellationToken::new(),
    )
    .await
    .expect("short job ran")
    else {
        panic!("the short job did not complete");
    };
    let mine = format!("batch_job=\"{short_id}\"");
    assert!(scrape(w3).contains(&mine), "the job's series while fresh");
    // The exporter prunes at scrape time: scrape until they are gone.
    let deadline = Instant::now() + Duration::from_secs(30);
    while scrape(w3).contains(&mine) {
        assert!(Instant::now() < deadline, "{mine} series never went idle");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let text = scrape(w3);
    assert!(text.contains("\nbatchfleet_worker_up{"), "{text}");
    assert!(text.contains("\nprocess_cpu_seconds_total{"), "{text}");
    // The version outlives the idle timeout too.
    let build = format!("version=\"{}\"", env!("CARGO_PKG_VERSION"));
    assert!(
        text.lines().any(|l| l.starts_with("batchfleet_build_info{")
            && l.contains(&build)
            && l.ends_with(" 1")),
        "{text}"
    );
    stop_all(&mut short);
    env.cleanup(&[&job_id, &short_id]).await;
    drop(broker);
}

/// Polls `q` in Prometheus until `until` holds for its value (bounded); the
/// values seen, the last one last.
async fn watch(
    prom: &Prometheus,
    q: &str,
    within: Duration,
    until: impl Fn(f64) -> bool,
) -> Vec<f64> {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        if let Some(v) = prom.scalar(q) {
            if seen.last() != Some(&v) {
                seen.push(v);
            }
            if until(v) {
                return seen;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{q} never got there within {within:?}; seen {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The `batchfleet` binary built beside the worker.
fn coordinator_bin() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_BIN_EXE_batchfleet-worker")).with_file_name("batchfleet")
}

/// `batchfleet <args>` against the env's services, its JSON output.
fn cli_json(env: &TestEnv, args: &[&str]) -> serde_json::Value {
    let out = Command::new(coordinator_bin())
        .args(["--redis-prefix", &env.prefix])
        .args(args)
        .env("BATCHFLEET_AMQP_URL", env.amqp.url.expose())
        .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
        .output()
        .expect("run batchfleet");
    assert!(
        out.status.success(),
        "batchfleet {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_a_deadline_needs_rise_when_workers_leave_and_fall_when_more_come() {
    let env = TestEnv::new("deadline");
    let name = batchfleet_testkit::services::unique("deadline");
    make_job(
        env.path(),
        &JobGen {
            rows: 24_000,
            files: 2,
            features: 8,
            hidden: 16,
            outputs: 1,
            name,
            pool: env.pool.clone(),
            item_rows: 50,
            batch_size: 50,
            ..JobGen::default()
        },
    )
    .expect("generate job");
    // One mini-batch of 50 rows per item, each held 250 ms on purpose: about
    // 200 rows/s per worker, so one worker needs two minutes and three
    // finish in about 40 s, inside the deadline.
    let manifest = env.path().join("job.toml");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    std::fs::write(
        &manifest,
        text.replacen(
            "[job]\n",
            "[job]\ndeadline = \"45s\"\nworker_hour_cost = 1.2\n",
            1,
        ),
    )
    .expect("manifest with a deadline");
    let slow = [
        "--debug-batch-delay",
        "250ms",
        "--prefetch",
        "1",
        "--prefetch-max",
        "1",
    ];
    let mut workers: Vec<_> = (0..3)
        .map(|i| env.spawn_worker(&format!("d{i}"), &slow))
        .collect();
    env.wait_for_consumers(3, &mut workers).await;

    let port = free_port();
    let prom = Prometheus::start(env.path(), &[port], free_port());
    let log = std::fs::File::create(env.path().join("coordinator.log")).expect("log");
    let coordinator = Command::new(coordinator_bin())
        .args(["--redis-prefix", &env.prefix])
        .args([
            "--metrics-port",
            &port.to_string(),
            "--metrics-host",
            "127.0.0.1",
        ])
        .args(["run", "--no-progress", "--json", "--pace-interval", "500ms"])
        .arg(&manifest)
        .env("BATCHFLEET_AMQP_URL", env.amqp.url.expose())
        .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("batchfleet run");
    let need = format!(
        "max(batchfleet_pool_workers_needed{{pool=\"{}\"}})",
        env.pool
    );

    // Three workers: a need is known once rows settle.
    let seen = watch(&prom, &need, Duration::from_secs(60), |v| v > 0.0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = prom.scalar(&need).expect("need");
    assert!(before >= 1.0, "{seen:?}");
    let running = cli_json(&env, &["status", "--json"]);
    assert_eq!(running["outlook"]["worker_hour_cost"], 1.2, "{running}");
    assert!(running["outlook"]["deadline"].is_string(), "{running}");

    // Two leave (a scale-down: they drain): the one left falls behind, and
    // the need rises above what it was.
    for mut w in workers.drain(1..) {
        let status = w.terminate(Duration::from_secs(30));
        assert!(status.success(), "{}", w.log_text());
    }
    let rising = watch(&prom, &need, Duration::from_secs(40), |v| v > before).await;
    let late = format!(
        "max(batchfleet_coordinator_job_deadline_late{{pool=\"{}\"}})",
        env.pool
    );
    watch(&prom, &late, Duration::from_secs(20), |v| v == 1.0).await;
    // The dashboard's deadline panel has data for it, every query.
    let panel = dashboard()["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .find(|p| {
            p["title"]
                .as_str()
                .is_some_and(|t| t.starts_with("Deadline"))
        })
        .cloned()
        .expect("a deadline panel");
    for t in panel["targets"].as_array().expect("targets") {
        let q = t["expr"]
            .as_str()
            .expect("expr")
            .replace("$job", ".+")
            .replace("$pool", &env.pool);
        assert!(!prom.query(&q).expect("query").is_empty(), "no data: {q}");
    }
    let advice = cli_json(&env, &["scale-advice", "--pool", &env.pool, "--json"]);
    let pool = &advice["pools"][0];
    assert_eq!(pool["workers"], 1, "{advice}");
    // Late with one worker: it needs more than the one it has.
    assert!(
        pool["workers_needed"].as_f64().expect("a need") > 1.0,
        "{advice}"
    );
    assert_eq!(pool["jobs"][0]["late"], true, "{advice}");
    // docker/scale-to-deadline.sh scales to that need (its own reading),
    // here capped at 4 by its ceiling and raised to 2 by its floor.
    let scaled = env.path().join("scaled");
    let script = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docker/scale-to-deadline.sh"
    ))
    .arg("--once")
    .env(
        "BATCHFLEET",
        format!(
            "{} --redis-prefix {}",
            coordinator_bin().display(),
            env.prefix
        ),
    )
    .env("BATCHFLEET_REDIS_URL", env.redis.url.expose())
    .env("BATCHFLEET_AMQP_URL", env.amqp.url.expose())
    .env("POOL", &env.pool)
    .env("MIN_WORKERS", "2")
    .env("MAX_WORKERS", "4")
    .env("SCALE", format!("echo %d > {}", scaled.display()))
    .output()
    .expect("scale-to-deadline.sh");
    assert!(
        script.status.success(),
        "{}",
        String::from_utf8_lossy(&script.stderr)
    );
    let count: u32 = std::fs::read_to_string(&scaled)
        .expect("the scale command ran")
        .trim()
        .parse()
        .expect("a count");
    let said = String::from_utf8_lossy(&script.stdout).into_owned();
    let advised: u32 = said
        .split("needs ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no need in {said:?}"));
    assert!(advised >= 1, "{said}");
    assert_eq!(count, advised.clamp(2, 4), "{said}");

    // Five more come: the need falls below its peak.
    let peak = *rising.last().expect("a need");
    workers.extend((3..8).map(|i| env.spawn_worker(&format!("d{i}"), &slow)));
    env.wait_for_consumers(6, &mut workers).await;
    // (Above 0: a finished job needs nothing, which is not the point here.)
    let falling = watch(&prom, &need, Duration::from_secs(40), |v| {
        v > 0.0 && v < peak
    })
    .await;

    // The job ends; its summary has its cost and whether it was on time.
    let out = coordinator.wait_with_output().expect("coordinator");
    assert!(
        out.status.success(),
        "{}",
        std::fs::read_to_string(env.path().join("coordinator.log")).unwrap_or_default()
    );
    let coordinator_log =
        std::fs::read_to_string(env.path().join("coordinator.log")).unwrap_or_default();
    assert!(
        coordinator_log.contains("will miss its deadline"),
        "{coordinator_log}"
    );
    let outcome: serde_json::Value = serde_json::from_slice(&out.stdout).expect("run --json");
    let job_id = outcome["job_id"].as_str().expect("job id").to_owned();
    let summary: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            env.path()
                .join("out")
                .join(batchfleet_shared::output::SUMMARY_FILE),
        )
        .expect("summary"),
    )
    .expect("summary json");
    let o = &summary["outlook"];
    let hours = o["worker_hours"].as_f64().expect("worker hours");
    // Between one and eight workers for the job's whole wall time.
    let wall_h = summary["duration_s"].as_f64().expect("duration") / 3600.0;
    assert!(
        hours > 0.5 * wall_h && hours < 8.0 * wall_h,
        "{o} over {wall_h} h"
    );
    let cost = o["cost"].as_f64().expect("cost");
    assert!((cost - hours * 1.2).abs() < 1e-9, "{o}");
    let per_million = o["cost_per_million_rows"].as_f64().expect("per million");
    assert!((per_million - cost / 24_000.0 * 1e6).abs() < 1e-6, "{o}");
    let finished = summary["finished_at_ms"].as_u64().expect("finished");
    let deadline_ms = summary["started_at_ms"].as_u64().expect("started") + 45_000;
    assert_eq!(o["late"], finished > deadline_ms, "{o}");
    eprintln!("need with 3 workers {before}; with 1: {rising:?}; with 6: {falling:?}; {o}");
    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}
