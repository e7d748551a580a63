#!/usr/bin/env bash
# Jobs across nodes, played on one machine: each "node" is an `ipcreduce launch --nnodes 2`
# of its own with a distinct IPCREDUCE_HOST_ID (so ranks group into nodes) and, through
# IPCREDUCE_NCCL_SHARED_GPU=1, a distinct NCCL_HOSTID per rank (NCCL then treats every rank as
# a host of its own and talks over loopback sockets: NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1).
# Loopback NCCL times say nothing about a real network; they show that the step runs and what
# it costs here.
#
# Phases (each bounded by `timeout`, each logged; a phase that needs two GPUs is skipped with
# one):
#   rsag-gpu-test   the GPU test of reduce-scatter/all-gather (plain, registered, graphs) at
#                   world 2 and 4 under MPS, when target/gpu-tests/gpu exists
#                   (scripts/build-gpu-tests.sh)
#   check-1x2       one node of 2 ranks (GPU 0, MPS): the all-reduce sweep still passes
#   check-2x2       2 nodes x 2 ranks on GPU 0 under MPS: `check` CASES cases (hierarchical)
#   check-2x2-reg   the same on registered buffers (zero-copy intra-node steps), CASES/4 cases
#   split-2x2       per size: the checked call, its intra/NCCL/intra split, flat NCCL beside
#   check-2x1, split-2x1   2 nodes x 1 GPU (node i on GPU i)         [two GPUs]
#   check-1x2gpu, split-1x2gpu   1 node x 2 GPUs, for comparison     [two GPUs]
# Builds nothing: expects target/release/ipcreduce (and optionally target/gpu-tests/gpu).
# Usage: scripts/device/multinode.sh OUT_DIR [CASES]
# Writes OUT_DIR/env.txt, OUT_DIR/<phase>.log (and <phase>.node1.log), OUT_DIR/split-*.json and
# OUT_DIR/summary.json; the last line printed is `N phases passed, N failed, N skipped`.
# Knobs: MAX_BYTES (check's largest message, default 64M), SPLIT_SIZES (default
# 64K,1M,16M,64M), BUDGET (seconds for the whole script, default 570: every phase's timeout
# stops at it, phases after it are skipped and reported), PHASES (names to run, default all),
# IPCREDUCE_BIN, GPU_TESTS_BIN.
set -u
# budget_fits, mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: multinode.sh OUT_DIR [CASES]}
CASES=${2:-2000}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
TESTS=${GPU_TESTS_BIN:-target/gpu-tests/gpu}
MAX_BYTES=${MAX_BYTES:-64M}
SPLIT_SIZES=${SPLIT_SIZES:-64K,1M,16M,64M}
BUDGET=${BUDGET:-570}
PHASES=${PHASES:-all}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Loopback sockets for NCCL between the played nodes (launch sets these too, unless set).
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
# Jobs across hosts need a shared secret in every launcher's environment.
IPCREDUCE_SECRET=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
export IPCREDUCE_SECRET

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "GPUs: $GPUS"
  "$BIN" --version
  ls -l "$BIN" "$TESTS" 2>&1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

mps_on || exit 1

passed=0 failed=0 skipped=0
json="["
# record NAME RC SECONDS LOG: one summary entry; "N passed, N failed" of the log when it has one.
record() {
  local name=$1 rc=$2 secs=$3 log=$4 line ok
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" 2>/dev/null | tail -n 1)
  if [ "$rc" -eq 0 ]; then ok=true; passed=$((passed + 1)); else ok=false; failed=$((failed + 1)); fi
  printf '%-14s %s (exit %s, %s s) %s\n' "$name" "$([ $ok = true ] && echo ok || echo FAILED)" "$rc" "$secs" "$line"
  json="$json{\"phase\":\"$name\",\"ok\":$ok,\"exit\":$rc,\"seconds\":$secs,\"result\":\"$line\"},"
}
skip() {
  skipped=$((skipped + 1))
  echo "$1 skipped: $2"
  json="$json{\"phase\":\"$1\",\"skipped\":\"$2\"},"
}
# wanted NAME: whether to run phase NAME; sets LIMIT (its timeout: what is left of the budget,
# at most 560 s). Skips (and reports) phases not asked for or past the budget.
wanted() {
  case " $PHASES " in *" all "* | *" $1 "*) ;; *) skip "$1" "not in PHASES"; return 1 ;; esac
  if ! budget_fits 560 30; then skip "$1" "budget of $BUDGET s spent"; return 1; fi
  LIMIT=$T
}

