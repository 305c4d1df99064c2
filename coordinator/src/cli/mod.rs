//! The `batchfleet` command line.
//!
//! Exit codes: 0 success (or job already complete), 1 runtime failure (broker,
//! Redis, I/O), 2 invalid manifest or usage (nothing was published), 3 job
//! finished but some items failed for good (listed in `_summary.json`, no
//! `_SUCCESS`), 4 job failed (error budget exceeded, remaining items skipped),
//! 5 job failed at once because nobody can run it (the model is not
//! TorchScript, changed or raises on load, or no worker could take its items
//! within `--unable-timeout`), 6 job cancelled (`batchfleet cancel`; its
//! committed items stay, and `run` continues it), 7 `compare --max-psi`
//! found an output past the gate, 130 interrupted while following a job
//! (the workers carry on).
//!
//! # Layout
//! - this file: [`main`] and the body of each command.
//! - [`args`]: the clap types — commands, flags, variables, help.
//! - [`report`]: exit codes, and what a run's outcome or an error prints.
//! - [`dlq`]: `batchfleet dlq list | replay | purge`.

mod args;
mod dlq;
mod report;

pub use args::{
    CancelArgs, Cli, Command, CompareArgs, CompletionsArgs, DlqCommand, FollowArgs, GcArgs,
    GlobalArgs, JobsArgs, OverrideArgs, PlanArgs, ResumeArgs, RunArgs, ScaleAdviceArgs, StatusArgs,
    SuperviseArgs, WaitArgs,
};
pub use report::{
    exit_code, outcome_json, EXIT_CANCELLED, EXIT_COMPLETED_WITH_FAILURES, EXIT_DRIFT,
    EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_JOB_FAILED, EXIT_JOB_UNRUNNABLE,
};

use crate::config::Connections;
use crate::error::RunError;
use crate::job::RunOutcome;
use crate::status;
use report::{
    print_json, print_json_error, print_json_failure, report_error, report_outcome,
    report_outcome_of,
};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Runs a parsed command line and returns the process exit code.
pub async fn main(mut cli: Cli) -> ExitCode {
    if let Command::Completions(args) = &cli.command {
        return completions(args.shell);
    }
    if let Command::Schema = &cli.command {
        return schema();
    }
    if let Command::Man(args) = &cli.command {
        return man_pages(&args.dir);
    }
    if let Command::TryModel = &cli.command {
        return crate::manifest::try_model_main();
    }
    if matches!(cli.command, Command::Run(_) | Command::Plan(_)) {
        // Its start overlaps the steps before validation tries the model.
        crate::manifest::start_model_trial();
    }
    cli.global.services.init_logging();
    if let Some(notice) = cli
        .command
        .data_roots_mut()
        .and_then(batchfleet_shared::paths::legacy_data_roots)
    {
        tracing::warn!("{notice}");
    }
    // Before any libtorch call (`run --local` and validation use it).
    batchfleet_shared::cuda::log(&batchfleet_shared::cuda::load(option_env!(
        "BATCHFLEET_LIBTORCH_LIB"
    )));
    let connections = match cli.global.connections() {
        Ok(c) => c,
        Err(e) => {
            // The command line parsed, so a `--json` in it is that
            // command's: its failure is a JSON object too.
            if std::env::args().any(|a| a == "--json") {
                return print_json_failure(EXIT_INVALID, &e);
            }
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_INVALID);
        }
    };
    if let Err(e) = serve_metrics(&cli) {
        eprintln!("error: {e}");
        return ExitCode::from(EXIT_FAILURE);
    }
    match cli.command {
        Command::Run(args) => run_main(args, connections).await,
        Command::Wait(args) => wait_main(args, connections).await,
        Command::Cancel(args) => cancel_main(args, connections).await,
        Command::Supervise(args) => {
            let cfg = args.follow.run_config(connections);
            let shutdown = batchfleet_shared::shutdown::on_signals();
            match crate::control::supervise(&cfg, &args.pools, args.every, shutdown).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => report_error(&e),
            }
        }
        Command::Resume(args) => {
            let cfg = args.follow.run_config(connections);
            let shutdown = batchfleet_shared::shutdown::on_signals();
            match crate::job::resume_job(&cfg, &args.job, shutdown).await {
                Ok(outcome) if args.json => print_json(&outcome),
                Err(e) if args.json => print_json_error(&e),
                Ok(outcome) => report_outcome(&outcome),
                Err(e) => report_error(&e),
            }
        }
        Command::Dlq(cmd) => dlq::main(cmd, &connections).await,
        // Answered before anything else, above.
        Command::Completions(_) | Command::Schema | Command::Man(_) | Command::TryModel => {
            ExitCode::SUCCESS
        }
        Command::Status(args) => status_main(args, connections).await,
        Command::Jobs(args) => jobs_main(args, connections).await,
        Command::ScaleAdvice(args) => scale_advice_main(args, connections).await,
        Command::Compare(args) => compare_main(&args, &connections).await,
        Command::Plan(args) => plan_main(args, connections).await,
        Command::Gc(args) => gc_main(args, connections).await,
    }
}

