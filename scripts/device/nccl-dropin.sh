#!/usr/bin/env bash
# libipcreduce_nccl.so, the NCCL stand-in, on one GPU under MPS (world 2, each rank its own
# NCCL_HOSTID): (a) python/gpu/nccl_dropin.py, an unchanged PyTorch program with
# backend="nccl", run plain and with the library preloaded (IPCREDUCE_NCCL=log): every check
# passes in both, the DDP losses agree, ipcreduce ran all-reduce, reduce-scatter and
# all-gather, and the 8 KB all-reduce times side by side; (b) with the nccl-tests source in
# target/nccl-tests-src, nccl-tests built here (MPI=1, system NCCL) and run with -c 1, the
# library preloaded, every dtype and op, in place and out of place.
# Builds nothing of ours: expects target/release/libipcreduce_nccl.so (carry it).
# Usage: scripts/device/nccl-dropin.sh OUT_DIR
# Knobs: BUDGET=540 (seconds); PARTS="torch nccl-tests" (either alone fits one call better on a
# bare machine, where the first ipcreduce communicator compiles every kernel).
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
BUDGET=${BUDGET:-540}
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
  git -C "$REPO" rev-parse HEAD 2>/dev/null
  ls -l "$LIB"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
mps_on || exit 1

PARTS=" ${PARTS:-torch nccl-tests} "
TORCHRUN="torchrun --standalone --nproc_per_node=2"
PY=$REPO/python/gpu/nccl_dropin.py
# (a) PyTorch, plain NCCL, then the same program preloaded.
if [[ $PARTS == *" torch "* ]]; then
step torch-plain 200 env DROPIN_TAG=plain $TORCHRUN "$PY"
step torch-preload 260 env DROPIN_TAG=preload IPCREDUCE_NCCL=log LD_PRELOAD="$LIB" $TORCHRUN "$PY"
cmp_rc=0
python3 - "$OUT" <<'PY' || cmp_rc=1
import glob, json, os, re, sys
out = sys.argv[1]
def reports(tag):
    return [json.load(open(p)) for p in sorted(glob.glob(f"{out}/dropin-{tag}-rank*.json"))]
plain, pre = reports("plain"), reports("preload")
bad = []
if len(plain) != 2 or len(pre) != 2:
    bad.append(f"reports: {len(plain)} plain, {len(pre)} preloaded (want 2 each)")
for r in plain + pre:
    if r["failures"]:
        bad.append(f"{r['tag']} rank {r['rank']}: {len(r['failures'])} failed: {r['failures'][:5]}")
if plain and pre:
    a, b = plain[0]["ddp_losses"], pre[0]["ddp_losses"]
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    print(f"DDP losses plain {a}\n           preload {b}\n           worst relative difference {worst:.2e}")
    if worst > 1e-4:
        bad.append(f"DDP losses differ by {worst:.2e} (more than 1e-4)")
log = open(f"{out}/torch-preload.log", errors="replace").read()
paths = {}
for coll, path in re.findall(r"(ncclAllReduce|ncclReduceScatter|ncclAllGather) .*-> (ipcreduce|nccl)", log):
    paths[(coll, path)] = paths.get((coll, path), 0) + 1
for coll in ("ncclAllReduce", "ncclReduceScatter", "ncclAllGather"):
    print(f"{coll}: ipcreduce {paths.get((coll, 'ipcreduce'), 0)} calls, nccl {paths.get((coll, 'nccl'), 0)} calls")
    if not paths.get((coll, "ipcreduce")):
        bad.append(f"{coll} never ran on ipcreduce")
reasons = {}
for why in re.findall(r"(?:ncclAllReduce|ncclReduceScatter|ncclAllGather) [^\n]*\(([^()]*)\) -> nccl$", log, re.M):
    reasons[why] = reasons.get(why, 0) + 1
print("forwarded collectives by reason:", reasons)
for line in re.findall(r"^ipcreduce-nccl: .*(?:ready|not accelerated|failed).*$", log, re.M)[:6]:
    print(line)
