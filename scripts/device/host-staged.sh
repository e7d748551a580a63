#!/usr/bin/env bash
# The cuda backend staged through host memory (IPCREDUCE_TRANSPORT=host), as on GPUs without
# peer access. Builds nothing: expects target/release/ipcreduce.
# Usage: scripts/device/host-staged.sh OUT_DIR
#
# On GPU 0 under MPS (every rank's traffic crosses PCIe to host memory and back):
#   check   `check` at world 2, 4, 8 with the host transport forced.
#   slots   `check` at world 2, host transport, 1 MiB slots (many chunks per call).
#   peer    `check` at world 2 on the peer transport (the kernels are shared with it).
#   fallback  `auto` with one pair denied (IPCREDUCE_DENY_PEER=1:0) must fall back to host
#           staging, name the pair in its log and pass `check`.
#   bench   world 2, bf16: host transport (oneshot, twoshot, auto) and NCCL on the same
#           buffers with NCCL_P2P_DISABLE=1 (two ranks on one GPU: NCCL runs over loopback
#           sockets, a functional column only); then the peer transport for reference.
#   faults  scripts/device/mps-faults.sh with the host transport forced: mismatched calls,
#           timeout, a rank killed mid-call, create/destroy cycles, a soak (not in the default
#           PHASES: run it as PHASES=faults).
# When `nvidia-smi -L` lists two GPUs or more, on GPUs 0 and 1 without MPS:
#   two     world 2: check with the host transport forced, then bench host transport against
#           NCCL over its shared-memory transport (NCCL_P2P_DISABLE=1): the issue's anchors.
# Knobs: PHASES="check slots peer fallback bench two" (any subset, and faults), WORLDS="2 4 8", CASES=2000
#   (CASES_4, CASES_8 default to CASES; CASES_PEER=500), MAX_BYTES=256M (check), BENCH_MAX=256M, BLOCKS
#   (IPCREDUCE_BLOCKS for every run), BLOCKS_SWEEP="16 64" (two-GPU phase: extra two-shot
#   benches with these block counts), SLOT_SWEEP="2097152 4194304" (the same with these slot
#   sizes in bytes), CASES_SLOT=500 (slots phase), SOAK_CASES=20000 CYCLES=200 (faults phase).
# Each step has its own timeout; one device call runs at most 10 minutes, so split long jobs
# by PHASES / WORLDS (see the report that introduced this script).
set -u
OUT=${1:?usage: host-staged.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
PHASES=${PHASES:-check slots peer fallback bench two}
CASES=${CASES:-2000}
MAX_BYTES=${MAX_BYTES:-256M}
BENCH_MAX=${BENCH_MAX:-256M}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -n "${BLOCKS:-}" ] && export IPCREDUCE_BLOCKS=$BLOCKS
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
has() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  nvidia-smi topo -m
  "$BIN" --version
  echo "PHASES=$PHASES WORLDS=${WORLDS-2 4 8} CASES=$CASES MAX_BYTES=$MAX_BYTES BENCH_MAX=$BENCH_MAX BLOCKS=${BLOCKS:-default} GPUS=$GPUS"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0

# check LOG TIMEOUT ARGS...: runs `check`; fails unless its summary line says 0 failed.
check() {
  local log=$1 limit=$2
  shift 2
  timeout "$limit" "$BIN" check --backend cuda --max-bytes "$MAX_BYTES" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  grep -E "passed, .* failed|error|panicked" "$OUT/$log" | grep -v WARN | tail -n 3
  if [ $rc -ne 0 ] || ! grep -qE "^[0-9]+ passed, 0 failed$" "$OUT/$log"; then
    echo "$log: FAILED (exit $rc)"
    status=1
  fi
}

# bench NAME TIMEOUT MIN_BYTES ARGS...: world-2 bf16 benchmark from MIN_BYTES to BENCH_MAX,
# table in NAME.log, results in NAME.json.
bench() {
  local name=$1 limit=$2 min=$3
  shift 3
  timeout "$limit" "$BIN" bench --backend cuda --ranks 2 -d bfloat16 -b "$min" -e "$BENCH_MAX" -f 4 \
    -n 20 -w 5 -G 10 --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1 || {
    echo "$name: FAILED"
    status=1
  }
  grep -E "bfloat16" "$OUT/$name.log" | head -n 80
  tail -n 2 "$OUT/$name.log"
}

