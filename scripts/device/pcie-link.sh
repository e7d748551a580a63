#!/usr/bin/env bash
# The bound of the host-staged transport on one GPU, and the transport beside it in the same run:
#   probe    scripts/device/probes/pcie_link.cu (compiled here with nvcc: a probe of the link,
#            nothing of the library), without MPS: each direction of the GPU's PCIe link alone
#            and while the other is busy, by copy engine and by kernel loads/stores of mapped
#            host memory (probe.txt, probe.json).
#   staged   under MPS, world 2, IPCREDUCE_TRANSPORT=host, bf16 sum, 1 MiB - MAX: one-shot,
#            two-shot and auto, eager, every call checked (staged.log, json/staged.json).
# An all-reduce of S bytes at world 2 on this transport moves 2S each way over the link (each
# rank writes its S into host memory and reads its peer's S), so its busbw (S / time) is at most
# half of one direction's bandwidth while the other direction carries as much: bound.txt puts
# the staged rows beside that figure.
# Builds nothing of ours: expects target/release/ipcreduce (IPCREDUCE_BIN).
# Usage: scripts/device/pcie-link.sh OUT_DIR       Knobs: MAX=256M, ITERS=8, BUDGET=200.
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: pcie-link.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
MAX=${MAX:-256M}
ITERS=${ITERS:-8}
BUDGET=${BUDGET:-200}
gpu_run_setup
mkdir -p "$OUT/json"
export CUDA_VISIBLE_DEVICES=0
env_txt "MAX=$MAX ITERS=$ITERS BUDGET=$BUDGET
$(nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current --format=csv 2>&1)"

PROBE=$(mktemp -d)/pcie_link
step probe-build 60 /usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o "$PROBE" \
  "$(dirname "$0")/probes/pcie_link.cu"
[ -x "$PROBE" ] && JSON="$OUT/probe.json" step probe 60 "$PROBE" 64 10
cp "$OUT/probe.log" "$OUT/probe.txt" 2>/dev/null

MPS_ENV="$OUT/env.txt" mps_on || exit 1
IPCREDUCE_TRANSPORT=host step staged 120 "$BIN" bench --backend cuda --ranks 2 -d bfloat16 \
  -a oneshot,twoshot,auto -b 1M -e "$MAX" -f 4 -n "$ITERS" -w 2 -G 0 --json "$OUT/json/staged.json"
mps_off

python3 - "$OUT" <<'PY' | tee "$OUT/bound.txt"
import json, os, sys
out = sys.argv[1]
try:
    probe = {r["name"]: r for r in json.load(open(os.path.join(out, "probe.json")))["rows"]}
except (OSError, ValueError) as e:
    sys.exit(f"no probe figures ({e})")
both = max((r for n, r in probe.items() if "+" in n or "both" in n), key=lambda r: r["gbps_median"])
bound = both["gbps_median"] / 2
print(f"# the link, both directions busy: best {both['name']} {both['gbps_median']:.2f} GB/s each way")
print(f"# world-2 all-reduce bound on this transport: {bound:.2f} GB/s busbw")
try:
    rows = json.load(open(os.path.join(out, "json", "staged.json")))["rows"]
except (OSError, ValueError) as e:
    sys.exit(f"no staged figures ({e})")
print("# algo path bytes busbw_GBps of_bound wrong")
for r in rows:
    print(r["algo"], r.get("path"), r["bytes"], "%.2f" % r["busbw_gbps"],
          "%.0f%%" % (100 * r["busbw_gbps"] / bound), r.get("wrong", 0))
PY
echo "== [$SECONDS s] done"
cat "$SUMMARY"
exit $status
