//! Prometheus metrics: the `/metrics` endpoint every binary can serve, the
//! names and HELP texts of every metric (so code, dashboard and docs cannot
//! drift), the histogram buckets, and the standard `process_*` metrics
//! (the `metrics-process` crate).
//!
//! Names follow `batchfleet_<component>_<what>_<unit>`. Labels are bounded
//! (`batch_job`, `pool`, `model`, `class`, `state` — never item ids), and a
//! series not updated for `--metrics-idle-timeout` is dropped, so a
//! long-lived process does not keep every finished job's series. The job
//! label is `batch_job`, not `job`: `job` is Prometheus's own target label,
//! which a scrape without `honor_labels` would turn into `exported_job`. The
//! full list with types and meanings is in `docs/metrics.md`.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Where to serve `/metrics` (every binary takes these flags).
#[derive(Debug, Clone, clap::Args)]
pub struct MetricsArgs {
    /// Port of the Prometheus `/metrics` endpoint; 0 = no endpoint.
    #[arg(
        long,
        env = "BATCHFLEET_METRICS_PORT",
        default_value_t = 0,
        global = true
    )]
    pub metrics_port: u16,
    /// Address the metrics endpoint listens on.
    #[arg(
        long,
        env = "BATCHFLEET_METRICS_HOST",
        default_value = "0.0.0.0",
        global = true
    )]
    pub metrics_host: IpAddr,
    /// Drop a series not updated for this long (a finished job's), so a
    /// long-lived worker or `batchfleet supervise` exports only recent jobs.
    #[arg(
        long,
        env = "BATCHFLEET_METRICS_IDLE_TIMEOUT",
        default_value = "15m",
        value_parser = humantime::parse_duration,
        global = true
    )]
    pub metrics_idle_timeout: Duration,
}

/// The label naming a batch job (`job` is Prometheus's target label).
pub const JOB_LABEL: &str = "batch_job";