/// `batchfleet completions SHELL`: the completion script on stdout.
fn completions(shell: clap_complete::Shell) -> ExitCode {
    use clap::CommandFactory;
    // Into memory first: the generator panics on a write error, and a
    // closed pipe (`| head`) is not one worth a panic.
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "batchfleet", &mut script);
    write_stdout(&script, "the completion script")
}

/// Writes a generated text to stdout; a closed pipe (`| head`) is no error.
fn write_stdout(bytes: &[u8], what: &str) -> ExitCode {
    use std::io::Write;
    match std::io::stdout().write_all(bytes) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write {what}: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// `batchfleet schema`: the manifest's JSON Schema on stdout.
fn schema() -> ExitCode {
    let mut text =
        serde_json::to_string_pretty(&crate::manifest::json_schema()).unwrap_or_default();
    text.push('\n');
    write_stdout(text.as_bytes(), "the schema")
}

/// `batchfleet man DIR`: the manual pages, rendered from the same clap
/// definitions as `--help`.
fn man_pages(dir: &Path) -> ExitCode {
    use clap::CommandFactory;
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| clap_mangen::generate_to(Cli::command(), dir))
        .and_then(|()| worker_man_page(dir));
    match written {
        Ok(()) => {
            println!("manual pages written to {}", dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "error: cannot write the manual pages to {}: {e}",
                dir.display()
            );
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// `batchfleet-worker.1`, where this binary carries the worker.
#[cfg(feature = "local")]
fn worker_man_page(dir: &Path) -> std::io::Result<()> {
    use clap::CommandFactory;
    let mut page = Vec::new();
    clap_mangen::Man::new(batchfleet_worker::WorkerConfig::command()).render(&mut page)?;
    std::fs::write(dir.join("batchfleet-worker.1"), page)
}

#[cfg(not(feature = "local"))]
fn worker_man_page(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

/// Commands that follow a job serve metrics while they do.
fn serve_metrics(cli: &Cli) -> Result<(), String> {
    if !matches!(
        cli.command,
        Command::Run(_) | Command::Resume(_) | Command::Wait(_) | Command::Supervise(_)
    ) {
        return Ok(());
    }
    // A local run's worker pipelines set the worker's own gauges here.
    let keep = match &cli.command {
        Command::Run(args) if args.local => batchfleet_shared::metrics::names::WORKER_OWN_GAUGES,
        _ => &[],
    };
    batchfleet_shared::metrics::install(&cli.global.metrics, "coordinator", &[], keep).map(|_| ())
}

/// `batchfleet run`: follow the job to its end, submit it (`--detach`), or
/// run it in this process (`--local`).
async fn run_main(args: RunArgs, connections: Connections) -> ExitCode {
    let mut cfg = args.follow.run_config(connections);
    cfg.overrides = args.overrides.all();
    cfg.trial = args.overrides.trial();
    if let Some(since) = &args.since {
        match crate::since::narrow(&cfg, &args.manifest, since, args.local).await {
            Ok(crate::since::Narrowed::Run { set, incremental }) => {
                cfg.overrides.push(set);
                cfg.since = Some(std::sync::Arc::new(incremental));
            }
            Ok(crate::since::Narrowed::Nothing(incremental)) => {
                let said = format!(
                    "nothing new or changed since job {}: {} file(s) unchanged, nothing published",
                    incremental.since_job,
                    incremental.reused.len()
                );
                if args.json {
                    let out = serde_json::json!({
                        "job_id": null, "status": "nothing_to_score", "exit_code": 0,
                        "incremental": incremental,
                    });
                    println!("{out}");
                } else {
                    println!("{said}");
                }
                return ExitCode::SUCCESS;
            }
            Err(e) if args.json => return print_json_error(&e),
            Err(e) => return report_error(&e),
        }
    }
    let shutdown = batchfleet_shared::shutdown::on_signals();
    let run = if args.detach {
        crate::job::submit_job(&cfg, &args.manifest).await
    } else if args.local {
        let opts = crate::local::LocalOptions::resolve(args.workers, args.threads);
        crate::local::run_job(&cfg, &args.manifest, opts, shutdown).await
    } else {
        crate::job::run_job(&cfg, &args.manifest, shutdown).await
    };
    match run {
        Ok(outcome) if args.json => print_json(&outcome),
        Err(e) if args.json => print_json_error(&e),
        Ok(RunOutcome::Interrupted { job_id }) if args.local => {
            eprintln!("interrupted; the local run of job {job_id} stopped. Its committed items are kept: run the same command again to resume it.");
            ExitCode::from(EXIT_INTERRUPTED)
        }
        Ok(outcome) => report_outcome_of(&outcome, args.local),
        Err(e) => report_error(&e),
    }
}

/// `batchfleet wait JOB`: follow a job another process published.
async fn wait_main(args: WaitArgs, connections: Connections) -> ExitCode {
    let cfg = args.follow.run_config(connections);
    let shutdown = batchfleet_shared::shutdown::on_signals();
    let waited = async {
        let store = cfg.connections.store().await?;
        if store.job(&args.job).await?.is_none() {
            return Err(RunError::UnknownJob(format!(
                "no job \"{}\" in {}; job ids look like <name>-<hash>, as `batchfleet run` prints them. A job that finished more than --retention ago has left Redis: its _summary.json is in its output folder",
                args.job,
                store.describe()
            )));
        }
        crate::job::follow_job(&cfg, &store, &args.job, shutdown).await
    };
    match waited.await {
        Ok(outcome) if args.json => print_json(&outcome),
        Err(e) if args.json => print_json_error(&e),
        Ok(outcome) => report_outcome(&outcome),
        Err(e) => report_error(&e),
    }
}

/// `batchfleet cancel JOB`.
async fn cancel_main(args: CancelArgs, connections: Connections) -> ExitCode {
    let mut cfg = FollowArgs::default_config(connections.clone());
    cfg.data_roots = args.data_roots.clone();
    let cancelled = async {
        let store = connections.store().await?;
        crate::job::cancel_job(&cfg, &store, &args.job, &args.reason).await
    };
    match cancelled.await {
        Ok(c) if args.json => {
            println!("{}", serde_json::to_string(&c).expect("json"));
            ExitCode::SUCCESS
        }
        Ok(c) if c.cancelled => {
            println!("job {} cancelled: its queued items are skipped and in-flight ones stop at their next checkpoint; its committed part files stay. Run the same manifest again to continue it from them.", c.job_id);
            if let Some(s) = &c.summary {
                println!("summary: {}", s.display());
            }
            ExitCode::SUCCESS
        }
        Ok(c) => {
            println!(
                "job {} is {}, not running: nothing to cancel",
                c.job_id, c.status
            );
            ExitCode::SUCCESS
        }
        Err(e) if args.json => print_json_error(&e),
        Err(e) => report_error(&e),
    }
}

/// `batchfleet status JOB`.
async fn status_main(args: StatusArgs, connections: Connections) -> ExitCode {
    // With --json, a failure is a JSON object too (as for run and resume).
    let fail = |e: RunError| {
        if args.json {
            print_json_error(&e)
        } else {
            report_error(&e)
        }
    };
    let store = match connections.store().await {
        Ok(s) => s,
        Err(e) => return fail(RunError::Store(e)),
    };
    let job = match &args.job {
        Some(job) => job.clone(),
        None => match status::jobs(&store, 1).await {
            Ok(latest) if !latest.is_empty() => latest[0].id.clone(),
            Ok(_) => {
                return fail(RunError::UnknownJob(format!(
                    "no job in {}; start one with `batchfleet run job.toml`",
                    store.describe()
                )))
            }
            Err(e) => return fail(RunError::Store(e)),
        },
    };
    let report = match status::report(&store, &job).await {
        Ok(Some(mut r)) => {
            r.consumers = pool_consumers(&connections, &r.job.pool).await;
            Ok(Some(r))
        }
        other => other,
    };
    match report {
        Ok(Some(r)) if args.json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&r).expect("report serializes")
            );
            ExitCode::SUCCESS
        }
        Ok(Some(r)) => {
            println!("{}", status::render(&r));
            ExitCode::SUCCESS
        }
        Ok(None) => fail(RunError::UnknownJob(format!(
            "no job \"{job}\" in {}; job ids look like <name>-<hash>, as printed by `batchfleet run`",
            store.describe()
        ))),
        Err(e) => fail(RunError::Store(e)),
    }
}

/// `batchfleet jobs`.
async fn jobs_main(args: JobsArgs, connections: Connections) -> ExitCode {
    let store = match connections.store().await {
        Ok(s) => s,
        Err(e) => return report_error(&RunError::Store(e)),
    };
    match status::jobs(&store, args.limit).await {
        Ok(jobs) if args.json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&jobs).expect("jobs serialize")
            );
            ExitCode::SUCCESS
        }
        Ok(jobs) => {
            println!("{}", status::render_jobs(&jobs));
            ExitCode::SUCCESS
        }
        Err(e) => report_error(&RunError::Store(e)),
    }
}

