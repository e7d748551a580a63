#!/usr/bin/env bash
# GPUs without peer access and PCIe machines: the cuda backend staged through host memory
# (IPCREDUCE_TRANSPORT=host), the PCIe policy (IPCREDUCE_TOPOLOGY=pcie), auto's fallback with a
# failing pair, and the host-staged path against NCCL over its shared-memory transport.
# Builds nothing: expects target/release/ipcreduce.
# Usage: scripts/device/host-staged.sh OUT_DIR
#
# The default phases fit ONE device call (10 minutes) on ONE H200; every step has a timeout
# that never reaches past BUDGET seconds, and a step that no longer fits is skipped and reported
# as skipped (never as passed). In this order:
# When `nvidia-smi -L` lists two GPUs or more, on GPUs 0 and 1 without MPS, first:
#   two       `topo` over both GPUs (NVLink pairs must not get the PCIe policy), then world 2,
#             bf16, 8 B - BENCH_MAX: host transport (auto, oneshot, twoshot) against NCCL over
#             its shared-memory transport (-a nccl-shm: NCCL_P2P_DISABLE=1 in the same bench
#             process, the same buffers, every call checked); then the copy-engine path
#             through host memory (IPCREDUCE_CE_STAGED_MIN=1) from 64 KiB.
# On GPU 0 under MPS (every rank's traffic crosses the one PCIe link to host memory and back):
#   fallback  auto with the pair 1:0 denied (IPCREDUCE_DENY_PEER=1:0): `topo` must name the pair
#             in its table and JSON, and `check` must name it in the log while the job runs
#             on the host-staged path and passes.
#   pcie      `check` at WORLDS on the peer transport with IPCREDUCE_TOPOLOGY=pcie (pushes in
#             passes, at most 16 CTAs). These machines are NVLink/one-GPU: this tests the
#             policy's correctness only; PCIe contention cannot be reproduced here.
#   check     `check` at WORLDS (2 4 8) with the host transport forced.
#   bench     (if the budget allows) world 2, eager and CUDA graph, every call checked: host
#             transport and nccl-shm (two ranks on one GPU: NCCL over loopback sockets, a
#             functional column only), then the peer transport.
# Optional phases (PHASES=...):
#   slots     `check` at world 2, host transport, 1 MiB slots (many chunks per call).
#   peer      `check` at world 2 on the peer transport (the kernels are shared with it).
#   faults    scripts/device/mps-faults.sh with the host transport forced.
# Knobs: PHASES="check pcie fallback two bench", WORLDS="2 4 8", CASES=2000 (CASES_4, CASES_8,
#   CASES_PCIE), MAX_BYTES=256M (check), BENCH_MAX=128M, BUDGET=560, BLOCKS (IPCREDUCE_BLOCKS
#   for every run), MPS_BENCH_ALGOS (bench's host-transport algorithms on one GPU, default
#   auto,oneshot,twoshot,nccl-shm), BLOCKS_SWEEP="64" and SLOT_SWEEP="262144" (two: extra one-shot and two-shot
#   benches from 64 KiB; empty: none), CASES_SLOT=500, SOAK_CASES=20000 CYCLES=200 (faults).
# On nvidia-h200-x2, for the two-GPU figures alone: PHASES=two.
# summary.txt lists every step: OK, FAILED or SKIPPED. Exit status: 0 all ran and passed, 1 a
# step failed, 2 none failed but some were skipped for the budget.
set -u
# budget_fits, mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: host-staged.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
PHASES=${PHASES:-check pcie fallback two bench}
CASES=${CASES:-2000}
MAX_BYTES=${MAX_BYTES:-256M}
BENCH_MAX=${BENCH_MAX:-128M}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset IPCREDUCE_TRANSPORT IPCREDUCE_TOPOLOGY IPCREDUCE_DENY_PEER NCCL_P2P_DISABLE
[ -n "${BLOCKS:-}" ] && export IPCREDUCE_BLOCKS=$BLOCKS
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
has() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  nvidia-smi topo -m
  "$BIN" --version
  echo "PHASES=$PHASES WORLDS=${WORLDS-2 4 8} CASES=$CASES MAX_BYTES=$MAX_BYTES BENCH_MAX=$BENCH_MAX BUDGET=$BUDGET BLOCKS=${BLOCKS:-default} GPUS=$GPUS"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