/// Every metric batchfleet defines, by name.
pub mod names {
    /// Worker: rows predicted (counter; job, pool, model).
    pub const WORKER_ROWS_PROCESSED: &str = "batchfleet_worker_rows_processed_total";
    /// Worker: rows rejected (counter; job, pool, model).
    pub const WORKER_ROWS_REJECTED: &str = "batchfleet_worker_rows_rejected_total";
    /// Worker: items committed by this worker (counter; job, pool, model).
    pub const WORKER_ITEMS_COMPLETED: &str = "batchfleet_worker_items_completed_total";
    /// Worker: failed item attempts (counter; job, pool, class).
    pub const WORKER_ITEMS_FAILED: &str = "batchfleet_worker_items_failed_total";
    /// Worker: items re-published for a later attempt (counter; job, pool, class).
    pub const WORKER_ITEMS_RETRIED: &str = "batchfleet_worker_items_retried_total";
    /// Worker: items dead-lettered (counter; job, pool, class).
    pub const WORKER_ITEMS_DEAD_LETTERED: &str = "batchfleet_worker_items_dead_lettered_total";
    /// Worker: items held now (gauge; pool).
    pub const WORKER_ITEMS_IN_FLIGHT: &str = "batchfleet_worker_items_in_flight";
    /// Worker: time from publish to delivery (histogram, seconds; pool).
    pub const WORKER_QUEUE_WAIT: &str = "batchfleet_worker_queue_wait_seconds";
    /// Worker: reading and parsing an item's rows (histogram, seconds; pool).
    pub const WORKER_READ: &str = "batchfleet_worker_read_seconds";
    /// Worker: tokenizing an item's texts (histogram, seconds; pool).
    pub const WORKER_TOKENIZE: &str = "batchfleet_worker_tokenize_seconds";
    /// Worker: one `forward` call (histogram, seconds; pool).
    pub const WORKER_INFERENCE: &str = "batchfleet_worker_inference_seconds";
    /// Worker: writing and publishing a part or segment file (histogram, seconds; pool).
    pub const WORKER_WRITE: &str = "batchfleet_worker_write_seconds";
    /// Worker: time an item's rows (or a checkpoint segment of them) kept
    /// the model's device busy, from the first mini-batch sent to the last
    /// output back (histogram, seconds; device). The rate of its sum is the
    /// share of time the device was busy.
    pub const WORKER_DEVICE_SECONDS: &str = "batchfleet_worker_device_seconds";
    /// Worker: rows per `forward` call (histogram, rows; pool).
    pub const WORKER_BATCH_SIZE: &str = "batchfleet_worker_batch_size_rows";
    /// Worker: items committed by one Redis call (histogram, items; pool).
    pub const WORKER_COMMIT_GROUP: &str = "batchfleet_worker_commit_group_items";
    /// Worker: items started, by how (`quick`: a first delivery checked
    /// against the job's facts, no Redis request; `checked`: the start
    /// script) (counter; pool, how).
    pub const WORKER_ITEM_STARTS: &str = "batchfleet_worker_item_starts_total";
    /// Worker: work messages taken from the broker, a bundle counted once
    /// (counter; pool).
    pub const WORKER_MESSAGES: &str = "batchfleet_worker_messages_received_total";
    /// Worker: bundles (several items in one message) received, by how
    /// (`opened`: worked; `split`: it came back, its items published one
    /// by one) (counter; pool, how).
    pub const WORKER_BUNDLES: &str = "batchfleet_worker_bundles_total";
    /// Worker: notices heard on its pool's notice exchange (counter; kind = start, end, refused).
    pub const WORKER_NOTICES: &str = "batchfleet_worker_notices_total";
    /// Any process: fsyncs and filesystem syncs made, by what was synced
    /// (`file`, `folder`, `filesystem`: one sync shared by the files a
    /// worker wrote side by side) (counter; what).
    pub const SYNCS: &str = "batchfleet_syncs_total";
    /// Worker: models kept loaded (gauge; pool).
    pub const WORKER_MODELS_LOADED: &str = "batchfleet_worker_models_loaded";
    /// Worker: bytes of the models it keeps loaded, parameters or file (gauge).
    pub const WORKER_MODELS_BYTES: &str = "batchfleet_worker_models_loaded_bytes";
    /// Worker: loading a model (histogram, seconds; pool).
    pub const WORKER_MODEL_LOAD: &str = "batchfleet_worker_model_load_seconds";
    /// Every process serving metrics: 1, with the batchfleet version
    /// (gauge; version).
    pub const BUILD_INFO: &str = "batchfleet_build_info";
    /// Worker: 1 while running (gauge; pool).
    pub const WORKER_UP: &str = "batchfleet_worker_up";
    /// Worker: 1 while draining after SIGTERM (gauge; pool).
    pub const WORKER_DRAINING: &str = "batchfleet_worker_draining";
    /// Worker: unacknowledged deliveries it holds at most now, sized from its item rate (gauge; pool).
    pub const WORKER_PREFETCH: &str = "batchfleet_worker_prefetch";
    /// Worker: job queues of its pool it consumes now, one per active job (gauge; pool).
    pub const WORKER_JOB_QUEUES: &str = "batchfleet_worker_job_queues";
    /// Worker: GPU memory in use (gauge, bytes; gpu).
    pub const WORKER_GPU_MEMORY: &str = "batchfleet_worker_gpu_memory_used_bytes";
    /// Worker: share of the last sample period a GPU ran kernels, as the
    /// driver reports it (gauge, 0–1; gpu).
    pub const WORKER_GPU_UTILIZATION: &str = "batchfleet_worker_gpu_utilization_ratio";
    /// Worker: panics caught while handling an item (counter; where = item, runner).
    pub const WORKER_PANICS: &str = "batchfleet_worker_panics_total";
    /// Worker: reads and writes of an item given up at its `item_timeout`
    /// (counter; step = read, write).
    pub const WORKER_STALLED_IO: &str = "batchfleet_worker_stalled_io_total";
    /// Worker: messages refused before any work, dead-lettered as `rejected` (counter; reason).
    pub const WORKER_MESSAGES_REJECTED: &str = "batchfleet_worker_messages_rejected_total";
    /// Worker: items handed back untouched for other workers (counter; class = unable, disk_full, unknown_job, waiting).
    pub const WORKER_ITEMS_HANDED_BACK: &str = "batchfleet_worker_items_handed_back_total";
    /// Worker: jobs this worker leaves to others for now (gauge).
    pub const WORKER_JOBS_BENCHED: &str = "batchfleet_worker_jobs_benched";
    /// Worker: 1 while it has stopped consuming because its output disk is full (gauge).
    pub const WORKER_PAUSED: &str = "batchfleet_worker_paused";
    /// Worker: items the broker dead-lettered at the delivery limit, recorded failed (counter; job).
    pub const WORKER_BROKER_DEAD_LETTERS: &str = "batchfleet_worker_broker_dead_letters_total";
    /// Worker: its broker session lost (connection or consuming channel
    /// closed) and opened again (counter).
    pub const WORKER_BROKER_RECONNECTS: &str = "batchfleet_worker_broker_reconnects_total";
    /// Coordinator: items of a job by state planned/done/failed (gauge; job, pool, state).
    pub const JOB_ITEMS: &str = "batchfleet_coordinator_job_items";
    /// Coordinator: rows of a job by state planned/done (gauge; job, pool, state).
    pub const JOB_ROWS: &str = "batchfleet_coordinator_job_rows";
    /// Coordinator: rows settled per second since the job started (gauge; job, pool).
    pub const JOB_ROWS_PER_SECOND: &str = "batchfleet_coordinator_job_rows_per_second";
    /// Coordinator: estimated seconds to completion (gauge; job, pool).
    pub const JOB_ETA: &str = "batchfleet_coordinator_job_eta_seconds";
    /// Coordinator: items held by workers now (gauge; job, pool).
    pub const JOB_IN_FLIGHT: &str = "batchfleet_coordinator_job_items_in_flight";
    /// Coordinator: items published again (gauge; job, pool).
    pub const JOB_REDISPATCHED: &str = "batchfleet_coordinator_job_items_redispatched";
    /// Coordinator: seconds since the job was registered, final once done (gauge; job, pool).
    pub const JOB_DURATION: &str = "batchfleet_coordinator_job_duration_seconds";
    /// Coordinator: 1 once the job is settled (gauge; job, pool).
    pub const JOB_FINISHED: &str = "batchfleet_coordinator_job_finished";
    /// Coordinator: workers the pool needs to finish every job of it that
    /// has a deadline on time (gauge; pool). Each coordinator supervising
    /// a job of the pool exports it: read it with `max by (pool)`.
    pub const POOL_WORKERS_NEEDED: &str = "batchfleet_pool_workers_needed";
    /// Coordinator: workers the pool needs for this job to finish by its deadline (gauge; job, pool).
    pub const JOB_WORKERS_NEEDED: &str = "batchfleet_coordinator_job_workers_needed";
    /// Coordinator: 1 while the job would finish after its deadline at the fleet's size (gauge; job, pool).
    pub const JOB_DEADLINE_LATE: &str = "batchfleet_coordinator_job_deadline_late";
    /// Coordinator: seconds until the job's deadline, 0 once past (gauge; job, pool).
    pub const JOB_DEADLINE_SECONDS_LEFT: &str = "batchfleet_coordinator_job_deadline_seconds_left";
    /// Coordinator: worker-seconds the job has used, its share of its pool (gauge; job, pool).
    pub const JOB_WORKER_SECONDS: &str = "batchfleet_coordinator_job_worker_seconds";
    /// Coordinator: what the job has cost so far at `[job] worker_hour_cost` (gauge; job, pool).
    pub const JOB_COST: &str = "batchfleet_coordinator_job_cost";