/// `batchfleet scale-advice`.
async fn scale_advice_main(args: ScaleAdviceArgs, connections: Connections) -> ExitCode {
    let store = match connections.store().await {
        Ok(s) => s,
        Err(e) => return report_error(&RunError::Store(e)),
    };
    let mut advice = match status::scale_advice(&store, &args.pools, args.limit).await {
        Ok(a) => a,
        Err(e) => return report_error(&RunError::Store(e)),
    };
    for pool in &mut advice.pools {
        pool.workers = pool_consumers(&connections, &pool.pool).await;
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&advice).expect("advice serializes")
        );
    } else {
        println!("{}", status::render_scale_advice(&advice));
    }
    ExitCode::SUCCESS
}

/// `batchfleet gc`.
async fn gc_main(args: GcArgs, connections: Connections) -> ExitCode {
    let store = match connections.store().await {
        Ok(s) => s,
        Err(e) => return report_error(&RunError::Store(e)),
    };
    match crate::control::gc(&store, args.older_than, args.dry_run).await {
        Ok(collected) if args.json => {
            let out = serde_json::json!({ "dry_run": args.dry_run, "jobs": collected });
            println!("{}", serde_json::to_string_pretty(&out).expect("json"));
            ExitCode::SUCCESS
        }
        Ok(collected) => {
            println!("{}", crate::control::render_gc(&collected, args.dry_run));
            ExitCode::SUCCESS
        }
        Err(e) => report_error(&RunError::Store(e)),
    }
}

