//! The `batchfleet-loadtest` command line: one clap struct per command,
//! each with the `run` that does it; the job and fleet flags the fault runs
//! on clusters of their own share (`cluster`, `redis-failover`,
//! `redis-cluster`) are one flattened struct, [`fault::FaultJobArgs`], and
//! their pace [`fault::PaceArgs`]; a fault run's settings are its flags.

use crate::{
    bench, chaos, cluster, fleetsoak, forward, gpu, planning, rediscluster, scale, sentinel,
    simworkers, slurm, soak,
};
use anyhow::{bail, Result};
use batchfleet_testkit::{python, verify};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// batchfleet-loadtest: generate jobs, verify outputs, measure ceilings.
#[derive(Debug, Parser)]
#[command(name = "batchfleet-loadtest", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Generate CSV input, a TorchScript MLP, golden predictions and job.toml.
    Gen(GenArgs),
    /// Check a job's part files against golden predictions (exit 1 on any difference).
    Verify(VerifyArgs),
    /// Run a job on a worker fleet while killing workers (-9 and SIGTERM,
    /// alternating), the coordinator, RabbitMQ and Redis; check INV-ROWS,
    /// INV-ACCT and INV-FILES and compare the wall time with a fault-free
    /// run of the same job (exit 1 if an invariant is violated). Needs the
    /// release binaries (`make release`) and the local RabbitMQ and Redis,
    /// which it restarts.
    Chaos(chaos::ChaosConfig),
    /// Run rounds of jobs of many models for `--duration` (20 min) on a
    /// pool of workers restarted whenever they exit, beside a pool whose
    /// workers an item kills; with `--faults`, a worker killed -9 each
    /// round and in turn Redis restarted empty with the jobs queued, a
    /// running job's queue deleted, forged dead letters replayed. Checks
    /// every job's rows, counts and files, the crashing item dead-lettered
    /// as `crash`, the forged letters left dead, worker memory bounded and
    /// no job left running (exit 1 if not). Needs the release binaries and
    /// the local RabbitMQ and Redis, which it restarts.
    ///
    /// With `--simulated <WORKERS>` instead: a fleet of that many real
    /// workers, many to a process, running `--jobs` jobs of one-row items
    /// together on a model that does next to nothing; prints per item the
    /// Redis commands (script-inner ones included), Redis requests, AMQP
    /// messages and bytes, syncs and CPU by part, Redis's latency p99,
    /// spurious copies, broker sessions lost and the idle fleet's Redis
    /// commands per worker-second against the targets of docs/scaling.md;
    /// checks every job's rows, counts and files (exit 1 if not).
    Soak(soak::SoakConfig),
    /// Run `--count` workers in this process (for `soak --simulated`).
    #[command(hide = true)]
    SimWorkers(simworkers::SimWorkersArgs),
    /// Run a job on a RabbitMQ cluster of the run's own (nodes on loopback
    /// ports, clustered with `rabbitmqctl join_cluster`) while the node
    /// leading the job's quorum queue is killed mid-job and started again;
    /// check every row exactly once against PyTorch's, nothing
    /// dead-lettered, the queue replicated on three nodes and the workers
    /// of the killed node moved to another; report the wall time next to
    /// the same job on the healthy cluster (exit 1 on a violation). Needs
    /// the release binaries (`make release`), the Debian rabbitmq-server
    /// package and the local Redis.
    Cluster(cluster::ClusterConfig),
    /// Run a job three times on a Redis primary with a replica and three
    /// Sentinels of its own (loopback ports, nothing on disk), every
    /// process finding the primary through the Sentinels: without a fault;
    /// with the primary killed mid-job (kill -9; the Sentinels promote the
    /// replica; the old primary comes back empty as a replica); and with
    /// replication cut, items committed on the primary alone and a failover
    /// to the replica that missed them, whose lost commits the coordinator
    /// must find in the output files. Checks every row exactly once, the
    /// counts, nothing dead-lettered; prints the wall times side by side.
    /// Needs the release binaries, redis-server and the local RabbitMQ.
    RedisFailover(sentinel::SentinelConfig),
    /// Run two jobs on a Redis Cluster of three masters of its own
    /// (loopback ports, `redis-cli --cluster create`), every process given
    /// its nodes with `--redis-cluster`: every row exactly once, the counts,
    /// nothing dead-lettered, and every key of a job in one slot on one
    /// master. Needs the release binaries, redis-server and the local
    /// RabbitMQ.
    RedisCluster(rediscluster::RedisClusterConfig),
    /// A job through docker/slurm's templates on a single-node Slurm
    /// cluster of its own (MUNGE, slurmctld and slurmd as this run's
    /// processes, loopback only, two GPUs played by device nodes): two GPU
    /// worker tasks, the coordinator as a job with --dependency; one task
    /// reaches its time limit (--signal=B:TERM@60), the other is preempted
    /// with scancel --signal=TERM, a second array grows the fleet, and a
    /// higher-priority partition's job makes Slurm preempt one; checks
    /// every row exactly once, each stop a drain with exit 0 and a requeue,
    /// the workers cancelled at the end, sacct's record (slurmdbd on the
    /// local MariaDB, when it answers) and the daemons gone (exit 1 on a
    /// violation). Needs root, Slurm and MUNGE (make slurm-test installs
    /// them), the release binaries and the local RabbitMQ and Redis.
    Slurm(slurm::SlurmConfig),
    /// Measure what one RabbitMQ and one Redis carry as the fleet grows:
    /// jobs of one-row items with a model that does next to nothing on 1,
    /// 2, 4 … worker processes, then jobs of 10,000-row items; for each,
    /// items/s, Redis commands and bytes per item, AMQP messages and bytes
    /// per item, CPU per item of the workers, the coordinator, RabbitMQ and
    /// Redis, and where the items/s curve bends and what bends it — the
    /// inputs of docs/scaling.md. Figures only, no assertion on them. Needs
    /// the release binaries, the local RabbitMQ and Redis, and `ss`.
    Scale(ScaleArgs),
    /// Measure the fleet against the machine's ceilings, side by side: for a
    /// small (I/O-bound) and a large (compute-bound) MLP, the libtorch compute
    /// ceiling, the read+parse+write I/O ceiling, the fleet end to end and
    /// `batchfleet run --local` (W pipelines, and one of all cores) on the
    /// same data; then the control plane (one-row items/s vs raw RabbitMQ,
    /// CPU per item by process and the rate it allows on this machine's
    /// cores) and worker memory after 1k and 10k items; a sentence encoder
    /// over a text corpus against a Python loop and its compute ceiling.
    /// Needs the release binaries
    /// (`make release`) and the local RabbitMQ and Redis.
    Bench(BenchArgs),
    /// Measure planning alone (the `bench` planning figures): many small CSV
    /// files and one big one, locally and on a local S3 server, cut blind
    /// and by reading every record.
    Plan(PlanArgs),
    /// Measure raw in-process libtorch forward rows/s on CSV rows held in memory.
    Forward(ForwardArgs),
    /// On a machine with a GPU: the fleet's rows/s on the GPU next to raw
    /// libtorch forward on it, for a compute-bound and an I/O-bound model,
    /// and the share of the job the GPU sat idle (under four minutes). On a
    /// machine without one it says so and exits 0. With `--local`: no
    /// services, `run --local` against host-fed and device-resident forward
    /// (on the CPU where there is no GPU).
    GpuCheck(GpuCheckArgs),
}

