#!/usr/bin/env bash
# What leases, speculation and checkpoints buy, measured side by side:
#  A. stragglers: one fast worker and one slowed down 50× (--debug-batch-delay);
#     the same job with speculation off (--speculate-after 0) and on (default),
#     alternating, REPS times each; medians of the wall time.
#  B. checkpoints: one worker killed (-9) KILL_AT seconds into a long item, a
#     second one takes over; the same job with checkpoint_every = 0 and = 4;
#     rows recomputed (rows through the model beyond the job's rows) and wall time.
# Workers get an artificial per-batch delay so items take seconds (a heavier
# model). Needs release binaries (`make release`) and RabbitMQ/Redis (`make services`).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=target/release
REPS=${REPS:-3}
KILL_AT=${KILL_AT:-3}
DIR=${DIR:-$(mktemp -d)}
POOL=bench-faults-$$
export BATCHFLEET_REDIS_PREFIX=bf-bench-$$
PY=.venv/bin/python
pids=()
cleanup() {
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
worker() { # id extra-args... ; appends the pid to pids
  local id=$1; shift
  "$BIN/batchfleet-worker" --pool "$POOL" --threads 1 --worker-id "$id" --data-root "$DIR" "$@" >"$DIR/$id.log" 2>&1 &
  pids+=($!)
}
stop_workers() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; pids=(); }
field() { grep -o "\"$2\": [0-9.]*" "$1" | awk '{print $2}'; }
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
manifest() { # src-dir name out-dir checkpoint_every
  sed -e "s/^name = .*/name = \"$2\"/" -e "s|^dir = \"out\"|dir = \"$3\"|" \
      -e "s/^checkpoint_every = .*/checkpoint_every = $4/" "$1/job.toml" > "$1/$2.toml"
}

# A. stragglers: 20 items of 5000 rows, mini-batches of 500 (10 per item).
A=$DIR/straggler
$PY loadtest/python/make_job.py --out "$A" --rows 100000 --files 2 --features 32 --hidden 64 \
  --name strag --pool "$POOL" --item-rows 5000 --batch-size 500 --checkpoint-every 1 >/dev/null
worker fast --prefetch 2 --debug-batch-delay 10ms
worker slow --prefetch 1 --debug-batch-delay 500ms
declare -A secs
for rep in $(seq 1 "$REPS"); do
  for variant in off on; do
    manifest "$A" "strag-$variant-$rep" "out-$variant-$rep" 1
    speculate=3; [ "$variant" = off ] && speculate=0
    "$BIN/batchfleet" run --no-progress --speculate-after "$speculate" "$A/strag-$variant-$rep.toml" >"$A/run-$variant-$rep.log" 2>&1
    secs[$variant]+="$(field "$A/out-$variant-$rep/summary.json" duration_s) "
  done
done
stop_workers
off=$(echo "${secs[off]}" | median); on=$(echo "${secs[on]}" | median)
echo "A. stragglers: 100000 rows, 20 items, 1 fast worker + 1 worker 50x slower (median of $REPS)"
printf '  %-28s %7.2f s  (runs: %s)\n' "speculation off" "$off" "${secs[off]}"
printf '  %-28s %7.2f s  (runs: %s) ratio %.2f\n' "speculation on (default)" "$on" "${secs[on]}" "$(echo "$on / $off" | bc -l)"
echo "  items published again with speculation on: $(field "$A/out-on-1/summary.json" items_redispatched) (run 1)"

# B. checkpoints: 4 items of 20000 rows, mini-batches of 500 (40 per item, 100 ms each).
B=$DIR/checkpoint
$PY loadtest/python/make_job.py --out "$B" --rows 80000 --files 1 --features 32 --hidden 64 \
  --name ckpt --pool "$POOL" --item-rows 20000 --batch-size 500 --checkpoint-every 4 >/dev/null
echo "B. a worker killed -9 ${KILL_AT}s into a 4 s item; 80000 rows, 4 items; a second worker takes over"
for every in 0 4; do
  manifest "$B" "ckpt-$every" "out-$every" "$every"
  worker "victim-$every" --prefetch 1 --debug-batch-delay 100ms
  victim=${pids[-1]}
  "$BIN/batchfleet" run --no-progress --speculate-after 0 "$B/ckpt-$every.toml" >"$B/run-$every.log" 2>&1 &
  coordinator=$!
  sleep "$KILL_AT"   # the fault's moment, not a wait for an event
  kill -9 "$victim"; wait "$victim" 2>/dev/null || true; pids=()
  worker "heir-$every" --prefetch 1 --debug-batch-delay 100ms
  wait "$coordinator"
  stop_workers
  s=$B/out-$every/summary.json
  rows=$(field "$s" rows_total); computed=$(field "$s" rows_computed)
  printf '  checkpoint_every = %-3s %7.2f s wall, %6d rows recomputed, %6d rows resumed from a checkpoint\n' \
    "$every" "$(field "$s" duration_s)" "$((computed - rows))" "$(field "$s" rows_resumed)"
done
