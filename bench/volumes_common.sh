# Sourced by the several-volume benchmarks (dirty_share.sh, slow_origin.sh):
#   volumes_bench_setup NAME
# checks for fio and nbdkit, makes the work directory $work under /var/tmp
# (removed on exit), defines stop_all (kills every process whose pid file
# is in $work) and points CAIRN_RUNTIME_DIR at $work.
volumes_bench_setup() {
  local name=$1 tool
  for tool in fio nbdkit; do
    command -v "$tool" >/dev/null || { echo "$name: $tool is missing" >&2; exit 1; }
  done
  work=$(mktemp -d "/var/tmp/cairn-$name.XXXXXX")
  trap 'stop_all; rm -rf "$work"' EXIT
  export CAIRN_RUNTIME_DIR="$work"
}

stop_all() {
  for f in "$work"/*.pid; do [ -e "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done
  rm -f "$work"/*.pid
  sleep 0.3
}
