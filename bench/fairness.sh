#!/usr/bin/env bash
# Does one volume's stream evict another volume's hot set? (issue 16)
#   bench/fairness.sh [CACHE_MIB] [HOT_MIB] [STREAM_MIB]
# Volume "" (A) has a hot random working set of HOT_MIB, read at QD4;
# volume "stream" (B) takes STREAM_MIB of sequential 1 MiB writes (more than
# the cache) while A is read. Prints A's hit ratio alone and during B's
# stream, and the cache's blocks per volume at the end. Hit ratios, not
# times: the figures do not depend on the machine's load. Needs fio.
set -euo pipefail
cache_mib=${1:-256}
hot_mib=${2:-64}
stream_mib=${3:-1024}
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/target/release/cairn"
[ -x "$bin" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
work=$(mktemp -d /var/tmp/cairn-fair.XXXXXX)
trap 'kill $(cat "$work/pid" 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
truncate -s "${cache_mib}M" "$work/cache.img"
truncate -s 1G "$work/a.img"
truncate -s "$((stream_mib + 64))M" "$work/b.img"
export CAIRN_RUNTIME_DIR="$work"
"$bin" format --cache "$work/cache.img" --origin "$work/a.img" >/dev/null 2>&1
"$bin" volume add --cache "$work/cache.img" --name stream --origin "$work/b.img" >/dev/null 2>&1
"$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" 2>"$work/serve.log" &
echo $! >"$work/pid"
for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
a="nbd+unix:///?socket=$work/s.sock"
b="nbd+unix:///stream?socket=$work/s.sock"
counts() {
  "$bin" status --cache "$work/cache.img" --json 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["read_hits"], d["read_misses"])'
}
ratio() { # seconds hits0 misses0 hits1 misses1
  python3 -c "h=$4-$2; m=$5-$3; print('%.3f (%d hits, %d misses; %.0f reads/s)' % (h/max(1,h+m), h, m, (h+m)/$1))"
}
now() { date +%s.%N; }
read_hot() { # seconds
  fio --name=hot --ioengine=nbd --uri="$a" --rw=randread --bs=4k --iodepth=4 \
    --size="${hot_mib}M" --time_based --runtime="$1" --randrepeat=0 >/dev/null
}
# Warm A's hot set (every block read once), then measure it alone.
fio --name=warm --ioengine=nbd --uri="$a" --rw=read --bs=1M --size="${hot_mib}M" >/dev/null
read_hot 5
set -- $(counts)
read_hot 10
set -- "$@" $(counts)
alone=$(ratio 10 "$@")
# B streams more than the cache holds while A keeps reading its hot set.
set -- $(counts)
start=$(now)
fio --name=stream --ioengine=nbd --uri="$b" --rw=write --bs=1M --iodepth=4 \
  --size="${stream_mib}M" --output-format=json --output="$work/stream.json" &
stream=$!
while kill -0 "$stream" 2>/dev/null; do read_hot 3; done
wait "$stream"
streamed=$(now)
set -- "$@" $(counts)
seconds=$(python3 -c "print($streamed - $start)")
during=$(ratio "$seconds" "$@")
stream_mb_s=$(python3 -c "import json; print('%.0f' % (json.load(open('$work/stream.json'))['jobs'][0]['write']['bw_bytes'] / 1e6))")
echo "fairness: cache ${cache_mib} MiB, hot set ${hot_mib} MiB on volume A, ${stream_mib} MiB streamed to volume B"
echo "  A's hit ratio alone:            $alone"
echo "  A's hit ratio during B's stream: $during"
echo "  B's stream: ${stream_mb_s} MB/s (fio's figure) while A was read"
"$bin" status --cache "$work/cache.img" --json 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
print("  cache: %d evictions, %d second chances, %d share moves" % (
    d["evictions"], d["second_chances"], d.get("share_moves", -1)))'
"$bin" volume list --cache "$work/cache.img" 2>/dev/null | sed 's/^/  /'
