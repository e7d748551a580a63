#!/usr/bin/env bash
# `ipcreduce topo` on the GPU machine: one rank per GPU (peer memory over NVLink when there are
# two GPUs), world 2 and 4 under MPS (pairs on the same GPU), and auto's fallback with a pair's
# P2P query denied (IPCREDUCE_DENY_PEER=1:0, the test knob) where the job must take the
# host-staged path and rank 0's log must name the pair. Checks every JSON report (every ordered
# pair present, transport as expected, mapping test passed on the peer path) and writes
# summary.json. Builds nothing: expects target/release/ipcreduce.
# Usage: scripts/device/topo.sh OUT_DIR
set -u
OUT=${1:?usage: topo.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset IPCREDUCE_TRANSPORT

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv
  nvidia-smi topo -m
  "$BIN" --version
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
GPUS=$(nvidia-smi -L | wc -l)

status=0
# run NAME EXPECTED_TRANSPORT RANKS [VAR=VALUE...]
run() {
  local name=$1 want=$2 ranks=$3; shift 3
  echo "== $name: $ranks ranks, expecting $want"
  env "$@" timeout 120 "$BIN" topo --ranks "$ranks" --json "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 || { echo "FAILED (exit $?)"; status=1; }
  cat "$OUT/$name.log"
  python3 - "$OUT/$name.json" "$want" "$ranks" "$OUT/$name.log" >>"$OUT/checks.txt" <<'PY' || status=1
import json, sys
path, want, ranks, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
r = json.load(open(path))
pairs = {(p["rank"], p["peer"]) for p in r["pairs"]}
expect = {(a, b) for a in range(ranks) for b in range(ranks) if a != b}
ok = pairs == expect and r["transport"] == want
if want == "peer":
    ok &= all(p["mapping"] == "passed" and p["path"].startswith("peer memory") for p in r["pairs"])
else:
    ok &= all(p["path"].startswith("host-staged") for p in r["pairs"])
    ok &= "cannot use rank 0" in open(log).read()
print(("OK " if ok else "FAIL ") + path + ": transport " + r["transport"] + ", " + str(len(pairs)) + " pairs")
sys.exit(0 if ok else 1)
PY
  tail -n 1 "$OUT/checks.txt"
}

if [ "$GPUS" -ge 2 ]; then
  run per-gpu peer "$GPUS"
fi
# MPS, checked: the daemon must answer (lib/steps.sh).
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
MPS_ENV="$OUT/env.txt" mps_on || exit 1
run mps-w2 peer 2
run mps-w4 peer 4
run deny-1-0 host-staged 2 IPCREDUCE_DENY_PEER=1:0 IPCREDUCE_LOG=warn

python3 - "$OUT" "$status" <<'PY'
import json, sys
out, status = sys.argv[1], int(sys.argv[2])
lines = open(out + "/checks.txt").read().split("\n")
json.dump({"ok": status == 0, "checks": [l for l in lines if l]}, open(out + "/summary.json", "w"), indent=1)
PY
exit $status
