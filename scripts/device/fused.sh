#!/usr/bin/env bash
# The fused all-reduce + residual add + RMSNorm on one GPU (ranks under MPS):
#   gputests  its GPU tests (crates/ipcreduce/tests/gpu_fused.rs: fused == all-reduce +
#             reference kernel bit for bit and == the CPU reference, worlds 2/4/8, plain and
#             registered, in place, FP8, each path forced, graph replays, mismatches) through
#             gpu-tests.sh;
#   bench     `ipcreduce fused-bench` at worlds 2 and 4: hidden 4096/8192/16384 x tokens
#             1/8/32/128/512, bf16, graph replay, fused vs all-reduce + reference kernel,
#             every result checked, each row naming its path; the tables go to
#             bench-w<W>.txt (and .json), or bench-w<W>-<path>.txt for a forced path.
# Builds nothing: run scripts/build-gpu-tests.sh here first (it leaves target/gpu-tests/gpu,
# target/gpu-tests/gpu_fused and target/release/ipcreduce).
# Usage: scripts/device/fused.sh OUT_DIR
# summary.txt: one line per step. Knobs: PHASES="gputests bench", BUDGET=145 (seconds),
# GPUTESTS_S=65 (the tests step's limit: every test of gpu_fused, both paths forced, takes
# more, so raise it with BUDGET, or pick tests with GPU_TESTS_FILTER), GPU_FUSED_CASES
# (random shapes per world, default 6), WORLDS="2 4", FUSED_PATHS="auto" (the bench once per
# word: auto, oneshot, twoshot, ll; IPCREDUCE_FUSED_PATH for the run, to measure the
# crossovers; ll runs the tokens 1/8/32 only: it takes at most 1 MiB per rank, and a call it
# cannot take is an argument error, which ends the run).
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: fused.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
BUDGET=${BUDGET:-145}
PHASES=${PHASES:-gputests bench}
WORLDS=${WORLDS:-2 4}
GPUTESTS_S=${GPUTESTS_S:-65}
FUSED_PATHS=${FUSED_PATHS:-auto}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
status=0
export GPU_FUSED_CASES=${GPU_FUSED_CASES:-6}
# Only the kernel groups these tests use are warmed up (below): all of them would take longer
# than the tests.
export GPU_TESTS_WARMUP=${GPU_TESTS_WARMUP:-0}
has() { [[ " $PHASES " == *" $1 "* ]]; }

if has gputests; then
  # The kernel groups the tests use, every world class, compiled in parallel into the cache.
  step warmup 40 "$BIN" warmup --world 8 --only ll,staged,zerocopy16,fused
  # gpu-tests.sh starts and stops MPS itself.
  step gputests "$GPUTESTS_S" env GPU_TESTS_BINS=target/gpu-tests/gpu_fused \
    "$(dirname "$0")/gpu-tests.sh" "$OUT/gpu-tests"
  grep -E "^(ok|FAILED|skip|ignore) |passed,|BAD" "$OUT/gputests.log" 2>/dev/null | head -n 20
fi
if has bench; then
  if mps_on; then
    for p in $FUSED_PATHS; do
      sfx=""
      [ "$p" = auto ] || sfx="-$p"
      tokens=1,8,32,128,512
      [ "$p" = ll ] && tokens=1,8,32
      for w in $WORLDS; do
        name="bench-w$w$sfx"
        step "$name" 18 env IPCREDUCE_FUSED_PATH="$p" "$BIN" fused-bench --backend cuda \
          --ranks "$w" --hidden 4096,8192,16384 --tokens "$tokens" --dtype bf16 -G 20 \
          --rounds 3 --json "$OUT/$name.json"
        cp "$OUT/$name.log" "$OUT/$name.txt" 2>/dev/null
        echo "== fused-bench world $w, path $p"
        grep -v "^#   rank" "$OUT/$name.log" | head -n 24
      done
    done
    mps_off
  else
    echo "FAIL mps: the MPS control daemon did not start" | tee -a "$SUMMARY"
    status=1
  fi
fi
echo "== summary"
cat "$SUMMARY"
exit $status
