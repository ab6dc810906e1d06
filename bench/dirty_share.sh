#!/usr/bin/env bash
# Does one volume's write stream to a slow origin hold back another
# volume's writes? (issue 16: the dirty share)
#   bench/dirty_share.sh [CACHE_MIB] [ORIGIN_B_MB_S] [ROUNDS]
# Volume A ("") is a file; volume B ("stream") is an nbdkit export limited
# to ORIGIN_B_MB_S (the rate filter). B takes sequential 1 MiB writes at
# QD4, faster than its origin drains them, while A runs fsync'd 4 KiB
# random writes at QD1 (W1's pattern). Each round measures A alone, then A
# during B's stream, with B's dirty share at its default (half the log
# with two volumes) and at 100% (no limit), in the same round. Prints A's
# IOPS and p99 latency for each, and at the end of each run the cache's
# writeback_stalls (writes that waited for a full log), dirty_share_waits
# and dirty blocks. Needs fio and nbdkit.
set -euo pipefail
cache_mib=${1:-256}
rate_mb_s=${2:-20}
rounds=${3:-2}
seconds=15
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${CAIRN_BIN:-$root/target/release/cairn}
[ -x "$bin" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
# shellcheck source=bench/volumes_common.sh
. "$root/bench/volumes_common.sh"
volumes_bench_setup dirty_share

# fio's write IOPS and p99 completion latency (µs) of A, from JSON.
a_writes() { # seconds uri
  fio --name=a --ioengine=nbd --uri="$2" --rw=randwrite --bs=4k --iodepth=1 \
    --fsync=1 --size=256M --time_based --runtime="$1" --randrepeat=0 \
    --output-format=json --output="$work/a.json" >/dev/null
  python3 -c "
import json; j = json.load(open('$work/a.json'))['jobs'][0]['write']
print('%.0f %.0f' % (j['iops'], j['clat_ns']['percentile']['99.000000'] / 1000))"
}

one() { # share_pct_flag...  -> prints: alone_iops alone_p99 during_iops during_p99
  stop_all
  rm -f "$work"/*.img "$work"/*.sock
  truncate -s "${cache_mib}M" "$work/cache.img"
  truncate -s 1G "$work/a.img" "$work/b.img"
  nbdkit --exit-with-parent -f -U "$work/b.sock" -P "$work/nbdkit.pid" --filter=rate \
    file "$work/b.img" rate="$((rate_mb_s * 8))M" &
  for _ in $(seq 100); do [ -S "$work/b.sock" ] && break; sleep 0.1; done
  "$bin" format --cache "$work/cache.img" --origin "$work/a.img" >/dev/null 2>&1
  "$bin" volume add --cache "$work/cache.img" --name stream \
    --origin "nbd+unix:///?socket=$work/b.sock" "$@" >/dev/null 2>&1
  "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" 2>"$work/serve.log" &
  echo $! >"$work/serve.pid"
  for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
  local a="nbd+unix:///?socket=$work/s.sock" b="nbd+unix:///stream?socket=$work/s.sock"
  local alone during
  alone=$(a_writes "$seconds" "$a")
  fio --name=stream --ioengine=nbd --uri="$b" --rw=write --bs=1M --iodepth=4 \
    --size=900M --time_based --runtime=$((seconds + 10)) >/dev/null 2>&1 &
  echo $! >"$work/stream.pid"
  sleep 5 # the log fills with B's dirty data
  during=$(a_writes "$seconds" "$a")
  local state
  state=$("$bin" status --cache "$work/cache.img" --json 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
print("%d %d %d" % (d["writeback_stalls"], d["dirty_share_waits"], d["dirty_blocks"]))')
  local b_dirty
  b_dirty=$("$bin" volume list --cache "$work/cache.img" --json 2>/dev/null | python3 -c '
import json, sys
print(next(v["dirty_blocks"] for v in json.load(sys.stdin) if v["name"] == "stream"))')
  echo "$alone $during $state $b_dirty"
}

echo "dirty share: cache ${cache_mib} MiB, B's origin ${rate_mb_s} MB/s, A fsync'd 4 KiB random writes QD1, ${seconds} s each, ${rounds} rounds"
printf '  %-7s %-18s %12s %8s %10s %8s %6s %8s %8s %8s %8s\n' round "B's dirty share" "A alone IOPS" "p99 us" "A during" "p99 us" ratio stalls "share w" dirty "B dirty"
for round in $(seq "$rounds"); do
  for share in default 100; do
    if [ "$share" = default ]; then flags=(); else flags=(--dirty-share-pct "$share"); fi
    read -r ai ap di dp stalls waits dirty b_dirty < <(one "${flags[@]}")
    label=$([ "$share" = default ] && echo "default (50%)" || echo "100% (no limit)")
    printf '  %-7s %-18s %12s %8s %10s %8s %6s %8s %8s %8s %8s\n' "$round" "$label" "$ai" "$ap" "$di" "$dp" \
      "$(python3 -c "print('%.2f' % ($di / max(1, $ai)))")" "$stalls" "$waits" "$dirty" "$b_dirty"
  done
done
