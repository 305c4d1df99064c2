#!/usr/bin/env bash
# `make torch-pairing-test TORCH=<version>`: the test suite against another
# PyTorch's libtorch — the pairing a `make gpu-bundle TORCH=<version>`
# bundle runs on. Uses the bundle's virtual environment and ported torch-sys
# (run `make gpu-bundle TORCH=<version>` first), adds what the tests'
# generators import, and runs `cargo test --workspace` (debug, a target
# folder of its own) with that venv as the tests' Python. Cargo.lock is left
# as it was. Not in CI: it builds everything a second time.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${TORCH:?"give the PyTorch version: make torch-pairing-test TORCH=2.11.0"}
work="target/gpu-bundle/torch-$torch"
venv="$PWD/$work/venv"
[ -x "$venv/bin/python" ] || { echo "error: no $work/venv: run make gpu-bundle TORCH=$torch first" >&2; exit 1; }
"$venv/bin/pip" install --quiet --disable-pip-version-check numpy pyarrow pandas pillow "moto[server]" "tokenizers==0.23.3" pytest duckdb jsonschema
patch=()
if [ -d "$work/torch-sys" ]; then
  patch=(--config "patch.crates-io.torch-sys.path=\"$PWD/$work/torch-sys\"")
  export LIBTORCH_BYPASS_VERSION_CHECK=1
fi
cp Cargo.lock "$work/Cargo.lock.orig"
trap 'cp "$work/Cargo.lock.orig" Cargo.lock' EXIT
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" LIBTORCH_USE_PYTORCH=1 CARGO_TARGET_DIR="$PWD/$work/target"
cargo build "${patch[@]}" --workspace --bins
# shellcheck disable=SC2086 # TEST_ARGS: several arguments
cargo test "${patch[@]}" --workspace --all-targets --no-fail-fast ${TEST_ARGS:-}
