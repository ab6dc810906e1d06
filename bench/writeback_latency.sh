#!/usr/bin/env bash
# Foreground read latency while write-back runs (issue 6): a mixed workload
# (4 KiB random reads of cached data + 4 KiB random writes with flushes)
# against cairn over a slow origin (nbdkit delay, 5 ms), once with
# write-back forced to run continuously (high watermark 1%) and once with
# --no-writeback. Prints the reader's p50/p99 latency for both and the ratio.
#   bench/writeback_latency.sh [RUNTIME_S] [ROUNDS]
set -euo pipefail
runtime=${1:-15}
rounds=${2:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/target/release/cairn"
[ -x "$bin" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
work=$(mktemp -d /var/tmp/cairn-wblat.XXXXXX)
cleanup() {
  for p in "$work"/*.pid; do [ -f "$p" ] && kill "$(cat "$p")" 2>/dev/null || true; done
  sleep 0.5
  rm -rf "$work"
}
trap cleanup EXIT
truncate -s 1G "$work/cache.img"
truncate -s 2G "$work/origin.img"
nbdkit -f -U "$work/origin.sock" --filter=delay file "$work/origin.img" rdelay=5ms wdelay=5ms &
echo $! >"$work/nbdkit.pid"
for _ in $(seq 100); do [ -S "$work/origin.sock" ] && break; sleep 0.1; done
origin="nbd+unix:///?socket=$work/origin.sock"
run_one() { # $1 = label, rest = serve flags
  local label=$1; shift
  "$bin" format --force --cache "$work/cache.img" --origin "$origin" >/dev/null
  CAIRN_RUNTIME_DIR="$work" "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" "$@" 2>"$work/serve.log" &
  echo $! >"$work/cairn.pid"
  for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
  local uri="nbd+unix:///?socket=$work/s.sock"
  # Warm the read set (256 MiB) into the cache.
  CAIRN_RUNTIME_DIR="$work" "$bin" warm --cache "$work/cache.img" 0:256M >/dev/null
  fio --output-format=json --output="$work/$label.json" \
    --name=reader --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --offset=0 --size=256M \
    --iodepth=4 --runtime="$runtime" --time_based \
    --name=writer --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --offset=512M --size=256M \
    --iodepth=1 --fsync=4 --runtime="$runtime" --time_based >/dev/null
  local st; st=$(CAIRN_RUNTIME_DIR="$work" "$bin" status --cache "$work/cache.img" --json)
  kill "$(cat "$work/cairn.pid")"; wait "$(cat "$work/cairn.pid")" 2>/dev/null || true
  python3 - "$work/$label.json" "$label" "$st" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); st = json.loads(sys.argv[3])
r = next(j for j in d["jobs"] if j["jobname"] == "reader")["read"]
w = next(j for j in d["jobs"] if j["jobname"] == "writer")["write"]
p = r["clat_ns"]["percentile"]
print(f"{sys.argv[2]} read_p50_us {p['50.000000']/1000:.1f} read_p99_us {p['99.000000']/1000:.1f} "
      f"read_iops {r['iops']:.0f} write_iops {w['iops']:.0f} written_back_blocks {st['writeback_blocks']}")
PY
}
for round in $(seq "$rounds"); do
  run_one "writeback-on" --writeback-high-pct 1 --writeback-low-pct 0
  run_one "writeback-off" --no-writeback
done | tee "$work/results.txt"
python3 - "$work/results.txt" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    rows.setdefault(f[0], []).append(dict(zip(f[1::2], map(float, f[2::2]))))
med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
on, off = med["writeback-on"], med["writeback-off"]
print(f"medians over {len(rows['writeback-on'])} rounds:")
print(f"  read p99 with write-back running: {on['read_p99_us']:.1f} us ({on['written_back_blocks']:.0f} blocks written back)")
print(f"  read p99 without write-back:      {off['read_p99_us']:.1f} us")
print(f"  ratio: {on['read_p99_us'] / off['read_p99_us']:.2f}x (goal <= 2x)")
PY
