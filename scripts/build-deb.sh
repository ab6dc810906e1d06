#!/usr/bin/env bash
# Build target/debian/cairn_*.deb: the release binary, the manual pages and
# shell completions it generates, the systemd units and the docs.
# Needs cargo-deb (`cargo install cargo-deb --locked`). With --no-build the
# release binary must exist already (the test suite uses it so).
set -euo pipefail
cd "$(dirname "$0")/.."
build=1
if [[ "${1:-}" == "--no-build" ]]; then
  build=0
  shift
fi
if (( build )); then
  cargo build --release -p cairn
fi
bin=target/release/cairn
assets=target/deb-assets
rm -rf "$assets"
mkdir -p "$assets/completions"
"$bin" manpages "$assets/man" >/dev/null
"$bin" completions bash > "$assets/completions/cairn.bash"
"$bin" completions zsh > "$assets/completions/_cairn"
"$bin" completions fish > "$assets/completions/cairn.fish"
cargo deb -p cairn --no-build --strip "$@"