/// A fault run's end: an error when an invariant was violated (each is
/// printed in the run's report).
fn held(violations: &[String]) -> Result<()> {
    if !violations.is_empty() {
        bail!("{} invariant violation(s)", violations.len());
    }
    Ok(())
}

impl Command {
    /// Runs the command.
    pub(crate) fn run(self) -> Result<()> {
        match self {
            Command::Gen(args) => args.run(),
            Command::Verify(args) => args.run(),
            Command::Chaos(cfg) => held(&chaos::run(&cfg)?.violations),
            Command::Soak(cfg) => match cfg.simulated {
                Some(workers) => held(&fleetsoak::run(&cfg, workers)?.violations),
                None => held(&soak::run(&cfg)?.violations),
            },
            Command::SimWorkers(args) => simworkers::run(&args),
            Command::Cluster(cfg) => held(&cluster::run(&cfg)?.violations),
            Command::RedisFailover(cfg) => held(&sentinel::run(&cfg)?.violations),
            Command::RedisCluster(cfg) => held(&rediscluster::run(&cfg)?.violations),
            Command::Slurm(cfg) => held(&slurm::run(&cfg)?.violations),
            Command::Scale(args) => args.run(),
            Command::Bench(args) => args.run(),
            Command::Plan(args) => args.run(),
            Command::Forward(args) => args.run(),
            Command::GpuCheck(args) => args.run(),
        }
    }
}

