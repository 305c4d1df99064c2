use clap::Parser;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    // First: before any hook command can run as this user.
    batchfleet_coordinator::hooks::harden_process();
    batchfleet_coordinator::cli::main(batchfleet_coordinator::cli::Cli::parse()).await
}