print("8 KB bf16 all-reduce (us, rank 0): eager plain %.1f preload %.1f; graph plain %.1f preload %.1f" % (
    plain[0]["allreduce_8k_bf16_eager_us"] if plain else float("nan"),
    pre[0]["allreduce_8k_bf16_eager_us"] if pre else float("nan"),
    plain[0]["allreduce_8k_bf16_graph_us"] if plain else float("nan"),
    pre[0]["allreduce_8k_bf16_graph_us"] if pre else float("nan")))
json.dump({"plain": plain, "preload": pre, "paths": {f"{c} {p}": n for (c, p), n in paths.items()},
           "forward_reasons": reasons, "problems": bad}, open(f"{out}/torch-summary.json", "w"), indent=1)
print("torch problems:", bad or "none")
sys.exit(1 if bad else 0)
PY
if [ $cmp_rc -eq 0 ]; then echo "PASS torch-compare" >>"$SUMMARY"; else echo "FAIL torch-compare" >>"$SUMMARY"; fi
fi

# (b) nccl-tests, when its source came along.
SRC=$REPO/target/nccl-tests-src
if [[ $PARTS != *" nccl-tests "* ]]; then
  :
elif [ -d "$SRC" ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PATH=/usr/local/cuda/bin:$PATH
  BUILD=/tmp/nccl-tests
  rm -rf "$BUILD" && cp -r "$SRC" "$BUILD"
  step nccl-tests-build 240 make -C "$BUILD" -j16 MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi \
    NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90"
  # Each rank its own NCCL_HOSTID (two ranks on one GPU).
  WRAP=$OUT/rank-env.sh
  printf '#!/bin/sh\nexport NCCL_HOSTID=nccltests-rank$OMPI_COMM_WORLD_RANK\nexec "$@"\n' >"$WRAP"
  chmod +x "$WRAP"
  # Both ranks on GPU 0 (nccl-tests would give the second process GPU 1).
  export NCCL_TESTS_DEVICE=0
  MPIRUN="mpirun -np 2 --bind-to none -x NCCL_TESTS_DEVICE -x LD_LIBRARY_PATH -x NCCL_SOCKET_IFNAME -x NCCL_IB_DISABLE -x NCCL_NVLS_ENABLE -x IPCREDUCE_TIMEOUT_MS -x CUDA_MPS_PIPE_DIRECTORY"
  for t in all_reduce reduce_scatter all_gather; do
    [ -x "$BUILD/build/${t}_perf" ] || continue
    # Correctness: every dtype and op, 8 B - 64 MiB, with the library (log: paths taken).
    step "nccl-tests-$t-check" 150 env IPCREDUCE_NCCL=log LD_PRELOAD="$LIB" $MPIRUN -x LD_PRELOAD -x IPCREDUCE_NCCL \
      "$WRAP" "$BUILD/build/${t}_perf" -b 8 -e 64M -f 8 -g 1 -c 1 -d all -o all -n 5 -w 2
    # Small-message time, graph replay, with and without.
    for mode in plain preload; do
      pre=""; [ $mode = preload ] && pre="LD_PRELOAD=$LIB"
      step "nccl-tests-$t-time-$mode" 90 env $pre $MPIRUN ${pre:+-x LD_PRELOAD} \
        "$WRAP" "$BUILD/build/${t}_perf" -b 8 -e 64K -f 4 -g 1 -c 1 -d bfloat16 -G 20 -n 50 -w 5
    done
  done
  for f in "$OUT"/nccl-tests-*-check.log; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f"): $(grep -cE '(ncclAllReduce|ncclReduceScatter|ncclAllGather) .*-> ipcreduce$' "$f") collectives on ipcreduce, $(grep -cE '(ncclAllReduce|ncclReduceScatter|ncclAllGather) .*-> nccl$' "$f") forwarded"
    grep -E "Out of bounds|Avg bus|counts:|not accelerated|communicator ready|#wrong" "$f" | head -n 12
  done
  for f in "$OUT"/nccl-tests-*-time-*.log; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f")"
    grep -E "^ +[0-9]+ " "$f" | head -n 8
  done
else
  echo "SKIP nccl-tests: no target/nccl-tests-src" | tee -a "$SUMMARY"
fi

echo "== summary"
cat "$SUMMARY"
grep -q '^FAIL' "$SUMMARY" && status=1
echo "== nccl-dropin.sh exit $status"
exit $status
