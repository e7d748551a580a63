#!/usr/bin/env bash
# One call on a one-GPU machine under MPS: exercises the NCCL column (ranks sharing the GPU,
# NCCL over loopback sockets: a functional check, not a performance reference) and the
# training-loop benchmark at world 2. Builds nothing: expects target/release/ipcreduce.
# Usage: scripts/device/mps-nccl-overlap.sh OUT_DIR   Knobs: STEPS=200 GRAD=256M
set -u
OUT=${1:?usage: mps-nccl-overlap.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
STEPS=${STEPS:-200}
GRAD=${GRAD:-256M}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 IPCREDUCE_NCCL_SHARED_GPU=1
# MPS, checked: the daemon must answer (lib/steps.sh).
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
mps_on || exit 1
status=0
echo "== bench with NCCL beside (world 2, eager)"
timeout 300 "$BIN" bench --backend cuda --ranks 2 -a all -d bfloat16 -b 8 -e 8M -f 8 -n 10 -w 3 \
  --json "$OUT/bench-nccl.json" >"$OUT/bench-nccl.log" 2>&1 || status=1
grep -E "nccl|rows" "$OUT/bench-nccl.log" | head -20
echo "== training loop (world 2, $STEPS steps, $GRAD of gradients)"
timeout 300 "$BIN" overlap --backend cuda --ranks 2 --steps "$STEPS" --grad-bytes "$GRAD" \
  --json "$OUT/overlap.json" >"$OUT/overlap.log" 2>&1 || status=1
tail -n 12 "$OUT/overlap.log"
exit $status
