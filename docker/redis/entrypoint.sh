#!/bin/sh
# Redis for the compose stack with an ACL user per batchfleet part (least
# privilege, see docs/deploy.md "Identities"), their passwords taken from
# the URLs of the compose secrets into an ACL file on a tmpfs — never on the
# command line, where `ps` shows it. The default user is switched off.
#   batchfleet-worker, batchfleet-coordinator: keys bf:*, batchfleet's
#   commands only (no FLUSHALL, FLUSHDB, CONFIG, KEYS, DEBUG, …)
set -eu
acl=/tmp/users.acl
rules='resetkeys ~bf:* resetchannels -@all +@read +@write +@scripting +@transaction +@connection +time -@dangerous +info'
# The password of a URL file: scheme://user:PASSWORD@host…
password() { sed -E 's#^[a-z]+://[^:]*:([^@]*)@.*#\1#' "$1"; }
umask 077
{
  echo "user default off"
  echo "user batchfleet-worker on >$(password /run/secrets/worker_redis_url) $rules"
  echo "user batchfleet-coordinator on >$(password /run/secrets/coordinator_redis_url) $rules"
} > "$acl"
exec redis-server --aclfile "$acl" --appendonly yes --appendfsync everysec --dir /data
