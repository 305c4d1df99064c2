//! A real job on two workers while a real Prometheus scrapes them and the
//! coordinator; then every query of the Grafana dashboard is evaluated
//! against that Prometheus and must return data, and the key figures must
//! agree with summary.json.
//!
//! Needs the `prometheus` binary (Debian package `prometheus`; `make test`
//! installs it). The coordinator runs in this process with its metrics
//! endpoint, so this test has a binary of its own.

#[allow(dead_code)]
#[path = "../it/support.rs"]
mod support;

use batchfleet_coordinator::{run_job, RunOutcome};
use batchfleet_loadtest::python::{make_job, JobGen};
use batchfleet_shared::metrics::MetricsArgs;
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
    fn start(dir: &std::path::Path, targets: &[u16]) -> Self {
        let port = free_port();
        let config = dir.join("prometheus.yml");
        let targets: Vec<String> = targets
            .iter()
            .map(|p| format!("\"127.0.0.1:{p}\""))
            .collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: batchfleet\n    honor_labels: true\n    static_configs:\n      - targets: [{}]\n",
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

fn dashboard_queries() -> Vec<String> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docker/grafana/dashboards/batchfleet.json"
    ))
    .expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("json");
    dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("expr").to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_and_agrees_with_the_summary() {
    let env = TestEnv::new("metrics");
    let name = batchfleet_loadtest::services::unique("metrics");
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
            item_rows: 2_000,
            batch_size: 500,
            ..JobGen::default()
        },
    )
    .expect("generate job");
    let manifest = env.path().join("job.toml");
    let (w1, w2, coord) = (free_port(), free_port(), free_port());
    let prom = Prometheus::start(env.path(), &[w1, w2, coord]);

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
        },
        "coordinator",
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
    let rows_q = format!("sum(batchfleet_worker_rows_processed_total{{job=\"{job_id}\"}})");
    let finished_q = format!("batchfleet_coordinator_job_finished{{job=\"{job_id}\"}}");
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
        // Text input's tokenizing time has no data on this numeric job; its
        // query must still be one Prometheus answers.
        let text_only = q.contains(batchfleet_shared::metrics::names::WORKER_TOKENIZE);
        match prom.query(&q) {
            Ok(r) if !r.is_empty() || text_only => {}
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

    // Key figures agree with summary.json.
    let job = format!("job=\"{job_id}\"");
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

    stop_all(&mut workers);
    env.cleanup(&[&job_id]).await;
}
