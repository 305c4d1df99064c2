# Where RabbitMQ and Redis are (BATCHFLEET_AMQP_URL, BATCHFLEET_REDIS_URL;
# defaults on 127.0.0.1) and whether they answer. Sourced by
# ensure-services.sh and demo.sh.
AMQP_URL="${BATCHFLEET_AMQP_URL:-amqp://127.0.0.1:5672/%2f}"
REDIS_URL="${BATCHFLEET_REDIS_URL:-redis://127.0.0.1:6379/}"

# host and port of a URL, credentials dropped (they are never printed)
hostport() {
  local rest="${1#*://}" default_port="$2"
  rest="${rest##*@}"; rest="${rest%%/*}"; rest="${rest%%\?*}"
  local host="${rest%:*}" port="${rest##*:}"
  [ "$host" = "$rest" ] && port="$default_port"
  [ -z "$host" ] && host=127.0.0.1
  echo "$host $port"
}

reachable() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }
