#!/usr/bin/env bash
# libipcreduce_nccl.so, the NCCL stand-in, on one GPU under MPS (world 2, each rank its own
# NCCL_HOSTID), every program unchanged with backend="nccl" / NCCL's C API, run plain and
# with the library preloaded (IPCREDUCE_NCCL=log):
#  torch       python/gpu/nccl_dropin.py: all-reduce (sum/max/min/avg), reduce-scatter,
#              all-gather of every size and dtype checked against float64, on the default
#              stream and on cudaStreamLegacy / cudaStreamPerThread, in a CUDA graph; DDP
#              losses compared; the 8 KB all-reduce timed.
#  fsdp-tp     python/gpu/nccl_fsdp_tp.py: FSDP2 (fully_shard) and a DTensor tensor-parallel
#              MLP, losses compared between the runs and across ranks.
#  watchdog    python/gpu/nccl_watchdog.py: a rank SIGKILLed inside an accelerated
#              all-reduce; the survivor's ncclCommGetAsyncError reports ncclRemoteError /
#              ncclSystemError within 10 s, ncclGetLastError names the rank, abort returns;
#              python/gpu/nccl_kill_step.py: DDP with a rank SIGKILLed mid-step, the survivor
#              gets PyTorch's error naming it within 20 s.
#  nccl-tests  with its source in target/nccl-tests-src: built here (MPI=1, system NCCL, only
#              all_reduce/reduce_scatter/all_gather), run with -c 1 and the library preloaded
#              (every dtype and op, in place and out of place; the all-reduce also on
#              stream 0, -y 1), then the small all-reduce timed with and without it, eager
#              and in a graph, beside our own bench of the same sizes (bench-ours), in
#              TIME_ROUNDS rounds run in turns (the summary gives the medians and what the
#              stand-in adds to our own calls); then an eager run with both host profiles
#              (profile.txt).
# Builds nothing of ours: expects target/release/libipcreduce_nccl.so (carry it; also
# target/release/ipcreduce for bench-ours).
# Usage: scripts/device/nccl-dropin.sh OUT_DIR
# Knobs: BUDGET=290 (seconds); PARTS="torch fsdp-tp watchdog nccl-tests" (or nccl-time: the
# nccl-tests part without its -c 1 checks); CHECK_MAX=16M, the upper end of the -c 1 sweeps
# (sizes step by 8x from 8 B: 256M ends at 128 MiB), CHECK_LIMIT=60 (seconds per sweep; raise
# it with CHECK_MAX); CHECK_TOP (unset: none), one more -c 1 run of each collective at exactly
# that size (256M: the top of NCCL's usual sweep), CHECK_TOP_LIMIT=120; TIME_ROUNDS=1 and
# TIME_ITERS=100, the timing's rounds (in turns) and calls per size.
# Prints a summary: checks passed/failed, calls per path, the small all-reduce's times.
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: nccl-dropin.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPO=$(pwd)
LIB=$REPO/target/release/libipcreduce_nccl.so
[ -f "$LIB" ] || { echo "need $LIB (carry target/release/libipcreduce_nccl.so)" >&2; exit 2; }
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
BUDGET=${BUDGET:-290}
status=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
# The first communicator compiles every kernel (tens of seconds on a bare machine).
export IPCREDUCE_TIMEOUT_MS=${IPCREDUCE_TIMEOUT_MS:-120000}
export DROPIN_OUT=$OUT
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
  # The commit the library was built from (the tree's git may be stale on a copied tree).
  grep -aoEm1 'ipcreduce-nccl build (unknown|[0-9a-f]{12}(-dirty)?)' "$LIB"
  ls -l "$LIB"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
mps_on || exit 1

PARTS=" ${PARTS:-torch fsdp-tp watchdog nccl-tests} "
TORCHRUN="torchrun --standalone --nproc_per_node=2"
PRELOAD=(env IPCREDUCE_NCCL=log LD_PRELOAD="$LIB")

# Each program plain, then preloaded (the first preloaded run compiles the kernels).
if [[ $PARTS == *" torch "* ]]; then
  step torch-plain 90 env DROPIN_TAG=plain $TORCHRUN "$REPO/python/gpu/nccl_dropin.py"
  step torch-preload 150 "${PRELOAD[@]}" DROPIN_TAG=preload $TORCHRUN "$REPO/python/gpu/nccl_dropin.py"
fi
if [[ $PARTS == *" fsdp-tp "* ]]; then
  step fsdptp-plain 60 env DROPIN_TAG=plain $TORCHRUN "$REPO/python/gpu/nccl_fsdp_tp.py"
  step fsdptp-preload 90 "${PRELOAD[@]}" DROPIN_TAG=preload $TORCHRUN "$REPO/python/gpu/nccl_fsdp_tp.py"
fi

# The killed rank: two processes started here (rank 1 kills itself), rank 0's exit decides.
# A function run by `step` through `bash -c` (timeout runs programs only).
watchdog() {
  local dir=$OUT/watchdog rc pid1
  rm -rf "$dir" && mkdir -p "$dir"
  env IPCREDUCE_NCCL=log LD_PRELOAD="$LIB" RANK=1 WATCHDOG_DIR="$dir" NCCL_HOSTID=watchdog-rank1 \
    python3 "$REPO/python/gpu/nccl_watchdog.py" >"$dir/rank1.log" 2>&1 &
  pid1=$!
  env IPCREDUCE_NCCL=log LD_PRELOAD="$LIB" RANK=0 WATCHDOG_DIR="$dir" NCCL_HOSTID=watchdog-rank0 \
    python3 "$REPO/python/gpu/nccl_watchdog.py" >"$dir/rank0.log" 2>&1
  rc=$?
  # Rank 1 ends by its own SIGKILL (or by the faulthandler bound).
  wait "$pid1"
  echo "rank 1 exit $? (137: its SIGKILL)"
  grep -E "ncclAllReduce .*-> (ipcreduce|nccl)$" "$dir/rank0.log" | tail -n 2
  if ! grep -qE "ncclAllReduce .*-> ipcreduce$" "$dir/rank0.log"; then
    echo "FAIL: rank 0's all-reduces did not run on ipcreduce"
    rc=1
  fi
  grep -E "PASS watchdog|FAIL" "$dir/rank0.log" | tail -n 1
  return "$rc"
}
# DDP with rank 1 SIGKILLed mid-step (no torchrun, whose agent would end rank 0 itself):
# rank 0 must get PyTorch's error naming rank 1 within 20 s of the kill (the script judges it
# and leaves at once, before PyTorch's minute-long teardown).
kill_step() {
  local dir=$OUT/kill-step rc pid1 t0
  rm -rf "$dir" && mkdir -p "$dir"
  export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 IPCREDUCE_NCCL=log LD_PRELOAD="$LIB"
  export KILL_FILE=$dir/killed
  RANK=1 NCCL_HOSTID=killstep-rank1 python3 "$REPO/python/gpu/nccl_kill_step.py" >"$dir/rank1.log" 2>&1 &
  pid1=$!
  t0=$SECONDS
  RANK=0 NCCL_HOSTID=killstep-rank0 timeout 45 python3 "$REPO/python/gpu/nccl_kill_step.py" >"$dir/rank0.log" 2>&1
  rc=$?
  wait "$pid1"
  echo "rank 1 exit $? (137: its SIGKILL); rank 0 exit $rc after $((SECONDS - t0)) s"
  echo "rank 0 on ipcreduce: $(grep -cE "ncclAllReduce .*-> ipcreduce$" "$dir/rank0.log") all-reduces"
  grep -E "kill-step|s after rank 1 was killed" "$dir/rank0.log" | cut -c1-700
  grep -q "PASS kill-step" "$dir/rank0.log" && [ "$rc" -eq 0 ]
}
if [[ $PARTS == *" watchdog "* ]]; then
  export -f watchdog kill_step
  export OUT REPO LIB
  step watchdog 40 bash -c watchdog
  step kill-step 50 bash -c kill_step
fi

SRC=$REPO/target/nccl-tests-src
BUILD=/tmp/nccl-tests
if [[ $PARTS != *" nccl-tests "* && $PARTS != *" nccl-time "* ]]; then
  :
