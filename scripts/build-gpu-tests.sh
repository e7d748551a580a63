#!/usr/bin/env bash
# Run HERE (the development machine; the GPU machine has no Rust): builds the ipcreduce binary
# and the GPU test executables (crates/ipcreduce/tests/gpu.rs, cargo feature
# `gpu`; more test files join the list below) and puts them at fixed paths for scripts/device/gpu-tests.sh:
#   target/gpu-tests/gpu
# and the commit they were built from, with a dirty flag, in target/gpu-tests/gpu.commit
# (`<sha>` or `<sha>-dirty`: uncommitted changes to tracked files).
# Then on the GPU machine: scripts/device/gpu-tests.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p ipcreduce-cli
mkdir -p target/gpu-tests
for t in gpu gpu_fused gpu_trace; do
  log=$(cargo test --release -p ipcreduce --features gpu --test "$t" --no-run 2>&1) || {
    echo "$log" >&2
    exit 1
  }
  exe=$(echo "$log" | sed -n "s|.*Executable tests/$t.rs (\(.*\))|\1|p" | tail -n 1)
  if [ -z "$exe" ] || [ ! -x "$exe" ]; then
    echo "$log" >&2
    echo "error: cargo named no executable for tests/$t.rs" >&2
    exit 1
  fi
  cp "$exe" "target/gpu-tests/$t"
  echo "target/gpu-tests/$t ($("target/gpu-tests/$t" --list 2>/dev/null | grep -c ': test$') tests)"
done
commit=$(git rev-parse HEAD)
git diff --quiet HEAD -- || commit="$commit-dirty"
echo "$commit" >target/gpu-tests/gpu.commit
echo "target/gpu-tests/gpu.commit: $commit"