    /// A worker's gauges with no labels of their own: they change rarely
    /// (`up` is set once), so the process touches them to keep them from
    /// the idle timeout.
    pub const WORKER_OWN_GAUGES: &[&str] = &[
        WORKER_ITEMS_IN_FLIGHT,
        WORKER_UP,
        WORKER_DRAINING,
        WORKER_PREFETCH,
        WORKER_JOB_QUEUES,
        WORKER_JOBS_BENCHED,
        WORKER_PAUSED,
        WORKER_MODELS_LOADED,
        WORKER_MODELS_BYTES,
    ];

    /// Every metric above with its type and its HELP text.
    pub const ALL: &[(&str, Kind, &str)] = &[
        (WORKER_ROWS_PROCESSED, Kind::Counter, "Rows this worker predicted, by batch job and model."),
        (WORKER_ROWS_REJECTED, Kind::Counter, "Rows this worker rejected into _rejects/ (bad rows, rows the model raised on), by batch job and model."),
        (WORKER_ITEMS_COMPLETED, Kind::Counter, "Work items this worker committed, by batch job and model."),
        (WORKER_ITEMS_FAILED, Kind::Counter, "Failed item attempts, by batch job and failure class."),
        (WORKER_ITEMS_RETRIED, Kind::Counter, "Items published again for a later attempt (backoff), by batch job and failure class."),
        (WORKER_ITEMS_DEAD_LETTERED, Kind::Counter, "Items dead-lettered by this worker, by batch job and failure class."),
        (WORKER_ITEMS_IN_FLIGHT, Kind::Gauge, "Work items this worker holds now."),
        (WORKER_QUEUE_WAIT, Kind::Histogram, "Seconds from an item's publish to its delivery to this worker."),
        (WORKER_READ, Kind::Histogram, "Seconds spent reading and parsing one item's rows (tokenizing included)."),
        (WORKER_TOKENIZE, Kind::Histogram, "Seconds spent tokenizing one item's texts."),
        (WORKER_INFERENCE, Kind::Histogram, "Seconds of one forward call."),
        (WORKER_DEVICE_SECONDS, Kind::Histogram, "Seconds an item's rows (or a checkpoint segment) kept the model's device busy, by device; the rate of its sum is the device's busy share."),
        (WORKER_WRITE, Kind::Histogram, "Seconds spent writing and publishing one part or segment file."),
        (WORKER_BATCH_SIZE, Kind::Histogram, "Rows per forward call."),
        (WORKER_COMMIT_GROUP, Kind::Histogram, "Items committed together by one Redis call (group commit)."),
        (SYNCS, Kind::Counter, "Syncs to disk this process made, by what: file (one file's fsync), folder (a folder's fsync, making new names durable), filesystem (one syncfs for the part files a worker wrote side by side)."),
        (WORKER_MODELS_LOADED, Kind::Gauge, "Models this worker keeps loaded (at most --models-kept; the least recently used is dropped past it)."),
        (WORKER_MODELS_BYTES, Kind::Gauge, "Bytes of the models the worker keeps loaded (parameters, or the file when larger)."),
        (WORKER_MESSAGES, Kind::Counter, "Work messages taken from the broker (a bundle of several items counts once)."),
        (WORKER_BUNDLES, Kind::Counter, "Bundles (several items in one message) received, by how: opened (its items worked side by side, the bundle acknowledged once all are settled) or split (it came back, and its items were published one by one)."),
        (WORKER_NOTICES, Kind::Counter, "Notices heard on the pool's notice exchange, by kind: start (a job announced: its queue consumed at once), end (a job ended: its queue let go and its facts forgotten at once), refused (an end notice stale, unsigned or forged where the pool's messages are signed; ignored)."),
        (WORKER_ITEM_STARTS, Kind::Counter, "Items started, by how: quick (a first delivery checked against the job's facts, no Redis request, no lease until its first heartbeat) or checked (the start script)."),
        (WORKER_MODEL_LOAD, Kind::Histogram, "Seconds spent loading a model."),
        (BUILD_INFO, Kind::Gauge, "1, labelled with the batchfleet version this process runs (and component)."),
        (WORKER_UP, Kind::Gauge, "1 while the worker runs."),
        (WORKER_DRAINING, Kind::Gauge, "1 while the worker drains after SIGTERM."),
        (WORKER_PREFETCH, Kind::Gauge, "Unacknowledged deliveries the worker holds at most now, sized from its item rate."),
        (WORKER_JOB_QUEUES, Kind::Gauge, "Job queues of the pool the worker consumes now that send it work (at most --job-queues; a subscription to an emptied queue, dormant, is not counted)."),
        (WORKER_GPU_MEMORY, Kind::Gauge, "GPU memory in use (NVML), by GPU index."),
        (WORKER_GPU_UTILIZATION, Kind::Gauge, "Share of the last sample period a GPU ran kernels (NVML), by GPU index."),
        (WORKER_PANICS, Kind::Counter, "Panics caught while handling an item, by where (item, runner)."),
        (WORKER_STALLED_IO, Kind::Counter, "Reads and writes of an item given up at its item_timeout (a stalled mount), by step (read, write)."),
        (WORKER_MESSAGES_REJECTED, Kind::Counter, "Messages refused before any work and dead-lettered as rejected, by reason."),
        (WORKER_ITEMS_HANDED_BACK, Kind::Counter, "Items handed back untouched for other workers, by class (unable, disk_full, unknown_job, waiting)."),
        (WORKER_JOBS_BENCHED, Kind::Gauge, "Jobs this worker leaves to other workers for now."),
        (WORKER_PAUSED, Kind::Gauge, "1 while the worker has stopped consuming because its output disk is full."),
        (WORKER_BROKER_DEAD_LETTERS, Kind::Counter, "Items the broker dead-lettered at the delivery limit, recorded failed, by batch job."),
        (WORKER_BROKER_RECONNECTS, Kind::Counter, "Times the worker lost its broker session (its connection, or a channel the broker closed) and opened it again."),
        (JOB_ITEMS, Kind::Gauge, "Items of a batch job by state (planned, done, failed)."),
        (JOB_ROWS, Kind::Gauge, "Rows of a batch job by state (planned, done)."),
        (JOB_ROWS_PER_SECOND, Kind::Gauge, "Rows settled per second since the batch job started."),
        (JOB_ETA, Kind::Gauge, "Estimated seconds until the batch job is done."),
        (JOB_IN_FLIGHT, Kind::Gauge, "Items of the batch job held by workers now."),
        (JOB_REDISPATCHED, Kind::Gauge, "Items of the batch job published again (dead workers, stragglers, lost messages)."),
        (JOB_DURATION, Kind::Gauge, "Seconds since the batch job was registered; final once it is done."),
        (JOB_FINISHED, Kind::Gauge, "1 once the batch job is settled."),
        (POOL_WORKERS_NEEDED, Kind::Gauge, "Workers the pool needs to finish its jobs with deadlines on time, the pool shared as now (max over coordinators)."),
        (JOB_WORKERS_NEEDED, Kind::Gauge, "Workers the pool needs for the batch job to finish by its deadline."),
        (JOB_DEADLINE_LATE, Kind::Gauge, "1 while the batch job would finish after its deadline at the fleet's current size."),
        (JOB_DEADLINE_SECONDS_LEFT, Kind::Gauge, "Seconds until the batch job's deadline."),
        (JOB_WORKER_SECONDS, Kind::Gauge, "Worker-seconds the batch job has used (its share of its pool)."),
        (JOB_COST, Kind::Gauge, "What the batch job has cost so far at its worker_hour_cost."),
    ];

