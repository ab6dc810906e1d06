#!/usr/bin/env bash
# Hit ratio of cairn on a Zipf-distributed random read workload against the
# ideal LRU hit ratio for the same cache size on the same access trace.
#   bench/zipf_hit_ratio.sh [CACHE_MIB] [VOLUME_MIB] [IOS]
# Prints both ratios and the policy memory. Needs fio and python3.
set -euo pipefail
cache_mib=${1:-64}
volume_mib=${2:-1024}
ios=${3:-200000}
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/target/release/cairn"
[ -x "$bin" ] || cargo build --release -p cairn --manifest-path "$root/Cargo.toml"
work=$(mktemp -d /var/tmp/cairn-zipf.XXXXXX)
trap 'kill $(cat "$work/pid" 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
truncate -s "${cache_mib}M" "$work/cache.img"
truncate -s "${volume_mib}M" "$work/origin.img"
"$bin" format --cache "$work/cache.img" --origin "$work/origin.img" >/dev/null
CAIRN_RUNTIME_DIR="$work" "$bin" serve --cache "$work/cache.img" --socket "$work/s.sock" 2>"$work/serve.log" &
echo $! >"$work/pid"
for _ in $(seq 100); do [ -S "$work/s.sock" ] && break; sleep 0.1; done
fio --name=zipf --ioengine=nbd --uri="nbd+unix:///?socket=$work/s.sock" --rw=randread --bs=4k \
  --size="${volume_mib}M" --random_distribution=zipf:1.1 --number_ios="$ios" --iodepth=1 \
  --write_iolog="$work/trace.log" --randrepeat=1 >/dev/null
status=$(CAIRN_RUNTIME_DIR="$work" "$bin" status --cache "$work/cache.img" --json)
python3 - "$work/trace.log" "$status" <<'PY'
import json, sys
from collections import OrderedDict
trace, status = sys.argv[1], json.loads(sys.argv[2])
cap = status["cache_blocks"]
lru, hits, total = OrderedDict(), 0, 0
for line in open(trace):
    parts = line.split()
    # iolog v3: "<time> <file> read <offset> <length>"
    if len(parts) != 5 or parts[2] != "read":
        continue
    b = int(parts[3]) // 4096
    total += 1
    if b in lru:
        hits += 1
        lru.move_to_end(b)
    else:
        lru[b] = True
        if len(lru) > cap:
            lru.popitem(last=False)
h, m = status["read_hits"], status["read_misses"]
print(f"accesses {total}, cache {cap} blocks of 4 KiB")
print(f"cairn hit ratio (block lookups): {h / max(1, h + m):.4f}  ({h} hits, {m} misses)")
print(f"ideal LRU hit ratio, same trace and capacity: {hits / max(1, total):.4f}")
print(f"policy memory: {status.get('policy_memory_bytes', 'n/a')} bytes; index {status['index_memory_bytes']} bytes")
PY
