"""The commands the wheel installs (``batchfleet``, ``batchfleet-worker``,
``batchfleet-loadtest``): each replaces this Python process with the binary
of the same name shipped in the package, so signals and exit codes are the
binary's own."""

from __future__ import annotations

import os
import sys

from ._binary import binary


def _exec(name: str) -> None:
    path = binary(name)
    os.execv(path, [path] + sys.argv[1:])


def batchfleet() -> None:
    _exec("batchfleet")


def worker() -> None:
    _exec("batchfleet-worker")


def loadtest() -> None:
    _exec("batchfleet-loadtest")
