"""batchfleet from Python: run a job, wait for it, read its predictions as
a table.

A thin client over the ``batchfleet`` command (``--json``): the same
manifests, flags, environment variables and exit codes (as exceptions).

>>> import batchfleet
>>> job = batchfleet.run("job.toml", local=True)
>>> df = job.to_pandas()

See docs/python.md.
"""

from ._binary import binary
from ._client import Job, job, run
from .errors import (
    BatchfleetError,
    BudgetExceeded,
    Interrupted,
    ItemsFailed,
    JobCancelled,
    JobFailed,
    JobUnrunnable,
    ManifestError,
)

__all__ = [
    "BatchfleetError",
    "BudgetExceeded",
    "Interrupted",
    "ItemsFailed",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobUnrunnable",
    "ManifestError",
    "binary",
    "job",
    "run",
    "__version__",
]

try:
    from importlib.metadata import version as _version

    __version__ = _version("batchfleet")
except Exception:  # not installed from a wheel: a source checkout
    __version__ = "0+source"