    /// A metric's Prometheus type.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        /// Only goes up; name ends in `_total`.
        Counter,
        /// Goes up and down.
        Gauge,
        /// Bucketed observations (`_bucket`, `_sum`, `_count` series).
        Histogram,
    }
}

/// Buckets of the stage timings: 0.5 ms to 30 s.
pub const STAGE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Buckets of the queue wait: 10 ms to 1 h.
pub const QUEUE_WAIT_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];
/// Buckets of mini-batch sizes: 1 to 16384 rows.
pub const BATCH_BUCKETS: &[f64] = &[
    1.0, 8.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// Buckets of commit group sizes: 1 to 64 items.
pub const GROUP_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];
/// Buckets of model load times: 10 ms to 2 min.
pub const LOAD_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 120.0];

/// Starts the `/metrics` endpoint (unless the port is 0) and the process
/// metrics. `component` (`worker`, `coordinator`) and `extra` become labels
/// on every metric of this process; `keep` are this process's own gauges
/// without labels of their own (`batchfleet_worker_up`, …), kept from the
/// idle timeout. Returns the address served.
pub fn install(
    args: &MetricsArgs,
    component: &str,
    extra: &[(&str, String)],
    keep: &'static [&'static str],
) -> Result<Option<SocketAddr>, String> {
    if args.metrics_port == 0 {
        return Ok(None);
    }
    let addr = SocketAddr::new(args.metrics_host, args.metrics_port);
    let mut builder = PrometheusBuilder::new()
        .with_http_listener(addr)
        .idle_timeout(
            metrics_util::MetricKindMask::ALL,
            Some(args.metrics_idle_timeout),
        )
        .add_global_label("component", component);
    for (k, v) in extra {
        builder = builder.add_global_label(*k, v.clone());
    }
    let buckets = [
        (names::WORKER_QUEUE_WAIT, QUEUE_WAIT_BUCKETS),
        (names::WORKER_READ, STAGE_BUCKETS),
        (names::WORKER_TOKENIZE, STAGE_BUCKETS),
        (names::WORKER_INFERENCE, STAGE_BUCKETS),
        (names::WORKER_DEVICE_SECONDS, STAGE_BUCKETS),
        (names::WORKER_WRITE, STAGE_BUCKETS),
        (names::WORKER_BATCH_SIZE, BATCH_BUCKETS),
        (names::WORKER_COMMIT_GROUP, GROUP_BUCKETS),
        (names::WORKER_MODEL_LOAD, LOAD_BUCKETS),
    ];
    for (name, b) in buckets {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(name.to_owned()), b)
            .map_err(|e| format!("metric buckets for {name}: {e}"))?;
    }
    // The listener needs a Tokio runtime: the binaries call this from main.
    builder
        .install()
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    describe();
    let process = metrics_process::Collector::default();
    process.describe();
    tokio::spawn(sample_process(process, keep, Duration::from_secs(5)));
    tracing::info!(%addr, "serving Prometheus metrics");
    Ok(Some(addr))
}

