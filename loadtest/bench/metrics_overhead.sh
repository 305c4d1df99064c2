#!/usr/bin/env bash
# What the Prometheus metrics cost: the same job run side by side with the
# workers' and coordinator's metrics endpoints off and on (while a scraper
# polls them every second), alternating, REPS times each; prints median rows/s.
# Needs release binaries (`make release`) and RabbitMQ/Redis (`make services`).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=target/release
ROWS=${ROWS:-1000000}
ITEM_ROWS=${ITEM_ROWS:-10000}
REPS=${REPS:-3}
WORKERS=${WORKERS:-2}
DIR=${DIR:-$(mktemp -d)}
POOL=bench-metrics-$$
export BATCHFLEET_REDIS_PREFIX=bf-bench-$$
PY=.venv/bin/python
$PY loadtest/python/make_job.py --out "$DIR" --rows "$ROWS" --files 4 --features 32 --hidden 64 \
  --name metrics --pool "$POOL" --item-rows "$ITEM_ROWS" >/dev/null
threads=$(( $(nproc) / WORKERS )); [ "$threads" -ge 1 ] || threads=1
pids=()
scraper=
cleanup() {
  [ -n "$scraper" ] && kill "$scraper" 2>/dev/null
  [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null
  wait 2>/dev/null || true
  if command -v rabbitmqctl >/dev/null; then
    for q in $(timeout 30 rabbitmqctl list_queues name --quiet </dev/null 2>/dev/null | grep "^bf\.$POOL\."); do
      timeout 20 rabbitmqctl delete_queue "$q" </dev/null >/dev/null 2>&1 || true
    done
  fi
  redis-cli --scan --pattern "$BATCHFLEET_REDIS_PREFIX:*" 2>/dev/null | xargs -r redis-cli del >/dev/null 2>&1 || true
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

declare -A rate
for rep in $(seq 1 "$REPS"); do
  for variant in off on; do
    ports=()
    for i in $(seq 1 "$WORKERS"); do
      port=0; [ "$variant" = on ] && port=$(free_port)
      ports+=("$port")
      "$BIN/batchfleet-worker" --pool "$POOL" --threads "$threads" --worker-id "m-$variant-$i" --data-root "$DIR" \
        --metrics-port "$port" --metrics-host 127.0.0.1 >"$DIR/worker-$variant-$rep-$i.log" 2>&1 &
      pids+=($!)
    done
    cport=0
    if [ "$variant" = on ]; then
      cport=$(free_port)
      ( while true; do for p in "${ports[@]}" "$cport"; do curl -s "http://127.0.0.1:$p/metrics" >/dev/null || true; done; sleep 1; done ) &
      scraper=$!
    fi
    sleep 1   # let the workers connect before the clock starts
    sed -e "s/^name = .*/name = \"metrics-$variant-$rep\"/" -e "s|^dir = \"out\"|dir = \"out-$variant-$rep\"|" "$DIR/job.toml" > "$DIR/$variant-$rep.toml"
    "$BIN/batchfleet" --metrics-port "$cport" --metrics-host 127.0.0.1 run --no-progress "$DIR/$variant-$rep.toml" >/dev/null 2>&1
    rate[$variant]+="$(grep -o '"rows_per_s": [0-9.]*' "$DIR/out-$variant-$rep/summary.json" | awk '{print $2}') "
    [ -n "$scraper" ] && { kill "$scraper" 2>/dev/null; wait "$scraper" 2>/dev/null || true; scraper=; }
    kill -TERM "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null || true; pids=()
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
off=$(echo "${rate[off]}" | median); on=$(echo "${rate[on]}" | median)
echo "metrics overhead: $ROWS rows, $WORKERS workers × $threads thread(s), median of $REPS"
printf '  %-30s %12.0f rows/s  (runs: %s)\n' "metrics off" "$off" "${rate[off]}"
printf '  %-30s %12.0f rows/s  (runs: %s) ratio %.3f\n' "metrics on, scraped every 1 s" "$on" "${rate[on]}" "$(echo "$on / $off" | bc -l)"
