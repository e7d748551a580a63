#!/usr/bin/env bash
# The bound of the host-staged transport on one GPU, and the transport beside it in the same run:
#   probe    scripts/device/probes/pcie_link.cu (compiled here with nvcc: a probe of the link,
#            nothing of the library), without MPS: each direction of the GPU's PCIe link alone
#            and while the other is busy, by copy engine and by kernel loads/stores of mapped
#            host memory (probe.txt, probe.json); then its copy-engine rows with memfd host
#            buffers, as the transport's slots are (probe-memfd.log, probe-memfd.json).
#   pair     under MPS, two probe processes at once (START_AT), row by row: each direction by
#            copy engine, then both: the traffic of a world-2 all-reduce on one GPU, two ranks'
#            copies sharing the copy engines and the link; then kernels both ways; each with
#            pinned and with memfd host buffers (pair-0.log, pair-1.log, pair-0.json,
#            pair-1.json: rows ROW@HOST, with their wall-clock spans).
#   staged   under MPS, world 2, IPCREDUCE_TRANSPORT=host, bf16 sum, 1 MiB - MAX: one-shot,
#            two-shot and auto, eager, every call checked (staged.log, json/staged.json).
# An all-reduce of S bytes at world 2 on this transport moves 2S each way over the link (each
# rank writes its S into host memory and reads its peer's S), so its busbw (S / time) is at most
# half of one direction's bandwidth while the other direction carries as much: bound.txt puts
# the staged rows beside that figure.
# Builds nothing of ours: expects target/release/ipcreduce (IPCREDUCE_BIN).
# Usage: scripts/device/pcie-link.sh OUT_DIR
# Knobs: MAX=256M, ITERS=8, BUDGET=200, STAGED=1 (0: no staged step), PAIR_REPS=300,
#   PAIR_ROWS ("ce-d2h ce-h2d ce-both sm-both/64": the probe's rows run by the pair),
#   PAIR_HOSTS ("pinned memfd": the host buffers, cudaHostAlloc or a registered memfd as the
#   transport's slots; the probe's HOST).
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: pcie-link.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
MAX=${MAX:-256M}
ITERS=${ITERS:-8}
BUDGET=${BUDGET:-200}
STAGED=${STAGED:-1}
PAIR_REPS=${PAIR_REPS:-300}
PAIR_ROWS=${PAIR_ROWS:-ce-d2h ce-h2d ce-both sm-both/64}
PAIR_HOSTS=${PAIR_HOSTS:-pinned memfd}
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
[ -x "$PROBE" ] && HOST=memfd ROWS=ce-d2h,ce-h2d,ce-both JSON="$OUT/probe-memfd.json" \
  step probe-memfd 30 "$PROBE" 64 10

# pair_probe: two probes under MPS, one row at a time, both starting it at the same second (each
# row its own launch: rows of unequal length would drift apart within one launch); fails if
# either does. pair-I.json holds process I's rows.
pair_probe() {
  local at row host i p pids rc=0
  for host in $PAIR_HOSTS; do
    for row in $PAIR_ROWS; do
      at=$(($(date +%s) + 3))
      pids=()
      for i in 0 1; do
        HOST=$host ROWS=$row START_AT=$at JSON="$OUT/pair-$i-$host-${row//\//_}.json" \
          "$PROBE" 64 "$PAIR_REPS" >>"$OUT/pair-$i.log" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || rc=1; done
    done
  done
  # pair-I.json: process I's rows, named ROW@HOST.
  for i in 0 1; do
    python3 -c 'import json, sys
rows = []
for f in sys.argv[1:]:
    host = f.rsplit("/", 1)[1].split("-")[2]
    rows += [dict(r, name=r["name"] + "@" + host) for r in json.load(open(f))["rows"]]
print(json.dumps({"rows": rows}))' "$OUT"/pair-$i-*.json >"$OUT/pair-$i.json" || rc=1
  done
  cat "$OUT"/pair-*.log
  return $rc
}

MPS_ENV="$OUT/env.txt" mps_on || exit 1
export -f pair_probe
export OUT PROBE PAIR_REPS PAIR_ROWS PAIR_HOSTS
[ -x "$PROBE" ] && step pair 150 bash -c pair_probe
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
try:
    for r in json.load(open(os.path.join(out, "probe-memfd.json")))["rows"]:
        pinned = probe.get(r["name"], {}).get("gbps_median")
        print(f"# memfd host buffers, {r['name']}: {r['gbps_median']:.2f} GB/s per direction "
              f"(cudaHostAlloc: {pinned if pinned is not None else '-'})")
except (OSError, ValueError):
    pass
pair = []
for i in (0, 1):
    try:
        pair.append({r["name"]: r for r in json.load(open(os.path.join(out, f"pair-{i}.json")))["rows"]})
    except (OSError, ValueError):
        pass
# The two processes' rows: bytes of both over the union of their wall-clock spans (their
# repetitions' rates cannot be added: one process's may run while the other's wait).
names = sorted(set(pair[0]) & set(pair[1])) if len(pair) == 2 else []
for name in names:
    rs = [p[name] for p in pair if "t_start" in p[name]]
    if len(rs) != 2:
        continue
    union = max(r["t_end"] for r in rs) - min(r["t_start"] for r in rs)
    overlap = max(0.0, min(r["t_end"] for r in rs) - max(r["t_start"] for r in rs))
    gbps = sum(r["bytes"] for r in rs) / union / 1e9
    line = (f"# two processes under MPS, {name}: {gbps:.2f} GB/s per direction together "
            f"(spans overlap {100 * overlap / union:.0f}%; per repetition, medians: "
            f"{rs[0]['gbps_median']:.2f}, {rs[1]['gbps_median']:.2f})")
    if name.startswith("ce-both@"):
        line += f"; world-2 bound {gbps / 2:.2f} GB/s busbw"
        if gbps / 2 > bound:
            bound = gbps / 2
            line += " (the bound of the rows below)"
    print(line)
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
