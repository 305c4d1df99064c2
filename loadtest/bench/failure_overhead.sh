#!/usr/bin/env bash
# What 1% poisoned items cost: the same job, run side by side with a clean
# model, with a model that raises on one item in a hundred (isolation off: the
# item is dead-lettered), and with isolation on (only the bad row is rejected).
# Runs each variant REPS times, alternating, on WORKERS workers; prints medians.
# Needs release binaries (`make release`) and RabbitMQ/Redis (`make services`).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=target/release
ROWS=${ROWS:-200000}
ITEM_ROWS=${ITEM_ROWS:-2000}
REPS=${REPS:-3}
WORKERS=${WORKERS:-2}
DIR=${DIR:-$(mktemp -d)}
POOL=bench-fail-$$
export BATCHFLEET_REDIS_PREFIX=bf-bench-$$
PY=.venv/bin/python

items=$(( (ROWS + ITEM_ROWS - 1) / ITEM_ROWS ))
poison_row=$(( ROWS / 2 + 17 ))   # one row in one item: 1 item of $items
$PY loadtest/python/make_job.py --out "$DIR" --rows "$ROWS" --files 4 --features 32 --hidden 64 \
  --name bench --pool "$POOL" --item-rows "$ITEM_ROWS" --poison-rows "$poison_row" >/dev/null
$PY loadtest/python/make_faulty_models.py --base "$DIR/model.pt" --out-dir "$DIR" >/dev/null

threads=$(( $(nproc) / WORKERS )); [ "$threads" -ge 1 ] || threads=1
pids=()
cleanup() {
  [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null
  wait 2>/dev/null || true
  # The benchmark's pool and job state are its own: remove them (local broker only).
  if command -v rabbitmqctl >/dev/null; then
    for q in $(timeout 30 rabbitmqctl list_queues name --quiet </dev/null 2>/dev/null | grep "^bf\.$POOL\."); do
      timeout 20 rabbitmqctl delete_queue "$q" </dev/null >/dev/null 2>&1 || true
    done
  fi
  redis-cli --scan --pattern "$BATCHFLEET_REDIS_PREFIX:*" 2>/dev/null | xargs -r redis-cli del >/dev/null 2>&1 || true
}
trap cleanup EXIT
for i in $(seq 1 "$WORKERS"); do
  "$BIN/batchfleet-worker" --pool "$POOL" --threads "$threads" --worker-id "bench-$i" --data-root "$DIR" >"$DIR/worker-$i.log" 2>&1 &
  pids+=($!)
done

manifest() { # name model failure-lines out
  sed -e "s/^name = .*/name = \"$1\"/" -e "s|^path = \"model.pt\"|path = \"$2\"|" -e "s|^dir = \"out\"|dir = \"$4\"|" "$DIR/job.toml" > "$DIR/$1.toml"
  printf '\n[failure]\n%b\n' "$3" >> "$DIR/$1.toml"
}

declare -A secs
for rep in $(seq 1 "$REPS"); do
  for variant in clean poison isolate; do
    case $variant in
      clean)   manifest "clean-$rep" model.pt "" "out-clean-$rep" ;;
      poison)  manifest "poison-$rep" poison.pt "isolate_poison_rows = false" "out-poison-$rep" ;;
      isolate) manifest "isolate-$rep" poison.pt "isolate_poison_rows = true" "out-isolate-$rep" ;;
    esac
    "$BIN/batchfleet" run --no-progress "$DIR/$variant-$rep.toml" >/dev/null 2>&1 || true
    s=$(grep -o '"duration_s": [0-9.]*' "$DIR/out-$variant-$rep/summary.json" | awk '{print $2}')
    secs[$variant]+="$s "
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
c=$(echo "${secs[clean]}" | median); p=$(echo "${secs[poison]}" | median); i=$(echo "${secs[isolate]}" | median)
echo "failure overhead: $ROWS rows, $items items, 1 poisoned item (1%), $WORKERS workers × $threads thread(s), median of $REPS"
printf '  %-34s %8.3f s  (runs: %s)\n' "clean model" "$c" "${secs[clean]}"
printf '  %-34s %8.3f s  (runs: %s) ratio %.2f\n' "1% items poisoned, dead-lettered" "$p" "${secs[poison]}" "$(echo "$p / $c" | bc -l)"
printf '  %-34s %8.3f s  (runs: %s) ratio %.2f\n' "1% items poisoned, row isolated" "$i" "${secs[isolate]}" "$(echo "$i / $c" | bc -l)"
grep -h '"status"\|"items_failed"\|"rows_rejected"' "$DIR/out-poison-1/summary.json" "$DIR/out-isolate-1/summary.json" | tr -d ' ,' | paste -sd' '
