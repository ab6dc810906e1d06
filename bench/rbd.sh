#!/usr/bin/env bash
# cairn in front of Ceph RBD against RBD alone (issue 19), on a throwaway
# single-node cluster (scripts/ceph-dev-cluster.sh: one memstore OSD on
# loopback), interleaved rounds, medians:
#   W1: 4 KiB random writes, fsync after each (fio --fsync=1), QD1, RUNTIME s
#   W6: cold 4 KiB random reads, QD32, one pass over a SPAN_MIB span of a
#       filled image: every block read once, so every cairn read is a miss
#       (cairn freshly formatted each round; fio's random map never repeats
#       a block within the pass)
# RBD alone is fio's rbd engine (librbd linked into fio); cairn is fio's nbd
# engine over a Unix socket to `cairn serve` with an rbd: origin. For W1
# also "raw": fio with io_uring, O_DIRECT and fsync=1 on a file like the
# cache's, the ceiling of any write-back cache on this disk (cairn's W1 is
# one fdatasync of the cache device per fsync), so the W1 ratio can be read
# against what the disk allows. Both use
# librbd's defaults, so its write-back cache is on ("rbd cache = true",
# writethrough until the first flush). Each system has its own image of
# the same size, filled the same way (reads of never-written objects are
# answered without the OSD and would flatter both).
#   bench/rbd.sh [ROUNDS] [RUNTIME_S] [SPAN_MIB]
set -euo pipefail
rounds=${1:-3}
runtime=${2:-10}
span_mib=${3:-512}
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/target/release/cairn"
cluster="$root/scripts/ceph-dev-cluster.sh"
for t in fio ceph-mon ceph-osd rbd; do
  command -v "$t" >/dev/null || { echo "bench/rbd.sh: $t is not installed (apt-get install fio ceph-mon ceph-osd ceph-mgr ceph-common)" >&2; exit 1; }
done
fio --enghelp 2>/dev/null | grep -qw rbd || { echo "bench/rbd.sh: this fio has no rbd engine" >&2; exit 1; }
[ -x "$bin" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
work=$(mktemp -d /var/tmp/cairn-rbd-bench.XXXXXX)
cleanup() {
  [ -f "$work/cairn.pid" ] && kill "$(cat "$work/cairn.pid")" 2>/dev/null || true
  sleep 1
  bash "$cluster" stop "$work/ceph" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
# memstore holds both images in the OSD's memory, with room to spare.
export CEPH_DEV_MEMSTORE_BYTES=$(( (span_mib * 2 + 1024) << 20 ))
conf=$(bash "$cluster" start "$work/ceph" | tail -1)
export CEPH_CONF="$conf"
for img in direct cached; do
  rbd create --size "${span_mib}M" "rbd/$img"
  fio --name=fill --ioengine=rbd --clientname=admin --pool=rbd --rbdname="$img" \
    --rw=write --bs=4M --iodepth=4 --size="${span_mib}M" >/dev/null
done
spec="rbd:rbd/cached?conf=$conf"
# Fully written, as a cache device is: first writes into a sparse file make
# every fdatasync commit file-system metadata, which halves W1 and is not
# what a block device does.
dd if=/dev/zero of="$work/cache.img" bs=4M count=$(( (span_mib + 256) / 4 )) oflag=direct status=none
dd if=/dev/zero of="$work/raw.img" bs=4M count=$(( span_mib / 4 )) oflag=direct status=none

start_cairn() {
  "$bin" format --force --cache "$work/cache.img" --origin "$spec" >/dev/null
  CAIRN_RUNTIME_DIR="$work" "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" \
    2>"$work/serve.log" &
  echo $! >"$work/cairn.pid"
  for _ in $(seq 600); do
    [ -S "$work/s.sock" ] && nbdinfo --size "nbd+unix:///?socket=$work/s.sock" >/dev/null 2>&1 && return
    sleep 0.1
  done
  echo "cairn serve did not start:" >&2; cat "$work/serve.log" >&2; exit 1
}
stop_cairn() {
  local pid; pid=$(cat "$work/cairn.pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$work/cairn.pid" "$work/s.sock"
}
# fio target options per system.
target() {
  case $1 in
    rbd) echo "--ioengine=rbd --clientname=admin --pool=rbd --rbdname=direct" ;;
    raw) echo "--ioengine=io_uring --direct=1 --filename=$work/raw.img" ;;
    cairn) echo "--ioengine=nbd --uri=nbd+unix:///?socket=$work/s.sock" ;;
  esac
}
iops() { # $1 = fio json, $2 = read|write
  python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["jobs"][0][sys.argv[2]]["iops"]))' "$1" "$2"
}
measure() { # $1 = system, $2 = workload; prints "workload system iops"
  local sys=$1 w=$2 out="$work/$1-$2.json"
  [ "$sys" = cairn ] && start_cairn
  # shellcheck disable=SC2046
  case $w in
    w1) fio --output-format=json --output="$out" --name=w1 $(target "$sys") --rw=randwrite \
          --bs=4k --iodepth=1 --fsync=1 --size="${span_mib}M" --time_based --runtime="$runtime" >/dev/null ;;
    w6) fio --output-format=json --output="$out" --name=w6 $(target "$sys") --rw=randread \
          --bs=4k --iodepth=32 --size="${span_mib}M" >/dev/null ;;
  esac
  [ "$sys" = cairn ] && stop_cairn
  echo "$w $sys $(iops "$out" "$([ "$w" = w1 ] && echo write || echo read)")"
}
for r in $(seq "$rounds"); do
  # Rotate the order each round so neither system always goes first.
  if [ $((r % 2)) -eq 1 ]; then order="rbd cairn raw"; else order="raw cairn rbd"; fi
  for w in w1 w6; do
    for sys in $order; do
      [ "$sys" = raw ] && [ "$w" != w1 ] && continue
      measure "$sys" "$w"
    done
  done
