# shellcheck shell=bash disable=SC2034 # status, T and MPS_ON are read by the sourcing script
# Shared by the GPU run scripts (sourced, never run): a time budget, steps that run under
# `timeout` into OUT/NAME.log and report into summary.txt, and MPS started and stopped once.
# Source it as:  . "$(dirname "$0")/lib/steps.sh"
#
# The caller sets (before the functions run):
#   OUT      the output folder (absolute or relative to the current directory)
#   SUMMARY  the file `step` appends its lines to (the scripts use "$OUT/summary.txt")
#   BUDGET   seconds the whole script may take, counted from its start ($SECONDS); empty or
#            unset: no budget (a step runs for its own limit)
#   status   0 at the start; `step` sets it to 1 on a failed or skipped step

# gpu_run_setup: what a GPU run script does first, after setting OUT: makes OUT (absolute
# afterwards); puts CUDA's libraries on the path; never NVLink multicast; no tuning table of
# the machine's (IPCREDUCE_TUNE_FILE in OUT); counts the GPUs into NGPU; starts SUMMARY
# ("$OUT/summary.txt") empty and status at 0.
gpu_run_setup() {
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  # Never NVLink multicast.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export IPCREDUCE_TUNE_FILE="$OUT/no-tune.txt"
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  SUMMARY="$OUT/summary.txt"
  : >"$SUMMARY"
  status=0
}

# budget_left: prints the seconds left of BUDGET (a large number without a budget).
budget_left() {
  if [ -z "${BUDGET:-}" ]; then
    echo 1000000000
  else
    echo $((BUDGET - SECONDS))
  fi
}

# budget_allows SECONDS: true while more than SECONDS of the budget are left.
budget_allows() {
  [ "$(budget_left)" -gt "$1" ]
}

# budget_fits LIMIT [MIN]: sets T to LIMIT, cut at what is left of the budget; false (T
# unchanged) when fewer than MIN seconds (default 20) are left, too few for a step to say
# anything.
budget_fits() {
  local left
  left=$(budget_left)
  [ "$left" -ge "${2:-20}" ] || return 1
  T=$(($1 < left ? $1 : left))
}

# step NAME LIMIT CMD...: runs CMD into OUT/NAME.log under `timeout`, at most LIMIT seconds and
# never past the budget; appends one line to SUMMARY:
#   PASS NAME (S s): <the log's last line>
#   FAIL NAME (exit RC, S s): <the log's last line>     (then its first error lines)
#   SKIP NAME: out of time (S s of BUDGET)               (fewer than 20 s of the budget left)
# ("WARN" lines are not taken as the last line). Returns 0, 1 (failed) or 2 (skipped).
step() {
  local name=$1 limit=$2 t0 rc T
  shift 2
  if ! budget_fits "$limit"; then
    echo "SKIP $name: out of time ($SECONDS s of $BUDGET)" | tee -a "$SUMMARY"
    status=1
    return 2
  fi
  echo "== [$SECONDS s] $name"
  t0=$SECONDS
  timeout "$T" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "PASS $name ($((SECONDS - t0)) s): $(grep -v WARN "$OUT/$name.log" | tail -n 1)" | tee -a "$SUMMARY"
    return 0
  fi
  echo "FAIL $name (exit $rc, $((SECONDS - t0)) s): $(grep -v WARN "$OUT/$name.log" | tail -n 1)" | tee -a "$SUMMARY"
  grep -E "FAIL|error|panicked" "$OUT/$name.log" | head -n 5
  status=1
  return 1
}

# summary_json SUMMARY: the step lines of SUMMARY as JSON on stdout (a list of {outcome, step,
# line}), for tools that read a run's outcome.
summary_json() {
  python3 - "$1" <<'EOF'
import json, sys
steps = []
for line in open(sys.argv[1]):
    word, _, rest = line.partition(" ")
    steps.append({"outcome": word, "step": rest.split(" ")[0].rstrip(":"), "line": line.strip()})
print(json.dumps(steps, indent=1))
EOF
}

# env_txt LINE: writes OUT/env.txt (the date, the GPUs, their topology when NGPU >= 2, BIN's
# version, then LINE) and prints it. The caller sets OUT, BIN and NGPU.
env_txt() {
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
    [ "${NGPU:-0}" -ge 2 ] && nvidia-smi topo -m
    "$BIN" --version
    echo "$1"
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

# mps_answers: whether an MPS control daemon answers on CUDA_MPS_PIPE_DIRECTORY (bounded).
mps_answers() {
  echo get_server_list | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
}

# mps_on: starts the MPS control daemon (ranks that share a GPU run side by side under it,
# rather than time-sliced) with its pipe and log folders under /tmp, and stops it when the
# script exits. Fails (status 1, with a message) unless the daemon then answers: without MPS,
# worlds 4 and 8 on one GPU run time-sliced, which is another test. A daemon already running
# there is used as it is (and still stopped at exit). Callers: `mps_on || exit 1`.
# With MPS_ENV set to a file, appends "MPS: on" to it.
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  local rc=$?
  MPS_ON=1
  trap mps_off EXIT
  if ! mps_answers; then
    echo "error: the MPS control daemon did not start (nvidia-cuda-mps-control -d: exit $rc) or does not answer get_server_list" >&2
    return 1
  fi
  [ "$rc" -eq 0 ] || echo "note: nvidia-cuda-mps-control -d exit $rc, but a daemon answers: using it" >&2
  [ -z "${MPS_ENV:-}" ] || echo "MPS: on" >>"$MPS_ENV"
  return 0
}

# mps_off: stops the daemon mps_on started (nothing when it did not run), before a program that
# must run without MPS or starts its own; returns once the daemon no longer answers (at most
# 20 s), so that a daemon still exiting cannot make the next mps_on fail.
mps_off() {
  [ -n "${MPS_ON:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control
  MPS_ON=
  trap - EXIT
  local i
  for i in $(seq 1 100); do
    mps_answers || return 0
    sleep 0.2
  done
  echo "warning: the MPS control daemon still answers 20 s after quit" >&2
}
