"""Joins MPI's CSV and ipcreduce's JSON (scripts/host/mpi-compare.sh) into one markdown table."""
import json
import sys


def main(out, ranks):
    print("| ranks | bytes | MPI us | ipcreduce us | MPI busbw GB/s | ipcreduce busbw GB/s | speed-up | wrong (MPI/ipcreduce) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in ranks:
        mpi = {}
        with open(f"{out}/mpi-{r}.csv") as f:
            for line in f:
                b, us, alg, bus, wrong = line.strip().split(",")
                mpi[int(b)] = (float(us), float(bus), int(wrong))
        with open(f"{out}/ipcreduce-{r}.json") as f:
            rows = json.load(f)["rows"]
        for row in rows:
            b = row["bytes"]
            if b not in mpi:
                continue
            m_us, m_bus, m_wrong = mpi[b]
            print(f"| {r} | {b} | {m_us:.2f} | {row['time_us']:.2f} | {m_bus:.2f} | "
                  f"{row['busbw_gbps']:.2f} | {m_us / row['time_us']:.2f}x | {m_wrong}/{row['wrong']} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
