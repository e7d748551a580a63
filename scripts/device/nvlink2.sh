#!/usr/bin/env bash
# One call on nvidia-h200-x2 (two GPUs over NVLink): correctness at world 2, the benchmark for
# bf16, f16 and f32 from 8 B to 1 GiB with every algorithm, auto and NCCL on the same buffers,
# eager and CUDA graph; the training-loop benchmark; compute-sanitizer. Builds nothing: expects
# target/release/ipcreduce. Usage: scripts/device/nvlink2.sh OUT_DIR
# Knobs: CASES=2000 BENCH_MAX=1G STEPS=1000 WORLD=2 (4 or 8 on nvidia-h200-x4 / -x8).
set -u
OUT=${1:?usage: nvlink2.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
CASES=${CASES:-2000}
BENCH_MAX=${BENCH_MAX:-1G}
STEPS=${STEPS:-1000}
WORLD=${WORLD:-2}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  "$BIN" --version
} >"$OUT/check.log" 2>&1
head -n 8 "$OUT/check.log"

status=0
echo "== check world $WORLD ($CASES cases)"
timeout 400 "$BIN" check --backend cuda --ranks "$WORLD" --cases "$CASES" --seed 2 >>"$OUT/check.log" 2>&1 || status=1
tail -n 1 "$OUT/check.log"

for dt in bfloat16 half float; do
  echo "== bench $dt"
  timeout 500 "$BIN" bench --backend cuda --ranks "$WORLD" -a all -d $dt -b 8 -e "$BENCH_MAX" -f 4 \
    -n 20 -w 5 -G 10 --json "$OUT/bench-$dt.json" >>"$OUT/bench.log" 2>&1 || status=1
done
grep -E "bfloat16" "$OUT/bench.log" | head -n 120

if "$BIN" overlap --help >/dev/null 2>&1; then
  echo "== training loop ($STEPS steps)"
  timeout 500 "$BIN" overlap --backend cuda --ranks "$WORLD" --steps "$STEPS" --json "$OUT/overlap.json" \
    >"$OUT/overlap.log" 2>&1 || status=1
  tail -n 8 "$OUT/overlap.log"
fi

echo "== compute-sanitizer (memcheck, racecheck, synccheck)"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck synccheck; do
  timeout 200 "$BIN" launch -n "$WORLD" -- "$SAN" --tool "$tool" --error-exitcode 99 \
    "$BIN" check --backend cuda --cases 12 --max-bytes 1M --seed 7 >>"$OUT/sanitizer.log" 2>&1 \
    || { echo "$tool: FAILED"; status=1; }
done
grep -E "ERROR SUMMARY|passed, .* failed" "$OUT/sanitizer.log"
exit $status
