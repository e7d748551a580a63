#!/usr/bin/env bash
# The fused all-reduce + residual add + RMSNorm from Python on GPUs: python/gpu/fused_check.py
# (a sweep of shapes and dtypes with the fp8 output against the documented numerics, the same
# bits on every rank, torch.compile with inductor and its CUDA graphs, a shape mismatch between
# ranks) at world 2; the tensor-parallel decoder example (fused vs unfused on the same inputs,
# eager and CUDA-graph replay) at world 2; then python/gpu/fused_bench.py at worlds 2 and 4
# (fused vs ipcreduce all-reduce + torch add + rms_norm vs NCCL all-reduce + the same; bf16,
# CUDA-graph replay, every result checked).
# Builds nothing: expects the abi3 wheel in target/wheels/ (README.md "Python") and
# target/release/ipcreduce (for the kernel-cache warm-up). Fewer GPUs than ranks: the ranks
# share the GPUs under MPS (NCCL then needs NCCL_HOSTID per rank: python/gpu/common.py).
# FUSED_HIDDEN / FUSED_TOKENS (comma lists) narrow the benchmark.
# Usage: scripts/device/fused-py.sh OUT_DIR
set -u
# mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: fused-py.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPO=$(pwd)
BIN=${IPCREDUCE_BIN:-$REPO/target/release/ipcreduce}
WHEEL=$(ls "$REPO"/target/wheels/ipcreduce-*-abi3-manylinux*.whl 2>/dev/null | tail -n 1)
if [ -z "$WHEEL" ] || [ ! -x "$BIN" ]; then
  echo "need target/wheels/ipcreduce-*-abi3-manylinux*.whl and $BIN (carry both)" >&2
  exit 2
fi
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export IPCREDUCE_TIMEOUT_MS=${IPCREDUCE_TIMEOUT_MS:-10000}
export IPCREDUCE_PY_OUT=$OUT PYTHONUNBUFFERED=1

SITE=/tmp/ipcreduce-site
rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEEL" || exit 2
export PYTHONPATH=$SITE:$REPO/python/gpu${PYTHONPATH:+:$PYTHONPATH}

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$BIN" --version
  python3 -c 'import torch, ipcreduce; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "ipcreduce", ipcreduce.__version__)'
  echo "wheel $(basename "$WHEEL")"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$GPUS" -lt 4 ]; then
  echo "== $GPUS GPU(s): ranks share them under MPS"
  mps_on || exit 1
fi
# A cold kernel cache makes each rank's first call of a kind wait for its compile (tens of
# seconds on a bare machine): fill it first, so no step times a compile.
echo "== warmup"
timeout -k 10 300 "$BIN" warmup --world 4 >"$OUT/warmup.log" 2>&1
echo "   exit $? ($(tail -n 1 "$OUT/warmup.log"))"

status=0
# py_step NAME SECONDS CMD...: one program, its output into OUT/NAME.log, the tail shown.
py_step() {
  local name=$1 secs=$2
  shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - t0)) s"
  grep -vE '^\s*$|Warning|warn\(' "$OUT/$name.log" | grep -vi "W1[0-9]* " | tail -n 40
  return $rc
}
TORCHRUN="torchrun --standalone --nproc_per_node"

# FUSED_PY_STEPS: the steps to run (default all four; a device call of 10 minutes may need two).
STEPS=" ${FUSED_PY_STEPS:-check decoder bench2 bench4} "
want() { case "$STEPS" in *" $1 "*) return 0 ;; esac; return 1; }
if want check; then
  py_step fused-check 300 $TORCHRUN=2 "$REPO/python/gpu/fused_check.py" || status=1
fi
if want decoder; then
  py_step tp-decoder 180 $TORCHRUN=2 "$REPO/python/examples/tp_decoder.py" --device cuda \
    --graph --tokens 8 --hidden 4096 --ffn 8192 --layers 4 || status=1
fi
if want bench2; then
  py_step fused-bench-w2 420 $TORCHRUN=2 "$REPO/python/gpu/fused_bench.py" || status=1
fi
if want bench4; then
  py_step fused-bench-w4 600 $TORCHRUN=4 "$REPO/python/gpu/fused_bench.py" || status=1
fi

python3 - "$OUT" "$STEPS" <<'PY' || status=1
import glob, json, os, sys
out, steps = sys.argv[1], sys.argv[2].split()
expected = [f"fused-bench-w{w}-rank{r}" for w in (2, 4) for r in range(w) if f"bench{w}" in steps]
expected += ["fused-check-rank0", "fused-check-rank1"] if "check" in steps else []
summary = {}
for path in sorted(glob.glob(os.path.join(out, "fused-*-rank*.json"))):
    summary[os.path.basename(path)[:-len(".json")]] = json.load(open(path))
json.dump(summary, open(os.path.join(out, "fused-summary.json"), "w"), indent=1)
missing = [n for n in expected if n not in summary]
failed = {n: r["failures"] for n, r in summary.items() if r.get("failures")}
for w in (2, 4):
    r = summary.get(f"fused-bench-w{w}-rank0")
    if r:
        print(r["table"])
        print(f"goal at world {w}: {r['goal']}\n")
print(f"== fused-summary.json: {len(summary)} reports; missing: {missing or 'none'}; "
      f"failed checks: {json.dumps(failed) if failed else 'none'}")
sys.exit(1 if missing or failed else 0)
PY
echo "== fused-py.sh exit $status"
exit $status
