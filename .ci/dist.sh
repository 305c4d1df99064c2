#!/usr/bin/env bash
# The release tarball that docker/vm/cloud-init.yaml installs on a VM:
#   dist/batchfleet-<version>-linux-<arch>.tar.gz and dist/SHA256SUMS
# holding bin/ (batchfleet, batchfleet-worker, batchfleet-preemption-watch,
# batchfleet-slurm-task),
# lib/batchfleet/ (libtorch's shared libraries in torch/lib, where the
# binaries' rpath $ORIGIN/../lib/batchfleet/torch/lib finds them, and for a
# CUDA build of PyTorch the NVIDIA libraries in nvidia/*/lib, where
# libtorch's own rpath $ORIGIN/../../nvidia/*/lib finds them: the layout of
# site-packages), share/batchfleet/systemd/ (the units) and
# share/batchfleet/slurm/ (the sbatch templates and the environment file's
# example) and share/man/man1/ (the manual pages, `batchfleet man`). `--list` prints
# the members without building anything.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
name="batchfleet-$version-linux-$(uname -m)"
units=(batchfleet-worker.service batchfleet-preemption.service batchfleet-job.service batchfleet-job.timer)
slurm=(worker-gpu.sbatch worker-cpu.sbatch coordinator.sbatch batchfleet.env.example)
members() {
  printf '%s\n' "$name/bin/batchfleet" "$name/bin/batchfleet-worker" "$name/bin/batchfleet-preemption-watch" "$name/bin/batchfleet-slurm-task"
  for u in "${units[@]}"; do echo "$name/share/batchfleet/systemd/$u"; done
  for f in "${slurm[@]}"; do echo "$name/share/batchfleet/slurm/$f"; done
  echo "$name/share/man/man1/"
  echo "$name/lib/batchfleet/"
}
if [ "${1:-}" = --list ]; then
  echo "dist/$name.tar.gz"
  echo "dist/SHA256SUMS"
  members
  exit 0
fi
# shellcheck source=.ci/env.sh
. .ci/env.sh
cargo build --release --workspace --bins
site=$(python -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
root="$stage/$name"
mkdir -p "$root/bin" "$root/lib/batchfleet/torch/lib" "$root/share/batchfleet/systemd" "$root/share/batchfleet/slurm"
install -m 0755 target/release/batchfleet target/release/batchfleet-worker docker/vm/batchfleet-preemption-watch docker/slurm/batchfleet-slurm-task "$root/bin/"
cp -a "$site"/torch/lib/*.so* "$root/lib/batchfleet/torch/lib/"
for lib in "$site"/nvidia/*/lib; do
  [ -d "$lib" ] || continue
  dest="$root/lib/batchfleet/nvidia/$(basename "$(dirname "$lib")")"
  mkdir -p "$dest"
  cp -a "$lib" "$dest/"
done
for u in "${units[@]}"; do install -m 0644 "docker/vm/$u" "$root/share/batchfleet/systemd/"; done
for f in "${slurm[@]}"; do install -m 0644 "docker/slurm/$f" "$root/share/batchfleet/slurm/"; done
target/release/batchfleet man "$root/share/man/man1" >/dev/null
mkdir -p dist
tar -C "$stage" -czf "dist/$name.tar.gz" "$name"
(cd dist && sha256sum "$name.tar.gz" > SHA256SUMS)
echo "dist/$name.tar.gz ($(du -h "dist/$name.tar.gz" | cut -f1)), dist/SHA256SUMS"