# two_nodes NAME PER_NODE DEV0 DEV1 ARGS...: `ipcreduce ARGS` as a job of 2 nodes x PER_NODE
# ranks on loopback; node i sees GPU DEVi only. Node 1 starts first (its ranks wait, bounded,
# for rank 0). Exit status: the worse of the two launchers.
two_nodes() {
  local name=$1 per=$2 dev0=$3 dev1=$4
  shift 4
  wanted "$name" || return 0
  local port=$((20000 + RANDOM % 30000)) start rc0 rc1
  start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$dev1 IPCREDUCE_HOST_ID=played-node-1 IPCREDUCE_NCCL_SHARED_GPU=1 \
    timeout $LIMIT "$BIN" launch -n "$per" --nnodes 2 --node-rank 1 --master 127.0.0.1:$port -- \
    "$BIN" "$@" >"$OUT/$name.node1.log" 2>&1 &
  local pid1=$!
  CUDA_VISIBLE_DEVICES=$dev0 IPCREDUCE_HOST_ID=played-node-0 IPCREDUCE_NCCL_SHARED_GPU=1 \
    timeout $LIMIT "$BIN" launch -n "$per" --nnodes 2 --node-rank 0 --master 127.0.0.1:$port -- \
    "$BIN" "$@" >"$OUT/$name.log" 2>&1
  rc0=$?
  wait $pid1
  rc1=$?
  record "$name" $((rc0 > rc1 ? rc0 : rc1)) $(($(date +%s) - start)) "$OUT/$name.log"
  grep -E "FAIL|error|^ *[0-9]+ +[0-9]+ " "$OUT/$name.log" "$OUT/$name.node1.log" | grep -v WARN | head -n 12
}

# one_node NAME ARGS...: `ipcreduce ARGS` (it starts its own ranks).
one_node() {
  local name=$1 start rc
  shift
  wanted "$name" || return 0
  start=$(date +%s)
  timeout $LIMIT "$BIN" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  record "$name" $rc $(($(date +%s) - start)) "$OUT/$name.log"
  grep -E "FAIL|error|^ *[0-9]+ +[0-9]+ " "$OUT/$name.log" | grep -v WARN | head -n 12
}

if ! [ -x "$TESTS" ]; then
  skip rsag-gpu-test "$TESTS missing (scripts/build-gpu-tests.sh)"
elif wanted rsag-gpu-test; then
  start=$(date +%s)
  timeout $LIMIT "$TESTS" --exact reduce_scatter_and_all_gather_plain_registered_and_in_graphs \
    --test-threads=1 --nocapture >"$OUT/rsag-gpu-test.log" 2>&1
  record rsag-gpu-test $? $(($(date +%s) - start)) "$OUT/rsag-gpu-test.log"
  grep -E "panicked|checked per rank" "$OUT/rsag-gpu-test.log" | head -n 5
fi

CHECK=(check --backend cuda --max-bytes "$MAX_BYTES")
CUDA_VISIBLE_DEVICES=0 one_node check-1x2 "${CHECK[@]}" --ranks 2 --cases 300 --seed 5
# 4 ranks on one GPU, two per played node: each node's communicator sizes its grid for the 2
# ranks it knows of, so the grid is fixed lower here to keep every CTA of the 4 ranks (and
# NCCL's) resident together.
IPCREDUCE_BLOCKS=32 two_nodes check-2x2 2 0 0 "${CHECK[@]}" --cases "$CASES" --seed 7
IPCREDUCE_BLOCKS=32 two_nodes check-2x2-reg 2 0 0 "${CHECK[@]}" --cases $((CASES / 4)) --seed 8 --registered
IPCREDUCE_BLOCKS=32 two_nodes split-2x2 2 0 0 split --backend cuda --sizes "$SPLIT_SIZES" \
  --json "$OUT/split-2x2.json"

if [ "$GPUS" -ge 2 ]; then
  two_nodes check-2x1 1 0 1 "${CHECK[@]}" --cases "$CASES" --seed 9
  two_nodes split-2x1 1 0 1 split --backend cuda --sizes "$SPLIT_SIZES" --json "$OUT/split-2x1.json"
  CUDA_VISIBLE_DEVICES=0,1 one_node check-1x2gpu "${CHECK[@]}" --ranks 2 --cases 500 --seed 10
  CUDA_VISIBLE_DEVICES=0,1 one_node split-1x2gpu split --backend cuda --ranks 2 \
    --sizes "$SPLIT_SIZES" --json "$OUT/split-1x2gpu.json"
else
  for p in check-2x1 split-2x1 check-1x2gpu split-1x2gpu; do skip $p "one GPU"; done
fi

echo "${json%,}]" >"$OUT/summary.json"
echo "$passed phases passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