elif [ -d "$SRC" ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PATH=/usr/local/cuda/bin:$PATH
  rm -rf "$BUILD" && cp -r "$SRC" "$BUILD"
  step nccl-tests-build 150 make -C "$BUILD" -j16 MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi \
    BIN_FILES_LIST="all_reduce reduce_scatter all_gather" \
    NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90"
  # Each rank its own NCCL_HOSTID (two ranks on one GPU), both on GPU 0.
  WRAP=$OUT/rank-env.sh
  printf '#!/bin/sh\nexport NCCL_HOSTID=nccltests-rank$OMPI_COMM_WORLD_RANK\nexec "$@"\n' >"$WRAP"
  chmod +x "$WRAP"
  export NCCL_TESTS_DEVICE=0
  MPIRUN="mpirun -np 2 --bind-to none -x NCCL_TESTS_DEVICE -x LD_LIBRARY_PATH -x NCCL_SOCKET_IFNAME -x NCCL_IB_DISABLE -x NCCL_NVLS_ENABLE -x IPCREDUCE_TIMEOUT_MS -x CUDA_MPS_PIPE_DIRECTORY"
  # nccl-time alone: the build and the timing, without the -c 1 checks.
  checks=all_reduce
  [[ $PARTS == *" nccl-tests "* ]] || checks=""
  for t in ${checks:+all_reduce reduce_scatter all_gather}; do
    [ -x "$BUILD/build/${t}_perf" ] || continue
    # Correctness: every dtype and op, 8 B - CHECK_MAX, in place and out of place (log: paths).
    step "nccl-tests-$t-check" "${CHECK_LIMIT:-60}" env IPCREDUCE_NCCL=log LD_PRELOAD="$LIB" $MPIRUN -x LD_PRELOAD -x IPCREDUCE_NCCL \
      "$WRAP" "$BUILD/build/${t}_perf" -b 8 -e "${CHECK_MAX:-16M}" -f 8 -g 1 -c 1 -d all -o all -n 3 -w 1
    # The sweep's 8x steps pass the top of the range by; one size on its own.
    [ -n "${CHECK_TOP:-}" ] && step "nccl-tests-$t-top-check" "${CHECK_TOP_LIMIT:-120}" \
      env IPCREDUCE_NCCL=log LD_PRELOAD="$LIB" $MPIRUN -x LD_PRELOAD -x IPCREDUCE_NCCL \
      "$WRAP" "$BUILD/build/${t}_perf" -b "$CHECK_TOP" -e "$CHECK_TOP" -g 1 -c 1 -d all -o all -n 2 -w 1
  done
  # The same on the legacy default stream (-y 1: nccl-tests passes stream 0).
  [ -n "$checks" ] && [ -x "$BUILD/build/all_reduce_perf" ] && step nccl-tests-all_reduce-stream0-check 45 \
    env IPCREDUCE_NCCL=log LD_PRELOAD="$LIB" $MPIRUN -x LD_PRELOAD -x IPCREDUCE_NCCL \
    "$WRAP" "$BUILD/build/all_reduce_perf" -b 8 -e 1M -f 8 -g 1 -c 1 -d all -o all -n 3 -w 1 -y 1
  # The small all-reduce, bf16, eager and as graph replays (-G), without and with the library,
  # and our own bench of the same sizes (what the stand-in's calls are held to): TIME_ROUNDS
  # rounds of all of them in turns (a drift of the machine hits them alike; eager calls are
  # bound by the host, whose pace moves between runs), TIME_ITERS calls per size.
  if [ -x "$BUILD/build/all_reduce_perf" ]; then
    BENCH_BIN=$REPO/target/release/ipcreduce
    [ -x "$BENCH_BIN" ] || echo "SKIP bench-ours: no $BENCH_BIN (carry target/release/ipcreduce)" | tee -a "$SUMMARY"
    iters=${TIME_ITERS:-100}
    for r in $(seq 1 "${TIME_ROUNDS:-1}"); do
      for mode in plain preload; do
        for g in 0 20; do
          pre=()
          [ $mode = preload ] && pre=(env LD_PRELOAD="$LIB")
          step "nccl-tests-time-$mode-G$g-r$r" 40 "${pre[@]}" $MPIRUN ${pre:+-x LD_PRELOAD} \
            "$WRAP" "$BUILD/build/all_reduce_perf" -b 8 -e 64K -f 4 -g 1 -c 1 -d bfloat16 -G "$g" \
            -n "$iters" -w 10
        done
      done
      [ -x "$BENCH_BIN" ] && step "bench-ours-r$r" 60 "$BENCH_BIN" bench --backend cuda --ranks 2 -a auto \
        -d bfloat16 -b 8 -e 8K -f 4 -n "$iters" -w 10 -G 20 --json "$OUT/bench-ours-r$r.json"
    done
    # Where a preloaded eager call's host time goes (its own run: the profiles' clock reads
    # cost time): the stand-in's phases (IPCREDUCE_NCCL_PROFILE) and the library's inside
    # its collective phase (IPCREDUCE_HOST_PROFILE), printed by every rank at exit.
    step nccl-tests-profile-G0 40 env LD_PRELOAD="$LIB" IPCREDUCE_NCCL_PROFILE=1 IPCREDUCE_HOST_PROFILE=1 \
      $MPIRUN -x LD_PRELOAD -x IPCREDUCE_NCCL_PROFILE -x IPCREDUCE_HOST_PROFILE \
      "$WRAP" "$BUILD/build/all_reduce_perf" -b 8 -e 8K -f 4 -g 1 -c 1 -d bfloat16 -G 0 -n 2000 -w 10
    grep -h "profile" "$OUT/nccl-tests-profile-G0.log" | tee "$OUT/profile.txt"
  fi
else
  echo "SKIP nccl-tests: no target/nccl-tests-src" | tee -a "$SUMMARY"
fi

# The summary: every check, every path, the timings.
python3 "$REPO/scripts/device/lib/nccl_dropin_summary.py" "$OUT" | tee "$OUT/summary-report.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAIL compare" >>"$SUMMARY"; }

echo "== summary"
cat "$SUMMARY"
grep -q '^FAIL' "$SUMMARY" && status=1
echo "== nccl-dropin.sh exit $status ($SECONDS s)"
exit $status
