use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(run());
    // A read or write stuck in the kernel (a hung network mount) holds
    // its blocking thread after its item timed out: not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

async fn run() -> ExitCode {
    let mut cfg = batchfleet_worker::WorkerConfig::parse();
    cfg.services.init_logging();
    if let Some(notice) = batchfleet_shared::paths::legacy_data_roots(&mut cfg.data_roots) {
        tracing::warn!("{notice}");
    }
    // Before any libtorch call.
    batchfleet_shared::cuda::log(&batchfleet_shared::cuda::load(option_env!(
        "BATCHFLEET_LIBTORCH_LIB"
    )));
    let shutdown = batchfleet_shared::shutdown::on_signals();
    match batchfleet_worker::run(cfg, shutdown).await {
        Ok(batchfleet_worker::Exit::Clean) => ExitCode::SUCCESS,
        Ok(batchfleet_worker::Exit::Restart(reason)) => {
            eprintln!("restart requested: {reason}");
            ExitCode::from(batchfleet_worker::EXIT_RESTART)
        }
        Err(e) if batchfleet_worker::is_permanent(&e) => {
            eprintln!("error: {e:#}");
            eprintln!(
                "(exit {}: a restart cannot help; fix the setting named above)",
                batchfleet_worker::EXIT_CONFIG
            );
            ExitCode::from(batchfleet_worker::EXIT_CONFIG)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
