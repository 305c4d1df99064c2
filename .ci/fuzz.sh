#!/usr/bin/env bash
# Fuzzes the model-archive reader with cargo-fuzz (libFuzzer, AddressSanitizer)
# for FUZZ_SECONDS (default 60), starting from a corpus of real archives
# torch writes (TorchScript stored and deflated, a state_dict, a pickled
# module, an exported program: loadtest/python/make_fuzz_seeds.py), each
# also cut short. Installs what it needs: a
# nightly toolchain (rustup) and cargo-fuzz. A crash fails it, with the
# input saved under shared/fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
. .ci/env.sh
unset RUSTUP_TOOLCHAIN
rustup run nightly rustc --version >/dev/null 2>&1 \
  || rustup toolchain install nightly --profile minimal >&2
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz >&2
corpus=$(mktemp -d); trap 'rm -rf "$corpus"' EXIT
python loadtest/python/make_fuzz_seeds.py "$corpus/seed" >/dev/null
cd shared/fuzz
cargo +nightly fuzz run --fuzz-dir . model_archive "$corpus/seed" -- \
  -max_total_time="$seconds" -max_len=1048576 -rss_limit_mb=2048 -timeout=10
