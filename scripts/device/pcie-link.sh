#!/usr/bin/env bash
# The bound of the host-staged transport on one GPU, and the transport beside it in the same run:
#   probe    scripts/device/probes/pcie_link.cu (compiled here with nvcc: a probe of the link,
#            nothing of the library), without MPS: each direction of the GPU's PCIe link alone
#            and while the other is busy, by copy engine and by kernel loads/stores of mapped
#            host memory (probe.txt, probe.json).
#   pair     under MPS, two probe processes at once (START_AT), row by row: each direction by
#            copy engine, then both: the traffic of a world-2 all-reduce on one GPU, two ranks'
#            copies sharing the copy engines and the link (pair-0.log, pair-1.log, pair-0.json,
#            pair-1.json).
#   staged   under MPS, world 2, IPCREDUCE_TRANSPORT=host, bf16 sum, 1 MiB - MAX: one-shot,
#            two-shot and auto, eager, every call checked (staged.log, json/staged.json).
# An all-reduce of S bytes at world 2 on this transport moves 2S each way over the link (each
# rank writes its S into host memory and reads its peer's S), so its busbw (S / time) is at most
# half of one direction's bandwidth while the other direction carries as much: bound.txt puts
# the staged rows beside that figure.
# Builds nothing of ours: expects target/release/ipcreduce (IPCREDUCE_BIN).
# Usage: scripts/device/pcie-link.sh OUT_DIR
# Knobs: MAX=256M, ITERS=8, BUDGET=200, STAGED=1 (0: no staged step), PAIR_REPS=100.
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: pcie-link.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
MAX=${MAX:-256M}
ITERS=${ITERS:-8}
BUDGET=${BUDGET:-200}
STAGED=${STAGED:-1}
PAIR_REPS=${PAIR_REPS:-100}
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

# pair_probe: two probes under MPS, one row at a time, both starting it at the same second (each
# row its own launch: rows of unequal length would drift apart within one launch); fails if
# either does. pair-I.json holds process I's rows.
pair_probe() {
  local at row i p pids rc=0
  for row in ce-d2h ce-h2d ce-both; do
    at=$(($(date +%s) + 3))
    pids=()
    for i in 0 1; do
      ROWS=$row START_AT=$at JSON="$OUT/pair-$i-$row.json" \
        "$PROBE" 64 "$PAIR_REPS" >>"$OUT/pair-$i.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
  done
  for i in 0 1; do
    python3 -c 'import json, sys; print(json.dumps({"rows": [r for f in sys.argv[1:] for r in json.load(open(f))["rows"]]}))' \
      "$OUT"/pair-$i-ce-*.json >"$OUT/pair-$i.json" || rc=1
  done
  cat "$OUT"/pair-*.log
  return $rc
}

MPS_ENV="$OUT/env.txt" mps_on || exit 1
export -f pair_probe
export OUT PROBE PAIR_REPS
[ -x "$PROBE" ] && step pair 60 bash -c pair_probe
[ "$STAGED" = 1 ] && IPCREDUCE_TRANSPORT=host step staged 120 "$BIN" bench --backend cuda --ranks 2 -d bfloat16 \
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
pair = []
for i in (0, 1):
    try:
        pair.append({r["name"]: r for r in json.load(open(os.path.join(out, f"pair-{i}.json")))["rows"]})
    except (OSError, ValueError):
        pass
if len(pair) == 2 and all("ce-both" in p for p in pair):
    each = [p["ce-both"]["gbps_median"] for p in pair]
    print(f"# two processes under MPS, both directions by copy engine at once: {each[0]:.2f} + "
          f"{each[1]:.2f} = {sum(each):.2f} GB/s each way; world-2 bound {sum(each) / 2:.2f} GB/s busbw")
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
