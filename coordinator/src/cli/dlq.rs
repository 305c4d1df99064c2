//! `batchfleet dlq list | replay | purge`: the dead-letter queue of a pool
//! (RabbitMQ), or the `_dead/` folder of a `--local` run.

use super::args::{DlqCommand, FollowArgs};
use super::report::{
    exit_code, outcome_json, print_json, print_json_error, report_error, report_outcome,
    report_outcome_of, EXIT_FAILURE, EXIT_INVALID,
};
use crate::config::Connections;
use crate::error::RunError;
use std::process::ExitCode;

/// `dlq list`'s output: JSON, or a table for people.
fn print_dead(items: &[crate::dlq::DeadItem], json: bool) -> ExitCode {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(items).expect("dead items serialize")
        );
    } else {
        println!("{}", crate::dlq::render(items));
    }
    ExitCode::SUCCESS
}

pub(super) async fn main(cmd: DlqCommand, connections: &Connections) -> ExitCode {
    match cmd {
        DlqCommand::List {
            local: Some(output),
            job,
            class,
            json,
            ..
        } => {
            let filter = crate::dlq::Filter {
                job,
                class,
                item: None,
            };
            match crate::local::list_dead(&output) {
                Ok(items) => {
                    let items: Vec<_> = items.into_iter().filter(|d| filter.matches(d)).collect();
                    print_dead(&items, json)
                }
                Err(e) => report_error(&e),
            }
        }
        DlqCommand::Replay {
            local: Some(output),
            update_model,
            workers,
            threads,
            json,
            ..
        } => {
            let cfg = FollowArgs::default_config(connections.clone());
            let opts = crate::local::LocalOptions::resolve(workers, threads);
            let shutdown = batchfleet_shared::shutdown::on_signals();
            match crate::local::replay(&cfg, &output, opts, update_model, shutdown).await {
                Ok(outcome) if json => print_json(&outcome),
                Err(e) if json => print_json_error(&e),
                Ok(outcome) => report_outcome_of(&outcome, true),
                Err(e) => report_error(&e),
            }
        }
        cmd => fleet(cmd, connections).await,
    }
}

async fn fleet(cmd: DlqCommand, connections: &Connections) -> ExitCode {
    let broker = match connections.broker("batchfleet dlq").await {
        Ok(c) => c,
        Err(e) => return report_error(&RunError::Broker(e)),
    };
    let code = match cmd {
        DlqCommand::List {
            pool,
            job,
            class,
            json,
            ..
        } => {
            let filter = crate::dlq::Filter {
                job,
                class,
                item: None,
            };
            match crate::dlq::list(&*broker, &pool, &filter).await {
                Ok(items) => print_dead(&items, json),
                Err(e) => report_error(&RunError::Broker(e)),
            }
        }
        DlqCommand::Replay {
            job,
            class,
            item,
            pool,
            update_model,
            trust_unsigned,
            no_wait,
            json,
            ..
        } => {
            let Some(job) = job else {
                eprintln!("error: --job (or --local OUTPUT) is required");
                return ExitCode::from(EXIT_INVALID);
            };
            if connections.signing_key.is_none() && !trust_unsigned {
                eprintln!("error: no signing key is set (BATCHFLEET_SIGNING_KEY or BATCHFLEET_SIGNING_KEY_FILE), so the dead messages' signatures cannot be checked, and a replay signs and publishes them again; set the key the coordinator signs with, or pass --trust-unsigned to replay them unverified (a deployment without a key trusts its queues)");
                return ExitCode::from(EXIT_INVALID);
            }
            let store = match connections.store().await {
                Ok(s) => s,
                Err(e) => return report_error(&RunError::Store(e)),
            };
            let pool = match (pool, store.job(&job).await) {
                (Some(p), _) => p,
                (None, Ok(Some(record))) => record.pool,
                (None, Ok(None)) => {
                    eprintln!("error: no job \"{job}\" in Redis; pass --pool to replay its dead items anyway");
                    return ExitCode::from(EXIT_FAILURE);
                }
                (None, Err(e)) => return report_error(&RunError::Store(e)),
            };
            let filter = crate::dlq::Filter {
                job: Some(job.clone()),
                class,
                item,
            };
            let replayed = match crate::dlq::replay(
                &*broker,
                &store,
                &pool,
                &filter,
                update_model,
                crate::dlq::Trust {
                    key: connections.signing_key.as_ref(),
                    unsigned: trust_unsigned,
                },
            )
            .await
            {
                Ok(r) => r,
                Err(e) => return report_error(&e),
            };
            let said = serde_json::json!({
                "job_id": job, "replayed": replayed.items.len(), "refused": replayed.refused,
            });
            // With --json, one object in the end: what the replay did, then the job's outcome.
            if !json {
                println!(
                    "replayed {} item(s) of job {job} to bf.{pool}.job.{job}",
                    replayed.items.len()
                );
            }
            if !json && !replayed.refused.is_empty() {
                eprintln!(
                    "left {} dead message(s) dead, not to be trusted:",
                    replayed.refused.len()
                );
                for why in &replayed.refused {
                    eprintln!("  {why}");
                }
            }
            if no_wait || store.job(&job).await.ok().flatten().is_none() {
                if json {
                    println!("{said}");
                }
                ExitCode::SUCCESS
            } else {
                let cfg = FollowArgs::default_config(connections.clone());
                match crate::job::follow_job(
                    &cfg,
                    &store,
                    &job,
                    batchfleet_shared::shutdown::on_signals(),
                )
                .await
                {
                    Ok(outcome) if json => {
                        let mut out = outcome_json(&outcome);
                        out["replayed"] = said["replayed"].clone();
                        out["refused"] = said["refused"].clone();
                        println!("{out}");
                        ExitCode::from(exit_code(&outcome))
                    }
                    Err(e) if json => print_json_error(&e),
                    Ok(outcome) => report_outcome(&outcome),
                    Err(e) => report_error(&e),
                }
            }
        }
        DlqCommand::Purge {
            pool,
            job,
            yes,
            json,
        } => {
            if !yes
                && !confirm(&format!(
                    "delete {} dead items of pool {pool} for good?",
                    job.as_deref()
                        .map_or("all".to_owned(), |j| format!("job {j}'s"))
                ))
            {
                eprintln!("not purged (pass --yes to skip this question)");
                return ExitCode::from(EXIT_FAILURE);
            }
            match crate::dlq::purge(&*broker, &pool, job.as_deref()).await {
                Ok(n) if json => {
                    println!("{}", serde_json::json!({ "purged": n }));
                    ExitCode::SUCCESS
                }
                Ok(n) => {
                    println!("purged {n} dead item(s)");
                    ExitCode::SUCCESS
                }
                Err(e) => report_error(&RunError::Broker(e)),
            }
        }
    };
    broker.close("bye").await;
    code
}

/// Asks on the terminal; anything but "yes" (or no terminal) is a no.
fn confirm(question: &str) -> bool {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        eprintln!("{question} — refusing without a terminal to confirm on");
        return false;
    }
    eprint!("{question} type yes to confirm: ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer).is_ok() && answer.trim() == "yes"
}
