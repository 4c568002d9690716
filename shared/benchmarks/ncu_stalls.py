"""Summarises where the warps of a kernel wait, per SASS instruction, from Nsight Compute's source page.

    ncu --clock-control none -k regex:main_kernel --section SourceCounters \\
        --page source --print-source sass --csv python3 DRIVER.py > stalls.csv
    python3 shared/benchmarks/ncu_stalls.py stalls.csv [--top N]

For each profiled kernel in the file: its instruction count, the warp-stall samples taken while no instruction
issued, their shares by reason (barrier, long_sb = a global or local load, short_sb = shared memory or a
shuffle, wait = a fixed latency, ...), and the N instructions with the most such samples, each with its own
reasons. A long-scoreboard wait lands on the first instruction that reads the loaded register, a barrier wait
on the instruction after the barrier.
"""

import argparse
import csv

NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"


def kernels(rows: list[list[str]]):
    """(header, instruction rows) per kernel section of the CSV (each section starts with an "Address" header)."""
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Address"]
    for n, k in enumerate(starts):
        header = rows[k]
        end = starts[n + 1] if n + 1 < len(starts) else len(rows)
        yield header, [r for r in rows[k + 1:end] if len(r) == len(header)]


def reasons(header: list[str], row: list[str]) -> dict[str, float]:
    """Not-issued samples of one instruction by stall reason (columns "stall_<reason> (Not Issued)")."""
    out = {}
    for i, name in enumerate(header):
        if name.startswith("stall_") and name.endswith("(Not Issued)") and row[i] not in ("", "0"):
            out[name[len("stall_"):].split()[0]] = float(row[i])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    for n, (header, data) in enumerate(kernels(rows)):
        col, exe = header.index(NOT_ISSUED), header.index(EXECUTED)
        total = sum(float(r[col] or 0) for r in data)
        by_reason: dict[str, float] = {}
        for r in data:
            for k, v in reasons(header, r).items():
                by_reason[k] = by_reason.get(k, 0.0) + v
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(by_reason.items(), key=lambda x: -x[1]) if v)
        print(f"kernel {n}: {len(data)} instructions, {total:.0f} not-issued samples: {shares}")
        top = sorted(range(len(data)), key=lambda i: -float(data[i][col] or 0))[: args.top]
        for i in sorted(top):
            r = data[i]
            why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons(header, r).items(), key=lambda x: -x[1]))
            print(f"  {i:5d} {float(r[col] or 0):6.0f} {int(float(r[exe] or 0)):9d}  {r[1].strip()[:64]:64s} {why}")


if __name__ == "__main__":
    main()