/// `Gen`'s flags (see [`Command::Gen`]).
#[derive(Debug, Args)]
pub(crate) struct GenArgs {
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
    /// Rows in all.
    #[arg(long, default_value_t = 200_000)]
    rows: u64,
    /// Input files.
    #[arg(long, default_value_t = 4)]
    files: u32,
    /// Features per row.
    #[arg(long, default_value_t = 32)]
    features: u32,
    /// Hidden width of the MLP.
    #[arg(long, default_value_t = 64)]
    hidden: u32,
    /// Model outputs per row.
    #[arg(long, default_value_t = 1)]
    outputs: u32,
    /// Job name written into job.toml.
    #[arg(long, default_value = "demo")]
    name: String,
    /// Pool written into job.toml.
    #[arg(long, default_value = "default")]
    pool: String,
    /// item_rows written into job.toml.
    #[arg(long, default_value_t = 10_000)]
    item_rows: u64,
    /// inference_batch_size written into job.toml.
    #[arg(long, default_value_t = 1024)]
    batch_size: u32,
}

impl GenArgs {
    fn run(self) -> Result<()> {
        let Self {
            out,
            rows,
            files,
            features,
            hidden,
            outputs,
            name,
            pool,
            item_rows,
            batch_size,
        } = self;
        python::make_job(
            &out,
            &python::JobGen {
                rows,
                files,
                features,
                hidden,
                outputs,
                seed: 7,
                name,
                pool,
                item_rows,
                batch_size,
                ..python::JobGen::default()
            },
        )
    }
}

/// `Verify`'s flags (see [`Command::Verify`]).
#[derive(Debug, Args)]
pub(crate) struct VerifyArgs {
    /// The job's output folder.
    #[arg(long)]
    output: PathBuf,
    /// Golden predictions (id plus score columns).
    #[arg(long)]
    golden: PathBuf,
    /// Allowed difference (absolute; relative above magnitude 1).
    #[arg(long, default_value_t = 1e-5)]
    tolerance: f64,
}

impl VerifyArgs {
    fn run(self) -> Result<()> {
        let Self {
            output,
            golden,
            tolerance,
        } = self;
        let v = verify::verify(&output, &golden, tolerance)?;
        println!("{}", v.describe());
        if !v.ok() {
            bail!("output does not match the golden predictions");
        }
        println!("verified: every row exactly once, every score within {tolerance:e}");
        Ok(())
    }
}

/// `Scale`'s flags (see [`Command::Scale`]).
#[derive(Debug, Args)]
pub(crate) struct ScaleArgs {
    /// Worker counts for the one-row jobs, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    workers: Vec<usize>,
    /// One-row items per job.
    #[arg(long, default_value_t = 5_000)]
    items: u64,
    /// Worker counts for the 10,000-row jobs.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    realistic_workers: Vec<usize>,
    /// Items per 10,000-row job.
    #[arg(long, default_value_t = 40)]
    realistic_items: u64,
    /// Rows per realistic item.
    #[arg(long, default_value_t = 10_000)]
    realistic_rows: u64,
    /// The short form for CI: 1, 2 and 4 workers, 3,000 one-row items,
    /// 2 workers on 10 items of 10,000 rows.
    #[arg(long)]
    quick: bool,
    /// Keep data, logs and scale.json here (default: a temporary folder).
    #[arg(long)]
    dir: Option<PathBuf>,
}

impl ScaleArgs {
    fn run(self) -> Result<()> {
        let Self {
            workers,
            items,
            realistic_workers,
            realistic_items,
            realistic_rows,
            quick,
            dir,
        } = self;
        let cfg = if quick {
            scale::ScaleConfig {
                workers: vec![1, 2, 4],
                items: 3_000,
                realistic_workers: vec![2],
                realistic_items: 10,
                realistic_rows,
                dir,
            }
        } else {
            scale::ScaleConfig {
                workers,
                items,
                realistic_workers,
                realistic_items,
                realistic_rows: realistic_rows.max(1),
                dir,
            }
        };
        scale::run(&cfg)?;
        Ok(())
    }
}

