"""Fixtures of the Python client's tests: the binaries, the real RabbitMQ
and Redis, a fleet of real workers on a pool of the test's own, and
generated jobs whose golden predictions PyTorch computed."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, Iterator, List

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "coordinator", "python"))


def _bin_dir() -> str:
    given = os.environ.get("BATCHFLEET_BIN_DIR")
    if given:
        return given
    for profile in ("debug", "release"):
        folder = os.path.join(ROOT, "target", profile)
        if os.access(os.path.join(folder, "batchfleet"), os.X_OK):
            return folder
    raise RuntimeError("no batchfleet binaries: cargo build --workspace --bins (or set BATCHFLEET_BIN_DIR)")


@pytest.fixture(scope="session", autouse=True)
def binaries() -> str:
    folder = _bin_dir()
    os.environ["BATCHFLEET_BIN_DIR"] = folder
    return folder


@pytest.fixture(scope="session")
def services() -> None:
    """RabbitMQ and Redis answer (started when down)."""
    subprocess.run([os.path.join(ROOT, ".ci", "ensure-services.sh")], check=True, stdout=subprocess.DEVNULL)


class Fleet:
    """Workers on a pool and Redis prefix of their own."""

    def __init__(self, root: str) -> None:
        tag = uuid.uuid4().hex[:10]
        self.pool = f"pytest-{tag}"
        self.env: Dict[str, str] = {"BATCHFLEET_REDIS_PREFIX": f"bfpytest-{tag}"}
        self.root = root
        self.workers: List[subprocess.Popen] = []

    def start(self, n: int) -> None:
        for i in range(n):
            ready = os.path.join(self.root, f"worker-{i}.ready")
            log = open(os.path.join(self.root, f"worker-{i}.log"), "wb")
            env = dict(os.environ, **self.env)
            env.pop("LD_LIBRARY_PATH", None)  # the binary finds libtorch by itself
            self.workers.append(
                subprocess.Popen(
                    [
                        os.path.join(os.environ["BATCHFLEET_BIN_DIR"], "batchfleet-worker"),
                        "--pool", self.pool,
                        "--worker-id", f"{self.pool}-w{i}",
                        "--threads", "1",
                        "--data-root", self.root,
                        "--ready-file", ready,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
            deadline = time.monotonic() + 60
            while not os.path.exists(ready):
                if self.workers[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {i} did not get ready; see {log.name}")
                time.sleep(0.05)

    def stop(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
        prefix = self.env["BATCHFLEET_REDIS_PREFIX"]
        keys = subprocess.run(["redis-cli", "--scan", "--pattern", f"{prefix}:*"], capture_output=True, text=True).stdout.split()
        for i in range(0, len(keys), 500):
            subprocess.run(["redis-cli", "del", *keys[i : i + 500]], capture_output=True)
        listed = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name"], capture_output=True, text=True).stdout.split()
        for queue in listed:
            if queue.startswith(f"bf.{self.pool}."):
                subprocess.run(["rabbitmqctl", "-q", "delete_queue", queue], capture_output=True)


@pytest.fixture
def fleet(services: None, tmp_path) -> Iterator[Fleet]:
    f = Fleet(str(tmp_path))
    try:
        yield f
    finally:
        f.stop()


def make_job(folder: str, *, rows: int, fmt: str = "csv", item_rows: int = 500, files: int = 2, name: str = "pyjob") -> Dict[str, List[float]]:
    """Generates a job in ``folder`` (loadtest/python/make_job.py: input
    files, a TorchScript MLP, job.toml); PyTorch's own predictions by id."""
    subprocess.run(
        [
            sys.executable, os.path.join(ROOT, "loadtest", "python", "make_job.py"),
            "--out", folder, "--rows", str(rows), "--files", str(files), "--format", fmt,
            "--item-rows", str(item_rows), "--batch-size", "128", "--name", name,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    golden: Dict[str, List[float]] = {}
    with open(os.path.join(folder, "golden.csv"), newline="") as f:
        for row in csv.DictReader(f):
            key = row.pop("id")
            golden[key] = [float(v) for v in row.values()]
    return golden
