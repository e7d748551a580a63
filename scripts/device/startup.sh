#!/usr/bin/env bash
# Start-up time on one GPU (ranks under MPS; one rank per GPU where there are enough): the time
# to the first checked all-reduce, cold and warm, at worlds 1, 2 and 8, with NCCL's beside.
# Builds nothing: expects target/release/ipcreduce.
#
# Usage: scripts/device/startup.sh OUT_DIR
#   cold      an empty kernel cache (IPCREDUCE_CACHE_DIR=OUT/cache-wN) and CUDA_CACHE_DISABLE=1
#             (no driver cache either): `bench --backend cuda --ranks N -b 8 -e 8 -n 2 -w 1
#             -a auto`, timed end to end (process start to exit), and the bench header's
#             start-up figures (init, first call: slowest rank, from its JSON)
#   warm      the same command REPEAT times on the cache the cold run filled (still
#             CUDA_CACHE_DISABLE=1: nothing but our cache helps)
#   graph     graph capture on a cold cache (fresh empty cache dirs): the start-up command with
#             `-G 4`, whose first call is then captured (its kernels compiled and loaded inside
#             the capture), and a sweep with `-G 4` of every dtype, auto, one-shot and two-shot,
#             plain and registered buffers (registered: the zero-copy paths), every call checked
#   nccl      torch.distributed NCCL (/opt/torch/.venv): init_process_group + a first 8 B
#             all-reduce + synchronize, per rank, end to end too (each rank its own NCCL_HOSTID
#             on one GPU, see docs/gpu-workflow.md: loopback sockets, a functional reference)
# Prints a table (startup.md) and the goals: cold <= 3 s at world 2 and <= 5 s at world 8, warm
# <= 0.5 s per rank (init + first call). summary.txt: one line per step; env.txt: GPU, driver,
# binary. Per-variant kernel log lines (compiled or read, ms) are in the step logs
# (IPCREDUCE_LOG=ipcreduce=info).
# Knobs: WORLDS="1 2 8", REPEAT=3, BUDGET=540, PHASES="cold warm graph nccl".
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: startup.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
BUDGET=${BUDGET:-540}
REPEAT=${REPEAT:-3}
WORLDS=${WORLDS:-1 2 8}
PHASES=${PHASES:-cold warm graph nccl}
TORCH_PY=${TORCH_PY:-/opt/torch/.venv/bin/python}
gpu_run_setup
# ipcreduce::phases: one line per rank with the time of each start-up phase.
export IPCREDUCE_LOG=ipcreduce=info,ipcreduce::phases=debug
TIMES="$OUT/times.txt"
: >"$TIMES"

env_txt "GPUs: $NGPU WORLDS=$WORLDS REPEAT=$REPEAT PHASES=$PHASES BUDGET=$BUDGET"
has() { [[ " $PHASES " == *" $1 "* ]]; }

# Worlds above the GPU count share GPUs: MPS (worlds 2 and 8 on one H200).
if [ "${NGPU:-0}" -lt 8 ]; then
  if ! mps_on; then
    echo "FAIL mps: the MPS control daemon did not start" | tee -a "$SUMMARY"
    exit 1
  fi
fi

# timed NAME LIMIT CMD...: `step`, with its wall time in milliseconds appended to TIMES as
# "NAME MS RC".
timed() {
  local name=$1 limit=$2 t0 t1 rc
  shift 2
  t0=$(date +%s%N)
  step "$name" "$limit" "$@"
  rc=$?
  t1=$(date +%s%N)
  echo "$name $(((t1 - t0) / 1000000)) $rc" >>"$TIMES"
  return $rc
}

bench_cmd() { # N JSON [more bench args]
  local n=$1 json=$2
  shift 2
  echo "$BIN" bench --backend cuda --ranks "$n" -b 8 -e 8 -n 2 -w 1 -a auto --json "$json" "$@"
}

