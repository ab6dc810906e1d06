#!/bin/sh
# Build cairn and the harness, then run the benchmarks of issue 8.
#   bench/run.sh            full run (3 rounds, ~20 min)
#   bench/run.sh --quick    smoke run (~2-3 min)
# Needs root (loop devices, mount) and fio, nbdkit, qemu-nbd, nbdfuse.
set -e
cd "$(dirname "$0")/.."
cargo build --release -p cairn -p cairn-bench
exec target/release/cairn-bench "$@"
