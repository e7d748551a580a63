#!/usr/bin/env bash
# One call on a one-GPU machine: correctness at world 2, 4 and 8 under MPS, then the benchmark
# at world 2 (eager and CUDA graph). Builds nothing: expects target/release/ipcreduce.
# Usage: scripts/device/mps-check.sh OUT_DIR [CASES]
# Knobs: WORLDS="2 4 8" (empty: no checks), SKIP_BENCH=1, BENCH_MAX=256M.
set -u
OUT=${1:?usage: mps-check.sh OUT_DIR [CASES]}
CASES=${2:-2000}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
BENCH_MAX=${BENCH_MAX:-256M}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$BIN" --version
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# MPS, checked: the daemon must answer (lib/steps.sh).
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
MPS_ENV="$OUT/env.txt" mps_on || exit 1

status=0
for w in ${WORLDS-2 4 8}; do
  echo "== check world $w ($CASES cases)"
  timeout 400 "$BIN" check --backend cuda --ranks $w --cases "$CASES" --seed $w \
    >"$OUT/check-w$w.log" 2>&1 || status=1
  grep -v WARN "$OUT/check-w$w.log" | grep -E "passed|FAIL|error" | tail -n 5
done

[ -n "${SKIP_BENCH:-}" ] && exit $status
echo "== bench world 2 (eager and graph)"
timeout 900 "$BIN" bench --backend cuda --ranks 2 -a all -d all -b 8 -e "$BENCH_MAX" -f 4 -n 20 -w 5 -G 10 \
  --json "$OUT/bench-w2.json" >"$OUT/bench-w2.log" 2>&1 || status=1
grep -E "bfloat16" "$OUT/bench-w2.log" | head -60
tail -n 2 "$OUT/bench-w2.log"
exit $status