if has check || has slots || has peer || has fallback || has bench; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  if has check; then
    for w in ${WORLDS-2 4 8}; do
      n=$CASES
      [ "$w" = 4 ] && n=${CASES_4:-$CASES}
      [ "$w" = 8 ] && n=${CASES_8:-$CASES}
      echo "== check world $w, host transport forced, one GPU under MPS ($n cases)"
      CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host check "check-host-w$w.log" 500 \
        --ranks "$w" --cases "$n" --seed "$w"
    done
  fi
  if has slots; then
    echo "== check world 2, host transport, 1 MiB slots: many chunks per call (${CASES_SLOT:-500} cases)"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host IPCREDUCE_SLOT_BYTES=1048576 \
      check check-host-w2-slot1M.log 300 --ranks 2 --cases "${CASES_SLOT:-500}" --seed 13
  fi
  if has peer; then
    echo "== check world 2, peer transport, one GPU under MPS (${CASES_PEER:-500} cases): the kernels are shared"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=peer check check-peer-w2.log 300 \
      --ranks 2 --cases "${CASES_PEER:-500}" --seed 12
  fi
  if has fallback; then
    echo "== auto with the pair 1:0 denied: must fall back to host staging and say why"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=auto IPCREDUCE_DENY_PEER=1:0 IPCREDUCE_LOG=info \
      check check-fallback-w2.log 200 --ranks 2 --cases 100 --seed 11
    if grep -q "staging through host memory, because rank 1 cannot use rank 0" "$OUT/check-fallback-w2.log"; then
      echo "fallback logged the pair"
    else
      echo "check-fallback-w2.log: FAILED (no log line naming the pair 1 -> 0)"
      status=1
    fi
  fi
  if has bench; then
    echo "== bench world 2, one GPU under MPS: host transport vs NCCL (P2P off, loopback sockets)"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host NCCL_P2P_DISABLE=1 IPCREDUCE_NCCL_SHARED_GPU=1 \
      bench bench-mps-host-w2 500 8 -a oneshot,twoshot,auto,nccl
    echo "== bench world 2, one GPU under MPS: peer transport, for reference"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=peer bench bench-mps-peer-w2 300 8 -a auto
  fi
  echo quit | nvidia-cuda-mps-control
  trap - EXIT
fi

if has faults; then
  echo "== fault tests and soak on the host transport (scripts/device/mps-faults.sh)"
  CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host SOAK_CASES=${SOAK_CASES:-20000} \
    CYCLES=${CYCLES:-200} bash "$(dirname "$0")/mps-faults.sh" "$OUT/faults" || status=1
fi

if has two; then
  if [ "$GPUS" -ge 2 ]; then
    echo "== check world 2 over GPUs 0 and 1, host transport forced ($CASES cases)"
    CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host check check-host-2gpu.log 500 \
      --ranks 2 --cases "$CASES" --seed 21
    echo "== bench world 2 over GPUs 0 and 1: host transport vs NCCL over shared memory"
    CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host NCCL_P2P_DISABLE=1 \
      bench bench-2gpu-host 500 8 -a oneshot,twoshot,auto,nccl
    for sl in ${SLOT_SWEEP:-}; do
      echo "== bench world 2 over GPUs 0 and 1, host transport, slots of $sl bytes, two-shot from 1 MiB"
      CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host IPCREDUCE_SLOT_BYTES=$sl \
        bench "bench-2gpu-host-slot$sl" 300 1M -a twoshot
    done
    for b in ${BLOCKS_SWEEP:-}; do
      echo "== bench world 2 over GPUs 0 and 1, host transport, $b blocks, two-shot from 1 MiB"
      CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host IPCREDUCE_BLOCKS=$b \
        bench "bench-2gpu-host-blocks$b" 300 1M -a twoshot
    done
  else
    echo "== two-GPU phase skipped: nvidia-smi lists $GPUS GPU(s)"
  fi
fi
exit $status
