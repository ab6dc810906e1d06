#!/bin/bash
# The soak of issue 15 for as long as asked: the real binary, several
# clients, kill -9 at random moments, origin faults (nbdkit's error
# filter), cache read and write faults (the cache on nbdfuse over nbdkit's
# error filter), online mode switches, and a verifier of every block after
# each restart. CI runs the same test for 40 s.
#
#   bench/soak.sh [--minutes N] [--seed S]
set -euo pipefail
minutes=10
seed=""
while [ $# -gt 0 ]; do
    case "$1" in
        --minutes) minutes="$2"; shift 2 ;;
        --seed) seed="$2"; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "soak.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.."
export CAIRN_SOAK_SECONDS=$((minutes * 60))
if [ -n "$seed" ]; then export CAIRN_SOAK_SEED="$seed"; fi
exec cargo test --release -p cairn --test soak -- --nocapture
