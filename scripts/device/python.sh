#!/usr/bin/env bash
# The Python package on GPUs: torch CUDA tensors against NCCL (bf16/f16/f32, every result
# checked), the custom ops and torch.compile, CUDA-graph capture (a tensor-parallel layer
# replayed 1000 times; 8-64 KB all-reduces against NCCL in the same graph), a killed rank, and
# the DDP training benchmark (NCCL / ipcreduce hook / no_sync, loss curves).
# Builds nothing: expects the abi3 wheel in target/wheels/ (built on the development machine,
# see README.md "Python") and target/release/ipcreduce.
# Two GPUs or more: the full run, one rank per GPU. One GPU: world 2 under MPS, fewer steps.
# Usage: scripts/device/python.sh OUT_DIR
set -u
# mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: python.sh OUT_DIR}
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
# Every wait bounded well below the step timeouts below.
export IPCREDUCE_TIMEOUT_MS=${IPCREDUCE_TIMEOUT_MS:-10000}
export IPCREDUCE_PY_OUT=$OUT

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

if [ "$GPUS" -lt 2 ]; then
  echo "== one GPU: world 2 under MPS, the smaller dry run"
  export IPCREDUCE_PY_SMALL=1
  mps_on || exit 1
fi

status=0
# py_step NAME SECONDS CMD...: runs one program, its output into OUT/NAME.log (its outcome is
# the JSON each rank writes, read at the end; no summary.txt line).
py_step() {
  local name=$1 secs=$2
  shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - t0)) s"
  grep -vE '^\s*$|Warning|warn\(' "$OUT/$name.log" | grep -vi "W1[0-9]* " | tail -n 30
  return $rc
}
TORCHRUN="torchrun --standalone --nproc_per_node=2"
# PY_STEPS: the programs to run (default all four).
STEPS=" ${PY_STEPS:-correctness graph kill train} "
want() { case "$STEPS" in *" $1 "*) return 0 ;; esac; return 1; }
G=$REPO/python/gpu

if want correctness; then py_step correctness 240 $TORCHRUN "$G/correctness.py" || status=1; fi
if want graph; then py_step graph 180 $TORCHRUN "$G/graph.py" || status=1; fi
# A killed rank: `ipcreduce launch` (torchrun would stop the survivor before it reports). The
# job itself fails (a rank was killed); the survivor's JSON says whether it raised in time.
for victim in $(want kill && echo 1 0); do
  VICTIM=$victim py_step "kill-victim$victim" 60 "$BIN" launch -n 2 -- python3 "$G/kill.py"
  survivor=$((1 - victim))
  python3 - "$OUT/kill-victim$victim-rank$survivor.json" <<'PY' || status=1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"   no report from the survivor: {e}")
print(f"   survivor raised {r.get('seconds_after_kill', float('nan')) * 1000:.0f} ms after the kill: {r['error']}")
sys.exit(1 if r["failures"] else 0)
PY
done
if want train; then py_step train 330 $TORCHRUN "$G/train.py" || status=1; fi

python3 - "$OUT" "$STEPS" <<'PY' || status=1
import glob, json, os, sys
out, steps = sys.argv[1], sys.argv[2].split()
expected = [n for n in ["correctness-rank0", "correctness-rank1", "graph-rank0", "graph-rank1",
                        "kill-victim1-rank0", "kill-victim0-rank1", "train-rank0", "train-rank1"]
            if n.split("-")[0] in steps]
summary = {}
for path in sorted(glob.glob(os.path.join(out, "*-rank*.json"))):
    name = os.path.basename(path)[:-len(".json")]
    r = json.load(open(path))
    if name.startswith("train"):
        r["loss"].pop("curves", None)
    summary[name] = r
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
missing = [n for n in expected if n not in summary]
failed = {n: r["failures"] for n, r in summary.items() if r.get("failures")}
print(f"== summary.json: {len(summary)} reports; missing: {missing or 'none'}; "
      f"failed checks: {json.dumps(failed) if failed else 'none'}")
sys.exit(1 if missing or failed else 0)
PY
echo "== python.sh exit $status"
exit $status
