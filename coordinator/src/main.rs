use clap::Parser;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    batchfleet_coordinator::cli::main(batchfleet_coordinator::cli::Cli::parse()).await
}
