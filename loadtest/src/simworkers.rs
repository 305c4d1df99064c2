//! `batchfleet-loadtest sim-workers` (hidden; run by `soak --simulated`):
//! many workers in one process. Each is a whole [`batchfleet_worker::run`]
//! — its own RabbitMQ connection, its own Redis connection, its own model
//! runner thread and model cache, the same code a `batchfleet-worker`
//! process runs — and they share one tokio runtime and one metrics
//! endpoint, so that hundreds of workers fit in a few processes of a small
//! machine.

use anyhow::{bail, Context, Result};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;

/// Flags of `sim-workers`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimWorkersArgs {
    /// Workers in this process.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub count: usize,
    /// The workers' ids are `<ID_PREFIX>-<n>`.
    #[arg(long)]
    pub id_prefix: String,
    /// Each worker writes `<READY_DIR>/<its id>` once it consumes.
    #[arg(long)]
    pub ready_dir: PathBuf,
    /// Threads of the runtime the workers share.
    #[arg(long, default_value_t = 2)]
    pub runtime_threads: usize,
    /// `batchfleet-worker` flags every worker gets (after `--`). Their
    /// metrics endpoint (`--metrics-port`) is this process's, shared.
    #[arg(last = true)]
    pub worker_args: Vec<String>,
}

/// Runs the workers until SIGTERM or SIGINT, then drains them; an error
/// when any of them stopped on an error.
pub fn run(args: &SimWorkersArgs) -> Result<()> {
    let base = batchfleet_worker::WorkerConfig::try_parse_from(
        std::iter::once("batchfleet-worker".to_owned()).chain(args.worker_args.iter().cloned()),
    )
    .context("the workers' flags (after --)")?;
    base.services.init_logging();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.runtime_threads.max(1))
        .enable_all()
        .build()?;
    // The exporter's listener runs on the runtime.
    let entered = runtime.enter();
    batchfleet_worker::install_metrics(&base)?;
    std::fs::create_dir_all(&args.ready_dir)
        .with_context(|| format!("creating {}", args.ready_dir.display()))?;
    drop(entered);
    let failed = runtime.block_on(async {
        let shutdown = batchfleet_shared::shutdown::on_signals();
        let mut workers = tokio::task::JoinSet::new();
        for n in 0..args.count {
            let mut cfg = base.clone();
            let id = format!("{}-{n}", args.id_prefix);
            cfg.ready_file = Some(args.ready_dir.join(&id));
            cfg.worker_id = Some(id);
            // The endpoint is installed once, above.
            cfg.metrics.metrics_port = 0;
            workers.spawn(batchfleet_worker::run(cfg, shutdown.clone()));
        }
        let mut failed = Vec::new();
        while let Some(ended) = workers.join_next().await {
            match ended {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failed.push(format!("{e:#}")),
                Err(e) => failed.push(format!("panicked: {e}")),
            }
        }
        failed
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    if let Some(first) = failed.first() {
        bail!(
            "{} of {} workers stopped on an error; the first: {first}",
            failed.len(),
            args.count
        );
    }
    Ok(())
}
