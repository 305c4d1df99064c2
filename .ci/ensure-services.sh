#!/usr/bin/env bash
# Makes sure RabbitMQ and Redis answer at the configured URLs
# (BATCHFLEET_AMQP_URL, BATCHFLEET_REDIS_URL; defaults on 127.0.0.1).
# Local ones that are down are started (and installed from Debian's packages
# when missing and we are root); remote ones that are down stop us with the
# exact thing to do.
set -euo pipefail

# shellcheck source=.ci/service-urls.sh
. "$(dirname "$0")/service-urls.sh"

wait_for() { # host port seconds
  local deadline=$((SECONDS + $3))
  while [ $SECONDS -lt $deadline ]; do reachable "$1" "$2" && return 0; sleep 0.5; done
  return 1
}

is_local() { case "$1" in 127.*|localhost|::1) return 0;; *) return 1;; esac; }

install_pkg() { # package command
  command -v "$2" >/dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing $1 from Debian's packages"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
  else
    echo "error: $2 is not installed; install it with: sudo apt-get install $1" >&2
    return 1
  fi
}

ensure() { # name host port package start-command...
  local name=$1 host=$2 port=$3 pkg=$4; shift 4
  if reachable "$host" "$port"; then echo "$name is up at $host:$port"; return 0; fi
  if ! is_local "$host"; then
    echo "error: $name is not reachable at $host:$port; start it there, or point the URL (BATCHFLEET_*_URL) at a running one" >&2
    return 1
  fi
  install_pkg "$pkg" "$1"
  echo "$name is down at $host:$port; starting it: $*"
  "$@" >/dev/null
  wait_for "$host" "$port" 90 || { echo "error: $name did not come up on $host:$port; run by hand: $*" >&2; return 1; }
  echo "$name is up at $host:$port"
}

read -r ahost aport < <(hostport "$AMQP_URL" 5672)
read -r rhost rport < <(hostport "$REDIS_URL" 6379)

redis_cmd=(redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$rport" --save "" --appendonly no)
if [ -d /var/lib/redis ] && [ -d /var/log/redis ]; then
  redis_cmd+=(--dir /var/lib/redis --logfile /var/log/redis/ci.log)
fi
ensure Redis "$rhost" "$rport" redis-server "${redis_cmd[@]}"
ensure RabbitMQ "$ahost" "$aport" rabbitmq-server rabbitmq-server -detached
