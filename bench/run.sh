#!/bin/sh
# Build cairn and the harness, then run the benchmarks of issues 8 and 14.
#   bench/run.sh            full run (3 rounds, ~30 min)
#   bench/run.sh --quick    smoke run (~4 min)
# Needs root (loop devices, mount) and fio, nbdkit, qemu-nbd, nbdfuse.
set -e
cd "$(dirname "$0")/.."
cargo build --release -p cairn -p cairn-bench
exec target/release/cairn-bench "$@"