async fn plan_main(args: PlanArgs, connections: Connections) -> ExitCode {
    let store = if args.local {
        None
    } else {
        match connections.store().await {
            Ok(s) => Some(s),
            Err(e) => return report_error(&RunError::Store(e)),
        }
    };
    let mut cfg = FollowArgs::default_config(connections);
    cfg.data_roots = args.data_roots;
    cfg.trial = args.overrides.trial();
    cfg.overrides = args.overrides.all();
    let sample = args.sample.map(|rows| crate::control::SampleArgs {
        rows: rows as usize,
        workers: args.workers,
    });
    let mut incremental = None;
    if let Some(since) = &args.since {
        match crate::since::narrow(&cfg, &args.manifest, since, args.local).await {
            Ok(crate::since::Narrowed::Run {
                set,
                incremental: i,
            }) => {
                cfg.overrides.push(set);
                incremental = Some(i);
            }
            Ok(crate::since::Narrowed::Nothing(i)) => {
                if args.json {
                    let out = serde_json::json!({ "state": "nothing_to_score", "incremental": i });
                    println!("{out}");
                } else {
                    println!(
                        "nothing new or changed since job {}: {} file(s) unchanged; `batchfleet run --since` would publish nothing",
                        i.since_job,
                        i.reused.len()
                    );
                }
                return ExitCode::SUCCESS;
            }
            Err(RunError::Manifest(e)) => {
                eprintln!("error: {e}");
                return ExitCode::from(EXIT_INVALID);
            }
            Err(e) => return report_error(&e),
        }
    }
    let planned = crate::control::plan(&cfg, &args.manifest, store.as_ref(), sample)
        .await
        .map(|mut r| {
            r.incremental = incremental;
            r
        });
    match planned {
        Ok(r) if args.json => {
            println!("{}", serde_json::to_string(&r).expect("plan serializes"));
            ExitCode::SUCCESS
        }
        Ok(r) => {
            println!("{}", crate::control::render_plan(&r));
            ExitCode::SUCCESS
        }
        Err(RunError::Manifest(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_INVALID)
        }
        Err(e) => report_error(&e),
    }
}

