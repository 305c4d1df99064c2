"""Exceptions, one per exit code of the ``batchfleet`` command.

Each carries the command's own message (``message``), its exit code
(``exit_code``) and, where the job ended, its summary (``report``, the
``_summary.json`` as a dict) and id (``job_id``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional


class BatchfleetError(Exception):
    """A ``batchfleet`` command failed (exit code 1: RabbitMQ, Redis or I/O
    unreachable or failing; the base of every other error here)."""

    exit_code: int = 1

    def __init__(
        self,
        message: str,
        *,
        exit_code: Optional[int] = None,
        job_id: Optional[str] = None,
        report: Optional[Dict[str, Any]] = None,
        stderr: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        if exit_code is not None:
            self.exit_code = exit_code
        self.job_id = job_id
        self.report = report
        self.stderr = stderr


class ManifestError(BatchfleetError):
    """Exit code 2: the manifest (or a flag) is invalid; nothing was published."""

    exit_code = 2


class JobFailed(BatchfleetError):
    """Exit codes 3, 4 and 5: the job ended without every item predicted.

    3: some items failed for good (dead-lettered; ``dlq replay`` retries
    them); 4: the error budget was exceeded; 5: nobody can run the job (its
    model is not TorchScript, changed, or raises on load). ``report`` is its
    summary; ``report["failed_items"]`` says which and why."""


class ItemsFailed(JobFailed):
    """Exit code 3: every item settled, some failed for good."""

    exit_code = 3


class BudgetExceeded(JobFailed):
    """Exit code 4: the error budget was exceeded; remaining items were skipped."""

    exit_code = 4


class JobUnrunnable(JobFailed):
    """Exit code 5: the job failed at once; nobody can run it."""

    exit_code = 5


class JobCancelled(BatchfleetError):
    """Exit code 6: the job was cancelled (``Job.cancel()``, ``batchfleet
    cancel``); its committed items stay, and running it again continues it."""

    exit_code = 6


class Interrupted(BatchfleetError):
    """Exit code 130: the command was interrupted while it followed the job
    (the fleet's workers carry on)."""

    exit_code = 130


_BY_CODE = {
    2: ManifestError,
    3: ItemsFailed,
    4: BudgetExceeded,
    5: JobUnrunnable,
    6: JobCancelled,
    130: Interrupted,
}


def error_for(exit_code: int) -> type:
    """The exception class of a ``batchfleet`` exit code."""
    return _BY_CODE.get(exit_code, BatchfleetError)
