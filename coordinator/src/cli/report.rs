//! What a command prints and how it exits: the exit codes (see
//! [`crate::cli`]), a run's outcome as text or as the one JSON object of
//! `--json`, and errors.

use crate::error::RunError;
use crate::job::RunOutcome;
use std::process::ExitCode;

/// Exit code: invalid manifest or usage; nothing was published.
pub const EXIT_INVALID: u8 = 2;
/// Exit code: runtime failure (broker, Redis, I/O).
pub const EXIT_FAILURE: u8 = 1;
/// Exit code: every item settled but some failed for good (no `_SUCCESS`).
pub const EXIT_COMPLETED_WITH_FAILURES: u8 = 3;
/// Exit code: the error budget was exceeded; the job failed and its remaining items were skipped.
pub const EXIT_JOB_FAILED: u8 = 4;
/// Exit code: nobody can run the job (its model, or no able worker): it failed at once.
pub const EXIT_JOB_UNRUNNABLE: u8 = 5;
/// Exit code: the job was cancelled (`batchfleet cancel`).
pub const EXIT_CANCELLED: u8 = 6;
/// Exit code: `compare --max-psi`: an output drifted past the gate.
pub const EXIT_DRIFT: u8 = 7;
/// Exit code: interrupted by a signal while following a job.
pub const EXIT_INTERRUPTED: u8 = 130;

/// The exit code of a run's outcome (see the module docs).
pub fn exit_code(outcome: &RunOutcome) -> u8 {
    match outcome {
        RunOutcome::Completed { report, .. } => match report.status.as_str() {
            "completed" => 0,
            "failed" if report.failed_class.as_deref().unwrap_or("budget") == "budget" => {
                EXIT_JOB_FAILED
            }
            "failed" => EXIT_JOB_UNRUNNABLE,
            "cancelled" => EXIT_CANCELLED,
            _ => EXIT_COMPLETED_WITH_FAILURES,
        },
        RunOutcome::AlreadyCompleted { .. } | RunOutcome::Detached { .. } => 0,
        RunOutcome::Interrupted { .. } => EXIT_INTERRUPTED,
    }
}

/// A run's outcome as the one JSON object `--json` prints: `job_id`,
/// `status`, `exit_code`, and, once the job ended, `summary` (its path)
/// and `report` (the summary itself).
pub fn outcome_json(outcome: &RunOutcome) -> serde_json::Value {
    let code = exit_code(outcome);
    match outcome {
        RunOutcome::Completed {
            job_id,
            summary,
            report,
        } => serde_json::json!({
            "job_id": job_id, "status": report.status, "exit_code": code,
            "summary": summary, "report": report,
        }),
        RunOutcome::AlreadyCompleted { job_id, summary } => serde_json::json!({
            "job_id": job_id, "status": "completed", "already_complete": true,
            "exit_code": code, "summary": summary,
        }),
        RunOutcome::Interrupted { job_id } => serde_json::json!({
            "job_id": job_id, "status": "interrupted", "exit_code": code,
        }),
        RunOutcome::Detached { job_id, items } => serde_json::json!({
            "job_id": job_id, "status": "running", "detached": true, "items": items,
            "exit_code": code,
        }),
    }
}

pub(super) fn print_json(outcome: &RunOutcome) -> ExitCode {
    println!("{}", outcome_json(outcome));
    ExitCode::from(exit_code(outcome))
}

pub(super) fn print_json_error(e: &RunError) -> ExitCode {
    let code = match e {
        RunError::Manifest(_) => EXIT_INVALID,
        _ => EXIT_FAILURE,
    };
    print_json_failure(code, &e.to_string())
}

/// A `--json` command's failure, exit code `code`: the JSON object every
/// such failure prints.
pub(super) fn print_json_failure(code: u8, error: &str) -> ExitCode {
    println!(
        "{}",
        serde_json::json!({ "job_id": null, "status": "error", "exit_code": code, "error": error })
    );
    ExitCode::from(code)
}

pub(super) fn report_outcome(outcome: &RunOutcome) -> ExitCode {
    report_outcome_of(outcome, false)
}