/// How many workers consume a pool's work queue now (`None` when the
/// broker cannot say: unreachable, or the queue not declared yet).
async fn pool_consumers(connections: &Connections, pool: &str) -> Option<u32> {
    let broker = connections.broker("batchfleet status").await.ok()?;
    let queue = batchfleet_shared::broker::PoolQueues::new(pool).work();
    let n = broker.consumer_count(&queue).await.ok().flatten();
    broker.close("bye").await;
    n
}

/// Reads a summary from a path, or from the output folder of a job in Redis.
async fn load_summary(
    which: &str,
    connections: &Connections,
) -> Result<crate::reducer::Summary, String> {
    let path = if std::path::Path::new(which).is_file() {
        PathBuf::from(which)
    } else {
        let store = connections.store().await.map_err(|e| e.to_string())?;
        let job = store
            .job(which)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| {
                format!("\"{which}\" is neither a _summary.json file nor a job in Redis; a finished job's state expires after its retention (--retention), its summary stays: pass the path of its _summary.json in the output folder")
            })?;
        batchfleet_shared::output::summary_in(Path::new(&job.output_dir))
    };
    let bytes = std::fs::read(&path).map_err(|e| {
        format!(
            "cannot read {}: {e} (has the job finished?)",
            path.display()
        )
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("{} is not a batchfleet summary: {e}", path.display()))
}

async fn compare_main(args: &CompareArgs, connections: &Connections) -> ExitCode {
    let loaded = async {
        let a = load_summary(&args.a, connections).await?;
        let Some(b) = &args.b else {
            // One job: its model against its shadow, over the rows both predicted.
            let shadow = a.shadow.as_ref().ok_or_else(|| {
                format!(
                    "job {} ran no shadow model; give a second job to compare with, or run the job with [model.shadow] (or run --shadow <model>)",
                    a.job_id
                )
            })?;
            // Vectors, or more than 64 outputs, have no per-column histograms.
            let dists = shadow
                .main_distribution
                .clone()
                .zip(shadow.shadow_distribution.clone());
            let drift = match &dists {
                Some((x, y)) => crate::compare::drift(x, y)?,
                None => Vec::new(),
            };
            return Ok::<_, String>((a.clone(), a, dists, drift));
        };
        let b = load_summary(b, connections).await?;
        let da = a
            .predictions
            .clone()
            .ok_or_else(|| format!("job {} recorded no prediction histogram", a.job_id))?;
        let db = b
            .predictions
            .clone()
            .ok_or_else(|| format!("job {} recorded no prediction histogram", b.job_id))?;
        let drift = crate::compare::drift(&da, &db)?;
        Ok::<_, String>((a, b, Some((da, db)), drift))
    };
    let (a, b, dists, drift) = match loaded.await {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let shadow = args.b.is_none().then_some(a.shadow.as_ref()).flatten();
    if args.json {
        let (da, db) = dists.unzip();
        let out = match shadow {
            Some(s) => {
                serde_json::json!({ "a": a.job_id, "b": format!("{} (shadow)", a.job_id), "a_distribution": da, "b_distribution": db, "drift": drift, "shadow": s })
            }
            None => {
                serde_json::json!({ "a": a.job_id, "b": b.job_id, "a_distribution": da, "b_distribution": db, "drift": drift })
            }
        };
        println!("{}", serde_json::to_string_pretty(&out).expect("json"));
    } else {
        if let Some(s) = shadow {
            println!("{}", s.render());
        }
        if let Some((da, db)) = &dists {
            let heads = match shadow {
                // One job: which model each side is, over the rows both predicted.
                Some(s) => [
                    format!(
                        "{}  model {} ({} rows compared)",
                        a.job_id, a.model, s.rows_compared
                    ),
                    format!("{}  shadow model {}", a.job_id, s.model),
                ],
                None => crate::compare::heads(&a, &b),
            };
            println!("{}", crate::compare::render(&heads, da, db, &drift));
        }
    }
    if let Some(limit) = args.max_psi {
        if let Some(d) = drift.iter().find(|d| d.psi > limit) {
            eprintln!("drift: {} has PSI {:.4} > --max-psi {limit}", d.name, d.psi);
            return ExitCode::from(EXIT_DRIFT);
        }
    }
    ExitCode::SUCCESS
}