for w in $WORLDS; do
  cache="$OUT/cache-w$w"
  if has cold; then
    rm -rf "$cache"
    # shellcheck disable=SC2046 # the command's words
    timed "cold-w$w" 120 env IPCREDUCE_CACHE_DIR="$cache" CUDA_CACHE_DISABLE=1 \
      $(bench_cmd "$w" "$OUT/cold-w$w.json")
    echo "cache-w$w files: $(find "$cache" -name '*.bin' 2>/dev/null | wc -l)" | tee -a "$OUT/cache-files.txt"
  fi
  if has warm; then
    for i in $(seq 1 "$REPEAT"); do
      # shellcheck disable=SC2046
      timed "warm-w$w-$i" 60 env IPCREDUCE_CACHE_DIR="$cache" CUDA_CACHE_DISABLE=1 \
        $(bench_cmd "$w" "$OUT/warm-w$w-$i.json")
    done
  fi
  if has graph; then
    # The bench's start-up call is then K calls captured in a graph: the process's first
    # kernel is compiled and loaded inside a stream capture.
    rm -rf "$OUT/cache-graph-first-w$w"
    # shellcheck disable=SC2046
    timed "graph-first-w$w" 120 env IPCREDUCE_CACHE_DIR="$OUT/cache-graph-first-w$w" \
      CUDA_CACHE_DISABLE=1 $(bench_cmd "$w" "$OUT/graph-first-w$w.json" -G 4)
    # Every path (one-shot, two-shot, LL, staged, zero-copy; every dtype) eager and in graphs,
    # all first used on a cold cache.
    rm -rf "$OUT/cache-graph-w$w"
    timed "graph-w$w" 240 env IPCREDUCE_CACHE_DIR="$OUT/cache-graph-w$w" CUDA_CACHE_DISABLE=1 \
      "$BIN" bench --backend cuda --ranks "$w" -b 8 -e 4M -f 16 -n 2 -w 1 -G 4 \
      -a auto,oneshot,twoshot -d all --registered --json "$OUT/graph-w$w.json"
  fi
done

if has nccl; then
  cat >"$OUT/nccl_startup.py" <<'EOF'
# torch.distributed NCCL: init_process_group + a first 8 B all-reduce, checked, per rank.
import json, os, sys, time
t_start = time.time()
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
ngpu = int(os.environ.get("NGPU", "1"))
if world > ngpu:
    # Ranks sharing a GPU: NCCL refuses them unless each believes it is on its own host.
    os.environ["NCCL_HOSTID"] = f"startup-host-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
