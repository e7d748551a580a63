"""Summaries of scripts/host/mpi-compare.sh's first two phases.

crossover OUT RANKS...: one-shot against two-shot per size from `ipcreduce tune --backend host`
  (OUT/tune-R-runK.json), the median over the runs; the crossover is the largest size up to
  which one-shot wins at every size (what plan::HOST_ONESHOT_MAX holds per world).
library OUT RANKS...: `ipcreduce bench -a auto` against the library's own back-to-back loop
  (examples/host_loop.rs), run alternately: bench/library time per size, min/median/max over
  the runs (goal: within 10%), and bench's run-to-run spread (goal: <= 15%).
wait OUT RANKS...: `bench -a auto` per wait policy (OUT/wait-R-POLICY-runK.json): the median
  over the runs per size and policy, and the fastest policy per size.
Each writes OUT/<phase>.json.
"""
import glob
import json
import statistics
import sys


def crossover(out, ranks):
    result = {}
    for r in ranks:
        times = {}  # (bytes, algo) -> [us per run]
        for path in sorted(glob.glob(f"{out}/tune-{r}-run*.json")):
            with open(path) as f:
                for s in json.load(f)["samples"]:
                    times.setdefault((s["bytes"], s["algo"]), []).append(s["time_us"])
        sizes = sorted({b for b, _ in times})
        if not sizes:
            print(f"- {r} ranks: no tune samples")
            continue
        print(f"\n### one-shot against two-shot, {r} ranks (median of runs)\n")
        print("| bytes | oneshot us | twoshot us | twoshot/oneshot |")
        print("|---|---|---|---|")
        rows, limit = [], 0
        still_one = True
        for b in sizes:
            one = statistics.median(times.get((b, "oneshot"), [float("nan")]))
            two = statistics.median(times.get((b, "twoshot"), [float("nan")]))
            if still_one and one <= two:
                limit = b
            else:
                still_one = False
            rows.append({"bytes": b, "oneshot_us": one, "twoshot_us": two})
            print(f"| {b} | {one:.2f} | {two:.2f} | {two / one:.2f} |")
        print(f"\n- {r} ranks: one-shot wins up to {limit} B at every size "
              f"(plan::HOST_ONESHOT_MAX for this world)")
        result[str(r)] = {"rows": rows, "oneshot_max_bytes": limit}
    with open(f"{out}/crossover.json", "w") as f:
        json.dump(result, f, indent=1)


def library(out, ranks):
    result = {}
    for r in ranks:
        lib, ours = {}, {}
        for path in sorted(glob.glob(f"{out}/library-{r}-run*.csv")):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        b, med, _lo, _hi = line.strip().split(",")
                        lib.setdefault(int(b), []).append(float(med))
        for path in sorted(glob.glob(f"{out}/bench-{r}-run*.json")):
            with open(path) as f:
                for row in json.load(f)["rows"]:
                    ours.setdefault(row["bytes"], []).append(row["time_us"])
        sizes = sorted(set(lib) & set(ours))
        if not sizes:
            print(f"- {r} ranks: no library/bench pairs")
            continue
        print(f"\n### bench against the library's loop, {r} ranks\n")
        print("| bytes | library us | bench us | bench/library min/med/max | "
              "bench run-to-run spread |")
        print("|---|---|---|---|---|")
        rows = []
        for b in sizes:
            ratios = [o / l for o, l in zip(ours[b], lib[b])]
            med = statistics.median(ours[b])
            spread = (max(ours[b]) - min(ours[b])) / med
            rows.append({"bytes": b, "library_us": statistics.median(lib[b]), "bench_us": med,
                         "ratio": [min(ratios), statistics.median(ratios), max(ratios)],
                         "bench_spread": spread})
            print(f"| {b} | {statistics.median(lib[b]):.2f} | {med:.2f} | "
                  f"{min(ratios):.2f}/{statistics.median(ratios):.2f}/{max(ratios):.2f} | "
                  f"{spread * 100:.0f}% |")
        off = [x for x in rows if abs(x["ratio"][1] - 1) > 0.10]
        wide = [x for x in rows if x["bench_spread"] > 0.15]
        print(f"\n- {r} ranks: bench within 10% of the library at every size: "
              + ("met" if not off else "**missed** at " + ", ".join(str(x["bytes"]) for x in off)))
        print(f"- {r} ranks: bench's run-to-run spread <= 15%: "
              + ("met" if not wide else "**missed** at " + ", ".join(str(x["bytes"]) for x in wide)))
        result[str(r)] = rows
    with open(f"{out}/library.json", "w") as f:
        json.dump(result, f, indent=1)


def wait(out, ranks):
    result = {}
    for r in ranks:
        times = {}  # policy -> bytes -> [us]
        for path in sorted(glob.glob(f"{out}/wait-{r}-*-run*.json")):
            policy = path.rsplit("/", 1)[1][len(f"wait-{r}-"):].rsplit("-run", 1)[0]
            with open(path) as f:
                for row in json.load(f)["rows"]:
                    times.setdefault(policy, {}).setdefault(row["bytes"], []).append(
                        row["time_us"])
        if not times:
            print(f"- {r} ranks: no wait runs")
            continue
        policies = sorted(times, key=lambda p: (p != "default", p))
        sizes = sorted(set.intersection(*(set(times[p]) for p in policies)))
        print(f"\n### wait policies (SPIN_NS_YIELD_NS), {r} ranks, median us of runs\n")
        print("| bytes | " + " | ".join(policies) + " | fastest | default/fastest |")
        print("|---|" + "---|" * (len(policies) + 2))
        rows = []
        for b in sizes:
            med = {p: statistics.median(times[p][b]) for p in policies}
            best = min(med, key=med.get)
            rows.append({"bytes": b, "median_us": med, "fastest": best})
            print(f"| {b} | " + " | ".join(f"{med[p]:.2f}" for p in policies)
                  + f" | {best} | {med.get('default', float('nan')) / med[best]:.2f} |")
        result[str(r)] = rows
    with open(f"{out}/wait.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    phase, out, ranks = sys.argv[1], sys.argv[2], [int(r) for r in sys.argv[3:]]
    {"crossover": crossover, "library": library, "wait": wait}[phase](out, ranks)
