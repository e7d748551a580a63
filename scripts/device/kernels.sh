#!/usr/bin/env bash
# The cuda data plane on a GPU machine: correctness of every path (staged and
# registered/zero-copy; LL, one-shot, two-shot; odd grids, small slots, unaligned pointers), the
# kernels' register use, compute-sanitizer on the new kernels, and a bandwidth sweep with CTA
# variations (NCCL beside it when two GPUs are present). Builds nothing: expects
# target/release/ipcreduce.
#
# Usage: scripts/device/kernels.sh OUT_DIR
# Run the phases in calls of at most 10 minutes into the same OUT_DIR (summary.txt collects
# every step), e.g. on two GPUs: PHASES=nvlink, then PHASES=bench, then PHASES=sweep; on one
# GPU (or two): PHASES=mps WORLDS=2, WORLDS=4, WORLDS=8 (one call each), PHASES=sanitize.
# Knobs: CASES=800 (main sweeps), VCASES=200 (variants), PHASES (any of nvlink, bench, sweep,
#        sanitize, mps; default "nvlink bench" with two GPUs, "mps" with one),
#        BENCH_MAX=1G, BLOCKS_SWEEP="8 16 32 64 96", WORLDS="2 4 8", BUDGET (seconds for the
#        call; unset by default: every step has its own timeout only; set, a step is cut at it
#        and one that no longer fits is skipped and reported as SKIP).
# Layout of OUT_DIR: env.txt, resources.txt, check-*.log, sanitizer.log, bench-*.{log,json},
# summary.txt (one line per step: PASS/FAIL and the last line of its output).
set -u
# step (timeouts, summary lines), mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: kernels.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
CASES=${CASES:-800}
VCASES=${VCASES:-200}
BENCH_MAX=${BENCH_MAX:-1G}
BLOCKS_SWEEP=${BLOCKS_SWEEP:-8 16 32 64 96}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# Without PHASES: what fits one call on this machine (two GPUs: NVLink checks and the
# benchmark; one GPU: the MPS checks and the sanitizer).
if [ "$NGPU" -ge 2 ]; then PHASES=${PHASES:-nvlink bench}; else PHASES=${PHASES:-mps}; fi
SUMMARY="$OUT/summary.txt"
: >>"$SUMMARY"
status=0

env_txt "GPUs: $NGPU"

# kstep NAME TIMEOUT CMD...: `step` (CMD into OUT/NAME.log, PASS/FAIL and its last line into
# summary.txt), then the paths the run took.
kstep() {
  step "$@"
  [ $? = 2 ] || grep -E "^# paths run" "$OUT/$1.log" | tail -n 1
}

# check NAME RANKS CASES [ARGS...]: the correctness sweep, with the variables in ENVS set.
check() {
  local name=$1 ranks=$2 cases=$3
  shift 3
  kstep "check-$name" 300 env "${ENVS[@]}" "$BIN" check --backend cuda --ranks "$ranks" \
    --cases "$cases" --seed "$ranks" "$@"
}

# Every path at world $1: staged and registered, then the variants that stress the protocol:
# odd and tiny grids (pieces that do not divide), small slots (many chunks, slot parity across
# calls with a changing grid), LL off (small messages through the SM kernels), one-shot only
# and two-shot only.
check_world() {
  local w=$1 tag=$2
  ENVS=()
  check "$tag-w$w-staged" "$w" "$CASES"
  check "$tag-w$w-registered" "$w" "$CASES" --registered
  ENVS=(IPCREDUCE_BLOCKS=5)
  check "$tag-w$w-staged-blocks5" "$w" "$VCASES" --max-bytes 64M
  check "$tag-w$w-registered-blocks5" "$w" "$VCASES" --max-bytes 64M --registered
  ENVS=(IPCREDUCE_SLOT_BYTES=262144 IPCREDUCE_LL_MAX=0)
  check "$tag-w$w-staged-smallslot-noll" "$w" "$VCASES" --max-bytes 16M
  ENVS=(IPCREDUCE_LL_MAX=0)
  check "$tag-w$w-registered-noll-oneshot" "$w" "$VCASES" --max-bytes 4M -a oneshot --registered
  check "$tag-w$w-registered-noll-twoshot" "$w" "$VCASES" --max-bytes 64M -a twoshot --registered
  if [ "$w" = 2 ]; then
    # The copy-engine path: every registered out-of-place case from 64 KB on (chunks of 8 MB).
    ENVS=(IPCREDUCE_CE_MIN=65536)
    check "$tag-w$w-registered-ce" "$w" "$VCASES" --max-bytes 64M --registered
  fi
  ENVS=()
}

