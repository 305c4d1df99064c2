#!/bin/sh
# Writes docker/secrets/: a random password per identity of the compose
# stack, inside the URLs the batchfleet parts read (BATCHFLEET_*_URL_FILE),
# the message-signing key, and the admin passwords. Files that exist are
# kept, so running it again changes nothing. Mode 0600; never commit them.
set -eu
dir=$(dirname "$0")/secrets
mkdir -p "$dir"
umask 077
put() { [ -s "$dir/$1" ] || printf '%s\n' "$2" > "$dir/$1"; }
pw() { openssl rand -hex 16; }
put signing_key "$(openssl rand -hex 32)"
put rabbitmq_admin_password "$(pw)"
put grafana_admin_password "$(pw)"
put worker_amqp_url "amqp://batchfleet-worker:$(pw)@rabbitmq:5672/%2f"
put coordinator_amqp_url "amqp://batchfleet-coordinator:$(pw)@rabbitmq:5672/%2f"
put monitor_amqp_url "http://batchfleet-monitor:$(pw)@rabbitmq:15672/%2f"
put worker_redis_url "redis://batchfleet-worker:$(pw)@redis:6379/0"
put coordinator_redis_url "redis://batchfleet-coordinator:$(pw)@redis:6379/0"
echo "secrets in $dir"
