#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over a small cuda check at world 2 on one
# GPU. Each rank runs under its own sanitizer. Without MPS the ranks time-slice the GPU, so the
# sweep is kept small. Builds nothing: expects target/release/ipcreduce.
# Knobs: CASES (per tool), TOOLS (default "memcheck racecheck synccheck"), BUFFERS ("plain",
# "registered" or both, the default: registered runs the zero-copy kernels).
# Usage: scripts/device/sanitize.sh OUT_DIR
set -u
OUT=${1:?usage: sanitize.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
CASES=${CASES:-12}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
status=0
for buffers in ${BUFFERS:-plain registered}; do
  flag=
  [ "$buffers" = registered ] && flag=--registered
  for tool in ${TOOLS:-memcheck racecheck synccheck}; do
    echo "== $tool, $buffers buffers"
    timeout 120 "$BIN" launch -n 2 -- "$SAN" --tool "$tool" --error-exitcode 99 \
      "$BIN" check --backend cuda --cases "$CASES" --max-bytes 256K --seed 7 $flag \
      >>"$OUT/sanitizer-$buffers.log" 2>&1 || { echo "$tool ($buffers): FAILED (exit $?)"; status=1; }
    grep -E "ERROR SUMMARY|passed, .* failed" "$OUT/sanitizer-$buffers.log" | tail -n 3
  done
done
exit $status
