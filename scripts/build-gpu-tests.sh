#!/usr/bin/env bash
# Run HERE (the development machine; the GPU machine has no Rust): builds the ipcreduce binary
# and the GPU test executable (crates/ipcreduce/tests/gpu.rs, cargo feature `gpu`) and puts the
# test executable at a fixed path for scripts/device/gpu-tests.sh:
#   target/gpu-tests/gpu
# Then on the GPU machine: scripts/device/gpu-tests.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p ipcreduce-cli
log=$(cargo test --release -p ipcreduce --features gpu --test gpu --no-run 2>&1) || {
  echo "$log" >&2
  exit 1
}
exe=$(echo "$log" | sed -n 's|.*Executable tests/gpu.rs (\(.*\))|\1|p' | tail -n 1)
if [ -z "$exe" ] || [ ! -x "$exe" ]; then
  echo "$log" >&2
  echo "error: cargo named no GPU test executable" >&2
  exit 1
fi
mkdir -p target/gpu-tests
cp "$exe" target/gpu-tests/gpu
echo "target/gpu-tests/gpu ($("target/gpu-tests/gpu" --list 2>/dev/null | grep -c ': test$') tests)"