/// Gives every batchfleet metric its HELP text (and so its TYPE line).
fn describe() {
    for (name, kind, help) in names::ALL {
        match kind {
            names::Kind::Counter => metrics::describe_counter!(*name, *help),
            names::Kind::Gauge => metrics::describe_gauge!(*name, *help),
            names::Kind::Histogram => metrics::describe_histogram!(*name, *help),
        }
    }
}

/// Collects the standard process metrics (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, open fds, threads, …) and touches the
/// process's own gauges, which change rarely but must not go idle.
async fn sample_process(
    process: metrics_process::Collector,
    keep: &'static [&'static str],
    every: Duration,
) {
    loop {
        process.collect();
        for name in keep {
            metrics::gauge!(*name).increment(0.0);
        }
        // Set every round, so the idle timeout never drops it.
        metrics::gauge!(names::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        tokio::time::sleep(every).await;
    }
}

/// CPU seconds (user + system) from a `/proc/<pid>/stat` file: the
/// process's own, or with `children` those of its children that ended and
/// were waited for (`cutime` + `cstime`).
pub fn stat_cpu_s(stat_file: &str, children: bool) -> Option<f64> {
    let stat = std::fs::read_to_string(stat_file).ok()?;
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime, stime, cutime, cstime are fields 14–17 of the file (index 11–14
    // here), in clock ticks: USER_HZ, which Linux fixes at 100 for /proc.
    let at = if children { 13 } else { 11 };
    let ticks = fields.get(at)?.parse::<f64>().ok()? + fields.get(at + 1)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_convention_are_unique_and_documented() {
        let docs =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
                .expect("docs/metrics.md");
        let mut seen = std::collections::HashSet::new();
        for (n, kind, help) in names::ALL {
            assert!(
                help.len() > 10 && help.ends_with('.'),
                "{n}: a HELP sentence"
            );
            assert!(n.starts_with("batchfleet_"), "{n}");
            assert!(seen.insert(*n), "{n} twice");
            assert_eq!(
                n.ends_with("_total"),
                *kind == names::Kind::Counter,
                "{n}: only counters end in _total"
            );
            if *kind == names::Kind::Histogram {
                assert!(
                    n.ends_with("_seconds") || n.ends_with("_rows") || n.ends_with("_items"),
                    "{n}: a histogram names its unit"
                );
            }
            assert!(
                docs.contains(&format!("`{n}`")),
                "{n} is not in docs/metrics.md"
            );
        }
    }

    #[test]
    fn stat_cpu_s_reads_a_process_and_its_ended_children() {
        assert!(stat_cpu_s("/proc/self/stat", false).is_some_and(|s| s >= 0.0));
        // A child that burns CPU counts among the ended children once waited for.
        let before = stat_cpu_s("/proc/self/stat", true).expect("children");
        let status = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"])
            .status()
            .expect("sh");
        assert!(status.success());
        let after = stat_cpu_s("/proc/self/stat", true).expect("children");
        assert!(after > before, "children's CPU {before} → {after}");
    }
}

#[cfg(test)]
mod dashboard_tests {
    use super::names;

    /// Every PromQL expression of the Grafana dashboard.
    pub fn dashboard_queries() -> Vec<String> {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docker/grafana/dashboards/batchfleet.json"
        ))
        .expect("dashboard file");
        let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is valid JSON");
        let mut out = Vec::new();
        for p in dash["panels"].as_array().expect("panels") {
            for t in p["targets"].as_array().into_iter().flatten() {
                out.push(t["expr"].as_str().expect("expr").to_owned());
            }
        }
        out
    }

    #[test]
    fn every_panel_query_names_only_metrics_the_code_defines() {
        let queries = dashboard_queries();
        assert!(queries.len() >= 20, "{} queries", queries.len());
        let defined: Vec<&str> = names::ALL.iter().map(|(n, ..)| *n).collect();
        let mut used = std::collections::BTreeSet::new();
        for q in &queries {
            let mut rest = q.as_str();
            while let Some(at) = rest.find("batchfleet_") {
                let tail = &rest[at..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(tail.len());
                let name = &tail[..end];
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|b| defined.contains(b)))
                    .unwrap_or(name);
                assert!(
                    defined.contains(&base),
                    "{q} names {name}, which the code does not define"
                );
                used.insert(base.to_owned());
                rest = &tail[end..];
            }
        }
        // The dashboard shows (nearly) everything there is.
        for (n, ..) in names::ALL {
            assert!(used.contains(*n), "{n} is on no dashboard panel");
        }
    }
}