/// `Bench`'s flags (see [`Command::Bench`]).
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Rows of the small-model jobs (0 skips them).
    #[arg(long, default_value_t = 2_000_000)]
    small_rows: u64,
    /// Rows of the large-model job (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    large_rows: u64,
    /// One-row items of the control-plane job (0 skips it).
    #[arg(long, default_value_t = 50_000)]
    control_items: u64,
    /// Texts of the sentence-encoder job (fleet vs a Python loop vs the
    /// compute ceiling; 0 skips it).
    #[arg(long, default_value_t = 50_000)]
    text_rows: u64,
    /// Rows of the model-format comparison (one MLP as TorchScript and as
    /// an AOTInductor `.pt2`, in the worker's backend; 0 skips it).
    #[arg(long, default_value_t = 200_000)]
    pt2_rows: u64,
    /// Worker processes (each gets cores / workers libtorch threads).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Short form for CI: 200k small rows, 10k large rows, 12k items, 2k texts, 20k format rows, 5 job starts;
    /// planning on 1,000 files, 200 MB, and 100 files, 20 MB in S3.
    #[arg(long)]
    quick: bool,
    /// Planning: small CSV files of the many-files job (0: skip planning).
    #[arg(long, default_value_t = 10_000)]
    plan_files: usize,
    /// Planning: gigabytes of the one-big-file job.
    #[arg(long, default_value_t = 10.0)]
    plan_gb: f64,
    /// Planning on the local S3 server: files of the many-files job (0: skip S3).
    #[arg(long, default_value_t = 1_000)]
    plan_s3_files: usize,
    /// Planning on the local S3 server: megabytes of the big object (moto holds it in memory).
    #[arg(long, default_value_t = 1_000)]
    plan_s3_mb: u64,
    /// Keep data and logs here (default: a temporary folder).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// One-item jobs run one after another on an idle fleet and with `run
    /// --local`, timing how long a new job waits (0 skips it; 5 in the
    /// short form).
    #[arg(long, default_value_t = 10)]
    start_jobs: usize,
    /// Input formats to run the small-model job in besides CSV, on the
    /// same rows (rows/s per format side by side; `pandas`: CSV written by
    /// `DataFrame.to_csv`, full-precision floats); empty for none.
    #[arg(long, value_delimiter = ',', default_value = "jsonl,parquet,pandas")]
    formats: Vec<String>,
}

impl BenchArgs {
    fn run(self) -> Result<()> {
        let Self {
            small_rows,
            large_rows,
            control_items,
            text_rows,
            pt2_rows,
            workers,
            quick,
            plan_files,
            plan_gb,
            plan_s3_files,
            plan_s3_mb,
            dir,
            json,
            formats,
            start_jobs,
        } = self;
        let (small_rows, large_rows, control_items, text_rows, pt2_rows) = if quick {
            (200_000, 10_000, 12_000, 2_000, pt2_rows.min(20_000))
        } else {
            (small_rows, large_rows, control_items, text_rows, pt2_rows)
        };
        let planning = (plan_files > 0).then(|| {
            if quick {
                planning::PlanningConfig {
                    files: 1_000,
                    big_bytes: 200_000_000,
                    s3_files: 100,
                    s3_big_bytes: 20_000_000,
                    read: true,
                }
            } else {
                planning::PlanningConfig {
                    files: plan_files,
                    big_bytes: (plan_gb * 1e9) as u64,
                    s3_files: plan_s3_files,
                    s3_big_bytes: plan_s3_mb * 1_000_000,
                    read: true,
                }
            }
        });
        let start_jobs = if quick { start_jobs.min(5) } else { start_jobs };
        bench::run(&bench::BenchConfig {
            small_rows,
            large_rows,
            control_items,
            text_rows,
            pt2_rows,
            workers: workers.max(1),
            dir,
            json,
            formats: formats.into_iter().filter(|f| !f.is_empty()).collect(),
            planning,
            start_jobs,
        })?;
        Ok(())
    }
}