/// [`report_outcome`]; `local` for a `--local` run (whose dead items are
/// replayed from its output folder).
pub(super) fn report_outcome_of(outcome: &RunOutcome, local: bool) -> ExitCode {
    let code = exit_code(outcome);
    match outcome {
        RunOutcome::Completed {
            job_id,
            summary,
            report,
        } => {
            println!(
                "job {job_id} {}: {} rows in {} items, {:.1}s, {} rows/s (item p50 {} ms, p95 {} ms, {} workers)",
                report.status, report.rows_predicted, report.items_completed, report.duration_s, report.rows_per_s,
                report.item_latency_ms.p50, report.item_latency_ms.p95, report.workers
            );
            println!("summary: {}", summary.display());
            if report.rows_rejected > 0 {
                eprintln!(
                    "{} row(s) rejected; see _rejects/ in the output folder",
                    report.rows_rejected
                );
            }
            if report.items_failed > 0 {
                eprintln!(
                    "{} item(s) failed for good and were dead-lettered (no _SUCCESS written):",
                    report.items_failed
                );
                for f in report.failed_items.iter().take(20) {
                    eprintln!(
                        "  item {} [{}] on {}: {}",
                        f.seq, f.class, f.worker, f.reason
                    );
                }
                if report.failed_items.len() > 20 {
                    eprintln!(
                        "  … and {} more in _summary.json",
                        report.failed_items.len() - 20
                    );
                }
            }
            match code {
                EXIT_JOB_UNRUNNABLE => eprintln!(
                    "the job failed at once: {}\nno worker process stopped; {} item(s) were skipped. Fix the cause and run the manifest again",
                    report.failed_reason.as_deref().unwrap_or("nobody can run it"),
                    report.items_skipped
                ),
                EXIT_JOB_FAILED if local => eprintln!(
                    "the error budget was exceeded: the job failed and {} item(s) were skipped. `batchfleet dlq list --local {out}` shows the dead items; fix the cause, then `batchfleet dlq replay --local {out}` or run the manifest again",
                    report.items_skipped, out = report.output_dir
                ),
                EXIT_JOB_FAILED => eprintln!(
                    "the error budget was exceeded: the job failed and {} item(s) were skipped. `batchfleet dlq list --pool {}` shows the dead items; fix the cause, then `batchfleet dlq replay --job {job_id}` or run the manifest again",
                    report.items_skipped, report.pool
                ),
                EXIT_CANCELLED => eprintln!(
                    "the job was cancelled{}: {} item(s) were skipped; its {} committed item(s) stay in {}. Run the same manifest again to continue it from them",
                    report.failed_reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default(),
                    report.items_skipped, report.items_completed, report.output_dir
                ),
                EXIT_COMPLETED_WITH_FAILURES if local => eprintln!("fix the cause, then `batchfleet dlq replay --local {}` (or run the same command again) to retry them", report.output_dir),
                EXIT_COMPLETED_WITH_FAILURES => eprintln!("fix the cause, then `batchfleet dlq replay --job {job_id}` (or run the same manifest again) to retry them"),
                _ => {}
            }
        }
        RunOutcome::AlreadyCompleted { job_id, summary } => {
            println!("job {job_id} is already complete; nothing was published");
            println!("summary: {}", summary.display());
        }
        RunOutcome::Interrupted { job_id } => {
            eprintln!("interrupted; job {job_id} keeps running on the workers. Run the same manifest again to follow it, or `batchfleet status {job_id}`.");
        }
        RunOutcome::Detached { job_id, items } => {
            println!("{job_id}");
            eprintln!("job {job_id}: {items} items published; follow it with `batchfleet wait {job_id}` (same exit codes as run), or let `batchfleet supervise` finish it");
        }
    }
    ExitCode::from(code)
}

pub(super) fn report_error(e: &RunError) -> ExitCode {
    eprintln!("error: {e}");
    match e {
        RunError::Manifest(_) => {
            eprintln!("nothing was published; fix the manifest and run again");
            ExitCode::from(EXIT_INVALID)
        }
        _ => ExitCode::from(EXIT_FAILURE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reducer::Summary;

    fn completed(status: &str) -> RunOutcome {
        let report: Summary = serde_json::from_value(serde_json::json!({
            "job_id": "j-1", "name": "j", "pool": "p", "status": status, "manifest": "m", "model": "m.pt",
            "model_sha256": "00", "output_dir": "/o", "rows_total": 1, "rows_predicted": 1, "rows_rejected": 0,
            "items_total": 1, "items_completed": 1, "parts": 1, "started_at_ms": 0, "finished_at_ms": 1,
            "duration_s": 0.001, "rows_per_s": 1000.0, "item_latency_ms": {"p50": 1, "p95": 1, "max": 1},
            "workers": 1, "items_recovered": 0, "items_failed": 0, "items_skipped": 0, "failed_items": []
        }))
        .unwrap();
        RunOutcome::Completed {
            job_id: "j-1".into(),
            summary: "/o/_summary.json".into(),
            report: Box::new(report),
        }
    }

    #[test]
    fn exit_codes_follow_the_job_status() {
        assert_eq!(exit_code(&completed("completed")), 0);
        assert_eq!(exit_code(&completed("completed_with_failures")), 3);
        assert_eq!(exit_code(&completed("failed")), 4);
        assert_eq!(exit_code(&completed("cancelled")), EXIT_CANCELLED);
        for (class, code) in [("budget", 4), ("unrunnable", 5), ("unable", 5)] {
            let RunOutcome::Completed { mut report, .. } = completed("failed") else {
                unreachable!()
            };
            report.failed_class = Some(class.into());
            let outcome = RunOutcome::Completed {
                job_id: "j-1".into(),
                summary: "s".into(),
                report,
            };
            assert_eq!(exit_code(&outcome), code, "{class}");
        }
        assert_eq!(
            exit_code(&RunOutcome::AlreadyCompleted {
                job_id: "j".into(),
                summary: "s".into()
            }),
            0
        );
        assert_eq!(
            exit_code(&RunOutcome::Interrupted { job_id: "j".into() }),
            130
        );
    }
}
