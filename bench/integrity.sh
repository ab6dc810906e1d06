#!/usr/bin/env bash
# Origin integrity cost (issue 7): 64 KiB sequential writes at queue depth 8
# through fio's nbd engine, cairn with `format --integrity` against cairn
# without it, same files, interleaved rounds, medians. Also reports the
# daemon's read_bytes (/proc/PID/io) during the writes: tags are never
# read, so it must be 0 with integrity on. Write-back is held back
# (--no-writeback) so the run measures the write path; a drain after each
# run sets the tags, and its time is reported too.
#   bench/integrity.sh [SIZE_MIB] [ROUNDS]
set -euo pipefail
size_mib=${1:-1024}
rounds=${2:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/target/release/cairn"
[ -x "$bin" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
work=$(mktemp -d /var/tmp/cairn-integrity.XXXXXX)
cleanup() {
  [ -f "$work/cairn.pid" ] && kill "$(cat "$work/cairn.pid")" 2>/dev/null || true
  sleep 0.5
  rm -rf "$work"
}
trap cleanup EXIT
truncate -s $(( size_mib * 2 + 256 ))M "$work/cache.img"
truncate -s $(( size_mib * 4 ))M "$work/origin.img"
run_one() { # $1 = label, rest = format flags
  local label=$1; shift
  "$bin" format --force --cache "$work/cache.img" --origin "$work/origin.img" "$@" >/dev/null
  CAIRN_RUNTIME_DIR="$work" "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" \
    --no-writeback 2>"$work/serve.log" &
  local pid=$!
  echo $pid >"$work/cairn.pid"
  for _ in $(seq 300); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
  # Let recalculation of the (empty) origin finish before measuring.
  for _ in $(seq 600); do
    CAIRN_RUNTIME_DIR="$work" "$bin" status --cache "$work/cache.img" --json \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d.get("recalc_state","complete")=="complete" else 1)' && break
    sleep 0.2
  done
  local before after
  before=$(awk '/^read_bytes/ {print $2}' "/proc/$pid/io")
  fio --output-format=json --output="$work/$label.json" --name=seq --ioengine=nbd \
    --uri="nbd+unix:///?socket=$work/s.sock" --rw=write --bs=64k --iodepth=8 \
    --size="${size_mib}M" --end_fsync=1 >/dev/null
  after=$(awk '/^read_bytes/ {print $2}' "/proc/$pid/io")
  local t0 t1
  t0=$(date +%s.%N)
  CAIRN_RUNTIME_DIR="$work" "$bin" flush --cache "$work/cache.img" >/dev/null
  t1=$(date +%s.%N)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$work/cairn.pid"
  python3 - "$work/$label.json" "$label" "$((after - before))" "$t0" "$t1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
w = d["jobs"][0]["write"]
print(f"{sys.argv[2]} write_mib_s {w['bw_bytes']/2**20:.1f} read_bytes_during_writes {sys.argv[3]} "
      f"drain_s {float(sys.argv[5]) - float(sys.argv[4]):.2f}")
PY
}
for _ in $(seq "$rounds"); do
  run_one integrity-off
  run_one integrity-on --integrity
done | tee "$work/results.txt"
python3 - "$work/results.txt" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    rows.setdefault(f[0], []).append((float(f[2]), int(f[4]), float(f[6])))
off = statistics.median(r[0] for r in rows["integrity-off"])
on = statistics.median(r[0] for r in rows["integrity-on"])
drain_off = statistics.median(r[2] for r in rows["integrity-off"])
drain_on = statistics.median(r[2] for r in rows["integrity-on"])
reads_on = max(r[1] for r in rows["integrity-on"])
print()
print("| 64 KiB seq write QD8 | MiB/s (median) | drain s (median) |")
print("|---|---|---|")
print(f"| integrity off | {off:.1f} | {drain_off:.2f} |")
print(f"| integrity on | {on:.1f} | {drain_on:.2f} |")
print(f"\nratio integrity on / off: {on/off:.2f}x write throughput, {drain_on/drain_off:.2f}x drain time")
print(f"daemon read_bytes during the writes with integrity on (max of rounds): {reads_on}")
PY
