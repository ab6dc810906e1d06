#!/usr/bin/env bash
# Does a slow origin hold back another volume's write-back? (issue 16)
#   bench/slow_origin.sh [ORIGIN_B_MB_S] [ROUNDS] [BIN...]
# Volume A ("") is a file; volume B ("stream") is an nbdkit export limited
# to ORIGIN_B_MB_S (the rate filter). B takes a sequential 1 MiB write
# stream at QD4, faster than its origin drains it, for the whole run. A
# takes 4 KiB random writes at QD1, flushed every 16 writes, for 10 s.
# When A's writes end, the run prints A's dirty blocks and how long A
# then takes to reach its origin (A's dirty blocks 0) while B's stream
# goes on, polled every 0.2 s for at most 60 s. Each BIN (default: this
# tree's release binary) is measured once per round, interleaved, so two
# trees can be compared in one run. Needs fio and nbdkit.
set -euo pipefail
rate_mb_s=${1:-20}
rounds=${2:-3}
shift $(( $# >= 2 ? 2 : $# ))
root=$(cd "$(dirname "$0")/.." && pwd)
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  [ -x "$root/target/release/cairn" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
  bins=("$root/target/release/cairn")
fi
# shellcheck source=bench/volumes_common.sh
. "$root/bench/volumes_common.sh"
volumes_bench_setup slow_origin

# A's and B's dirty blocks, from `volume list --json`.
dirty() { # bin
  "$1" volume list --cache "$work/cache.img" --json 2>/dev/null | python3 -c '
import json, sys
v = {x["name"]: x["dirty_blocks"] for x in json.load(sys.stdin)}
print(v[""], v["stream"])'
}

one() { # bin -> prints: a_iops a_dirty_at_end drain_s b_dirty_at_end
  local bin=$1
  stop_all
  rm -f "$work"/*.img "$work"/*.sock
  truncate -s 256M "$work/cache.img"
  truncate -s 1G "$work/a.img" "$work/b.img"
  nbdkit --exit-with-parent -f -U "$work/b.sock" -P "$work/nbdkit.pid" --filter=rate \
    file "$work/b.img" rate="$((rate_mb_s * 8))M" &
  for _ in $(seq 100); do [ -S "$work/b.sock" ] && break; sleep 0.1; done
  "$bin" format --cache "$work/cache.img" --origin "$work/a.img" >/dev/null 2>&1
  "$bin" volume add --cache "$work/cache.img" --name stream \
    --origin "nbd+unix:///?socket=$work/b.sock" >/dev/null 2>&1
  "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" 2>"$work/serve.log" &
  echo $! >"$work/serve.pid"
  for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
  local a="nbd+unix:///?socket=$work/s.sock" b="nbd+unix:///stream?socket=$work/s.sock"
  fio --name=stream --ioengine=nbd --uri="$b" --rw=write --bs=1M --iodepth=4 \
    --size=900M --time_based --runtime=120 >/dev/null 2>&1 &
  echo $! >"$work/stream.pid"
  sleep 3
  fio --name=a --ioengine=nbd --uri="$a" --rw=randwrite --bs=4k --iodepth=1 \
    --fsync=16 --end_fsync=1 --size=256M --time_based --runtime=10 --randrepeat=0 \
    --output-format=json --output="$work/a.json" >/dev/null
  local a_iops
  a_iops=$(python3 -c "import json; print('%.0f' % json.load(open('$work/a.json'))['jobs'][0]['write']['iops'])")
  local a_dirty b_dirty start
  read -r a_dirty b_dirty < <(dirty "$bin")
  local at_end=$a_dirty b_at_end=$b_dirty
  start=$(date +%s.%N)
  local drain="> 60"
  for _ in $(seq 300); do
    read -r a_dirty b_dirty < <(dirty "$bin")
    if [ "$a_dirty" -eq 0 ]; then
      drain=$(python3 -c "print('%.1f' % ($(date +%s.%N) - $start))")
      break
    fi
    sleep 0.2
  done
  echo "$a_iops $at_end $drain $b_at_end"
}

echo "slow origin: B's origin ${rate_mb_s} MB/s under a 1 MiB QD4 stream; A 4 KiB random writes QD1, a flush every 16, 10 s"
printf '  %-6s %-40s %10s %16s %20s %16s\n' round binary "A IOPS" "A dirty at end" "A on origin after s" "B dirty at end"
for round in $(seq "$rounds"); do
  for bin in "${bins[@]}"; do
    read -r iops at_end drain b_at_end < <(one "$bin")
    printf '  %-6s %-40s %10s %16s %20s %16s\n' "$round" "$bin" "$iops" "$at_end" "$drain" "$b_at_end"
  done
done