import torch
import torch.distributed as dist
t_import = time.time()
torch.cuda.set_device(rank % ngpu)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank % ngpu))
t_init = time.time()
x = torch.full((2,), float(rank + 1), device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
t_first = time.time()
ok = bool((x == world * (world + 1) / 2).all())
out = {"rank": rank, "import_s": t_import - t_start, "init_s": t_init - t_import,
       "first_call_s": t_first - t_init, "ok": ok}
with open(os.path.join(sys.argv[1], f"nccl-w{world}-rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
EOF
  if [ -x "$TORCH_PY" ]; then
    for w in $WORLDS; do
      timed "nccl-w$w" 120 env NGPU="$NGPU" "$TORCH_PY" -m torch.distributed.run --standalone \
        --nproc_per_node="$w" "$OUT/nccl_startup.py" "$OUT"
    done
  else
    echo "SKIP nccl: no $TORCH_PY" | tee -a "$SUMMARY"
  fi
fi

python3 - "$OUT" "$WORLDS" >"$OUT/startup.md" <<'EOF' || status=1
import glob, json, os, statistics, sys
out, worlds = sys.argv[1], [int(w) for w in sys.argv[2].split()]
times = {}
for line in open(os.path.join(out, "times.txt")):
    name, ms, rc = line.split()
    times[name] = (int(ms) / 1000.0, int(rc))
def startup(path):
    try:
        return json.load(open(path))["meta"]["startup"]
    except Exception:
        return None
def e2e(name):
    t = times.get(name)
    if t is None:
        return "-"
    return f"{t[0]:.2f}" + ("" if t[1] == 0 else f" (exit {t[1]})")
def fig(s, key):
    return "-" if not s else f"{s[key]:.3f}"
print("# Start-up on one GPU (ranks under MPS), bench -b 8 -e 8 -n 2 -w 1 -a auto; seconds")
print("# e2e: process start to exit (launch, init, first checked call, table, teardown);")
print("# init / first: the bench header's (slowest rank); cold: empty cache dir +")
print("# CUDA_CACHE_DISABLE=1; warm: the cache the cold run filled (median of the runs)")
print()
print("| world | cold e2e | cold init | cold first call | warm e2e | warm init | warm first call | -G 4 cold: first call captured | -G 4 cold: every path | NCCL init | NCCL first call |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
goals = []
for w in worlds:
    cold = startup(os.path.join(out, f"cold-w{w}.json"))
    warm_runs = [startup(p) for p in sorted(glob.glob(os.path.join(out, f"warm-w{w}-*.json")))]
    warm_runs = [s for s in warm_runs if s]
    warm_e2e = [times[n][0] for n in times if n.startswith(f"warm-w{w}-") and times[n][1] == 0]
    def med(key):
        return "-" if not warm_runs else f"{statistics.median(s[key] for s in warm_runs):.3f}"
    nccl = [json.load(open(p)) for p in glob.glob(os.path.join(out, f"nccl-w{w}-rank*.json"))]
    n_init = "-" if not nccl else f"{max(r['init_s'] for r in nccl):.3f}"
    n_first = "-" if not nccl else f"{max(r['first_call_s'] for r in nccl):.3f}"
    we = "-" if not warm_e2e else f"{statistics.median(warm_e2e):.2f}"
    print(f"| {w} | {e2e(f'cold-w{w}')} | {fig(cold, 'init_s')} | {fig(cold, 'first_call_s')} | {we} | {med('init_s')} | {med('first_call_s')} | {e2e(f'graph-first-w{w}')} | {e2e(f'graph-w{w}')} | {n_init} | {n_first} |")
    limit = {2: 3.0, 8: 5.0}.get(w)
    if limit is not None and f"cold-w{w}" in times:
        t, rc = times[f"cold-w{w}"]
        goals.append((f"cold start to the first checked all-reduce, world {w} <= {limit} s (e2e)", rc == 0 and t <= limit, f"{t:.2f} s"))
    if warm_runs:
        per_rank = statistics.median(s["init_s"] + s["first_call_s"] for s in warm_runs)
        goals.append((f"warm, world {w}: init + first call <= 0.5 s per rank", per_rank <= 0.5, f"{per_rank:.3f} s"))
    if f"graph-first-w{w}" in times:
        goals.append((f"a first call captured in a graph on a cold cache, world {w}", times[f"graph-first-w{w}"][1] == 0, f"exit {times[f'graph-first-w{w}'][1]}"))
    if f"graph-w{w}" in times:
        goals.append((f"graph capture (-G 4) of every path on a cold cache, world {w}", times[f"graph-w{w}"][1] == 0, f"exit {times[f'graph-w{w}'][1]}"))
print()
for text, ok, got in goals:
    print(f"- {'met' if ok else 'MISSED'}: {text}: {got}")
EOF
# Where the warm start-up goes: each phase's median over runs of its slowest rank (the line of
# every rank's `init` and `cuda init`, from the warm step logs).
python3 - "$OUT" "$WORLDS" >"$OUT/phases.md" <<'EOF' || status=1
import glob, os, re, statistics, sys
out, worlds = sys.argv[1], [int(w) for w in sys.argv[2].split()]
line = re.compile(r"(cuda init|init) ([0-9.]+) s: (.*?) rank=(\d+)")
print("# Warm start-up phases (seconds; slowest rank of each run, median over runs)")
for w in worlds:
    runs = []
    for log in sorted(glob.glob(os.path.join(out, f"warm-w{w}-*.log"))):
        worst = {}
        for m in line.finditer(open(log, errors="replace").read()):
            what, total = m.group(1), float(m.group(2))
            parts = [p.rsplit(" ", 1) for p in m.group(3).split(", ") if " " in p]
            for name, t in [("total", total)] + [(n, float(v)) for n, v in parts]:
                key = f"{what}: {name}"
                worst[key] = max(worst.get(key, 0.0), t)
        if worst:
            runs.append(worst)
    if not runs:
        print(f"- world {w}: no phase lines")
        continue
    keys = list(runs[0])
    print(f"- world {w} ({len(runs)} runs): " + ", ".join(
        f"{k} {statistics.median(r.get(k, 0.0) for r in runs):.3f}" for k in keys))
EOF
cat "$OUT/startup.md"
cat "$OUT/phases.md"
cat "$OUT/cache-files.txt" 2>/dev/null
echo "== summary"
cat "$SUMMARY"
exit $status
