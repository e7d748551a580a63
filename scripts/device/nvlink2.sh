#!/usr/bin/env bash
# One call on nvidia-h200-x2 (two GPUs over NVLink) that makes everything BENCHMARKS.md needs
# for the bandwidth work: check at world 2; tune (its table is what `auto` uses afterwards);
# bench from 8 B to 1 GiB for bf16, f16 and f32, eager and CUDA graph, plain and registered
# buffers, NCCL beside, every call checked; the training loop in two compute configurations
# with NCCL; the plots and the goals table (ipcreduce plot / report, from this run's JSON);
# compute-sanitizer if time is left.
# Builds nothing: expects target/release/ipcreduce.
#
# Usage: scripts/device/nvlink2.sh OUT_DIR
# On a machine with fewer GPUs than WORLD (one H200) it is a dry run: the ranks share the GPU
# under MPS, NCCL runs over loopback sockets (functional only) and sizes and steps shrink.
# Knobs: WORLD=2 CASES=2000 BENCH_MAX=1G STEPS=300 GRAD=1G SKIP_TUNE=1 BUDGET=480 (seconds before the
# optional phases are skipped; the device call's limit is 600).
set -u
# budget_allows, budget_left, mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: nvlink2.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
WORLD=${WORLD:-2}
BUDGET=${BUDGET:-480}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${GPUS:-0}" -lt "$WORLD" ]; then
  DRY=1
  echo "== dry run: $GPUS GPU(s) for world $WORLD: ranks share a GPU under MPS, NCCL over sockets"
  export IPCREDUCE_NCCL_SHARED_GPU=1
  mps_on || exit 1
else
  DRY=0
fi
if [ $DRY = 1 ]; then
  CASES=${CASES:-500} BENCH_MAX=${BENCH_MAX:-64M} STEPS=${STEPS:-50} GRAD=${GRAD:-256M}
else
  CASES=${CASES:-2000} BENCH_MAX=${BENCH_MAX:-1G} STEPS=${STEPS:-300} GRAD=${GRAD:-1G}
fi

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  "$BIN" --version
  echo "WORLD=$WORLD DRY=$DRY CASES=$CASES BENCH_MAX=$BENCH_MAX STEPS=$STEPS GRAD=$GRAD"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
# Phases stop at their own timeouts; `budget_allows N` says whether an optional phase still
# fits (more than N seconds left).
# A phase's timeout: at most $1 seconds and never past the budget (+60 s for the rest, at
# least 10 s).
cap() { local r=$(($(budget_left) + 60)); [ "$r" -lt "$1" ] && echo $((r > 10 ? r : 10)) || echo "$1"; }
phase() { echo "== [$SECONDS s] $*"; }

phase "check world $WORLD ($CASES cases)"
timeout 120 "$BIN" check --backend cuda --ranks "$WORLD" --cases "$CASES" --seed 2 \
  >"$OUT/check.log" 2>&1 || status=1
tail -n 1 "$OUT/check.log"

# Tune first: the table it writes is what `auto` consults in every run after it.
export IPCREDUCE_TUNE_FILE="$OUT/tune.txt"
if [ -z "${SKIP_TUNE:-}" ]; then
  phase "tune (-> $IPCREDUCE_TUNE_FILE)"
  timeout "$(cap 180)" "$BIN" tune --backend cuda --ranks "$WORLD" -e "$BENCH_MAX" --json "$OUT/tune-samples.json" \
    >"$OUT/tune.log" 2>&1 || { echo "tune: FAILED (auto keeps its built-in rules)"; status=1; }
  grep -A40 "^# world elem" "$OUT/tune.log"
else
  phase "tune skipped (SKIP_TUNE): auto follows the built-in rules"
fi

# Iterations budgeted by size: small messages are cheap, 1 GiB calls take milliseconds and
# their output is read back and checked on the host.
bench_range() { # NAME MIN MAX ITERS WARMUP GRAPH_CALLS ALGOS
  local name=$1 lo=$2 hi=$3 n=$4 w=$5 g=$6 algos=$7 dt
  for dt in bfloat16 half float; do
    budget_allows 30 || { echo "bench $dt $name: skipped, out of time"; status=1; continue; }
    timeout "$(cap 200)" "$BIN" bench --backend cuda --ranks "$WORLD" -a "$algos" -d $dt -b "$lo" -e "$hi" \
      -f 2 -n "$n" -w "$w" -G "$g" --registered --json "$OUT/bench-$dt-$name.json" \
      >>"$OUT/bench-$dt.log" 2>&1 || { echo "bench $dt $name: FAILED"; status=1; }
  done
}
size_bytes() { numfmt --from=iec "$1"; }
MAX=$(size_bytes "$BENCH_MAX")
phase "bench 8 B - min(1 MiB, $BENCH_MAX) (100 timed calls)"
bench_range small 8 "$([ "$MAX" -lt $((1 << 20)) ] && echo "$BENCH_MAX" || echo 1M)" 100 20 10 all
if [ "$MAX" -ge $((2 << 20)) ]; then
  phase "bench 2 MiB - 32 MiB (40 timed calls)"
  bench_range mid 2M "$([ "$MAX" -lt $((32 << 20)) ] && echo "$BENCH_MAX" || echo 32M)" 40 10 10 all
fi
if [ "$MAX" -ge $((64 << 20)) ]; then
  phase "bench 64 MiB - $BENCH_MAX (10 timed calls)"
  bench_range large 64M "$BENCH_MAX" 10 3 5 all
fi
grep -h -E "bfloat16 .*(auto|nccl)" "$OUT"/bench-bfloat16.log | head -n 200
grep -h -E "^# rows" "$OUT"/bench-*.log

# Today's configuration (a 2 ms compute phase) and a compute-heavier one (8 ms): in the
# second, communication can hide behind compute, and what stays exposed is what counts.
for compute in 2000 8000; do
  if budget_allows 60; then
    phase "training loop, compute $compute us ($STEPS steps, $GRAD of gradients)"
    timeout "$(cap 150)" "$BIN" overlap --backend cuda --ranks "$WORLD" --steps "$STEPS" --grad-bytes "$GRAD" \
      --compute-us $compute --json "$OUT/overlap-$compute.json" >"$OUT/overlap-$compute.log" 2>&1 \
      || { echo "overlap $compute: FAILED"; status=1; }
    tail -n 6 "$OUT/overlap-$compute.log"
  fi
done

phase "plots and the goals table"
shopt -s nullglob # a phase that failed leaves no JSON: report what is there
for dt in bf16 f16 f32; do
  "$BIN" plot "$OUT"/bench-*.json -d $dt -o "$OUT/bench-$dt.png" || status=1
done
"$BIN" report "$OUT"/bench-*.json "$OUT"/overlap-*.json >"$OUT/goals.md" || status=1
cat "$OUT/goals.md"

if budget_allows 100; then
  phase "compute-sanitizer (memcheck, racecheck, synccheck)"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck synccheck; do
    budget_allows 30 || break
    timeout 60 "$BIN" launch -n "$WORLD" -- "$SAN" --tool "$tool" --error-exitcode 99 \
      "$BIN" check --backend cuda --cases 12 --max-bytes 1M --seed 7 >>"$OUT/sanitizer.log" 2>&1 \
      || { echo "$tool: FAILED"; status=1; }
  done
  grep -E "ERROR SUMMARY|passed, .* failed" "$OUT/sanitizer.log"
else
  echo "== compute-sanitizer skipped: $SECONDS s used of $BUDGET"
fi
phase "done, status $status"
exit $status
