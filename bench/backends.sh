#!/usr/bin/env bash
# The pread and io_uring device backends of `cairn serve`, side by side in one
# run, through fio's nbd engine (libnbd) over a Unix socket:
#   randread: 4 KiB random reads, QD32, on a working set that is fully cached
#             (`cairn warm` first; the script checks nothing missed);
#   seqwrite: 64 KiB sequential writes, QD8, one pass, write-back running.
# Both backends use the same cache and origin files on this machine's disk;
# runs are interleaved (pread, uring, uring, pread, pread, uring, ...) and
# each run starts from a freshly formatted cache. Medians and the uring/pread
# ratio are printed at the end.
#
#   bench/backends.sh [--rounds N] [--runtime SECS] [--dir DIR]
#
# Needs fio (with its nbd engine) and python3. The machine may be shared:
# only the ratios measured in the same run mean much.
set -euo pipefail

rounds=3
runtime=15
dir=/var/tmp/cairn-backends
cache_mib=2048
origin_mib=2048
workset_mib=512
seq_mib=1024
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
cargo build --release -p cairn --manifest-path "$root/Cargo.toml" >&2
bin="$target/release/cairn"
command -v fio >/dev/null || { echo "fio is needed" >&2; exit 1; }
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "fio has no nbd engine" >&2; exit 1; }

mkdir -p "$dir"
exec 9>"$dir/lock"
flock -n 9 || { echo "another run uses $dir" >&2; exit 1; }
export CAIRN_RUNTIME_DIR="$dir"
cache="$dir/cache.img"
origin="$dir/origin.img"
sock="$dir/cairn.sock"
results="$dir/results.tsv"
pid=
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -f "$cache" "$origin"
}
trap cleanup EXIT

# Fully written files (no holes), so both backends read and write real blocks.
echo "preparing ${cache_mib} MiB cache and ${origin_mib} MiB origin files in $dir" >&2
dd if=/dev/zero of="$cache" bs=1M count="$cache_mib" status=none conv=fsync
fio --name=fill --filename="$origin" --rw=write --bs=1M --size="${origin_mib}M" \
  --ioengine=psync --refill_buffers --end_fsync=1 --output=/dev/null
: >"$results"

status_field() {
  "$bin" status --cache "$cache" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"
}

# fio's JSON (its nbd engine may print a line before it), reduced to one
# number by the python expression $1 on `job`.
fio_number() {
  local expr=$1; shift
  fio --output-format=json --ioengine=nbd --uri="nbd+unix:///?socket=$sock" "$@" |
    python3 -c "import json,sys; t=sys.stdin.read(); job=json.loads(t[t.index('{'):])['jobs'][0]; print(round($expr))"
}

one_run() {
  local backend=$1 round=$2
  "$bin" format --force --cache "$cache" --origin "$origin" >/dev/null
  CAIRN_IO_BACKEND=$backend CAIRN_LOG=info "$bin" serve --cache "$cache" --socket "$sock" \
    2>"$dir/serve-$round-$backend.log" &
  pid=$!
  for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
  [ -S "$sock" ] || { echo "cairn serve did not start:" >&2; cat "$dir/serve-$round-$backend.log" >&2; exit 1; }
  grep -q "cache_backend=\"\\?${backend}" "$dir/serve-$round-$backend.log" || {
    echo "cairn did not use the $backend backend:" >&2; grep "devices opened" "$dir/serve-$round-$backend.log" >&2; exit 1; }

  "$bin" warm --cache "$cache" "0:${workset_mib}M" >/dev/null
  local misses_before
  misses_before=$(status_field read_misses)
  # Bytes the daemon read from storage (not the page cache) during the run.
  local io_before
  io_before=$(awk '/^read_bytes/ {print $2}' "/proc/$pid/io")
  local rr
  rr=$(fio_number "job['read']['iops']" --name=randread --rw=randread --bs=4k --iodepth=32 \
    --size="${workset_mib}M" --time_based --runtime="$runtime" --ramp_time=2 --randrepeat=0)
  local disk_mb
  disk_mb=$(( ($(awk '/^read_bytes/ {print $2}' "/proc/$pid/io") - io_before) / 1000000 ))
  local misses_after
  misses_after=$(status_field read_misses)
  if [ "$misses_after" != "$misses_before" ]; then
    echo "randread missed the cache ($misses_before -> $misses_after misses): the working set was not fully cached" >&2
    exit 1
  fi

  local sw
  sw=$(fio_number "job['write']['bw_bytes'] / 1e6" --name=seqwrite --rw=write --bs=64k \
    --iodepth=8 --offset="${workset_mib}M" --size="${seq_mib}M")

  kill -TERM "$pid"
  wait "$pid" || { echo "cairn serve did not shut down cleanly" >&2; exit 1; }
  pid=
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$backend" "$rr" "$sw" "$disk_mb" \
    "$(cut -d' ' -f1 /proc/loadavg)" >>"$results"
  printf 'round %s %-5s randread %7s IOPS (%6s MB read from disk)   seqwrite %5s MB/s   (load %s)\n' \
    "$round" "$backend" "$rr" "$disk_mb" "$sw" "$(cut -d' ' -f1 /proc/loadavg)" >&2
}

for round in $(seq "$rounds"); do
  # Alternate which backend goes first, so neither always follows the other.
  if [ $((round % 2)) -eq 1 ]; then order="pread uring"; else order="uring pread"; fi
  for backend in $order; do
    one_run "$backend" "$round"
  done
done

python3 - "$results" "$rounds" "$runtime" <<'PY'
import statistics, sys
path, rounds, runtime = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [l.split("\t") for l in open(path).read().splitlines()]
by = {}
for r, b, rr, sw, disk, load in rows:
    by.setdefault(b, []).append((int(rr), int(sw), int(disk), float(load)))
med = {b: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for b, v in by.items()}
print(f"\n{rounds} rounds, interleaved, {runtime} s per random-read run; medians\n")
print("| backend | 4 KiB randread QD32, cached (IOPS) | MB read from disk per randread run | 64 KiB seq write QD8 (MB/s) | every round (IOPS / MB/s) | load |")
print("|---|---:|---:|---:|---|---|")
for b in ("pread", "uring"):
    rounds_txt = ", ".join(f"{x[0]} / {x[1]}" for x in by[b])
    disk = statistics.median(x[2] for x in by[b])
    loads = f"{min(x[3] for x in by[b]):.1f}-{max(x[3] for x in by[b]):.1f}"
    print(f"| {b} | {med[b][0]:.0f} | {disk:.0f} | {med[b][1]:.0f} | {rounds_txt} | {loads} |")
print(f"| uring / pread | {med['uring'][0] / med['pread'][0]:.2f}x | | {med['uring'][1] / med['pread'][1]:.2f}x | | |")
PY
