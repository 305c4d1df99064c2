#!/usr/bin/env bash
# Installs the programs the tests start besides RabbitMQ and Redis:
# Prometheus (the metrics test scrapes real workers with it), openssl
# (the TLS and webhook tests make their CA and certificates with it), and
# mkfs.ext4, fsfreeze and prlimit (the stalled-write test freezes a file
# system of its own; the model-memory test bounds a worker's address space),
# jq (docker/scale-to-deadline.sh, run by the deadline test).
set -euo pipefail
for tool in mkfs.ext4:e2fsprogs fsfreeze:util-linux prlimit:util-linux jq:jq; do
  command -v "${tool%%:*}" >/dev/null && continue
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${tool#*:} from Debian's packages (for ${tool%%:*})"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${tool#*:}" >/dev/null
  else
    echo "error: ${tool%%:*} is not installed; install it with: sudo apt-get install ${tool#*:}" >&2
    exit 1
  fi
done
if ! command -v openssl >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing openssl from Debian's packages (for the TLS tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssl >/dev/null
  else
    echo "error: openssl is not installed; install it with: sudo apt-get install openssl" >&2
    exit 1
  fi
fi
if command -v prometheus >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing prometheus from Debian's packages (for the metrics test)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package may start its own service on :9090; the test runs its own on a free port.
  command -v systemctl >/dev/null && systemctl disable --now prometheus >/dev/null 2>&1 || true
  pkill -x prometheus 2>/dev/null || true
else
  echo "error: prometheus is not installed; install it with: sudo apt-get install prometheus" >&2
  exit 1
fi
