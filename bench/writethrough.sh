#!/usr/bin/env bash
# Write-through and write-around over a slow origin, against the origin
# alone: 4 KiB random writes at QD1 and QD32 (fio's nbd engine, one
# connection), the origin an nbdkit file export delayed 5 ms per read and
# write (64 threads, so the origin alone takes 32 writes at once). cairn is
# formatted afresh for each measurement. Each BIN (default: this tree's
# release binary) and the origin alone are measured once per round,
# interleaved; medians and per-round figures are printed.
#   bench/writethrough.sh [ROUNDS] [RUNTIME_S] [BIN...]
set -euo pipefail
rounds=${1:-3}
runtime=${2:-5}
shift $(( $# >= 2 ? 2 : $# ))
root=$(cd "$(dirname "$0")/.." && pwd)
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  [ -x "$root/target/release/cairn" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
  bins=("$root/target/release/cairn")
fi
for t in fio nbdkit; do
  command -v "$t" >/dev/null || { echo "bench/writethrough.sh: $t is not installed" >&2; exit 1; }
done
work=$(mktemp -d /var/tmp/cairn-wt-bench.XXXXXX)
cleanup() {
  [ -f "$work/serve.pid" ] && kill "$(cat "$work/serve.pid")" 2>/dev/null || true
  [ -f "$work/origin.pid" ] && kill "$(cat "$work/origin.pid")" 2>/dev/null || true
  sleep 0.5
  rm -rf "$work"
}
trap cleanup EXIT
truncate -s 1G "$work/origin.img"
# Written once, so the origin's writes never allocate.
dd if=/dev/zero of="$work/origin.img" bs=4M count=256 conv=notrunc status=none
fallocate -l 512M "$work/cache.img"
nbdkit --exit-with-parent -f -t 64 -U "$work/origin.sock" -P "$work/origin.pid" \
  --filter=delay file "$work/origin.img" rdelay=5ms wdelay=5ms &
for _ in $(seq 100); do [ -S "$work/origin.sock" ] && break; sleep 0.1; done
origin_uri="nbd+unix:///?socket=$work/origin.sock"

iops() { # uri qd -> IOPS
  fio --name=wt --ioengine=nbd --uri="$1" --rw=randwrite --bs=4k --iodepth="$2" \
    --size=256M --time_based --runtime="$runtime" --randrepeat=0 \
    --output-format=json --output="$work/fio.json" >/dev/null
  python3 -c "import json; print('%.0f' % json.load(open('$work/fio.json'))['jobs'][0]['write']['iops'])"
}

cairn_iops() { # bin mode qd -> IOPS
  local bin=$1 mode=$2 qd=$3
  "$bin" format --force --cache "$work/cache.img" --origin "$origin_uri" >/dev/null
  "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" --mode "$mode" \
    2>"$work/serve.log" &
  echo $! >"$work/serve.pid"
  for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
  iops "nbd+unix:///?socket=$work/s.sock" "$qd"
  kill "$(cat "$work/serve.pid")"
  wait "$(cat "$work/serve.pid")" 2>/dev/null || true
  rm -f "$work/serve.pid" "$work/s.sock"
}

declare -A results
for round in $(seq "$rounds"); do
  for qd in 1 32; do
    r=$(iops "$origin_uri" "$qd")
    results["origin,$qd"]+="$r "
    echo "round $round qd$qd origin $r"
    for i in "${!bins[@]}"; do
      for mode in writethrough writearound; do
        r=$(cairn_iops "${bins[$i]}" "$mode" "$qd")
        results["$i,$mode,$qd"]+="$r "
        echo "round $round qd$qd bin$i $mode $r"
      done
    done
  done
done

median() { printf '%s\n' $1 | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo
echo "rounds $rounds, ${runtime} s each; origin: nbdkit -t 64 delay 5 ms; fio 4 KiB randwrite, one connection"
echo
echo "| system | QD | IOPS (median) | per round | ratio to the origin alone |"
echo "|---|---:|---:|---|---:|"
for qd in 1 32; do
  o=$(median "${results["origin,$qd"]}")
  echo "| origin alone | $qd | $o | ${results["origin,$qd"]}| 1.00x |"
  for i in "${!bins[@]}"; do
    for mode in writethrough writearound; do
      m=$(median "${results["$i,$mode,$qd"]}")
      ratio=$(python3 -c "print('%.2fx' % ($m / $o))")
      echo "| ${bins[$i]} $mode | $qd | $m | ${results["$i,$mode,$qd"]}| $ratio |"
    done
  done
done
