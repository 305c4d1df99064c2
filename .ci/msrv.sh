#!/usr/bin/env bash
# Prints the Rust toolchain that Cargo.toml's `rust-version` names (the
# floor batchfleet declares), installing it with rustup when missing, so
# that CI builds and tests everything with that floor and a newer feature
# or dependency cannot slip under it. Prints nothing (and says why on
# stderr) when rustup cannot install it; CI then uses the default toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml | head -1)
[ -n "$msrv" ] || { echo "no rust-version in Cargo.toml" >&2; exit 1; }
if ! command -v rustup >/dev/null; then
  echo "warning: no rustup to install Rust $msrv; building with $(rustc --version)" >&2
  exit 0
fi
if ! rustup run "$msrv" rustc --version >/dev/null 2>&1; then
  if ! rustup toolchain install "$msrv" --profile minimal --component clippy,rustfmt >&2; then
    echo "warning: cannot install Rust $msrv; building with $(rustc --version)" >&2
    exit 0
  fi
fi
echo "$msrv"
