#!/usr/bin/env python3
"""The table of scripts/device/fused-ab.sh's results: per world, hidden and tokens, the old
build's fused time (median over rounds), the new build's, and the range of new/old over the
rounds (each round's new against the same round's old). Any wrong element is printed and
makes the exit status 1.

Usage: scripts/device/lib/fused_ab_table.py OUT_DIR
"""
import json
import pathlib
import re
import statistics
import sys


def main() -> int:
    out = pathlib.Path(sys.argv[1])
    runs = {}  # (world, version, round) -> {(hidden, tokens): row}
    for f in sorted(out.glob("bench-w*-*-r*.json")):
        m = re.fullmatch(r"bench-w(\d+)-(old|new)-r(\d+)\.json", f.name)
        if not m:
            continue
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        runs[(int(m[1]), m[2], int(m[3]))] = {(r["hidden"], r["tokens"]): r for r in rows}
    bad = 0
    print("| world | hidden | tokens | old (us) | new (us) | new / old | path |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for world in sorted({w for w, _, _ in runs}):
        rounds = sorted({r for w, v, r in runs if w == world and (w, "new", r) in runs
                         and (w, "old", r) in runs})
        if not rounds:
            continue
        shapes = sorted(runs[(world, "old", rounds[0])])
        for shape in shapes:
            old, new, ratio, path = [], [], [], "?"
            for r in rounds:
                o = runs[(world, "old", r)].get(shape)
                n = runs[(world, "new", r)].get(shape)
                if o is None or n is None:
                    continue
                for row, v in ((o, "old"), (n, "new")):
                    if row["wrong"]:
                        bad += 1
                        print(f"WRONG world {world} {shape} {v} round {r}: {row['wrong']}",
                              file=sys.stderr)
                old.append(o["fused_us"])
                new.append(n["fused_us"])
                ratio.append(n["fused_us"] / o["fused_us"])
                path = n["fused_path"]
            if not ratio:
                continue
            print(f"| {world} | {shape[0]} | {shape[1]} | {statistics.median(old):.2f} | "
                  f"{statistics.median(new):.2f} | {min(ratio):.3f}-{max(ratio):.3f} | {path} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