: >"$OUT/summary.txt"
status=0

# result NAME OK|FAILED|SKIPPED [why]: one line of summary.txt (and of the output).
result() {
  echo "$1: $2${3:+ ($3)}" | tee -a "$OUT/summary.txt"
  [ "$2" = FAILED ] && status=1
  return 0
}
# fits NAME LIMIT: sets T to LIMIT, cut at the budget; false (and reported SKIPPED) when
# fewer than 20 seconds are left.
fits() {
  if ! budget_fits "$2"; then
    result "$1" SKIPPED "budget of $BUDGET s spent"
    [ $status = 0 ] && status=2 # incomplete, though nothing failed
    return 1
  fi
}

# check LOG LIMIT ARGS...: runs `check`; OK only if its summary line says 0 failed.
check() {
  local log=$1
  fits "$log" "$2" || return 0
  shift 2
  timeout "$T" "$BIN" check --backend cuda --max-bytes "$MAX_BYTES" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  grep -E "passed, .* failed|error|panicked" "$OUT/$log" | grep -v WARN | tail -n 2
  if [ $rc -eq 0 ] && grep -qE "^[0-9]+ passed, 0 failed$" "$OUT/$log"; then
    result "$log" OK "$(grep -E '^# [0-9]+ cases' "$OUT/$log" | tail -n 1 | sed 's/^# //')"
  else
    result "$log" FAILED "exit $rc$( [ $rc -eq 124 ] && echo ", timed out after $T s")"
  fi
}

# bench NAME LIMIT MIN_BYTES ARGS...: world-2 bf16 benchmark from MIN_BYTES to BENCH_MAX, table
# in NAME.log, results in NAME.json.
bench() {
  local name=$1
  fits "$name" "$2" || return 0
  local min=$3
  shift 3
  timeout "$T" "$BIN" bench --backend cuda --ranks 2 -d bfloat16 -b "$min" -e "$BENCH_MAX" -f 4 \
    -n 20 -w 5 -G 10 --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "bfloat16" "$OUT/$name.log" | head -n 120
  tail -n 2 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then result "$name" OK; else result "$name" FAILED "exit $rc"; fi
  [ -s "$OUT/$name.json" ] && ratios "$OUT/$name.json"
}

# ratios JSON: ipcreduce auto against NCCL per size and mode (busbw and time), into
# JSON's .ratios.txt; the goals: >= 2x NCCL's speed up to 1 MB, >= 1.5x its busbw from 8 MB.
ratios() {
  python3 - "$1" <<'PY' | tee "${1%.json}.ratios.txt"
import json, sys
rows = json.load(open(sys.argv[1])).get("rows", [])
get = {(r["algo"], r["mode"], r["bytes"]): r for r in rows if not r.get("registered")}
print("# bytes mode auto_us nccl_us speedup auto_busbw nccl_busbw nccl_flavor goal")
for (algo, mode, b), r in sorted(get.items(), key=lambda kv: (kv[0][1], kv[0][2])):
    n = get.get(("nccl", mode, b))
    if algo != "auto" or n is None:
        continue
    x = n["time_us"] / r["time_us"]
    goal = "2x" if b <= 1 << 20 else ("1.5x" if b >= 8 << 20 else "-")
    met = {"2x": x >= 2, "1.5x": x >= 1.5}.get(goal)
    print(b, mode, "%.2f" % r["time_us"], "%.2f" % n["time_us"], "%.2fx" % x,
          "%.1f" % r["busbw_gbps"], "%.1f" % n["busbw_gbps"], n.get("nccl"),
          goal + ("" if met is None else (" met" if met else " MISSED")))
PY
}

