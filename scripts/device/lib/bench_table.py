"""Side-by-side table of `ipcreduce bench --json` runs that took turns (sourced by the GPU run
scripts, never imported).

Usage: python3 bench_table.py OUT_DIR NAME[=ANYTHING] ...
Reads OUT_DIR/bench-NAME-*.json (one file per round, any number of parts per round named
bench-NAME-ROUND[-PART].json) and prints, per mode (graph, eager), a markdown table: every
size's median over the rounds of the slowest rank's us per call, the rounds' [min-max], the
ratio of each NAME's median to the first NAME's, and the ratio of their best rounds: eager
rounds of small messages fall in two modes (about 2.5 or 4.5-5 us a call on one GPU under MPS)
in any binary, which moves a median by more than a few percent, while a machine's noise only
ever adds time. Rows: the `auto` algorithm on plain buffers.
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
print(f"# [min-max]; X/{first} < 1: X is faster than {first}; best: the ratio of the fastest rounds")
print("# " + ", ".join(f"{v}: {len(glob.glob(os.path.join(out, f'bench-{v}-*.json')))} files" for v in names))
for mode in ("graph", "eager"):
    if not any(rounds(v, b, mode) for v in names for b in sizes):
        continue
    print()
    print(f"## {mode}")
    print()
    ratio_names = [f"{v}/{first}" for v in names[1:]] + [f"{v}/{first} best" for v in names[1:]]
    print("| size | " + " | ".join(names) + " | " + " | ".join(ratio_names) + " |")
    print("|---" * (1 + len(names) + len(ratio_names)) + "|")

    def ratio(a, b):
        return "-" if None in (a, b) else f"{a / b:.3f}"

    for b in sizes:
        cells, meds, bests = [], [], []
        for v in names:
            c = rounds(v, b, mode)
            meds.append(statistics.median(c) if c else None)
            bests.append(min(c) if c else None)
            cells.append(f"{fmt(meds[-1])} [{fmt(min(c))}-{fmt(max(c))}]" if c else "-")
        ratios = [ratio(m, meds[0]) for m in meds[1:]] + [ratio(m, bests[0]) for m in bests[1:]]
        print(f"| {b} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
wrong = sum(r["wrong"] for v in names for r in rows[v])
print()
print(f"wrong elements over every row: {wrong}")
