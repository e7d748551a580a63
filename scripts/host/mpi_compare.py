"""Joins the runs of scripts/host/mpi-compare.sh: MPI's CSV and ipcreduce's JSON of every run.

Prints a markdown table per rank count (per size: both times as the median over the runs of
each run's median round; ours/MPI latency and ours/MPI busbw as min/median/max over the runs,
each ratio taken within one run; the run-to-run spread of our time), then the goals of issue
23 judged on the median ratio. Writes OUT/summary.json with every number printed.

Usage: python3 mpi_compare.py OUT RUNS RANKS...
"""
import json
import statistics
import sys


def load_mpi(path):
    rows = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            fields = line.strip().split(",")
            b, us, _alg, bus, wrong = fields[:5]
            lo, hi = (float(fields[5]), float(fields[6])) if len(fields) >= 7 else (float(us),) * 2
            rows[int(b)] = {"us": float(us), "busbw": float(bus), "wrong": int(wrong),
                            "min_us": lo, "max_us": hi}
    return rows


def load_ours(path):
    with open(path) as f:
        doc = json.load(f)
    return {r["bytes"]: {"us": r["time_us"], "busbw": r["busbw_gbps"], "wrong": r["wrong"],
                         "min_us": r["time_min_us"], "max_us": r["time_max_us"], "ran": r["ran"]}
            for r in doc["rows"]}


def spread(values):
    """(max - min) / median, as a fraction."""
    m = statistics.median(values)
    return (max(values) - min(values)) / m if m > 0 else float("inf")


def mmm(values):
    return [min(values), statistics.median(values), max(values)]


def size_text(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def main(out, runs, ranks):
    summary = {"runs": runs, "ranks": {}}
    goals = []
    for r in ranks:
        per_run = []
        for k in range(1, runs + 1):
            try:
                mpi = load_mpi(f"{out}/mpi-{r}-run{k}.csv")
                ours = load_ours(f"{out}/ipcreduce-{r}-run{k}.json")
            except (OSError, ValueError, KeyError) as e:
                print(f"- {r} ranks, run {k}: missing or unreadable ({e})")
                continue
            per_run.append((mpi, ours))
        if not per_run:
            continue
        sizes = sorted(set.intersection(*(set(m) & set(o) for m, o in per_run)))
        rows = []
        print(f"\n### {r} ranks ({len(per_run)} runs)\n")
        print("| bytes | auto ran | MPI us | ours us | ours/MPI latency min/med/max | "
              "ours/MPI busbw min/med/max | ours busbw GB/s | ours run-to-run spread | "
              "ours in-run spread | MPI run-to-run spread | wrong MPI/ours |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for b in sizes:
            m_us = [m[b]["us"] for m, _ in per_run]
            o_us = [o[b]["us"] for _, o in per_run]
            lat = [o / m for o, m in zip(o_us, m_us)]
            bw = [m / o for o, m in zip(o_us, m_us)]
            in_run = max((o[b]["max_us"] - o[b]["min_us"]) / o[b]["us"] for _, o in per_run)
            row = {
                "bytes": b,
                "ran": sorted({o[b]["ran"] for _, o in per_run}),
                "mpi_us": statistics.median(m_us),
                "ours_us": statistics.median(o_us),
                "latency_ratio": mmm(lat),
                "busbw_ratio": mmm(bw),
                "ours_busbw_gbps": statistics.median(o[b]["busbw"] for _, o in per_run),
                "ours_run_spread": spread(o_us),
                "ours_round_spread": in_run,
                "mpi_run_spread": spread(m_us),
                "wrong_mpi": sum(m[b]["wrong"] for m, _ in per_run),
                "wrong_ours": sum(o[b]["wrong"] for _, o in per_run),
            }
            rows.append(row)
            f3 = lambda v: "/".join(f"{x:.2f}" for x in v)  # noqa: E731
            print(f"| {size_text(b)} | {','.join(row['ran'])} | {row['mpi_us']:.2f} | "
                  f"{row['ours_us']:.2f} | {f3(row['latency_ratio'])} | {f3(row['busbw_ratio'])} | "
                  f"{row['ours_busbw_gbps']:.2f} | {row['ours_run_spread'] * 100:.0f}% | "
                  f"{row['ours_round_spread'] * 100:.0f}% | {row['mpi_run_spread'] * 100:.0f}% | "
                  f"{row['wrong_mpi']}/{row['wrong_ours']} |")
        summary["ranks"][str(r)] = rows

        def goal(name, sel, key, ok):
            picked = [x for x in rows if sel(x["bytes"])]
            if not picked:
                return
            worst = min(picked, key=lambda x: x[key][1]) if key == "busbw_ratio" else \
                max(picked, key=lambda x: x[key][1])
            met = all(ok(x[key][1]) for x in picked)
            goals.append({"ranks": r, "goal": name, "met": met, "worst_bytes": worst["bytes"],
                          "worst_median": worst[key][1], "worst_range": worst[key]})

        if r == 2:
            goal("no slower than MPI at <= 4 KiB (ours/MPI latency <= 1)",
                 lambda b: b <= 4096, "latency_ratio", lambda v: v <= 1.0)
            goal(">= 1.5x MPI's busbw from 512 KiB", lambda b: b >= 512 << 10,
                 "busbw_ratio", lambda v: v >= 1.5)
        if r == 4:
            goal("no slower than MPI at any size", lambda b: True,
                 "latency_ratio", lambda v: v <= 1.0)
        spreads = [x["ours_run_spread"] for x in rows]
        if spreads and len(per_run) > 1:
            w = max(rows, key=lambda x: x["ours_run_spread"])
            goals.append({"ranks": r, "goal": "our run-to-run spread <= 15%",
                          "met": max(spreads) <= 0.15, "worst_bytes": w["bytes"],
                          "worst_median": w["ours_run_spread"], "worst_range": None})
        wrong = sum(x["wrong_ours"] + x["wrong_mpi"] for x in rows)
        goals.append({"ranks": r, "goal": "0 wrong elements (MPI and ours)", "met": wrong == 0,
                      "worst_bytes": None, "worst_median": wrong, "worst_range": None})
    summary["goals"] = goals
    print("\n### Goals (judged on each size's median over the runs)\n")
    for g in goals:
        where = f" (worst: {size_text(g['worst_bytes'])}, {g['worst_median']:.2f}" \
                + (f", runs {'/'.join(f'{x:.2f}' for x in g['worst_range'])}" if g["worst_range"] else "") \
                + ")" if g["worst_bytes"] is not None else f" ({g['worst_median']})"
        print(f"- {g['ranks']} ranks: {g['goal']}: {'met' if g['met'] else '**missed**'}{where}")
    with open(f"{out}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [int(r) for r in sys.argv[3:]])
