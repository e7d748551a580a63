"""Side-by-side table of `ipcreduce bench --json` runs that took turns (sourced by the GPU run
scripts, never imported).

Usage: python3 bench_table.py OUT_DIR NAME[=ANYTHING] ...
Reads OUT_DIR/bench-NAME-*.json (one file per round, any number of parts per round named
bench-NAME-ROUND[-PART].json) and prints, per mode (graph, eager), a markdown table: every
size's median over the rounds of the slowest rank's us per call, the rounds' [min-max], and the
ratio of each NAME's median to the first NAME's. Rows: the `auto` algorithm on plain buffers.
Ends with the wrong elements over every row of every file (the bench checks every call)."""
import glob
import json
import os
import statistics
import sys

out = sys.argv[1]
names = [a.split("=", 1)[0] for a in sys.argv[2:]]
rows = {}
for v in names:
    rows[v] = []
    for f in sorted(glob.glob(os.path.join(out, f"bench-{v}-*.json"))):
        rows[v].extend(json.load(open(f))["rows"])


def rounds(v, b, mode):
    return [r["time_us"] for r in rows[v]
            if r["bytes"] == b and r["mode"] == mode and not r["registered"] and r["algo"] == "auto"]


def fmt(x):
    return f"{x:.2f}" if x < 1000 else f"{x:.0f}"


sizes = sorted({r["bytes"] for v in names for r in rows[v]})
first = names[0]
print("# bf16 sum, two ranks under MPS on one GPU, us per call (slowest rank), median of the rounds")
print(f"# [min-max]; X/{first} < 1: X is faster than {first}")
print("# " + ", ".join(f"{v}: {len(glob.glob(os.path.join(out, f'bench-{v}-*.json')))} files" for v in names))
for mode in ("graph", "eager"):
    if not any(rounds(v, b, mode) for v in names for b in sizes):
        continue
    print()
    print(f"## {mode}")
    print()
    print("| size | " + " | ".join(names) + " | " + " | ".join(f"{v}/{first}" for v in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for b in sizes:
        cells, meds = [], []
        for v in names:
            c = rounds(v, b, mode)
            meds.append(statistics.median(c) if c else None)
            cells.append(f"{fmt(meds[-1])} [{fmt(min(c))}-{fmt(max(c))}]" if c else "-")
        ratios = ["-" if None in (m, meds[0]) else f"{m / meds[0]:.3f}" for m in meds[1:]]
        print(f"| {b} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
wrong = sum(r["wrong"] for v in names for r in rows[v])
print()
print(f"wrong elements over every row: {wrong}")
