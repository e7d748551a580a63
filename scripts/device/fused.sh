#!/usr/bin/env bash
# The fused all-reduce + residual add + RMSNorm on one GPU (ranks under MPS): its GPU tests
# (crates/ipcreduce/tests/gpu_fused.rs: fused == all-reduce + reference kernel bit for bit and
# == the CPU reference, worlds 2/4/8, plain and registered, in place, FP8, graph replays, shape
# mismatches) through gpu-tests.sh.
# Builds nothing: run scripts/build-gpu-tests.sh here first (it leaves target/gpu-tests/gpu and
# target/gpu-tests/gpu_fused, and target/release/ipcreduce for the kernel-cache warmup).
# Usage: scripts/device/fused.sh OUT_DIR
# summary.txt: one line per step; gpu-tests/: the per-test logs and gpu-tests.json.
# Knobs: BUDGET=540, GPU_FUSED_CASES (random shapes per world, default 40).
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: fused.sh OUT_DIR}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
status=0
export GPU_FUSED_CASES=${GPU_FUSED_CASES:-40}
step gputests "$(budget_left)" env GPU_TESTS_BINS=target/gpu-tests/gpu_fused \
  "$(dirname "$0")/gpu-tests.sh" "$OUT/gpu-tests"
cat "$OUT/gpu-tests.log" 2>/dev/null | grep -E "^(ok|FAILED|skip|ignore) |passed,|panicked|BAD" | head -n 40
echo "== summary"
cat "$SUMMARY"
exit $status
