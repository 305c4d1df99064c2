#!/bin/sh
# RabbitMQ for the compose stack, with one user per batchfleet part (least
# privilege, see docs/deploy.md "Identities"): starts the server with the
# image's own entrypoint, waits for it, then creates or updates the users
# with the passwords in the URLs of the compose secrets (files, never the
# command line or the environment) and waits on the server, forwarding
# SIGTERM to it.
#   batchfleet-worker       the queues of the pools in RABBITMQ_WORKER_POOLS
#                           (space-separated; default "default"), bf.dlx, amq.default
#   batchfleet-coordinator  every pool's queues
#   batchfleet-monitor      the management API's read-only "monitoring" tag (KEDA, dashboards)
set -euf   # -f: the permission regexes hold `*`, never a file glob
docker-entrypoint.sh rabbitmq-server &
server=$!
trap 'rabbitmqctl stop >/dev/null 2>&1; wait "$server"' TERM INT
until rabbitmq-diagnostics -q ping >/dev/null 2>&1; do
  kill -0 "$server" 2>/dev/null || exit 1
  sleep 2
done
# The password of a URL file: scheme://user:PASSWORD@host…
password() { sed -E 's#^[a-z]+://[^:]*:([^@]*)@.*#\1#' "$1"; }
user() { # name url-file configure write read [tags]; permissions.sh gives the regexes
  pass=$(password "$2")
  rabbitmqctl -q add_user "$1" "$pass" 2>/dev/null || rabbitmqctl -q change_password "$1" "$pass"
  rabbitmqctl -q set_permissions -p / "$1" "$3" "$4" "$5"
  rabbitmqctl -q set_user_tags "$1" ${6:-}
}
. /usr/local/lib/batchfleet-permissions.sh
# shellcheck disable=SC2046 # one regex a line, none with spaces
user batchfleet-worker /run/secrets/worker_amqp_url $(worker_permissions "${RABBITMQ_WORKER_POOLS:-default}")
# shellcheck disable=SC2046
user batchfleet-coordinator /run/secrets/coordinator_amqp_url $(coordinator_permissions)
user batchfleet-monitor /run/secrets/monitor_amqp_url '^$' '^$' '^$' monitoring
echo "batchfleet users ready"
wait "$server"
