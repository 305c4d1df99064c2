#!/usr/bin/env bash
# Installs Slurm and MUNGE from Debian's packages (slurm-wlm, slurmdbd,
# munge) for `make slurm-test`, which starts its own munged, slurmctld,
# slurmd and (on the local MariaDB, for sacct) slurmdbd on loopback ports
# with configuration in a temporary folder. The packages' own services are
# stopped: the run uses none of them.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null && command -v slurmdbd >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing Slurm and MUNGE from Debian's packages (for the Slurm run)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm slurmdbd munge >/dev/null
  if command -v systemctl >/dev/null; then
    systemctl disable --now slurmctld slurmd slurmdbd munge >/dev/null 2>&1 || true
  fi
else
  echo "error: Slurm and MUNGE are not installed; install them with: sudo apt-get install slurm-wlm slurmdbd munge" >&2
  exit 1
fi
