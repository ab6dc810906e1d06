#!/usr/bin/env bash
# Writes of part of a block over a slow origin, against the origin alone:
# 512-byte random writes at QD1 and QD16 (fio's nbd engine, one
# connection) into a cold cache (write-back, formatted afresh for each
# measurement), the origin an nbdkit file export delayed 5 ms per read and
# write (64 threads). Each such write must read the rest of its 4 KiB block
# from the origin first; this shows whether those reads overlap (one origin
# latency per write at any depth) or queue behind one another. Each BIN
# (default: this tree's release binary) and the origin alone are measured
# once per round, interleaved; medians and per-round figures are printed.
#   bench/partial_writes.sh [ROUNDS] [RUNTIME_S] [BIN...]
set -euo pipefail
rounds=${1:-3}
runtime=${2:-10}
shift $(( $# >= 2 ? 2 : $# ))
root=$(cd "$(dirname "$0")/.." && pwd)
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  [ -x "$root/target/release/cairn" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
  bins=("$root/target/release/cairn")
fi
for t in fio nbdkit; do
  command -v "$t" >/dev/null || { echo "bench/partial_writes.sh: $t is not installed" >&2; exit 1; }
done
work=$(mktemp -d /var/tmp/cairn-pw-bench.XXXXXX)
cleanup() {
  [ -f "$work/serve.pid" ] && kill "$(cat "$work/serve.pid")" 2>/dev/null || true
  [ -f "$work/origin.pid" ] && kill "$(cat "$work/origin.pid")" 2>/dev/null || true
  sleep 0.5
  rm -rf "$work"
}
trap cleanup EXIT
truncate -s 1G "$work/origin.img"
# Written once, so the origin's reads and writes touch real blocks.
dd if=/dev/urandom of="$work/origin.img" bs=4M count=256 conv=notrunc status=none
fallocate -l 512M "$work/cache.img"
nbdkit --exit-with-parent -f -t 64 -U "$work/origin.sock" -P "$work/origin.pid" \
  --filter=delay file "$work/origin.img" rdelay=5ms wdelay=5ms &
for _ in $(seq 100); do [ -S "$work/origin.sock" ] && break; sleep 0.1; done
origin_uri="nbd+unix:///?socket=$work/origin.sock"

iops() { # uri qd -> "IOPS p50_us"
  fio --name=pw --ioengine=nbd --uri="$1" --rw=randwrite --bs=512 --iodepth="$2" \
    --size=1G --time_based --runtime="$runtime" --randrepeat=0 \
    --output-format=json --output="$work/fio.json" >/dev/null
  python3 -c "import json; w = json.load(open('$work/fio.json'))['jobs'][0]['write']; print('%.0f' % w['iops'], '%.0f' % (w['clat_ns']['percentile']['50.000000'] / 1000))"
}

cairn_iops() { # bin qd -> "IOPS p50_us"
  local bin=$1 qd=$2
  "$bin" format --force --cache "$work/cache.img" --origin "$origin_uri" >/dev/null 2>&1
  "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" 2>"$work/serve.log" &
  echo $! >"$work/serve.pid"
  for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
  iops "nbd+unix:///?socket=$work/s.sock" "$qd"
  kill "$(cat "$work/serve.pid")"
  wait "$(cat "$work/serve.pid")" 2>/dev/null || true
  rm -f "$work/serve.pid" "$work/s.sock"
}

declare -A results latency
for round in $(seq "$rounds"); do
  for qd in 1 16; do
    read -r r l < <(iops "$origin_uri" "$qd")
    results["origin,$qd"]+="$r "; latency["origin,$qd"]+="$l "
    echo "round $round qd$qd origin $r IOPS, p50 $l us"
    for i in "${!bins[@]}"; do
      read -r r l < <(cairn_iops "${bins[$i]}" "$qd")
      results["$i,$qd"]+="$r "; latency["$i,$qd"]+="$l "
      echo "round $round qd$qd bin$i $r IOPS, p50 $l us"
    done
  done
done

median() { printf '%s\n' $1 | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo
echo "rounds $rounds, ${runtime} s each; origin: nbdkit -t 64 delay 5 ms; fio 512 B randwrite, one connection"
echo
echo "| system | QD | IOPS (median) | per round | p50 latency, us (median) | ratio to the origin alone |"
echo "|---|---:|---:|---|---:|---:|"
for qd in 1 16; do
  o=$(median "${results["origin,$qd"]}")
  echo "| origin alone | $qd | $o | ${results["origin,$qd"]}| $(median "${latency["origin,$qd"]}") | 1.00x |"
  for i in "${!bins[@]}"; do
    m=$(median "${results["$i,$qd"]}")
    ratio=$(python3 -c "print('%.2fx' % ($m / $o))")
    echo "| ${bins[$i]} | $qd | $m | ${results["$i,$qd"]}| $(median "${latency["$i,$qd"]}") | $ratio |"
  done
done
