//! `batchfleet-loadtest`: jobs and models generated, outputs verified, the
//! fleet measured against the machine's ceilings, and fault runs on
//! services and clusters of their own. Everything tests share lives in the
//! test kit (`loadtest/testkit`); this binary links libtorch.
//!
//! # Layout
//! - [`cli`]: the command line, one struct per command with its `run`.
//! - [`fleet`]: worker processes, a job run to its summary, CPU per part.
//! - [`bench`]: the fleet against the compute and I/O ceilings, the control
//!   plane and memory; with [`startbench`] (how long a new job waits),
//!   [`textbench`] (a sentence encoder),
//!   [`formatbench`] (TorchScript against a `.pt2` package) and [`planning`]
//!   (planning time by file count and size).
//! - [`forward`]: the compute ceiling: libtorch `forward` on rows in memory.
//! - [`gpu`]: `gpu-check`, the fleet against raw `forward` on a GPU.
//! - [`scale`]: what one RabbitMQ and one Redis carry as the fleet grows.
//! - [`chaos`]: a job while workers, the coordinator, RabbitMQ and Redis are
//!   killed.
//! - [`soak`]: a long stream of jobs of many models on workers restarted as
//!   a supervisor would, with crashing items and, with `--faults`, Redis
//!   restarted empty, queues deleted and forged dead letters replayed.
//!   [`fleetsoak`] (`soak --simulated`): hundreds of workers, many to a
//!   process ([`simworkers`]), and many jobs at once, measured per item.
//! - [`fault`]: what every fault run shares — the job, the worker settings,
//!   processes, the flags of the runs on clusters of their own, the checks.
//! - [`cluster`]: a three-node RabbitMQ cluster losing the queue's leader.
//! - [`sentinel`]: Redis Sentinel failovers, one losing writes.
//! - [`rediscluster`]: jobs on a Redis Cluster.
//! - [`slurm`]: a job through the Slurm templates on a cluster of its own.

use clap::Parser;

mod bench;
mod chaos;
mod cli;
mod cluster;
mod fault;
mod fleet;
mod fleetsoak;
mod formatbench;
mod forward;
mod gpu;
mod gpulocal;
mod planning;
mod rediscluster;
mod scale;
mod sentinel;
mod simworkers;
mod slurm;
mod soak;
mod startbench;
mod textbench;

fn main() -> std::process::ExitCode {
    // Before any libtorch call (gpu-check needs CUDA where there is a GPU).
    let cuda = batchfleet_shared::cuda::load(option_env!("BATCHFLEET_LIBTORCH_LIB"));
    if let batchfleet_shared::cuda::CudaSupport::Failed(why) = &cuda {
        eprintln!("warning: CUDA devices are unavailable: {why}");
    }
    match cli::Cli::parse().command.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The error with its backtrace (when RUST_BACKTRACE asks for
            // one), then the error alone again as the last line, so that a
            // log's tail names what failed.
            eprintln!("{e:?}");
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