# topo_deny: `topo` with the pair 1:0 denied must take the host-staged path and name the pair,
# in its table, in its JSON and in rank 0's log line.
topo_deny() {
  fits topo-deny-1-0 60 || return 0
  CUDA_VISIBLE_DEVICES=0 IPCREDUCE_DENY_PEER=1:0 IPCREDUCE_LOG=warn timeout "$T" \
    "$BIN" topo --ranks 2 --json "$OUT/topo-deny-1-0.json" >"$OUT/topo-deny-1-0.log" 2>&1
  local rc=$?
  cat "$OUT/topo-deny-1-0.log"
  if [ $rc -eq 0 ] && python3 - "$OUT/topo-deny-1-0.json" "$OUT/topo-deny-1-0.log" <<'PY'; then
import json, sys
r = json.load(open(sys.argv[1]))
log = open(sys.argv[2]).read()
named = [p for p in r["pairs"] if p["mapping"].startswith("FAILED: rank 1 cannot use rank 0")]
ok = (r["transport"] == "host-staged" and r["fabric"] == "host-staged"
      and {(p["rank"], p["peer"]) for p in named} == {(0, 1), (1, 0)}
      and "rank 1 cannot use rank 0" in (r.get("fallback") or "")
      and "staging through host memory, because rank 1 cannot use rank 0" in log)
sys.exit(0 if ok else 1)
PY
    result topo-deny-1-0 OK "pair 1 -> 0 named in the table, the JSON and the log"
  else
    result topo-deny-1-0 FAILED "exit $rc, or the pair is not named"
  fi
}

# The two-GPU figures first: on nvidia-h200-x2 they are what the call is for.
# topo_classified: `topo` over GPUs 0 and 1 with everything on auto: pairs over NVLink must not
# get the PCIe policy (the classification reads P2P without native atomics as PCIe).
topo_classified() {
  fits topo-2gpu 60 || return 0
  CUDA_VISIBLE_DEVICES=0,1 timeout "$T" "$BIN" topo --ranks 2 --json "$OUT/topo-2gpu.json" \
    >"$OUT/topo-2gpu.log" 2>&1
  local rc=$?
  cat "$OUT/topo-2gpu.log"
  if [ $rc -eq 0 ] && python3 - "$OUT/topo-2gpu.json" <<'PY'; then
import json, sys
r = json.load(open(sys.argv[1]))
nvlink = all(p["link"].startswith("NVLink") for p in r["pairs"])
pcie = all(p["link"].startswith("PCIe") for p in r["pairs"])
want = "peer" if nvlink else ("pcie-peer" if pcie else r["fabric"])
print("links:", sorted({p["link"] for p in r["pairs"]}), "fabric:", r["fabric"], "expected:", want)
sys.exit(0 if r["fabric"] == want else 1)
PY
    result topo-2gpu OK "fabric follows the links"
  else
    result topo-2gpu FAILED "exit $rc, or the PCIe classification disagrees with NVML's links"
  fi
}

if has two; then
  if [ "$GPUS" -ge 2 ]; then
    echo "== [$SECONDS s] topo over GPUs 0 and 1: the path auto takes follows the links"
    topo_classified
    echo "== [$SECONDS s] bench world 2 over GPUs 0 and 1: host transport vs NCCL over shared memory"
    CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host \
      bench bench-2gpu-host 240 8 -a auto,oneshot,twoshot,nccl-shm
    # Sweeps from 64 KiB: smaller slots cap the chunk (a deeper pipeline for small messages),
    # more CTAs put more loads from host memory in flight.
    for sl in ${SLOT_SWEEP-262144}; do
      CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host IPCREDUCE_SLOT_BYTES=$sl \
        bench "bench-2gpu-host-slot$sl" 120 64K -a oneshot,twoshot
    done
    for b in ${BLOCKS_SWEEP-64}; do
      CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host IPCREDUCE_BLOCKS=$b \
        bench "bench-2gpu-host-blocks$b" 120 64K -a oneshot,twoshot
    done
    # The copy-engine path through host memory from 1 byte on (every call above the LL
    # limit): each GPU has a link of its own here, where copy engines carry 49 GB/s each way
    # with both directions busy and kernels 37.6 (scripts/device/pcie-link.sh).
    CUDA_VISIBLE_DEVICES=0,1 IPCREDUCE_TRANSPORT=host IPCREDUCE_CE_STAGED_MIN=1 \
      bench bench-2gpu-host-ce 120 64K -a auto
  else
    result bench-2gpu-host SKIPPED "nvidia-smi lists $GPUS GPU(s)"
  fi