# bench NAME ENV... -- ARGS...: one benchmark run (bf16, eager and graph) into bench-NAME.*
bench() {
  local name=$1
  shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  kstep "bench-$name" 300 env "${envs[@]}" "$BIN" bench --backend cuda --ranks "$RANKS" \
    -d bfloat16 -n 20 -w 5 -G 10 --json "$OUT/bench-$name.json" "$@"
  grep -E "bfloat16" "$OUT/bench-$name.log" | head -n 80
}

# --- kernel resources (registers, local memory) as the driver reports them ------------------
IPCREDUCE_LOG=info timeout 300 "$BIN" check --backend cuda --ranks 2 --cases 1 >"$OUT/resources.log" 2>&1
grep -E "kernels for world class" "$OUT/resources.log" | head -n 2 | tee "$OUT/resources.txt"

# --- two GPUs over NVLink ------------------------------------------------------------------
if [ "$NGPU" -ge 2 ] && [[ " $PHASES " == *" nvlink "* ]]; then
  check_world 2 nvlink
fi

# --- compute-sanitizer at world 2 (no MPS: it does not run under it) -------------------------
if [[ " $PHASES " == *" sanitize "* ]]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # Each rank under its own sanitizer; on one GPU the ranks time-slice, so keep it small.
  SCASES=8 SMAX=256K
  [ "$NGPU" -ge 2 ] && SCASES=40 SMAX=2M
  for tool in memcheck racecheck synccheck; do
    for reg in "" --registered; do
      kstep "sanitize-$tool${reg:+-registered}" 150 env IPCREDUCE_TIMEOUT_MS=120000 \
        "$BIN" launch -n 2 -- "$SAN" --tool "$tool" --error-exitcode 99 \
        "$BIN" check --backend cuda --cases "$SCASES" --max-bytes "$SMAX" --seed 7 $reg
      grep -E "ERROR SUMMARY" "$OUT/sanitize-$tool${reg:+-registered}.log" | sort | uniq -c
    done
  done
fi

# --- bandwidth sweep: every path, eager and graph; CTA variations for tuning ------------------
# Registered (zero-copy) buffers in the benchmark: its own --registered when this binary has it,
# else the test-buffer switch IPCREDUCE_TEST_REGISTERED=1.
REGFLAG=""
REGENV=IPCREDUCE_TEST_REGISTERED=1
if "$BIN" bench --help 2>&1 | grep -q -- "--registered"; then REGFLAG=--registered REGENV=; fi
if [[ " $PHASES " == *" bench "* ]]; then
  if [ "$NGPU" -ge 2 ]; then
    ALGOS=all
    RANKS=2
  else
    ALGOS=auto,oneshot,twoshot # NCCL refuses two ranks on one GPU; no NVLink figures here
    RANKS=2
    mps_on || exit 1
  fi
  bench staged -- -a "$ALGOS" -b 8 -e "$BENCH_MAX" -f 4
  bench registered $REGENV -- -a auto,oneshot,twoshot -b 8 -e "$BENCH_MAX" -f 4 $REGFLAG
  if [ "$RANKS" = 2 ]; then
    # The copy-engine path (two ranks, registered, out of place) from 4 MB on; in place stays
    # on the SM kernels. Its reduce kernel's CTAs follow IPCREDUCE_BLOCKS.
    bench ce $REGENV IPCREDUCE_CE_MIN=4194304 -- -a auto -b 4M -e "$BENCH_MAX" -f 2 $REGFLAG
    bench ce-blocks8 $REGENV IPCREDUCE_CE_MIN=4194304 IPCREDUCE_BLOCKS=8 -- -a auto -b 16M -e "$BENCH_MAX" -f 4 $REGFLAG
  fi
  mps_off
fi

# --- CTA sweep for tuning (1 MB, 8 MB, 64 MB, 512 MB; every SM path) ---------------------------
if [[ " $PHASES " == *" sweep "* ]]; then
  RANKS=2
  if [ "$NGPU" -lt 2 ]; then
    mps_on || exit 1
  fi
  for b in $BLOCKS_SWEEP; do
    bench "staged-blocks$b" IPCREDUCE_BLOCKS=$b -- -a oneshot,twoshot -b 1M -e 512M -f 8
    bench "registered-blocks$b" $REGENV IPCREDUCE_BLOCKS=$b -- -a oneshot,twoshot -b 1M -e 512M -f 8 $REGFLAG
  done
  mps_off
fi

# --- worlds 2, 4, 8 under MPS on one GPU -----------------------------------------------------
if [[ " $PHASES " == *" mps "* ]]; then
  mps_on || exit 1
  export CUDA_VISIBLE_DEVICES=0
  for w in ${WORLDS:-2 4 8}; do
    check_world "$w" mps
  done
fi

echo "== summary"
cat "$SUMMARY"
exit $status