done | tee "$work/results.txt"
python3 - "$work/results.txt" "$rounds" "$runtime" "$span_mib" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    w, s, v = line.split()
    rows.setdefault((w, s), []).append(int(v))
print()
print(f"rounds {sys.argv[2]}, W1 {sys.argv[3]} s per measurement, span {sys.argv[4]} MiB, librbd cache on (default)")
print()
print("| workload | cairn in front of RBD | RBD alone (fio rbd engine) | ratio | goal |")
print("|---|---:|---:|---:|---|")
goals = {"w1": 3.0, "w6": 0.8}
ratios = {w: [] for w in goals}
for w in goals:
    for c, r in zip(rows[(w, "cairn")], rows[(w, "rbd")]):
        ratios[w].append(c / r)
names = {"w1": "W1 4 KiB random writes + fsync, QD1 (IOPS)", "w6": "W6 cold 4 KiB random reads, QD32 (IOPS)"}
for w in ("w1", "w6"):
    c = statistics.median(rows[(w, "cairn")])
    r = statistics.median(rows[(w, "rbd")])
    ratio = c / r if r else float("nan")
    met = "met" if ratio >= goals[w] else "NOT met"
    print(f"| {names[w]} | {c:,.0f} | {r:,.0f} | {ratio:.2f}x | >= {goals[w]}x: {met} |")
print()
for w in goals:
    print(f"{w} ratio per round (cairn / RBD): " + ", ".join(f"{x:.2f}" for x in ratios[w]))
raw = statistics.median(rows[("w1", "raw")])
c = statistics.median(rows[("w1", "cairn")])
r = statistics.median(rows[("w1", "rbd")])
print(f"w1 raw disk fsync'd 4 KiB writes: {raw:,.0f} IOPS; cairn / raw {c/raw:.2f}x; "
      f"the most any cache on this disk could reach against RBD here: {raw/r:.2f}x")
PY