fi

if has check || has pcie || has fallback || has bench || has slots || has peer; then
  mps_on || exit 1
  limit_for() { case $1 in 2) echo 120 ;; 4) echo 150 ;; *) echo 240 ;; esac; }
  cases_for() { case $1 in 4) echo "${CASES_4:-$CASES}" ;; 8) echo "${CASES_8:-$CASES}" ;; *) echo "$CASES" ;; esac; }
  if has fallback; then
    echo "== [$SECONDS s] auto with the pair 1:0 denied: topo and the log name it, the job runs"
    topo_deny
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=auto IPCREDUCE_DENY_PEER=1:0 IPCREDUCE_LOG=info \
      check check-fallback-w2.log 90 --ranks 2 --cases 300 --seed 11
    if [ -f "$OUT/check-fallback-w2.log" ] &&
      ! grep -q "staging through host memory, because rank 1 cannot use rank 0" "$OUT/check-fallback-w2.log"; then
      result check-fallback-w2.log FAILED "no log line naming the pair 1 -> 0"
    fi
  fi
  if has pcie; then
    for w in ${WORLDS-2 4 8}; do
      echo "== [$SECONDS s] check world $w, peer transport, PCIe policy forced (correctness only)"
      CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=peer IPCREDUCE_TOPOLOGY=pcie IPCREDUCE_LOG=info \
        check "check-pcie-w$w.log" "$(limit_for "$w")" --ranks "$w" \
        --cases "${CASES_PCIE:-$(cases_for "$w")}" --seed $((w + 30))
      if [ -f "$OUT/check-pcie-w$w.log" ] && ! grep -q "PCIe policy" "$OUT/check-pcie-w$w.log"; then
        result "check-pcie-w$w.log" FAILED "the devices do not say PCIe policy"
      fi
    done
  fi
  if has check; then
    for w in ${WORLDS-2 4 8}; do
      echo "== [$SECONDS s] check world $w, host transport forced, one GPU under MPS"
      CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host check "check-host-w$w.log" "$(limit_for "$w")" \
        --ranks "$w" --cases "$(cases_for "$w")" --seed "$w"
    done
  fi
  if has slots; then
    echo "== [$SECONDS s] check world 2, host transport, 1 MiB slots: many chunks per call"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host IPCREDUCE_SLOT_BYTES=1048576 \
      check check-host-w2-slot1M.log 120 --ranks 2 --cases "${CASES_SLOT:-500}" --seed 13
  fi
  if has peer; then
    echo "== [$SECONDS s] check world 2, peer transport, one GPU under MPS: the kernels are shared"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=peer check check-peer-w2.log 120 \
      --ranks 2 --cases "${CASES_PEER:-500}" --seed 12
  fi
  if has bench; then
    echo "== [$SECONDS s] bench world 2, one GPU under MPS: host transport vs nccl-shm (loopback sockets)"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host IPCREDUCE_NCCL_SHARED_GPU=1 \
      bench bench-mps-host-w2 200 8 -a "${MPS_BENCH_ALGOS:-auto,oneshot,twoshot,nccl-shm}"
    echo "== [$SECONDS s] bench world 2, one GPU under MPS: peer transport, for reference"
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=peer bench bench-mps-peer-w2 120 8 -a auto
  fi
  mps_off
fi

if has faults; then
  echo "== [$SECONDS s] fault tests and soak on the host transport (scripts/device/mps-faults.sh)"
  if fits faults 300; then
    CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host SOAK_CASES=${SOAK_CASES:-20000} \
      CYCLES=${CYCLES:-200} timeout "$T" bash "$(dirname "$0")/mps-faults.sh" "$OUT/faults" &&
      result faults OK || result faults FAILED
  fi
fi

echo "== [$SECONDS s] done"
cat "$OUT/summary.txt"
exit $status
