# RabbitMQ permissions of batchfleet's users (configure, write, read — one
# regex a line), sourced by entrypoint.sh and by the test that runs a job
# with them (worker/tests/it/privilege.rs). Pool names are letters, digits,
# '-' and '_': nothing in them to escape.

# A pool's workers: its queues (bf.<pool>.*), the shared dead-letter
# exchange their queues name (declared and bound to), and the default
# exchange (amq.default: retries, dead letters and hand-backs go through
# it). $1: the pools, space-separated.
worker_permissions() {
  own="bf\\.($(printf '%s' "$1" | tr -s ' ' '|'))\\..*"
  printf '%s\n' "^($own|bf\\.dlx)\$" "^($own|bf\\.dlx|amq\\.default)\$" "^($own|bf\\.dlx)\$"
}

# The coordinator (and `batchfleet supervise`, `dlq`): every pool's queues.
coordinator_permissions() {
  printf '%s\n' '^bf\..*$' '^(bf\..*|amq\.default)$' '^bf\..*$'
}