/// `Plan`'s flags (see [`Command::Plan`]).
#[derive(Debug, Args)]
pub(crate) struct PlanArgs {
    /// Small CSV files of the many-files job.
    #[arg(long, default_value_t = 10_000)]
    files: usize,
    /// Gigabytes of the one-big-file job.
    #[arg(long, default_value_t = 10.0)]
    gb: f64,
    /// Files of the many-files job in S3 (0: skip S3).
    #[arg(long, default_value_t = 1_000)]
    s3_files: usize,
    /// Megabytes of the big S3 object.
    #[arg(long, default_value_t = 1_000)]
    s3_mb: u64,
    /// Measure only the blind cut (planning by reading every record takes
    /// minutes on thousands of S3 objects).
    #[arg(long)]
    blind_only: bool,
    /// Work folder (default: a temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
}

impl PlanArgs {
    fn run(self) -> Result<()> {
        let Self {
            files,
            gb,
            s3_files,
            s3_mb,
            blind_only,
            dir,
        } = self;
        let tmp = tempfile::tempdir()?;
        let root = dir.unwrap_or_else(|| tmp.path().to_owned());
        std::fs::create_dir_all(&root)?;
        let figures = planning::run(
            planning::PlanningConfig {
                files,
                big_bytes: (gb * 1e9) as u64,
                s3_files,
                s3_big_bytes: s3_mb * 1_000_000,
                read: !blind_only,
            },
            &root,
        )?;
        println!("{}", serde_json::to_string_pretty(&figures)?);
        Ok(())
    }
}

/// `Forward`'s flags (see [`Command::Forward`]).
#[derive(Debug, Args)]
pub(crate) struct ForwardArgs {
    /// TorchScript model.
    #[arg(long)]
    model: PathBuf,
    /// CSV files or globs (first column id, the rest features).
    #[arg(long, required = true, num_args = 1..)]
    data: Vec<String>,
    /// Batch sizes to try.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096")]
    batch_size: Vec<usize>,
    /// libtorch intra-op threads (0: libtorch default).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Timed passes per batch size (median reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

impl ForwardArgs {
    fn run(self) -> Result<()> {
        let Self {
            model,
            data,
            batch_size,
            threads,
            repeats,
        } = self;
        let features = forward::load_csv(&forward::expand(&data)?)?;
        println!(
            "forward: {} rows × {} features, {threads} thread(s), median of {repeats}",
            features.rows(),
            features.cols
        );
        for r in forward::measure(
            &model,
            &features,
            &batch_size,
            threads,
            repeats,
            tch::Device::Cpu,
        )? {
            println!(
                "  batch {:>6}: {:>12.0} rows/s",
                r.batch_size, r.median_rows_per_s
            );
        }
        Ok(())
    }
}

/// `GpuCheck`'s flags (see [`Command::GpuCheck`]).
#[derive(Debug, Args)]
pub(crate) struct GpuCheckArgs {
    /// With no services: an MLP, a sentence encoder and an image CNN made
    /// by this machine's PyTorch (python3, or BATCHFLEET_PYTHON), each
    /// through `run --local` against host-fed and device-resident
    /// `forward`, in float32, float32 with TF32 (on a GPU) and bfloat16; on
    /// the CPU, small, for a second or two per figure where no GPU is
    /// visible.
    #[arg(long)]
    local: bool,
    /// `--local`: seconds of device work per figure (default 10 on a GPU,
    /// 1.5 on the CPU).
    #[arg(long, requires = "local")]
    seconds: Option<f64>,
    /// `--local`: run on the CPU even where a GPU is visible.
    #[arg(long, requires = "local")]
    cpu: bool,
    /// Rows of each model's job (the fleet form, without `--local`).
    #[arg(long, default_value_t = 1_000_000, conflicts_with = "local")]
    rows: u64,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Work folder (default: a temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
}

impl GpuCheckArgs {
    fn run(self) -> Result<()> {
        let Self {
            local,
            seconds,
            cpu,
            rows,
            json,
            dir,
        } = self;
        let figures = if local {
            let figures =
                crate::gpulocal::run(&crate::gpulocal::LocalConfig { seconds, dir, cpu })?;
            Some(serde_json::to_value(figures)?)
        } else {
            gpu::run(&gpu::GpuCheckConfig { rows, dir })?
                .map(serde_json::to_value)
                .transpose()?
        };
        if let (Some(path), Some(figures)) = (json, figures) {
            std::fs::write(&path, serde_json::to_vec_pretty(&figures)?)?;
            println!("figures written to {}", path.display());
        }
        Ok(())
    }
}
