#!/usr/bin/env bash
# The demo job end to end. First in one process with `batchfleet run --local`
# (no RabbitMQ, no Redis, no root); then, when RabbitMQ and Redis answer at
# BATCHFLEET_AMQP_URL / BATCHFLEET_REDIS_URL, the same data on a two-worker
# fleet. Each run's predictions are checked against PyTorch's own, and the
# two throughputs printed side by side. Expects release binaries (`make demo`
# builds them first; BF_BIN points elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BF_BIN:-target/release}
DEMO=${DEMO_DIR:-demo}
ROWS=${DEMO_ROWS:-200000}
WORKERS=${DEMO_WORKERS:-2}
export BATCHFLEET_REDIS_PREFIX=${BATCHFLEET_REDIS_PREFIX:-bf-demo}
# shellcheck source=.ci/service-urls.sh
. .ci/service-urls.sh

if [ ! -f "$DEMO/job.toml" ] || [ "$(cat "$DEMO/.rows" 2>/dev/null)" != "$ROWS" ]; then
  rm -rf "$DEMO"
  "$BIN/batchfleet-loadtest" gen --out "$DEMO" --rows "$ROWS" --files 4 --features 32 --name demo --pool demo
  echo "$ROWS" > "$DEMO/.rows"
fi
# The fleet run writes to its own folder (a different manifest: another job).
sed 's/^dir = "out"$/dir = "out-fleet"/' "$DEMO/job.toml" > "$DEMO/job-fleet.toml"
# Fresh output folders each time, so the demo always runs the jobs.
rm -rf "$DEMO/out" "$DEMO/out-fleet"
threads=$(( $(nproc) / WORKERS )); [ "$threads" -ge 1 ] || threads=1

rate() { sed -n 's/.*"rows_per_s": *\([0-9.]*\).*/\1/p' "$1/_summary.json" | head -1; }

echo "== in one process: batchfleet run --local (no RabbitMQ, no Redis)"
"$BIN/batchfleet" run "$DEMO/job.toml" --local --workers "$WORKERS" --threads "$threads"
"$BIN/batchfleet-loadtest" verify --output "$DEMO/out" --golden "$DEMO/golden.csv"
local_rate=$(rate "$DEMO/out")

# shellcheck disable=SC2046
if ! reachable $(hostport "$AMQP_URL" 5672) || ! reachable $(hostport "$REDIS_URL" 6379); then
  echo
  echo "local run: $local_rate rows/s. RabbitMQ or Redis does not answer, so the fleet half is skipped; start them (\`make services\`) to run it too"
  exit 0
fi

echo
echo "== on a fleet: $WORKERS workers over RabbitMQ and Redis"
redis-cli -u "$REDIS_URL" --no-auth-warning eval \
  "local n=0 for _,k in ipairs(redis.call('keys', ARGV[1])) do redis.call('del', k) n=n+1 end return n" 0 "$BATCHFLEET_REDIS_PREFIX:*" >/dev/null 2>&1 || true
pids=()
stop_workers() {
  [ ${#pids[@]} -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  return $rc
}
trap stop_workers EXIT
for i in $(seq 1 "$WORKERS"); do
  "$BIN/batchfleet-worker" --pool demo --threads "$threads" --worker-id "demo-worker-$i" --data-root "$DEMO" > "$DEMO/worker-$i.log" 2>&1 &
  pids+=($!)
done
echo "started $WORKERS workers ($threads libtorch thread(s) each); logs in $DEMO/worker-*.log"
"$BIN/batchfleet" run "$DEMO/job-fleet.toml"
echo
cat "$DEMO/out-fleet/_summary.json"
echo
"$BIN/batchfleet-loadtest" verify --output "$DEMO/out-fleet" --golden "$DEMO/golden.csv"
stop_workers
echo "workers stopped"
echo
echo "rows/s: local $local_rate, fleet $(rate "$DEMO/out-fleet") ($WORKERS pipelines or workers, $threads libtorch thread(s) each, same data)"
echo
echo "for comparison, raw in-process libtorch forward on the same rows already in memory:"
"$BIN/batchfleet-loadtest" forward --model "$DEMO/model.pt" --data "$DEMO/data/*.csv" --batch-size 1024 --threads "$threads" --repeats 5
if [ "$threads" != "$(nproc)" ]; then
  "$BIN/batchfleet-loadtest" forward --model "$DEMO/model.pt" --data "$DEMO/data/*.csv" --batch-size 1024 --threads "$(nproc)" --repeats 5
fi
