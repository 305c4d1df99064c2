#!/usr/bin/env bash
# The demo job end to end: generate a dataset and a TorchScript model, start two
# workers, run the job through RabbitMQ and Redis, print the summary, check every
# prediction against PyTorch, stop the workers. Expects release binaries
# (`make demo` builds them first).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release
DEMO=${DEMO_DIR:-demo}
ROWS=${DEMO_ROWS:-200000}
WORKERS=${DEMO_WORKERS:-2}
export BATCHFLEET_REDIS_PREFIX=${BATCHFLEET_REDIS_PREFIX:-bf-demo}

if [ ! -f "$DEMO/job.toml" ] || [ "$(cat "$DEMO/.rows" 2>/dev/null)" != "$ROWS" ]; then
  rm -rf "$DEMO"
  "$BIN/batchfleet-loadtest" gen --out "$DEMO" --rows "$ROWS" --files 4 --features 32 --name demo --pool demo
  echo "$ROWS" > "$DEMO/.rows"
fi
# A fresh output folder and job state each time, so the demo always runs the job.
rm -rf "$DEMO/out"
redis-cli -u "${BATCHFLEET_REDIS_URL:-redis://127.0.0.1:6379/}" --no-auth-warning eval \
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

threads=$(( $(nproc) / WORKERS )); [ "$threads" -ge 1 ] || threads=1
for i in $(seq 1 "$WORKERS"); do
  "$BIN/batchfleet-worker" --pool demo --threads "$threads" --worker-id "demo-worker-$i" --data-root "$DEMO" > "$DEMO/worker-$i.log" 2>&1 &
  pids+=($!)
done
echo "started $WORKERS workers ($threads libtorch thread(s) each); logs in $DEMO/worker-*.log"

"$BIN/batchfleet" run "$DEMO/job.toml"
echo
cat "$DEMO/out/summary.json"
echo
"$BIN/batchfleet-loadtest" verify --output "$DEMO/out" --golden "$DEMO/golden.csv"
stop_workers
echo "workers stopped"
echo
echo "for comparison, raw in-process libtorch forward on the same rows already in memory:"
"$BIN/batchfleet-loadtest" forward --model "$DEMO/model.pt" --data "$DEMO/data/*.csv" --batch-size 1024 --threads "$threads" --repeats 5
if [ "$threads" != "$(nproc)" ]; then
  "$BIN/batchfleet-loadtest" forward --model "$DEMO/model.pt" --data "$DEMO/data/*.csv" --batch-size 1024 --threads "$(nproc)" --repeats 5
fi
