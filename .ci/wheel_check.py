"""Run by .ci/wheel-check.sh with the Python of a fresh venv the wheel was
installed into: a Parquet job (made by make_job.py; its model an object in
S3, on the local server whose AWS_* settings are in the environment)
--local and on a fleet of two workers started from the venv's own
batchfleet-worker, its predictions read back with Job.to_pandas() and
pandas.read_parquet(out) and compared with PyTorch's, one row each."""

import argparse
import csv
import math
import os
import shutil
import signal
import subprocess
import time
import uuid

import pandas as pd

import batchfleet


def golden_of(folder):
    with open(os.path.join(folder, "golden.csv"), newline="") as f:
        return {row["id"]: float(row["score"]) for row in csv.DictReader(f)}


def check(frame, golden, what):
    ids = frame["id"].astype(str).tolist()
    assert len(ids) == len(set(ids)) == len(golden), f"{what}: {len(ids)} rows, {len(set(ids))} ids, {len(golden)} expected"
    for i, s in zip(ids, frame["score"].tolist()):
        assert math.isclose(s, golden[i], rel_tol=1e-5, abs_tol=1e-5), f"{what}: {i}: {s} != {golden[i]}"
    print(f"ok: {what}: {len(ids)} rows equal PyTorch's")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True, help="the folder make_job.py wrote")
    ap.add_argument("--model", required=True, help="the model's s3:// URL")
    args = ap.parse_args()
    exe = batchfleet.binary()
    assert exe.startswith(os.path.dirname(batchfleet.__file__)), f"the package runs {exe}, not its own"
    print(f"batchfleet {batchfleet.__version__} runs {exe}")
    folder = args.job
    golden = golden_of(folder)
    manifest = os.path.join(folder, "job.toml")
    assert not os.path.exists(os.path.join(folder, "model.pt")), "the model is only in S3"
    bucket = "/".join(args.model.split("/")[:3])
    roots = [folder, bucket]
    common = {"output.format": "parquet", "model.path": args.model}

    job = batchfleet.run(manifest, local=True, set={**common, "output.dir": "out-local"}, data_roots=roots)
    check(job.to_pandas(), golden, "--local: Job.to_pandas()")
    check(pd.read_parquet(job.output_dir), golden, "--local: pandas.read_parquet(out)")

    tag = uuid.uuid4().hex[:8]
    pool, env = f"wheel-{tag}", {"BATCHFLEET_REDIS_PREFIX": f"bfwheel-{tag}"}
    workers = []
    try:
        for i in range(2):
            ready = os.path.join(folder, f"w{i}.ready")
            log = open(os.path.join(folder, f"w{i}.log"), "wb")
            workers.append(subprocess.Popen([shutil.which("batchfleet-worker"), "--pool", pool, "--threads", "1",
                                             "--data-root", folder, "--data-root", bucket, "--ready-file", ready,
                                             "--cache-dir", os.path.join(folder, f"cache-w{i}")],
                                            env=dict(os.environ, **env), stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 60
            while not os.path.exists(ready):
                assert workers[-1].poll() is None and time.monotonic() < deadline, open(log.name).read()[-2000:]
                time.sleep(0.05)
        job = batchfleet.run(manifest, detach=True, env=env, data_roots=roots,
                             set={**common, "job.pool": pool, "output.dir": "out-fleet"})
        report = job.wait(timeout=300)
        assert report["status"] == "completed", report
        check(job.to_pandas(), golden, "fleet: Job.to_pandas()")
        check(pd.read_parquet(job.output_dir), golden, "fleet: pandas.read_parquet(out)")
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(timeout=60)
        keys = subprocess.run(["redis-cli", "--scan", "--pattern", f"{env['BATCHFLEET_REDIS_PREFIX']}:*"],
                              capture_output=True, text=True).stdout.split()
        if keys:
            subprocess.run(["redis-cli", "del", *keys], capture_output=True)
        queues = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name"], capture_output=True, text=True).stdout.split()
        for q in queues:
            if q.startswith(f"bf.{pool}."):
                subprocess.run(["rabbitmqctl", "-q", "delete_queue", q], capture_output=True)


if __name__ == "__main__":
    main()
