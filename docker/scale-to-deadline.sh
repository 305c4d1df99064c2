#!/bin/sh
# Scales a pool's workers to what its jobs' [job] deadline needs
# (`batchfleet scale-advice`, the value of batchfleet_pool_workers_needed),
# kept between a floor and a ceiling: for docker compose and VM fleets,
# where KEDA's Prometheus trigger (docker/k8s/keda.yaml) is not there to do
# it. Every INTERVAL seconds, or once with --once.
#
#   docker/scale-to-deadline.sh [--once]
#
# POOL         the pool (default "default")
# MIN_WORKERS  the floor, kept while no job needs more (default 1)
# MAX_WORKERS  the ceiling: the most you would pay for (default 20)
# INTERVAL     seconds between looks (default 30)
# BATCHFLEET   how to run the CLI (default "batchfleet"; in the compose
#              stack: "docker compose run --rm -T coordinator")
# SCALE        the command that sets the count, with %d where the count
#              goes (default "docker compose up -d --no-recreate --scale
#              worker=%d worker"; an autoscaling group: "aws autoscaling
#              set-desired-capacity --auto-scaling-group-name workers
#              --desired-capacity %d")
#
# Needs jq. Changes nothing while the advice cannot be read.
set -eu
pool=${POOL:-default}
min=${MIN_WORKERS:-1}
max=${MAX_WORKERS:-20}
interval=${INTERVAL:-30}
cli=${BATCHFLEET:-batchfleet}
scale=${SCALE:-docker compose up -d --no-recreate --scale worker=%d worker}
last=""

look() {
  # $cli is a command line: split on purpose.
  # shellcheck disable=SC2086
  if ! advice=$($cli scale-advice --pool "$pool" --json); then
    echo "scale-to-deadline: batchfleet scale-advice failed; leaving the fleet as it is" >&2
    return 0
  fi
  need=$(printf '%s' "$advice" | jq -r '.pools[0].workers_needed // 0')
  case $need in '' | *[!0-9]*) need=0 ;; esac
  n=$need
  [ "$n" -lt "$min" ] && n=$min
  [ "$n" -gt "$max" ] && n=$max
  if [ "$n" != "$last" ]; then
    echo "scale-to-deadline: pool $pool needs $need worker(s) for its deadlines; scaling to $n (between $min and $max)"
    # shellcheck disable=SC2059
    sh -c "$(printf "$scale" "$n")"
    last=$n
  fi
}

if [ "${1:-}" = "--once" ]; then
  look
  exit 0
fi
while :; do
  look
  sleep "$interval"
done
